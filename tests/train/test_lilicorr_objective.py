"""LiLiCorr objective: the lattice terms and the walk's simulated τ against a slow per-block loop oracle, for any
chunking (a chunk never splits a block); gradients reach the backbone through the candidates' log-probs."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from dflashkit.family import new_drafter, reads_target_law
from dflashkit.config import TrainSection
from dflashkit.family.lilicorr import LiLiCorrWeights
from dflashkit.model.dflash2 import walk
from dflashkit.train.loss import Heads, LossInputs
from dflashkit.train.terms import chunk_bounds
from dflashkit.train.objective import labels_and_weights
from tests.helpers import random_case, tiny_contract, train_loss, with_fields

V, H, B = 50, 32, 4


def _model(seed: int = 0):
    c = with_fields(tiny_contract(block_size=B, vocab=V, hidden=H), drafter_type="lilicorr",
                    lilicorr_candidate_topk=4, lilicorr_num_heads=4, lilicorr_factor_dim=12)
    torch.manual_seed(seed)
    m = new_drafter(c)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():  # a head whose scores differ (random factor heads, biases): real rerankings
        for name, p in m.lilicorr.named_parameters():
            if not name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        m.fc.weight.mul_(10)
    return m


def _oracle(m, lm_head, embed, feats, ids, lm, lens, a, tl, *, label_ids, margin=2.0, on_path_only=False):
    """Per block, by loops: Σ w·CE, Σ w·penalty, Σ w·hinge over the trained slots; the walk's τ and tokens; and
    the slots trained in blocks the on-path mask cut (`on_path_only`: complete before the mask, then trained up
    to their first off-path slot)."""
    from dflashkit.model.masks import dense_block_mask
    from dflashkit.train.objective import block_input_ids, block_position_ids

    b, n = a.anchors.shape
    S, K = B - 1, m.top_k
    labels, w = labels_and_weights(ids, lm, lens, a, block_size=B, gamma=2.0, label_ids=label_ids,
                                   on_path_only=on_path_only)
    labels, w = labels.view(b, n, B), w.view(b, n, B)
    w_all = labels_and_weights(ids, lm, lens, a, block_size=B, gamma=2.0, label_ids=label_ids)[1].view(b, n, B)
    with torch.no_grad():
        noise = embed(block_input_ids(ids, a, mask_token_id=m.mask_token_id, block_size=B))
        mask = dense_block_mask(a.anchors, a.keep, lens, ctx_len=ids.shape[1], block_size=B)
        hid = m(noise, feats, block_position_ids(a, ctx_len=ids.shape[1], block_size=B), attention_mask=mask)
        hid = hid.view(b, n, B, H)
        sums = {"ce": 0.0, "pen": 0.0, "hinge": 0.0}
        tau, blocks, trained, walks, cut = 0.0, 0, 0, {}, 0
        for bi, j in itertools.product(range(b), range(n)):
            if not a.keep[bi, j]:
                continue
            blocks += 1
            anchor = int(a.anchors[bi, j])
            h = hid[bi, j, 1:]                                                  # [S, H]
            cand, logp = m.candidates(lm_head(h))
            valid = torch.tensor([anchor >= 1])
            ah = m.anchor_hidden(feats[bi, max(anchor - 1, 0)])[None] * valid[:, None]
            scores = m.lilicorr(embed(cand)[None], logp[None], h[None], ah, valid)[0]   # [S, K, K]
            tokens, _ = walk(scores[None], cand[None])
            lead, leading = 0, True
            for s in range(S):
                ok = bool(w[bi, j, s + 1] > 0) and int(tokens[0, s]) == int(labels[bi, j, s + 1])
                leading = leading and ok
                lead += int(leading)
                walks[(bi, anchor + s + 1)] = int(tokens[0, s])
            tau += 1 + lead
            if not bool((w_all[bi, j, 1:] > 0).all()):
                continue                                                        # only complete blocks train
            prev = None
            for s in range(S):
                if not bool(w[bi, j, s + 1] > 0):
                    break                                                       # off the target's path (mask)
                gold = int(labels[bi, j, s + 1])
                if gold not in cand[s].tolist():
                    break                                                       # the gold path left the lattice
                gi = cand[s].tolist().index(gold)
                node = scores[0, 0] if s == 0 else scores[s, prev]
                wt = float(w[bi, j, s + 1])
                sums["ce"] += wt * float(F.cross_entropy(node[None], torch.tensor([gi])))
                others = torch.cat([node[:gi], node[gi + 1:]])
                sums["hinge"] += wt * max(0.0, margin - float(node[gi] - others.max()))
                t = tl[bi, anchor + s]                                          # the target's logits predicting it
                q = torch.softmax(node, -1)
                sums["pen"] += wt * float(sum(q[r] * max(0.0, float(t[gold] - t[cand[s, r]])) for r in range(K)))
                trained += 1
                cut += int(not bool((w[bi, j, 1:] > 0).all()))
                prev = gi
    return sums, tau, blocks, float(w.sum()), trained, walks, cut


def _case(seed: int):
    """A random batch whose labels are the walk's own tokens where it can (so blocks are accepted past slot 1
    and the gold path stays in the lattice for a while)."""
    m = _model(seed)
    g = torch.Generator().manual_seed(seed)
    embed = torch.nn.Embedding(V, H)
    lm_head = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        lm_head.weight.mul_(5)
    lm, lens, a = random_case(seed, b=3, s=13, block=B, num_anchors=5)
    ids = torch.randint(0, V - 1, lm.shape, generator=g)
    feats = torch.randn(3, 13, 2 * H, generator=g)
    tl = torch.randn(3, 13, V, generator=g) * 3
    walks = _oracle(m, lm_head, embed, feats, ids, lm, lens, a, tl, label_ids=ids)[5]
    label_ids = ids.clone()
    for (bi, p), tok in sorted(walks.items()):
        if p < int(lens[bi]):
            label_ids[bi, p] = tok
    return m, embed, lm_head, (feats, ids, lm, lens, a, tl, label_ids), g


@pytest.mark.parametrize("seed", [0, 1])
def test_lattice_terms_and_walk_tau_equal_the_loop_oracle_for_any_chunking(seed):
    m, embed, lm_head, (feats, ids, lm, lens, a, tl, label_ids), g = _case(seed)
    sums, tau, blocks, wsum, trained, _, _ = _oracle(m, lm_head, embed, feats, ids, lm, lens, a, tl,
                                                     label_ids=label_ids)
    assert trained >= 4 and sums["ce"] > 0 and sums["pen"] > 0 and sums["hinge"] > 0
    x = LossInputs(feats, ids, lm, lens, label_ids=label_ids, target_logits=tl)
    heads = Heads(embed, lm_head)
    kw = dict(lilicorr_ce_weight=0.3, lilicorr_penalty_weight=0.2, lilicorr_margin_weight=0.1)
    without = train_loss(m.contract, gamma=2.0, lilicorr_ce_weight=0.0, lilicorr_penalty_weight=0.0)(m, heads, x, a)
    want = (0.3 * sums["ce"] + 0.2 * sums["pen"] + 0.1 * sums["hinge"]) / wsum
    for chunk in (1, 2, 64):
        out = train_loss(m.contract, gamma=2.0, loss_chunk_blocks=chunk, **kw)(m, heads, x, a)
        assert abs(float((out.loss - without.loss).detach()) - want) < 1e-4 * max(1.0, want), chunk
        assert out.blocks == blocks and abs(out.tau_sum - tau) < 1e-6, (chunk, out.tau_sum, tau)
        assert out.extra["lattice_trained"] == trained
        assert abs(out.extra["lattice_ce"] - sums["ce"]) < 1e-3 * max(1.0, sums["ce"])
        assert abs(out.extra["lattice_penalty"] - sums["pen"]) < 1e-3 * max(1.0, sums["pen"])
    assert tau > blocks + 2 and out.extra["unary_tau_sum"] >= blocks
    # the target's logits from its last hidden state + head give the same penalty
    hid_t = torch.randn(3, 13, H, generator=g)
    t_head = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        x2 = LossInputs(feats, ids, lm, lens, label_ids=label_ids, target_logits=t_head(hid_t))
    x3 = LossInputs(feats, ids, lm, lens, label_ids=label_ids, target_hidden=hid_t)
    o2 = train_loss(m.contract, gamma=2.0, **kw)(m, heads, x2, a)
    o3 = train_loss(m.contract, gamma=2.0, **kw)(m, Heads(embed, lm_head, None, t_head), x3, a)
    assert abs(o2.extra["lattice_penalty"] - o3.extra["lattice_penalty"]) < 1e-5 and o2.extra["lattice_penalty"] > 0


def test_under_the_on_path_mask_a_whole_block_trains_its_on_path_prefix():
    """train.on_path=mask drops the slots past a block's first raw-vs-argmax disagreement; the block stays whole
    (ModelOpt's complete blocks count supervision, not the mask), and its gold path trains up to that slot."""
    m, embed, lm_head, (feats, ids, lm, lens, a, tl, label_ids), _ = _case(1)
    sums, tau, blocks, wsum, trained, _, cut = _oracle(m, lm_head, embed, feats, ids, lm, lens, a, tl,
                                                       label_ids=label_ids, on_path_only=True)
    assert cut >= 1 and sums["ce"] > 0, (cut, trained)  # the case has blocks the mask cut and that still train
    x = LossInputs(feats, ids, lm, lens, label_ids=label_ids, target_logits=tl, on_path_only=True)
    heads = Heads(embed, lm_head)
    kw = dict(lilicorr_ce_weight=0.3, lilicorr_penalty_weight=0.2, lilicorr_margin_weight=0.1)
    without = train_loss(m.contract, gamma=2.0, lilicorr_ce_weight=0.0, lilicorr_penalty_weight=0.0)(m, heads, x, a)
    want = (0.3 * sums["ce"] + 0.2 * sums["pen"] + 0.1 * sums["hinge"]) / wsum
    for chunk in (1, 64):
        out = train_loss(m.contract, gamma=2.0, loss_chunk_blocks=chunk, **kw)(m, heads, x, a)
        assert out.extra["lattice_trained"] == trained, chunk
        assert abs(float((out.loss - without.loss).detach()) - want) < 1e-4 * max(1.0, want), chunk


def test_the_lattice_gradient_reaches_the_backbone_through_the_candidates_log_probs():
    m, embed, lm_head, (feats, ids, lm, lens, a, tl, label_ids), _ = _case(0)
    with torch.no_grad():  # the slot hidden states reach the head only through the candidates' log-probs now
        m.lilicorr.pass_hidden_proj.weight.zero_()
    x = LossInputs(feats, ids, lm, lens, label_ids=label_ids, target_logits=tl)
    out = train_loss(m.contract, gamma=2.0, lilicorr_ce_weight=1.0, lilicorr_penalty_weight=1.0)(
        m, Heads(embed, lm_head), x, a)
    base = train_loss(m.contract, gamma=2.0, lilicorr_ce_weight=0.0, lilicorr_penalty_weight=0.0)(
        m, Heads(embed, lm_head), x, a)
    assert out.extra["lattice_trained"] > 0
    (out.loss - base.loss).backward()
    assert m.layers[0].mlp.up_proj.weight.grad.abs().sum() > 0      # via the log-probs (pass_hidden_proj is 0)
    assert m.lilicorr.out_head.weight.grad.abs().sum() > 0 and m.fc.weight.grad.abs().sum() > 0   # fc: the anchor
    assert embed.weight.grad is None                                 # the candidates' embeddings are inputs only


def test_chunks_never_split_a_block():
    g = torch.Generator().manual_seed(0)
    for trial in range(50):
        bsz, n = 2, 7
        w = torch.rand(bsz * n * B, generator=g) < 0.6
        w.view(-1, B)[:, 0] = False
        rows = w.nonzero().flatten()
        step = B * int(torch.randint(1, 4, (1,), generator=g))
        bounds = chunk_bounds(rows, step, B)
        assert [c0 for c0, _ in bounds] == [0] + [c1 for _, c1 in bounds[:-1]] and (not bounds or bounds[-1][1] == rows.numel())
        for c0, c1 in bounds:
            assert 0 < c1 - c0 <= step
            if c1 < rows.numel():
                assert int(rows[c1 - 1]) // B != int(rows[c1]) // B, (trial, c0, c1)


def test_the_penalty_makes_the_trainer_read_the_target():
    c = _model().contract
    assert reads_target_law(TrainSection(), c.family)                     # lilicorr_penalty_weight 0.25
    assert not reads_target_law(TrainSection(weights=LiLiCorrWeights(lilicorr_penalty_weight=0.0)), c.family)
    assert not reads_target_law(TrainSection(), tiny_contract().family) and reads_target_law(
        TrainSection(loss="kl"), tiny_contract().family)
