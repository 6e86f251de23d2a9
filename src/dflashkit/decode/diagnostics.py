"""Why is a drafter weak? Cheap baselines computed on `eval`'s own held-out greedy outputs.

Usage:
    table = BigramTable.fit(data.input_ids, data.loss_mask)        # the training answers
    table.accuracy([out.token_ids for out in baseline_results])    # share of next tokens it predicts
    sim = simulated_acceptance(target, drafter, prompts, outputs)  # teacher-forced τ, position-1 acc
    sim0 = simulated_acceptance(target, drafter, prompts, outputs, no_features=True)
    simx = simulated_acceptance(target, drafter, prompts, outputs, no_features=True, ablation="other")

Bigram baseline: next-token counts over the supervised training answers, scored on the target's
greedy outputs (an unseen previous token backs off to the most frequent token). A drafter whose
position-1 acceptance is below it has learned no more than token co-occurrence.

Simulated acceptance (teacher-forced, not a decode): the target re-reads the greedy outputs once,
then the drafter drafts a block at every output position at once (the training block mask).
Simulated τ = mean over blocks of 1 + the leading drafts equal to the greedy tokens; position-k
accuracy = share of blocks whose draft k is right (equal to real acceptance at position 1 only).

Ablations (`no_features=True`): "context" (default) removes the target context, each block attending
to itself only (`DraftLoss(..., context=False)`); "other" gives each sequence another sequence's
real features (cyclically, cut to length): a drafter that reads the target drops there; "zeros"
zeroes the features, which is not a no-context ablation (zero keys still take softmax mass) and is
kept only for comparison. What the context is worth is measured by a drafter trained without it
(`bench recipe`'s `no-features` variant); readings and numbers: docs/recipe.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dflashkit.model.draft_vocab import restricted_head
from dflashkit.train.loss import DraftLoss, Heads, LossInputs
from dflashkit.train.objective import Anchors


@dataclass
class BigramTable:
    """argmax next token per previous token (`best[prev]`, −1 = unseen) and the backoff token."""

    best: dict[int, int]
    backoff: int
    pairs: int

    @classmethod
    def fit(cls, input_ids: Sequence[np.ndarray], loss_mask: Sequence[np.ndarray]) -> "BigramTable":
        """Count (x[t−1], x[t]) over supervised x[t] (t ≥ 1); ties go to the lower next-token id."""
        prev_all, next_all = [], []
        for ids, mask in zip(input_ids, loss_mask):
            ids, mask = np.asarray(ids, dtype=np.int64), np.asarray(mask)
            sup = np.flatnonzero(mask[1:] > 0) + 1
            prev_all.append(ids[sup - 1])
            next_all.append(ids[sup])
        prev = np.concatenate(prev_all) if prev_all else np.zeros(0, np.int64)
        nxt = np.concatenate(next_all) if next_all else np.zeros(0, np.int64)
        if prev.size == 0:
            return cls({}, -1, 0)
        pairs, counts = np.unique(np.stack([prev, nxt], 1), axis=0, return_counts=True)  # sorted by (prev, next)
        best: dict[int, int] = {}
        top: dict[int, int] = {}
        for (p, n), c in zip(pairs.tolist(), counts.tolist()):
            if c > top.get(p, 0):
                best[p], top[p] = n, c
        values, freq = np.unique(nxt, return_counts=True)
        return cls(best, int(values[int(np.argmax(freq))]), int(prev.size))

    def predict(self, prev: int) -> int:
        return self.best.get(int(prev), self.backoff)

    def accuracy(self, outputs: Sequence[Sequence[int]]) -> dict:
        """Share of positions t ≥ 1 of each output whose token equals the table's argmax after x[t−1]."""
        hits = total = unseen = 0
        for out in outputs:
            for prev, tok in zip(out[:-1], out[1:]):
                total += 1
                unseen += int(prev) not in self.best
                hits += self.predict(prev) == tok
        return {"accuracy": round(hits / total, 4) if total else 0.0, "positions": total,
                "unseen_previous": unseen, "training_pairs": self.pairs}


@torch.inference_mode()
def simulated_acceptance(target, drafter, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], *,
                         no_features: bool = False, ablation: str = "context") -> dict:
    """Teacher-forced τ and per-position accuracy of `drafter` on prompt + greedy output sequences.

    A block is anchored at every output position p (the token the decoder would start a step with)
    whose next token exists; the drafter sees the target features of positions < p and [x_p, MASK ×
    (B−1)], exactly as in training and decoding. `no_features`: the ablation (module docstring):
    `ablation="context"` removes the context (the block attends to itself only), "other" gives each
    sequence the features of the other sequences (the next ones, cyclically; needs two or more),
    "zeros" feeds zeroed features (kept to show why that reading is wrong).
    Returns {"tau", "blocks", "per_position_accuracy" (positions 1..B−1), "no_features", "ablation"}.
    """
    if ablation not in ("context", "other", "zeros"):
        raise ValueError(f"ablation must be 'context', 'other' or 'zeros', got {ablation!r}")
    if no_features and ablation == "other" and len(prompts) < 2:
        raise ValueError("ablation='other' needs two or more sequences (each takes the others' features)")
    B = drafter.block_size
    p0 = next(drafter.parameters())
    head = target.lm_head
    vocab = drafter.draft_vocab
    if vocab is not None:
        vocab = vocab.to(p0.device)
        head = restricted_head(head, vocab)
    head_w = head.weight.detach().to(p0.dtype)
    head_b = getattr(head, "bias", None)

    def lm_head(h: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(h, head_w, None if head_b is None else head_b.to(p0.dtype))

    def features_of(ids_list: list[int]) -> torch.Tensor:
        ids = torch.tensor([ids_list], device=target.device)
        return target.features(ids, layer_ids=list(drafter.target_layer_ids)).to(p0.dtype)      # [1, L, nF·H]

    # teacher-forced scoring: the training loss's metrics (unweighted positions), the context dropped for
    # the "context" ablation
    score = DraftLoss.scoring(drafter.contract, context=not (no_features and ablation == "context"))
    heads = Heads(target.embed, lm_head, vocab)
    seqs = [[*prompt, *out] for prompt, out in zip(prompts, outputs)]
    others = [features_of(x) for x in seqs] if no_features and ablation == "other" else None
    correct = torch.zeros(B)
    total = torch.zeros(B)
    tau_sum, blocks = 0.0, 0
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        ids_list = seqs[i]
        n_p, length = len(prompt), len(prompt) + len(out)
        if len(out) < 2:
            continue
        ids = torch.tensor([ids_list], device=target.device)
        if others is not None:  # the next sequences' features, cyclically, cut to this one's length
            parts: list[torch.Tensor] = []
            j = i
            while sum(f.shape[1] for f in parts) < length:
                j = (j + 1) % len(others)
                if j != i:
                    parts.append(others[j])
            feats = torch.cat(parts, dim=1)[:, :length]
        else:
            feats = features_of(ids_list)
        if no_features and ablation == "zeros":
            feats = torch.zeros_like(feats)
        loss_mask = torch.zeros_like(ids)
        loss_mask[0, n_p:] = 1
        anchors = torch.arange(n_p, length - 1, device=target.device)[None]               # [1, N]
        a = Anchors(anchors, torch.ones_like(anchors, dtype=torch.bool))
        res = score(drafter, heads, LossInputs(feats, ids, loss_mask, torch.tensor([length], device=target.device)), a)
        correct += res.correct
        total += res.total
        tau_sum += res.tau_sum
        blocks += res.blocks
    acc = (correct[1:] / total[1:].clamp(min=1)).tolist()
    return {"tau": round(tau_sum / blocks, 4) if blocks else 0.0, "blocks": blocks,
            "per_position_accuracy": [round(x, 4) for x in acc], "no_features": no_features,
            "ablation": (ablation if no_features else None)}
