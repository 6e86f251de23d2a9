"""drafter.init=target: matching target-layer tensors are copied, the rest skipped with a reason."""

from __future__ import annotations

import torch

from dflashkit.config import load_config
from dflashkit.model.drafter import DFlashDraftModel
from dflashkit.model.init import init_from_target
from dflashkit.target.load import load_target
from tests.helpers import make_contract


def _load(path):
    return load_target(load_config(None, [f"target.path={path}"]).target)


def test_init_from_qwen3_copies_attention_mlp_and_norms(tiny_targets):
    t = _load(tiny_targets["qwen3"])
    d = DFlashDraftModel(make_contract(tiny_targets["qwen3"], num_draft_layers=2))
    with torch.no_grad():  # a random target's final norm is all ones, like the drafter's: make it differ
        t.model.get_decoder().norm.weight.uniform_(0.5, 1.5)
    rep = init_from_target(d, t)
    assert rep["layer_ids"] == [4, 5] and not rep["skipped"] and len(rep["copied"]) == 23
    assert "norm.weight" in rep["copied"]
    assert torch.equal(d.norm.weight, t.model.get_decoder().norm.weight)
    src = t.decoder_layers[5]
    assert torch.equal(d.layers[1].self_attn.q_proj.weight, src.self_attn.q_proj.weight)
    assert torch.equal(d.layers[1].mlp.down_proj.weight, src.mlp.down_proj.weight)
    assert torch.equal(d.layers[1].self_attn.k_norm.weight, src.self_attn.k_norm.weight)


def test_init_from_llama_keeps_unit_qk_norm_and_skips_mla_moe(tiny_targets):
    d = DFlashDraftModel(make_contract(tiny_targets["llama"]))
    with torch.no_grad():
        d.layers[0].self_attn.q_norm.weight.fill_(1.0)
    rep = init_from_target(d, _load(tiny_targets["llama"]))
    assert "layers.0.self_attn.q_proj.weight" in rep["copied"]
    assert any("q_norm" in s for s in rep["skipped"]) and torch.all(d.layers[0].self_attn.q_norm.weight == 1)
    ds = DFlashDraftModel(make_contract(tiny_targets["deepseek_v3"]))
    before = ds.layers[0].self_attn.q_proj.weight.clone()
    rep = init_from_target(ds, _load(tiny_targets["deepseek_v3"]))
    assert "layers.0.self_attn.q_proj.weight" not in rep["copied"]  # MLA has no plain q_proj
    assert torch.equal(before, ds.layers[0].self_attn.q_proj.weight)
    assert "layers.0.input_layernorm.weight" in rep["copied"]


def test_init_from_target_fills_dflash2_shared_parts_and_leaves_the_identity_convolutions(tiny_targets):
    from dflashkit.model.dflash2 import DFlash2DraftModel

    t = _load(tiny_targets["qwen3"])
    c = make_contract(tiny_targets["qwen3"], num_draft_layers=2, drafter_type="dflash2", conv_group_size=16,
                      selector_rank=8, selector_top_k=4)
    d1, d2 = DFlashDraftModel(make_contract(tiny_targets["qwen3"], num_draft_layers=2)), DFlash2DraftModel(c)
    r1, r2 = init_from_target(d1, t), init_from_target(d2, t)
    assert r1["copied"] == r2["copied"] and not r2["skipped"]
    shared = d1.state_dict()
    own = d2.state_dict()
    assert all(torch.equal(own[k], shared[k]) for k in r1["copied"])
    conv = d2.layers[0].attention_conv
    assert torch.equal(conv.base_kernel[:, 0], torch.ones_like(conv.base_kernel[:, 0]))
    assert not conv.base_kernel[:, 1:].any() and not conv.kernel_projection.weight.any()
