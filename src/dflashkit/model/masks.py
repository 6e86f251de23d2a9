"""Block-diffusion training attention masks (dflash-spec §3.4 step 4), dense and flex forms.

Usage:
    mask = dense_block_mask(anchors, keep, seq_lens, ctx_len=S, block_size=B)   # bool [b,1,N·B,S+N·B]
    bm = flex_block_mask(anchors, keep, seq_lens, ctx_len=S, block_size=B)      # flex BlockMask (GPU)
    mask = dense_block_mask(anchors, keep, seq_lens, ctx_len=S, block_size=B, causal=True)   # JetSpec
    h = drafter(noise, feats, pos, attention_mask=mask)
    m = inference_mask(ctx_len=t, q_len=B, device=dev)        # decoding a causal drafter: [q, t + q]
    masks = layer_masks(dense_block_mask, anchors, keep, seq_lens, ctx_len=S, block_size=B,
                        windows=model.layer_windows, causals=model.layer_causal)  # {(W, causal): mask} or one mask

Layout: queries are the N·B block tokens (block j = queries j·B … j·B+B-1); keys/values are the
S context tokens followed by the N·B block tokens. The rule, stated once:
  * a query of block j sees context key i iff  i < anchors[j]  (STRICT: the anchor's own target
    feature is not known at inference, pitfall §3.7.2) and i < seq_len (padding is never visible)
    and the block is real (keep[j]);
  * it sees every token of its own block (bidirectional), and never another block;
  * causal (`drafter.causal`, JetSpec): of its own block only the offsets j <= its own offset i;
  * a sliding-window layer (window W, `drafter.sliding_window`): a query at position p (block j's
    offset k sits at p = anchors[j] + k) sees context key i only if also p − W < i (`layer_masks`);
  * packed rows (`train.pack`, `starts` [b, N]: where the anchor's document starts): also starts[j] <= i.
Padded / invalid blocks still see their own block, so no softmax row is empty (no NaN, pitfall
§3.7.5); their loss weight is 0. A mask is [N·B, S + N·B], never [S, S].
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import create_block_mask


def dense_block_mask(anchors: torch.Tensor, keep: torch.Tensor, seq_lens: torch.Tensor, *,
                     ctx_len: int, block_size: int, causal: bool = False, window: int | None = None,
                     starts: torch.Tensor | None = None) -> torch.Tensor:
    """The dense boolean SDPA mask (True = may attend).

    Args:
        anchors: [b, N] anchor positions (int).
        keep: [b, N] bool, real blocks.
        seq_lens: [b] true (unpadded) sequence lengths.
        ctx_len: S, the padded context length.
        block_size: B.
        causal: block offset i sees offsets j <= i of its block only (else the whole block).
        window: a sliding layer's W (None: full attention): context keys i > p − W only, p the query's position.
        starts: [b, N] where each anchor's document starts in its packed row (None: at 0).
    Returns:
        bool [b, 1, N·B, S + N·B].
    """
    b, n = anchors.shape
    dev = anchors.device
    ctx_idx = torch.arange(ctx_len, device=dev)
    limit = torch.minimum(anchors, seq_lens[:, None].to(anchors.dtype))          # [b, N]
    ctx = (ctx_idx[None, None, :] < limit[:, :, None]) & keep[:, :, None]       # [b, N, S]
    if starts is not None:
        ctx = ctx & (ctx_idx[None, None, :] >= starts[:, :, None])
    ctx = ctx.repeat_interleave(block_size, dim=1)                              # [b, N·B, S]
    q_id = torch.arange(n * block_size, device=dev)
    if window is not None:
        q_pos = anchors.repeat_interleave(block_size, dim=1) + q_id % block_size  # [b, N·B]
        ctx = ctx & (ctx_idx[None, None, :] > q_pos[:, :, None] - window)
    own = (q_id[:, None] // block_size == q_id[None, :] // block_size)         # [N·B, N·B]
    if causal:
        own = own & (q_id[None, :] <= q_id[:, None])                          # same block: offset j <= i
    return torch.cat([ctx, own.expand(b, -1, -1)], dim=-1).unsqueeze(1)


def mask_mod_for(anchors: torch.Tensor, keep: torch.Tensor, seq_lens: torch.Tensor, *,
                 ctx_len: int, block_size: int, causal: bool = False, window: int | None = None,
                 starts: torch.Tensor | None = None):
    """A flex-attention `mask_mod(b, h, q_idx, kv_idx)` implementing the same rule as the dense mask."""
    n = anchors.shape[1]
    limit = torch.minimum(anchors, seq_lens[:, None].to(anchors.dtype)) * keep.to(anchors.dtype)

    def mask_mod(b, h, q_idx, kv_idx):
        j = (q_idx // block_size).clamp(0, n - 1)  # clamp: flex may probe padded q rows (§3.7.5)
        in_ctx = kv_idx < ctx_len
        ctx_ok = kv_idx < limit[b, j]
        if starts is not None:  # packed rows: keys of the anchor's own document only
            ctx_ok = ctx_ok & (kv_idx >= starts[b, j])
        if window is not None:  # the query's position: its block's anchor + its offset
            ctx_ok = ctx_ok & (kv_idx > anchors[b, j] + q_idx % block_size - window)
        own_ok = ((kv_idx - ctx_len) // block_size == j) & (kv_idx >= ctx_len)
        if causal:  # the block key's offset (kv_idx − S) mod B <= the query's: in one block, kv − S <= q
            own_ok = own_ok & (kv_idx - ctx_len <= q_idx)
        return torch.where(in_ctx, ctx_ok, own_ok)

    return mask_mod


def flex_block_mask(anchors: torch.Tensor, keep: torch.Tensor, seq_lens: torch.Tensor, *,
                    ctx_len: int, block_size: int, causal: bool = False, window: int | None = None,
                    starts: torch.Tensor | None = None):
    """The same mask as a flex-attention `BlockMask` (use with `drafter.attention=flex`)."""
    b, n = anchors.shape
    mod = mask_mod_for(anchors, keep, seq_lens, ctx_len=ctx_len, block_size=block_size, causal=causal,
                       window=window, starts=starts)
    return create_block_mask(mod, B=b, H=None, Q_LEN=n * block_size, KV_LEN=ctx_len + n * block_size,
                             device=anchors.device)


def layer_masks(make, anchors: torch.Tensor, keep: torch.Tensor, seq_lens: torch.Tensor, *, ctx_len: int,
                block_size: int, causal: bool = False, windows: list[int | None] | None = None,
                causals: list[bool] | None = None, starts: torch.Tensor | None = None):
    """The training mask(s) of a drafter whose layers have `windows` (per layer W or None; None: all full) and
    in-block causality `causals` (per layer; None: every layer `causal`).

    `make` is `dense_block_mask` or `flex_block_mask`; `starts`: packed rows' document starts per anchor.
    Returns one mask when every layer attends alike, else a dict {(window, causal): mask} with one entry per
    distinct pair (the drafter picks its layer's)."""
    n = max(len(windows or ()), len(causals or ()), 1)
    kinds = list(dict.fromkeys(zip(windows or [None] * n, causals or [causal] * n)))
    masks = {(w, c): make(anchors, keep, seq_lens, ctx_len=ctx_len, block_size=block_size, causal=c, window=w,
                         starts=starts)
             for w, c in kinds}
    return masks[kinds[0]] if len(masks) == 1 else masks


def window_mask(q_pos: torch.Tensor, ctx_pos: torch.Tensor, window: int | None) -> torch.Tensor | None:
    """The context part of a sliding layer's decoding mask: bool [..., q, t] from positions q_pos [..., q] and
    ctx_pos [..., t]; the query at q_pos[r] sees the context key at ctx_pos[c] iff ctx_pos[c] > q_pos[r] − window
    (None: full attention, nothing to mask)."""
    if window is None:
        return None
    return ctx_pos[..., None, :] > q_pos[..., :, None] - window


def inference_mask(*, ctx_len: int, q_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Decoding a causal drafter (one block of q tokens after t = `ctx_len` context tokens): bool [q, t + q],
    row i sees the whole context and block offsets 0 … i. (A bidirectional drafter decodes without a mask.)"""
    return torch.ones(q_len, ctx_len + q_len, dtype=torch.bool, device=device).tril(diagonal=ctx_len)


def loop_block_mask(anchors: list[list[int]], keep: list[list[bool]], seq_lens: list[int], *,
                    ctx_len: int, block_size: int, causal: bool = False) -> torch.Tensor:
    """Slow pure-Python oracle of `dense_block_mask` (tests only; the rule written as loops)."""
    b, n = len(anchors), len(anchors[0])
    q_len, kv_len = n * block_size, ctx_len + n * block_size
    out = torch.zeros(b, 1, q_len, kv_len, dtype=torch.bool)
    for bi in range(b):
        for j in range(n):
            for k in range(block_size):
                q = j * block_size + k
                for i in range(ctx_len):
                    if keep[bi][j] and i < anchors[bi][j] and i < seq_lens[bi]:
                        out[bi, 0, q, i] = True
                for kk in range(block_size):
                    if kk <= k or not causal:
                        out[bi, 0, q, ctx_len + j * block_size + kk] = True
    return out
