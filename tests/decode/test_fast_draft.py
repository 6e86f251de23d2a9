"""The lean draft forward (decode/fast_draft.py) proposes what the drafter module proposes, step by step.

The oracle is `DFlashDraftModel.forward` with its `DraftKVCache`, driven the way the decoder drove it before the
lean path: new context features each step, the block [anchor, MASK, …] at its positions, the head's rows.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflashkit.decode.fast_draft import FastDraft, _PackedLinear
from dflashkit.model.drafter import DFlashDraftModel, DraftKVCache
from dflashkit.model.drafter_config import DrafterContract


def _contract(layers: int = 2, block: int = 4) -> DrafterContract:
    return DrafterContract(block_size=block, num_draft_layers=layers, target_layer_ids=[0, 2, 3], mask_token_id=3,
                           num_target_layers=6, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, intermediate_size=96, vocab_size=300, rope_theta=1e4)


def _pair(dtype: torch.dtype, *, steps: int = 24, layers: int = 2, scale: bool = False, vocab_rows: int = 300,
          short_tail: bool = False):
    """(reference logits, fast logits) per step over one simulated decode."""
    torch.manual_seed(1)
    c = _contract(layers)
    fs = torch.rand(len(c.target_layer_ids) * c.hidden_size) + 0.5 if scale else None
    m = DFlashDraftModel(c, feature_scale=fs)
    m.reset_parameters(std=0.2)  # a drafter far from init: peaked, distinct logits
    m = m.to(dtype).eval()
    emb = (torch.randn(c.vocab_size, c.hidden_size)).to(dtype)
    head = (torch.randn(vocab_rows, c.hidden_size) * 0.3).to(dtype)
    mask = emb[c.mask_token_id].view(1, 1, -1)
    fast = FastDraft(m, head, None, mask, max_len=16)            # the RoPE table grows on the way
    state = fast.new_state(capacity=4)                           # and so do the K/V buffers
    cache = DraftKVCache()
    pos = torch.arange(512)[None]
    start = t = 19
    out = []
    g = torch.Generator().manual_seed(2)
    with torch.inference_mode():
        for step in range(steps):
            k = c.block_size - 1 if not (short_tail and step == steps - 1) else 1
            feats = torch.randn(1, t, len(c.target_layer_ids) * c.hidden_size, generator=g).to(dtype)
            anchor = emb[(7 * step) % c.vocab_size].view(1, 1, -1)
            block = torch.cat([anchor, mask.expand(1, k, -1)], dim=1)
            h = m(block, feats, pos[:, start - t: start + k + 1], cache=cache)
            ref = F.linear(h[0, 1:], head)
            got = fast.propose(state, feats, anchor, start, k)
            out.append((ref, got))
            t = 1 + step % c.block_size
            start += t
    return out


def _assert_same_proposals(pairs, atol: float) -> None:
    decided = 0
    for i, (ref, got) in enumerate(pairs):
        assert got.shape == ref.shape, i
        diff = (ref.float() - got.float()).abs().max().item()
        assert diff <= atol, f"step {i}: logits differ by {diff}"
        top2 = ref.float().topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * atol  # a tie within rounding may break either way
        decided += int(clear.sum())
        assert torch.equal(ref.argmax(-1)[clear], got.argmax(-1)[clear]), f"step {i}: proposals differ"
    assert decided >= 0.6 * sum(r.shape[0] for r, _ in pairs)  # the comparison decided (almost) every position


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
def test_fast_draft_proposes_what_the_module_proposes(dtype, atol):
    _assert_same_proposals(_pair(dtype), atol)


def test_fast_draft_with_a_feature_scale_one_layer_a_reduced_head_and_a_short_last_block():
    _assert_same_proposals(_pair(torch.float32, layers=1, scale=True, vocab_rows=37, short_tail=True), 1e-5)


def test_packed_linear_is_f_linear_or_falls_back():
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        w, b = torch.randn(48, 32).to(dtype), torch.randn(48).to(dtype)
        lin = _PackedLinear(w, b, rows=4)
        assert lin.packed is None or dtype == torch.bfloat16      # packing is only tried for CPU bf16
        for m in (1, 3, 4, 9):                                    # 9 > rows: F.linear
            x = torch.randn(m, 32).to(dtype)
            assert torch.equal(lin(x), F.linear(x, w, b)) or lin.packed is not None and m <= 4
            if lin.packed is not None and m <= 4:                 # chosen only where it is F.linear bit for bit
                assert torch.equal(lin(x), F.linear(x, w, b)), (dtype, m)


def test_supports_plain_dflash_only():
    c = _contract(1)
    assert FastDraft.supports(DFlashDraftModel(c))
    from dataclasses import replace

    from dflashkit.model.dflash2 import DFlash2DraftModel

    d2 = replace(c, drafter_type="dflash2", conv_group_size=16, selector_rank=8, selector_top_k=4)
    assert not FastDraft.supports(DFlash2DraftModel(d2))
