"""How the GPU check compares two runs: losses, gradients, weights, each against a stated tolerance.

Usage:
    row = close_losses([2.31, 2.20], [2.31, 2.20], first_rtol=1e-5, rtol=1e-4)   # {"ok", "max_rel", ...}
    row = close_tensors(grads_a, grads_b, rel=1e-4)             # per-tensor ‖a−b‖/‖b‖, the worst named
    row = close_weights(weights_a, weights_b, atol=2e-4)         # the largest |a−b| over every tensor

Each helper returns a JSON-ready row holding the measured difference beside the tolerance, so the summary
shows how close a pass was and how far a failure missed. The tolerances, and why:

* `FLEX_FP32`: flex attention and SDPA compute the same masked softmax in float32; they differ only in
  summation order (and flex's exp2 form), ~1e-7 relative per element. Loss rtol 1e-5, gradients 1e-4 (a
  gradient sums over every query row, so its rounding grows with the row count).
* `FLEX_BF16`: under bf16 autocast both kernels round q, k, v and the output to an 8-bit mantissa (2^-9
  relative) at different points; elementwise they differ by a few bf16 ulps (~1%), norm-wise less. Loss rtol
  1e-2, gradients 5e-2.
* `CPU_GPU`: float32 on both, TF32 off. The first loss depends only on identical inputs (the drafter is
  initialised on the CPU from the seed, anchors come from CPU generators), so it may differ by summation order
  alone: rtol 1e-5. After an AdamW step a weight whose gradient is ~0 moves by up to lr·sign(g), and the two
  devices can disagree on that sign, so later losses get 1e-4 and the final weights lr/2 (an actual bug — a
  wrong batch, a missing mask — moves the losses by ≫1e-4 and the weights by ~lr per step).
* `RANKS`: one process vs two ranks on the same device kind: as tests/integration/test_distributed.py
  (losses within 1e-5 + 1e-5·|loss|, as its torch.allclose; weights atol 2e-4: the gradients are averaged
  over ranks in another order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence


@dataclass(frozen=True)
class Tolerance:
    """What two runs may differ by (see the module doc for each choice)."""

    loss_rtol: float
    grad_rel: float = 0.0
    first_loss_rtol: float | None = None  # the first step's loss, when it is held tighter than the rest
    loss_atol: float = 0.0
    weight_atol: float = 0.0


FLEX_FP32 = Tolerance(loss_rtol=1e-5, grad_rel=1e-4)
FLEX_BF16 = Tolerance(loss_rtol=1e-2, grad_rel=5e-2)
CPU_GPU_LR = 3e-3  # the lr both runs train with (the weights' tolerance is half of it)
CPU_GPU = Tolerance(loss_rtol=1e-4, first_loss_rtol=1e-5, weight_atol=CPU_GPU_LR / 2)
RANKS = Tolerance(loss_rtol=1e-5, loss_atol=1e-5, weight_atol=2e-4)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def close_losses(got: Sequence[float], want: Sequence[float], tol: Tolerance) -> dict[str, Any]:
    """Two loss curves step by step: |a−b| ≤ atol + rtol·|b| (the first step with `first_loss_rtol`)."""
    if len(got) != len(want) or not got:
        return {"ok": False, "reason": f"{len(got)} losses against {len(want)}", "got": list(got),
                "want": list(want)}
    worst_rel, ok = 0.0, True
    for i, (a, b) in enumerate(zip(got, want)):
        if not (math.isfinite(a) and math.isfinite(b)):
            ok = False
            continue
        rtol = tol.first_loss_rtol if i == 0 and tol.first_loss_rtol is not None else tol.loss_rtol
        ok &= abs(a - b) <= tol.loss_atol + rtol * abs(b)
        worst_rel = max(worst_rel, _rel(a, b))
    return {"ok": bool(ok), "max_rel": worst_rel, "max_abs": max(abs(a - b) for a, b in zip(got, want)),
            "rtol": tol.loss_rtol, "first_rtol": tol.first_loss_rtol, "atol": tol.loss_atol,
            "got": [round(x, 7) for x in got], "want": [round(x, 7) for x in want]}


def close_tensors(got: Mapping[str, Any], want: Mapping[str, Any], *, rel: float) -> dict[str, Any]:
    """Named tensors (gradients): per tensor ‖a−b‖/‖b‖ ≤ rel; the worst one, and the overall cosine."""
    if set(got) != set(want):
        return {"ok": False, "reason": f"different tensors: {sorted(set(got) ^ set(want))[:8]}"}
    worst, worst_name, dot, na, nb = 0.0, None, 0.0, 0.0, 0.0
    finite = True
    for name in want:
        a, b = got[name].double().flatten(), want[name].double().flatten()
        finite &= bool(a.isfinite().all() and b.isfinite().all())
        err = float((a - b).norm()) / max(float(b.norm()), 1e-30)
        if err > worst:
            worst, worst_name = err, name
        dot, na, nb = dot + float(a @ b), na + float(a @ a), nb + float(b @ b)
    cosine = dot / math.sqrt(na * nb) if na > 0 and nb > 0 else 0.0
    return {"ok": bool(finite and worst <= rel), "max_rel": worst, "worst": worst_name, "cosine": cosine,
            "rel": rel, "tensors": len(want)}


def close_weights(got: Mapping[str, Any], want: Mapping[str, Any], *, atol: float) -> dict[str, Any]:
    """Named tensors (trained weights): the largest |a−b| over every element ≤ atol."""
    if set(got) != set(want):
        return {"ok": False, "reason": f"different tensors: {sorted(set(got) ^ set(want))[:8]}"}
    diffs = {k: float((got[k].double() - want[k].double()).abs().max()) if want[k].numel() else 0.0 for k in want}
    name = max(diffs, key=lambda k: diffs[k]) if diffs else None
    worst = diffs[name] if name is not None else 0.0
    return {"ok": bool(math.isfinite(worst) and worst <= atol), "max_abs": worst, "worst": name, "atol": atol}
