"""The worst possible drafter for `decode.spec_decode.SpecDecoder` (the best one is `dflashkit.testing`'s).

Usage:
    SpecDecoder(target, None, 4, proposer=AdversarialProposer(target))   # τ = 1
"""

from __future__ import annotations

from dflashkit.testing.proposers import CopyTargetProposer


class AdversarialProposer(CopyTargetProposer):
    """Always proposes a token different from the target's greedy choice (τ = 1)."""

    def propose(self, sequence: list[int], num_tokens: int) -> list[int]:
        first = super().propose(sequence, 1)[0]
        return [(first + 1) % self.target.vocab_size] * num_tokens
