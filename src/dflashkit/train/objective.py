"""The DFlash training objective (dflash-spec §3.4) as pure functions beside the model.

Usage:
    anchors = sample_anchors(loss_mask, seq_lens, num_anchors=512, block_size=B, seeds=[...])
    out = dflash_loss(drafter, embed, lm_head, features, input_ids, loss_mask, seq_lens, anchors,
                      mask_token_id=m, gamma=7.0, denom=anchors_weight_sum)
    out.loss.backward()                       # Σ w·CE / denom; out.stats holds acc / τ counts

Rules (each pinned by a test):
  * Anchor p of a sequence of true length L is a candidate iff p + 1 < L and loss_mask[p] and
    loss_mask[p+1] (the anchor and its first prediction are supervised). Block positions that run
    past L get weight 0. Up to `num_anchors` distinct candidates per sequence are drawn uniformly
    without replacement (a per-sample seeded generator, so the draw does not depend on the batch
    a sample lands in, nor on the number of ranks) and sorted; rows are padded with anchor 0 and
    keep=False.
  * Block j input = [x[a_j], MASK × (B−1)], positions a_j … a_j+B−1; context positions 0 … S−1.
  * Same-position labels: block j position k is trained to predict x[a_j + k] (pitfall §3.7.1).
  * Weight w = keep·[a_j+k < L]·[k > 0]·loss_mask[a_j+k]·exp(−(k−1)/γ).
  * CE = Σ w·CE / denom (denom = Σ w over the whole optimizer step, all micro-batches and ranks,
    so micro-batching, accumulation and world size do not change the loss). KL (optional) uses the
    target's next-token distribution at a_j+k−1 as the soft label, weighted the same way.
  * `position_weighting="dpace"` (D-PACE, arXiv 2605.18810) replaces the fixed decay by weights
    from the drafter's own confidence, computed in the forward and detached (`dpace_weights`):
    q_k = exp(−CE_k), q̃_k = (1−α)·q_k + α, w_j = Σ_{m≥j} Π_{1≤i≤m} q̃_i. The denominator is then
    the step's count of supervised in-vocab positions (Σ of the decay-free mask, known before the
    forward), so the loss stays invariant to micro-batching, accumulation and world size.
  * Logits are produced only for positions with w > 0, `chunk_blocks`·B rows at a time under
    activation checkpointing, so the [blocks·B, vocab] logits of the whole batch never exist at
    once (also not for backward).
  * Metrics: accuracy per block position 1..B−1 over positions with w > 0 and simulated τ =
    mean over real blocks of 1 + the number of leading correct supervised positions.
  * Reduced draft vocabulary (`vocab`, sorted target ids [V']; `lm_head` = the target head's rows
    `vocab`): labels are mapped to draft indices; a supervised label outside the vocab gets loss
    weight 0 (also in the denominator Σ w) but still counts, as a wrong prediction, in accuracy and
    τ; KL compares against the target's logits restricted to the `vocab` columns (renormalised).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dflashkit.model.dflash2 import walk_path
from dflashkit.model.draft_vocab import draft_labels
from dflashkit.model.masks import dense_block_mask, flex_block_mask


@dataclass
class Anchors:
    """Sampled blocks: `anchors` [b, N] (int64, padded with 0) and `keep` [b, N] (bool)."""

    anchors: torch.Tensor
    keep: torch.Tensor


def sample_anchors(loss_mask: torch.Tensor, seq_lens: torch.Tensor, *, num_anchors: int, block_size: int,
                   seeds: list[int], coverage: float | None = None) -> Anchors:
    """Draw up to `num_anchors` sorted distinct anchors per sequence (see the module rules).

    Args:
        loss_mask: [b, S] 0/1 supervised tokens (padding = 0).
        seq_lens: [b] true lengths.
        num_anchors: cap per sequence.
        block_size: B (unused by the candidate rule; positions past L are masked in the loss).
        seeds: one int per sequence; the same seed always draws the same anchors.
        coverage: anchors per document in proportion to its length (`train.anchor_coverage`): each
            sequence draws ceil(coverage · its candidates), still capped by `num_anchors`; None = the
            cap alone (every long sequence gets `num_anchors`, a short one all its candidates).
    Returns:
        Anchors with N = min(num_anchors, max candidates in the batch), at least 1.
    """
    del block_size
    b, s = loss_mask.shape
    lm = loss_mask.bool()
    picks: list[torch.Tensor] = []
    for i in range(b):
        n_i = int(seq_lens[i])
        row = lm[i, :n_i]
        valid = torch.zeros(n_i, dtype=torch.bool)
        if n_i >= 2:
            valid[:-1] = row[:-1].cpu() & row[1:].cpu()
        cand = valid.nonzero().flatten()
        g = torch.Generator().manual_seed(int(seeds[i]) & 0x7FFFFFFFFFFFFFFF)
        keys = torch.rand(n_i, generator=g)[cand]
        take = min(num_anchors, cand.numel())
        if coverage is not None:
            take = min(take, math.ceil(coverage * cand.numel()))
        chosen = cand[torch.argsort(keys)[:take]]
        picks.append(torch.sort(chosen).values)
    n = max(1, max(p.numel() for p in picks))
    anchors = torch.zeros(b, n, dtype=torch.long)
    keep = torch.zeros(b, n, dtype=torch.bool)
    for i, p in enumerate(picks):
        anchors[i, :p.numel()] = p
        keep[i, :p.numel()] = True
    return Anchors(anchors.to(loss_mask.device), keep.to(loss_mask.device))


def block_input_ids(input_ids: torch.Tensor, a: Anchors, *, mask_token_id: int, block_size: int) -> torch.Tensor:
    """[b, N·B] ids: slot 0 of block j = input_ids[a_j] (mask id for padded blocks), rest = mask id."""
    b, n = a.anchors.shape
    ids = torch.full((b, n, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    first = torch.gather(input_ids, 1, a.anchors)
    ids[:, :, 0] = torch.where(a.keep, first, torch.full_like(first, mask_token_id))
    return ids.view(b, n * block_size)


def block_position_ids(a: Anchors, *, ctx_len: int, block_size: int) -> torch.Tensor:
    """[b, S + N·B]: context 0 … S−1, then block j → a_j … a_j+B−1."""
    b, n = a.anchors.shape
    dev = a.anchors.device
    ctx = torch.arange(ctx_len, device=dev).expand(b, ctx_len)
    blk = (a.anchors[:, :, None] + torch.arange(block_size, device=dev)).view(b, n * block_size)
    return torch.cat([ctx, blk], dim=1)


def labels_and_weights(input_ids: torch.Tensor, loss_mask: torch.Tensor, seq_lens: torch.Tensor, a: Anchors, *,
                       block_size: int, gamma: float | None,
                       label_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same-position labels and loss weights, both [b, N·B] (labels 0 where the weight is 0).

    `label_ids` [b, S] (default `input_ids`) is the label of each position: with `train.labels=target`
    it holds the target's greedy prediction for position t (its argmax at t−1; `target_label_ids`)."""
    b, n = a.anchors.shape
    dev = input_ids.device
    k = torch.arange(block_size, device=dev)
    pos = a.anchors[:, :, None] + k                                           # [b, N, B]
    inside = pos < seq_lens.to(dev)[:, None, None]
    safe = torch.where(inside, pos, torch.zeros_like(pos)).view(b, -1)
    labels = torch.gather(input_ids if label_ids is None else label_ids, 1, safe).view(b, n, block_size)
    sup = torch.gather(loss_mask.to(torch.float32), 1, safe).view(b, n, block_size)
    decay = torch.exp(-(k.float() - 1).clamp(min=0) / gamma) if gamma else torch.ones(block_size, device=dev)
    decay = decay * (k > 0).float()
    w = a.keep[:, :, None].float() * inside.float() * sup * decay
    labels = torch.where(w > 0, labels, torch.zeros_like(labels))
    return labels.view(b, -1), w.view(b, -1)


def weight_sum(loss_mask, seq_lens, a: Anchors, *, input_ids, block_size: int, gamma: float | None,
               vocab: torch.Tensor | None = None, label_ids: torch.Tensor | None = None) -> float:
    """Σ w of one micro-batch (summed over the step to form the loss denominator; in-vocab labels only)."""
    labels, w = labels_and_weights(input_ids, loss_mask, seq_lens, a, block_size=block_size, gamma=gamma,
                                   label_ids=label_ids)
    if vocab is not None:
        w = w * draft_labels(labels, vocab)[1]
    return float(w.sum())


def dpace_weights(ce: torch.Tensor, supervised: torch.Tensor, *, alpha: float) -> torch.Tensor:
    """D-PACE position weights (detached), [..., B] like `ce`; slot 0 (the anchor) gets 0.

    q_k = exp(−CE_k) is the drafter's probability of the label at block position k (k = 1 … B−1),
    q̃_k = (1−α)·q_k + α, and w_j = Σ_{m≥j} Π_{1≤i≤m} q̃_i: the derivative of the block's expected
    accepted length Σ_m Π_{i≤m} q̃_i with respect to log q_j.

    Positions outside the supervised set (padded blocks, past the sequence end, loss_mask 0) get
    q̃ = 0: like simulated τ, where such a position ends the accepted run, the chain stops there, so
    they and every later position of the block get weight 0. A supervised label the drafter cannot
    produce (outside a reduced draft vocab: pass CE = +inf) has q = 0, so q̃ = α; it keeps its weight
    here, but the caller gives it no loss (it has no logit).

    Args:
        ce: [..., B] per-position cross-entropy (values outside `supervised` are ignored).
        supervised: [..., B] bool, the supervised positions (slot 0 must be False).
        alpha: smoothing in (0, 1].
    """
    with torch.no_grad():
        sup = supervised.bool()
        q = torch.exp(-ce.detach().float().clamp(min=0)).where(sup, torch.zeros((), device=ce.device))
        qt = torch.where(sup, (1 - alpha) * q + alpha, torch.zeros_like(q))[..., 1:]
        prefix = torch.cumprod(qt, dim=-1)                                     # Π_{i≤m} q̃_i
        suffix = prefix.flip(-1).cumsum(-1).flip(-1)                            # Σ_{m≥j}
        return torch.cat([torch.zeros_like(suffix[..., :1]), suffix], dim=-1)


@dataclass
class LossOutput:
    """`loss` (differentiable, already divided by the step denominator) and summable statistics.

    For a DFlash2 drafter `correct` / `tau_sum` score the selector's walk (what the decoder drafts)
    and `unary_*` the unary argmax beside it; for DFlash both are the argmax."""

    loss: torch.Tensor
    weight_sum: float
    correct: torch.Tensor     # [B] correct predictions per block position (position 0 unused)
    total: torch.Tensor       # [B] supervised positions per block position
    tau_sum: float            # Σ over real blocks of (1 + leading correct)
    blocks: int               # number of real blocks
    unary_correct: torch.Tensor | None = None   # [B] the unary argmax's (DFlash2; None: = correct)
    unary_tau_sum: float | None = None
    selector: SelectorStats | None = None


@dataclass
class SelectorStats:
    """DFlash2's selector over the supervised rows: top-K coverage of the gold token, teacher-forced
    selector accuracy over the strict top-K (serving semantics: no gold insertion), and its loss."""

    rows: float = 0.0         # supervised rows
    covered: float = 0.0      # gold label inside the unary top-K
    correct: float = 0.0      # the selector's best candidate after the gold predecessor is the gold label
    loss_sum: float = 0.0     # Σ w·CE_selector (before the denominator)

    def as_list(self) -> list[float]:
        return [self.rows, self.covered, self.correct, self.loss_sum]


def in_head_dtype(head, x: torch.Tensor) -> torch.Tensor:
    """`x` in the dtype of `head`'s weight. The drafter's output is float32 (its final norm's weight is), and
    outside autocast F.linear takes one dtype: a bf16 target's head (`target.dtype: auto` on CUDA) projects
    it in bf16, as autocast would, instead of refusing it."""
    w = getattr(head, "weight", None)
    return x if w is None or x.dtype == w.dtype else x.to(w.dtype)


def _chunk_rows(lm_head, h, labels, tgt, need_ce: bool, need_kl: bool, model=None, prev=None):
    """Per-row CE and KL (zeros when not needed) and the argmax of one chunk of rows.

    With a DFlash2 `model` (and `prev` [rows], the gold predecessor tokens) the logits are the unary
    scores and the selector's part is added (`_selector_rows`); without, the last item is None."""
    logits = lm_head(in_head_dtype(lm_head, h)).float()                      # [rows, V]
    sel = None
    if model is not None:
        logits = model.unary(logits)
        sel = _selector_rows(model, logits, h, labels, prev)
    ce = F.cross_entropy(logits, labels, reduction="none") if need_ce else logits.new_zeros(labels.shape)
    if need_kl:
        logp = F.log_softmax(logits, dim=-1)
        tlogp = F.log_softmax(tgt.float(), dim=-1)
        kl = (tlogp.exp() * (tlogp - logp)).sum(-1)
    else:
        kl = logits.new_zeros(labels.shape)
    return ce, kl, logits.argmax(-1), sel


def _selector_rows(model, unary: torch.Tensor, h: torch.Tensor, labels: torch.Tensor, prev: torch.Tensor):
    """DFlash2's selector on supervised rows: (CE over the K candidates after the gold predecessor, with the
    gold label inserted as the K-th candidate when the unary top-K misses it; strict top-K ids [rows, K];
    their unary scores [rows, K]; gold covered [rows]; selector correct [rows] (strict, no insertion))."""
    k = model.top_k
    ids = torch.topk(unary.detach(), k, dim=-1).indices                      # [rows, K] strict candidates
    covered = (ids == labels[:, None]).any(-1)
    cand = ids.clone()
    cand[~covered, -1] = labels[~covered]                                    # gold insertion (training only)
    scores = model.candidate_selector.pair_scores(prev[:, None], cand, unary.gather(-1, cand), h)[:, 0]
    gold = (cand == labels[:, None]).long().argmax(-1)
    ce = F.cross_entropy(scores, gold, reduction="none")
    correct = covered & (scores.detach().argmax(-1) == gold)                 # with gold covered, cand == ids
    return ce, ids, unary.detach().gather(-1, ids), covered, correct


def dflash_loss(drafter, embed, lm_head, features: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                seq_lens: torch.Tensor, a: Anchors, *, mask_token_id: int, gamma: float | None,
                denom: float | None = None, loss: str = "ce", kl_weight: float = 1.0,
                target_logits: torch.Tensor | None = None, chunk_blocks: int = 64,
                attention: str = "sdpa", autocast_dtype: torch.dtype | None = None,
                vocab: torch.Tensor | None = None, label_ids: torch.Tensor | None = None,
                target_hidden: torch.Tensor | None = None, target_head=None,
                position_weighting: str = "decay", dpace_alpha: float = 0.5,
                selector_weight: float = 1.0, context: bool = True) -> LossOutput:
    """Drafter forward over all sampled blocks + the chunked weighted loss.

    Args:
        drafter: DFlashDraftModel (or a DDP/FSDP wrapper of it).
        embed, lm_head: the target's frozen embedding and output head (tied heads share the weight).
        features: [b, S, n_feat·H] target features (online or cached).
        input_ids, loss_mask: [b, S] (right-padded); seq_lens: [b].
        a: sampled anchors.
        denom: loss denominator (Σ w over the optimizer step); None = this batch's Σ w.
        loss: "ce" | "kl" | "ce+kl"; kl needs target_logits [b, S, V], or target_hidden [b, S, H] (the
            target's final-norm output) and target_head (its full lm_head): then only the supervised
            rows' target logits are computed, chunk by chunk.
        label_ids: [b, S] the label of each position (default input_ids; see labels_and_weights).
        chunk_blocks: blocks per logits chunk.
        attention: "sdpa" (dense bool mask) or "flex" (BlockMask; GPU training).
        vocab: a reduced draft vocabulary (sorted target ids [V'], on the batch's device); then
            `lm_head` must be the head over those V' rows (`draft_vocab.restricted_head`).
        position_weighting: "decay" (exp(−(k−1)/γ)) or "dpace" (`dpace_weights`, α = dpace_alpha;
            `gamma` is ignored and `denom` must be the step's count of supervised in-vocab positions,
            i.e. `weight_sum(..., gamma=None)`).
        selector_weight: a DFlash2 drafter's selector loss weight (the selector CE of each supervised row,
            with the same position weight as its unary CE; `_selector_rows`). DFlash2's unary CE and
            metrics use its unary scores (`DFlash2DraftModel.unary`).
        context: False = the no-features ablation: the blocks attend to themselves only (no target
            context at all, as a drafter run on an empty context). Zeroed features are not that: they
            fuse to a context of zeros whose keys/values still take softmax mass (q·0 = 0 per context
            position), so a long context drowns the block's own attention and the ablated drafter is
            broken, not merely uninformed (`features` is then unused).
    Returns:
        LossOutput (DFlash2: τ and accuracy of the walk, the unary argmax's beside them, SelectorStats).
    """
    bsz, s = input_ids.shape
    model = getattr(drafter, "module", drafter)
    B = model.block_size
    d2 = model if getattr(model.contract, "is_dflash2", False) else None
    if d2 is not None and vocab is not None:
        raise ValueError("a DFlash2 drafter trains over the full vocab (no reduced draft vocab)")
    n = a.anchors.shape[1]
    dpace = position_weighting == "dpace"
    labels, w = labels_and_weights(input_ids, loss_mask, seq_lens, a, block_size=B, gamma=None if dpace else gamma,
                                   label_ids=label_ids)
    sup = w.view(bsz, n, B) > 0                       # supervised positions: the metrics' denominators
    loss_labels = labels
    if vocab is not None:
        head_w = getattr(lm_head, "weight", None)
        if head_w is not None and head_w.shape[0] != vocab.numel():
            raise ValueError(f"lm_head has {head_w.shape[0]} rows but the draft vocab has {vocab.numel()} "
                             "tokens (pass draft_vocab.restricted_head(target_head, vocab))")
        loss_labels, inside = draft_labels(labels, vocab)
        w = w * inside                                # out-of-vocab labels: no loss, but still scored
    wsum = float(w.sum())
    denom = denom if denom is not None else wsum
    with torch.no_grad():
        noise = embed(block_input_ids(input_ids, a, mask_token_id=mask_token_id, block_size=B))
    ctx_len = s if context else 0
    ctx_feats = features if context else features[:, :0]
    pos = block_position_ids(a, ctx_len=ctx_len, block_size=B)
    make = flex_block_mask if attention == "flex" else dense_block_mask
    mask = make(a.anchors, a.keep, seq_lens.to(a.anchors.device), ctx_len=ctx_len, block_size=B)
    with torch.autocast(device_type=input_ids.device.type, dtype=autocast_dtype or torch.bfloat16,
                        enabled=autocast_dtype is not None):
        hidden = drafter(noise.to(features.dtype), ctx_feats, pos, attention_mask=mask)   # [b, N·B, H]
    # Only rows with w > 0 reach the vocab projection (slot 0 of every block, padded blocks and
    # unsupervised / past-the-end positions never do): the [rows, V] logits are the dominant cost.
    hidden = hidden.reshape(bsz * n * B, -1)
    rows = (w.flatten() > 0).nonzero().flatten()
    labels_f, w_f = loss_labels.flatten(), w.flatten()
    tgt_rows = None
    if loss != "ce":
        if target_logits is None and (target_hidden is None or target_head is None):
            raise ValueError("loss kl / ce+kl needs target_logits, or target_hidden and target_head")
        tgt_pos = (a.anchors[:, :, None] + torch.arange(B, device=input_ids.device) - 1).clamp(0, s - 1)
        row_batch = torch.arange(bsz, device=input_ids.device)[:, None, None].expand(bsz, n, B)
        tgt_rows = (row_batch.flatten(), tgt_pos.flatten())
    need_ce, need_kl = loss in ("ce", "ce+kl") or dpace, loss in ("kl", "ce+kl")
    prev_f = _predecessors(input_ids, label_ids, a, block_size=B).flatten() if d2 is not None else None
    ce_parts, kl_parts, sel_parts = [], [], []
    pred_flat = torch.full_like(labels_f, -1)
    step = max(1, chunk_blocks) * B
    for c0 in range(0, rows.numel(), step):
        r = rows[c0:c0 + step]
        tgt = None
        if tgt_rows is not None:
            if target_logits is not None:
                tgt = target_logits[tgt_rows[0][r], tgt_rows[1][r]]
            else:
                assert target_hidden is not None and target_head is not None  # checked above
                with torch.no_grad():
                    tgt = target_head(in_head_dtype(target_head, target_hidden[tgt_rows[0][r], tgt_rows[1][r]]))
        if tgt is not None and vocab is not None:
            tgt = tgt.index_select(-1, vocab)
        args = (lm_head, hidden[r], labels_f[r], tgt, need_ce, need_kl, d2, None if prev_f is None else prev_f[r])
        if step >= rows.numel() or not hidden.requires_grad:
            ce_r, kl_r, pred, sel = _chunk_rows(*args)
        else:
            ce_r, kl_r, pred, sel = checkpoint(_chunk_rows, *args, use_reentrant=False)
        ce_parts.append(ce_r)
        kl_parts.append(kl_r)
        sel_parts.append(sel)
        pred_flat[r] = pred
    ce_rows = torch.cat(ce_parts) if ce_parts else hidden.new_zeros(0, dtype=torch.float32)
    kl_rows = torch.cat(kl_parts) if kl_parts else hidden.new_zeros(0, dtype=torch.float32)
    if dpace:  # rows = the in-vocab supervised positions; out-of-vocab supervised ones: CE = +inf (q = 0)
        ce_grid = torch.full((bsz * n * B,), float("inf"), device=ce_rows.device)
        ce_grid[rows] = ce_rows.detach()
        row_w = dpace_weights(ce_grid.view(bsz, n, B), sup, alpha=dpace_alpha).flatten()[rows]
    else:
        row_w = w_f[rows]
    total = hidden.new_zeros((), dtype=torch.float32)
    if loss in ("ce", "ce+kl"):
        total = total + (row_w * ce_rows).sum()
    if loss in ("kl", "ce+kl"):
        total = total + (kl_weight if loss == "ce+kl" else 1.0) * (row_w * kl_rows).sum()
    sel_stats = None
    if d2 is not None:
        sel_ce = torch.cat([p[0] for p in sel_parts]) if sel_parts else ce_rows
        sel_loss = (row_w * sel_ce).sum()
        total = total + selector_weight * sel_loss
        sel_stats = SelectorStats(rows=float(rows.numel()),
                                  covered=float(sum(float(p[3].sum()) for p in sel_parts)),
                                  correct=float(sum(float(p[4].sum()) for p in sel_parts)),
                                  loss_sum=float(sel_loss.detach()))
    scaled = total / max(denom, 1e-6)
    with torch.no_grad():
        pred = pred_flat.view(bsz, n, B)
        if vocab is not None:  # draft index → target id; rows without logits stay -1 (wrong)
            pred = torch.where(pred >= 0, vocab[pred.clamp(min=0)], pred)
        ok = (pred == labels.view(bsz, n, B)) & sup
        correct = ok.sum(dim=(0, 1)).float().cpu()
        tot = sup.sum(dim=(0, 1)).float().cpu()
        tau_sum = _tau_sum(ok, a.keep)
        out = LossOutput(loss=scaled, weight_sum=wsum, correct=correct, total=tot,
                         tau_sum=tau_sum, blocks=int(a.keep.sum()), selector=sel_stats)
        if d2 is not None:  # the walk is what the decoder drafts: τ and accuracy are the walk's
            walked = _walk_tokens(d2, hidden.detach(), rows, sel_parts, input_ids, a, block_size=B)
            walk_ok = (walked == labels.view(bsz, n, B)) & sup
            out.unary_correct, out.unary_tau_sum = correct, tau_sum
            out.correct, out.tau_sum = walk_ok.sum(dim=(0, 1)).float().cpu(), _tau_sum(walk_ok, a.keep)
    return out


def _tau_sum(ok: torch.Tensor, keep: torch.Tensor) -> float:
    """Σ over real blocks of 1 + the leading correct positions (ok [b, N, B], slot 0 ignored)."""
    lead = torch.cumprod(ok[:, :, 1:].long(), dim=-1).sum(-1)
    return float(((1 + lead).float() * keep.float()).sum())


def _predecessors(input_ids: torch.Tensor, label_ids: torch.Tensor | None, a: Anchors, *,
                  block_size: int) -> torch.Tensor:
    """[b, N, B] the gold token before each block position: the anchor x[a] at k = 1, the label of
    position k − 1 after it (slot 0: unused). Positions past the sequence take its last token."""
    src = input_ids if label_ids is None else label_ids
    s = input_ids.shape[1]
    pos = (a.anchors[:, :, None] + torch.arange(block_size, device=input_ids.device) - 1).clamp(0, s - 1)
    b, n = a.anchors.shape
    prev = torch.gather(src, 1, pos.view(b, -1)).view(b, n, block_size).clone()
    prev[:, :, 1] = torch.gather(input_ids, 1, a.anchors)
    return prev


@torch.no_grad()
def _walk_tokens(model, hidden: torch.Tensor, rows: torch.Tensor, sel_parts: list, input_ids: torch.Tensor,
                 a: Anchors, *, block_size: int) -> torch.Tensor:
    """[b, N, B] the greedy walk's tokens per block (slot 0: −1), from the supervised rows' strict top-K.

    Rows without logits (unsupervised) get candidate id 0 and unary 0; the walk through them is never
    scored (τ and accuracy count supervised positions only and stop at the first unsupervised one)."""
    b, n = a.anchors.shape
    k = model.top_k
    cand = torch.zeros(b * n * block_size, k, dtype=torch.long, device=hidden.device)
    unary = torch.zeros(b * n * block_size, k, dtype=torch.float32, device=hidden.device)
    if sel_parts:
        cand[rows] = torch.cat([p[1] for p in sel_parts])
        unary[rows] = torch.cat([p[2] for p in sel_parts])
    cand, unary = cand.view(b * n, block_size, k)[:, 1:], unary.view(b * n, block_size, k)[:, 1:]
    h = hidden.view(b * n, block_size, -1)[:, 1:]
    anchor = torch.gather(input_ids, 1, a.anchors).flatten()
    tokens, _ = walk_path(model.candidate_selector, cand, unary, h, anchor)
    out = torch.full((b * n, block_size), -1, dtype=torch.long, device=hidden.device)
    out[:, 1:] = tokens
    return out.view(b, n, block_size)


def target_label_ids(input_ids: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
    """[b, S] labels from the target: position t gets `next_ids[t−1]` (the target's argmax after x[..t−1]);
    position 0 keeps x[0] (never a label: slot 0 is unweighted)."""
    return torch.cat([input_ids[:, :1], next_ids[:, :-1].to(input_ids.dtype)], dim=1)


def gamma_for(train_gamma: float | None, block_size: int) -> float:
    """`train.gamma` if set, else the reference default for B."""
    from dflashkit.model.drafter_config import default_gamma

    return float(train_gamma) if train_gamma else default_gamma(block_size)
