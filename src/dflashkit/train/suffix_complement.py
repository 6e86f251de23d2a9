"""`train.suffix_complement`: the drafter trained to complement the suffix proposer of the hybrid.

Usage:
    comp = SuffixComplement.from_train(cfg.train)           # None under train.suffix_complement=off
    factor, covered = comp.factors(input_ids, anchors, labels, sup)   # [b, N, B] each

A block anchored at position a of a document predicts the labels of a+1 … a+B−1. The suffix proposer
(`decode/suffix.py`, in context only: no pool) proposes B−1 tokens from the document's own tokens up to and
including a; when its match is at least `min_match` tokens long, the block offsets 1 … r of the proposal's
leading run of correct, supervised labels are *covered*: the hybrid would draft them by copying, so their loss
weight is multiplied by `weight` (drop: 0, downweight: `train.suffix_complement_weight`). Everything else keeps
factor 1. Rules:
  * the context is the anchor's document only (`Anchors.starts` in packed rows): a packed row's documents
    never match across a boundary, so packed ≡ unpacked;
  * the labels compared are the loss's labels (`train.labels=target`: the target's argmax; `on_path=rollout`:
    its path), and a position outside the supervision (`sup`: past the document, loss mask 0, padded block)
    ends the run, as it ends a simulated τ run;
  * the proposals are computed on the CPU at the sampled anchors only, one proposer per document, anchors in
    ascending order (each call extends the last one's sequence, so an incremental proposer indexes each token
    once); the comparison with the labels is vectorised.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from dflashkit.config import TrainSection
    from dflashkit.train.objective import Anchors

try:  # helper S's proposer (decode/suffix.py); the brute-force one below has the same semantics
    from dflashkit.decode.suffix import SuffixProposer as _Proposer
except ImportError:  # pragma: no cover - until decode/suffix.py lands
    _Proposer = None


@dataclass(frozen=True)
class LongestMatch:
    """A brute-force in-context suffix proposer: the longest suffix (≤ `max_depth`) of the sequence that occurs
    earlier in it with a token after it, then the most frequent continuation, token by token (ties: the most
    recent occurrence), while the extended context still occurs with a follower. O(n · depth) per call."""

    max_depth: int = 32

    def propose_scored(self, sequence: list[int], num_tokens: int) -> Any:
        n = len(sequence)
        match = 0
        for m in range(min(self.max_depth, n - 1), 0, -1):
            if _followers(sequence, sequence[n - m:], n):
                match = m
                break
        out: list[int] = []
        ctx = sequence[n - match:] if match else []
        while match and len(out) < num_tokens:
            foll = _followers(sequence, ctx, n)
            if not foll:
                break
            counts = Counter(tok for tok, _ in foll)
            best = max(counts.values())
            tok = max((i, t) for t, i in foll if counts[t] == best)[1]  # ties: the most recent occurrence
            out.append(tok)
            ctx = (ctx + [tok])[-self.max_depth:]
        return _Draft(out, match)


@dataclass(frozen=True)
class _Draft:
    tokens: list[int]
    match_len: int


def _followers(seq: list[int], ctx: list[int], n: int) -> list[tuple[int, int]]:
    """(following token, start) of every occurrence of `ctx` in seq[:n] that has a token after it."""
    m = len(ctx)
    return [(seq[i + m], i) for i in range(n - m) if seq[i:i + m] == ctx]


def new_proposer() -> Any:
    """An in-context suffix proposer for one document (`propose_scored(sequence, k)` → tokens, match_len)."""
    return _Proposer() if _Proposer is not None else LongestMatch()


@dataclass(frozen=True)
class SuffixComplement:
    """`train.suffix_complement` (module docstring): `weight` is the factor of a covered position (0 = drop)."""

    weight: float
    min_match: int = 4
    proposer: Callable[[], Any] = new_proposer

    @classmethod
    def from_train(cls, train: TrainSection) -> SuffixComplement | None:
        mode = train.suffix_complement
        if mode == "off":
            return None
        return cls(0.0 if mode == "drop" else float(train.suffix_complement_weight),
                   int(train.suffix_complement_min_match))

    def proposals(self, input_ids: torch.Tensor, a: Anchors, num_tokens: int) -> torch.Tensor:
        """[b, N, num_tokens] each real block's in-context proposal (−1 past its end, for a match shorter than
        `min_match`, and for padded blocks)."""
        ids = input_ids.detach().cpu().tolist()
        anchors, keep = a.anchors.cpu().tolist(), a.keep.cpu().tolist()
        starts = a.starts.cpu().tolist() if a.starts is not None else None
        b, n = a.anchors.shape
        out = torch.full((b, n, num_tokens), -1, dtype=torch.long)
        for i in range(b):
            doc, prop = -1, None
            for j in range(n):
                if not keep[i][j]:
                    continue
                s = starts[i][j] if starts is not None else 0
                if s != doc:  # a new document: a proposer of its own
                    doc, prop = s, self.proposer()
                assert prop is not None
                d = prop.propose_scored(ids[i][s:anchors[i][j] + 1], num_tokens)
                if d.match_len >= self.min_match and d.tokens:
                    toks = d.tokens[:num_tokens]
                    out[i, j, :len(toks)] = torch.tensor(toks, dtype=torch.long)
        return out

    def factors(self, input_ids: torch.Tensor, a: Anchors, labels: torch.Tensor, sup: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(factor [b, N, B] float32: `weight` on covered positions, 1 elsewhere; covered [b, N, B] bool) on
        `labels`' device, for blocks with labels [b, N, B] (target ids) and supervision `sup` [b, N, B]."""
        B = labels.shape[-1]
        prop = self.proposals(input_ids, a, B - 1)
        ok = (prop == labels[:, :, 1:].cpu()) & sup[:, :, 1:].cpu().bool()
        covered = torch.cat([torch.zeros_like(ok[:, :, :1]), torch.cumprod(ok.long(), dim=-1).bool()], dim=-1)
        covered = covered.to(labels.device)
        factor = torch.where(covered, torch.full((), self.weight, device=labels.device),
                             torch.ones((), device=labels.device))
        return factor, covered
