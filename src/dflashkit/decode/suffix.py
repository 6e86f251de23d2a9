"""Brute-force stand-in for dflashkit.decode.suffix (helper S's module), per the shared design."""
from __future__ import annotations
from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class SuffixDraft:
    tokens: list[int]
    match_len: int
    scores: list[float]
    origin: str = "request"


class SuffixProposer:
    def __init__(self, max_depth: int = 32, min_match: int = 1, min_score: float = 0.0, pool=None, tenant=None):
        self.max_depth = max_depth

    def begin(self, prompt_ids, tenant=None):
        pass

    def finish(self):
        pass

    def propose(self, sequence, num_tokens):
        return self.propose_scored(sequence, num_tokens).tokens

    def propose_scored(self, sequence, num_tokens):
        s = list(sequence)
        n = len(s)
        for L in range(min(self.max_depth, n - 1), 0, -1):
            suf = s[n - L:]
            if any(s[i:i + L] == suf for i in range(0, n - L)):
                path, toks, scores = list(suf), [], []
                while len(toks) < num_tokens:
                    m = len(path)
                    occ = [i for i in range(0, n - m) if s[i:i + m] == path]
                    if not occ:
                        break
                    c = Counter(s[i + m] for i in occ)
                    best = max(c.values())
                    tok = next(s[i + m] for i in reversed(occ) if c[s[i + m]] == best)
                    toks.append(tok); scores.append(best / len(occ)); path.append(tok)
                return SuffixDraft(toks, L, scores)
        return SuffixDraft([], 0, [])
