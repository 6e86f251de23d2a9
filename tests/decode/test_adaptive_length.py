"""The adaptive draft length (SpecDecoder(adaptive=True), decode/draft_length.py) keeps decoding lossless.

Greedy output equals the target's own greedy output whatever lengths the policy picks: the policy's own
choices on a random drafter, and a planted policy that cycles through every length 0 … B−1.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from dflashkit.config import TargetSection
from dflashkit.decode.api import SamplingParams
from dflashkit.decode.spec_decode import SpecDecoder
from dflashkit.target.load import load_target
from dflashkit.testing import random_drafter

PROMPT = [1, 60, 61, 62, 63, 64, 10, 65, 66, 67, 68, 2, 10]


@pytest.fixture(scope="module")
def targets(tiny_targets):
    return {arch: load_target(TargetSection(path=str(d), device="cpu", dtype="float32"))
            for arch, d in tiny_targets.items() if arch in ("qwen3", "llama")}


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("block", [2, 4, 8])
def test_adaptive_greedy_equals_target_greedy(targets, arch, block):
    target = targets[arch]
    drafter = random_drafter(target, block_size=8)
    params = SamplingParams(max_new_tokens=31)
    ref = SpecDecoder(target, None, block_size=1).generate(PROMPT, params).token_ids
    dec = SpecDecoder(target, drafter, block_size=block, adaptive=True)
    r = dec.generate(PROMPT, params)
    assert r.token_ids == ref
    assert sum(r.acceptance_lengths) == 30 and all(1 <= a <= block for a in r.acceptance_lengths)
    assert dec.policy is not None and sorted(dec.policy.cost) == list(range(1, block + 1))  # t(n) was measured

    lengths = itertools.cycle(range(block))                  # every length, including no drafts at all
    chosen = []
    dec.policy.choose = lambda conf: chosen.append(next(lengths)) or chosen[-1]  # type: ignore[method-assign]
    r = dec.generate(PROMPT, params)
    assert r.token_ids == ref
    assert set(chosen) == set(range(block)) or len(chosen) < block
    assert all(a <= c + 1 for a, c in zip(r.acceptance_lengths, chosen))  # never more than the verified drafts + 1


def test_confidence_is_the_draft_heads_probability_of_each_proposal(targets):
    target = targets["qwen3"]
    drafter = random_drafter(target, block_size=4)
    dec = SpecDecoder(target, drafter, block_size=4, adaptive=True)
    logits = torch.randn(3, target.vocab_size)
    tokens = [5, 17, 3]
    want = [float(torch.softmax(logits[i], -1)[t]) for i, t in enumerate(tokens)]
    assert dec._confidence(logits, tokens) == pytest.approx(want, rel=1e-6)


def test_adaptive_sampling_runs_and_stays_in_bounds(targets):
    target = targets["llama"]
    drafter = random_drafter(target, block_size=4)
    dec = SpecDecoder(target, drafter, block_size=4, adaptive=True, draft_sampling="sample")
    r = dec.generate(PROMPT, SamplingParams(max_new_tokens=20, temperature=0.8, seed=3))
    assert len(r.token_ids) == 20 and all(1 <= a <= 4 for a in r.acceptance_lengths)
