"""`dflashkit bench decode [DIR]`: our speculative decoder vs the z-lab reference `dflash_generate`.

Usage:
    dflashkit bench decode -c run.yaml                       # drafter: train/final or export
    dflashkit bench decode runs/x/export target.path=smollm2-135m-instruct eval.num_prompts=4

Same target (verified in eval's dtype, `eval.dtype`: a bf16 verify where eval runs one, so the draft's
share of a target step is the share eval pays; the JSON's `dtype_reason` says why), drafter weights, prompts and block size (eval.block_sizes[0],
else the drafter's), in one run, prompt by prompt in turn (warm-up excluded): our baseline (block_size 1), our speculative
decoder, and the reference loop from PyPI `dflash==0.1.0` (its `DFlashDraftModel` loaded from the
same dir). Reports end-to-end tokens/s of each call, ours/reference ratio (goal ≥ 1.2), identical
tokens, τ, our t(1), t(B), and the bound τ·t(1)/t(B) next to the measured speedup (`unreliable`: why that speedup
cannot be true, `decode.metrics.timing_flags`; [] when nothing is found); `decode_step` puts t(1)
and t(B) against the memory floor (`sizing/step_cost.py`) for the packed target every decoder runs
(`eval.packed_weights`) and `decode_step_unpacked` for the same weights as transformers loads them.
With `eval.hybrid` the suffix proposer alone (`suffix`) and the hybrid at each gate of `eval.hybrid_gates`
(`hybrid`, keyed "B@gate", the graft "B@gate+graft") run in the same turns, each with its τ, speedup and share
of steps per branch, and `unreliable` where its timing cannot be true (printed as an unreliable measurement).
The reference only reports stats through `torch.cuda.synchronize`, so it runs without stats and is
timed here around the call. A DFlash2 drafter has no reference (PyPI `dflash` 0.1.0 predates it): the
bench then times our baseline against our walk-drafting decoder only (reference numbers 0 / null).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, cast

import torch

from dflashkit.decode.api import Decoder, GenerationResult, SamplingParams
from dflashkit.decode.evaluation import (decode_inputs, entries, flag_phrase, group_key, hybrid_decoders,
                                         load_checked_target, verify_dtype, verify_target_config)
from dflashkit.decode.metrics import compare, compare_flags, summarize_acceptance, summarize_timing
from dflashkit.decode.runner import draft_dtype_for, first_difference, params_for, run_interleaved
from dflashkit.decode.spec_decode import SpecDecoder
from dflashkit.sizing.step_cost import decode_step_report, roofline, step_times
from dflashkit.errors import UsageError
from dflashkit.export.hf import load_drafter
from dflashkit.target.load import announce, load_target

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


def _decoders(cfg: RunConfig, target: Any, drafter: Any, drafter_dir: Any, contract: Any,
              bs: int) -> dict[str, Decoder]:
    """The decoders the bench runs in turn: our baseline (block size 1) and speculative decoder, the module forward
    beside the lean one, the adaptive draft length (eval.adaptive_length) and the PyPI reference, where they apply."""
    baseline = SpecDecoder(target, None, 1, max_context=cfg.eval.max_context)
    ddt = draft_dtype_for(cfg, target)
    ours = SpecDecoder(target, drafter, bs, max_context=cfg.eval.max_context, draft_dtype=ddt)
    decoders: dict[str, Decoder] = {"baseline": baseline, "ours": ours}
    if ours._fast is not None:  # the module forward beside the lean one: same proposals, the draft's cost before
        decoders["ours-module"] = SpecDecoder(target, drafter, bs, max_context=cfg.eval.max_context, draft_dtype=ddt,
                                              lean=False)
    if cfg.eval.adaptive_length:
        decoders["ours-adaptive"] = SpecDecoder(target, drafter, bs, max_context=cfg.eval.max_context,
                                                draft_dtype=ddt, adaptive=True)
    if cfg.eval.hybrid:  # the suffix proposer alone and the hybrid grid (keys "suffix-4", "hybrid-4@2", "graft-4@4")
        decoders.update(hybrid_decoders(cfg, target, drafter, bs, ddt))
    if contract.family.decoding.reference_loop:  # the PyPI reference (dflash 0.1.0) decodes this family
        decoders["reference"] = ReferenceDecoder(target, str(drafter_dir), bs)
    return decoders


def _proposer_rows(runs: dict[str, list[GenerationResult]], base_t: dict[str, Any],
                   params: SamplingParams) -> dict[str, dict[str, Any]]:
    """`suffix` and `hybrid` rows (eval.hybrid): τ, speedup, tokens/s, identical tokens (greedy), gate and branch
    shares, `unreliable` where flagged."""
    keys = {k: v for k, v in runs.items() if group_key(k)[0] in ("suffix", "hybrid")}
    out: dict[str, dict[str, Any]] = {}
    for key, e in entries(keys, base_t).items():
        group, sub = group_key(key)
        row = {k: e[k] for k in ("tau", "speedup", "bound", "decode_tokens_per_s") if k in e}
        row.update({k: e[k] for k in ("gate", "branches", "unreliable") if k in e})
        row["identical_tokens"] = (all(a.token_ids == b.token_ids for a, b in zip(runs[key], runs["baseline"]))
                                   if params.temperature <= 0 else None)
        out.setdefault(group, {})[sub] = row
    return out


def _headline(runs: dict[str, list[GenerationResult]], base_t: dict[str, Any], ours_t: dict[str, Any],
              acc: dict[str, Any], cmp: dict[str, Any]) -> dict[str, Any]:
    """End-to-end tokens/s of each decoder, whether our tokens are the reference's, our τ and step times against
    the baseline's (`base_t`, `ours_t`, `acc`, `cmp`: decode.metrics' summaries of the runs): every bench's keys."""
    n_ours, s_ours = _e2e(runs["ours"])
    n_ref, s_ref = _e2e(runs.get("reference", []))
    n_base, s_base = _e2e(runs["baseline"])
    diffs = [first_difference(a.token_ids, b.token_ids) for a, b in zip(runs["ours"], runs.get("reference", []))]
    identical = all(d is None for d in diffs)
    tps = {k: round(n / s, 3) if s > 0 else 0.0 for k, n, s in
           (("baseline", n_base, s_base), ("ours", n_ours, s_ours), ("reference", n_ref, s_ref))}
    return {
        "tokens_per_s_e2e": tps,
        "ours_over_reference": round(tps["ours"] / tps["reference"], 4) if tps["reference"] else 0.0,
        "identical_tokens": identical if "reference" in runs else None,
        "first_difference": next(({"prompt": i, "position": d} for i, d in enumerate(diffs) if d is not None), None),
        "tau": acc["tau"], "tau_histogram": acc["tau_histogram"],
        "decode_tokens_per_s": {"baseline": base_t["decode_tokens_per_s"], "ours": ours_t["decode_tokens_per_s"]},
        "t1_ms": round(cmp["t1_s"] * 1e3, 3), "tB_ms": round(cmp["tB_s"] * 1e3, 3),
        "draft_ms": round(ours_t["draft_s_mean"] * 1e3, 3), "step_ms": round(ours_t["step_s_mean"] * 1e3, 3),
        "speedup": cmp["speedup"], "bound": cmp["bound"], "efficiency": cmp["efficiency"],
        "unreliable": compare_flags(cmp, acc["tau"]),  # why the speedup cannot be true ([]: nothing found)
        # the draft's cost against a target step at B (the verify of B tokens) and at 1 token
        "draft_share": round(ours_t["draft_s_mean"] / cmp["tB_s"], 4) if cmp["tB_s"] else None,
        "draft_share_t1": round(ours_t["draft_s_mean"] / cmp["t1_s"], 4) if cmp["t1_s"] else None,
    }


def _module_forward(runs: dict[str, list[GenerationResult]], ours: SpecDecoder, tB_s: float,
                    tau: float) -> dict[str, Any]:
    """The lean draft forward against the module forward, decoded in the same run (`module_forward`), and the lean
    forward's parts timed (`draft_profile_ms`)."""
    mod_t = summarize_timing(runs["ours-module"])
    same = all(a.token_ids == b.token_ids and a.acceptance_lengths == b.acceptance_lengths
               for a, b in zip(runs["ours"], runs["ours-module"]))
    assert ours._fast is not None
    return {"module_forward": {"draft_ms": round(mod_t["draft_s_mean"] * 1e3, 3),
                               "draft_share": round(mod_t["draft_s_mean"] / tB_s, 4) if tB_s else None,
                               "identical_decodes": same,  # tokens and accepted lengths, step by step
                               "decode_tokens_per_s": mod_t["decode_tokens_per_s"]},
            "draft_profile_ms": ours._fast.profile(context=256, new=max(1, round(tau)))}


def _adaptive(runs: dict[str, list[GenerationResult]], base_t: dict[str, Any], bs: int,
              params: SamplingParams) -> dict[str, Any]:
    """The adaptive draft length (eval.adaptive_length) against the baseline (`base_t`: its timing summary)."""
    ad_t = summarize_timing(runs["ours-adaptive"])
    ad_acc = summarize_acceptance(runs["ours-adaptive"], bs)
    ad_cmp = compare(base_t, ad_t, ad_acc["tau"])
    steps = sum(len(r.acceptance_lengths) for r in runs["ours-adaptive"])
    return {"tau": ad_acc["tau"], "speedup": ad_cmp["speedup"], "decode_tokens_per_s": ad_t["decode_tokens_per_s"],
            "drafts_per_step": round(sum(r.verified_drafts for r in runs["ours-adaptive"]) / max(1, steps), 4),
            # greedy only: sampled decodes draw other random streams, lossless or not
            "identical_tokens": all(a.token_ids == b.token_ids for a, b in
                                    zip(runs["ours-adaptive"], runs["baseline"]))
            if params.temperature <= 0 else None}


def _print_summary(result: dict[str, Any]) -> None:
    """The human-readable lines of a bench result (not printed with --json)."""
    tps = result["tokens_per_s_e2e"]
    identical = result["identical_tokens"] is not False  # without a reference nothing differs
    print(f"decode bench B={result['block_size']}, {result['prompts']} prompts × {result['max_new_tokens']} tokens, "
          f"{result['device']}, {result['dtype']} verify, {result['draft_dtype']} draft:\n"
          f"  tokens/s e2e: baseline {tps['baseline']:.1f}, ours {tps['ours']:.1f}, reference {tps['reference']:.1f}"
          f" (ours/reference {result['ours_over_reference']:.2f}, identical tokens: {identical})\n"
          f"  tau {result['tau']:.2f}; t(1) {result['t1_ms']:.1f} ms, t(B) {result['tB_ms']:.1f} ms, draft "
          f"{result['draft_ms']:.1f} ms; speedup {result['speedup']:.2f} vs bound {result['bound']:.2f} "
          f"(efficiency {result['efficiency']:.2f}); draft / target step at B {result['draft_share'] or 0:.1%}",
          flush=True)
    flags = result["unreliable"] + (result.get("decode_step") or {}).get("unreliable", [])
    if flags:
        print(f"  unreliable measurement ({'; '.join(flags)}): the machine was busy or a decoder was timed cold; "
              "this speedup is not a result, rerun on a quiet machine", flush=True)
    if "module_forward" in result:
        m = result["module_forward"]
        print(f"  draft: lean {result['draft_ms']:.2f} ms vs module forward {m['draft_ms']:.2f} ms "
              f"({m['draft_share'] or 0:.1%} of a target step; identical decodes: {m['identical_decodes']}); "
              f"lean parts (ms): {result['draft_profile_ms']}", flush=True)
    if "adaptive" in result:
        a = result["adaptive"]
        print(f"  adaptive draft length: tau {a['tau']:.2f}, speedup {a['speedup']:.2f}, "
              f"{a['drafts_per_step']:.2f} drafts verified per step", flush=True)
    rows = [(f"suffix B={k}", r) for k, r in (result.get("suffix") or {}).items()]
    rows += [(f"hybrid {k}", r) for k, r in (result.get("hybrid") or {}).items()]
    for name, r in rows:
        print(f"  {name}: tau {r['tau']:.2f}, speedup {r['speedup']:.2f}, {r['decode_tokens_per_s']:.1f} tok/s"
              + (f"; {flag_phrase(r['unreliable'])}" if r.get("unreliable") else ""), flush=True)


def bench_decode(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict[str, Any]:
    """The decode bench (module docstring): its result, with a summary printed on stdout unless --json."""
    inputs = decode_inputs(cfg, rd, ctx.positionals[1:], num_prompts=cfg.eval.num_prompts)
    drafter_dir, contract = inputs.drafter_dir, inputs.contract
    bs = (cfg.eval.block_sizes or [contract.block_size])[0]
    # verified in eval's dtype (`eval.dtype`; auto: target.dtype's), so the draft's share of a target step is the
    # one eval pays; the drafter and every prompt fit
    verify = announce(verify_dtype(cfg))
    target, ids = load_checked_target(cfg, inputs, verify_target_config(cfg, verify))
    params = params_for(cfg, target)
    drafter = load_drafter(drafter_dir, dtype=target.dtype, device=target.device)
    decoders = _decoders(cfg, target, drafter, drafter_dir, contract, bs)
    runs = run_interleaved(decoders, ids, params, warmup=max(1, cfg.eval.warmup), base_seed=cfg.run.seed)
    base_t, ours_t = summarize_timing(runs["baseline"]), summarize_timing(runs["ours"])
    acc = summarize_acceptance(runs["ours"], bs)
    cmp = compare(base_t, ours_t, acc["tau"])
    result = {
        "target": str(cfg.target.path), "drafter": str(drafter_dir), "drafter_type": contract.drafter_type,
        "block_size": bs, "prompts": len(ids),
        "max_new_tokens": params.max_new_tokens, "device": str(target.device), "threads": torch.get_num_threads(),
        "dtype": str(target.dtype).removeprefix("torch."), "dtype_reason": verify.reason,
        "draft_dtype": str(next(drafter.parameters()).dtype).removeprefix("torch."),
        **_headline(runs, base_t, ours_t, acc, cmp),
    }
    # the target step against this machine's memory floor, packed (what every decoder above ran) and as loaded
    result["decode_step"] = decode_step_report(target, [bs])
    if cfg.eval.packed_weights != "off":
        plain = load_target(verify_target_config(cfg, verify), announce_dtype=False)
        result["decode_step_unpacked"] = roofline(plain, step_times(plain, sorted({1, bs})))
        del plain
    if "ours-module" in runs:  # before / after of the lean forward, in the same run
        result.update(_module_forward(runs, cast(SpecDecoder, decoders["ours"]), cmp["tB_s"], acc["tau"]))
    if "ours-adaptive" in runs:
        result["adaptive"] = _adaptive(runs, base_t, bs, params)
    result.update(_proposer_rows(runs, base_t, params))
    if not ctx.json:
        _print_summary(result)
    return result
