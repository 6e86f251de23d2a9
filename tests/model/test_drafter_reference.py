"""Our DFlashDraftModel equals the z-lab reference (PyPI dflash==0.1.0) for the same weights."""

import pytest
import torch

from dflashkit.model.drafter import DFlashDraftModel, DraftKVCache
from dflashkit.family.contract import DrafterContract

ref = pytest.importorskip("dflash.model", reason="test-only dependency: pip install --no-deps dflash==0.1.0")


def _contract(**kw):
    base = dict(block_size=4, num_draft_layers=2, target_layer_ids=[1, 3, 5], mask_token_id=7,
                num_target_layers=8, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, intermediate_size=128, vocab_size=100, rope_theta=10000.0)
    base.update(kw)
    return DrafterContract(**base)


def _reference(contract, state_dict):
    from transformers import Qwen3Config

    hc = contract.to_hf_config(dtype="float32")
    for k in ("auto_map", "architectures"):
        hc.pop(k)
    rc = Qwen3Config(**hc)
    rc._attn_implementation = "sdpa"
    r = ref.DFlashDraftModel(rc).eval()
    r.load_state_dict(state_dict, strict=True)
    return r, rc


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_forward_and_cache_step_equal_reference(kv_heads):
    from transformers import DynamicCache

    torch.manual_seed(0)
    c = _contract(num_key_value_heads=kv_heads)
    ours = DFlashDraftModel(c).eval()
    theirs, rc = _reference(c, ours.state_dict())
    ctx, noise = torch.randn(2, 10, 192), torch.randn(2, 4, 64)
    pos = torch.arange(14)[None].expand(2, -1)
    with torch.no_grad():
        cache, rcache = DraftKVCache(), DynamicCache(config=rc)
        a = ours(noise, ctx, pos, cache=cache)
        b = theirs(position_ids=pos, noise_embedding=noise, target_hidden=ctx, past_key_values=rcache, use_cache=True)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        cache.crop(10)
        rcache.crop(-4)
        ctx2, noise2, pos2 = torch.randn(2, 3, 192), torch.randn(2, 4, 64), torch.arange(10, 17)[None].expand(2, -1)
        a2 = ours(noise2, ctx2, pos2, cache=cache)
        b2 = theirs(position_ids=pos2, noise_embedding=noise2, target_hidden=ctx2, past_key_values=rcache, use_cache=True)
        torch.testing.assert_close(a2, b2, atol=1e-5, rtol=1e-5)
        assert cache.length == 13


def test_state_dict_names_are_the_zlab_checkpoint_names():
    c = _contract(num_draft_layers=5)
    keys = set(DFlashDraftModel(c).state_dict())
    assert len(keys) == 11 * 5 + 3
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.4.self_attn.q_norm.weight",
            "layers.0.mlp.gate_proj.weight", "layers.2.post_attention_layernorm.weight"} <= keys
    assert not any("embed" in k or "lm_head" in k or "rotary" in k for k in keys)
