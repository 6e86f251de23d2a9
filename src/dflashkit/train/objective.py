"""The DFlash training objective (dflash-spec §3.4): the pure functions the loss (train/loss.py) is made of.

Usage:
    anchors = sample_anchors(loss_mask, seq_lens, num_anchors=512, block_size=B, seeds=[...])
    ids = block_input_ids(input_ids, anchors, mask_token_id=m, block_size=B)      # [b, N·B]
    labels, w = labels_and_weights(input_ids, loss_mask, seq_lens, anchors, block_size=B, gamma=7.0)
    denom = weight_sum(loss_mask, seq_lens, anchors, input_ids=input_ids, block_size=B, gamma=7.0)
    w = dpace_weights(ce, supervised, alpha=0.5)                                  # D-PACE position weights

Rules (each pinned by a test):
  * Anchor p of a sequence of true length L is a candidate iff p + 1 < L and loss_mask[p] and
    loss_mask[p+1] (the anchor and its first prediction are supervised). Block positions that run
    past L get weight 0. Up to `num_anchors` distinct candidates per sequence are drawn uniformly
    without replacement (a per-sample seeded generator, so the draw does not depend on the batch
    a sample lands in, nor on the number of ranks) and sorted; rows are padded with anchor 0 and
    keep=False.
  * Block j input = [x[a_j], MASK × (B−1)], positions a_j … a_j+B−1; context positions 0 … S−1.
  * Packed rows (`train.pack`, `Batch.docs`): each document draws its anchors as it would alone (its own
    seed and `num_anchors` cap, shifted by its offset in the row), the candidate rule reads "L" as the
    document's end, positions restart at 0 per document, and `Anchors.starts` / `Anchors.ends` hold each
    anchor's document span (the mask's `starts`; block positions at or past `ends` get weight 0). What the
    drafter sees for a block is then the same as unpacked (`tests/train/test_packing.py`).
  * Same-position labels: block j position k is trained to predict x[a_j + k] (pitfall §3.7.1); with
    `train.labels=target` the target's argmax at a_j+k−1, and with `train.on_path` the target's own greedy
    path after x[..a_j] (`path_ids`, rollout) or only the positions where the two agree (`on_path_only`,
    mask): `model/path_labels.py`.
  * Weight w = keep·[a_j+k < L]·[k > 0]·loss_mask[a_j+k]·exp(−(k−1)/γ).
  * The loss divides by denom = Σ w over the whole optimizer step (`weight_sum` of every micro-batch
    and rank, in-vocab labels only), so micro-batching, accumulation and world size do not change it.
  * D-PACE (arXiv 2605.18810) replaces the fixed decay by weights from the drafter's own confidence,
    computed in the forward and detached (`dpace_weights`): q_k = exp(−CE_k), q̃_k = (1−α)·q_k + α,
    w_j = Σ_{m≥j} Π_{1≤i≤m} q̃_i. The denominator is then the step's count of supervised in-vocab
    positions (`weight_sum(..., gamma=None)`, known before the forward).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dflashkit.family.contract import default_gamma
from dflashkit.model.draft_vocab import draft_labels
from dflashkit.model.path_labels import on_path_weights, path_label_ids


@dataclass
class Anchors:
    """Sampled blocks: `anchors` [b, N] (int64, padded with 0) and `keep` [b, N] (bool); in packed rows also
    `starts` / `ends` [b, N], the row span [start, end) of each anchor's document, and `positions` [b, S], each
    token's position in its own document (all None: one document per row)."""

    anchors: torch.Tensor
    keep: torch.Tensor
    starts: torch.Tensor | None = None
    ends: torch.Tensor | None = None
    positions: torch.Tensor | None = None


def _draw(lm: torch.Tensor, n_i: int, seed: int, num_anchors: int, coverage: float | None) -> torch.Tensor:
    """The sorted anchors of one document of length `n_i` (`lm` its loss mask, length >= n_i)."""
    row = lm[:n_i]
    valid = torch.zeros(n_i, dtype=torch.bool)
    if n_i >= 2:
        valid[:-1] = row[:-1].cpu() & row[1:].cpu()
    cand = valid.nonzero().flatten()
    g = torch.Generator().manual_seed(int(seed) & 0x7FFFFFFFFFFFFFFF)
    keys = torch.rand(n_i, generator=g)[cand]
    take = min(num_anchors, cand.numel())
    if coverage is not None:
        take = min(take, math.ceil(coverage * cand.numel()))
    return torch.sort(cand[torch.argsort(keys)[:take]]).values


def sample_anchors(loss_mask: torch.Tensor, seq_lens: torch.Tensor, *, num_anchors: int, block_size: int,
                   seeds: list[int], coverage: float | None = None,
                   docs: list[list[tuple[int, int]]] | None = None) -> Anchors:
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
        docs: packed rows (`Batch.docs`): per row its documents' (length, seed) in order; each document
            draws as a sequence of its own (`seeds` is then unused) and the result carries the spans.
    Returns:
        Anchors with N = min(num_anchors, max candidates in the batch), at least 1.
    """
    del block_size
    b, s = loss_mask.shape
    lm = loss_mask.bool()
    picks: list[torch.Tensor] = []
    spans: list[tuple[torch.Tensor, torch.Tensor]] = []
    positions = torch.zeros(b, s, dtype=torch.long)
    for i in range(b):
        if docs is None:
            picks.append(_draw(lm[i], int(seq_lens[i]), seeds[i], num_anchors, coverage))
            continue
        got, st, en, off = [], [], [], 0
        for n_d, seed_d in docs[i]:
            p = _draw(lm[i, off:off + n_d], n_d, seed_d, num_anchors, coverage) + off
            got.append(p)
            st.append(torch.full_like(p, off))
            en.append(torch.full_like(p, off + n_d))
            positions[i, off:off + n_d] = torch.arange(n_d)
            off += n_d
        empty = torch.zeros(0, dtype=torch.long)
        picks.append(torch.cat(got) if got else empty)
        spans.append((torch.cat(st) if st else empty, torch.cat(en) if en else empty))
    n = max(1, max(p.numel() for p in picks))
    anchors = torch.zeros(b, n, dtype=torch.long)
    keep = torch.zeros(b, n, dtype=torch.bool)
    for i, p in enumerate(picks):
        anchors[i, :p.numel()] = p
        keep[i, :p.numel()] = True
    dev = loss_mask.device
    if docs is None:
        return Anchors(anchors.to(dev), keep.to(dev))
    starts = torch.zeros(b, n, dtype=torch.long)
    ends = torch.zeros(b, n, dtype=torch.long)  # padded blocks: an empty span (no weight; keep=False anyway)
    for i, (st_i, en_i) in enumerate(spans):
        starts[i, :st_i.numel()] = st_i
        ends[i, :en_i.numel()] = en_i
    return Anchors(anchors.to(dev), keep.to(dev), starts.to(dev), ends.to(dev), positions.to(dev))


def block_input_ids(input_ids: torch.Tensor, a: Anchors, *, mask_token_id: int, block_size: int) -> torch.Tensor:
    """[b, N·B] ids: slot 0 of block j = input_ids[a_j] (mask id for padded blocks), rest = mask id."""
    b, n = a.anchors.shape
    ids = torch.full((b, n, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    first = torch.gather(input_ids, 1, a.anchors)
    ids[:, :, 0] = torch.where(a.keep, first, torch.full_like(first, mask_token_id))
    return ids.view(b, n * block_size)


def block_position_ids(a: Anchors, *, ctx_len: int, block_size: int) -> torch.Tensor:
    """[b, S + N·B]: context 0 … S−1, then block j → a_j … a_j+B−1 (packed rows: in-document positions)."""
    b, n = a.anchors.shape
    dev = a.anchors.device
    ctx = (torch.arange(ctx_len, device=dev).expand(b, ctx_len) if a.positions is None
           else a.positions[:, :ctx_len])
    first = a.anchors if a.starts is None else a.anchors - a.starts
    blk = (first[:, :, None] + torch.arange(block_size, device=dev)).view(b, n * block_size)
    return torch.cat([ctx, blk], dim=1)


def labels_and_weights(input_ids: torch.Tensor, loss_mask: torch.Tensor, seq_lens: torch.Tensor, a: Anchors, *,
                       block_size: int, gamma: float | None, label_ids: torch.Tensor | None = None,
                       path_ids: torch.Tensor | None = None,
                       on_path_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Same-position labels and loss weights, both [b, N·B] (labels 0 where the weight is 0).

    `label_ids` [b, S] (default `input_ids`) is the label of each position: with `train.labels=target`
    it holds the target's greedy prediction for position t (its argmax at t−1; `target_label_ids`).
    `path_ids` [b, S, D] (`train.on_path=rollout`): position k ≥ 1 of anchor a learns the target's own
    greedy path instead, path_ids[a, k−1] (`model/path_labels.py`). `on_path_only` (`train.on_path=mask`;
    `label_ids` must be the target's argmax labels): weight 0 for the positions past the first raw token
    of the block that differs from the target's argmax (`on_path_weights`)."""
    b, n = a.anchors.shape
    dev = input_ids.device
    k = torch.arange(block_size, device=dev)
    pos = a.anchors[:, :, None] + k                                           # [b, N, B]
    inside = pos < seq_lens.to(dev)[:, None, None]
    if a.ends is not None:  # packed rows: the block's labels stay inside the anchor's document
        inside = inside & (pos < a.ends[:, :, None])
    safe = torch.where(inside, pos, torch.zeros_like(pos)).view(b, -1)
    labels = torch.gather(input_ids if label_ids is None else label_ids, 1, safe).view(b, n, block_size)
    if path_ids is not None:
        labels = path_label_ids(path_ids.to(labels.dtype), a.anchors, block_size)
    sup = torch.gather(loss_mask.to(torch.float32), 1, safe).view(b, n, block_size)
    decay = torch.exp(-(k.float() - 1).clamp(min=0) / gamma) if gamma else torch.ones(block_size, device=dev)
    decay = decay * (k > 0).float()
    w = a.keep[:, :, None].float() * inside.float() * sup * decay
    if on_path_only:
        if label_ids is None:
            raise ValueError("on_path_only needs label_ids, the target's argmax labels (target_label_ids)")
        w = w * on_path_weights(input_ids, label_ids, seq_lens, a.anchors, block_size=block_size)
    if path_ids is not None and bool(((labels < 0) & (w > 0)).any()):
        raise ValueError("path_ids lacks the greedy path of a supervised block position (computed for other rows)")
    labels = torch.where(w > 0, labels, torch.zeros_like(labels))
    return labels.view(b, -1), w.view(b, -1)


def weight_sum(loss_mask, seq_lens, a: Anchors, *, input_ids, block_size: int, gamma: float | None,
               vocab: torch.Tensor | None = None, label_ids: torch.Tensor | None = None,
               path_ids: torch.Tensor | None = None, on_path_only: bool = False) -> float:
    """Σ w of one micro-batch (summed over the step to form the loss denominator; in-vocab labels only)."""
    labels, w = labels_and_weights(input_ids, loss_mask, seq_lens, a, block_size=block_size, gamma=gamma,
                                   label_ids=label_ids, path_ids=path_ids, on_path_only=on_path_only)
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


def target_label_ids(input_ids: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
    """[b, S] labels from the target: position t gets `next_ids[t−1]` (the target's argmax after x[..t−1]);
    position 0 keeps x[0] (never a label: slot 0 is unweighted)."""
    return torch.cat([input_ids[:, :1], next_ids[:, :-1].to(input_ids.dtype)], dim=1)


def gamma_for(train_gamma: float | None, block_size: int) -> float:
    """`train.gamma` if set, else the reference default for B."""
    return float(train_gamma) if train_gamma else default_gamma(block_size)
