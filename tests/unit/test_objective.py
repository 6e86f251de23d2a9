"""Objective: anchors/labels/weights == loop oracles, chunked == unchunked, no NaN, KL target index."""

from __future__ import annotations

import math

import pytest
import torch

from dflashkit.model.drafter import DFlashDraftModel
from dflashkit.train.objective import (Anchors, block_input_ids, block_position_ids, dflash_loss,
                                       labels_and_weights, sample_anchors)
from tests.unit.test_masks import random_case, tiny_contract


@pytest.mark.parametrize("seed", range(8))
def test_anchor_sampling_matches_oracle(seed):
    lm, lens, a = random_case(seed, b=4, s=20, num_anchors=4)
    for i in range(4):
        n = int(lens[i])
        cand = [p for p in range(n - 1) if lm[i, p] and lm[i, p + 1]]
        got = a.anchors[i][a.keep[i]].tolist()
        assert got == sorted(set(got)) and set(got) <= set(cand)
        assert len(got) == min(4, len(cand))
        assert not a.anchors[i][~a.keep[i]].any()
    # per-sample seeding: the same sample in another batch draws the same anchors
    lm2, lens2 = lm[1:2], lens[1:2]
    a2 = sample_anchors(lm2, lens2, num_anchors=4, block_size=4, seeds=[seed * 10 + 1])
    assert a2.anchors[0][a2.keep[0]].tolist() == a.anchors[1][a.keep[1]].tolist()


@pytest.mark.parametrize("seed", range(5))
def test_labels_weights_positions_match_oracle(seed):
    lm, lens, a = random_case(seed, b=3, s=15, num_anchors=6)
    B, gamma = 4, 2.5
    ids = torch.randint(0, 40, lm.shape, generator=torch.Generator().manual_seed(seed))
    labels, w = labels_and_weights(ids, lm, lens, a, block_size=B, gamma=gamma)
    pos = block_position_ids(a, ctx_len=15, block_size=B)
    bids = block_input_ids(ids, a, mask_token_id=99, block_size=B)
    for i in range(3):
        assert pos[i, :15].tolist() == list(range(15))
        for j in range(a.anchors.shape[1]):
            anc, keep = int(a.anchors[i, j]), bool(a.keep[i, j])
            assert bids[i, j * B].item() == (ids[i, anc].item() if keep else 99)
            assert bids[i, j * B + 1:(j + 1) * B].eq(99).all()
            for k in range(B):
                q = j * B + k
                assert pos[i, 15 + q].item() == anc + k
                p = anc + k
                want = (keep and p < lens[i] and k > 0 and bool(lm[i, p])) * math.exp(-(k - 1) / gamma)
                assert abs(w[i, q].item() - want) < 1e-6
                if want:  # same-position label: the token AT anchor + k, never anchor + k + 1
                    assert labels[i, q].item() == ids[i, p].item()


def _setup(seed=0, B=4, vocab=50):
    torch.manual_seed(seed)
    c = tiny_contract(block_size=B, vocab=vocab)
    model = DFlashDraftModel(c)
    emb = torch.nn.Embedding(vocab, c.hidden_size).requires_grad_(False)
    head = torch.nn.Linear(c.hidden_size, vocab, bias=False).requires_grad_(False)
    lm, lens, a = random_case(seed, b=3, s=16, num_anchors=5)
    ids = torch.randint(0, vocab - 1, lm.shape)
    feats = torch.randn(*lm.shape, 2 * c.hidden_size)
    return c, model, emb, head, lm, lens, a, ids, feats


@pytest.mark.parametrize("kind", ["ce", "ce+kl"])
def test_chunked_loss_and_grads_equal_unchunked(kind):
    c, model, emb, head, lm, lens, a, ids, feats = _setup()
    tl = torch.randn(*ids.shape, c.vocab_size)
    outs, grads = [], []
    for chunk in (1000, 2):
        model.zero_grad()
        out = dflash_loss(model, emb, head, feats, ids, lm, lens, a, mask_token_id=c.mask_token_id, gamma=2.0,
                          loss=kind, target_logits=tl, chunk_blocks=chunk)
        out.loss.backward()
        outs.append(out)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert torch.allclose(outs[0].loss, outs[1].loss, atol=1e-6)
    assert torch.equal(outs[0].correct, outs[1].correct) and outs[0].tau_sum == outs[1].tau_sum
    for n in grads[0]:
        assert torch.allclose(grads[0][n], grads[1][n], atol=1e-6), n


def test_no_nan_with_anchor_zero_and_padded_blocks():
    c, model, emb, head, lm, lens, _, ids, feats = _setup()
    a = Anchors(torch.tensor([[0, 2, 0], [0, 0, 0], [1, 0, 0]]),
                torch.tensor([[True, True, False], [True, False, False], [True, False, False]]))
    lm = torch.ones_like(lm)
    out = dflash_loss(model, emb, head, feats, ids, lm, torch.full((3,), 16), a, mask_token_id=c.mask_token_id,
                      gamma=2.0)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_kl_target_is_next_token_distribution_at_anchor_plus_k_minus_1():
    """If the target logits put all mass on the TRUE token at a+k (i.e. logits row a+k-1 predicts
    x[a+k]), KL == CE up to the target entropy (0) -> the two losses coincide."""
    c, model, emb, head, lm, lens, a, ids, feats = _setup()
    tl = torch.full((*ids.shape, c.vocab_size), -1e4)
    nxt = torch.roll(ids, -1, dims=1)  # row t predicts x[t+1]
    tl.scatter_(2, nxt[..., None], 1e4)
    kw = dict(mask_token_id=c.mask_token_id, gamma=2.0, target_logits=tl)
    ce = dflash_loss(model, emb, head, feats, ids, lm, lens, a, loss="ce", **kw).loss
    kl = dflash_loss(model, emb, head, feats, ids, lm, lens, a, loss="kl", **kw).loss
    assert torch.allclose(ce, kl, rtol=1e-4), (ce, kl)
