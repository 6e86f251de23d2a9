"""The drafter's optimizer (AdamW, or Muon for 2-D weights + AdamW) and a cosine schedule with warmup.

Usage:
    opt = build_optimizer(drafter, cfg.train)          # train.optimizer: adamw | muon
    sched = build_scheduler(opt, total_steps=1000, warmup_ratio=0.04, min_lr_ratio=0.0)

The learning rate of step s (0-based, the step about to be taken) is
    lr·(s+1)/W                                  for s < W = ceil(warmup_ratio·total)
    lr·(m + (1−m)·½(1 + cos(π·(s−W)/(total−W))))  afterwards (m = min_lr_ratio).
"""

from __future__ import annotations

import math

import torch


def build_optimizer(model: torch.nn.Module, train) -> torch.optim.Optimizer:
    """`train.optimizer` over trainable parameters only (the target's embedding/head stay frozen):
    AdamW (fp32 state), or Muon for the 2-D weights + AdamW for the rest (`MuonAdamW`)."""
    params = [p for p in model.parameters() if p.requires_grad]
    kind = getattr(train, "optimizer", "adamw")
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=train.lr, betas=tuple(train.betas), weight_decay=train.weight_decay,
                                 eps=1e-8, foreach=False)
    matrices, rest = muon_split(model)
    muon = torch.optim.Muon(matrices, lr=train.lr, weight_decay=train.weight_decay, momentum=train.muon_momentum,
                            adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW(rest or [torch.nn.Parameter(torch.zeros(1))], lr=train.lr, betas=tuple(train.betas),
                              weight_decay=train.weight_decay, eps=1e-8, foreach=False)
    return MuonAdamW(muon, adamw)


def lr_factor(step: int, total: int, warmup_ratio: float, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr at 0-based optimizer step `step`."""
    warm = math.ceil(warmup_ratio * total)
    if step < warm:
        return (step + 1) / warm
    rest = max(1, total - warm)
    progress = min(1.0, (step - warm) / rest)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class CpuBudget:
    """A training budget in process CPU seconds (`time.process_time`: every thread of this process).

    `total_steps()` is the number of steps the budget affords at the mean CPU cost of the steps
    measured so far (capped by the configured steps; the cap itself before the first step), so the
    schedule's cosine ends where the budget does whatever a variant's step costs; `spent()` says
    when to stop. Only optimizer steps are charged (held-out evaluations are measurement)."""

    def __init__(self, seconds: float, max_steps: int):
        self.seconds, self.max_steps = float(seconds), int(max_steps)
        self.used, self.steps = 0.0, 0

    def charge(self, cpu_s: float) -> None:
        self.used += float(cpu_s)
        self.steps += 1

    def total_steps(self) -> int:
        if self.steps == 0:
            return self.max_steps
        return max(self.steps, min(self.max_steps, int(self.seconds / (self.used / self.steps))))

    def spent(self) -> bool:
        return self.used >= self.seconds


def build_scheduler(opt: torch.optim.Optimizer, *, total_steps: int, warmup_ratio: float,
                    min_lr_ratio: float, budget: CpuBudget | None = None) -> torch.optim.lr_scheduler.LambdaLR:
    """Warmup + cosine over `total_steps`, or over the steps `budget` affords (re-estimated every step)."""
    if budget is not None:
        return torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: lr_factor(s, budget.total_steps(), warmup_ratio, min_lr_ratio))
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, total_steps, warmup_ratio, min_lr_ratio))


class MuonAdamW(torch.optim.Optimizer):
    """`train.optimizer=muon`: torch.optim.Muon for the 2-D weights, AdamW for every other parameter.

    One optimizer object to the loop, the scheduler and the checkpoints: `param_groups` are the inner
    optimizers' own group dicts (Muon's first), so a scheduler's lr reaches both; `state` is their
    merged per-parameter state; `state_dict()` / `load_state_dict()` use the standard layout over that
    group order. Muon runs with `adjust_lr_fn="match_rms_adamw"` (its update rescaled to AdamW's RMS,
    Moonlight's rule), so one `train.lr` suits both halves."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer):
        self.inner = [muon, adamw]
        super().__init__(muon.param_groups + adamw.param_groups, defaults={})

    @property  # type: ignore[override]
    def state(self):  # noqa: D401 - the merged view the checkpoint code reads
        merged: dict = {}
        for opt in getattr(self, "inner", []):
            merged.update(opt.state)
        return merged

    @state.setter
    def state(self, value) -> None:  # Optimizer.__init__ / __setstate__ assign it: routed to the inner ones
        if not value or not hasattr(self, "inner"):
            return
        for opt in self.inner:
            own = {p for g in opt.param_groups for p in g["params"]}
            opt.state.update({p: s for p, s in value.items() if p in own})

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        for opt in self.inner:
            out = opt.step(closure)
            loss = out if out is not None else loss
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.inner:
            opt.zero_grad(set_to_none=set_to_none)

    def load_state_dict(self, state_dict: dict) -> None:
        groups, state = state_dict["param_groups"], state_dict["state"]
        k = len(self.inner[0].param_groups)
        for opt, gs in ((self.inner[0], groups[:k]), (self.inner[1], groups[k:])):
            ids = [i for g in gs for i in g["params"]]
            remap = {old: new for new, old in enumerate(ids)}
            opt.load_state_dict({"state": {remap[i]: s for i, s in state.items() if i in remap},
                                 "param_groups": [{**g, "params": [remap[i] for i in g["params"]]} for g in gs]})
        self.param_groups = self.inner[0].param_groups + self.inner[1].param_groups


def muon_split(model: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(2-D trainable weights, every other trainable parameter) of `model`."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [p for p in params if p.ndim == 2], [p for p in params if p.ndim != 2]
