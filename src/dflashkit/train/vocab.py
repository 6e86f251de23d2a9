"""Draft-vocab choice for training: which target tokens a reduced draft vocab keeps.

Usage:
    vocab = pick_draft_vocab(cfg.drafter.draft_vocab_size, recipe, contract, target, data, train_idx,
                             batch_size=cfg.train.batch_size)                   # None: the full vocab

`drafter.draft_vocab_size`: the most frequent supervised label tokens of the training samples (held-out
ones excluded; with `train.labels=target` the target's own labels, from the shards or one prefill
pass) plus the eos ids; the same on every rank. The counting is `model/draft_vocab.py`.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from dflashkit.errors import UsageError
from dflashkit.model.draft_vocab import label_token_counts, vocab_from_counts
from dflashkit.family.contract import DrafterContract
from dflashkit.family.recipe import Recipe
from dflashkit.train.data import collate
from dflashkit.train.objective import target_label_ids

log = logging.getLogger("dflashkit.train")


def pick_draft_vocab(draft_vocab_size: int | None, recipe: Recipe, contract: DrafterContract, target: Any, data: Any,
                     train_idx: list[int], *, batch_size: int) -> torch.Tensor | None:
    """The reduced draft vocab of `draft_vocab_size` tokens (drafter.draft_vocab_size; None: unset, 0, or the
    whole vocab).

    The most frequent supervised tokens of the training samples (held-out ones excluded) plus the
    eos ids of the contract and the tokenizer; the same on every rank (a pure function of the data).
    `batch_size` (train.batch_size): the batches of the target's labelling pass (train.labels=target, online).
    """
    n, vocab_size = draft_vocab_size, target.vocab_size
    if not n:
        return None
    if n > vocab_size:
        raise UsageError(f"drafter.draft_vocab_size {n} exceeds the target vocab of {vocab_size} tokens",
                         hint=f"use at most {vocab_size}, or null for the full vocab")
    if n == vocab_size:
        log.info("drafter.draft_vocab_size %d is the whole target vocab: training over the full vocab", n)
        return None
    eos = contract.eos_token_id
    always = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    tok_eos = getattr(getattr(target, "tokenizer", None), "eos_token_id", None)
    if tok_eos is not None:
        always.add(int(tok_eos))
    labels = [data.input_ids[i] for i in train_idx]
    if recipe.target_labels:  # the labels trained on are the target's own predictions: count those
        labels = target_labels_of(contract, target, data, train_idx, batch_size=batch_size)
    counts = label_token_counts(labels, [data.loss_mask[i] for i in train_idx], vocab_size)
    vocab = vocab_from_counts(counts, n, always=always)
    log.info("draft vocab: %d of %d target tokens, covering %.2f%% of the training label tokens", n, vocab_size,
             100 * counts[vocab.numpy()].sum() / max(1, counts.sum()))
    return vocab


def target_labels_of(contract: DrafterContract, target, data, idx: list[int], *, batch_size: int) -> list:
    """`train.labels=target` labels of samples `idx` (np.int64 arrays): from the cached `next_ids`, or
    (online) from one prefill pass of the target over those samples, in batches of `batch_size`."""
    out = []
    if data.features is not None and data.features.has("next_ids"):
        for i in idx:
            nxt = data.features.get(data.where[i], len(data.input_ids[i]), "next_ids").to(torch.long)[None]
            out.append(target_label_ids(torch.from_numpy(data.input_ids[i])[None], nxt)[0].numpy())
        return out
    log.info("draft vocab: labelling %d training samples with the target (one prefill pass)", len(idx))
    pad = (getattr(getattr(target, "tokenizer", None), "pad_token_id", None) or 0)
    bs = max(1, batch_size)
    for k in range(0, len(idx), bs):
        items = [(i, 0) for i in idx[k:k + bs]]
        b = collate(data, items, run_seed=0, pad_id=pad).to(target.device)
        with torch.no_grad():
            _, hidden = target.features(b.input_ids, layer_ids=contract.target_layer_ids, need_last_hidden=True,
                                        attention_mask=b.attention_mask)
            lab = target_label_ids(b.input_ids, target.next_token_ids(hidden)).cpu()
        out.extend(lab[r, :int(n)].numpy().astype(np.int64) for r, n in enumerate(b.seq_lens.tolist()))
    return out
