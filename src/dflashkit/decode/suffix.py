"""Suffix matching: the longest-suffix, most-frequent-continuation proposer, with a per-tenant pool.

Usage:
    pool = SuffixPool(max_tokens=1 << 20, max_age_s=3600)           # shared by a server's requests
    proposer = SuffixProposer(max_depth=32, pool=pool)
    proposer.begin(prompt_ids, tenant="alice")                         # a request starts
    draft = proposer.propose_scored(prompt_and_output, 7)              # SuffixDraft: tokens, match_len, scores, origin
    proposer.propose(prompt_and_output, 7)                             # the `Proposer` protocol: draft.tokens
    proposer.finish(prompt_and_output)                                 # the request ended: it joins alice's pool

Rule (the oracle in tests/decode/test_suffix.py implements the same words). The *texts* of a request are
its own sequence S (prompt + committed output) and, with a pool, the finished requests of its tenant. An
*occurrence of x followed by t* is a place in one text where x is immediately followed by t (in S both lie
inside S, so the suffix of S itself is followed by nothing); N(x, t) counts them.
1. Match: for the request's own text, L_req is the largest l ≤ max_depth such that the last l tokens of S
   are followed by some token somewhere in S; L_pool is the same over the pool's texts. The request wins
   when L_req ≥ L_pool (own context takes precedence at equal length), else the pool. The winner's texts
   alone give every count below; match_len is its l. A match shorter than max(min_match, 1) proposes
   nothing (origin "none").
2. Continue: c starts as the matched suffix. Each proposed token is the t maximising N(x, t) with x the last
   min(|c|, max_depth) tokens of c; ties go to the t whose latest occurrence after x is the most recent
   (position in S; for the pool, later requests beat earlier ones). Its score is N(x, t) / Σ_u N(x, u), the
   empirical probability of t after x, and t is appended to c. It stops at num_tokens tokens, when x is
   never followed, or before a token whose score is below min_score.

Structure: a depth-bounded suffix trie (substrings of length ≤ max_depth + 1, with occurrence counts), one
per request and one per tenant in the pool, as SuffixDecoding's. A substring seen twice is a node (count,
latest occurrence, suffix link); one seen once is a reference to where it ends in the text, so nodes grow
with the repeated substrings, not with max_depth × tokens. Appending a token touches one node per repeated
suffix: at most max_depth, independent of the context length. Matching the pool binary-searches the match
length (O(max_depth · log max_depth) per step); the pool removes an evicted request the way it added it.
Prompt lookup (`decode/ngram.py`, n ≤ 3, the latest match) stays the training-free floor.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

ROOT = 0
SENT = -1                                         # separates texts in a trie's buffer
Cursor = tuple[int, int, int]                     # (explicit node, end stamp, depth): see _Trie


@dataclass(frozen=True)
class SuffixDraft:
    """One suffix proposal.

    tokens: the proposed continuation (empty: no match, or the match is shorter than min_match).
    match_len: length of the matched suffix (0 = none), reported even when nothing is proposed.
    scores: per proposed token, its empirical probability N(x, t) / Σ_u N(x, u) given the path so far.
    origin: "request" (the request's own prompt and output), "pool" (earlier requests of its tenant),
        or "none" (no match of at least min_match tokens).
    """

    tokens: list[int]
    match_len: int
    scores: list[float]
    origin: str


class _Trie:
    """Depth-bounded suffix trie over one growing token buffer (`text`, SENT between texts).

    Every substring of length ≤ height that occurs at least twice is an explicit node (node 0 = root) with
    its occurrence count, the stamp of its latest occurrence and a suffix link; a substring that occurs
    once is a reference from its parent to where that occurrence ends (a negative kid, -(stamp + 1)), and
    its own continuation is read from `text`. A stamp is a position in the buffer, so later texts have later
    stamps. A cursor (node, end, depth) names a string: explicit when depth == depth[node], else the
    unique occurrence ending at stamp `end` whose longest explicit prefix is `node`.
    """

    def __init__(self, height: int):
        self.height = height                        # longest string stored
        self.kids: list[dict[int, int]] = [{}]
        self.count: list[int] = [0]
        self.last: list[int] = [-1]
        self.link: list[int] = [ROOT]
        self.depth: list[int] = [0]
        self.free: list[int] = []
        self.live = 1
        self.text: list[int] = []
        self.base = 0                               # stamp of text[0]
        self.dead = 0                               # leading buffer tokens of removed texts

    def at(self, stamp: int) -> int:
        i = stamp - self.base
        return self.text[i] if 0 <= i < len(self.text) else SENT

    def _node(self, parent: int, tok: int, link: int) -> int:
        d = self.depth[parent] + 1
        if self.free:
            i = self.free.pop()
            self.kids[i], self.count[i], self.last[i], self.link[i], self.depth[i] = {}, 0, -1, link, d
        else:
            i = len(self.count)
            self.kids.append({})
            self.count.append(0)
            self.last.append(-1)
            self.link.append(link)
            self.depth.append(d)
        self.kids[parent][tok] = i
        self.live += 1
        return i

    def append(self, active: list[int], tok: int) -> list[int]:
        """Append `tok` to the buffer. `active` lists the explicit suffixes of the text so far, depth 0, 1, …
        (≤ height − 1); returns the new text's list. Work: one node per explicit suffix."""
        stamp = self.base + len(self.text)
        self.text.append(tok)
        kids, count, last, depth, height = self.kids, self.count, self.last, self.depth, self.height
        new = [ROOT]
        prev = ROOT                                  # explicit node of the previous (one shorter) suffix
        for k, node in enumerate(active):
            ch = kids[node].get(tok)
            if ch is None:                           # first occurrence: so is every longer suffix's
                for longer in active[k:]:
                    kids[longer][tok] = -(stamp + 1)
                break
            if ch < 0:                               # second occurrence: the reference becomes a node
                e = -ch - 1
                ch = self._node(node, tok, prev)
                count[ch] = 1
                if depth[ch] < height and (nxt := self.at(e + 1)) != SENT:
                    kids[ch][nxt] = -(e + 2)
            count[ch] += 1
            last[ch] = stamp
            prev = ch
            if depth[ch] < height:
                new.append(ch)
        return new

    def end_text(self) -> None:
        self.text.append(SENT)

    def remove(self, tokens: Sequence[int]) -> None:
        """Forget the oldest indexed text (the latest stamps of what remains stay right); its buffer is dropped."""
        kids, count = self.kids, self.count
        n = len(tokens)
        for s in range(n):
            node = ROOT
            for j in range(s, min(s + self.height, n)):
                tok = tokens[j]
                ch = kids[node][tok]
                if ch < 0:                           # this text held the only occurrence (and all below it)
                    del kids[node][tok]
                    break
                count[ch] -= 1
                if count[ch] == 0:
                    del kids[node][tok]
                    self.free.append(ch)
                    self.live -= 1
                node = ch
        self.dead += n + 1                           # the text and its separator lead the buffer
        if self.dead * 2 >= len(self.text):          # drop dead stamps in bulk: amortised O(1) per token
            del self.text[:self.dead]
            self.base += self.dead
            self.dead = 0

    def locate(self, tokens: Sequence[int]) -> Cursor | None:
        """The cursor of `tokens` (None: they never occur)."""
        node, end, d = ROOT, -1, 0
        kids, depth = self.kids, self.depth
        for tok in tokens:
            if d == depth[node]:
                ch = kids[node].get(tok)
                if ch is None:
                    return None
                if ch >= 0:
                    node = ch
                else:
                    end = -ch - 1
            else:
                if d >= self.height or self.at(end + 1) != tok:
                    return None
                end += 1
            d += 1
        return node, end, d

    def followers(self, cur: Cursor) -> list[tuple[int, int, int, Cursor]]:
        """(token, N, stamp of the latest occurrence, cursor) for each token that follows the cursor's string."""
        node, end, d = cur
        if d == self.depth[node]:
            out = []
            for tok, ch in self.kids[node].items():
                if ch >= 0:
                    out.append((tok, self.count[ch], self.last[ch], (ch, -1, d + 1)))
                else:
                    out.append((tok, 1, -ch - 1, (node, -ch - 1, d + 1)))
            return out
        if d < self.height and (nxt := self.at(end + 1)) != SENT:
            return [(nxt, 1, end + 1, (node, end + 1, d + 1))]
        return []

    def shorten(self, cur: Cursor) -> Cursor:
        """The cursor of the string without its first token."""
        node, end, d = cur
        if d == self.depth[node]:
            return self.link[node], -1, d - 1
        z = self.link[node] if node != ROOT else ROOT
        first = end - d + 2                          # stamp of the shortened string's first token
        for k in range(self.depth[z], d - 1):
            ch = self.kids[z][self.at(first + k)]
            if ch < 0:
                return z, end, d - 1
            z = ch
        return z, -1, d - 1

    def match(self, sequence: Sequence[int], max_len: int) -> tuple[int, Cursor]:
        """The longest suffix of `sequence` (≤ max_len tokens) that is followed by some token, and its cursor.
        Being followed is monotone in the length, so a binary search over lengths finds it."""
        lo, hi = 0, min(max_len, len(sequence))
        best: Cursor = (ROOT, -1, 0)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            cur = self.locate(sequence[len(sequence) - mid:])
            if cur is not None and self.followers(cur):
                lo, best = mid, cur
            else:
                hi = mid - 1
        return lo, best

    def continuation(self, cur: Cursor, num_tokens: int, max_len: int,
                     min_score: float) -> tuple[list[int], list[float]]:
        """Greedy most-frequent walk from the cursor (rule 2 of the module docstring)."""
        tokens: list[int] = []
        scores: list[float] = []
        while len(tokens) < num_tokens:
            fol = self.followers(cur)
            if not fol:
                break
            tok, c, _, nxt = max(fol, key=lambda f: (f[1], f[2]))
            score = c / sum(f[1] for f in fol)
            if score < min_score:
                break
            tokens.append(tok)
            scores.append(score)
            cur = nxt if nxt[2] <= max_len else self.shorten(nxt)
        return tokens, scores


@dataclass
class _PoolEntry:
    tenant: str | None
    tokens: list[int]
    added: float


@dataclass
class _TenantIndex:
    trie: _Trie
    entries: deque[_PoolEntry] = field(default_factory=deque)


class SuffixPool:
    """Recent finished requests, per tenant, for `SuffixProposer` (TensorRT-LLM's "global pool").

    Args:
        max_tokens: memory cap in indexed tokens over all tenants; the oldest requests are evicted first
            until a new one fits (a request longer than the cap keeps its last max_tokens tokens).
        max_age_s: requests older than this are evicted (None: no age limit).
        share_tenants: one pool for every tenant; by default a tenant only ever matches its own requests
            (requests without a tenant form one tenant of their own, `None`).
        max_depth: longest matched suffix (the proposers using the pool cap theirs at this).
        clock: seconds, monotonic (tests pass a fake one).
    """

    def __init__(self, max_tokens: int = 1 << 20, max_age_s: float | None = None, share_tenants: bool = False,
                 max_depth: int = 32, clock: Callable[[], float] = time.monotonic):
        if max_tokens < 1:
            raise ValueError(f"SuffixPool: max_tokens must be >= 1, got {max_tokens}")
        if max_age_s is not None and max_age_s <= 0:
            raise ValueError(f"SuffixPool: max_age_s must be > 0 or None, got {max_age_s}")
        if max_depth < 1:
            raise ValueError(f"SuffixPool: max_depth must be >= 1, got {max_depth}")
        self.max_tokens, self.max_age_s, self.share_tenants = max_tokens, max_age_s, share_tenants
        self.max_depth = max_depth
        self.clock = clock
        self.lock = threading.RLock()
        self._order: deque[_PoolEntry] = deque()     # every tenant's entries, oldest first
        self._index: dict[str | None, _TenantIndex] = {}
        self.tokens = 0                              # indexed tokens, all tenants

    def _key(self, tenant: str | None) -> str | None:
        return None if self.share_tenants else tenant

    def _evict_oldest(self) -> None:
        entry = self._order.popleft()
        idx = self._index[self._key(entry.tenant)]
        idx.entries.popleft()
        idx.trie.remove(entry.tokens)
        self.tokens -= len(entry.tokens)
        if not idx.entries:
            del self._index[self._key(entry.tenant)]

    def _expire(self) -> None:
        if self.max_age_s is None:
            return
        now = self.clock()
        while self._order and now - self._order[0].added > self.max_age_s:
            self._evict_oldest()

    def add(self, tokens: Sequence[int], tenant: str | None = None) -> None:
        """Index one finished request (prompt + output) for its tenant, evicting by age and memory."""
        toks = [int(t) for t in tokens[-self.max_tokens:]]
        if not toks:
            return
        with self.lock:
            self._expire()
            while self._order and self.tokens + len(toks) > self.max_tokens:
                self._evict_oldest()
            key = self._key(tenant)
            idx = self._index.get(key)
            if idx is None:
                idx = self._index[key] = _TenantIndex(_Trie(self.max_depth + 1))
            active = [ROOT]
            for tok in toks:
                active = idx.trie.append(active, tok)
            idx.trie.end_text()
            entry = _PoolEntry(tenant, toks, self.clock())
            idx.entries.append(entry)
            self._order.append(entry)
            self.tokens += len(toks)

    def requests(self, tenant: str | None = None) -> list[list[int]]:
        """The texts a request of `tenant` matches against, oldest first."""
        with self.lock:
            self._expire()
            idx = self._index.get(self._key(tenant))
            return [list(e.tokens) for e in idx.entries] if idx else []

    @property
    def nodes(self) -> int:
        """Trie nodes held, all tenants (memory grows with these: at most max_depth + 1 per token)."""
        with self.lock:
            return sum(idx.trie.live for idx in self._index.values())

    def draft(self, sequence: Sequence[int], tenant: str | None, num_tokens: int, max_depth: int,
              min_score: float = 0.0, longer_than: int = 0) -> SuffixDraft | None:
        """`tenant`'s pool draft for `sequence` when its match is longer than `longer_than` (else None)."""
        with self.lock:
            self._expire()
            idx = self._index.get(self._key(tenant))
            if idx is None:
                return None
            depth = min(max_depth, self.max_depth)
            length, cur = idx.trie.match(sequence, depth)
            if length <= longer_than:
                return None
            tokens, scores = idx.trie.continuation(cur, num_tokens, depth, min_score)
            return SuffixDraft(tokens, length, scores, "pool")


class SuffixProposer:
    """Longest-suffix, most-frequent-continuation proposer (implements `decode.spec_decode.Proposer`).

    Args:
        max_depth: longest suffix matched (and longest context a continuation is conditioned on).
        min_match: propose nothing when the match is shorter (match_len is still reported).
        min_score: stop the continuation before a token whose empirical probability is lower.
        pool: recent requests to match as well (shared between proposers; None: the request only).
        tenant: the pool tenant when `begin` names none.

    One instance follows one request at a time: `begin` / `finish` mark a request's ends (the decoder
    calls them when present); without them a sequence that does not extend the indexed one starts a new
    request (its predecessor is not added to the pool: only `finish` does that).
    """

    def __init__(self, max_depth: int = 32, min_match: int = 1, min_score: float = 0.0,
                 pool: SuffixPool | None = None, tenant: str | None = None):
        if max_depth < 1:
            raise ValueError(f"SuffixProposer: max_depth must be >= 1, got {max_depth}")
        if min_match < 0:
            raise ValueError(f"SuffixProposer: min_match must be >= 0, got {min_match}")
        if not 0.0 <= min_score <= 1.0:
            raise ValueError(f"SuffixProposer: min_score must be in [0, 1], got {min_score}")
        self.max_depth, self.min_match, self.min_score = max_depth, min_match, min_score
        self.pool, self.default_tenant = pool, tenant
        self.tenant = tenant
        self._reset()

    def _reset(self) -> None:
        self._trie = _Trie(self.max_depth + 1)
        self._active = [ROOT]
        self._begun = False

    @property
    def _text(self) -> list[int]:
        return self._trie.text                       # the request's own buffer: no separators, base 0

    def _index(self, tokens: Sequence[int]) -> None:
        trie = self._trie
        active = self._active
        for tok in tokens:
            active = trie.append(active, int(tok))
        self._active = active

    def begin(self, prompt_ids: Sequence[int], tenant: str | None = None) -> None:
        """A new request starts: index its prompt; the pool it matches is `tenant`'s (default: the constructor's)."""
        self._reset()
        self.tenant = tenant if tenant is not None else self.default_tenant
        self._index(prompt_ids)
        self._begun = True

    def finish(self, sequence: Sequence[int] | None = None) -> None:
        """The request ended: its prompt + output join its tenant's pool; the proposer is free for the next.

        `sequence`: the request's final prompt + output (the tokens of its last step were never proposed after,
        so only this call indexes them); None = what the proposer has seen.
        """
        if sequence is not None:
            self._sync(sequence)
        if self.pool is not None and self._text:
            self.pool.add(self._text, self.tenant)
        self._reset()
        self.tenant = self.default_tenant

    def _sync(self, sequence: Sequence[int]) -> None:
        n = len(self._text)
        if len(sequence) < n:
            extends = False
        elif self._begun:                           # the hooks mark request ends: a cheap check suffices
            extends = n == 0 or sequence[n - 1] == self._text[-1]
        else:
            extends = list(sequence[:n]) == self._text
        if not extends:
            begun = self._begun
            self._reset()
            self._begun = begun
            n = 0
        self._index(sequence[n:])

    def propose_scored(self, sequence: Sequence[int], num_tokens: int, pending: Sequence[int] = ()) -> SuffixDraft:
        """The draft for `sequence` (prompt + committed tokens), at most `num_tokens` tokens.

        `pending`: speculative tokens after `sequence` (a drafter's kept prefix, for a graft). The suffix matched
        is that of sequence + pending; the texts it is matched against stay the committed ones (S and the
        pool), and pending is never indexed.
        """
        self._sync(sequence)
        trie = self._trie
        if pending:
            tail: Sequence[int] = list(sequence[max(len(sequence) - self.max_depth, 0):]) + [int(t) for t in pending]
            own_len, cur = trie.match(tail, self.max_depth)
        else:
            tail = sequence
            node = self._active[-1]                  # deepest suffix seen twice (≤ max_depth): so followed
            own_len = trie.depth[node]
            cur = (node, -1, own_len)
        need = max(self.min_match, 1)
        if self.pool is not None:
            pooled = self.pool.draft(tail, self.tenant, max(num_tokens, 0), self.max_depth,
                                     self.min_score, own_len)
            if pooled is not None:
                if pooled.match_len < need:
                    return SuffixDraft([], pooled.match_len, [], "none")
                return pooled
        if own_len < need:
            return SuffixDraft([], own_len, [], "none")
        tokens, scores = trie.continuation(cur, num_tokens, self.max_depth, self.min_score)
        return SuffixDraft(tokens, own_len, scores, "request")

    def propose(self, sequence: list[int], num_tokens: int) -> list[int]:
        """Up to `num_tokens` tokens (the `Proposer` protocol)."""
        return self.propose_scored(sequence, num_tokens).tokens


def suffix_run_lengths(tokens: Sequence[int], anchors: Sequence[int], labels: Sequence[int] | None = None,
                       block_size: int = 16, max_depth: int = 32, min_match: int = 1) -> list[int]:
    """Per anchor a, how many of the B − 1 tokens after it the in-context suffix proposer gets right.

    The proposer sees `tokens[: a + 1]` (the anchor is the block's first token, as x_start in decoding) and
    proposes B − 1 tokens; the run is the length of the prefix of that proposal equal to
    `labels[a + 1 : a + B]` (labels default to `tokens`). Anchors in any order; one incremental pass.
    """
    ref = tokens if labels is None else labels
    proposer = SuffixProposer(max_depth=max_depth, min_match=min_match)
    proposer.begin([])
    order = sorted(range(len(anchors)), key=lambda i: anchors[i])
    runs = [0] * len(anchors)
    seq = list(tokens)
    for i in order:
        a = int(anchors[i])
        draft = proposer.propose(seq[: a + 1], block_size - 1)
        run = 0
        for k, tok in enumerate(draft):
            p = a + 1 + k
            if p >= len(ref) or ref[p] != tok:
                break
            run += 1
        runs[i] = run
    return runs
