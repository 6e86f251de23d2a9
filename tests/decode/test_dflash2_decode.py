"""DFlash2 decoding: the walk drafts, greedy fp32 output equals the target's, τ bounds; the walk ≠ the argmax."""

from __future__ import annotations

import pytest
import torch

from dflashkit.config import TargetSection
from dflashkit.decode.api import SamplingParams
from dflashkit.decode.spec_decode import SpecDecoder
from dflashkit.model.dflash2 import DFlash2DraftModel
from dflashkit.target.load import load_target
from dflashkit.testing import random_drafter
from tests.helpers import record_proposals

PROMPT = [1, 60, 61, 62, 63, 64, 10, 65, 66, 67, 68, 2, 10]


@pytest.fixture(scope="module")
def targets(tiny_targets):
    return {arch: load_target(TargetSection(path=str(d), device="cpu", dtype="float32"))
            for arch in ("qwen3", "llama") for d in [tiny_targets[arch]]}


def _dflash2(target, block_size=8):
    d2 = random_drafter(target, block_size=block_size, drafter_type="dflash2", conv_group_size=16, selector_rank=8,
                        selector_top_k=6)
    assert isinstance(d2, DFlash2DraftModel)
    with torch.no_grad():  # a selector that reranks, and convolutions that are not the identity
        sel = d2.candidate_selector
        sel.predecessor_codebook.normal_(std=2.0)
        sel.successor_codebook.normal_(std=2.0)
        sel.hidden_projection.weight.normal_(std=0.5)
        for layer in d2.layers:
            layer.attention_conv.kernel_projection.weight.normal_(std=0.05)
            layer.mlp_conv.base_kernel.normal_(std=0.5)
    return d2


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_dflash2_greedy_speculative_equals_target_greedy(targets, arch, monkeypatch):
    target = targets[arch]
    drafter = _dflash2(target)
    params = SamplingParams(max_new_tokens=23)
    base = SpecDecoder(target, None, block_size=1).generate(PROMPT, params).token_ids
    calls = record_proposals(monkeypatch)
    for b in (2, 4, 8):
        r = SpecDecoder(target, drafter, block_size=b).generate(PROMPT, params)
        assert r.token_ids == base, f"B={b}"
        assert sum(r.acceptance_lengths) == 22 and all(1 <= a <= b for a in r.acceptance_lengths)
    assert calls and any(tokens != logits.argmax(-1).tolist() for _, logits, _, tokens in calls)  # the selector changed some drafts


def test_a_drafter_that_drafts_the_target_gets_full_blocks(targets, monkeypatch):
    """The walk's tokens are what gets verified: a walk that picks the target's own tokens is accepted whole."""
    target = targets["qwen3"]
    params = SamplingParams(max_new_tokens=17)
    base = SpecDecoder(target, None, block_size=1).generate(PROMPT, params).token_ids
    seq = list(PROMPT) + base

    def oracle_walk(self, h, logits, anchor, p, gen, block=None):
        n = len(PROMPT) + len(self._seen)
        return seq[n:n + h.shape[1]], None

    drafter = _dflash2(target, block_size=4)
    dec = SpecDecoder(target, drafter, block_size=4)
    real = SpecDecoder._draft

    def track(self, s, start, *a):
        self._seen = s[len(PROMPT):start + 1]
        return real(self, s, start, *a)

    monkeypatch.setattr(SpecDecoder, "_propose", oracle_walk)
    monkeypatch.setattr(SpecDecoder, "_draft", track)
    r = dec.generate(PROMPT, params)
    assert r.token_ids == base and r.acceptance_lengths == [4, 4, 4, 4]
