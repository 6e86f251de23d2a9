"""DFlash2 objective: the selector loss and the walk's simulated τ against slow loop oracles; gold insertion."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from dflashkit.family import new_drafter
from dflashkit.family.dflash2 import selector_rows
from dflashkit.model.dflash2 import DFlash2DraftModel
from dflashkit.train.loss import Heads, LossInputs
from dflashkit.train.objective import labels_and_weights
from tests.helpers import random_case, tiny_contract, train_loss, with_fields

V, H = 50, 32


def _model(seed: int = 0, top_k: int = 4) -> DFlash2DraftModel:
    c = with_fields(tiny_contract(block_size=4, vocab=V, hidden=H), drafter_type="dflash2", conv_group_size=8,
                    selector_rank=6, selector_top_k=top_k)
    torch.manual_seed(seed)
    m = new_drafter(c)
    with torch.no_grad():
        m.candidate_selector.predecessor_codebook.normal_()
        m.candidate_selector.successor_codebook.normal_()
        m.fc.weight.mul_(10)
    return m


def test_gold_insertion_replaces_the_last_candidate_only_when_missing():
    m = _model()
    unary = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0] + [-9.0] * (V - 6)] * 2)
    h = torch.randn(2, H)
    labels = torch.tensor([1, 5])            # row 0: inside the top-4; row 1: rank 6, missing
    prev = torch.tensor([7, 8])
    ce, ids, uvals, covered, correct = selector_rows(m, unary, h, labels, prev)
    assert ids.tolist() == [[0, 1, 2, 3]] * 2 and covered.tolist() == [True, False]
    assert not correct[1]                    # a missing gold token is never a correct strict pick
    sel = m.candidate_selector
    with torch.no_grad():
        for row, cand, gold in ((0, [0, 1, 2, 3], 1), (1, [0, 1, 2, 5], 3)):
            s = sel.pair_scores(prev[row:row + 1, None], torch.tensor([cand]), unary[row:row + 1, cand],
                                h[row:row + 1])[0, 0]
            assert torch.isclose(ce[row], F.cross_entropy(s[None], torch.tensor([gold])))[()]
            if row == 0:
                assert bool(correct[0]) == (int(s.argmax()) == gold)
    assert torch.equal(uvals, unary.gather(-1, ids))


def _oracle(m, lm_head, embed, feats, ids, lm, lens, a, gamma, label_ids=None):
    """Slow loops over blocks: selector loss Σ w·CE(scores after the gold predecessor, gold inserted), and the
    greedy walk per block scored like simulated τ (1 + leading correct supervised positions)."""
    from dflashkit.model.masks import dense_block_mask
    from dflashkit.train.objective import block_input_ids, block_position_ids

    B = m.block_size
    b, n = a.anchors.shape
    src = ids if label_ids is None else label_ids
    labels, w = labels_and_weights(ids, lm, lens, a, block_size=B, gamma=gamma, label_ids=label_ids)
    labels, w = labels.view(b, n, B), w.view(b, n, B)
    with torch.no_grad():
        noise = embed(block_input_ids(ids, a, mask_token_id=m.mask_token_id, block_size=B))
        mask = dense_block_mask(a.anchors, a.keep, lens, ctx_len=ids.shape[1], block_size=B)
        hid = m(noise, feats, block_position_ids(a, ctx_len=ids.shape[1], block_size=B), attention_mask=mask)
        hid = hid.view(b, n, B, H)
        sel = m.candidate_selector
        loss, tau, blocks, walks = 0.0, 0.0, 0, {}
        for bi, j in itertools.product(range(b), range(n)):
            if not a.keep[bi, j]:
                continue
            blocks += 1
            anchor = int(a.anchors[bi, j])
            prev_walk, lead, leading = int(ids[bi, anchor]), 0, True
            for k in range(1, B):
                u = m.unary(lm_head(hid[bi, j, k]))
                top = torch.topk(u, m.top_k).indices.tolist()
                if w[bi, j, k] > 0:
                    gold = int(labels[bi, j, k])
                    prev_gold = int(ids[bi, anchor]) if k == 1 else int(src[bi, anchor + k - 1])
                    cand = top if gold in top else top[:-1] + [gold]
                    s = sel.pair_scores(torch.tensor([[prev_gold]]), torch.tensor([cand]), u[cand][None],
                                        hid[bi, j, k][None])[0, 0]
                    loss += float(w[bi, j, k]) * float(F.cross_entropy(s[None], torch.tensor([cand.index(gold)])))
                s = sel.pair_scores(torch.tensor([[prev_walk]]), torch.tensor([top]), u[top][None],
                                    hid[bi, j, k][None])[0, 0]
                prev_walk = top[int(s.argmax())]
                walks[(bi, anchor + k)] = prev_walk
                ok = w[bi, j, k] > 0 and prev_walk == int(labels[bi, j, k])
                leading = leading and ok
                lead += int(leading)
            tau += 1 + lead
    return loss, tau, blocks, float(w.sum()), walks


@pytest.mark.parametrize("seed", [0, 1])
def test_selector_loss_and_walk_tau_equal_the_loop_oracle(seed):
    m = _model(seed)
    g = torch.Generator().manual_seed(seed)
    embed = torch.nn.Embedding(V, H)
    lm_head = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        lm_head.weight.mul_(5)
    lm, lens, a = random_case(seed, b=3, s=13, block=4, num_anchors=5)
    ids = torch.randint(0, V - 1, lm.shape, generator=g)
    feats = torch.randn(3, 13, 2 * H, generator=g)
    # labels = the walk's own tokens where blocks agree on them, so some blocks are accepted past slot 1
    walks = _oracle(m, lm_head, embed, feats, ids, lm, lens, a, 2.0)[-1]
    label_ids = ids.clone()
    for (bi, p), tok in sorted(walks.items()):
        if p < int(lens[bi]):
            label_ids[bi, p] = tok
    x = LossInputs(feats, ids, lm, lens, label_ids=label_ids)
    with_sel = train_loss(m.contract, gamma=2.0, selector_loss_weight=1.0)(m, Heads(embed, lm_head), x, a)
    without = train_loss(m.contract, gamma=2.0, selector_loss_weight=0.0)(m, Heads(embed, lm_head), x, a)
    sel_loss, tau, blocks, wsum, _ = _oracle(m, lm_head, embed, feats, ids, lm, lens, a, 2.0, label_ids)
    assert blocks == with_sel.blocks and sel_loss > 0
    assert abs(float((with_sel.loss - without.loss).detach()) - sel_loss / wsum) < 1e-4
    assert abs(with_sel.tau_sum - tau) < 1e-6 and tau > blocks + 2, (tau, blocks)
    assert with_sel.extra["unary_tau_sum"] >= blocks and with_sel.extra["selector_rows"] > 0
    assert abs(with_sel.extra["selector_loss"] - sel_loss) < 1e-3 * max(1.0, sel_loss)
    # the selector gets gradients from its loss, the backbone from both
    with_sel.loss.backward()
    assert m.candidate_selector.successor_codebook.grad.abs().sum() > 0
    assert m.layers[0].attention_conv.kernel_projection.weight.grad.abs().sum() > 0
