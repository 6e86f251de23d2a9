"""The training loss: one object built once per run from `train.*` and the drafter family, called per micro-batch.

Usage:
    loss = DraftLoss.from_train(cfg.train, contract, gamma=7.0)        # the Trainer builds it once
    out = loss(drafter, Heads(embed, head), LossInputs(feats, ids, loss_mask, seq_lens), anchors, denom=sum_w)
    out.loss.backward()                        # Σ of the terms / denom; out.correct, tau_sum, extra: statistics
    score = DraftLoss.scoring(contract)                                 # metrics only (eval's diagnostics)

It is composed of: the drafter pass over every sampled block (train/objective.py builds the block
inputs, positions, labels and weights), the loss rows — only positions with weight > 0 reach the
vocab projection, `chunk_blocks`·B rows at a time under activation checkpointing, so the
[blocks·B, vocab] logits of a batch never exist at once (nor for backward) — a position weighting
(`Decay`: exp(−(k−1)/γ), or 1 everywhere under `uniform`; `DPace`: D-PACE, arXiv 2605.18810, weights
from the drafter's own confidence), and terms: `CE`, `KL` (the target's next-token distribution at
a+k−1 as the soft label, weighted the same way, at temperature T and scaled by T²), and the family's
own (`Family.loss_terms`; DFlash2: its selector). JetSpec's row as NeMo Automodel trains it is
`train.loss=kl train.position_weighting=uniform` (T = `train.kl_temperature`, 1) on a causal drafter
(`drafter.causal=true`: the mask is built causal for `model.causal`).

Rules (each pinned by a test):
  * loss = Σ_terms weight · Σ_rows w·row_loss / denom (denom = Σ w over the whole optimizer step, all
    micro-batches and ranks, so micro-batching, accumulation and world size do not change the loss;
    under D-PACE the step's count of supervised in-vocab positions, known before the forward).
  * Metrics: accuracy per block position 1..B−1 over positions with w > 0 and simulated τ = mean over
    real blocks of 1 + the number of leading correct supervised positions; a family term may re-score
    them by what its decoder drafts (DFlash2: the walk, the argmax kept as `unary_*`).
  * Reduced draft vocabulary (`Heads.vocab`, sorted target ids [V']; `Heads.head` = the target head's
    rows `vocab`): labels are mapped to draft indices; a supervised label outside the vocab gets loss
    weight 0 (also in the denominator Σ w) but still counts, as a wrong prediction, in accuracy and τ;
    KL compares against the target's logits restricted to the `vocab` columns (renormalised).
  * `context=False` (`train.ablate_features`): the blocks attend to themselves only (no target context at
    all). Zeroed features are not that: a context of zeros still takes softmax mass (q·0 = 0 per context
    position), so a long context drowns the block's own attention (`features` is then unused).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dflashkit.family.base import Blocks, Family, LossTerm, Rows, Scored
from dflashkit.model.draft_vocab import draft_labels
from dflashkit.model.masks import dense_block_mask, flex_block_mask, layer_masks
from dflashkit.model.path_labels import path_label_ids
from dflashkit.train.objective import Anchors, block_input_ids, block_position_ids, dpace_weights, labels_and_weights

if TYPE_CHECKING:
    from dflashkit.config import TrainSection
    from dflashkit.family.contract import DrafterContract


# -- position weighting ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Decay:
    """Fixed weights exp(−(k−1)/γ) per block position k ≥ 1 (`gamma` None: all 1)."""

    gamma: float | None
    needs_ce: bool = False

    @property
    def label_gamma(self) -> float | None:
        """γ of `labels_and_weights` / `weight_sum` (the step denominator's too)."""
        return self.gamma

    def row_weights(self, w: torch.Tensor, rows: torch.Tensor, ce_rows: torch.Tensor, sup: torch.Tensor) -> torch.Tensor:
        return w[rows]


@dataclass(frozen=True)
class DPace:
    """D-PACE (`objective.dpace_weights`): weights from the drafter's own CE, detached; the labels' weights
    are the plain supervised mask (γ None), so the denominator is the count of supervised positions."""

    alpha: float
    needs_ce: bool = True
    label_gamma: float | None = None

    def row_weights(self, w: torch.Tensor, rows: torch.Tensor, ce_rows: torch.Tensor, sup: torch.Tensor) -> torch.Tensor:
        # rows = the in-vocab supervised positions; out-of-vocab supervised ones: CE = +inf (q = 0)
        ce_grid = torch.full((w.numel(),), float("inf"), device=ce_rows.device)
        ce_grid[rows] = ce_rows.detach()
        return dpace_weights(ce_grid.view(sup.shape), sup, alpha=self.alpha).flatten()[rows]


# -- the terms of train.loss -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CE:
    """Σ w · CE(row scores, label)."""

    weight: float = 1.0
    name: str = "ce"
    base_rows: tuple[str, ...] = ("ce",)
    needs_prev: bool = False
    needs_target: bool = False

    def chunk(self, rows: Rows) -> None:
        return None

    def total(self, parts: list, row_w: torch.Tensor, base: dict) -> tuple[torch.Tensor, dict]:
        return self.weight * (row_w * base["ce"]).sum(), {}

    def rescore(self, s: Scored) -> tuple[None, dict]:
        return None, {}


@dataclass(frozen=True)
class KL:
    """Σ w · T² · KL(target's next-token law at a+k−1 ‖ the drafter's), both laws softmax(logits / T): the forward
    KL of distillation (`train.kl_temperature` T; T² keeps the gradient's scale as T changes, Hinton et al.)."""

    weight: float = 1.0
    temperature: float = 1.0
    name: str = "kl"
    base_rows: tuple[str, ...] = ("kl",)
    needs_prev: bool = False
    needs_target: bool = False

    def chunk(self, rows: Rows) -> None:
        return None

    def total(self, parts: list, row_w: torch.Tensor, base: dict) -> tuple[torch.Tensor, dict]:
        return self.weight * self.temperature ** 2 * (row_w * base["kl"]).sum(), {}

    def rescore(self, s: Scored) -> tuple[None, dict]:
        return None, {}


# -- inputs and outputs ------------------------------------------------------------------------------------------
@dataclass
class Heads:
    """The frozen target parts the loss uses: its input embedding and the loss's head (the target's lm_head, or
    its rows `vocab` for a reduced draft vocab); `target_head` = the full head (KL from cached last hidden states)."""

    embed: Callable[[torch.Tensor], torch.Tensor]
    head: Callable[[torch.Tensor], torch.Tensor]
    vocab: torch.Tensor | None = None
    target_head: Callable[[torch.Tensor], torch.Tensor] | None = None


@dataclass
class LossInputs:
    """One micro-batch: features [b, S, n_feat·H] (online or cached), right-padded ids / loss mask [b, S], true
    lengths [b]; `label_ids` [b, S] the label of each position (default the ids; `labels_and_weights`);
    for KL the target's logits [b, S, V], or its final-norm output [b, S, H] through `Heads.target_head`;
    `train.on_path`: `path_ids` [b, S, D] the target's greedy path after each raw prefix (the labels instead,
    rollout) or `on_path_only` (only the positions on that path weigh, mask; `labels_and_weights`)."""

    features: torch.Tensor
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    seq_lens: torch.Tensor
    label_ids: torch.Tensor | None = None
    target_logits: torch.Tensor | None = None
    target_hidden: torch.Tensor | None = None
    path_ids: torch.Tensor | None = None
    on_path_only: bool = False


@dataclass
class LossOutput:
    """`loss` (differentiable, already divided by the step denominator) and summable statistics
    (`train/stats.py`); `extra` holds the family's (`Family.stats`)."""

    loss: torch.Tensor
    weight_sum: float
    correct: torch.Tensor     # [B] correct predictions per block position (position 0 unused)
    total: torch.Tensor       # [B] supervised positions per block position
    tau_sum: float            # Σ over real blocks of (1 + leading correct)
    blocks: int               # number of real blocks
    extra: dict[str, Any] = field(default_factory=dict)


def in_head_dtype(head: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`x` in the dtype of `head`'s weight. The drafter's output is float32 (its final norm's weight is), and
    outside autocast F.linear takes one dtype: a bf16 target's head (`target.dtype: auto` on CUDA) projects
    it in bf16, as autocast would, instead of refusing it."""
    w = getattr(head, "weight", None)
    return x if w is None or x.dtype == w.dtype else x.to(w.dtype)


def tau_sum(ok: torch.Tensor, keep: torch.Tensor) -> float:
    """Σ over real blocks of 1 + the leading correct positions (ok [b, N, B], slot 0 ignored)."""
    lead = torch.cumprod(ok[:, :, 1:].long(), dim=-1).sum(-1)
    return float(((1 + lead).float() * keep.float()).sum())


def predecessors(input_ids: torch.Tensor, label_ids: torch.Tensor | None, a: Anchors, *,
                 block_size: int, path_ids: torch.Tensor | None = None) -> torch.Tensor:
    """[b, N, B] the gold token before each block position: the anchor x[a] at k = 1, the label of
    position k − 1 after it (slot 0: unused; with `path_ids`, the path label path_ids[a, k−2]).
    Positions past the sequence take its last token."""
    src = input_ids if label_ids is None else label_ids
    s = input_ids.shape[1]
    pos = (a.anchors[:, :, None] + torch.arange(block_size, device=input_ids.device) - 1).clamp(0, s - 1)
    b, n = a.anchors.shape
    prev = torch.gather(src, 1, pos.view(b, -1)).view(b, n, block_size).clone()
    if path_ids is not None and block_size > 2:
        prev[:, :, 2:] = path_label_ids(path_ids.to(prev.dtype), a.anchors, block_size)[:, :, 1:-1]
    prev[:, :, 1] = torch.gather(input_ids, 1, a.anchors)
    return prev


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


# -- the loss ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DraftLoss:
    """The loss of a run (module docstring): terms in the order they are summed, a position weighting."""

    family: Family
    mask_token_id: int
    terms: tuple[LossTerm, ...] = (CE(),)
    weighting: Decay | DPace = Decay(None)
    chunk_blocks: int = 64
    attention: str = "sdpa"                  # "sdpa" (dense bool mask) or "flex" (BlockMask; GPU training)
    amp: torch.dtype | None = None           # autocast dtype of the drafter pass (None: off)
    context: bool = True

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
        return cls(fam, contract.mask_token_id, (*terms, *fam.loss_terms(train)), weighting,
                   chunk_blocks=train.loss_chunk_blocks, attention=attention, amp=amp,
                   context=not train.ablate_features)

    @classmethod
    def scoring(cls, contract: DrafterContract, *, context: bool = True) -> DraftLoss:
        """The loss whose metrics score a drafter teacher-forced (eval's diagnostics): CE over unweighted
        positions plus the family's terms at their defaults (they may score what the decoder drafts:
        DFlash2's walk)."""
        from dflashkit.config import TrainSection

        fam = contract.family
        return cls(fam, contract.mask_token_id, (CE(), *fam.loss_terms(TrainSection())), Decay(None), context=context)

    @property
    def _kl_temperature(self) -> float:
        """T of the KL rows: the KL term's (1 when the rows serve another term only)."""
        return next((float(t.temperature) for t in self.terms if isinstance(t, KL)), 1.0)

    def _needs(self, rows: str) -> bool:
        return any(rows in t.base_rows for t in self.terms) or (rows == "ce" and self.weighting.needs_ce)

    def _chunk(self, model, head, h, labels, tgt, prev, need_ce: bool, need_kl: bool, index=None, blocks=None):
        """Per-row CE and KL (zeros when not needed), the argmax, and each term's own values, of one chunk."""
        scores = self.family.scores(model, head(in_head_dtype(head, h)).float())  # [rows, V']
        rows = Rows(model, h, scores, labels, prev, index=index, target=tgt, blocks=blocks)
        own = [t.chunk(rows) for t in self.terms]
        ce = F.cross_entropy(scores, labels, reduction="none") if need_ce else scores.new_zeros(labels.shape)
        if need_kl:
            temp = self._kl_temperature
            logp = F.log_softmax(scores / temp, dim=-1)
            tlogp = F.log_softmax(tgt.float() / temp, dim=-1)
            kl = (tlogp.exp() * (tlogp - logp)).sum(-1)
        else:
            kl = scores.new_zeros(labels.shape)
        return ce, kl, scores.argmax(-1), own

    def __call__(self, drafter, heads: Heads, x: LossInputs, a: Anchors, *, denom: float | None = None) -> LossOutput:
        """Drafter forward over all sampled blocks + the chunked weighted loss.

        Args:
            drafter: the drafter network (or a DDP/FSDP wrapper of it).
            heads: embedding and head(s); `heads.vocab` a reduced draft vocab on the batch's device.
            x: the micro-batch; a: its sampled anchors.
            denom: the loss denominator (Σ w over the optimizer step; `weight_sum` with this loss's
                `weighting.label_gamma`); None = this batch's Σ w.
        """
        bsz, s = x.input_ids.shape
        model = getattr(drafter, "module", drafter)
        B = model.block_size
        n = a.anchors.shape[1]
        vocab = heads.vocab
        labels, w = labels_and_weights(x.input_ids, x.loss_mask, x.seq_lens, a, block_size=B,
                                       gamma=self.weighting.label_gamma, label_ids=x.label_ids,
                                       path_ids=x.path_ids, on_path_only=x.on_path_only)
        sup = w.view(bsz, n, B) > 0                       # supervised positions: the metrics' denominators
        loss_labels = labels
        if vocab is not None:
            head_w = getattr(heads.head, "weight", None)
            if head_w is not None and head_w.shape[0] != vocab.numel():
                raise ValueError(f"lm_head has {head_w.shape[0]} rows but the draft vocab has {vocab.numel()} "
                                 "tokens (pass draft_vocab.restricted_head(target_head, vocab))")
            loss_labels, inside = draft_labels(labels, vocab)
            w = w * inside                                # out-of-vocab labels: no loss, but still scored
        wsum = float(w.sum())
        denom = denom if denom is not None else wsum
        with torch.no_grad():
            noise = heads.embed(block_input_ids(x.input_ids, a, mask_token_id=self.mask_token_id, block_size=B))
        ctx_len = s if self.context else 0
        ctx_feats = x.features if self.context else x.features[:, :0]
        pos = block_position_ids(a, ctx_len=ctx_len, block_size=B)
        make = flex_block_mask if self.attention == "flex" else dense_block_mask
        mask = layer_masks(make, a.anchors, a.keep, x.seq_lens.to(a.anchors.device), ctx_len=ctx_len, block_size=B,
                           causal=getattr(model, "causal", False),  # the drafter networks say; a test stub need not
                           windows=getattr(model, "layer_windows", None),  # per layer: a sliding window or None
                           causals=getattr(model, "layer_causal", None),   # per layer in-block causality
                           starts=a.starts)                                # packed rows: each anchor's document
        with torch.autocast(device_type=x.input_ids.device.type, dtype=self.amp or torch.bfloat16,
                            enabled=self.amp is not None):
            hidden = drafter(noise.to(x.features.dtype), ctx_feats, pos, attention_mask=mask)   # [b, N·B, H]
        # Only rows with w > 0 reach the vocab projection (slot 0 of every block, padded blocks and
        # unsupervised / past-the-end positions never do): the [rows, V] logits are the dominant cost.
        hidden = hidden.reshape(bsz * n * B, -1)
        rows = (w.flatten() > 0).nonzero().flatten()
        labels_f, w_f = loss_labels.flatten(), w.flatten()
        need_ce, need_kl = self._needs("ce"), self._needs("kl")
        have_target = x.target_logits is not None or (x.target_hidden is not None and heads.target_head is not None)
        if need_kl and not have_target:
            raise ValueError("loss kl / ce+kl needs target_logits, or target_hidden and target_head")
        tgt_rows = None
        if need_kl or (have_target and any(t.needs_target for t in self.terms)):
            tgt_pos = (a.anchors[:, :, None] + torch.arange(B, device=x.input_ids.device) - 1).clamp(0, s - 1)
            row_batch = torch.arange(bsz, device=x.input_ids.device)[:, None, None].expand(bsz, n, B)
            tgt_rows = (row_batch.flatten(), tgt_pos.flatten())
        prev_f = None
        if any(t.needs_prev for t in self.terms):
            prev_f = predecessors(x.input_ids, x.label_ids, a, block_size=B, path_ids=x.path_ids).flatten()
        ce_parts, kl_parts = [], []
        own: list[list[Any]] = [[] for _ in self.terms]
        pred_flat = torch.full_like(labels_f, -1)
        step = max(1, self.chunk_blocks) * B
        fam = self.family

        def score(hr: torch.Tensor) -> torch.Tensor:  # as `_chunk` scores its rows
            return fam.scores(model, heads.head(in_head_dtype(heads.head, hr)).float())

        supervised = None
        if x.on_path_only:  # the blocks' supervision before the mask drops positions off the target's path
            supervised = labels_and_weights(x.input_ids, x.loss_mask, x.seq_lens, a, block_size=B, gamma=None,
                                            label_ids=x.label_ids)[1].flatten() > 0
        blocks = Blocks(hidden, score, heads.embed, ctx_feats if self.context else None, a.anchors, B, supervised)
        for c0, c1 in chunk_bounds(rows, step, B):
            r = rows[c0:c1]
            tgt = None
            if tgt_rows is not None:
                if x.target_logits is not None:
                    tgt = x.target_logits[tgt_rows[0][r], tgt_rows[1][r]]
                else:
                    assert x.target_hidden is not None and heads.target_head is not None  # checked above
                    with torch.no_grad():
                        tgt = heads.target_head(in_head_dtype(heads.target_head,
                                                              x.target_hidden[tgt_rows[0][r], tgt_rows[1][r]]))
            if tgt is not None and vocab is not None:
                tgt = tgt.index_select(-1, vocab)
            args = (model, heads.head, hidden[r], labels_f[r], tgt, None if prev_f is None else prev_f[r],
                    need_ce, need_kl, r, blocks)
            if c1 - c0 >= rows.numel() or not hidden.requires_grad:
                ce_r, kl_r, pred, parts = self._chunk(*args)
            else:
                ce_r, kl_r, pred, parts = checkpoint(self._chunk, *args, use_reentrant=False)
            ce_parts.append(ce_r)
            kl_parts.append(kl_r)
            for i, p in enumerate(parts):
                own[i].append(p)
            pred_flat[r] = pred
        base = {"ce": torch.cat(ce_parts) if ce_parts else hidden.new_zeros(0, dtype=torch.float32),
                "kl": torch.cat(kl_parts) if kl_parts else hidden.new_zeros(0, dtype=torch.float32)}
        row_w = self.weighting.row_weights(w_f, rows, base["ce"], sup)
        total = hidden.new_zeros((), dtype=torch.float32)
        extra: dict[str, Any] = {}
        for term, parts in zip(self.terms, own):
            part, stats = term.total(parts, row_w, base)
            total = total + part
            extra.update(stats)
        scaled = total / max(denom, 1e-6)
        with torch.no_grad():
            pred = pred_flat.view(bsz, n, B)
            if vocab is not None:  # draft index → target id; rows without logits stay -1 (wrong)
                pred = torch.where(pred >= 0, vocab[pred.clamp(min=0)], pred)
            ok = (pred == labels.view(bsz, n, B)) & sup
            scored = Scored(model, hidden.detach(), rows, [], x.input_ids, a, labels.view(bsz, n, B), sup, ok,
                            lambda v: tau_sum(v, a.keep))
            for term, parts in zip(self.terms, own):
                better, stats = term.rescore(replace(scored, parts=parts))
                extra.update(stats)
                ok = ok if better is None else better
            return LossOutput(loss=scaled, weight_sum=wsum, correct=ok.sum(dim=(0, 1)).float().cpu(),
                              total=sup.sum(dim=(0, 1)).float().cpu(), tau_sum=tau_sum(ok, a.keep),
                              blocks=int(a.keep.sum()), extra=extra)
