"""`train.suffix_complement`: the drafter trained to complement the suffix proposer of the hybrid.

Usage:
    comp = SuffixComplement.from_train(cfg.train, SuffixProposer)     # None under train.suffix_complement=off
    factor, covered = comp.factors(input_ids, anchors, labels, sup)   # [b, N, B] each

A block anchored at position a of a document predicts the labels of a+1 … a+B−1. The suffix proposer
(`decode.suffix.SuffixProposer`: train/ ranks below decode/, so the train stage and `bench recipe` pass it
in; in context only: no pool) proposes B−1 tokens from the document's own tokens up to and including a.
When its match is at least `min_match` tokens long, the block offsets 1 … r of the proposal's leading run
of correct, supervised labels are *covered*: the hybrid would draft them by copying, so their loss weight is
multiplied by `weight` (drop: 0, downweight: `train.suffix_complement_weight`). Everything else keeps
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

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

import torch

if TYPE_CHECKING:
    from dflashkit.config import TrainSection
    from dflashkit.train.objective import Anchors


class InContextProposer(Protocol):
    """What the complement asks of a suffix proposer (`decode.suffix.SuffixProposer`): `begin` a request,
    then drafts for growing prefixes of it (`.tokens`, `.match_len`)."""

    def begin(self, prompt_ids: Sequence[int]) -> None: ...

    def propose_scored(self, sequence: Sequence[int], num_tokens: int) -> Any: ...


@dataclass(frozen=True)
class SuffixComplement:
    """`train.suffix_complement` (module docstring): `weight` is the factor of a covered position (0 = drop)."""

    proposer: Callable[[], InContextProposer]
    weight: float
    min_match: int = 4

    @classmethod
    def from_train(cls, train: TrainSection, proposer: Callable[[], InContextProposer] | None
                   ) -> SuffixComplement | None:
        """The complement `train.suffix_complement` asks for (None: off). `proposer` makes one in-context suffix
        proposer (`decode.suffix.SuffixProposer`: train/ ranks below decode/, so the caller passes it in)."""
        mode = train.suffix_complement
        if mode == "off":
            return None
        if proposer is None:
            raise ValueError("train.suffix_complement needs the suffix proposer (pass decode.suffix.SuffixProposer)")
        return cls(proposer, 0.0 if mode == "drop" else float(train.suffix_complement_weight),
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
                if s != doc:  # a new document: a proposer of its own, following its growing prefixes
                    doc, prop = s, self.proposer()
                    prop.begin([])
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
