"""The GPU check's training parts: flex ≡ SDPA, bf16 steps on an 8B-shaped target, CPU ≡ GPU.

Usage (checks of `runner.CHECKS`; `ctx` is the runner's `CheckContext`):
    flex_vs_sdpa(ctx)      # one batch's loss and drafter gradients with drafter.attention sdpa vs flex
    bf16_steps(ctx)        # tokens/s, step time, peak memory: 1- and 5-layer drafters on a random Qwen3-8B
    cpu_equals_gpu(ctx)    # `fit` on the tiny target on the CPU and on the GPU: the same losses and weights

All three go through the trainer itself: `train.loop.setup` builds the Trainer from a run dir (contract +
tokenized shards, `fixtures.write_run`), `train_step` runs an optimizer step, `fit` a whole training. The one
direct call into the objective is `loss_and_grads` (`Trainer.micro_loss` on one micro-batch, the run's
`DraftLoss`): adapt it there when the objective's interface changes; `_with_loss` switches the loss's attention
and autocast dtype.

CPU halves (ctx.small): flex has no backward on the CPU (torch raises), so there the flex check compares the
losses only; the 8B and medium shapes become `fixtures.SMALL`; "CPU ≡ GPU" compares two CPU runs.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import statistics
import time
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from dflashkit.export.hf import load_drafter
from dflashkit.gpucheck.compare import (CPU_GPU, CPU_GPU_LR, FLEX_BF16, FLEX_FP32, close_losses, close_tensors,
                                        close_weights)
from dflashkit.gpucheck.fixtures import (MEDIUM, QWEN3_8B, SMALL, contract_for, random_target, tiny_target_dir,
                                         torch_device, train_config, write_run)
from dflashkit.gpucheck.runner import CheckContext, guarded, part, verdict
from dflashkit.target.load import text_config_dict
from dflashkit.rundir import RunDir
from dflashkit.train.logging import read_metrics
from dflashkit.train.loop import fit, setup, train_step
from dflashkit.train.optim import build_optimizer, build_scheduler
from dflashkit.train.parallel import DistInfo

log = logging.getLogger("dflashkit.gpucheck")
TINY_TOKENS = 259  # the tiny target's byte tokenizer: 256 bytes + 3 specials (rows above are unused)


def _trainer(cfg, run_dir, device: str, target=None):
    return setup(cfg, RunDir(run_dir), DistInfo(device=torch_device(device)), target=target)


def _first_batch(tr) -> tuple[Any, Any, Any]:
    """The trainer's first micro-batch, its anchors and the target's side of it (features)."""
    b = tr.batch(tr.plan.micro_batches(0, tr.dist.rank)[0])
    a = tr.anchors(b)
    return b, a, tr.target_outputs(b, a)


def _with_loss(tr, *, attention: str, amp: torch.dtype | None) -> None:
    """The trainer's loss (`train/loss.py` `DraftLoss`, frozen) with another attention and autocast dtype."""
    tr.loss = dataclasses.replace(tr.loss, attention=attention, amp=amp)


def loss_and_grads(tr, b, a, tout, *, grads: bool) -> tuple[float, dict[str, torch.Tensor] | None]:
    """The trainer's loss on one micro-batch and, with `grads`, the drafter's gradients (float32 copies).

    The check's one call into the objective (through `Trainer.micro_loss`, which holds every recipe knob)."""
    tr.drafter.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(grads):
        out = tr.micro_loss(b, a, None, tout)
    loss = float(out.loss.detach())
    if not grads:
        return loss, None
    out.loss.backward()
    got = {n: p.grad.detach().float().clone() for n, p in tr.drafter.named_parameters() if p.grad is not None}
    tr.drafter.zero_grad(set_to_none=True)
    return loss, got


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- 1. flex attention ≡ SDPA -----------------------------------------------------------------------------------
def _flex_cases(ctx: CheckContext) -> list[dict[str, Any]]:
    """The tiny target from disk (1-layer drafter, B = 4) and a random medium one (2 layers, B = 16, 1k tokens)."""
    tiny = tiny_target_dir(ctx.shared)
    cases = [{"name": "tiny", "target_path": tiny, "need_s": 15,
              "contract": contract_for(text_config_dict(tiny), block_size=4, num_draft_layers=1),
              "data": {"samples": 8, "seq_len": (48, 96), "token_range": TINY_TOKENS}, "anchors": 8}]
    shape = SMALL if ctx.small else MEDIUM
    cases.append({"name": f"medium ({shape['name']})", "target_path": "", "shape": shape, "need_s": 20,
                  "contract": contract_for(shape, block_size=4 if ctx.small else 16, num_draft_layers=2),
                  "data": {"samples": 4, "seq_len": (48, 96) if ctx.small else (896, 1024)},
                  "anchors": 8 if ctx.small else 64})
    return cases


def _compare_attention(tr, ctx: CheckContext, name: str, amp: torch.dtype | None, *, grads: bool,
                       batch=None) -> tuple[dict[str, Any], Any]:
    """sdpa vs flex on one batch of `tr` under `amp` → (the part's row, the batch)."""
    b, a, tout = batch or _first_batch(tr)
    res, secs = {}, {}
    for attention in ("sdpa", "flex"):
        _with_loss(tr, attention=attention, amp=amp)
        _sync(ctx.device)
        t0 = time.perf_counter()
        res[attention] = loss_and_grads(tr, b, a, tout, grads=grads)
        _sync(ctx.device)
        secs[attention] = round(time.perf_counter() - t0, 4)
    tol = FLEX_FP32 if amp is None else FLEX_BF16
    (l_sdpa, g_sdpa), (l_flex, g_flex) = res["sdpa"], res["flex"]
    loss = close_losses([l_flex], [l_sdpa], tol)
    row: dict[str, Any] = {"loss_sdpa": l_sdpa, "loss_flex": l_flex, "loss_rel": loss["max_rel"],
                           "loss_rtol": tol.loss_rtol, "sdpa_s": secs["sdpa"], "flex_s": secs["flex"]}
    ok = loss["ok"]
    if grads and g_sdpa is not None and g_flex is not None:
        g = close_tensors(g_flex, g_sdpa, rel=tol.grad_rel)
        ok = ok and g["ok"]
        row.update(grad_max_rel=g["max_rel"], grad_worst=g["worst"], grad_cosine=g["cosine"], grad_rel=tol.grad_rel)
    else:
        row["grads"] = "not compared: flex has no backward on the CPU"
    label = f"{name}, {'float32' if amp is None else 'bf16 autocast'}"
    return part(label, ok, **row), (b, a, tout)


def flex_vs_sdpa(ctx: CheckContext) -> dict[str, Any]:
    """drafter.attention=flex ≡ sdpa in the trainer's loss: the same batch's loss and gradients."""
    parts: list[dict[str, Any]] = []
    for i, case in enumerate(_flex_cases(ctx)):
        skip = ctx.no_time(case["need_s"])
        if skip:
            parts.append(part(case["name"], None, skip))
            continue
        parts += guarded(case["name"], partial(_flex_case, ctx, case, i))
        _free()
    return verdict(parts)


def _flex_case(ctx: CheckContext, case: dict[str, Any], i: int) -> list[dict[str, Any]]:
    grads = not ctx.small
    rd = write_run(ctx.work_dir / f"flex-{i}", case["contract"], **case["data"])
    keys = {"drafter.attention": "flex", "train.num_anchors": case["anchors"]}
    cfg = train_config(rd, device=ctx.device, target_path=case["target_path"], **keys)
    target = random_target(case["shape"], device=ctx.device, dtype=torch.float32) if "shape" in case else None
    tr = _trainer(cfg, rd, ctx.device, target)
    row, batch = _compare_attention(tr, ctx, case["name"], None, grads=grads)
    rows = [row, _compare_attention(tr, ctx, case["name"], torch.bfloat16, grads=grads, batch=batch)[0]]
    if "shape" in case and not ctx.small:
        compiled = train_config(rd, device=ctx.device, **keys, **{"train.compile": "true"})
        name = "medium, flex + train.compile, bf16 autocast vs eager sdpa"
        rows += guarded(name, lambda: [_compiled_flex(ctx, name, compiled, rd, target, tr, batch)])
    return rows


def _compiled_flex(ctx: CheckContext, name: str, compiled_cfg, rd, target, eager, batch) -> dict[str, Any]:
    """flex under `train.compile` (the fused kernel, what flex is for) ≡ eager SDPA, bf16, the same weights
    (`setup` seeds the drafter's init with run.seed, so both trainers start equal)."""
    skip = ctx.no_time(60)
    if skip:
        return part(name, None, skip)
    b, a, tout = batch
    _with_loss(eager, attention="sdpa", amp=torch.bfloat16)
    want, g_want = loss_and_grads(eager, b, a, tout, grads=True)
    tr = _trainer(compiled_cfg, rd, ctx.device, target)
    _with_loss(tr, attention="flex", amp=torch.bfloat16)
    t0 = time.perf_counter()
    got, g_got = loss_and_grads(tr, b, a, tout, grads=True)
    _sync(ctx.device)
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    loss_and_grads(tr, b, a, tout, grads=True)
    _sync(ctx.device)
    loss = close_losses([got], [want], FLEX_BF16)
    assert g_got is not None and g_want is not None
    g = close_tensors(g_got, g_want, rel=FLEX_BF16.grad_rel)
    return part(name, loss["ok"] and g["ok"], loss_sdpa=want, loss_flex=got, loss_rel=loss["max_rel"],
                grad_max_rel=g["max_rel"], grad_cosine=g["cosine"], compile_and_first_s=round(first_s, 2),
                compiled_s=round(time.perf_counter() - t0, 4))


# -- 2. bf16 steps on a random Qwen3-8B-shaped target ------------------------------------------------------------
def bf16_steps(ctx: CheckContext) -> dict[str, Any]:
    """bf16 autocast training steps with online target features: step time, tokens/s, peak memory."""
    shape = SMALL if ctx.small else QWEN3_8B
    sizes = {"warm": 1, "timed": 1, "batch": 2, "seq": 64, "anchors": 8, "block": 4} if ctx.small else \
        {"warm": 2, "timed": 5, "batch": 4, "seq": 2048, "anchors": 512, "block": 16}
    cuda = ctx.device.startswith("cuda")
    t0 = time.perf_counter()
    target = random_target(shape, device=ctx.device, dtype=torch.bfloat16)
    _sync(ctx.device)
    numbers: dict[str, Any] = {"target": shape["name"], "target_build_s": round(time.perf_counter() - t0, 2),
                               "target_gib": round(torch.cuda.memory_allocated() / 2**30, 2) if cuda else None,
                               **sizes}
    if cuda:
        try:
            numbers["sdpa_masked_gqa"] = sdpa_kernels(shape)
        except Exception as e:  # noqa: BLE001 - a diagnostic: the steps below still run
            numbers["sdpa_masked_gqa"] = f"probe failed: {type(e).__name__}: {e}"
    parts: list[dict[str, Any]] = []
    for layers in (1, 5):
        name = f"{layers}-layer drafter"
        skip = ctx.no_time(10 if ctx.small else 35)
        if skip:
            parts.append(part(name, None, skip))
            continue
        parts += guarded(name, partial(_bf16_part, ctx, name, shape, target, layers, sizes))
        _free()
    return verdict(parts, **numbers)


def _bf16_part(ctx: CheckContext, name: str, shape: dict[str, Any], target, layers: int,
               sizes: dict[str, int]) -> list[dict[str, Any]]:
    """Warm-up steps, then timed `train_step`s (synchronised), peak memory, the online features' share."""
    cuda = ctx.device.startswith("cuda")
    warm, timed, batch = sizes["warm"], sizes["timed"], sizes["batch"]
    contract = contract_for(shape, block_size=sizes["block"], num_draft_layers=layers)
    rd = write_run(ctx.work_dir / f"bf16-{layers}", contract, samples=(warm + timed) * batch + 1,
                   seq_len=sizes["seq"])
    keys: dict[str, Any] = {"target.dtype": "bfloat16", "train.dtype": "bfloat16", "train.batch_size": batch,
                            "train.num_anchors": sizes["anchors"], "train.max_steps": warm + timed,
                            "train.heldout_samples": 1, "train.lr": 0.0006}
    cfg = train_config(rd, device=ctx.device, **keys)
    tr = _trainer(cfg, rd, ctx.device, target)
    opt = build_optimizer(tr.drafter, cfg.train)
    sched = build_scheduler(opt, total_steps=warm + timed, warmup_ratio=0.0, min_lr_ratio=0.0)
    start_gib = None
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        start_gib = round(torch.cuda.memory_allocated() / 2**30, 2)  # the target + the drafter
    times, losses, tokens, blocks = [], [], 0, 0
    for step in range(warm + timed):
        _sync(ctx.device)
        ts = time.perf_counter()
        m = train_step(tr, step, opt, sched)
        _sync(ctx.device)
        losses.append(m["loss"])
        if step >= warm:
            times.append(time.perf_counter() - ts)
            tokens, blocks = tokens + m["tokens"], blocks + m["blocks"]
    peak = round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None
    b = tr.batch(tr.plan.micro_batches(0, 0)[0])
    feat_s = []
    for _ in range(3):
        _sync(ctx.device)
        ts = time.perf_counter()
        tr.target_outputs(b)
        _sync(ctx.device)
        feat_s.append(time.perf_counter() - ts)
    step_s, features_s = statistics.median(times), statistics.median(feat_s)
    finite = all(math.isfinite(x) for x in losses)
    return [part(name, finite, None if finite else "a loss is not finite",
                 step_s=round(step_s, 4), step_s_each=[round(x, 4) for x in times],
                 tokens_per_s=round(tokens / sum(times), 1), anchors_per_s=round(blocks / sum(times), 1),
                 features_s=round(features_s, 4), features_share=round(features_s / step_s, 3),
                 peak_memory_gib=peak, allocated_before_steps_gib=start_gib,
                 drafter_params_m=round(sum(p.numel() for p in tr.drafter.parameters()) / 1e6, 3),
                 target_layer_ids=list(contract.target_layer_ids), losses=[round(x, 4) for x in losses],
                 warmup_steps=warm, timed_steps=timed)]


def sdpa_kernels(shape: dict[str, Any]) -> dict[str, str]:
    """Which fused CUDA SDPA kernels take the drafter's masked attention (bf16, the shape's heads), with grouped
    K/V (`enable_gqa`) and with K/V repeated per head (what `model.drafter.block_attention` does on CUDA)."""
    heads, kv, d = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, heads, 256, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, kv, 384, d, device="cuda", dtype=torch.bfloat16, generator=g)
    mask = torch.rand(1, 1, 256, 384, device="cuda", generator=g) < 0.5
    mask[..., 0] = True
    out = {}
    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
        for form, (kk, gqa) in {"grouped": (k, True), "repeated": (k.repeat_interleave(heads // kv, 1), False)}.items():
            try:
                with sdpa_kernel([getattr(SDPBackend, name)]):
                    F.scaled_dot_product_attention(q, kk, kk, attn_mask=mask, enable_gqa=gqa)
                torch.cuda.synchronize()
                out[f"{name.lower()}, {form} K/V"] = "ok"
            except Exception as e:  # noqa: BLE001 - a refusal is the answer here
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                out[f"{name.lower()}, {form} K/V"] = f"refused: {first[:160]}"
    return out


# -- 3. CPU ≡ GPU ------------------------------------------------------------------------------------------------
def _fit_run(ctx: CheckContext, where: str, tag: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """`fit` on the tiny target on `where` (float32, 4 steps; 2 in the CPU halves) → the metrics rows' losses, the
    final weights."""
    tiny = tiny_target_dir(ctx.shared)
    contract = contract_for(text_config_dict(tiny), block_size=4, num_draft_layers=1)
    rd = write_run(ctx.work_dir / f"fit-{tag}", contract, samples=12, seq_len=(48, 96), token_range=TINY_TOKENS)
    cfg = train_config(rd, device=where, target_path=tiny, **{"train.lr": CPU_GPU_LR,
                                                              "train.max_steps": 2 if ctx.small else 4})
    fit(cfg, RunDir(rd), show_bar=False)
    run = RunDir(rd)
    losses = [float(r["loss"]) for r in read_metrics(run) if "loss" in r]
    return losses, load_drafter(run.final_dir).state_dict()


def cpu_equals_gpu(ctx: CheckContext) -> dict[str, Any]:
    """The same `fit` (seed, data, 4 steps, float32, TF32 off) on the CPU and on `ctx.device`."""
    default = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # float32 products in float32, not TF32 (torch's default too)
    try:
        cpu_losses, cpu_w = _fit_run(ctx, "cpu", "cpu")
        skip = ctx.no_time(10)
        if skip:
            return verdict([part("fit on the GPU", None, skip)])
        dev_losses, dev_w = _fit_run(ctx, ctx.device, "device")
    finally:
        torch.set_float32_matmul_precision(default)
    losses = close_losses(dev_losses, cpu_losses, CPU_GPU)
    weights = close_weights(dev_w, cpu_w, atol=CPU_GPU.weight_atol)
    note = {} if ctx.device.startswith("cuda") else {"note": "no CUDA: two CPU runs (the comparison's own check)"}
    return verdict([part("losses, step by step (train rows, then the held-out row)", losses.pop("ok"), **losses),
                    part("final drafter weights", weights.pop("ok"), **weights)],
                   float32_matmul_precision_default=default, **note)
