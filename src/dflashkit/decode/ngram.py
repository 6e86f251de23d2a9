"""Prompt lookup: a training-free n-gram proposer for the same lossless speculative decoder.

Usage:
    proposer = PromptLookupProposer(max_ngram=3, min_ngram=1)
    spec = SpecDecoder(target, None, block_size=8, proposer=proposer)    # verify as for a drafter
    proposer.propose(prompt_and_output, 7)                                 # ≤ 7 tokens, maybe none

Rule (as transformers' `prompt_lookup_num_tokens` and vLLM's `ngram` speculative method): for
n = max_ngram down to min_ngram, find the latest earlier occurrence of the last n tokens of the
sequence (prompt + committed output; the suffix itself does not count) and propose the tokens that
followed it, at most `num_tokens` of them; the first n that matches wins. No match → no proposal,
and the verify step is a plain one-token step. A proposal may be shorter than B−1 (the match sits
near the end of the sequence); the decoder verifies what it gets.

It needs no training, so it is the floor a trained drafter must beat: `dflashkit eval` runs it on
the same prompts and block sizes as the drafter and reports its τ and speedup beside the drafter's.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class PromptLookupProposer:
    """Propose the continuation of the latest earlier match of the last n tokens (n = max..min)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, sequence: list[int], num_tokens: int) -> list[int]:
        """Up to `num_tokens` tokens that followed the latest earlier occurrence of the suffix."""
        if num_tokens <= 0:
            return []
        seq = np.asarray(sequence, dtype=np.int64)
        n_seq = seq.shape[0]
        for n in range(min(self.max_ngram, n_seq - 1), self.min_ngram - 1, -1):
            # windows starting at 0 .. n_seq-n-1: every occurrence but the suffix itself
            windows = sliding_window_view(seq[:-1], n)         # [n_seq - n, n]
            hits = np.flatnonzero((windows == seq[n_seq - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n                       # first token after the match
                return seq[start: start + num_tokens].tolist()
        return []

