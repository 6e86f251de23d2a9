"""Exact definitions of the numbers `eval`, `bench decode` and `report` print.

Usage:
    s = summarize_acceptance(results, block_size=16)   # τ mean, histogram, per-position acceptance
    t = summarize_timing(results)                      # tokens/s, per-step and per-token times
    bound = speedup_bound(tau, t1, tB)                 # τ·t(1)/t(B)
    p = paired_speed(drafter_results, lookup_results)  # ratio, 90% interval over prompts, prompts won
    flags = timing_flags(tau=1.34, speedup=2.14, bound=1.5, t1=0.04, tb=0.03)   # why it cannot be true ([] = none)

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
- Paired speed ratio of decoder A over decoder B (`paired_speed`) = B's decode time per token / A's, over the
  same prompts (decoded interleaved, prompt by prompt); its 90% interval resamples the prompts (paired
  bootstrap), so it holds both the prompts' spread and the timing noise; one containing 1 tells nothing apart.
- An unreliable measurement (`timing_flags`): a decoder commits at most τ̄ tokens per target step and a step over
  B tokens costs at least one over a single token, so a speedup above τ̄ (or above its bound) by more than
  `SPEEDUP_TOLERANCE`, or t(B) below t(1) by more than `TIME_NOISE`, means the decoders compared were timed
  under different conditions (a cold start, another job's burst): such a number is flagged, never a win.
"""

from __future__ import annotations

import math
from collections import Counter
from statistics import mean
from typing import Iterable

from dflashkit.decode.api import GenerationResult


SPEEDUP_TOLERANCE = 0.05  # a speedup this far above its τ̄ (or its bound τ̄·t(1)/t(B)) cannot be true
TIME_NOISE = 0.10         # t(B) this far below t(1) is not noise: the two were timed under other conditions


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


def timing_flags(*, tau: float = 0.0, speedup: float = 0.0, bound: float = 0.0, t1: float = 0.0, tb: float = 0.0,
                 tolerance: float = SPEEDUP_TOLERANCE, noise: float = TIME_NOISE) -> list[str]:
    """Why a measurement cannot be true, in words (empty: nothing found; see the module docstring): a speedup
    above τ̄ or above its bound τ̄·t(1)/t(B) by more than `tolerance`, t(B) below t(1) by more than `noise`, or a
    time, speedup or τ̄ that is not a finite number ≥ 0. A zero (missing) number is not checked."""
    vals = {"tau": tau, "speedup": speedup, "bound": bound, "t(1)": t1, "t(B)": tb}
    out = [f"{k} {v} is not a finite number >= 0" for k, v in vals.items() if not (math.isfinite(v) and v >= 0)]
    if out:
        return out
    if tau > 0 and speedup > tau * (1 + tolerance):
        out.append(f"speedup {speedup:.2f} above its tau {tau:.2f}")
    if bound > 0 and speedup > bound * (1 + tolerance):
        out.append(f"speedup {speedup:.2f} above its bound {bound:.2f}")
    if t1 > 0 and 0 < tb < t1 * (1 - noise):
        out.append(f"t(B) {tb * 1e3:.1f} ms below t(1) {t1 * 1e3:.1f} ms")
    return out


def compare_flags(cmp: dict, tau: float) -> list[str]:
    """`timing_flags` of a `compare` result (its speedup, bound, t(1) and t(B)) at τ̄ `tau`."""
    return timing_flags(tau=tau, speedup=cmp.get("speedup", 0.0), bound=cmp.get("bound", 0.0),
                        t1=cmp.get("t1_s", 0.0), tb=cmp.get("tB_s", 0.0))


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


def _decode_tokens(r: GenerationResult) -> int:
    return max(0, len(r.token_ids) - 1)


def paired_speed(a: list[GenerationResult], b: list[GenerationResult], *, reps: int = 2000,
                 seed: int = 0) -> dict:
    """How much faster decoder A decodes than B on the same prompts (result i of each = prompt i).

    Returns `ratio` (B's decode seconds per token / A's, summed over the prompts as `compare` sums them),
    `interval90` (5th and 95th percentiles of that ratio over `reps` resamplings of the prompts with
    replacement, the same indices for both decoders), `faster_prompts` (prompts on which A's time per
    token was lower) and `prompts`; `clear` is "a" or "b" when the whole interval lies on one side of 1 over
    two prompts or more, else None (not told apart: one prompt resamples to itself, so its interval has no width
    and says nothing of the next prompt)."""
    import numpy as np

    if len(a) != len(b):
        raise ValueError(f"paired_speed needs the same prompts: {len(a)} vs {len(b)} results")
    ta = np.array([r.decode_s for r in a], dtype=np.float64)
    tb = np.array([r.decode_s for r in b], dtype=np.float64)
    na = np.array([_decode_tokens(r) for r in a], dtype=np.float64)
    nb = np.array([_decode_tokens(r) for r in b], dtype=np.float64)

    def ratio(i: np.ndarray) -> np.ndarray:  # i: [..., n] prompt indices
        sa, sb = ta[i].sum(-1), tb[i].sum(-1)
        ca, cb = na[i].sum(-1), nb[i].sum(-1)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where((sa > 0) & (cb > 0), (sb / np.maximum(cb, 1)) / (sa / np.maximum(ca, 1)), 0.0)

    n = len(a)
    if n == 0:
        return {"ratio": 0.0, "interval90": [0.0, 0.0], "faster_prompts": 0, "prompts": 0, "clear": None}
    point = float(ratio(np.arange(n)))
    draws = ratio(np.random.default_rng(seed).integers(0, n, size=(reps, n)))
    lo, hi = (float(x) for x in np.percentile(draws, [5, 95]))
    per_a = np.where(na > 0, ta / np.maximum(na, 1), np.inf)
    per_b = np.where(nb > 0, tb / np.maximum(nb, 1), np.inf)
    return {"ratio": round(point, 4), "interval90": [round(lo, 4), round(hi, 4)],
            "faster_prompts": int((per_a < per_b).sum()), "prompts": n,
            "clear": None if n < 2 else "a" if lo > 1 else "b" if hi < 1 else None}


def paired_phrase(p: dict) -> str:
    """`paired_speed`'s result in words: "1.05x per token, 90% interval 0.98-1.12 over 8 prompts, faster on 6:
    not told apart" (or "clearly faster" / "clearly slower")."""
    lo, hi = p["interval90"]
    word = {"a": "clearly faster", "b": "clearly slower"}.get(p.get("clear") or "", "not told apart by this measurement")
    return (f"{p['ratio']:.2f}x per token, 90% interval {lo:.2f}-{hi:.2f} over {p['prompts']} prompts, faster on "
            f"{p['faster_prompts']}: {word}")
