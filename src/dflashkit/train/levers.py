"""Setup-time recipe levers of the training loop: held-out sources and the feature scale.

Usage:
    train_idx, heldout = split_samples(cfg, data)                          # train's split (capture's too)
    train_idx, heldout = held_out_sources(cfg, data, train_idx, heldout)    # train.heldout_sources
    scale = feature_scale_of(cfg, contract, target, data, train_idx)       # drafter.feature_scale=rms

Both are pure functions of the config and the data (the same on every rank); `train/loop.py`
`setup` calls them before the drafter is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
import logging

import torch

from dflashkit.errors import UsageError
from dflashkit.family.contract import DrafterContract
from dflashkit.model.feature_scale import channel_scale
from dflashkit.train.data import collate, hold_out_sources, split_heldout

if TYPE_CHECKING:
    from dflashkit.config import RunConfig

log = logging.getLogger("dflashkit.train")


def split_samples(cfg: RunConfig, data) -> tuple[list[int], list[int]]:
    """(training, held-out) sample indices: `train.heldout_samples` of a seeded permutation (run.seed), then
    `train.heldout_sources`. The one split: `capture` computes the held-out samples' greedy paths with it."""
    train_idx, heldout = split_heldout(len(data), cfg.train.heldout_samples, seed=cfg.run.seed)
    if cfg.train.heldout_sources:
        train_idx, heldout = held_out_sources(cfg, data, train_idx, heldout)
    return train_idx, heldout


def held_out_sources(cfg: RunConfig, data, train_idx: list[int], heldout: list[int]) -> tuple[list[int], list[int]]:
    """`train.heldout_sources` applied (`data.hold_out_sources`); an unknown source name is exit 2."""
    src = [s or "all" for s in (getattr(data, "source", None) or [""] * len(data))]
    names = list(cfg.train.heldout_sources)
    missing = sorted(set(names) - set(src))
    if missing:
        raise UsageError(f"train.heldout_sources: no tokenized samples of source(s) {missing}; the data has "
                         f"{sorted(set(src))}", hint="name sources as data.sources[].name (or their file stem)")
    train_idx, heldout = hold_out_sources(train_idx, heldout, src, names, per_source=cfg.train.heldout_samples,
                                          seed=cfg.run.seed)
    if not train_idx:
        raise UsageError(f"train.heldout_sources={names} holds out every training sample",
                         hint="keep at least one source for training")
    return train_idx, heldout


def feature_scale_of(cfg: RunConfig, contract: DrafterContract, target, data, train_idx: list[int], samples: int = 32):
    """`drafter.feature_scale=rms`: the per-channel scale (`model/feature_scale.py`) from the target features of
    the first `samples` training samples (cached shards, or one online prefill of them); the same on every rank."""
    idx, n_feat = train_idx[:samples], len(contract.target_layer_ids)
    if data.features is not None:
        feats = (data.features.get(data.where[i], len(data.input_ids[i])).float() for i in idx)
        return channel_scale(feats, n_feat=n_feat)
    pad = (getattr(getattr(target, "tokenizer", None), "pad_token_id", None) or 0)
    chunks = []
    with torch.no_grad():
        for k in range(0, len(idx), max(1, cfg.train.batch_size)):
            b = collate(data, [(i, 0) for i in idx[k:k + cfg.train.batch_size]], run_seed=0,
                        pad_id=pad).to(target.device)
            f = target.features(b.input_ids, layer_ids=contract.target_layer_ids, attention_mask=b.attention_mask)
            chunks += [f[r, :int(n)].float().cpu() for r, n in enumerate(b.seq_lens.tolist())]
    scale = channel_scale(chunks, n_feat=n_feat)
    log.info("feature scale: channel RMS folded to the layer median (largest reduction %.1f×)", float(1 / scale.min()))
    return scale
