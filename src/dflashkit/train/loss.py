"""The training loss: one object built once per run from `train.*` and the drafter family, called per micro-batch.

Usage:
    loss = DraftLoss.from_train(cfg.train, contract, gamma=7.0)        # the Trainer builds it once
    out = loss(drafter, Heads(embed, head), LossInputs(feats, ids, loss_mask, seq_lens), anchors, denom=sum_w)
    out.loss.backward()                        # Σ of the terms / denom; out.correct, tau_sum, extra: statistics
    score = DraftLoss.scoring(contract)                                 # metrics only (eval's diagnostics)

One call: `build_blocks` (train/blocks.py: block inputs, positions, mask, labels, weights, rows), one drafter
forward, then each term's per-row arithmetic over `chunk_blocks`·B supervised rows at a time under activation
checkpointing (`chunked`, train/terms.py: the [rows, vocab] logits of a batch never exist at once), the
position weighting (`Decay`: exp(−(k−1)/γ), 1 under `uniform`; `DPace`: arXiv 2605.18810, from the drafter's
own confidence), the terms' totals (`CE`, `KL`, then the family's: `Objective.loss_terms`), the metrics.

Rules (each pinned by a test):
  * loss = Σ_terms weight · Σ_rows w·row_loss / denom (denom = Σ w over the whole optimizer step, all
    micro-batches and ranks, so micro-batching, accumulation and world size do not change the loss;
    under D-PACE the step's count of supervised in-vocab positions, known before the forward).
  * Metrics: accuracy per block position 1..B−1 over supervised positions and simulated τ = mean over real
    blocks of 1 + the leading correct supervised positions; a family term may re-score them by what its
    decoder drafts (DFlash2, LiLiCorr: the walk, the argmax kept as `unary_*`).
  * Reduced draft vocabulary (`Heads.vocab` sorted target ids, `Heads.head` its rows): labels become draft
    indices; an out-of-vocab label has no loss (nor weight in Σ w) but counts as wrong; KL compares against
    the target's logits at the `vocab` columns (renormalised).
  * The terms' order is immaterial: the loss puts them in one canonical order (`canonical`: CE, KL, then the
    others by name) and runs them in it, so their sum and the gradients they add up are the same bits whatever
    order they were listed in.
  * `context=False` (`train.ablate_features`): the blocks attend to themselves only, no target context.
  * `train.suffix_complement` (`LossInputs.complement`): each row's weight times its factor (0 or the
    complement's weight where the suffix proposer already gets the label right), after the weighting; the
    denominator and the metrics are unchanged (`covered` counts those positions).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from dflashkit.family.base import Blocks, Family, LossTerm, Rows, Scored
from dflashkit.train.blocks import Heads, LossBlocks, LossInputs, build_blocks, in_head_dtype
from dflashkit.train.objective import Anchors
from dflashkit.train.terms import CE, KL, Decay, DPace, chunked

if TYPE_CHECKING:
    from dflashkit.config import TrainSection
    from dflashkit.family.contract import DrafterContract

__all__ = ["CE", "KL", "DPace", "Decay", "DraftLoss", "Heads", "LossInputs", "LossOutput", "tau_sum"]


@dataclass
class LossOutput:
    """`loss` (differentiable, already divided by the step denominator) and summable statistics
    (`train/stats.py`); `extra` holds the family's (`Objective.stats`)."""

    loss: torch.Tensor
    weight_sum: float
    correct: torch.Tensor     # [B] correct predictions per block position (position 0 unused)
    total: torch.Tensor       # [B] supervised positions per block position
    tau_sum: float            # Σ over real blocks of (1 + leading correct)
    blocks: int               # number of real blocks
    extra: dict[str, Any] = field(default_factory=dict)
    covered: float | None = None  # train.suffix_complement: supervised positions it covers (None: off)


def tau_sum(ok: torch.Tensor, keep: torch.Tensor) -> float:
    """Σ over real blocks of 1 + the leading correct positions (ok [b, N, B], slot 0 ignored)."""
    lead = torch.cumprod(ok[:, :, 1:].long(), dim=-1).sum(-1)
    return float(((1 + lead).float() * keep.float()).sum())


COMMON_TERMS = ("ce", "kl")  # the terms every family may take, first in the canonical order (`canonical`)


def canonical(terms: tuple[LossTerm, ...] | list[LossTerm]) -> tuple[LossTerm, ...]:
    """`terms` in the order the loss runs them: CE, KL, then the others by name (the order the recipes build
    them in, so the default recipe's sums are those it always had). Float addition is not associative: this one
    order makes the loss and its gradients independent of how the terms were listed. ValueError when two terms
    share a name (their statistics would too)."""
    names = [t.name for t in terms]
    if len(set(names)) != len(names):
        raise ValueError(f"loss terms {names}: each term needs its own name")
    return tuple(sorted(terms, key=lambda t: (COMMON_TERMS.index(t.name) if t.name in COMMON_TERMS
                                              else len(COMMON_TERMS), t.name)))


@dataclass(frozen=True)
class DraftLoss:
    """The loss of a run (module docstring): its terms (in any order: kept in the `canonical` one), a position
    weighting."""

    family: Family
    mask_token_id: int
    terms: tuple[LossTerm, ...] = (CE(),)
    weighting: Decay | DPace = Decay(None)
    chunk_blocks: int = 64
    attention: str = "sdpa"                  # "sdpa" (dense bool mask) or "flex" (BlockMask; GPU training)
    amp: torch.dtype | None = None           # autocast dtype of the drafter pass (None: off)
    context: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "terms", canonical(self.terms))

    @classmethod
    def from_train(cls, train: TrainSection, contract: DrafterContract, *, gamma: float | None, attention: str = "sdpa",
                   amp: torch.dtype | None = None) -> DraftLoss:
        """`train.loss` (ce | kl | ce+kl, `kl_weight`, `kl_temperature`), `position_weighting` (decay: exp(−(k−1)/γ),
        uniform: 1 at every position, dpace), `loss_chunk_blocks`, `ablate_features`, and the family's terms
        (DFlash2: `selector_loss_weight`)."""
        terms: list[LossTerm] = []
        if train.loss in ("ce", "ce+kl"):
            terms.append(CE())
        if train.loss in ("kl", "ce+kl"):
            terms.append(KL(train.kl_weight if train.loss == "ce+kl" else 1.0, train.kl_temperature))
        fam = contract.family
        weighting: Decay | DPace = (DPace(train.dpace_alpha) if train.position_weighting == "dpace" else
                                    Decay(None if train.position_weighting == "uniform" else gamma))
        return cls(fam, contract.mask_token_id, (*terms, *fam.terms(train.weights)), weighting,
                   chunk_blocks=train.loss_chunk_blocks, attention=attention, amp=amp,
                   context=not train.ablate_features)

    @classmethod
    def scoring(cls, contract: DrafterContract, *, context: bool = True) -> DraftLoss:
        """The loss whose metrics score a drafter teacher-forced (eval's diagnostics): CE over unweighted
        positions plus the family's terms at their defaults (they may score what the decoder drafts:
        DFlash2's walk)."""
        fam = contract.family
        return cls(fam, contract.mask_token_id, (CE(), *fam.terms(None)), Decay(None), context=context)

    def __call__(self, drafter, heads: Heads, x: LossInputs, a: Anchors, *, denom: float | None = None) -> LossOutput:
        """Drafter forward over all sampled blocks + the chunked weighted loss.

        Args:
            drafter: the drafter network (or a DDP/FSDP wrapper of it).
            heads: embedding and head(s); `heads.vocab` a reduced draft vocab on the batch's device.
            x: the micro-batch; a: its sampled anchors.
            denom: the loss denominator (Σ w over the optimizer step; `weight_sum` with this loss's
                `weighting.label_gamma`); None = this batch's Σ w.
        """
        model = getattr(drafter, "module", drafter)
        blk = build_blocks(x, a, heads, model=model, mask_token_id=self.mask_token_id,
                           gamma=self.weighting.label_gamma, context=self.context, attention=self.attention,
                           prev=any(t.needs_prev for t in self.terms),
                           target=any(t.needs_target for t in self.terms),
                           target_required=any(isinstance(t, KL) for t in self.terms))
        hidden = self.forward(drafter, heads, blk)
        parts, pred = self.row_values(model, heads, x, a, blk, hidden)
        row_w = self.weighting.row_weights(blk.weights, blk.rows, blk.sup, parts[-1])
        if blk.complement is not None:  # train.suffix_complement: after the weighting, decay or D-PACE
            row_w = row_w * blk.complement[blk.rows]
        total = hidden.new_zeros((), dtype=torch.float32)
        extra: dict[str, Any] = {}
        for term, term_parts in zip(self.terms, parts):
            part, stats = term.total(term_parts, row_w)
            total = total + part
            extra.update(stats)
        scaled = total / max(denom if denom is not None else blk.weight_sum, 1e-6)
        ok = self.verdicts(model, heads, x, a, blk, hidden, parts, pred, extra)
        return LossOutput(loss=scaled, weight_sum=blk.weight_sum, correct=ok.sum(dim=(0, 1)).float().cpu(),
                          total=blk.sup.sum(dim=(0, 1)).float().cpu(), tau_sum=tau_sum(ok, a.keep),
                          blocks=int(a.keep.sum()), extra=extra,
                          covered=None if blk.complement is None else float(blk.covered))

    def forward(self, drafter, heads: Heads, blk: LossBlocks) -> torch.Tensor:
        """The drafter over every block (under `amp` autocast when set): outputs [b·N·B, H], flat rows."""
        with torch.no_grad():
            noise = heads.embed(blk.block_ids)
        with torch.autocast(device_type=blk.block_ids.device.type, dtype=self.amp or torch.bfloat16,
                            enabled=self.amp is not None):
            hidden = drafter(noise.to(blk.features.dtype), blk.features, blk.positions, attention_mask=blk.mask)
        return hidden.reshape(-1, hidden.shape[-1])

    def row_values(self, model, heads: Heads, x: LossInputs, a: Anchors, blk: LossBlocks, hidden: torch.Tensor
                   ) -> tuple[list[list[Any]], torch.Tensor]:
        """Each term's `chunk` values, then the weighting's ([term][chunk]), and the argmax of every flat row
        (−1 where a row has no logits). Only the supervised rows reach the vocab projection, chunk by chunk.
        A chunk runs its terms last to first in the `canonical` order: the terms share the scores, and the order
        they are built in fixes the order their gradients sum in (float addition is not associative)."""
        fam, head = self.family, heads.head
        users = (*self.terms, self.weighting)
        order = [*range(len(self.terms) - 1, -1, -1), len(self.terms)]

        def score(h: torch.Tensor) -> torch.Tensor:
            return fam.network.scores(model, head(in_head_dtype(head, h)).float())      # [rows, V'] float32

        view = Blocks(hidden, score, heads.embed, blk.features if blk.context else None, a.anchors,
                      blk.block_size, blk.supervised)

        def prepare(r: torch.Tensor) -> tuple:
            return (hidden[r], blk.loss_labels[r], blk.target_rows(r, x, heads),
                    None if blk.prev is None else blk.prev[r], r)

        def compute(h, labels, target, prev, r) -> tuple[list[Any], torch.Tensor]:
            scores = score(h)
            rows = Rows(model, h, scores, labels, prev, index=r, target=target, blocks=view)
            values: list[Any] = [None] * len(users)
            for i in order:
                values[i] = users[i].chunk(rows)
            return values, scores.argmax(-1)

        out = chunked(compute, prepare, blk.rows, step=max(1, self.chunk_blocks) * blk.block_size,
                      block_size=blk.block_size, checkpointed=hidden.requires_grad)
        pred = torch.full_like(blk.loss_labels, -1)
        if out:
            pred[blk.rows] = torch.cat([p for _, p in out])
        return [[values[i] for values, _ in out] for i in range(len(users))], pred

    def verdicts(self, model, heads: Heads, x: LossInputs, a: Anchors, blk: LossBlocks, hidden: torch.Tensor,
                 parts: list[list[Any]], pred: torch.Tensor, extra: dict[str, Any]) -> torch.Tensor:
        """[b, N, B] whether each supervised position counts as correct: the argmax is the label, unless a
        term re-scores the blocks (`LossTerm.rescore`; its statistics go to `extra`)."""
        with torch.no_grad():
            pred = pred.view(blk.labels.shape)
            if heads.vocab is not None:  # draft index → target id; rows without logits stay -1 (wrong)
                pred = torch.where(pred >= 0, heads.vocab[pred.clamp(min=0)], pred)
            ok = (pred == blk.labels) & blk.sup
            scored = Scored(model, hidden.detach(), blk.rows, [], x.input_ids, a, blk.labels, blk.sup, ok,
                            lambda v: tau_sum(v, a.keep))
            for term, term_parts in zip(self.terms, parts):
                better, stats = term.rescore(replace(scored, parts=term_parts))
                extra.update(stats)
                ok = ok if better is None else better
        return ok
