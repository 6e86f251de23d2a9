"""The loss's term protocol (family/base.py `LossTerm`) as a new head uses it, and the blocks built once per call.

A term added to `DraftLoss.terms` sees every supervised row exactly once, in block-aligned chunks, its total
is summed into the loss and its statistics reach `LossOutput.extra`; `build_blocks`' rows, labels and target
rows equal direct computations; a KL loss without the target's logits is refused before the drafter runs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from dflashkit.family.base import Rows, Scored
from dflashkit.model.drafter import DFlashDraftModel
from dflashkit.train.blocks import build_blocks
from dflashkit.train.loss import CE, Heads, LossInputs
from dflashkit.train.objective import labels_and_weights
from tests.helpers import random_case, tiny_contract, train_loss

B, V = 4, 50


@dataclass(frozen=True)
class ScaledCE:
    """A new head's term: its own CE over the rows, times `weight`; it records the rows it saw."""

    weight: float = 2.0
    name: str = "scaled_ce"
    needs_prev: bool = False
    needs_target: bool = False

    def chunk(self, rows: Rows):
        assert rows.blocks is not None and rows.index is not None and rows.scores.shape == (rows.index.numel(), V)
        return F.cross_entropy(rows.scores, rows.labels, reduction="none"), rows.index

    def total(self, parts: list, row_w: torch.Tensor):
        ce = torch.cat([p[0] for p in parts]) if parts else row_w.new_zeros(0)
        seen = torch.cat([p[1] for p in parts]) if parts else torch.zeros(0, dtype=torch.long)
        return self.weight * (row_w * ce).sum(), {"seen": seen, "chunks": [p[1] for p in parts]}

    def rescore(self, s: Scored):
        return None, {"rescored_rows": int(s.rows.numel())}


def _case(seed: int = 0):
    torch.manual_seed(seed)
    c = tiny_contract(block_size=B, vocab=V)
    model = DFlashDraftModel(c)
    emb = torch.nn.Embedding(V, c.hidden_size).requires_grad_(False)
    head = torch.nn.Linear(c.hidden_size, V, bias=False).requires_grad_(False)
    lm, lens, a = random_case(seed, b=3, s=16, num_anchors=5)
    ids = torch.randint(0, V - 1, lm.shape)
    feats = torch.randn(*lm.shape, 2 * c.hidden_size)
    return c, model, Heads(emb, head), LossInputs(feats, ids, lm, lens), a


@pytest.mark.parametrize("chunk", [1, 2, 64])
def test_a_family_term_sees_every_row_once_and_adds_its_total_and_stats(chunk):
    c, model, heads, x, a = _case()
    base = train_loss(c, gamma=2.0, loss_chunk_blocks=chunk)
    plain = base(model, heads, x, a)
    plain.loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    out = dataclasses.replace(base, terms=(CE(), ScaledCE(2.0)))(model, heads, x, a)
    out.loss.backward()
    assert math.isclose(float(out.loss.detach()), 3 * float(plain.loss.detach()), rel_tol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 3 * want[n], rtol=1e-5, atol=1e-7)
    _, w = labels_and_weights(x.input_ids, x.loss_mask, x.seq_lens, a, block_size=B, gamma=2.0)
    rows = (w.flatten() > 0).nonzero().flatten()
    assert out.extra["seen"].tolist() == rows.tolist() and out.extra["rescored_rows"] == rows.numel()
    chunks = out.extra["chunks"]
    assert (len(chunks) == 1) == (chunk == 64)   # one chunk is not checkpointed, several are
    for r0, r1 in zip(chunks, chunks[1:]):  # a chunk never splits a block
        assert int(r0[-1]) // B < int(r1[0]) // B
    assert torch.equal(out.correct, plain.correct) and out.tau_sum == plain.tau_sum


def test_build_blocks_rows_labels_and_target_rows_equal_direct_computations():
    c, model, heads, x, a = _case(1)
    tl = torch.randn(*x.input_ids.shape, V)
    x = dataclasses.replace(x, target_logits=tl)
    blk = build_blocks(x, a, heads, model=model, mask_token_id=c.mask_token_id, gamma=2.0, prev=True, target=True)
    labels, w = labels_and_weights(x.input_ids, x.loss_mask, x.seq_lens, a, block_size=B, gamma=2.0)
    rows = (w.flatten() > 0).nonzero().flatten()
    assert torch.equal(blk.rows, rows) and torch.equal(blk.weights, w.flatten())
    assert torch.equal(blk.labels.flatten(), labels.flatten()) and blk.weight_sum == float(w.sum())
    assert blk.prev is not None and blk.prev.numel() == w.numel()
    got = blk.target_rows(rows, x, heads)
    n = a.anchors.shape[1]
    for i, r in enumerate(rows.tolist()):  # row (b, j, k) reads the target's logits at anchor + k − 1
        b, j, k = r // (n * B), r // B % n, r % B
        assert torch.equal(got[i], tl[b, int(a.anchors[b, j]) + k - 1])


def test_kl_without_the_targets_logits_is_refused_before_the_drafter_runs():
    c, _, heads, x, a = _case()

    class Refuses(torch.nn.Module):
        block_size = B

        def forward(self, *args, **kwargs):
            raise AssertionError("the drafter ran")

    with pytest.raises(ValueError, match="needs target_logits"):
        train_loss(c, gamma=2.0, loss="kl")(Refuses(), heads, x, a)


@pytest.mark.parametrize("chunk", [2, 64])
def test_the_terms_order_does_not_change_a_bit_of_the_loss_or_its_gradients(chunk):
    """However the terms are listed, the loss runs them in its one canonical order: the same loss and gradients
    bit for bit; two terms of one name are refused."""
    import itertools

    from dflashkit.train.loss import KL, canonical

    c, model, heads, x, a = _case(2)
    x = dataclasses.replace(x, target_logits=torch.randn(*x.input_ids.shape, V))
    base = train_loss(c, gamma=2.0, loss_chunk_blocks=chunk)
    terms = (CE(), KL(0.5, 2.0), ScaledCE(0.7), ScaledCE(1.3, name="aux"))
    got = []
    for order in itertools.permutations(terms):
        model.zero_grad()
        out = dataclasses.replace(base, terms=order)(model, heads, x, a)
        out.loss.backward()
        got.append((out.loss.detach(), [p.grad.clone() for p in model.parameters()]))
    for loss, grads in got[1:]:
        assert torch.equal(loss, got[0][0])
        assert all(torch.equal(g, w) for g, w in zip(grads, got[0][1]))
    assert [t.name for t in canonical(terms[::-1])] == ["ce", "kl", "aux", "scaled_ce"]
    with pytest.raises(ValueError, match="its own name"):
        dataclasses.replace(base, terms=(CE(), ScaledCE(), ScaledCE(3.0)))


def test_the_recipes_build_their_terms_in_the_canonical_order():
    """Canonical = the order every built-in family's recipe lists its terms in (CE, KL, the family's), so the
    loss sums what it summed before the order was fixed (the demo's curve)."""
    from dflashkit.config import TrainSection
    from dflashkit.family import BUILTIN
    from dflashkit.train.loss import KL, canonical

    for fam in BUILTIN:
        listed = (CE(), KL(0.5, 1.0), *fam.terms(TrainSection().weights))
        assert canonical(listed) == listed, fam.name
