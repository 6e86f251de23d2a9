"""A per-channel scale for the target features (`drafter.feature_scale: rms`), folded away on save.

Usage:
    scale = channel_scale(feature_batches, n_feat=3)     # [n_feat·H] from the training data's features
    drafter = DFlashDraftModel(contract, feature_scale=scale)   # fuse(x) = hidden_norm(fc(x · scale))
    sd = fold_feature_scale(drafter.state_dict())        # fc.weight · diag(scale); no `feature_scale` key

Why: target residual streams carry a few massive channels (SmolLM2-135M: one channel's RMS is
~1,650 against a median of ~5). The drafter's `fc` sees them raw, so at initialisation that one
channel dominates the fused context, and AdamW's per-weight step moves its column's output
hundreds of times more than a typical column's. `rms` divides each channel by its RMS over the
training data and multiplies by the median RMS of its target layer: typical channels stay about
as they are, a massive one is brought down to the median.

The scale is a persistent buffer while training (checkpoints and resume carry it). `fc(x·s)` is
`(W·diag(s))·x`, so `train/final`, `train/best` and every export store the folded `fc.weight`
(`fold_feature_scale`): a plain z-lab drafter that engines load unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def channel_scale(features: Iterable[torch.Tensor], *, n_feat: int, eps: float = 1e-6) -> torch.Tensor:
    """median-RMS / RMS per channel, per target layer, over all tokens of `features` ([tokens, n_feat·H] each)."""
    sq, count = None, 0
    for f in features:
        f = f.reshape(-1, f.shape[-1]).double()
        sq = f.pow(2).sum(0) if sq is None else sq + f.pow(2).sum(0)
        count += f.shape[0]
    if sq is None or count == 0:
        raise ValueError("no features to compute a channel scale from")
    rms = (sq / count).sqrt().view(n_feat, -1)
    median = rms.median(dim=-1, keepdim=True).values
    return (median / rms.clamp(min=eps)).flatten().float()


def fold_feature_scale(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with `feature_scale` folded into `fc.weight` (columns scaled) and removed; unchanged without it."""
    if "feature_scale" not in state:
        return state
    out = dict(state)
    scale = out.pop("feature_scale")
    w = out["fc.weight"]
    out["fc.weight"] = (w.float() * scale.float().to(w.device)[None, :]).to(w.dtype)
    return out
