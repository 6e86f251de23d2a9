"""The summable statistics of a training step or a held-out evaluation, and the metrics made from them.

Usage:
    st = StepStats.zeros(B, contract.family)
    st.add_step(out, tokens=float(b.seq_lens.sum()), loss_scale=1 / denom)     # one training micro-batch
    st.add_heldout(out)                                                        # one held-out batch
    st = StepStats.from_tensor(all_reduce_sum(st.to_tensor(), dist), B, fam)   # summed over ranks
    row = st.metrics(step + 1, lr=lr, grad_norm=g)        # a metrics.jsonl row (+ the family's metrics)
    row = st.heldout_row(step, samples=8)                 # a held-out row: losses per Σw

A step's statistics are sums over micro-batches and ranks: the loss (already divided by the step's
denominator, so the sum is the step's loss), τ sum, blocks, tokens, and per block position the
correct and supervised counts; under `train.suffix_complement` the supervised positions the suffix
proposer covers (metric `suffix_covered`: their share of the supervised positions 1 … B−1, and
`complemented`, the micro-batches that counted them); the drafter family adds its own (`Objective.stats`,
filled by its loss terms; DFlash2: the unary argmax's τ and accuracy, the selector's rows, coverage, accuracy,
loss).
`to_tensor` / `from_tensor` are the one flat float64 form the all-reduce sums.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from dflashkit.family.base import Family, ratio

if TYPE_CHECKING:
    from dflashkit.train.loss import LossOutput


_HEAD = 6  # the scalars before the per-position counts in the flat form (`to_tensor`)


def _zeros(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.float64)


@dataclass
class StepStats:
    """Summed statistics (module docstring). `tokens` is the context tokens of a training step, the loss
    weight Σw of a held-out evaluation (its normaliser)."""

    block_size: int
    family: Family
    loss: float = 0.0
    tau_sum: float = 0.0
    blocks: float = 0.0
    tokens: float = 0.0
    correct: torch.Tensor = field(default_factory=lambda: _zeros(0))   # [B] float64
    total: torch.Tensor = field(default_factory=lambda: _zeros(0))     # [B] float64
    extra: dict[str, Any] = field(default_factory=dict)                # the family's (`Objective.stats`)
    covered: float = 0.0        # train.suffix_complement: supervised positions the suffix proposer covers
    complemented: float = 0.0   # micro-batches that counted them (0: the option is off)

    @classmethod
    def zeros(cls, block_size: int, family: Family) -> StepStats:
        return cls(block_size, family, correct=_zeros(block_size), total=_zeros(block_size),
                   extra={f.name: _zeros(cls._size(f.size, block_size)) if f.size != 1 else 0.0
                          for f in family.objective.stats})

    @staticmethod
    def _size(size: int | str, block_size: int) -> int:
        return block_size if size == "B" else int(size)

    def _add_extra(self, out: LossOutput, loss_scale: float) -> None:
        for f in self.family.objective.stats:
            if f.name not in out.extra:
                continue
            v = out.extra[f.name]
            if isinstance(v, torch.Tensor):
                self.extra[f.name] = self.extra[f.name] + v.double()
            else:
                self.extra[f.name] += v * loss_scale if f.loss else v

    def add_step(self, out: LossOutput, *, tokens: float, loss_scale: float) -> None:
        """One training micro-batch: its loss is already per step denominator; the family's loss-like
        statistics are scaled by `loss_scale` (1 / the denominator) the same way."""
        self.loss += float(out.loss.detach())
        self.tau_sum += out.tau_sum
        self.blocks += out.blocks
        self.tokens += tokens
        self.correct += out.correct.double()
        self.total += out.total.double()
        if out.covered is not None:
            self.covered += out.covered
            self.complemented += 1
        self._add_extra(out, loss_scale)

    def add_heldout(self, out: LossOutput) -> None:
        """One held-out batch (loss over its own Σw): losses are summed as loss·Σw, normalised by `heldout_row`."""
        self.loss += float(out.loss) * out.weight_sum
        self.tau_sum += out.tau_sum
        self.blocks += out.blocks
        self.tokens += out.weight_sum
        both = torch.cat([out.correct, out.total]).double()
        self.correct += both[:self.block_size]
        self.total += both[self.block_size:]
        self._add_extra(out, 1.0)

    def __iadd__(self, other: StepStats) -> StepStats:
        return StepStats.from_tensor(self.to_tensor() + other.to_tensor(), self.block_size, self.family)

    # -- the all-reduce's flat form -------------------------------------------------------------------------
    def to_tensor(self) -> torch.Tensor:
        """[loss, τ sum, blocks, tokens, covered, complemented, correct (B), total (B), the family's in
        `Objective.stats` order] float64."""
        extra = [torch.as_tensor(self.extra[f.name], dtype=torch.float64).reshape(-1) for f in self.family.objective.stats]
        head = torch.tensor([self.loss, self.tau_sum, self.blocks, self.tokens, self.covered, self.complemented],
                            dtype=torch.float64)
        return torch.cat([head, self.correct, self.total, *extra])

    @classmethod
    def from_tensor(cls, t: torch.Tensor, block_size: int, family: Family) -> StepStats:
        B = block_size
        want = _HEAD + 2 * B + sum(cls._size(f.size, B) for f in family.objective.stats)
        if t.numel() != want:
            raise ValueError(f"statistics of {t.numel()} values, expected {want} (block size {B}, {family.name})")
        extra: dict[str, Any] = {}
        at = _HEAD + 2 * B
        for f in family.objective.stats:
            n = cls._size(f.size, B)
            extra[f.name] = t[at:at + n].clone() if f.size != 1 else float(t[at])
            at += n
        return cls(B, family, float(t[0]), float(t[1]), float(t[2]), float(t[3]), t[_HEAD:_HEAD + B].clone(),
                   t[_HEAD + B:_HEAD + 2 * B].clone(), extra, covered=float(t[4]), complemented=float(t[5]))

    # -- metrics ----------------------------------------------------------------------------------------------
    def metrics(self, step: int, **extra: Any) -> dict[str, Any]:
        """The step's metrics (τ, per-position accuracy over positions 1 … B−1, …) and the family's."""
        correct, total = self.correct, self.total
        out = {"step": step, "loss": self.loss, "tau": self.tau_sum / max(self.blocks, 1),
               "acc": [ratio(c, t) for c, t in zip(correct[1:], total[1:])],
               "acc_mean": float(correct[1:].sum() / max(total[1:].sum(), 1)),
               "blocks": int(self.blocks), "tokens": int(self.tokens),
               "_window": [self.tau_sum, self.blocks, float(correct[1]), float(total[1])], **extra}
        if self.complemented:
            out["suffix_covered"] = float(self.covered / max(float(total[1:].sum()), 1.0))
        mine = self.family.objective.metrics(self)
        if tuple(mine) != self.family.metric_names:
            raise ValueError(f"{self.family.title}'s metrics returned {list(mine)}, its Objective declares "
                             f"metric_names {list(self.family.metric_names)}: declare what metrics returns, in order")
        out.update(mine)
        return out

    def heldout_row(self, step: int, **extra: Any) -> dict[str, Any]:
        """A held-out evaluation's row: the loss (and the family's loss-like statistics) per Σw."""
        norm = max(self.tokens, 1e-6)
        st = StepStats(self.block_size, self.family, self.loss / norm, self.tau_sum, self.blocks, self.tokens,
                       self.correct, self.total,
                       {f.name: (self.extra[f.name] / norm if f.loss else self.extra[f.name])
                        for f in self.family.objective.stats})
        m = st.metrics(step)
        return {"step": step, "loss": m["loss"], "tau": m["tau"], "acc": m["acc"], "acc_mean": m["acc_mean"],
                "blocks": m["blocks"], **{k: m[k] for k in self.family.metric_names}, **extra}
