"""The online drafter gate (decode/online_gate.py): with a clock in which drafter steps are dear it switches the
drafter off and re-probes it after a doubling back-off; with a cheap drafter it keeps it on; whatever it decides
the output is the target's (greedy, and its law when sampling), and a drafter that sat out plain steps proposes
what one fed every step would. No test reads a real clock: the decoder's `_now` is a counter the test advances."""

from __future__ import annotations

import pytest

from dflashkit.decode.api import SamplingParams
from dflashkit.decode.hybrid import NEVER, HybridGate, HybridProposer
from dflashkit.decode.online_gate import DrafterSwitch, OnlineGate
from dflashkit.decode.spec_decode import SpecDecoder
from dflashkit.decode.suffix import SuffixProposer
from dflashkit.errors import UsageError
from dflashkit.testing import random_drafter
from tests.decode.test_hybrid import PROMPT, _greedy, _Targets, _teacher_forced
from tests.helpers import results_of

N = 30
RULE = OnlineGate(min_steps=3, backoff=2, max_backoff=8, probe_steps=1)
# drafter runs (D) and plain steps (P) under RULE when a drafter step costs more than a plain step commits: three
# measured drafter steps, one plain probe (no plain step measured yet), off for 2; a re-probe (its catch-up run,
# then one measured run), off for 4; again, off for 8 (the cap); again, off for 8
EXPENSIVE = "DDD" + "P" + "PP" + "DD" + "PPPP" + "DD" + "P" * 8 + "DD" + "P" * 8


@pytest.fixture(scope="module")
def targets(tiny_targets, tmp_path_factory):
    return _Targets(tiny_targets, tmp_path_factory.mktemp("online"))


class Clocked(SpecDecoder):
    """A decoder whose clock is a counter: each target forward costs `forward_s`, each drafter run `draft_s`.
    Records the committed sequence, anchor and context width at each drafter run (`calls`)."""

    forward_s, draft_s = 1.0, 0.0

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.clock, self.calls = 0.0, []

    def _now(self) -> float:
        return self.clock

    def _forward(self, *a, **kw):
        self.clock += self.forward_s
        return super()._forward(*a, **kw)

    def _draft(self, seq, start, k, ctx, dcache, positions, params, gen, confidence=False):
        self.clock += self.draft_s
        tokens, law, conf = super()._draft(seq, start, k, ctx, dcache, positions, params, gen, confidence)
        self.calls.append((list(seq[: start + 1]), start, k, ctx.shape[1], tokens))
        return tokens, law, conf


def _runs(r, n_steps: int | None = None) -> str:
    return "".join("P" if b == "plain" else "D" for b in r.branch[:n_steps])


def _hybrid_never(target, b: int = 4, draft_s: float = 10.0, lean: bool = True, rule: OnlineGate = RULE):
    """A hybrid whose suffix branch never drafts alone: each step is the drafter's or a plain one."""
    dec = Clocked(target, random_drafter(target, block_size=b), b, lean=lean, online_gate=rule,
                  hybrid=HybridProposer(SuffixProposer(), HybridGate(min_match=NEVER)))
    dec.draft_s = draft_s
    return dec


def test_dear_drafter_is_switched_off_and_reprobed_with_a_doubling_backoff(targets):
    target = targets["qwen3"]
    dec = _hybrid_never(target)
    r = dec.generate(PROMPT, SamplingParams(max_new_tokens=N))
    assert r.token_ids == _greedy(target, PROMPT, N)
    steps = len(r.branch)
    assert steps >= 24
    assert _runs(r) == EXPENSIVE[:steps]
    assert r.drafter_off == r.branch.count("plain") == _runs(r).count("P")


def test_cheap_drafter_stays_on_after_one_plain_probe(targets):
    target = targets["qwen3"]
    dec = _hybrid_never(target, draft_s=0.0)
    r = dec.generate(PROMPT, SamplingParams(max_new_tokens=N))
    assert r.token_ids == _greedy(target, PROMPT, N)
    assert _runs(r) == "DDDP" + "D" * (len(r.branch) - 4)
    assert r.drafter_off == 1


def test_the_plain_drafter_decoder_is_gated_too(targets):
    """Without a hybrid: plain steps are counted in `drafter_off` (no branch labels), the output is the target's."""
    target = targets["llama"]
    dec = Clocked(target, random_drafter(target, block_size=4), 4, online_gate=RULE)
    dec.draft_s = 10.0
    r = dec.generate(PROMPT, SamplingParams(max_new_tokens=N))
    assert r.token_ids == _greedy(target, PROMPT, N)
    assert r.branch == [] and r.drafter_off >= 10
    assert len(dec.calls) == len(r.acceptance_lengths) - r.drafter_off
    assert SpecDecoder(target, random_drafter(target, block_size=4), 4).online is None  # off unless asked


def test_suffix_steps_bound_the_plain_step(targets):
    """With the suffix branch drafting too, a dear drafter loses against the suffix steps' cost (an upper bound on
    a plain step's) and is switched off with no plain probe first: off for 2 steps, then the re-probe."""
    target = targets["qwen3"]
    dec = Clocked(target, random_drafter(target, block_size=4), 4, online_gate=RULE,
                  hybrid=HybridProposer(SuffixProposer(), HybridGate(min_match=1)))
    dec.draft_s = 10.0
    prompt = PROMPT[:12] * 3
    r = dec.generate(prompt, SamplingParams(max_new_tokens=N))
    assert r.token_ids == _greedy(target, prompt, N)
    third = [i for i, b in enumerate(r.branch) if b == "drafter"][2]
    assert "suffix" in r.branch[:third]  # a bound exists when the drafter has its 3 measured steps
    assert [b for b in r.branch if b != "suffix"][:6] == ["drafter"] * 3 + ["plain"] * 2 + ["drafter"]


@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v3", "qwen3_next"])
def test_gated_hybrid_greedy_equals_target_greedy(targets, arch):
    """Lossless with the gate switching, the suffix branch drafting too, a hybrid target included (B = 2/4/8 on
    qwen3, B = 4 on the others)."""
    target = targets[arch]
    ref = _greedy(target, PROMPT, N)
    for b in (2, 4, 8) if arch == "qwen3" else (4,):
        dec = Clocked(target, random_drafter(target, block_size=b), b, online_gate=RULE,
                      hybrid=HybridProposer(SuffixProposer(), HybridGate(min_match=4)))
        dec.draft_s = 10.0
        r = dec.generate(PROMPT, SamplingParams(max_new_tokens=N))
        assert r.token_ids == ref, b
        assert "plain" in r.branch and "drafter" in r.branch
        assert all(not o for br, o in zip(r.branch, r.draft_origin) if br == "plain")


@pytest.mark.parametrize("lean", [True, False])
def test_a_drafter_back_from_plain_steps_proposes_as_one_fed_every_token(targets, lean):
    """The re-probe's drafter reads every feature the plain steps committed: its proposal equals a fresh drafter's
    fed the whole committed sequence (teacher forcing)."""
    target = targets["qwen3"]
    dec = _hybrid_never(target, lean=lean)
    r = dec.generate(PROMPT, SamplingParams(max_new_tokens=N))
    assert "plain" in r.branch
    later = [c for c in dec.calls if c[1] > len(PROMPT)]
    assert any(c[3] > 2 for c in later)  # fed several plain steps' tokens at once
    for seq, start, k, _, tokens in later:
        assert tokens == _teacher_forced(dec, seq, start, k)[0]


def test_gated_sampling_matches_the_target_law():
    """χ² of 3-token continuations against the exact law with the drafter's sampled law on its steps and plain
    steps where the gate has it off (tests/decode/test_sampling.py)."""
    from tests.decode.test_sampling import _chi2_z, _exact_law, _samples, _tiny_small_vocab_target

    target, drafter = _tiny_small_vocab_target()
    prompt = [1, 2, 3, 4, 1, 2]
    law = _exact_law(target.model, prompt, 2.0)  # flatter than at 1.0: a plain step that did not sample would show
    dec = Clocked(target, drafter, block_size=2, draft_sampling="sample",
                  online_gate=OnlineGate(min_steps=1, backoff=1, probe_steps=1))
    dec.draft_s = 10.0
    results = results_of(dec)
    z = _chi2_z(_samples(dec, prompt, 400, 2.0), law)
    off = [r.drafter_off for r in results]
    print(f"chi2 z={z:.3f} plain steps in {sum(off)} of {len(off)} requests")
    assert 0 < sum(off) < len(off)  # some requests took a plain step
    assert abs(z) < 4.0, f"chi-square z = {z:.2f} (|z| < 4 expected for the target's law)"


def test_switch_rule_without_a_decoder():
    """The state machine alone: a re-probe the drafter wins keeps it on and resets the back-off."""
    s = DrafterSwitch(OnlineGate(min_steps=2, backoff=2, probe_steps=1, margin=0.0))
    s.observe(False, 0, 1, 1.0)  # a plain step: 1 token a second
    for _ in range(2):
        assert s.runs()
        s.observe(True, 3, 1, 4.0)  # the drafter: a token in 4 s
    assert [s.runs() for _ in range(3)] == [False, False, True]  # off for 2, then the re-probe
    s.observe(True, 3, 4, 9.0)  # its catch-up run: not measured (4 tokens in 9 s would lose)
    assert s.runs()
    s.observe(True, 3, 4, 2.0)  # 2 tokens a second: it wins
    assert s.mode == "on" and s.backoff == 2 and all(s.runs() for _ in range(5))


def test_bad_online_gate():
    with pytest.raises(UsageError, match="min_steps"):
        OnlineGate(min_steps=0)
    with pytest.raises(UsageError, match="margin"):
        OnlineGate(margin=1.0)


def test_eval_keys_and_decoders_with_the_online_gate(targets):
    """eval.hybrid_online_gate: each grid point without the gate (off), with it (on, "+online"), or both; the key
    builds a decoder that gates, and results.json records the gate."""
    from dflashkit.config import load_config
    from dflashkit.decode.evaluation import (block_of, gate_dict, group_key, hybrid_decoders, hybrid_gate,
                                             hybrid_keys, proposer_of)

    grid = ["hybrid-4@2", "hybrid-4@4", "graft-4@4"]
    keys = {v: hybrid_keys(load_config(None, [f"eval.hybrid_online_gate={v}"]), 4) for v in ("off", "on", "both")}
    assert keys["off"] == ["suffix-4", *grid]
    assert keys["on"] == ["suffix-4", *(k + "+online" for k in grid)]
    assert keys["both"] == ["suffix-4", *grid, *(k + "+online" for k in grid)]
    g = hybrid_gate("graft-4@4/2+online")
    assert g is not None and (g.min_match, g.graft, g.drafter_block, g.online_gate) == (4, True, 2, True)
    assert gate_dict(g) == {"min_match": 4, "graft": True, "drafter_block": 2, "online_gate": True}
    assert "online_gate" not in gate_dict(hybrid_gate("hybrid-4@2"))  # type: ignore[arg-type]
    assert block_of("hybrid-4@2+online") == 4 and proposer_of("hybrid-4@2+online") == "hybrid"
    assert group_key("hybrid-4@2+online") == ("hybrid", "4@2+online")
    cfg = load_config(None, ["eval.hybrid_online_gate=both", "eval.hybrid_graft=false", "eval.hybrid_gates=[2]"])
    target = targets["qwen3"]
    decs = hybrid_decoders(cfg, target, random_drafter(target, block_size=4), 4)
    assert [k for k, d in decs.items() if getattr(d, "online", None) is not None] == ["hybrid-4@2+online"]
