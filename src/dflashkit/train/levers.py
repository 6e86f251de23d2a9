"""Setup-time recipe levers of the training loop: held-out sources and the feature scale.

Usage (`t`: cfg.train, `seed`: cfg.run.seed):
    train_idx, heldout = split_samples(data, heldout_samples=t.heldout_samples,
                                       heldout_sources=t.heldout_sources, seed=seed)  # train's split (capture's too)
    train_idx, heldout = held_out_sources(data, train_idx, heldout, t.heldout_sources,
                                          per_source=t.heldout_samples, seed=seed)    # train.heldout_sources
    scale = feature_scale_of(contract, target, data, train_idx, batch_size=t.batch_size)  # drafter.feature_scale=rms

Both are pure functions of these settings and the data (the same on every rank); `train/loop.py`
`setup` calls them before the drafter is built.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from dflashkit.errors import UsageError
from dflashkit.family.contract import DrafterContract
from dflashkit.model.feature_scale import channel_scale
from dflashkit.train.data import collate, hold_out_sources, split_heldout

log = logging.getLogger("dflashkit.train")


def split_samples(data, *, heldout_samples: int, heldout_sources: Sequence[str],
                  seed: int) -> tuple[list[int], list[int]]:
    """(training, held-out) sample indices: `train.heldout_samples` of a seeded permutation (`seed`: run.seed),
    then `train.heldout_sources`. The one split: `capture` computes the held-out samples' greedy paths with it."""
    train_idx, heldout = split_heldout(len(data), heldout_samples, seed=seed)
    if heldout_sources:
        train_idx, heldout = held_out_sources(data, train_idx, heldout, heldout_sources, per_source=heldout_samples,
                                              seed=seed)
    return train_idx, heldout


def held_out_sources(data, train_idx: list[int], heldout: list[int], sources: Sequence[str], *, per_source: int,
                     seed: int) -> tuple[list[int], list[int]]:
    """`train.heldout_sources` (`sources`, `per_source` samples of each: train.heldout_samples) applied
    (`data.hold_out_sources`); an unknown source name is exit 2."""
    src = [s or "all" for s in (getattr(data, "source", None) or [""] * len(data))]
    names = list(sources)
    missing = sorted(set(names) - set(src))
    if missing:
        raise UsageError(f"train.heldout_sources: no tokenized samples of source(s) {missing}; the data has "
                         f"{sorted(set(src))}", hint="name sources as data.sources[].name (or their file stem)")
    train_idx, heldout = hold_out_sources(train_idx, heldout, src, names, per_source=per_source, seed=seed)
    if not train_idx:
        raise UsageError(f"train.heldout_sources={names} holds out every training sample",
                         hint="keep at least one source for training")
    return train_idx, heldout


def feature_scale_of(contract: DrafterContract, target, data, train_idx: list[int], *, batch_size: int,
                     samples: int = 32):
    """`drafter.feature_scale=rms`: the per-channel scale (`model/feature_scale.py`) from the target features of
    the first `samples` training samples (cached shards, or one online prefill of them in batches of
    `batch_size`: train.batch_size); the same on every rank."""
    idx, n_feat = train_idx[:samples], len(contract.target_layer_ids)
    if data.features is not None:
        feats = (data.features.get(data.where[i], len(data.input_ids[i])).float() for i in idx)
        return channel_scale(feats, n_feat=n_feat)
    pad = (getattr(getattr(target, "tokenizer", None), "pad_token_id", None) or 0)
    chunks = []
    with torch.no_grad():
        for k in range(0, len(idx), max(1, batch_size)):
            b = collate(data, [(i, 0) for i in idx[k:k + batch_size]], run_seed=0,
                        pad_id=pad).to(target.device)
            f = target.features(b.input_ids, layer_ids=contract.target_layer_ids, attention_mask=b.attention_mask)
            chunks += [f[r, :int(n)].float().cpu() for r, n in enumerate(b.seq_lens.tolist())]
    scale = channel_scale(chunks, n_feat=n_feat)
    log.info("feature scale: channel RMS folded to the layer median (largest reduction %.1f×)", float(1 / scale.min()))
    return scale
