"""`dflashkit bench decode [DIR]`: our speculative decoder vs the z-lab reference `dflash_generate`.

Usage:
    dflashkit bench decode -c run.yaml                       # drafter: train/final or export
    dflashkit bench decode runs/x/export target.path=smollm2-135m-instruct eval.num_prompts=4

Same target, drafter weights, prompts and block size (eval.block_sizes[0], else the drafter's), in
one run, prompt by prompt in turn (warm-up excluded): our baseline (block_size 1), our speculative
decoder, and the reference loop from PyPI `dflash==0.1.0` (its `DFlashDraftModel` loaded from the
same dir). Reports end-to-end tokens/s of each call, ours/reference ratio (goal ≥ 1.2), identical
tokens, τ, our t(1), t(B), and the bound τ·t(1)/t(B) next to the measured speedup.
The reference only reports stats through `torch.cuda.synchronize`, so it runs without stats and is
timed here around the call. A DFlash2 drafter has no reference (PyPI `dflash` 0.1.0 predates it): the
bench then times our baseline against our walk-drafting decoder only (reference numbers 0 / null).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from dflashkit.decode.api import Decoder, GenerationResult, SamplingParams
from dflashkit.errors import UsageError

if TYPE_CHECKING:
    from dflashkit.config import RunConfig
    from dflashkit.context import StageContext
    from dflashkit.rundir import RunDir

log = logging.getLogger("dflashkit.bench")


class ReferenceDecoder:
    """The z-lab `dflash_generate` behind our `Decoder` protocol (timed end to end, no stats)."""

    def __init__(self, target: Any, drafter_dir: str, block_size: int):
        try:
            from dflash.model import DFlashDraftModel, dflash_generate
        except ImportError as e:
            raise UsageError(f"the reference package is not importable ({e})",
                             hint="pip install --no-deps dflash==0.1.0") from None
        self._generate = dflash_generate
        self.target, self.block_size = target, block_size
        self.model = DFlashDraftModel.from_pretrained(str(drafter_dir), dtype=target.dtype).to(target.device).eval()

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        import torch

        ids = torch.tensor([prompt_ids], device=self.target.device)
        t0 = time.perf_counter()
        out = self._generate(self.model, self.target.model, ids, params.max_new_tokens,
                             list(params.stop_token_ids) or None, temperature=params.temperature,
                             top_p=params.top_p, top_k=params.top_k, block_size=self.block_size)
        if self.target.device.type == "cuda":
            torch.cuda.synchronize()
        toks = out[0, len(prompt_ids):].tolist()
        stopped = bool(toks) and toks[-1] in params.stop_token_ids
        return GenerationResult(token_ids=toks, finish_reason="stop" if stopped else "length",
                                decode_s=time.perf_counter() - t0)


def _e2e(results: list[GenerationResult]) -> tuple[int, float]:
    return sum(len(r.token_ids) for r in results), sum(r.prefill_s + r.decode_s for r in results)


def bench_decode(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict[str, Any]:
    import torch

    from dflashkit.decode.evaluation import decode_inputs, load_checked_target
    from dflashkit.decode.metrics import compare, summarize_acceptance, summarize_timing
    from dflashkit.decode.runner import draft_dtype_for, first_difference, params_for, run_interleaved
    from dflashkit.decode.spec_decode import SpecDecoder
    from dflashkit.export.hf import load_drafter

    inputs = decode_inputs(cfg, rd, ctx.positionals[1:], num_prompts=cfg.eval.num_prompts)
    drafter_dir, contract = inputs.drafter_dir, inputs.contract
    bs = (cfg.eval.block_sizes or [contract.block_size])[0]
    target, ids = load_checked_target(cfg, inputs, cfg.target)  # the drafter and every prompt fit
    params = params_for(cfg, target)
    drafter = load_drafter(drafter_dir, dtype=target.dtype, device=target.device)
    baseline = SpecDecoder(target, None, 1, max_context=cfg.eval.max_context)
    decoders: dict[str, Decoder] = {
        "baseline": baseline,
        "ours": SpecDecoder(target, drafter, bs, max_context=cfg.eval.max_context,
                            draft_dtype=draft_dtype_for(cfg, target))}
    if contract.family.reference_loop:  # the PyPI reference (dflash 0.1.0) decodes this family
        decoders["reference"] = ReferenceDecoder(target, str(drafter_dir), bs)
    runs = run_interleaved(decoders, ids, params, warmup=max(1, cfg.eval.warmup), base_seed=cfg.run.seed)

    base_t, ours_t = summarize_timing(runs["baseline"]), summarize_timing(runs["ours"])
    acc = summarize_acceptance(runs["ours"], bs)
    cmp = compare(base_t, ours_t, acc["tau"])
    n_ours, s_ours = _e2e(runs["ours"])
    n_ref, s_ref = _e2e(runs.get("reference", []))
    n_base, s_base = _e2e(runs["baseline"])
    diffs = [first_difference(a.token_ids, b.token_ids) for a, b in zip(runs["ours"], runs.get("reference", []))]
    identical = all(d is None for d in diffs)
    tps = {k: round(n / s, 3) if s > 0 else 0.0 for k, n, s in
           (("baseline", n_base, s_base), ("ours", n_ours, s_ours), ("reference", n_ref, s_ref))}
    result = {
        "target": str(cfg.target.path), "drafter": str(drafter_dir), "drafter_type": contract.drafter_type,
        "block_size": bs, "prompts": len(ids),
        "max_new_tokens": params.max_new_tokens, "device": str(target.device), "threads": torch.get_num_threads(),
        "draft_dtype": str(next(drafter.parameters()).dtype).removeprefix("torch."),
        "tokens_per_s_e2e": tps,
        "ours_over_reference": round(tps["ours"] / tps["reference"], 4) if tps["reference"] else 0.0,
        "identical_tokens": identical if "reference" in runs else None,
        "first_difference": next(({"prompt": i, "position": d} for i, d in enumerate(diffs) if d is not None), None),
        "tau": acc["tau"], "tau_histogram": acc["tau_histogram"],
        "decode_tokens_per_s": {"baseline": base_t["decode_tokens_per_s"], "ours": ours_t["decode_tokens_per_s"]},
        "t1_ms": round(cmp["t1_s"] * 1e3, 3), "tB_ms": round(cmp["tB_s"] * 1e3, 3),
        "draft_ms": round(ours_t["draft_s_mean"] * 1e3, 3), "step_ms": round(ours_t["step_s_mean"] * 1e3, 3),
        "speedup": cmp["speedup"], "bound": cmp["bound"], "efficiency": cmp["efficiency"],
    }
    if not ctx.json:
        print(f"decode bench B={bs}, {len(ids)} prompts × {params.max_new_tokens} tokens, {result['device']}:\n"
              f"  tokens/s e2e: baseline {tps['baseline']:.1f}, ours {tps['ours']:.1f}, reference {tps['reference']:.1f}"
              f" (ours/reference {result['ours_over_reference']:.2f}, identical tokens: {identical})\n"
              f"  tau {acc['tau']:.2f}; t(1) {result['t1_ms']:.1f} ms, t(B) {result['tB_ms']:.1f} ms, draft "
              f"{result['draft_ms']:.1f} ms; speedup {cmp['speedup']:.2f} vs bound {cmp['bound']:.2f} "
              f"(efficiency {cmp['efficiency']:.2f})", flush=True)
    return result
