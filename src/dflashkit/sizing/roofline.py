"""This machine's two ceilings, measured: memory bandwidth (what a decode step is bound by) and matrix-product
throughput (what a prefill or capture forward is bound by), and a model's weights and FLOPs against them.

Usage:
    bw = memory_bandwidth("cpu")                      # bytes/s read by a pass over a large tensor
    peak = matmul_throughput(torch.bfloat16, "cpu")   # FLOP/s of a [2048, 1024] x [1024, 2816] product
    nbytes = weight_bytes(model)                       # what one decode step streams
    flops = forward_flops_per_token(model, layers=12)  # 2 x the parameters of the first 12 layers
    share = achieved / peak                            # 1.0 = at the ceiling
    log_capture_roofline(target, tokens, seconds, plan=plan)  # a local capture's rate against the matmul ceiling

Each measurement is the fastest of a few repetitions after a warm-up (`dflashkit.timing`), cached per process.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import Any

import torch

from dflashkit.target.packed import PackedLinear
from dflashkit.timing import fastest

capture_log = logging.getLogger("dflashkit.capture")


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
    blocked weight instead of the unpacked one it may keep, `target.packed`)."""
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


def log_capture_roofline(target: Any, tokens: int, seconds: float, *, plan: Any) -> dict[str, Any] | None:
    """Log a local capture's rate against this machine's matrix-product throughput in the forward's dtype → the
    numbers (None for a mixture of experts, whose FLOPs per token the layer parameters do not give). `plan`: the
    capture's `data.capturing.CapturePlan` (its layer ids, whether it keeps the last layer, its autocast)."""
    layers = target.decoder_layers
    depth = len(layers) if plan.keep_last else max(plan.layer_ids) + 1
    flops = forward_flops_per_token(layers, depth)
    rate = tokens / max(seconds, 1e-9)
    if flops is None:
        capture_log.info("capture: %d tokens in %.0f s = %.0f tok/s", tokens, seconds, rate)
        return None
    dtype = plan.autocast or target.dtype
    peak = matmul_throughput(dtype, target.device.type,
                             k=target.hidden_size, n=int(getattr(target.config, "intermediate_size", 0) or
                                                         4 * target.hidden_size))
    share = flops * rate / peak
    capture_log.info("capture: %d tokens in %.0f s = %.0f tok/s; its matrix products run at %.1f GFLOP/s = %.0f%% of this "
             "machine's %s matmul throughput (%.1f GFLOP/s)", tokens, seconds, rate, flops * rate / 1e9,
             100 * share, str(dtype).removeprefix("torch."), peak / 1e9)
    return {"tokens_per_s": rate, "gflops": flops * rate / 1e9, "peak_gflops": peak / 1e9, "share": share}
