"""What one target decode step costs on this machine, and what it would cost at the memory roofline.

Usage:
    t = step_times(target, [1, 4])            # {1: 0.041, 4: 0.043}: seconds per target forward of n tokens
    t0 = step_times_as_loaded(target, (1, 2, 4), context=300, reps=5)   # the same through DynamicCache
    r = roofline(target, t)                    # {"weight_bytes": …, "bandwidth_gb_s": …, "t1_roofline_s": …,
                                               #  "t1_share": 0.83, "t_ratio": {4: 1.05}}

A decode step of batch size 1 streams every weight once, whatever n (a few tokens): its floor is the
weights' bytes over the memory bandwidth, and a step over n ≤ B tokens costs about the same as one token when
the matrix products run at that floor. `step_times` measures the target's forward over n tokens after a short
context (a throwaway KV cache, rolled back after each timed forward; every n warmed up, then timed in turns, the
fastest of `reps`: `timing.py` `fastest_each`); `roofline` gives
the measured one-token step as a share of that floor (1.0 = at the floor) and t(n)/t(1). The bandwidth is a
large read-only pass (`memory_bandwidth`), read once per process. `step_times_as_loaded` times the same steps
through transformers' own layers and DynamicCache (append by concatenation, crop by slicing): `bench step` sets
the two side by side.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import torch
from transformers import DynamicCache

from dflashkit.decode.metrics import timing_flags
from dflashkit.decode.rollback import arm, rollback
from dflashkit.sizing.roofline import memory_bandwidth, weight_bytes
from dflashkit.target.kv_cache import decode_cache
from dflashkit.target.load import Target, cache_kwarg
from dflashkit.timing import fastest_each


@torch.inference_mode()
def step_times(target: Target, ns: list[int], *, context: int = 64, reps: int = 3,
               warmup: int = 2) -> dict[int, float]:
    """Seconds of one target forward over n tokens after `context` tokens, for each n: the fastest of `reps`, the
    sizes timed in turns after `warmup` forwards of each (`fastest_each`), so none is timed cold."""
    dev = target.device
    kw = cache_kwarg(target.model)
    vocab = int(target.vocab_size)
    ids = torch.arange(context, device=dev)[None] % max(vocab, 1)
    cache = decode_cache(target.config, capacity=context + max(ns, default=1))
    target.model(input_ids=ids, **{kw: cache}, use_cache=True, logits_to_keep=1)
    arm(cache, max(ns, default=1))  # exact rollback of recurrent layers too (decode/rollback.py)
    sizes = sorted({int(n) for n in ns})
    xs = {n: (torch.arange(n, device=dev)[None] + context) % max(vocab, 1) for n in sizes}
    steps = {n: partial(target.model, input_ids=xs[n], **{kw: cache}, use_cache=True) for n in sizes}
    return fastest_each(steps, dev, reps, warmup=warmup, after={n: partial(rollback, cache, n) for n in sizes})


def roofline(target: Target, times: dict[int, float], *, bandwidth: float | None = None) -> dict[str, Any]:
    """The measured step times against the memory floor: t1_share = floor / t(1) (1.0 = at the floor),
    t_ratio[n] = t(n) / t(1)."""
    bw = bandwidth if bandwidth is not None else memory_bandwidth(target.device.type)
    nbytes = weight_bytes(target.model)
    floor = nbytes / bw
    t1 = times.get(1)
    return {"weight_bytes": nbytes, "bandwidth_gb_s": round(bw / 1e9, 2), "t1_roofline_s": floor,
            "t_s": {int(n): t for n, t in times.items()},
            "t1_share": round(floor / t1, 3) if t1 else None,
            "t_ratio": {int(n): round(t / t1, 3) for n, t in times.items() if t1 and n != 1}}


def decode_step_report(target: Target, block_sizes: list[int]) -> dict[str, Any]:
    """Measure t(1) and t(B) for each block size, log them against the memory floor → `roofline`'s record, with
    `unreliable` (`decode.metrics.timing_flags`) when a t(B) is below t(1) beyond noise."""
    ns = sorted({1, *(int(b) for b in block_sizes)})
    r = roofline(target, step_times(target, ns, reps=5))
    t = r["t_s"]
    ratios = ", ".join(f"t({n})/t(1) {v:.2f}" for n, v in r["t_ratio"].items())
    log = logging.getLogger("dflashkit.eval")
    log.info("decode step: t(1) %.1f ms, %.0f%% of the memory floor (%.0f MB of weights at %.1f GB/s = %.1f ms)%s",
             t[1] * 1e3, 100 * (r["t1_share"] or 0), r["weight_bytes"] / 1e6, r["bandwidth_gb_s"],
             r["t1_roofline_s"] * 1e3, f"; {ratios}" if ratios else "")
    flags = [f for n in ns if n != 1 for f in timing_flags(t1=t[1], tb=t[n])]
    if flags:
        r["unreliable"] = flags
        log.warning("decode step: unreliable measurement (%s): the machine was busy while it was timed",
                    "; ".join(flags))
    return r


@torch.inference_mode()
def step_times_as_loaded(target: Any, ns: tuple[int, ...], context: int, reps: int) -> dict[int, float]:
    """t(n) through transformers' DynamicCache (append by concatenation, crop by slicing), the sizes timed in turns
    after a warm-up of each (`fastest_each`)."""
    kw = cache_kwarg(target.model)
    vocab = max(int(target.vocab_size), 1)
    cache = DynamicCache(config=target.config)
    target.model(input_ids=torch.arange(context)[None] % vocab, **{kw: cache}, use_cache=True, logits_to_keep=1)
    steps = {n: partial(target.model, input_ids=(torch.arange(n)[None] + context) % vocab, **{kw: cache},
                        use_cache=True) for n in ns}
    return fastest_each(steps, target.device, reps, after={n: partial(cache.crop, -n) for n in ns})
