"""AdamW over the drafter's parameters and a cosine schedule with linear warmup.

Usage:
    opt = build_optimizer(drafter, cfg.train)
    sched = build_scheduler(opt, total_steps=1000, warmup_ratio=0.04, min_lr_ratio=0.0)

The learning rate of step s (0-based, the step about to be taken) is
    lr·(s+1)/W                                  for s < W = ceil(warmup_ratio·total)
    lr·(m + (1−m)·½(1 + cos(π·(s−W)/(total−W))))  afterwards (m = min_lr_ratio).
"""

from __future__ import annotations

import math

import torch


def build_optimizer(model: torch.nn.Module, train) -> torch.optim.AdamW:
    """AdamW (fp32 state) over trainable parameters only: the target's embedding/head stay frozen."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=train.lr, betas=tuple(train.betas), weight_decay=train.weight_decay,
                             eps=1e-8, foreach=False)


def lr_factor(step: int, total: int, warmup_ratio: float, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr at 0-based optimizer step `step`."""
    warm = math.ceil(warmup_ratio * total)
    if step < warm:
        return (step + 1) / warm
    rest = max(1, total - warm)
    progress = min(1.0, (step - warm) / rest)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(opt: torch.optim.Optimizer, *, total_steps: int, warmup_ratio: float,
                    min_lr_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, total_steps, warmup_ratio, min_lr_ratio))
