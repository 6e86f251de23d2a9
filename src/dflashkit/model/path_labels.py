"""On-path labels: the target's own greedy continuation after every raw prefix, and the cheap mask.

Usage:
    cache = path_cache()                                    # the prefill's KV cache, kept for the rollout
    feats, last = target.features(ids, layer_ids=ids_, need_last_hidden=True, attention_mask=att,
                                  **with_cache(target, cache))
    nxt = target.next_token_ids(last)                       # [b, S] = path_ids[:, :, 0]
    need = label_need(loss_mask, seq_lens, depth=B - 1)     # the rows / levels block labels read
    path = greedy_path_ids(target, ids, seq_lens, B - 1, next_ids=nxt, cache=cache, need=need)
    path.path_ids                                           # [b, S, D] int64, -1 where not needed
    path.rolled                                             # target tokens fed beyond the prefill
    w = on_path_weights(ids, target_labels, seq_lens, anchors, block_size=B)   # the mask mode, [b, N, B]

Definitions: path_ids[t, j] = the target's greedy argmax after x[0..t], path_ids[t, 0..j−1]. The on-path label of block position k ≥ 1 of
anchor a is path_ids[a, k−1]: what verification compares a draft with. Shortcut: if x[t+1] ==
path_ids[t, 0] then path_ids[t, j] = path_ids[t+1, j−1], so only rows where the raw next token
disagrees with the argmax ("rollout rows") cost target work.

`greedy_path_ids` (the "rollout", exact) reuses the prefill's KV cache and feeds level j at position
t + j of every rollout row under a custom 4-D mask (cached raw tokens 0..t plus the row's own earlier
levels), `chunk_rows` at a time, cropping the cache back after each chunk. Full-attention targets only;
a sliding-window or linear-attention layer is refused (`attention_limit`). `on_path_weights` (the
"mask", free) keeps block position k ≥ 2 only where every raw token since the anchor agrees with the
target's argmax, where next_ids[a+k−1] is the on-path label (docs/training-data.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from dflashkit.errors import UsageError
from dflashkit.target.load import cache_kwarg


@dataclass
class GreedyPath:
    """`path_ids` [b, S, D] int64 (−1 where `need` was False) and what it cost."""

    path_ids: torch.Tensor
    rolled: int          # target tokens fed beyond the prefill (rollout rows × their levels)
    rollout_rows: int    # rows whose raw next token disagrees with the argmax and that needed levels ≥ 1
    raw_tokens: int      # real tokens of the batch (Σ seq_lens)


def path_depth(block_size: int) -> int:
    """D for training block size B: labels of positions 1 … B−1 read levels 0 … B−2."""
    return max(1, int(block_size) - 1)


def with_cache(target: Any, cache: Any) -> dict[str, Any]:
    """The forward keywords that fill `cache` (its name by transformers version: `target.load.cache_kwarg`)."""
    return {cache_kwarg(target.model): cache, "use_cache": True}


def path_cache() -> Any:
    """A KV cache for the prefill whose layers all keep every position (the rollout indexes it by position)."""
    return DynamicCache()


def attention_limit(config: Any, length: int) -> str | None:
    """Why the rollout's mask (every raw token 0 … t) is not what the target attends to over `length` tokens,
    or None: a layer type other than full attention, or a sliding window / attention chunk shorter than
    `length` (a window at least as long as the sequence never binds). `config`: the target's HF config or its
    config.json dict."""
    def get(key: str) -> Any:
        return config.get(key) if isinstance(config, dict) else getattr(config, key, None)

    window, chunk = get("sliding_window"), get("attention_chunk_size")
    types = get("layer_types")
    if types is None:  # older configs: a sliding window applies to every layer unless switched off
        types = ["sliding_attention" if window and get("use_sliding_window") is not False else "full_attention"]
    for kind in sorted(set(types) - {"full_attention"}):
        span = window if kind == "sliding_attention" else chunk if kind == "chunked_attention" else None
        if span is None or int(span) < length:
            return f"{kind} layers" + (f" (window {span} < {length} tokens)" if span is not None else "")
    return None


def check_full_attention(config: Any, length: int) -> None:
    """Refuse a rollout over `length` tokens whose attention the rollout's mask would not reproduce."""
    why = attention_limit(config, length)
    if why:
        raise UsageError(f"train.on_path=rollout: the target has {why}; the greedy-path rollout reproduces full "
                         "attention over the whole prefix only",
                         hint="use train.on_path=mask (free, no target work), or shorter samples (tokenize.max_length)")


def label_need(loss_mask: torch.Tensor, seq_lens: torch.Tensor, depth: int,
               anchors: torch.Tensor | None = None, keep: torch.Tensor | None = None) -> torch.Tensor:
    """[b, S, D] bool: the (row, level) pairs block labels read. Rows: the anchors (`anchors`/`keep`
    [b, N]), or every anchor candidate (loss_mask[t] and loss_mask[t+1], t + 1 < L); level j of row t
    only while the label's position t + j + 1 is inside the sequence."""
    b, s = loss_mask.shape
    dev = loss_mask.device
    t = torch.arange(s, device=dev)
    lens = seq_lens.to(dev)[:, None]
    if anchors is None:
        lm = loss_mask.bool() & (t < lens)
        rows = torch.zeros_like(lm)
        rows[:, :-1] = lm[:, :-1] & lm[:, 1:]
    else:
        rows = torch.zeros(b, s, dtype=torch.bool, device=dev)
        kp = (keep if keep is not None else torch.ones_like(anchors, dtype=torch.bool)).to(dev)
        which = torch.arange(b, device=dev)[:, None].expand_as(anchors)
        rows[which[kp], anchors.to(dev)[kp]] = True   # padded anchors (keep False, index 0) mark nothing
        rows &= t < lens
    j = torch.arange(depth, device=dev)
    inside = (t[:, None] + j[None] + 1)[None] < lens[:, :, None]      # [b, S, D]
    return rows[:, :, None] & inside


def _closure(need: torch.Tensor, agree: torch.Tensor) -> torch.Tensor:
    """Add what the shortcut reads: need[t, j] on an agreeing row t needs need[t+1, j−1]."""
    need = need.clone()
    for j in range(need.shape[-1] - 1, 0, -1):
        need[:, 1:, j - 1] |= need[:, :-1, j] & agree[:, :-1]
    return need


def _prefill_argmax(target: Any, input_ids: torch.Tensor, att: torch.Tensor, cache: Any) -> torch.Tensor:
    """The target's argmax after every prefix [b, S], filling `cache`: the base model's final-norm states, then the
    head a chunk of rows at a time, so the [b, S, V] logits never exist at once (a 152k vocab at S = 4096 takes
    GBs); a sharded target (FSDP: DTensor weights, unsharded by its root's forward) runs its whole forward."""
    if type(next(target.model.parameters())).__name__ == "DTensor":
        return target.model(input_ids=input_ids, attention_mask=att, **with_cache(target, cache)).logits.argmax(-1)
    out = target.model.model(input_ids=input_ids, attention_mask=att, **with_cache(target, cache))
    return target.next_token_ids(out.last_hidden_state)


@torch.no_grad()
def greedy_path_ids(target: Any, input_ids: torch.Tensor, seq_lens: torch.Tensor, depth: int, *,
                    next_ids: torch.Tensor | None = None, cache: Any = None,
                    attention_mask: torch.Tensor | None = None, need: torch.Tensor | None = None,
                    chunk_rows: int = 128) -> GreedyPath:
    """The target's greedy continuation of depth D after every raw prefix (see the module doc).

    Args:
        target: a `target.load.Target` (its HF model is called with a KV cache, position ids and a 4-D mask).
        input_ids: [b, S] right-padded raw tokens; seq_lens: [b].
        depth: D.
        next_ids, cache: the prefill's argmax [b, S] and its KV cache (`path_cache`, filled by the forward
            that gave the features); both None = run the prefill here.
        attention_mask: [b, S] 0/1 for that prefill (default: from seq_lens).
        need: [b, S, D] bool, the entries wanted (default: every t < L, every level); `label_need`.
        chunk_rows: rollout rows per sequence per target call.
    Returns:
        GreedyPath; path_ids[t, j] is exact wherever `need[t, j]`, −1 elsewhere.
    """
    b, s = input_ids.shape
    if depth > 1:  # the deepest rollout token sits at position s − 1 + (D − 1) and attends back to position 0
        check_full_attention(target.config, s + depth - 1)
    dev = input_ids.device
    lens = seq_lens.to(dev)
    t_idx = torch.arange(s, device=dev)
    valid = t_idx[None] < lens[:, None]                                        # [b, S]
    if need is None:
        need = valid[:, :, None].expand(b, s, depth).clone()
    need = need.to(dev) & valid[:, :, None]
    if next_ids is None or cache is None:
        att = attention_mask if attention_mask is not None else valid.long()
        cache = path_cache()
        next_ids = _prefill_argmax(target, input_ids, att, cache)
    next_ids = next_ids.to(dev).long()
    agree = torch.zeros(b, s, dtype=torch.bool, device=dev)
    agree[:, :-1] = (input_ids[:, 1:] == next_ids[:, :-1]) & (t_idx[None, 1:] < lens[:, None])
    asked, need = need, _closure(need, agree)
    path = torch.full((b, s, depth), -1, dtype=torch.long, device=dev)
    path[:, :, 0] = torch.where(valid, next_ids, torch.full_like(next_ids, -1))
    deepest = (need[:, :, 1:] * torch.arange(1, depth, device=dev)).amax(-1) if depth > 1 else \
        torch.zeros(b, s, dtype=torch.long, device=dev)
    levels = deepest * (~agree & valid)                                        # [b, S] levels ≥ 1 to roll
    rolled = int(levels.sum())
    if depth > 1 and rolled:
        if cache.get_seq_length() != s:
            raise ValueError(f"the prefill cache holds {cache.get_seq_length()} positions, the batch {s}")
        _rollout(target, cache, path, levels, s, chunk_rows=max(1, chunk_rows))
    for j in range(1, depth):  # the shortcut, level by level (level j−1 is complete before level j)
        path[:, :-1, j] = torch.where(agree[:, :-1], path[:, 1:, j - 1], path[:, :-1, j])
    path[:, :, 1:] = torch.where(asked[:, :, 1:], path[:, :, 1:], torch.full_like(path[:, :, 1:], -1))
    return GreedyPath(path, rolled, int((levels > 0).sum()), int(lens.sum()))


def _rollout(target: Any, cache: Any, path: torch.Tensor, levels: torch.Tensor, s: int, *, chunk_rows: int) -> None:
    """Fill path[t, 1 … levels[t]] of the rollout rows in place (see the module doc)."""
    b = path.shape[0]
    dev = path.device
    per_row = [levels[i].nonzero().flatten() for i in range(b)]               # each sequence's rollout rows
    most = max(r.numel() for r in per_row)
    for c0 in range(0, most, chunk_rows):
        rows = [r[c0:c0 + chunk_rows] for r in per_row]
        q = max(r.numel() for r in rows)
        row_t = torch.full((b, q), -1, dtype=torch.long, device=dev)          # padded slots: −1
        for i, r in enumerate(rows):
            row_t[i, :r.numel()] = r
        real = row_t >= 0
        safe_t = row_t.clamp(min=0)
        row_levels = torch.where(real, torch.gather(levels, 1, safe_t), torch.zeros_like(row_t))
        owner = torch.empty(b, 0, dtype=torch.long, device=dev)               # row of each appended kv slot
        raw_part = (torch.arange(s, device=dev)[None, None] <= row_t[:, :, None]) & real[:, :, None]  # [b, q, S]
        for j in range(1, int(row_levels.max()) + 1):
            active = real & (row_levels >= j)
            slot_t = torch.where(active, row_t, torch.full_like(row_t, -1))
            owner = torch.cat([owner, slot_t], dim=1)
            own = (owner[:, None, :] == slot_t[:, :, None])                    # own earlier levels + itself
            raw = raw_part & active[:, :, None]
            mask = torch.cat([raw, own], dim=2)[:, None]                       # [b, 1, q, S + appended]
            tok = torch.where(active, torch.gather(path[:, :, j - 1], 1, safe_t), torch.zeros_like(row_t))
            pos = torch.where(active, safe_t + j, torch.zeros_like(row_t))
            logits = target.model(input_ids=tok, position_ids=pos, attention_mask=_as_mask(mask, target),
                                  **with_cache(target, cache)).logits
            got = logits.argmax(-1)                                            # [b, q]
            for i in range(b):
                sel = active[i]
                path[i, row_t[i, sel], j] = got[i, sel]
        appended = cache.get_seq_length() - s
        if appended:
            cache.crop(-appended)


def _as_mask(mask: torch.Tensor, target: Any) -> torch.Tensor:
    """The bool mask as the attention implementation reads it: bool for sdpa, additive float for eager."""
    impl = getattr(target.config, "_attn_implementation", "sdpa")
    if impl == "eager":
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill(
            ~mask, torch.finfo(torch.float32).min)
    return mask


def path_label_ids(path_ids: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[b, N, B] on-path labels: position k ≥ 1 of anchor a → path_ids[a, k−1]; position 0 → −1."""
    b, n = anchors.shape
    d = path_ids.shape[-1]
    if d < block_size - 1:
        raise ValueError(f"path_ids has depth {d}; block size {block_size} needs {block_size - 1}")
    rows = torch.gather(path_ids, 1, anchors[:, :, None].expand(b, n, d))     # [b, N, D]
    first = torch.full((b, n, 1), -1, dtype=rows.dtype, device=rows.device)
    return torch.cat([first, rows[:, :, :block_size - 1]], dim=2)


def on_path_weights(input_ids: torch.Tensor, target_labels: torch.Tensor, seq_lens: torch.Tensor,
                    anchors: torch.Tensor, *, block_size: int) -> torch.Tensor:
    """[b, N, B] float 0/1: 1 at k ≤ 1 and at k ≥ 2 when x[a+j] == next_ids[a+j−1] for every 1 ≤ j < k.

    `target_labels` [b, S] is `target_label_ids(input_ids, next_ids)` (target_labels[t] = next_ids[t−1]),
    so the rule reads x[a+j] == target_labels[a+j]. Positions past the sequence end count as agreeing
    (their weight is 0 anyway)."""
    b, n = anchors.shape
    dev = input_ids.device
    pos = anchors[:, :, None] + torch.arange(block_size, device=dev)            # [b, N, B]
    inside = pos < seq_lens.to(dev)[:, None, None]
    safe = torch.where(inside, pos, torch.zeros_like(pos)).view(b, -1)
    same = (torch.gather(input_ids, 1, safe) == torch.gather(target_labels.to(input_ids.dtype), 1, safe))
    same = same.view(b, n, block_size) | ~inside
    same[:, :, 0] = True                                                        # the anchor itself: not a prediction
    # position k keeps iff positions 1 … k−1 agree: an exclusive running product over the block
    ok = torch.cumprod(same.long(), dim=-1)                                    # ok[k] = Π_{j ≤ k} same[j]
    out = torch.ones(b, n, block_size, device=dev)
    out[:, :, 2:] = ok[:, :, 1:-1].float()
    return out
