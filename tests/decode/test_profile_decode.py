"""The speculation profile on real decodes (tiny target): the decoder marks exactly the steps that are no free
outcome of B − 1 drafts, and the profile built from its steps passes its self-checks and equals
`decode/metrics.py`'s per-position acceptance over the same steps."""

from __future__ import annotations

import dataclasses

import pytest

from dflashkit.config import TargetSection
from dflashkit.decode.api import SamplingParams
from dflashkit.decode.metrics import summarize_acceptance
from dflashkit.decode.spec_decode import SpecDecoder
from dflashkit.export.profile import Measurement, build_profile, validate
from dflashkit.target.load import load_target
from dflashkit.testing.proposers import CopyTargetProposer

PROMPTS = [[1, 60, 61, 62, 63, 64, 10, 65, 66, 67, 68, 2, 10], [1, 70, 71, 72, 2, 10], [1, 5, 6, 7, 8, 9, 10]]


@pytest.fixture(scope="module")
def target(tiny_qwen3):
    return load_target(TargetSection(path=str(tiny_qwen3), device="cpu", dtype="float32"))


class SometimesWrongProposer(CopyTargetProposer):
    """The target's own continuation with one token spoiled at a position that cycles from call to call (none
    every B-th call): every acceptance length from 1 to B shows up."""

    calls = 0

    def propose(self, sequence: list[int], num_tokens: int) -> list[int]:
        out = super().propose(sequence, num_tokens)
        self.calls += 1
        spoil = (self.calls * 3) % (num_tokens + 1)
        if spoil < num_tokens:
            out[spoil] = (out[spoil] + 1) % self.target.vocab_size
        return out


@pytest.mark.parametrize("b", [2, 4, 8])
def test_a_perfect_proposer_commits_b_tokens_on_exactly_the_uncut_steps(target, b):
    params = SamplingParams(max_new_tokens=24)  # 23 tokens after the prefill's: the last block is cut for each B
    r = SpecDecoder(target, None, b, proposer=CopyTargetProposer(target)).generate(PROMPTS[0], params)
    assert len(r.acceptance_cut) == len(r.acceptance_lengths) and any(r.acceptance_cut)
    assert [not c for c in r.acceptance_cut] == [n == b for n in r.acceptance_lengths]
    base = SpecDecoder(target, None, 1).generate(PROMPTS[0], params).token_ids
    firsts = [j for j in range(1, len(base)) if base.index(base[j]) == j]  # tokens not seen before position j
    bonus, inside = next(j for j in firsts if j % 4 == 0), next(j for j in firsts if j % 4 != 0)
    for j in (bonus, inside):  # a stop token as a block's bonus token (not cut) and inside an accepted block (cut)
        stop = dataclasses.replace(params, stop_token_ids=(base[j],))
        r = SpecDecoder(target, None, 4, proposer=CopyTargetProposer(target)).generate(PROMPTS[0], stop)
        assert r.finish_reason == "stop" and r.token_ids == base[: j + 1]
        assert [not c for c in r.acceptance_cut] == [n == 4 for n in r.acceptance_lengths]
        assert r.acceptance_cut[-1] is (j % 4 != 0)


def test_the_profile_of_a_real_decode_holds_together(target):
    params = SamplingParams(max_new_tokens=30)
    runs = {b: [SpecDecoder(target, None, b, proposer=SometimesWrongProposer(target)).generate(p, params)
                for p in PROMPTS] for b in (3, 5)}
    ms = [Measurement(b, [r.acceptance_lengths for r in rs], [r.acceptance_cut for r in rs], ["x", "y", "x"])
          for b, rs in runs.items()]
    p = build_profile(ms, headline=5, method="dflash", draft_checkpoint={}, target_model={}, block_size=5,
                      max_supported_k=4, conditions={})
    validate(p, "real decode")
    v = p["validation"]
    assert v["mean_consistency"]["abs_delta"] < 1e-5 and v["marginal_monotonicity"]["passed"]
    lengths = {int(n) for n, v in p["acceptance_length_histogram"].items() if v}
    assert lengths == {1, 2, 3, 4, 5}, "the proposer should give every length"
    # the same steps through decode/metrics.py's own definition
    uncut = [dataclasses.replace(r, acceptance_lengths=[n for n, c in zip(r.acceptance_lengths, r.acceptance_cut)
                                                        if not c]) for r in runs[5]]
    ref = summarize_acceptance(uncut, 5)
    assert p["marginal_accept_rates"] == pytest.approx(ref["per_position_acceptance"], abs=1e-4)
    assert p["mean_accept_length"] == pytest.approx(ref["tau"], abs=1e-4)
    assert p["measurement_conditions"]["steps"]["mean_accept_length_all_steps"] == pytest.approx(
        summarize_acceptance(runs[5], 5)["tau"], abs=1e-4)
    assert set(p["per_category"]) == {"x", "y"} and p["accept_length_by_k"].keys() == {"2", "4"}
