"""The hybrid proposer in the decoder (decode/hybrid.py): lossless whichever branch drafts, every verified draft
token labelled with its origin, and a drafter that skips steps proposes what a drafter fed every step would."""

from __future__ import annotations

import pytest
import torch

from dflashkit.config import TargetSection
from dflashkit.decode.api import SamplingParams
from dflashkit.decode.hybrid import NEVER, HybridGate, HybridProposer, label
from dflashkit.decode.spec_decode import SpecDecoder
from dflashkit.decode.suffix import SuffixPool, SuffixProposer
from dflashkit.errors import UsageError
from dflashkit.model.drafter import DraftKVCache
from dflashkit.target.load import Target, load_target
from dflashkit.testing import random_drafter
from dflashkit.testing.proposers import CopyTargetProposer
from tests.harness.hybrid import HYBRID_ARCHS, make_tiny_hybrid_target
from tests.helpers import pinned_cost, results_of

# repeated text: the suffix branch has long matches from the first step on
PROMPT = [1, 60, 61, 62, 63, 64, 10, 65, 66, 67, 68, 2, 10, 60, 61, 62, 63, 64, 10, 65, 66, 67]
N = 30
ORIGINS = {"drafter", "suffix", "both"}


class _Targets(dict):
    """Tiny targets by arch, each loaded on first use (most tests here need two of them)."""

    def __init__(self, tiny_targets, base):
        super().__init__()
        self.tiny_targets, self.base = tiny_targets, base

    def __missing__(self, arch: str) -> Target:
        path = self.tiny_targets[arch] if arch in self.tiny_targets else make_tiny_hybrid_target(self.base / arch, arch)
        target = self[arch] = load_target(TargetSection(path=str(path), device="cpu", dtype="float32"))
        return target


@pytest.fixture(scope="module")
def targets(tiny_targets, tmp_path_factory):
    """qwen3, llama, deepseek_v3 (MLA + MoE), and the tiny hybrids of `tests.harness.hybrid` (HYBRID_ARCHS)."""
    return _Targets(tiny_targets, tmp_path_factory.mktemp("hybrid"))


def _greedy(target: Target, prompt: list[int], n: int) -> list[int]:
    return SpecDecoder(target, None, 1).generate(prompt, SamplingParams(max_new_tokens=n)).token_ids


def _hf_greedy(target: Target, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = target.model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                    max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _check_shape(r, b: int) -> None:
    """τ within [1, B], one branch and one origin list per step, an origin for every verified draft."""
    assert all(1 <= a <= b for a in r.acceptance_lengths)
    assert len(r.branch) == len(r.draft_origin) == len(r.acceptance_lengths)
    assert sum(len(o) for o in r.draft_origin) == r.verified_drafts
    for branch, origin in zip(r.branch, r.draft_origin):
        assert set(origin) <= ORIGINS
        assert (branch == "none") == (not origin)
        if branch == "suffix":
            assert set(origin) == {"suffix"}
        if branch == "drafter":
            assert set(origin) <= {"drafter", "both"}


def _hybrid(min_match: int = 2, **gate) -> HybridProposer:
    return HybridProposer(SuffixProposer(), HybridGate(min_match=min_match, **gate))


@pytest.mark.parametrize("arch", ["qwen3", "llama", "deepseek_v3", *HYBRID_ARCHS])
def test_hybrid_greedy_equals_target_greedy(targets, arch):
    target = targets[arch]
    ref = _greedy(target, PROMPT, N)
    assert ref == _hf_greedy(target, PROMPT, N)  # the reference is transformers' own greedy output
    params = SamplingParams(max_new_tokens=N)
    for b in (2, 4, 8):
        for lean in (True, False):
            hybrid = HybridProposer(SuffixProposer(pool=SuffixPool()), HybridGate(min_match=2))
            dec = SpecDecoder(target, random_drafter(target, block_size=b), b, hybrid=hybrid, lean=lean)
            branches: set[str] = set()
            # The same request twice: a target whose greedy output never repeats itself nor the prompt (bamba's,
            # nemotron_h's here) gives the suffix branch nothing to match the first time; the second time the pool
            # holds the first, and the suffix branch drafts whatever the target writes.
            for run in ("first", "again"):
                r = dec.generate(PROMPT, params)
                assert r.token_ids == ref, f"B={b} lean={lean} {run}"
                assert sum(r.acceptance_lengths) == N - 1
                _check_shape(r, b)
                branches |= set(r.branch)
            assert {"suffix", "drafter"} <= branches, (b, r.branch)  # both branches drafted



class _Stub(SpecDecoder):
    """The drafter runs (and is fed) as usual, but its block is replaced by the target's greedy continuation with
    its first token right and the others wrong, confidences 1, 0, 0, …: every block is grafted where the suffix
    proposer matches. `blocks` records each block and its graft."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.copy = CopyTargetProposer(self.target)
        self.blocks: list[tuple[list[int], object]] = []
        assert self.hybrid is not None
        graft = self.hybrid.graft

        def recording(sequence, tokens, conf, suffix_tokens, size=None):
            g = graft(sequence, tokens, conf, suffix_tokens, size=size)
            self.blocks.append((list(tokens), g, list(suffix_tokens)))
            return g
        self.hybrid.graft = recording  # type: ignore[method-assign]

    def _draft(self, seq, start, k, ctx, dcache, positions, params, gen, confidence=False):
        _, law, _ = super()._draft(seq, start, k, ctx, dcache, positions, params, gen, confidence)
        good = self.copy.propose(seq[: start + 1], k)
        tokens = good[:1] + [(t + 1) % self.target.vocab_size for t in good[1:]]
        return tokens, law, [1.0] + [0.0] * (k - 1)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_next"])
def test_graft_is_lossless_and_labels_each_token_with_its_branch(targets, arch):
    target = targets[arch]
    ref = _greedy(target, PROMPT, N)
    for b in (4, 8):
        dec = _Stub(target, random_drafter(target, block_size=b), b,
                    hybrid=_hybrid(NEVER, graft=True, graft_min_match=1, graft_conf=0.5))
        r = dec.generate(PROMPT, SamplingParams(max_new_tokens=N))
        assert r.token_ids == ref, f"B={b}"
        _check_shape(r, b)
        assert "graft" in r.branch and "suffix" not in r.branch
        grafts = [(tokens, g, s) for tokens, g, s in dec.blocks if g is not None]
        assert grafts
        disagree = 0
        for tokens, g, suffix_first in grafts:
            assert len(g.tokens) == len(tokens) == len(g.origin)  # filled to the block
            for i, (tok, origin) in enumerate(zip(g.tokens, g.origin)):
                from_suffix = i in g.suffix_rows
                other = tokens[i] if from_suffix else (suffix_first[i] if i < len(suffix_first) else None)
                if from_suffix:
                    assert origin == ("both" if tok == tokens[i] else "suffix")
                else:
                    assert tok == tokens[i] and origin == ("both" if tok == other else "drafter")
                disagree += origin != "both"
            assert g.suffix_rows and g.suffix_rows[0] == 1  # the drafter's one confident token, then the match
        assert disagree
        # what the decoder reports for a graft step is the graft's labels (cut to what was verified)
        graft_steps = [o for br, o in zip(r.branch, r.draft_origin) if br == "graft"]
        made = [g.origin for _, g, _ in grafts]
        assert all(any(o == m[: len(o)] for m in made) for o in graft_steps)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_next"])
def test_a_short_drafter_block_beside_long_suffix_drafts_is_lossless(targets, arch):
    """drafter_block=2: the drafter branch verifies one draft, the suffix branch and grafts up to B − 1."""
    target = targets[arch]
    ref = _greedy(target, PROMPT, N)
    longest = {False: 0, True: 0}
    for b in (4, 8):
        for graft in (False, True):
            hyb = _hybrid(min_match=2 if not graft else NEVER, drafter_block=2, graft=graft, graft_min_match=1,
                          graft_conf=1.0)
            cls = _Stub if graft else SpecDecoder  # the stub's first token is the target's: the graft matches on
            r = cls(target, random_drafter(target, block_size=b), b, hybrid=hyb).generate(
                PROMPT, SamplingParams(max_new_tokens=N))
            assert r.token_ids == ref, f"B={b} graft={graft}"
            _check_shape(r, b)
            by = {br: [len(o) for x, o in zip(r.branch, r.draft_origin) if x == br] for br in set(r.branch)}
            assert max(by.get("drafter", [0])) <= 1, by  # the drafter's block is 2
            longest[graft] = max(longest[graft], *by.get("graft" if graft else "suffix", [0]))
    assert longest[False] > 0 and longest[True] > 1, longest  # the other branches draft past the drafter's block


def test_graft_labels_disagreements_by_branch():
    """A unit check of `HybridProposer.graft` with a suffix proposer whose answer is known."""
    from dflashkit.decode.suffix import SuffixDraft

    calls = []

    class Fixed:
        def propose_scored(self, sequence, num_tokens, pending=()):
            calls.append((list(sequence), list(pending), num_tokens))
            return SuffixDraft(tokens=[7, 8, 9][:num_tokens], match_len=3, scores=[0.9, 0.8, 0.7][:num_tokens],
                               origin="request")

    hyb = HybridProposer(Fixed(), HybridGate(graft=True, graft_conf=0.5, graft_min_match=2))  # type: ignore[arg-type]
    g = hyb.graft([1, 2], [5, 6, 8, 4, 3, 2], [0.9, 0.7, 0.2, 0.9, 0.9, 0.9], suffix_tokens=[5, 0])
    assert calls == [([1, 2], [5, 6], 4)]  # the kept prefix is matched as pending tokens, never committed
    assert g is not None
    assert g.tokens == [5, 6, 7, 8, 9, 2]
    assert g.origin == ["both", "drafter", "suffix", "suffix", "suffix", "drafter"]
    assert g.conf == [0.9, 0.7, 0.9, 0.8, 0.7, 0.9] and g.suffix_rows == [2, 3, 4]
    g = hyb.graft([1], [5, 8], [0.1, 0.9], [])  # an unconfident first token is kept all the same
    assert g is not None and g.tokens == [5, 7] and g.origin == ["drafter", "suffix"] and calls[-1][1] == [5]
    assert hyb.graft([1], [5, 6], [0.9, 0.9], []) is None  # a confident whole block is not grafted
    g = hyb.graft([1], [5], [0.9], [5, 7], size=3)  # a short drafter block continued up to `size`
    assert g is not None and g.tokens == [5, 7, 8] and g.origin == ["both", "suffix", "suffix"]
    assert g.suffix_rows == [1, 2] and g.conf == [0.9, 0.9, 0.8] and calls[-1] == ([1], [5], 2)
    assert hyb.graft([1], [5, 6], [0.9, 0.9], [], size=2) is None  # size = the block: nothing to continue
    assert hyb.drafter_drafts(7) == 7
    assert HybridProposer(Fixed(), HybridGate(drafter_block=2)).drafter_drafts(7) == 1  # type: ignore[arg-type]
    strict = HybridProposer(Fixed(), HybridGate(graft=True, graft_min_match=4))  # type: ignore[arg-type]
    assert strict.graft([1], [5, 6], [0.9, 0.1], []) is None  # the match (3) is too short
    assert label([1, 2, 3], [1, 5], "drafter") == ["both", "drafter", "drafter"]


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_next"])
def test_adaptive_hybrid_is_lossless_and_keeps_a_policy_per_branch(targets, arch):
    target = targets[arch]
    ref = _greedy(target, PROMPT, N)
    # a flat cost table: every draft rated above zero is verified, whatever this machine's t(n)
    dec = pinned_cost(SpecDecoder(target, random_drafter(target, block_size=4), 4, hybrid=_hybrid(graft=True),
                                  adaptive=True), {1: 1.0})
    r = dec.generate(PROMPT, SamplingParams(max_new_tokens=N))
    assert r.token_ids == ref
    _check_shape(r, 4)
    assert set(dec.policies) == {"drafter", "suffix", "graft"} and dec.policies["drafter"] is dec.policy
    assert all(sorted(p.cost) == [1, 2, 3, 4] for p in dec.policies.values())
    assert "suffix" in r.branch and sum(dec.policies["suffix"]._conf) > 0  # it saw the suffix scores
    assert dec.policies["suffix"].draft_s > 0


def test_the_suffix_policy_weighs_the_suffix_scores(targets):
    """With `adaptive`, a suffix step's length is chosen by the suffix branch's policy from the draft's scores."""
    target = targets["qwen3"]
    dec = pinned_cost(SpecDecoder(target, random_drafter(target, block_size=4), 4, hybrid=_hybrid(), adaptive=True),
                      {1: 1.0})
    assert dec.hybrid is not None
    drafts, seen = [], []
    suffix_draft, choose = dec.hybrid.suffix_draft, dec.policies["suffix"].choose
    dec.hybrid.suffix_draft = lambda seq, k: drafts.append(suffix_draft(seq, k)) or drafts[-1]  # type: ignore
    dec.policies["suffix"].choose = lambda conf: seen.append((drafts[-1], list(conf))) or choose(conf)  # type: ignore
    r = dec.generate(PROMPT, SamplingParams(max_new_tokens=N))
    assert len(seen) >= r.branch.count("suffix") > 0  # (a suffix step cut to no drafts counts as "none")
    assert all(conf == d.scores[:3] and d.match_len >= 2 for d, conf in seen)


def _teacher_forced(dec: SpecDecoder, seq: list[int], start: int, k: int):
    """The drafter's proposal after seq[start] from a fresh cache fed the features of seq[:start] at once."""
    feats, _ = dec.target.features(torch.tensor([seq[:start]]), layer_ids=dec.layer_ids, need_logits=True)
    positions = torch.arange(start + k + 1)[None]
    state = dec._fast.new_state(start + k + 1) if dec._fast is not None else DraftKVCache()
    return dec._draft(seq, start, k, feats, state, positions, SamplingParams(), None, confidence=True)


@pytest.mark.parametrize("lean", [True, False])
def test_a_drafter_that_skipped_steps_proposes_as_one_fed_every_token(targets, lean):
    """After suffix steps, the drafter reads all the pending features at once; its proposal equals a fresh
    drafter's fed the whole committed sequence (teacher forcing)."""
    target = targets["qwen3"]
    calls = []

    class Recording(SpecDecoder):
        def _draft(self, seq, start, k, ctx, dcache, positions, params, gen, confidence=False):
            tokens, law, conf = super()._draft(seq, start, k, ctx, dcache, positions, params, gen, True)
            calls.append((list(seq[: start + 1]), start, k, ctx.shape[1], (tokens, law, conf)))
            return tokens, law, conf if confidence else None

    dec = Recording(target, random_drafter(target, block_size=4), 4, hybrid=_hybrid(), lean=lean)
    assert (dec._fast is not None) == lean
    r = dec.generate(PROMPT, SamplingParams(max_new_tokens=N))
    assert "suffix" in r.branch
    later = [c for c in calls if c[1] > len(PROMPT)]
    assert any(c[3] > 1 for c in later)  # fed more than one step's tokens at once
    for seq, start, k, _, (tokens, _, conf) in later:
        ref_tokens, _, ref_conf = _teacher_forced(dec, seq, start, k)
        assert tokens == ref_tokens
        assert conf == pytest.approx(ref_conf, abs=1e-4)


class _Hooked(CopyTargetProposer):
    """Records the request hooks around its proposals."""

    def __init__(self, target):
        super().__init__(target)
        self.events: list[tuple] = []

    def begin(self, prompt_ids, tenant=None):
        self.events.append(("begin", tuple(prompt_ids), tenant))

    def propose(self, sequence, num_tokens):
        self.events.append(("propose",))
        return super().propose(sequence, num_tokens)

    def finish(self, sequence=None):
        self.events.append(("finish", tuple(sequence)))


def test_plain_proposer_request_hooks(targets):
    """`begin(prompt, tenant)` before the first proposal, `finish()` after the last."""
    target = targets["qwen3"]
    proposer = _Hooked(target)
    r = SpecDecoder(target, None, 4, proposer=proposer).generate(PROMPT, SamplingParams(max_new_tokens=5,
                                                                                         tenant="a"))
    events = proposer.events
    assert events[0] == ("begin", tuple(PROMPT), "a") and events[-1] == ("finish", tuple(PROMPT + r.token_ids))
    assert {e[0] for e in events[1:-1]} == {"propose"}


def test_hybrid_request_hooks(targets):
    """The hybrid hands the hooks to its suffix proposer, one begin/finish per request."""
    target = targets["qwen3"]
    events: list[tuple] = []

    class Hooked(SuffixProposer):
        def begin(self, prompt_ids, tenant=None):
            events.append(("begin", tenant))
            super().begin(prompt_ids, tenant)

        def finish(self, sequence=None):
            events.append(("finish", len(sequence)))
            super().finish(sequence)

    dec = SpecDecoder(target, random_drafter(target, block_size=4), 4,
                      hybrid=HybridProposer(Hooked(), HybridGate(min_match=2)))
    dec.generate(PROMPT, SamplingParams(max_new_tokens=6, tenant="t1"))
    dec.generate(PROMPT, SamplingParams(max_new_tokens=6))
    n = len(PROMPT) + 6
    assert events == [("begin", "t1"), ("finish", n), ("begin", None), ("finish", n)]


def test_bad_gates_and_a_hybrid_without_drafter(targets):
    with pytest.raises(UsageError, match="min_match"):
        HybridGate(min_match=-1)
    with pytest.raises(UsageError, match="graft_conf"):
        HybridGate(graft_conf=1.5)
    with pytest.raises(UsageError, match="drafter_block"):
        HybridGate(drafter_block=1)
    with pytest.raises(UsageError, match="needs a drafter"):
        SpecDecoder(targets["qwen3"], None, 4, hybrid=_hybrid())


GRAFT = dict(min_match=NEVER, graft=True, graft_min_match=1, graft_conf=1.0)


@pytest.mark.parametrize("gate,adaptive", [(dict(min_match=1), False), (GRAFT, False), (GRAFT, True),
                                          ({**GRAFT, "drafter_block": 2}, False)],
                         ids=["suffix", "graft", "graft-adaptive", "graft-short-drafter"])
def test_hybrid_sampling_matches_the_target_law(gate, adaptive):
    """χ² of 3-token continuations against the exact law (tests/decode/test_sampling.py): suffix drafts are point
    masses beside the drafter's sampled law; grafted rows carry one-hot laws."""
    from tests.decode.test_sampling import _chi2_z, _exact_law, _samples, _tiny_small_vocab_target

    target, drafter = _tiny_small_vocab_target()
    prompt = [1, 2, 3, 4, 1, 2]
    law = _exact_law(target.model, prompt, 1.0)
    dec = SpecDecoder(target, drafter, block_size=4, draft_sampling="sample", hybrid=_hybrid(**gate),
                      adaptive=adaptive)
    if adaptive:  # lengths from the confidences, not this machine's t(n): a slow t(4) could leave no block to graft
        pinned_cost(dec, {1: 1.0, 4: 2.0})
    results = results_of(dec)
    z = _chi2_z(_samples(dec, prompt, 500, 1.0), law)
    branches = {b for r in results for b in r.branch}
    print(f"chi2 z={z:.3f} branches={branches}")
    assert ("suffix" if gate["min_match"] == 1 else "graft") in branches
    assert abs(z) < 4.0, f"chi-square z = {z:.2f} (|z| < 4 expected for the target's law)"
