"""LiLiCorr decoding: the lattice walk drafts, greedy fp32 output equals the target's, τ bounds; the walk ≠ the
argmax; the lattice's anchor row is the target features of the token before the anchor."""

from __future__ import annotations

import pytest
import torch

from dflashkit.config import TargetSection
from dflashkit.decode.api import SamplingParams
from dflashkit.decode.spec_decode import SpecDecoder
from dflashkit.model.lilicorr import LiLiCorrDraftModel
from dflashkit.target.load import load_target
from dflashkit.testing import random_drafter

PROMPT = [1, 60, 61, 62, 63, 64, 10, 65, 66, 67, 68, 2, 10]


@pytest.fixture(scope="module")
def targets(tiny_targets):
    return {arch: load_target(TargetSection(path=str(d), device="cpu", dtype="float32"))
            for arch in ("qwen3", "llama") for d in [tiny_targets[arch]]}


def _lilicorr(target, block_size=8, **knobs):
    d = random_drafter(target, block_size=block_size, drafter_type="lilicorr", lilicorr_candidate_topk=8,
                       lilicorr_num_heads=4, lilicorr_factor_dim=16, **knobs)
    assert isinstance(d, LiLiCorrDraftModel)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a head that reranks
        for name, p in d.lilicorr.named_parameters():
            if not name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return d.eval()


@pytest.mark.parametrize("arch,conv", [("qwen3", False), ("llama", True)])
def test_lilicorr_greedy_speculative_equals_target_greedy(targets, arch, conv, monkeypatch):
    target = targets[arch]
    drafter = _lilicorr(target, **({"lilicorr_conv_kernel_size": 2, "lilicorr_conv_group_size": 16} if conv else {}))
    params = SamplingParams(max_new_tokens=23)
    base = SpecDecoder(target, None, block_size=1).generate(PROMPT, params).token_ids
    walked, argmax, anchors = [], [], []
    real = SpecDecoder._propose

    def spy(self, h, logits, anchor, p, gen, block=None):
        out = real(self, h, logits, anchor, p, gen, block)
        walked.append(out[0])
        argmax.append(logits.argmax(-1).tolist())
        anchors.append(block.context)
        return out

    monkeypatch.setattr(SpecDecoder, "_propose", spy)
    for b in (2, 4, 8):
        r = SpecDecoder(target, drafter, block_size=b).generate(PROMPT, params)
        assert r.token_ids == base, f"B={b}"
        assert sum(r.acceptance_lengths) == 22 and all(1 <= a <= b for a in r.acceptance_lengths)
    assert walked and any(w != u for w, u in zip(walked, argmax))  # the lattice changed some drafts
    assert all(c is not None and c.shape == (1, drafter.contract.num_features * target.hidden_size) for c in anchors)


def test_the_anchor_row_is_the_token_before_the_anchor(targets, monkeypatch):
    """The lattice reads the target features of the last committed token (vLLM's `prepare_context_anchor`): the
    features of position start − 1 of the committed sequence, whatever was accepted in the step before."""
    target = targets["qwen3"]
    drafter = _lilicorr(target, block_size=4)
    committed, rows = [], []
    real_draft, real_propose = SpecDecoder._draft, SpecDecoder._propose

    def track(self, seq, start, *a):
        committed.append(list(seq[:start]))                 # the tokens before the anchor seq[start]
        return real_draft(self, seq, start, *a)

    def spy(self, h, logits, anchor, p, gen, block=None):
        rows.append(block.context.clone())
        return real_propose(self, h, logits, anchor, p, gen, block)

    monkeypatch.setattr(SpecDecoder, "_draft", track)
    monkeypatch.setattr(SpecDecoder, "_propose", spy)
    SpecDecoder(target, drafter, block_size=4).generate(PROMPT, SamplingParams(max_new_tokens=12))
    assert len(rows) == len(committed) >= 3
    for before, row in zip(committed, rows):
        with torch.no_grad():
            feats = target.features(torch.tensor([before]), layer_ids=list(drafter.target_layer_ids))
        torch.testing.assert_close(row[0], feats[0, -1], atol=1e-4, rtol=1e-4)
