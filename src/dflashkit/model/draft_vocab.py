"""An optional reduced draft vocabulary (`drafter.draft_vocab_size`): choice, mapping, checks.

Usage:
    vocab = choose_draft_vocab(data.input_ids, data.loss_mask, 32000, target.vocab_size, always=[eos])
    counts = label_token_counts(data.input_ids, data.loss_mask, target.vocab_size)  # → vocab_from_counts
    head = restricted_head(target.lm_head, vocab)          # frozen nn.Linear over the V' rows, built once
    idx, inside = draft_labels(labels, vocab)              # target ids → draft indices (+ in-vocab mask)
    d2t = to_offsets(vocab); vocab = from_offsets(d2t)     # the checkpoint's `d2t` (vLLM convention)
    check_draft_vocab(vocab, vocab_size=V, source="model.safetensors")

`vocab` (the draft→target map) is a sorted, duplicate-free int64 tensor of target ids [V']: draft
index i stands for target id vocab[i]. The drafter uses only those rows of the *target's* head.

The choice (`choose_draft_vocab`) is a pure function of the tokenized data, so every torchrun rank
computes the same vocab: the tokenizer's eos id(s) always, then the most frequent supervised label
tokens (loss_mask == 1) of the given samples, ties broken by the lower id. When the data hold fewer
distinct label tokens than requested, the lowest unused ids fill it to exactly the configured size.

Checkpoint convention (vLLM's EAGLE-3 / DFlash loaders, `llama_eagle3.py`, `qwen3_dflash.py`):
`d2t` [V'] int64 holds *offsets*, target id = i + d2t[i]; `t2d` [V] bool marks the target ids in
the draft vocab (vLLM skips it; EAGLE-3 tools write it); `lm_head.weight` [V', H] is the draft's
own head (vLLM shares the target's full head only when the checkpoint has none, which cannot work
for V' < V); config.json's top-level `draft_vocab_size` = V'.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from dflashkit.errors import UsageError


def label_token_counts(input_ids: Sequence[np.ndarray], loss_mask: Sequence[np.ndarray], vocab_size: int,
                       *, chunk_tokens: int = 1 << 22) -> np.ndarray:
    """How often each target id is a supervised token (loss_mask == 1) in the samples → int64 [V]."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    pending: list[np.ndarray] = []
    size = 0

    def flush():
        nonlocal pending, size
        if pending:
            ids = np.concatenate(pending)
            if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                bad = int(ids[(ids < 0) | (ids >= vocab_size)][0])
                raise UsageError(f"tokenized data hold token id {bad}, outside the target vocab [0, {vocab_size})",
                                 hint="re-run `dflashkit tokenize -c run.yaml` with this target's tokenizer")
            counts[:] += np.bincount(ids, minlength=vocab_size)
        pending, size = [], 0

    for ids, mask in zip(input_ids, loss_mask):
        sel = np.asarray(ids, dtype=np.int64)[np.asarray(mask) == 1]
        pending.append(sel)
        size += sel.size
        if size >= chunk_tokens:
            flush()
    flush()
    return counts


def choose_draft_vocab(input_ids: Sequence[np.ndarray], loss_mask: Sequence[np.ndarray], size: int,
                       vocab_size: int, *, always: Iterable[int] = ()) -> torch.Tensor:
    """The `size` target ids of the draft vocab (module docstring), sorted int64 [size].

    Args:
        input_ids, loss_mask: the training samples (held-out samples excluded by the caller).
        size: V', 1 ≤ V' ≤ vocab_size.
        vocab_size: the target vocab V.
        always: ids included whatever their count (the eos ids); ids outside [0, V) are ignored.
    Raises:
        UsageError: a bad size, more `always` ids than `size`, or data ids outside the vocab.
    """
    return vocab_from_counts(label_token_counts(input_ids, loss_mask, vocab_size), size, always=always)


def vocab_from_counts(counts: np.ndarray, size: int, *, always: Iterable[int] = ()) -> torch.Tensor:
    """`choose_draft_vocab` from per-id label counts [V] (see there)."""
    vocab_size = int(counts.shape[0])
    if not 0 < size <= vocab_size:
        raise UsageError(f"drafter.draft_vocab_size {size} must be in [1, {vocab_size}] (the target vocab)")
    forced = sorted({int(i) for i in always if 0 <= int(i) < vocab_size})
    if len(forced) > size:
        raise UsageError(f"drafter.draft_vocab_size {size} is smaller than the {len(forced)} eos ids "
                         f"{forced} it must hold", hint="raise drafter.draft_vocab_size")
    chosen = np.zeros(vocab_size, dtype=bool)
    chosen[forced] = True
    ids = np.arange(vocab_size)
    cand = ids[(counts > 0) & ~chosen]
    order = np.lexsort((cand, -counts[cand]))  # most frequent first, then the lower id
    chosen[cand[order[:size - len(forced)]]] = True
    missing = size - int(chosen.sum())
    if missing > 0:  # fewer distinct label tokens than asked: the lowest unused ids fill the vocab
        chosen[ids[~chosen][:missing]] = True
    return torch.from_numpy(ids[chosen].astype(np.int64))


def to_offsets(vocab: torch.Tensor) -> torch.Tensor:
    """Sorted target ids [V'] → vLLM's `d2t` offsets (target id = i + d2t[i])."""
    return (vocab.long() - torch.arange(vocab.numel(), device=vocab.device)).contiguous()


def from_offsets(d2t: torch.Tensor) -> torch.Tensor:
    """vLLM's `d2t` offsets [V'] → target ids [V']."""
    return d2t.long() + torch.arange(d2t.numel(), device=d2t.device)


def t2d_mask(vocab: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The `t2d` tensor of EAGLE-3 checkpoints: bool [V], True at the draft vocab's target ids."""
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[vocab.cpu()] = True
    return mask


def check_draft_vocab(vocab: torch.Tensor, *, vocab_size: int, size: int | None = None,
                      source: str = "d2t") -> None:
    """Raise UsageError naming `source` unless `vocab` is a valid draft vocab of a V-token target.

    Valid: 1-D integer, `size` entries when given, ids in [0, vocab_size) (when vocab_size > 0),
    strictly increasing (sorted, no duplicates).
    """
    problems = []
    if vocab.dim() != 1 or vocab.dtype.is_floating_point or vocab.dtype == torch.bool:
        problems.append(f"must be a 1-D integer tensor, got {str(vocab.dtype).removeprefix('torch.')} "
                        f"{tuple(vocab.shape)}")
    else:
        if size is not None and vocab.numel() != size:
            problems.append(f"has {vocab.numel()} entries but draft_vocab_size is {size}")
        if vocab.numel() == 0:
            problems.append("is empty")
        else:
            lo, hi = int(vocab.min()), int(vocab.max())
            if lo < 0 or (vocab_size and hi >= vocab_size):
                problems.append(f"maps to target ids [{lo}, {hi}], outside the target vocab [0, {vocab_size})")
            if vocab.numel() > 1 and not bool((vocab[1:] > vocab[:-1]).all()):
                problems.append("target ids are not strictly increasing (must be sorted, without duplicates)")
    if problems:
        raise UsageError(f"{source}: invalid draft vocabulary: " + "; ".join(problems),
                         hint="re-export the drafter, or retrain with drafter.draft_vocab_size")


def restricted_head(lm_head: torch.nn.Module, vocab: torch.Tensor) -> torch.nn.Linear:
    """A frozen Linear holding the rows `vocab` of the target head (one copy of V'·H, made once)."""
    w = lm_head.weight.detach()
    idx = vocab.to(w.device)
    bias = getattr(lm_head, "bias", None)
    head = torch.nn.Linear(w.shape[1], idx.numel(), bias=bias is not None, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        head.weight.copy_(w.index_select(0, idx))
        if bias is not None:
            head.bias.copy_(bias.detach().index_select(0, idx))
    return head.requires_grad_(False)


def draft_labels(labels: torch.Tensor, vocab: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Target-id labels → (draft indices, 0 where outside the vocab; bool mask of in-vocab labels)."""
    v = vocab.to(labels.device)
    idx = torch.searchsorted(v, labels).clamp_(max=v.numel() - 1)
    inside = v[idx] == labels
    return torch.where(inside, idx, torch.zeros_like(idx)), inside
