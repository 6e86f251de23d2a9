"""A micro-batch's sampled blocks as the loss reads them, built once before the drafter's forward.

Usage:
    blk = build_blocks(x, a, heads, model=drafter, mask_token_id=m, gamma=7.0, prev=True, target=True)
    blk.block_ids, blk.positions, blk.mask           # the drafter's inputs (its features: blk.features)
    blk.rows, blk.loss_labels, blk.weights           # the supervised flat rows, their labels and weights
    blk.complement, blk.covered                      # train.suffix_complement: the rows' factors, covered count
    blk.target_rows(r, x, heads)                     # the target's logits predicting rows r (KL, a family term)

Invariants (`train/objective.py` states the rules these functions follow):
  * Flat row i = (b·N + n)·B + k (block i // B, position i % B); `rows` are the indices with weight > 0,
    ascending: only they reach the vocab projection.
  * `sup` (the metrics' denominators) is the supervision before a reduced draft vocab drops a label:
    an out-of-vocab label gets weight 0 (and adds nothing to `weight_sum`) but still counts as wrong.
  * `context=False` (`train.ablate_features`): no context at all (positions and mask of 0 context
    tokens, `features` [b, 0, ·]), not a context of zeros.
  * `train.suffix_complement` (`LossInputs.complement`, `train/suffix_complement.py`): `complement` [b·N·B] is
    each row's factor on its loss weight (the complement's weight where the suffix proposer already gets the
    label right in context, 1 elsewhere), applied after the position weighting (decay or D-PACE). `weights`,
    `rows`, `weight_sum` (the denominator) and the metrics stay the labels' own: a dropped row still reaches
    the vocab projection (its τ and accuracy are scored) with factor 0. Off: `complement` None, nothing else
    changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from dflashkit.model.draft_vocab import draft_labels
from dflashkit.model.masks import dense_block_mask, flex_block_mask, layer_masks
from dflashkit.model.path_labels import path_label_ids
from dflashkit.train.objective import Anchors, block_input_ids, block_position_ids, labels_and_weights
from dflashkit.train.suffix_complement import SuffixComplement


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
    rollout) or `on_path_only` (only the positions on that path weigh, mask; `labels_and_weights`);
    `complement`: the suffix-complement factors of the training loss (module docstring)."""

    features: torch.Tensor
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    seq_lens: torch.Tensor
    label_ids: torch.Tensor | None = None
    target_logits: torch.Tensor | None = None
    target_hidden: torch.Tensor | None = None
    path_ids: torch.Tensor | None = None
    on_path_only: bool = False
    complement: SuffixComplement | None = None   # train.suffix_complement (training only; None: off)


@dataclass
class LossBlocks:
    """The blocks of one micro-batch (module docstring); tensors [b·N·B] are flat rows."""

    block_size: int
    block_ids: torch.Tensor             # [b, N·B] the drafter's block input ids (anchor token, then mask ids)
    features: torch.Tensor              # [b, S, n_feat·H] its context features ([b, 0, ·] without context)
    context: bool                       # whether the blocks attend to the target context
    positions: torch.Tensor             # [b, S + N·B] (S = 0 without context)
    mask: object                        # per layer: a dense bool mask or a flex BlockMask (`layer_masks`)
    labels: torch.Tensor                # [b, N, B] label ids (target ids)
    sup: torch.Tensor                   # [b, N, B] bool: supervised positions (before the draft vocab)
    loss_labels: torch.Tensor           # [b·N·B] the loss's labels (draft-vocab indices with a reduced vocab)
    weights: torch.Tensor               # [b·N·B] position weights (0 for an out-of-vocab label)
    rows: torch.Tensor                  # [r] flat indices with weight > 0, ascending
    prev: torch.Tensor | None           # [b·N·B] the gold predecessors (`predecessors`; a term asked)
    target_at: tuple[torch.Tensor, torch.Tensor] | None   # (batch, position) [b·N·B] of each row's target logits
    supervised: torch.Tensor | None     # [b·N·B] bool: supervised before `train.on_path=mask` (None: not on)
    weight_sum: float                   # Σ weights (the batch's own loss denominator)
    complement: torch.Tensor | None = None  # [b·N·B] train.suffix_complement's factor per row (None: off)
    covered: int = 0                    # supervised positions the suffix proposer covers (complement on)

    def target_rows(self, r: torch.Tensor, x: LossInputs, heads: Heads) -> torch.Tensor | None:
        """[r, V'] the target's logits predicting rows `r` (its next-token law at a+k−1; the `vocab` columns
        with a reduced vocab), from `x.target_logits` or, without grad, `heads.target_head` of `x.target_hidden`;
        None when no term asked for them or the batch has none. Asked per chunk of rows, outside its checkpoint:
        a batch's [rows, V] target logits never exist at once either."""
        if self.target_at is None:
            return None
        bi, pos = self.target_at[0][r], self.target_at[1][r]
        if x.target_logits is not None:
            tgt = x.target_logits[bi, pos]
        else:
            assert x.target_hidden is not None and heads.target_head is not None  # `build_blocks` checked
            with torch.no_grad():
                tgt = heads.target_head(in_head_dtype(heads.target_head, x.target_hidden[bi, pos]))
        return tgt if heads.vocab is None else tgt.index_select(-1, heads.vocab)


def build_blocks(x: LossInputs, a: Anchors, heads: Heads, *, model, mask_token_id: int, gamma: float | None,
                 context: bool = True, attention: str = "sdpa", prev: bool = False, target: bool = False,
                 target_required: bool = False) -> LossBlocks:
    """The blocks of micro-batch `x` at anchors `a` for `model` (the unwrapped drafter: its block size and
    its masks' causality and windows). `gamma` is the labels' decay (`labels_and_weights`), `attention` "sdpa"
    (dense bool mask) or "flex" (BlockMask); `prev` asks for the gold predecessors, `target` for the target's
    logits when the batch has them, `target_required` refuses a batch without them (ValueError)."""
    B = model.block_size
    s = x.input_ids.shape[1]
    labels, sup, loss_labels, w = _labels(x, a, heads, block_size=B, gamma=gamma)
    have = x.target_logits is not None or (x.target_hidden is not None and heads.target_head is not None)
    if target_required and not have:
        raise ValueError("loss kl / ce+kl needs target_logits, or target_hidden and target_head")
    supervised = None
    if x.on_path_only:  # the blocks' supervision before the mask drops positions off the target's path
        supervised = labels_and_weights(x.input_ids, x.loss_mask, x.seq_lens, a, block_size=B, gamma=None,
                                        label_ids=x.label_ids)[1].flatten() > 0
    ctx_len = s if context else 0
    factor, covered = None, 0
    if x.complement is not None:
        f, cov = x.complement.factors(x.input_ids, a, labels, sup)
        factor, covered = f.flatten(), int(cov.sum())
    return LossBlocks(
        block_size=B,
        block_ids=block_input_ids(x.input_ids, a, mask_token_id=mask_token_id, block_size=B),
        features=x.features if context else x.features[:, :0], context=context,
        positions=block_position_ids(a, ctx_len=ctx_len, block_size=B),
        mask=_mask(model, a, x.seq_lens, ctx_len=ctx_len, attention=attention),
        labels=labels, sup=sup, loss_labels=loss_labels.flatten(), weights=w.flatten(),
        rows=(w.flatten() > 0).nonzero().flatten(),
        prev=(predecessors(x.input_ids, x.label_ids, a, block_size=B, path_ids=x.path_ids).flatten()
              if prev else None),
        target_at=_target_at(a, s, B) if target and have else None,
        supervised=supervised, weight_sum=float(w.sum()), complement=factor, covered=covered)


def _labels(x: LossInputs, a: Anchors, heads: Heads, *, block_size: int, gamma: float | None):
    """(labels [b, N, B], sup [b, N, B], the loss's labels [b, N·B], weights [b, N·B]): an out-of-vocab label of
    a reduced vocab keeps its place in `sup` but gets weight 0."""
    bsz, n = a.anchors.shape
    labels, w = labels_and_weights(x.input_ids, x.loss_mask, x.seq_lens, a, block_size=block_size, gamma=gamma,
                                   label_ids=x.label_ids, path_ids=x.path_ids, on_path_only=x.on_path_only)
    sup = w.view(bsz, n, block_size) > 0
    loss_labels, vocab = labels, heads.vocab
    if vocab is not None:
        head_w = getattr(heads.head, "weight", None)
        if head_w is not None and head_w.shape[0] != vocab.numel():
            raise ValueError(f"lm_head has {head_w.shape[0]} rows but the draft vocab has {vocab.numel()} "
                             "tokens (pass draft_vocab.restricted_head(target_head, vocab))")
        loss_labels, inside = draft_labels(labels, vocab)
        w = w * inside
    return labels.view(bsz, n, block_size), sup, loss_labels, w


def _mask(model, a: Anchors, seq_lens: torch.Tensor, *, ctx_len: int, attention: str):
    """The drafter's per-layer attention masks over [context, blocks]."""
    make = flex_block_mask if attention == "flex" else dense_block_mask
    return layer_masks(make, a.anchors, a.keep, seq_lens.to(a.anchors.device), ctx_len=ctx_len,
                       block_size=model.block_size,
                       causal=getattr(model, "causal", False),  # the drafter networks say; a test stub need not
                       windows=getattr(model, "layer_windows", None),  # per layer: a sliding window or None
                       causals=getattr(model, "layer_causal", None),   # per layer in-block causality
                       starts=a.starts)                                # packed rows: each anchor's document


def _target_at(a: Anchors, s: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch, position) of the target's logits that predict each flat row: position a+k−1 (clamped to the row)."""
    bsz, n = a.anchors.shape
    dev = a.anchors.device
    pos = (a.anchors[:, :, None] + torch.arange(block_size, device=dev) - 1).clamp(0, s - 1)
    batch = torch.arange(bsz, device=dev)[:, None, None].expand(bsz, n, block_size)
    return batch.flatten(), pos.flatten()


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


def in_head_dtype(head: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`x` in the dtype of `head`'s weight. The drafter's output is float32 (its final norm's weight is), and
    outside autocast F.linear takes one dtype: a bf16 target's head (`target.dtype: auto` on CUDA) projects
    it in bf16, as autocast would, instead of refusing it."""
    w = getattr(head, "weight", None)
    return x if w is None or x.dtype == w.dtype else x.to(w.dtype)
