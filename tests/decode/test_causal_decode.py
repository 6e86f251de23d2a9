"""Decoding a causal (JetSpec) drafter: greedy speculative output ≡ the target's greedy output on the tiny targets
(DFlash and DFlash2), and the decoder's drafts are causal: a shorter block drafts the first positions of the longer
one exactly (a bidirectional drafter's drafts depend on the block length)."""

from __future__ import annotations

import pytest
import torch

from dflashkit.config import TargetSection
from dflashkit.decode.api import SamplingParams
from dflashkit.decode.spec_decode import SpecDecoder
from dflashkit.target.load import load_target
from dflashkit.testing import random_drafter

PROMPTS = ([1, 60, 61, 62, 63, 64, 10, 65, 66, 67, 68, 2, 10], [1, 5, 9, 14, 3, 77, 120, 4], [1, 200, 201, 2, 7])
DFLASH2 = {"drafter_type": "dflash2", "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 6}


@pytest.fixture(scope="module")
def targets(tiny_targets):
    return {arch: load_target(TargetSection(path=str(d), device="cpu", dtype="float32"))
            for arch, d in tiny_targets.items()}


def _drafter(target, causal: bool, **extra):
    d = random_drafter(target, block_size=8, layers=2, seed=5, causal=causal, **extra)
    with torch.no_grad():  # larger attention logits, so the in-block mask moves the drafts
        for layer in d.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
    return d


@pytest.mark.parametrize("arch,extra", [("qwen3", {}), ("llama", {}), ("deepseek_v3", {}), ("qwen3", DFLASH2)],
                         ids=["qwen3", "llama", "deepseek_v3", "qwen3-dflash2"])
def test_causal_greedy_speculative_equals_target_greedy(targets, arch, extra):
    target = targets[arch]
    drafter = _drafter(target, causal=True, **extra)
    assert drafter.causal
    params = SamplingParams(max_new_tokens=21)
    for prompt in PROMPTS:
        base = SpecDecoder(target, None, block_size=1).generate(prompt, params)
        for b in (2, 4, 8):
            r = SpecDecoder(target, drafter, block_size=b).generate(prompt, params)
            assert r.token_ids == base.token_ids, (arch, b, prompt)
            assert sum(r.acceptance_lengths) == 20 and all(1 <= a <= b for a in r.acceptance_lengths)


def _first_logits(monkeypatch, target, drafter, block_size: int, prompt: list[int]) -> torch.Tensor:
    """The draft logits [B − 1, V] of the decoder's first step."""
    seen: list[torch.Tensor] = []
    real = SpecDecoder._propose

    def spy(self, h, logits, *args):
        seen.append(logits.detach().clone())
        return real(self, h, logits, *args)

    monkeypatch.setattr(SpecDecoder, "_propose", spy)
    SpecDecoder(target, drafter, block_size=block_size).generate(prompt, SamplingParams(max_new_tokens=12))
    monkeypatch.undo()
    return seen[0]


def test_the_decoders_drafts_are_causal(targets, monkeypatch):
    """The first step's draft logits at B = 4 are the first 3 rows at B = 8 for a causal drafter (offset i never
    sees i + 1 …); for the same weights served bidirectionally they change with the block length."""
    target = targets["qwen3"]
    causal, bidir = _drafter(target, causal=True), _drafter(target, causal=False)
    for prompt in PROMPTS:
        long_c, short_c = (_first_logits(monkeypatch, target, causal, b, prompt) for b in (8, 4))
        assert long_c.shape[0] == 7 and short_c.shape[0] == 3
        torch.testing.assert_close(short_c, long_c[:3], rtol=0, atol=1e-5)
        long_b, short_b = (_first_logits(monkeypatch, target, bidir, b, prompt) for b in (8, 4))
        assert not torch.allclose(short_b, long_b[:3], atol=1e-3), prompt
