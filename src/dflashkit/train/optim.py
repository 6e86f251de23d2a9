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

from dflashkit.target.load import fast_bf16


def build_optimizer(model: torch.nn.Module, train) -> torch.optim.Optimizer:
    """`train.optimizer` over trainable parameters only (the target's embedding/head stay frozen):
    AdamW (fp32 state), or Muon for the 2-D weights + AdamW for the rest (`MuonAdamW`)."""
    params = [p for p in model.parameters() if p.requires_grad]
    kind = getattr(train, "optimizer", "adamw")
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=train.lr, betas=tuple(train.betas), weight_decay=train.weight_decay,
                                 eps=1e-8, foreach=False)
    matrices, rest = muon_split(model)
    dev = matrices[0].device if matrices else torch.device("cpu")

    muon_cls = torch.optim.Muon if fast_bf16(dev) else Fp32Muon
    muon = muon_cls(matrices, lr=train.lr, weight_decay=train.weight_decay, momentum=train.muon_momentum,
                    adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW(rest or [torch.nn.Parameter(torch.zeros(1))], lr=train.lr, betas=tuple(train.betas),
                              weight_decay=train.weight_decay, eps=1e-8, foreach=False)
    return MuonAdamW(muon, adamw)


def newton_schulz_fp32(g: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                       eps: float) -> torch.Tensor:
    """Muon's quintic Newton-Schulz orthogonalisation of a 2-D update, in float32 (torch.optim.Muon's runs in
    bfloat16, which on a CPU without AMX-BF16 made a demo Muon step cost 52 CPU-s instead of AdamW's 3.9)."""
    a, b, c = coefficients
    x = g.float()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class Fp32Muon(torch.optim.Muon):
    """torch.optim.Muon (same hyper-parameters, state and checkpoints) with the Newton-Schulz iteration in
    float32: the update where bfloat16 products are slow (CPUs without AMX-BF16 or AVX512-BF16:
    `target.load.fast_bf16`). Elsewhere torch's own runs."""

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd, mom = float(group["lr"]), group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mom)
                update = p.grad.lerp(buf, mom) if group["nesterov"] else buf
                update = newton_schulz_fp32(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
                rows, cols = p.shape[:2]
                scale = 0.2 * math.sqrt(max(rows, cols)) if group["adjust_lr_fn"] == "match_rms_adamw" \
                    else math.sqrt(max(1, rows / cols))
                p.mul_(1 - lr * wd)
                p.add_(update.to(p.dtype), alpha=-lr * scale)
        return loss


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
