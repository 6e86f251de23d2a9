"""Block-diffusion masks: vectorised == loop oracle, flex == dense, training view == inference view."""

from __future__ import annotations

import pytest
import torch

from dflashkit.model.drafter import DFlashDraftModel
from dflashkit.model.masks import dense_block_mask, flex_block_mask, loop_block_mask
from dflashkit.train.objective import Anchors, block_input_ids, block_position_ids
from tests.helpers import random_case, tiny_contract, with_fields


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


# -- causal in-block attention (drafter.causal, JetSpec) ---------------------------------------------------------
def _causal_model(seed: int = 0, causal: bool = True, block_size: int = 4) -> DFlashDraftModel:
    torch.manual_seed(seed)
    return DFlashDraftModel(with_fields(tiny_contract(block_size=block_size), causal=causal)).eval()


@pytest.mark.parametrize("seed", range(6))
def test_causal_dense_mask_equals_loop_oracle(seed):
    lm, lens, a = random_case(seed)
    got = dense_block_mask(a.anchors, a.keep, lens, ctx_len=13, block_size=4, causal=True)
    want = loop_block_mask(a.anchors.tolist(), a.keep.tolist(), lens.tolist(), ctx_len=13, block_size=4, causal=True)
    assert torch.equal(got, want)
    bidirectional = dense_block_mask(a.anchors, a.keep, lens, ctx_len=13, block_size=4)
    assert torch.equal(got[..., :13], bidirectional[..., :13])            # the context rule is unchanged
    assert not (got & ~bidirectional).any() and (bidirectional & ~got).any()  # causal sees strictly less


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_flex_mask_materialised_on_cpu_equals_loop_oracle(seed, causal):
    """The flex form is evaluated element by element (create_mask runs the mask_mod on CPU; flex backward
    does not run there, mask evaluation does)."""
    from torch.nn.attention.flex_attention import create_mask

    from dflashkit.model.masks import mask_mod_for

    lm, lens, a = random_case(seed, block=3, num_anchors=4)
    n, s, B = a.anchors.shape[1], 13, 3
    mod = mask_mod_for(a.anchors, a.keep, lens, ctx_len=s, block_size=B, causal=causal)
    got = create_mask(mod, a.anchors.shape[0], None, n * B, s + n * B, device="cpu")
    want = loop_block_mask(a.anchors.tolist(), a.keep.tolist(), lens.tolist(), ctx_len=s, block_size=B, causal=causal)
    assert torch.equal(got, want)


def test_causal_mask_rows_in_one_block():
    a = Anchors(torch.tensor([[3, 6]]), torch.tensor([[True, True]]))
    m = dense_block_mask(a.anchors, a.keep, torch.tensor([9]), ctx_len=9, block_size=3, causal=True)[0, 0]
    own = m[3:6, 12:15]                                   # block 1's queries x its own keys
    assert torch.equal(own, torch.ones(3, 3, dtype=torch.bool).tril())  # offset i sees j <= i
    assert m[3:6, :6].all() and not m[3:6, 6:9].any()     # context strictly before its anchor, every offset
    assert not m[3:6, 9:12].any() and m.any(-1).all()     # never block 0; every row sees a key (no NaN)


def test_inference_mask_is_the_training_rule_for_one_block():
    from dflashkit.model.masks import inference_mask

    a = Anchors(torch.tensor([[5]]), torch.tensor([[True]]))
    train = dense_block_mask(a.anchors, a.keep, torch.tensor([5]), ctx_len=5, block_size=4, causal=True)[0, 0]
    assert torch.equal(inference_mask(ctx_len=5, q_len=4), train)


@pytest.mark.parametrize("seed", range(2))
def test_causal_flex_forward_equals_dense_on_cpu(seed):
    model = _causal_model(seed)
    c = model.contract
    lm, lens, a = random_case(seed, s=16)
    b, s = lm.shape
    feats = torch.randn(b, s, 2 * c.hidden_size)
    noise = torch.randn(b, a.anchors.shape[1] * 4, c.hidden_size)
    pos = block_position_ids(a, ctx_len=s, block_size=4)
    with torch.no_grad():
        want = model(noise, feats, pos, attention_mask=dense_block_mask(a.anchors, a.keep, lens, ctx_len=s,
                                                                        block_size=4, causal=True))
        got = model(noise, feats, pos, attention_mask=flex_block_mask(a.anchors, a.keep, lens, ctx_len=s,
                                                                      block_size=4, causal=True))
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_causal_training_view_equals_inference_view(kind):
    """A causal drafter's training blocks (the causal mask) equal its inference calls (no mask given: the drafter
    masks offsets j > i itself), with and without a context cache; DFlash2's too."""
    from dflashkit.family import new_drafter
    from dflashkit.model.drafter import DraftKVCache

    torch.manual_seed(0)
    extra = {"drafter_type": "dflash2", "conv_group_size": 8, "selector_rank": 4, "selector_top_k": 3} \
        if kind == "dflash2" else {}
    c = with_fields(tiny_contract(), causal=True, **extra)
    model = new_drafter(c).eval()
    with torch.no_grad():
        for p in model.parameters():  # identity convolutions would hide a wiring mistake
            p.add_(torch.randn_like(p) * 0.05)
    s, B = 12, 4
    ids = torch.randint(0, c.vocab_size - 1, (1, s))
    feats = torch.randn(1, s, 2 * c.hidden_size)
    emb = torch.nn.Embedding(c.vocab_size, c.hidden_size)
    a = Anchors(torch.tensor([[0, 3, 4, 10]]), torch.tensor([[True, True, True, True]]))
    bids = block_input_ids(ids, a, mask_token_id=c.mask_token_id, block_size=B)
    with torch.no_grad():
        train_out = model(emb(bids), feats, block_position_ids(a, ctx_len=s, block_size=B),
                          attention_mask=dense_block_mask(a.anchors, a.keep, torch.tensor([s]), ctx_len=s,
                                                          block_size=B, causal=True))
        bidir = model(emb(bids), feats, block_position_ids(a, ctx_len=s, block_size=B),
                      attention_mask=dense_block_mask(a.anchors, a.keep, torch.tensor([s]), ctx_len=s, block_size=B))
        assert not torch.allclose(train_out, bidir, atol=1e-4)  # the mask matters on these inputs
        for j, anchor in enumerate(a.anchors[0].tolist()):
            blk = emb(torch.tensor([[ids[0, anchor].item()] + [c.mask_token_id] * (B - 1)]))
            pos = torch.arange(anchor + B)[None]
            inf = model(blk, feats[:, :anchor], pos)
            assert torch.allclose(train_out[:, j * B:(j + 1) * B], inf, atol=1e-5), j
            if anchor >= 2:  # part of the context already in the drafter's cache, as the decoder runs it
                cache = DraftKVCache()
                model(blk, feats[:, :2], torch.arange(2 + B)[None], cache=cache)  # an earlier step's draft
                cached = model(blk, feats[:, 2:anchor], pos[:, 2:], cache=cache)
                assert torch.allclose(cached, inf, atol=1e-5), j


def test_a_causal_drafters_prefix_ignores_later_offsets():
    """Offset i of a causal block depends on offsets 0 … i only: a shorter block (or other tokens after i) gives
    the same first outputs; a bidirectional drafter's change."""
    ctx, q = 6, 4
    feats = torch.randn(1, ctx, 64)
    pos = torch.arange(ctx + q)[None]
    block = torch.randn(1, q, 32)
    other = torch.cat([block[:, :2], torch.randn(1, q - 2, 32)], dim=1)
    for causal in (True, False):
        model = _causal_model(1, causal=causal)
        with torch.no_grad():
            full, changed = model(block, feats, pos), model(other, feats, pos)
            short = model(block[:, :2], feats, pos[:, :ctx + 2])
        same = torch.allclose(full[:, :2], changed[:, :2], atol=1e-6) and torch.allclose(full[:, :2], short, atol=1e-6)
        assert same is causal, causal
