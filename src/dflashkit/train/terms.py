"""The loss's own terms (CE, KL), its position weightings (Decay, D-PACE) and the chunked evaluation of rows.

Usage:
    terms = (CE(), KL(0.5, temperature=2.0), *family.terms(train.weights))   # `DraftLoss` sums them in this order
    parts = chunked(compute, prepare, blk.rows, step=64 * B, block_size=B, checkpointed=True)
    part, stats = term.total([p[i] for p in parts], row_w)               # Σ w · row loss (before the denominator)

A term (`family.base.LossTerm`) computes its per-row arithmetic in `chunk(Rows)`, inside the checkpointed
chunk, and its weighted sum in `total`; a weighting (`Decay`, `DPace`) gives the rows' weights from its own
chunk values. Invariants:
  * `chunk_bounds` never splits the rows of one block (a term may score whole blocks: `Rows.blocks`).
  * `chunked` recomputes a chunk's [rows, V] logits in backward (activation checkpointing) when there is
    more than one chunk and gradients flow, so a batch's logits never exist at once; the values are the
    same either way.
  * CE and D-PACE read one cross-entropy per row (`Rows.ce`, computed once per chunk).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dflashkit.family.base import Rows, Scored
from dflashkit.train.objective import dpace_weights


def cat_rows(parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """The chunks' per-row values in row order (an empty one like `like` when there were no rows)."""
    return torch.cat(parts) if parts else like.new_zeros(0)


# -- the terms of train.loss -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CE:
    """Σ w · CE(row scores, label)."""

    weight: float = 1.0
    name: str = "ce"
    needs_prev: bool = False
    needs_target: bool = False

    def chunk(self, rows: Rows) -> torch.Tensor:
        return rows.ce

    def total(self, parts: list, row_w: torch.Tensor) -> tuple[torch.Tensor, dict]:
        return self.weight * (row_w * cat_rows(parts, row_w)).sum(), {}

    def rescore(self, s: Scored) -> tuple[None, dict]:
        return None, {}


@dataclass(frozen=True)
class KL:
    """Σ w · T² · KL(target's next-token law at a+k−1 ‖ the drafter's), both laws softmax(logits / T): the forward
    KL of distillation (`train.kl_temperature` T; T² keeps the gradient's scale as T changes, Hinton et al.).
    The loss refuses a batch without the target's logits when it has this term."""

    weight: float = 1.0
    temperature: float = 1.0
    name: str = "kl"
    needs_prev: bool = False
    needs_target: bool = True

    def chunk(self, rows: Rows) -> torch.Tensor:
        assert rows.target is not None  # `build_blocks(target_required=True)`
        temp = float(self.temperature)
        logp = F.log_softmax(rows.scores / temp, dim=-1)
        tlogp = F.log_softmax(rows.target.float() / temp, dim=-1)
        return (tlogp.exp() * (tlogp - logp)).sum(-1)

    def total(self, parts: list, row_w: torch.Tensor) -> tuple[torch.Tensor, dict]:
        return self.weight * self.temperature ** 2 * (row_w * cat_rows(parts, row_w)).sum(), {}

    def rescore(self, s: Scored) -> tuple[None, dict]:
        return None, {}


# -- position weighting ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Decay:
    """Fixed weights exp(−(k−1)/γ) per block position k ≥ 1 (`gamma` None: all 1)."""

    gamma: float | None

    @property
    def label_gamma(self) -> float | None:
        """γ of `labels_and_weights` / `weight_sum` (the step denominator's too)."""
        return self.gamma

    def chunk(self, rows: Rows) -> None:
        return None

    def row_weights(self, w: torch.Tensor, rows: torch.Tensor, sup: torch.Tensor, parts: list) -> torch.Tensor:
        """The weights of the supervised rows `rows` (flat indices into `w`)."""
        return w[rows]


@dataclass(frozen=True)
class DPace:
    """D-PACE (`objective.dpace_weights`): weights from the drafter's own CE, detached; the labels' weights
    are the plain supervised mask (γ None), so the denominator is the count of supervised positions."""

    alpha: float
    label_gamma: float | None = None

    def chunk(self, rows: Rows) -> torch.Tensor:
        return rows.ce

    def row_weights(self, w: torch.Tensor, rows: torch.Tensor, sup: torch.Tensor, parts: list) -> torch.Tensor:
        """The rows' D-PACE weights; an out-of-vocab supervised position (no row) has CE = +inf (q = 0)."""
        ce_grid = torch.full((w.numel(),), float("inf"), device=w.device)
        ce_grid[rows] = cat_rows(parts, w).detach()
        return dpace_weights(ce_grid.view(sup.shape), sup, alpha=self.alpha).flatten()[rows]


# -- chunked evaluation ------------------------------------------------------------------------------------------
def chunk_bounds(rows: torch.Tensor, step: int, block_size: int) -> list[tuple[int, int]]:
    """[c0, c1) ranges over the sorted flat row indices `rows`, at most `step` rows each (step ≥ B), never
    splitting the rows of one block (a term may score whole blocks: `Blocks`)."""
    n = rows.numel()
    block = (rows // block_size).tolist()
    out, c0 = [], 0
    while c0 < n:
        c1 = min(c0 + step, n)
        while c1 < n and c1 > c0 + 1 and block[c1 - 1] == block[c1]:  # back to the block's first row
            c1 -= 1
        out.append((c0, c1))
        c0 = c1
    return out


def chunked(compute: Callable[..., Any], prepare: Callable[[torch.Tensor], tuple], rows: torch.Tensor, *,
            step: int, block_size: int, checkpointed: bool) -> list[Any]:
    """`compute(*prepare(r))` for each block-aligned chunk r of `rows` (`chunk_bounds`), in order. `prepare`
    runs outside the checkpoint (gathers, no-grad lookups); `compute` runs under activation checkpointing when
    `checkpointed` and the rows take more than one chunk."""
    out = []
    for c0, c1 in chunk_bounds(rows, step, block_size):
        args = prepare(rows[c0:c1])
        if checkpointed and c1 - c0 < rows.numel():
            out.append(checkpoint(compute, *args, use_reentrant=False))
        else:
            out.append(compute(*args))
    return out
