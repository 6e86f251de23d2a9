"""Block-diffusion masks: vectorised == loop oracle, flex == dense, training view == inference view."""

from __future__ import annotations

import pytest
import torch

from dflashkit.model.drafter import DFlashDraftModel
from dflashkit.model.masks import dense_block_mask, flex_block_mask, loop_block_mask
from dflashkit.train.objective import Anchors, block_input_ids, block_position_ids
from tests.helpers import random_case, tiny_contract


@pytest.mark.parametrize("seed", range(6))
def test_dense_mask_equals_loop_oracle(seed):
    lm, lens, a = random_case(seed)
    got = dense_block_mask(a.anchors, a.keep, lens, ctx_len=13, block_size=4)
    want = loop_block_mask(a.anchors.tolist(), a.keep.tolist(), lens.tolist(), ctx_len=13, block_size=4)
    assert torch.equal(got, want)


def test_mask_strict_context_and_no_other_blocks():
    a = Anchors(torch.tensor([[0, 5]]), torch.tensor([[True, True]]))
    m = dense_block_mask(a.anchors, a.keep, torch.tensor([10]), ctx_len=10, block_size=3)[0, 0]
    assert not m[0:3, :10].any()                       # anchor 0: no visible context at all
    assert m[3:6, :5].all() and not m[3:6, 5:10].any()  # strictly < anchor: index 5 itself hidden
    assert m[0:3, 10:13].all() and not m[0:3, 13:16].any()
    assert m[3:6, 13:16].all() and not m[3:6, 10:13].any()
    assert m.any(-1).all()                              # every row has a key: no NaN


def test_padding_never_visible_and_padded_blocks_only_see_themselves():
    a = Anchors(torch.tensor([[6, 0]]), torch.tensor([[True, False]]))
    m = dense_block_mask(a.anchors, a.keep, torch.tensor([4]), ctx_len=8, block_size=2)[0, 0]
    assert not m[:, 4:8].any()
    assert not m[2:4, :8].any() and m[2:4, 10:12].all()


@pytest.mark.parametrize("seed", range(2))
def test_flex_forward_equals_dense_on_cpu(seed):
    torch.manual_seed(seed)
    c = tiny_contract()
    model = DFlashDraftModel(c).eval()
    lm, lens, a = random_case(seed, s=16)
    b, s = lm.shape
    feats = torch.randn(b, s, 2 * c.hidden_size)
    ids = torch.randint(0, c.vocab_size - 1, (b, s))
    noise = torch.randn(b, a.anchors.shape[1] * 4, c.hidden_size)
    pos = block_position_ids(a, ctx_len=s, block_size=4)
    dense = dense_block_mask(a.anchors, a.keep, lens, ctx_len=s, block_size=4)
    with torch.no_grad():
        want = model(noise, feats, pos, attention_mask=dense)
        got = model(noise, feats, pos, attention_mask=flex_block_mask(a.anchors, a.keep, lens, ctx_len=s, block_size=4))
    del ids
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_training_view_equals_inference_view():
    """Each training block's output equals what the inference call (context = features[:a], no mask) gives."""
    torch.manual_seed(0)
    c = tiny_contract()
    model = DFlashDraftModel(c).eval()
    s, B = 12, 4
    ids = torch.randint(0, c.vocab_size - 1, (1, s))
    feats = torch.randn(1, s, 2 * c.hidden_size)
    emb = torch.nn.Embedding(c.vocab_size, c.hidden_size)
    a = Anchors(torch.tensor([[0, 3, 4, 10]]), torch.tensor([[True, True, True, True]]))
    bids = block_input_ids(ids, a, mask_token_id=c.mask_token_id, block_size=B)
    with torch.no_grad():
        train_out = model(emb(bids), feats, block_position_ids(a, ctx_len=s, block_size=B),
                          attention_mask=dense_block_mask(a.anchors, a.keep, torch.tensor([s]), ctx_len=s,
                                                          block_size=B))
        for j, anchor in enumerate(a.anchors[0].tolist()):
            blk = torch.tensor([[ids[0, anchor].item()] + [c.mask_token_id] * (B - 1)])
            pos = torch.arange(anchor + B)[None]
            inf = model(emb(blk), feats[:, :anchor], pos)
            assert torch.allclose(train_out[:, j * B:(j + 1) * B], inf, atol=1e-5), j
