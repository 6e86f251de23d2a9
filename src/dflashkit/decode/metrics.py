"""Exact definitions of the numbers `eval`, `bench decode` and `report` print.

Usage:
    s = summarize_acceptance(results, block_size=16)   # τ mean, histogram, per-position acceptance
    t = summarize_timing(results)                      # tokens/s, per-step and per-token times
    bound = speedup_bound(tau, t1, tB)                 # τ·t(1)/t(B)

Definitions (one place, used everywhere):
- τ (acceptance length) of one verify step = tokens committed by that step: the accepted drafts
  plus the target's own token (bonus or correction), so τ ∈ [1, B] (z-lab convention; a step cut
  short by a stop token or max_new_tokens counts what it committed). τ̄ = mean over steps.
- Per-position acceptance rate at draft position k (1..B−1) = fraction of verify steps whose τ
  exceeds k, i.e. drafts 1..k were all accepted.
- Decode time excludes prefill (time to first token); decode tokens/s = tokens after the first /
  decode time. End-to-end tokens/s includes prefill.
- Speedup = baseline decode time per token / speculative decode time per token (same target, same
  prompts, same run; the baseline is the same loop with block_size = 1).
- t(1) = mean baseline verify time (one target forward on one token, logits included); t(B) =
  mean target verify time on a block of B tokens, in the speculative run.
  Bound = τ̄·t(1)/t(B): the speedup if drafting and bookkeeping were free. Efficiency = measured speedup / bound.
"""

from __future__ import annotations

from collections import Counter
from statistics import mean
from typing import Iterable

from dflashkit.decode.api import GenerationResult


def tau_mean(lengths: Iterable[int]) -> float:
    vals = list(lengths)
    return float(mean(vals)) if vals else 0.0


def summarize_acceptance(results: list[GenerationResult], block_size: int) -> dict:
    """τ̄, τ histogram (index = τ, 1..B) and per-position acceptance (index 0 = draft position 1)."""
    lengths = [a for r in results for a in r.acceptance_lengths]
    counts = Counter(lengths)
    hist = [counts.get(t, 0) for t in range(1, block_size + 1)]
    n = len(lengths)
    per_pos = [sum(1 for a in lengths if a > k) / n if n else 0.0 for k in range(1, block_size)]
    return {"tau": round(tau_mean(lengths), 4), "steps": n, "tau_histogram": hist,
            "per_position_acceptance": [round(x, 4) for x in per_pos]}


def summarize_timing(results: list[GenerationResult]) -> dict:
    """Aggregate timings over prompts (warm-up already excluded by the caller)."""
    tokens = sum(len(r.token_ids) for r in results)
    decode_tokens = sum(max(0, len(r.token_ids) - 1) for r in results)
    prefill = sum(r.prefill_s for r in results)
    decode = sum(r.decode_s for r in results)
    verify = [t for r in results for t in r.verify_s]
    draft = [t for r in results for t in r.draft_s]
    steps = [t for r in results for t in r.step_s]
    return {
        "tokens": tokens,
        "prefill_s": round(prefill, 6),
        "decode_s": round(decode, 6),
        "ttft_s": round(prefill / len(results), 6) if results else 0.0,
        "decode_tokens_per_s": round(decode_tokens / decode, 3) if decode > 0 else 0.0,
        "e2e_tokens_per_s": round(tokens / (prefill + decode), 3) if prefill + decode > 0 else 0.0,
        "decode_s_per_token": decode / decode_tokens if decode_tokens else 0.0,
        "step_s_mean": mean(steps) if steps else 0.0,
        "verify_s_mean": mean(verify) if verify else 0.0,
        "draft_s_mean": mean(draft) if draft else 0.0,
    }


def speedup_bound(tau: float, t1: float, tb: float) -> float:
    """τ̄·t(1)/t(B) (see module docstring); 0 when a time is missing."""
    return tau * t1 / tb if t1 > 0 and tb > 0 else 0.0


def compare(baseline: dict, spec: dict, tau: float) -> dict:
    """Speedups of a speculative run over the baseline, with the bound from the same run."""
    base_tpt, spec_tpt = baseline["decode_s_per_token"], spec["decode_s_per_token"]
    speedup = base_tpt / spec_tpt if spec_tpt > 0 else 0.0
    base_e2e = baseline["prefill_s"] + baseline["decode_s"]
    spec_e2e = spec["prefill_s"] + spec["decode_s"]
    e2e = base_e2e / spec_e2e if spec_e2e > 0 else 0.0
    bound = speedup_bound(tau, baseline["verify_s_mean"], spec["verify_s_mean"])
    return {"speedup": round(speedup, 4), "speedup_e2e": round(e2e, 4), "bound": round(bound, 4),
            "efficiency": round(speedup / bound, 4) if bound > 0 else 0.0,
            "t1_s": round(baseline["verify_s_mean"], 6), "tB_s": round(spec["verify_s_mean"], 6)}
