"""This machine's two ceilings, measured: memory bandwidth (what a decode step is bound by) and matrix-product
throughput (what a prefill or capture forward is bound by), and a model's weights and FLOPs against them.

Usage:
    bw = memory_bandwidth("cpu")                      # bytes/s read by a pass over a large tensor
    peak = matmul_throughput(torch.bfloat16, "cpu")   # FLOP/s of a [2048, 1024] x [1024, 2816] product
    nbytes = weight_bytes(model)                       # what one decode step streams
    flops = forward_flops_per_token(model, layers=12)  # 2 x the parameters of the first 12 layers
    share = achieved / peak                            # 1.0 = at the ceiling
    t = fastest(fn, device, reps=5)                    # the fastest of 5 calls after a warm-up, synchronised
    ts = fastest_each({1: step1, 4: step4}, device, reps=5)   # several sizes timed interleaved: {1: …, 4: …}

Each measurement is the fastest of a few repetitions after a warm-up, cached per process. Sizes compared with
each other (t(1) against t(B)) are timed by `fastest_each`: every one warmed up, then in turns, so a cold start,
a clock ramp or another job's burst falls on all of them alike instead of on the first one timed.
"""

from __future__ import annotations

import time
from functools import lru_cache
from typing import Callable, Hashable, Mapping, TypeVar

import torch

from dflashkit.model.packed import PackedLinear


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fastest(fn: Callable[[], object], device: torch.device, reps: int, *, warmup: int = 1,
            after: Callable[[], object] | None = None) -> float:
    """Seconds of the fastest of `reps` calls of `fn` after `warmup` untimed ones, synchronised on CUDA; `after`
    (untimed) runs after every call (e.g. a cache rollback)."""
    best = float("inf")
    for i in range(warmup + reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        if i >= warmup:
            best = min(best, time.perf_counter() - t0)
        if after is not None:
            after()
    return best


K = TypeVar("K", bound=Hashable)


def fastest_each(fns: Mapping[K, Callable[[], object]], device: torch.device, reps: int, *, warmup: int = 1,
                 after: Mapping[K, Callable[[], object]] | None = None,
                 clock: Callable[[], float] | None = None) -> dict[K, float]:
    """Seconds of the fastest of `reps` calls of each fn in `fns`, timed interleaved: `warmup` untimed rounds over
    every fn first, then `reps` rounds that call every fn once each, the order rotated by one per round (so no fn
    is always first after another). `after[k]` (untimed) runs after every call of `fns[k]`; `clock` (default:
    perf_counter after a CUDA synchronise on `device`) reads the time before and after each call."""
    keys = list(fns)
    if not keys:
        return {}

    def now() -> float:
        _sync(device)
        return time.perf_counter()

    tick = clock or now
    best = {k: float("inf") for k in keys}
    for r in range(warmup + max(1, reps)):
        shift = r % len(keys)
        for k in keys[shift:] + keys[:shift]:
            t0 = tick()
            fns[k]()
            dt = tick() - t0
            if r >= warmup:
                best[k] = min(best[k], dt)
            if after is not None and k in after:
                after[k]()
    return best


@lru_cache(maxsize=4)
def memory_bandwidth(device: str = "cpu", mib: int = 512, reps: int = 3) -> float:
    """Bytes per second read by a sum over a tensor far larger than the caches on `device` (a decode step
    reads its weights and writes little), the fastest of `reps`."""
    dev = torch.device(device)
    src = torch.ones(mib << 18, dtype=torch.float32, device=dev)  # mib MiB
    return src.numel() * src.element_size() / fastest(src.sum, dev, reps)


@lru_cache(maxsize=8)
def matmul_throughput(dtype: torch.dtype = torch.float32, device: str = "cpu", m: int = 2048, k: int = 1024,
                      n: int = 2816, reps: int = 3) -> float:
    """FLOP/s of an [m, k] x [k, n] product in `dtype` on `device` (a capture batch's shape), the fastest of
    `reps`."""
    dev = torch.device(device)
    a = torch.randn(m, k, device=dev).to(dtype)
    b = torch.randn(k, n, device=dev).to(dtype)
    return 2 * m * k * n / fastest(lambda: a @ b, dev, reps)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step streams: every parameter once (a tied embedding/head counted once; a packed layer's
    blocked weight instead of the unpacked one it may keep, `model.packed`)."""
    seen: set[int] = set()
    total = 0
    for mod in model.modules():
        if isinstance(mod, PackedLinear):
            total += mod.packed.numel() * mod.packed.element_size()
            if mod.weight is not None:
                seen.add(mod.weight.data_ptr())
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def forward_flops_per_token(layers: torch.nn.ModuleList, depth: int) -> int | None:
    """2 x the parameters of the first `depth` decoder layers (the matrix products of a forward that stops
    there; attention scores left out), or None for a mixture of experts (only the routed experts run)."""
    run = list(layers)[:depth]
    if any("expert" in name for layer in run for name, _ in layer.named_modules()):
        return None
    return 2 * sum(p.numel() for layer in run for p in layer.parameters())
