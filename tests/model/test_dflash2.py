"""DFlash2 model: the grouped convolution, the edge scores and the walk against slow loop oracles;
identity init ≡ DFlash; blocks never see each other; vLLM's tensor names."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from dflashkit.errors import UsageError
from dflashkit.family import new_drafter
from dflashkit.model.dflash2 import DFlash2DraftModel, grouped_conv, init_from_dflash, walk, walk_path
from dflashkit.model.drafter import DFlashDraftModel
from dflashkit.model.masks import dense_block_mask
from dflashkit.train.objective import Anchors
from tests.helpers import tiny_contract, with_fields


def dflash2_contract(**over):
    return with_fields(tiny_contract(block_size=4, vocab=50, hidden=32),
                       **{"drafter_type": "dflash2", "conv_group_size": 8, "selector_rank": 6, "selector_top_k": 5,
                          **over})


def loop_conv(x, delta, base, block_len):
    """y[b,t,c] = Σ_{j ≤ pos(t)} (base[j,c] + delta[b,t,j,c // gs]) · x[b,t−j,c], as plain loops."""
    b, t, h = x.shape
    taps, groups = base.shape[0], delta.shape[-1]
    gs = h // groups
    out = torch.zeros(b, t, h, dtype=torch.float64)
    for bi, ti, c in itertools.product(range(b), range(t), range(h)):
        for j in range(taps):
            if ti % block_len >= j:
                out[bi, ti, c] += (base[j, c] + delta[bi, ti, j, c // gs]) * x[bi, ti - j, c]
    return out


@pytest.mark.parametrize("taps,block_len,blocks", [(2, 4, 3), (3, 5, 2), (1, 4, 2), (4, 3, 2)])
def test_grouped_conv_equals_the_loop_oracle(taps, block_len, blocks):
    g = torch.Generator().manual_seed(taps * 10 + block_len)
    x = torch.randn(2, blocks * block_len, 12, generator=g, dtype=torch.float64)
    delta = torch.randn(2, blocks * block_len, taps, 3, generator=g, dtype=torch.float64)
    base = torch.randn(taps, 12, generator=g, dtype=torch.float64)
    got = grouped_conv(x, delta, base, block_len)
    assert torch.allclose(got, loop_conv(x, delta, base, block_len), atol=1e-12)


def loop_scores(P, S, W, cand, unary, hidden, anchor):
    """scores[b,t,p,c] = unary[b,t,c] + Σ_r P[prev_p, r]·(W h[b,t])_r·S[cand[b,t,c], r]; prev of t=0: the anchor."""
    b, n, k = cand.shape
    out = torch.zeros(b, n, k, k, dtype=torch.float64)
    for bi, t, p, c in itertools.product(range(b), range(n), range(k), range(k)):
        prev = int(anchor[bi]) if t == 0 else int(cand[bi, t - 1, p])
        wh = W.double() @ hidden[bi, t].double()
        out[bi, t, p, c] = float(unary[bi, t, c]) + sum(
            float(P[prev, r]) * float(wh[r]) * float(S[int(cand[bi, t, c]), r]) for r in range(P.shape[1]))
    return out


def loop_walk(scores, cand):
    """Greedy from the anchor: position t takes the best candidate after the one chosen at t−1 (first max wins)."""
    b, n, k = cand.shape
    out = []
    for bi in range(b):
        prev, path = 0, []
        for t in range(n):
            row = [float(scores[bi, t, prev, c]) for c in range(k)]
            prev = row.index(max(row))
            path.append(int(cand[bi, t, prev]))
        out.append(path)
    return out


def test_edge_scores_and_walk_equal_the_loop_oracles():
    torch.manual_seed(0)
    model = DFlash2DraftModel(dflash2_contract()).double()
    sel = model.candidate_selector
    b, n, k = 3, 3, 5
    hidden = torch.randn(b, n, 32, dtype=torch.float64)
    cand = torch.stack([torch.randperm(50)[:k] for _ in range(b * n)]).view(b, n, k)
    unary = torch.randn(b, n, k, dtype=torch.float64)
    anchor = torch.tensor([7, 8, 9])
    with torch.no_grad():
        sel.predecessor_codebook.normal_()  # make the pair term matter against the unary one
        sel.successor_codebook.normal_()
        scores = sel(cand, unary, hidden, anchor)
    ref = loop_scores(sel.predecessor_codebook.detach(), sel.successor_codebook.detach(),
                      sel.hidden_projection.weight.detach(), cand, unary,
                      hidden, anchor)
    assert torch.allclose(scores.double(), ref, atol=1e-9)
    tokens, rows = walk(scores, cand)
    assert tokens.tolist() == loop_walk(scores, cand)
    unary_path = cand[:, :, 0].tolist()
    assert tokens.tolist() != unary_path  # the pair term changed the path: the oracle compares real walks
    # the realized rows are the rows the walk read
    for bi in range(b):
        prev = 0
        for t in range(n):
            assert torch.equal(rows[bi, t], scores[bi, t, prev])
            prev = int((cand[bi, t] == tokens[bi, t]).nonzero())


def test_walk_ties_take_the_lower_index_and_gumbel_walk_samples_softmax():
    cand = torch.tensor([[[4, 5, 6], [7, 8, 9]]])
    flat = torch.zeros(1, 2, 3, 3)
    assert walk(flat, cand)[0].tolist() == [[4, 7]]
    # T > 0: the path law is Π_t softmax(row_t / T) along the path (rows depend on the previous pick)
    scores = torch.tensor([[[[1.0, 0.0, -1.0]] * 3,
                            [[0.0, 2.0, 0.0], [1.0, 1.0, 1.0], [-2.0, 0.0, 2.0]]]])
    temp, n = 0.8, 6000
    g = torch.Generator().manual_seed(1)
    counts: dict[tuple, int] = {}
    for _ in range(n):
        path = tuple(walk(scores, cand, temperature=temp, generator=g)[0][0].tolist())
        counts[path] = counts.get(path, 0) + 1
    p1 = torch.softmax(scores[0, 0, 0] / temp, -1)
    tv = 0.0
    for i, j in itertools.product(range(3), range(3)):
        law = float(p1[i] * torch.softmax(scores[0, 1, i] / temp, -1)[j])
        tv += abs(counts.get((int(cand[0, 0, i]), int(cand[0, 1, j])), 0) / n - law) / 2
    assert tv < 0.03, f"total variation {tv:.4f} from the walk's law (≈ 0.01 expected at n={n})"


def test_identity_init_from_a_dflash_checkpoint_computes_dflash_exactly():
    torch.manual_seed(0)
    c1 = tiny_contract(block_size=4, vocab=50, hidden=32)
    d1 = DFlashDraftModel(c1).eval()
    d2 = DFlash2DraftModel(dflash2_contract()).eval()
    report = init_from_dflash(d2, d1.state_dict())
    assert set(report["copied"]) == set(d1.state_dict())
    noise, feats = torch.randn(2, 8, 32), torch.randn(2, 5, 64)
    pos = torch.arange(13).expand(2, 13)
    a = Anchors(torch.tensor([[1, 3], [2, 4]]), torch.ones(2, 2, dtype=torch.bool))
    mask = dense_block_mask(a.anchors, a.keep, torch.tensor([5, 5]), ctx_len=5, block_size=4)
    with torch.no_grad():
        h1, h2 = d1(noise, feats, pos, attention_mask=mask), d2(noise, feats, pos, attention_mask=mask)
        assert torch.allclose(h1, h2, atol=1e-6)
        d2.layers[0].attention_conv.base_kernel[1, 1].fill_(0.5)  # a non-identity kernel must change them
        assert not torch.allclose(h1, d2(noise, feats, pos, attention_mask=mask), atol=1e-3)


def test_blocks_never_see_each_other():
    """Two blocks in one training pass give each block what it gives alone (conv and attention stay in-block)."""
    torch.manual_seed(1)
    d2 = DFlash2DraftModel(dflash2_contract(conv_kernel_size=3)).eval()
    with torch.no_grad():
        for layer in d2.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.normal_()
                conv.kernel_projection.weight.normal_(std=0.1)
    noise, feats = torch.randn(1, 8, 32), torch.randn(1, 6, 64)
    anchors = torch.tensor([[2, 4]])
    pos = torch.cat([torch.arange(6), anchors[0, 0] + torch.arange(4), anchors[0, 1] + torch.arange(4)])[None]
    both = dense_block_mask(anchors, torch.ones(1, 2, dtype=torch.bool), torch.tensor([6]), ctx_len=6, block_size=4)
    with torch.no_grad():
        h = d2(noise, feats, pos, attention_mask=both)
        for j in range(2):
            one = dense_block_mask(anchors[:, j:j + 1], torch.ones(1, 1, dtype=torch.bool), torch.tensor([6]),
                                   ctx_len=6, block_size=4)
            alone = d2(noise[:, 4 * j:4 * j + 4], feats, torch.cat([pos[:, :6], pos[:, 6 + 4 * j:10 + 4 * j]], 1),
                       attention_mask=one)
            assert torch.allclose(h[:, 4 * j:4 * j + 4], alone, atol=1e-5)
        # and a block's positions do see their predecessors: a change at position 1 moves position 2
        bumped = noise.clone()
        bumped[:, 1] += 1.0
        h2 = d2(bumped, feats, pos, attention_mask=both)
        assert not torch.allclose(h2[:, 2], h[:, 2], atol=1e-4) and torch.allclose(h2[:, 4:], h[:, 4:], atol=1e-5)


def test_state_dict_names_are_vllms_dflash2_names():
    d2 = DFlash2DraftModel(dflash2_contract(num_draft_layers=1))
    extra = set(d2.state_dict()) - set(DFlashDraftModel(tiny_contract()).state_dict())
    layer0 = {f"layers.0.{c}.{p}" for c in ("attention_conv", "mlp_conv")
              for p in ("base_kernel", "kernel_projection.weight")}
    layer1 = {n.replace("layers.0.", "layers.1.") for n in layer0}
    selector = {f"candidate_selector.{p}" for p in ("predecessor_codebook", "successor_codebook",
                                                    "hidden_projection.weight")}
    assert extra == (layer0 | selector) or extra == (layer0 | layer1 | selector)
    sd = d2.state_dict()
    assert tuple(sd["layers.0.attention_conv.base_kernel"].shape) == (2, 2, 32)
    assert tuple(sd["layers.0.mlp_conv.kernel_projection.weight"].shape) == (2 * 2 * 4, 32)
    assert tuple(sd["candidate_selector.successor_codebook"].shape) == (50, 6)
    assert tuple(sd["candidate_selector.hidden_projection.weight"].shape) == (6, 32)


def test_unary_transform_and_refusals():
    d2 = DFlash2DraftModel(dflash2_contract(output_multiplier=2.0, final_logit_softcapping=3.0))
    logits = torch.tensor([[0.5, -4.0, 10.0]])
    assert torch.allclose(d2.unary(logits), 3.0 * torch.tanh(2.0 * logits / 3.0))
    assert isinstance(new_drafter(dflash2_contract()), DFlash2DraftModel)
    assert type(new_drafter(tiny_contract())) is DFlashDraftModel
    with pytest.raises(UsageError, match="full target vocabulary"):
        new_drafter(dflash2_contract(), draft_vocab=torch.arange(10))
    with pytest.raises(UsageError, match="conv_group_size 5 must divide hidden_size 32"):
        dflash2_contract(conv_group_size=5).check()
    assert math.isclose(d2.candidate_selector.predecessor_codebook.std().item(), 6 ** -0.5, rel_tol=0.3)


def test_walk_path_equals_the_walk_over_all_edge_scores():
    """The lazy walk (one row of scores per step) takes the same path as the walk over all K×K scores."""
    torch.manual_seed(2)
    model = DFlash2DraftModel(dflash2_contract()).double()
    sel = model.candidate_selector
    with torch.no_grad():
        sel.predecessor_codebook.normal_()
        sel.successor_codebook.normal_()
    b, n, k = 4, 3, 5
    hidden, unary = torch.randn(b, n, 32, dtype=torch.float64), torch.randn(b, n, k, dtype=torch.float64)
    cand = torch.stack([torch.randperm(50)[:k] for _ in range(b * n)]).view(b, n, k)
    anchor = torch.tensor([1, 2, 3, 4])
    with torch.no_grad():
        scores = sel(cand, unary, hidden, anchor)
        for temp in (0.0, 1.0):
            g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
            full = walk(scores, cand, temperature=temp, generator=g1)
            lazy = walk_path(sel, cand, unary, hidden, anchor, temperature=temp, generator=g2)
            assert torch.equal(full[0], lazy[0]) and torch.allclose(full[1], lazy[1], atol=1e-9)
