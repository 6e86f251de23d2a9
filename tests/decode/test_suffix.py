"""The suffix proposer equals a brute-force oracle; the pool keeps its cap, evicts oldest first, isolates tenants."""

from __future__ import annotations

import random

import pytest

from dflashkit.decode.suffix import SuffixDraft, SuffixPool, SuffixProposer, suffix_run_lengths


# ---------------------------------------------------------------- the oracle, written from the rule's words
def followers(docs: list[list[int]], x: list[int], own: bool) -> dict[int, tuple[int, int]]:
    """t -> (N(x, t), recency of the latest occurrence of x followed by t); docs oldest first."""
    out: dict[int, tuple[int, int]] = {}
    stamp0 = 0
    for doc in docs:
        n = len(x)
        for i in range(len(doc) - n):
            if doc[i:i + n] == x:
                t = doc[i + n]
                c, _ = out.get(t, (0, -1))
                out[t] = (c + 1, stamp0 + i + n)
        stamp0 += len(doc)
    return out


def longest(seq: list[int], docs: list[list[int]], max_depth: int, own: bool) -> int:
    for length in range(min(max_depth, len(seq)), 0, -1):
        if followers(docs, seq[len(seq) - length:], own):
            return length
    return 0


def oracle(seq: list[int], pool_docs: list[list[int]], num_tokens: int, max_depth: int = 32, min_match: int = 1,
           min_score: float = 0.0, pending: list[int] | None = None) -> SuffixDraft:
    own = seq
    seq = seq + (pending or [])                      # matched as a suffix, never counted as a text
    l_req = longest(seq, [own], max_depth, True)
    l_pool = longest(seq, pool_docs, max_depth, False) if pool_docs else 0
    if l_req >= l_pool:
        docs, length, origin = [own], l_req, "request"
    else:
        docs, length, origin = pool_docs, l_pool, "pool"
    if length < max(min_match, 1):
        return SuffixDraft([], length, [], "none")
    c = seq[len(seq) - length:]
    tokens: list[int] = []
    scores: list[float] = []
    while len(tokens) < num_tokens:
        x = c[-min(len(c), max_depth):]
        f = followers(docs, x, origin == "request")
        if not f:
            break
        t = max(f, key=lambda k: f[k])
        score = f[t][0] / sum(v[0] for v in f.values())
        if score < min_score:
            break
        tokens.append(t)
        scores.append(score)
        c = c + [t]
    return SuffixDraft(tokens, length, scores, origin)


def random_seq(rng: random.Random, n: int, alphabet: int) -> list[int]:
    return [rng.randrange(alphabet) for _ in range(n)]


def repetitive_seq(rng: random.Random, n: int, alphabet: int) -> list[int]:
    """Copies of earlier spans with a few edits: long matches and competing continuations."""
    out = random_seq(rng, rng.randint(1, 6), alphabet)
    while len(out) < n:
        if rng.random() < 0.7:
            s = rng.randrange(len(out))
            out += out[s:s + rng.randint(1, 12)]
        else:
            out.append(rng.randrange(alphabet))
    return out[:n]


def assert_same(got: SuffixDraft, want: SuffixDraft, note: str) -> None:
    assert (got.tokens, got.match_len, got.origin) == (want.tokens, want.match_len, want.origin), note
    assert got.scores == pytest.approx(want.scores), note


# ------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("make", [random_seq, repetitive_seq])
def test_fresh_proposer_equals_oracle(make):
    rng = random.Random(1)
    for trial in range(150):
        depth = rng.choice([1, 2, 3, 5, 32])
        seq = make(rng, rng.randint(1, 60), rng.choice([2, 3, 5]))
        k = rng.randint(0, 9)
        min_match = rng.choice([0, 1, 1, 2, 3])
        got = SuffixProposer(max_depth=depth, min_match=min_match).propose_scored(seq, k)
        assert_same(got, oracle(seq, [], k, depth, min_match), f"trial {trial}: {seq} depth={depth} k={k}")


def test_incremental_equals_fresh_step_by_step():
    rng = random.Random(2)
    for trial in range(12):
        depth = rng.choice([2, 4, 32])
        seq = (repetitive_seq if trial % 2 else random_seq)(rng, 80, 3)
        inc = SuffixProposer(max_depth=depth)
        inc.begin(seq[:5])
        n = 5
        while n <= len(seq):
            got = inc.propose_scored(seq[:n], 6)
            assert_same(got, oracle(seq[:n], [], 6, depth), f"trial {trial} at {n}")
            n += rng.randint(1, 4)                   # a verify step commits several tokens


def test_pending_tokens_are_matched_but_never_indexed():
    rng = random.Random(6)
    for trial in range(80):
        depth = rng.choice([2, 3, 32])
        pool = SuffixPool(max_depth=depth)
        docs = [repetitive_seq(rng, rng.randint(1, 30), 3) for _ in range(rng.randint(0, 2))]
        for d in docs:
            pool.add(d, tenant="a")
        seq = repetitive_seq(rng, rng.randint(1, 30), 3)
        p = SuffixProposer(max_depth=depth, pool=pool)
        p.begin(seq[:3], tenant="a")
        before = p.propose_scored(seq, 4)
        pending = random_seq(rng, rng.randint(1, 5), 3)
        got = p.propose_scored(seq, 4, pending=pending)
        assert_same(got, oracle(seq, docs, 4, depth, pending=pending), f"trial {trial}: {seq} + {pending}")
        assert p.propose_scored(seq, 4) == before    # nothing of pending stayed


def test_new_request_without_hooks_resets():
    p = SuffixProposer()
    assert p.propose([1, 2, 3, 1, 2], 3) == [3, 1, 2]
    # not an extension of [1, 2, 3, 1, 2]: nothing of it may leak into the answer
    assert p.propose_scored([7, 1, 2], 3) == SuffixDraft([], 0, [], "none")


def test_min_score_cuts_the_continuation():
    seq = [1, 2, 3, 1, 2, 4, 1, 2, 4, 1]
    for min_score in (0.0, 0.5, 0.7, 1.0):
        got = SuffixProposer(min_score=min_score).propose_scored(seq, 5)
        assert_same(got, oracle(seq, [], 5, min_score=min_score), f"min_score {min_score}")
        assert all(s >= min_score for s in got.scores)
    seq = [1, 2, 1, 3, 1, 2, 5, 1]                  # only "1" matches: followed by 2, 3, 2
    assert SuffixProposer().propose_scored(seq, 1) == SuffixDraft([2], 1, [pytest.approx(2 / 3)], "request")
    assert SuffixProposer(min_score=0.7).propose_scored(seq, 1) == SuffixDraft([], 1, [], "request")


def test_pool_matches_equal_oracle_and_own_context_wins_ties():
    rng = random.Random(3)
    for trial in range(60):
        depth = rng.choice([2, 3, 32])
        pool = SuffixPool(max_tokens=10_000, max_depth=depth)
        docs = [repetitive_seq(rng, rng.randint(1, 30), 3) for _ in range(rng.randint(1, 4))]
        for d in docs:
            pool.add(d, tenant="a")
        seq = repetitive_seq(rng, rng.randint(1, 25), 3)
        p = SuffixProposer(max_depth=depth, pool=pool)
        p.begin(seq[:1], tenant="a")
        got = p.propose_scored(seq, 5)
        assert_same(got, oracle(seq, docs, 5, depth), f"trial {trial}: {seq} / {docs}")
    pool = SuffixPool()
    pool.add([5, 6, 7], tenant="a")
    p = SuffixProposer(pool=pool)
    p.begin([], tenant="a")
    assert p.propose_scored([5, 6, 8, 5, 6], 2) == SuffixDraft([8, 5], 2, [1.0, 1.0], "request")
    assert p.propose_scored([5, 6, 8, 5, 6, 9, 6, 7, 5, 6], 2).origin == "request"   # "5 6": both length 2
    assert p.propose_scored([9, 5, 6], 1) == SuffixDraft([7], 2, [1.0], "pool")


def test_finish_feeds_the_pool_and_tenants_stay_apart():
    for share in (False, True):
        pool = SuffixPool(share_tenants=share)
        a = SuffixProposer(pool=pool)
        a.begin([10, 11, 12, 13, 14], tenant="A")
        a.propose([10, 11, 12, 13, 14, 15], 3)
        a.finish([10, 11, 12, 13, 14, 15, 16])          # the last step's tokens come with the hook
        assert pool.requests("A") == [[10, 11, 12, 13, 14, 15, 16]]
        b = SuffixProposer(pool=pool)
        b.begin([1, 10, 11], tenant="B")
        got = b.propose_scored([1, 10, 11], 3)
        if share:
            assert got == SuffixDraft([12, 13, 14], 2, [1.0, 1.0, 1.0], "pool")
            assert b.propose([1, 10, 11, 12, 13, 14, 15], 3) == [16]
        else:
            assert got.origin != "pool" and got.tokens == []
            assert pool.requests("B") == []
        again = SuffixProposer(pool=pool)
        again.begin([1, 10, 11], tenant="A")
        assert again.propose([1, 10, 11], 3) == [12, 13, 14]


def test_pool_never_exceeds_its_cap_and_evicts_oldest_first():
    rng = random.Random(4)
    pool = SuffixPool(max_tokens=50, max_depth=4)
    added: list[tuple[str, list[int]]] = []
    for _ in range(40):
        doc = (random_seq if rng.random() < 0.5 else repetitive_seq)(rng, rng.randint(1, 70), 4)
        tenant = rng.choice(["x", "y"])
        pool.add(doc, tenant=tenant)
        added.append((tenant, doc[-50:]))
        assert pool.tokens <= 50
        assert pool.nodes - 1 <= 5 * pool.tokens     # at most max_depth + 1 nodes per token (+ roots)
        kept = pool.requests("x") + pool.requests("y")
        assert sum(map(len, kept)) == pool.tokens
        # what is kept is the newest suffix of the insertion order
        tail, total = [], 0
        for t, d in reversed(added):
            if total + len(d) > 50:
                break
            tail.append((t, d))
            total += len(d)
        assert sorted(map(tuple, kept)) == sorted(tuple(d) for _, d in tail)
        # after evictions the trie still answers as one built from what is kept
        for tenant in ("x", "y"):
            seq = repetitive_seq(rng, 14, 4)
            p = SuffixProposer(max_depth=4, pool=pool)
            p.begin([99], tenant=tenant)
            assert_same(p.propose_scored([99] + seq, 6), oracle([99] + seq, pool.requests(tenant), 6, 4),
                        f"after eviction, tenant {tenant}")


def test_pool_evicts_by_age():
    now = [0.0]
    pool = SuffixPool(max_age_s=10.0, clock=lambda: now[0])
    pool.add([1, 2, 3])
    now[0] = 6.0
    pool.add([4, 5, 6])
    now[0] = 12.0
    assert pool.requests() == [[4, 5, 6]]
    p = SuffixProposer(pool=pool)
    p.begin([])
    assert p.propose([9, 1, 2], 1) == []
    assert p.propose([9, 4, 5], 1) == [6]


def test_scores_are_probabilities_and_match_len_is_a_real_match():
    rng = random.Random(5)
    for _ in range(100):
        seq = repetitive_seq(rng, 40, 3)
        d = SuffixProposer(max_depth=8).propose_scored(seq, 6)
        assert len(d.scores) == len(d.tokens) and all(0.0 < s <= 1.0 for s in d.scores)
        m = d.match_len
        assert 0 <= m <= 8
        if m:
            tail = seq[-m:]
            assert any(seq[i:i + m] == tail for i in range(len(seq) - m))   # it occurs earlier, followed


def test_suffix_run_lengths_counts_the_right_prefix():
    toks = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4]
    runs = suffix_run_lengths(toks, [8, 4, 0], block_size=4)
    # anchor 8 (token 1): "1" seen before followed by 2 3 4 / 2 3 5 → 2 3 5 is most recent on ties: 2, 3 right
    want = []
    for a in (8, 4, 0):
        prop = oracle(toks[:a + 1], [], 3).tokens
        run = 0
        while run < len(prop) and a + 1 + run < len(toks) and prop[run] == toks[a + 1 + run]:
            run += 1
        want.append(run)
    assert runs == want and runs[2] == 0


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="max_depth"):
        SuffixProposer(max_depth=0)
    with pytest.raises(ValueError, match="min_score"):
        SuffixProposer(min_score=1.5)
    with pytest.raises(ValueError, match="max_tokens"):
        SuffixPool(max_tokens=0)
