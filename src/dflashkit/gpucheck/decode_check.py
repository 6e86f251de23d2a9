"""The GPU check's decoder part: `SpecDecoder`'s greedy output ≡ the baseline (block size 1), with τ and step times.

Usage:
    decoder_equals_baseline(ctx)    # a check of `runner.CHECKS`

Targets: the tiny target loaded from disk (`load_target`, float32), and a random Qwen3-8B-shaped target
(`fixtures.random_target`) in bf16, then the same weights upcast to float32 (bf16 values are exact in
float32, so both dtypes judge one model). Proposers at block size B: a random DFlash drafter with the
target's own attention widths (real drafter passes on the GPU; its drafts are mostly rejected, so this tests
the reject path and the draft KV cache), and `CopyTargetProposer` (the target's own greedy continuation:
every draft accepted on a full step, so the multi-token accept and the KV-cache crop run). Each output is
compared with the baseline's by `decode/lossless.py` (exact in float32; in bf16 a divergence must be a
numerical tie, within the tie tolerance); τ (`summarize_acceptance`) and per-step times
(`summarize_timing`, CUDA-synchronised in `SpecDecoder`, a warm-up generation first) are reported.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import numpy as np
import torch

from dflashkit.config import load_config
from dflashkit.decode.api import SamplingParams
from dflashkit.decode.lossless import TOP_K, first_divergence, lossless_verdict, tie_rule
from dflashkit.decode.metrics import summarize_acceptance, summarize_timing
from dflashkit.decode.spec_decode import SpecDecoder
from dflashkit.gpucheck.fixtures import QWEN3_8B, SMALL, random_target, tiny_target_dir
from dflashkit.gpucheck.runner import CheckContext, guarded, part, verdict
from dflashkit.testing import CopyTargetProposer, random_drafter

log = logging.getLogger("dflashkit.gpucheck")
BLOCK = 4


def _prompts(n: int, lo: int, hi: int, top: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng([seed, 23])
    return [rng.integers(0, top, int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)]


def _drafter(target):
    """A random 1-layer drafter with the target's attention and MLP widths (2 target features)."""
    c = target.config
    heads = int(c.num_attention_heads)
    return random_drafter(target, block_size=BLOCK, layers=1, num_attention_heads=heads,
                          num_key_value_heads=int(getattr(c, "num_key_value_heads", heads)),
                          head_dim=int(getattr(c, "head_dim", None) or target.hidden_size // heads),
                          intermediate_size=int(c.intermediate_size))


def decode_parts(name: str, target, *, prompts: list[list[int]], new_tokens: int) -> list[dict[str, Any]]:
    """Baseline, drafter and copy-target decoders on `prompts`: one row each (verdict, τ, step times)."""
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, stop_token_ids=())
    warm = SamplingParams(temperature=0.0, max_new_tokens=4, stop_token_ids=())
    base = SpecDecoder(target, None, 1, record_top=TOP_K)
    base.generate(prompts[0], warm)
    want = [base.generate(p, params) for p in prompts]
    t = summarize_timing(want)
    rows = [part(f"{name}: baseline (block size 1)", True, tokens=t["tokens"], step_s_mean=t["step_s_mean"],
                 decode_tokens_per_s=t["decode_tokens_per_s"])]
    rule = tie_rule(target.dtype)
    for label, dec in (("random drafter", SpecDecoder(target, _drafter(target), BLOCK)),
                       ("copy-target proposer", SpecDecoder(target, None, BLOCK, proposer=CopyTargetProposer(target)))):
        dec.generate(prompts[0], warm)
        got = [dec.generate(p, params) for p in prompts]
        v = lossless_verdict([first_divergence(g, w) for g, w in zip(got, want)], rule)
        acc, tim = summarize_acceptance(got, BLOCK), summarize_timing(got)
        same = sum(g.token_ids == w.token_ids for g, w in zip(got, want))
        rows.append(part(f"{name}: {label}, B={BLOCK}", v["verdict"] != "not lossless",
                         None if v["verdict"] != "not lossless" else "an output diverges where the target "
                         "clearly preferred its own token", verdict=v["verdict"], identical=f"{same}/{len(got)}",
                         ties=v["ties"], max_tie_gap=v["max_tie_gap"], min_non_tie_gap=v["min_non_tie_gap"],
                         tolerance=v["tolerance"], tau=acc["tau"], steps=acc["steps"],
                         per_position_acceptance=acc["per_position_acceptance"], step_s_mean=tim["step_s_mean"],
                         draft_s_mean=tim["draft_s_mean"], verify_s_mean=tim["verify_s_mean"],
                         decode_tokens_per_s=tim["decode_tokens_per_s"]))
    return rows


def decoder_equals_baseline(ctx: CheckContext) -> dict[str, Any]:
    """Greedy SpecDecoder ≡ block size 1 on the tiny target (float32) and an 8B-shaped one (bf16, float32)."""
    new, n = (8, 2) if ctx.small else (32, 3)
    parts = guarded("tiny float32", partial(_tiny, ctx, n, new))
    shape = SMALL if ctx.small else QWEN3_8B
    skip = ctx.no_time(10 if ctx.small else 45)
    if skip:
        return verdict(parts + [part(shape["name"], None, skip)])
    parts += guarded(shape["name"], partial(_big, ctx, shape, n, new))
    return verdict(parts)


def _tiny(ctx: CheckContext, n: int, new: int) -> list[dict[str, Any]]:
    from dflashkit.target.load import load_target

    tiny = load_config(None, [f"target.path={tiny_target_dir(ctx.shared)}", f"target.device={ctx.device}",
                              "target.dtype=float32"]).target
    return decode_parts("tiny float32", load_target(tiny), prompts=_prompts(n, 12, 40, 259), new_tokens=new)


def _big(ctx: CheckContext, shape: dict[str, Any], n: int, new: int) -> list[dict[str, Any]]:
    """The 8B-shaped target in bf16, then its weights upcast to float32 (the same model, judged exactly)."""
    big = random_target(shape, device=ctx.device, dtype=torch.bfloat16)
    prompts = _prompts(n, 16, 64, min(int(shape["vocab_size"]), 32000))
    rows = decode_parts(f"{shape['name']} bf16", big, prompts=prompts, new_tokens=new)
    skip = ctx.no_time(10 if ctx.small else 40)
    if skip:
        return rows + [part(f"{shape['name']} float32", None, skip)]
    big.model.float()
    big.dtype = torch.float32
    return rows + decode_parts(f"{shape['name']} float32", big, prompts=prompts, new_tokens=new)
