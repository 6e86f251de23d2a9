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
from dflashkit.family.contract import DrafterContract
from tests.helpers import with_fields


def _contract(layers: int = 2, block: int = 4) -> DrafterContract:
    return DrafterContract(block_size=block, num_draft_layers=layers, target_layer_ids=[0, 2, 3], mask_token_id=3,
                           num_target_layers=6, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, intermediate_size=96, vocab_size=300, rope_theta=1e4)


def _pair(dtype: torch.dtype, *, steps: int = 24, layers: int = 2, scale: bool = False, vocab_rows: int = 300,
          short_tail: bool = False, causal: bool = False):
    """(reference logits, fast logits) per step over one simulated decode (`causal`: a JetSpec drafter, the
    module forward masking offsets j > i itself)."""
    torch.manual_seed(1)
    c = with_fields(_contract(layers), causal=causal)
    fs = torch.rand(len(c.target_layer_ids) * c.hidden_size) + 0.5 if scale else None
    m = DFlashDraftModel(c, feature_scale=fs)
    m.reset_parameters(std=0.2)  # a drafter far from init: peaked, distinct logits
    m = m.to(dtype).eval()
    emb = (torch.randn(c.vocab_size, c.hidden_size)).to(dtype)
    head = (torch.randn(vocab_rows, c.hidden_size) * 0.3).to(dtype)
    mask = emb[c.mask_token_id].view(1, 1, -1)
    fast = FastDraft(m, head, None, mask, max_len=16, causal=causal)  # the RoPE table grows on the way
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


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
def test_fast_draft_of_a_causal_drafter_proposes_what_the_module_proposes(dtype, atol):
    pairs = _pair(dtype, causal=True, short_tail=True)
    _assert_same_proposals(pairs, atol)
    if dtype == torch.float32:  # the same weights and inputs served bidirectionally: the mask changes the drafts
        bidirectional = _pair(dtype, short_tail=True)
        assert any(not torch.allclose(r, b, atol=1e-3) for (r, _), (b, _) in zip(pairs, bidirectional))


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


def test_supports_what_the_family_declares(monkeypatch):
    """The family's `Decoding.fast_path` decides, not the layers' classes: DFlash and a LiLiCorr backbone without
    convolutions with GQA layers; not MLA, DFlash2, a convolved LiLiCorr, nor a family that declares nothing (here
    DFlash's very network, whose layers are plain DFlash layers)."""
    from dataclasses import replace

    from dflashkit import family
    from dflashkit.family import new_drafter
    from dflashkit.family.base import Decoding
    from dflashkit.family.dflash import DFLASH, propose

    c = _contract(1)
    assert FastDraft.supports(DFlashDraftModel(c))
    lili = dict(drafter_type="lilicorr", lilicorr_candidate_topk=4, lilicorr_num_heads=4, lilicorr_factor_dim=8)
    assert FastDraft.supports(new_drafter(with_fields(c, **lili)))
    refused = {"dflash2": with_fields(c, drafter_type="dflash2", conv_group_size=16, selector_rank=8, selector_top_k=4),
               "mla": with_fields(c, attention_type="mla", mla_q_lora_rank=0, mla_kv_lora_rank=16,
                                  mla_qk_nope_head_dim=8, mla_qk_rope_head_dim=8, mla_v_head_dim=8),
               "lilicorr+conv": with_fields(c, **lili, lilicorr_conv_kernel_size=2, lilicorr_conv_group_size=8)}
    for name, contract in refused.items():
        assert not FastDraft.supports(new_drafter(contract)), name
    plain = replace(DFLASH, name="plain", formats=replace(DFLASH.formats, architecture="PlainDraftModel"),
                    decoding=Decoding(propose=propose))
    monkeypatch.setitem(family.FAMILIES, "plain", plain)
    drafter = new_drafter(with_fields(c, drafter_type="plain"))
    assert type(drafter) is DFlashDraftModel and not FastDraft.supports(drafter)


def test_forward_gives_the_modules_hidden_states_before_the_head():
    """`forward`'s h is what the module returns at block positions 1 … k (a family's proposal step may read it)."""
    torch.manual_seed(3)
    c = _contract(2)
    m = DFlashDraftModel(c)
    m.reset_parameters(std=0.2)
    m.eval()
    emb, head = torch.randn(c.vocab_size, c.hidden_size), torch.randn(c.vocab_size, c.hidden_size) * 0.3
    mask = emb[c.mask_token_id].view(1, 1, -1)
    fast = FastDraft(m, head, None, mask)
    feats = torch.randn(1, 9, len(c.target_layer_ids) * c.hidden_size)
    anchor = emb[11].view(1, 1, -1)
    with torch.inference_mode():
        want = m(torch.cat([anchor, mask.expand(1, 3, -1)], dim=1), feats, torch.arange(13)[None],
                 cache=DraftKVCache())[0, 1:]
        h, logits = fast.forward(fast.new_state(), feats, anchor, 9, 3)
    torch.testing.assert_close(h, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(logits, F.linear(h, head))


@pytest.mark.parametrize("drafter_type", ["dflash", "dflash2", "dflash-causal", "lilicorr"])
def test_the_decoder_drafts_through_the_lean_forward_what_it_drafts_through_the_module(tiny_qwen3, drafter_type):
    """SpecDecoder builds `FastDraft` for plain DFlash layers (a LiLiCorr backbone without convolutions too; a
    DFlash2 one keeps the module path); with it every step drafts what the module forward (with its
    DraftKVCache) drafts, and the decode is the same (LiLiCorr: the lattice reads the same hidden states and
    anchor row on both paths)."""
    from dflashkit.config import load_config
    from dflashkit.decode.api import SamplingParams
    from dflashkit.decode.spec_decode import SpecDecoder
    from dflashkit.target.load import load_target
    from dflashkit.testing import random_drafter

    target = load_target(load_config(None, [f"target.path={tiny_qwen3}", "target.device=cpu",
                                            "target.dtype=float32"]).target)
    extra = {"dflash": {}, "dflash-causal": dict(causal=True),
             "dflash2": dict(drafter_type="dflash2", conv_group_size=8, selector_top_k=4),
             "lilicorr": dict(drafter_type="lilicorr", lilicorr_candidate_topk=4, lilicorr_num_heads=4,
                              lilicorr_factor_dim=8)}[drafter_type]
    drafter = random_drafter(target, block_size=4, layers=2, **extra)
    lean, module = SpecDecoder(target, drafter, 4), SpecDecoder(target, drafter, 4)
    assert (lean._fast is not None) == (drafter_type != "dflash2")
    assert lean._fast is None or lean._fast.causal is drafter.causal
    module._fast = None  # the module forward with its DraftKVCache
    drafted: dict[str, list[list[int]]] = {"lean": [], "module": []}
    for name, dec in (("lean", lean), ("module", module)):
        step = dec._propose

        def recorded(*args, _step=step, _out=drafted[name], **kw):
            tokens, law = _step(*args, **kw)
            _out.append(list(tokens))
            return tokens, law

        dec._propose = recorded  # type: ignore[method-assign]
    params = SamplingParams(max_new_tokens=24, stop_token_ids=())
    for prompt in ([40, 41, 42, 43, 44, 10], [7, 8, 9, 200, 201, 202, 203, 12, 99]):
        a, b = lean.generate(prompt, params), module.generate(prompt, params)
        assert a.token_ids == b.token_ids and a.acceptance_lengths == b.acceptance_lengths
    assert drafted["lean"] == drafted["module"] and len(drafted["lean"]) >= 20
    assert len({t for d in drafted["lean"] for t in d}) > 3  # varied drafts: the comparison bites
