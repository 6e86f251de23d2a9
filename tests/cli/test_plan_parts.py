"""`plan`'s drafter parameters part by part (sizing/budget.drafter_parts) equal the networks our code builds, for
DFlash, DSpark (with a reduced draft vocabulary), MLA draft layers and DSpark with MLA; and at Kimi K2.6's shape
(the config.json fixture, no weights) plan prints them with the memory a reduced vocabulary changes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflashkit.cli import main
from dflashkit.config import config_from_dict

K26 = str(Path(__file__).resolve().parents[1] / "fixtures" / "configs" / "kimi-k2.6")
MLA = {"attention_type": "mla", "mla_q_lora_rank": 24, "mla_kv_lora_rank": 16, "mla_qk_nope_head_dim": 8,
       "mla_qk_rope_head_dim": 4, "mla_v_head_dim": 12}
CASES = {"dflash": {}, "dspark": {"type": "dspark", "dspark_markov_rank": 8},
         "mla": MLA, "dspark+mla": {"type": "dspark", "dspark_markov_rank": 8, "dspark_confidence_with_markov": True,
                                    **MLA}}


def numel(model: torch.nn.Module, *prefixes: str) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if n.startswith(prefixes))


@pytest.mark.parametrize("draft_vocab", [None, 40])
@pytest.mark.parametrize("case", list(CASES))
def test_each_part_is_the_built_networks_count(tiny_qwen3, case, draft_vocab):
    from dflashkit.family import extra_params, new_drafter
    from dflashkit.sizing.budget import drafter_parts, drafter_params
    from dflashkit.inspect.config_facts import read_model_facts
    from dflashkit.inspect.contract import derive_contract
    from dflashkit.inspect.tokenizer_facts import read_tokenizer_facts

    d = config_from_dict({"drafter": {"num_draft_layers": 2, "num_target_features": 3, **CASES[case]}}).drafter
    c = derive_contract(d, read_model_facts(tiny_qwen3), read_tokenizer_facts(tiny_qwen3))
    vocab = None if draft_vocab is None else torch.randperm(c.vocab_size)[:draft_vocab].sort().values
    model = new_drafter(c, vocab)
    parts = drafter_parts(c, draft_vocab)
    assert parts["layer"] == {"attention": numel(model, "layers.0.self_attn."), "mlp": numel(model, "layers.0.mlp."),
                              "norms": numel(model, "layers.0.input_layernorm.", "layers.0.post_attention_layernorm.")}
    assert parts["layers"] == numel(model, "layers.") and parts["fc"] == numel(model, "fc.")
    assert parts["norms"] == numel(model, "hidden_norm.", "norm.")
    assert {k: numel(model, k + ".") for k in parts["family"]} == parts["family"]
    assert parts["params"] == drafter_params(c, draft_vocab) == sum(p.numel() for p in model.parameters())
    if draft_vocab is None:  # the family seam's own count agrees (MLA kept in the DFlash it is compared with)
        assert extra_params(c) == sum(parts["family"].values())
    if case.startswith("dspark"):  # Markov head V·r + V'·r, confidence head H (+ r) + 1, in closed form
        r, v, h = 8, c.vocab_size, c.hidden_size
        assert parts["family"] == {"markov_head": v * r + (draft_vocab or v) * r,
                                   "confidence_head": h + (r if "mla" in case else 0) + 1}
    else:
        assert parts["family"] == {}
    if "mla" in case:  # q-LoRA down + norm + up, kv down (+ rope) + norm + up, o_proj
        n, h = c.num_attention_heads, c.hidden_size
        assert parts["layer"]["attention"] == (h * 24 + 24 + 24 * n * 12 + h * (16 + 4) + 16 + 16 * n * (8 + 12)
                                               + n * 12 * h)


def _plan(capsys, *over: str) -> dict:
    args = [K26, "8x141", "data.num_prompts=50000", "data.mean_tokens=2000", "drafter.num_draft_layers=3",
            "drafter.block_size=8", "drafter.target_layer_ids=[1,29,57]", *over]
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["plan"]


def test_plan_at_kimi_k26_shape_counts_dspark_and_mla_and_the_reduced_vocab(tmp_path, capsys):
    rd = ["--run-dir", str(tmp_path)]
    dflash = _plan(capsys, *rd)
    full = _plan(capsys, *rd, "drafter.type=dspark")
    ds = _plan(capsys, *rd, "drafter.type=dspark", "drafter.draft_vocab_size=32768")
    mla = _plan(capsys, *rd, "drafter.type=dspark", "drafter.draft_vocab_size=32768", "drafter.attention_type=mla")
    v, vp, h, r = 163_840, 32_768, 7168, 256
    assert ds["drafter"]["parts"]["family"] == {"markov_head": v * r + vp * r, "confidence_head": h + 1}
    assert full["drafter"]["params"] - ds["drafter"]["params"] == (v - vp) * r   # markov_w2 has V' rows
    assert ds["drafter"]["params"] - dflash["drafter"]["params"] == v * r + vp * r + h + 1
    assert ds["drafter"]["parts"]["fc"] == 3 * h * h and ds["drafter"]["draft_vocab_size"] == vp
    # MLA (q-LoRA 1536, kv-LoRA 512, qk 128 + 64, v 128, 64 heads) replaces GQA's attention, nothing else
    n = 64
    att = h * 1536 + 1536 + 1536 * n * 192 + h * (512 + 64) + 512 + 512 * n * (128 + 128) + n * 128 * h
    assert mla["drafter"]["parts"]["layer"]["attention"] == att
    assert mla["drafter"]["params"] - ds["drafter"]["params"] == 3 * (att - ds["drafter"]["attention_params_per_layer"])
    # memory: 16 B/param of weights, grads and Adam; the V' head rows copied beside the frozen embedding and head;
    # logits over V' only
    for p in (dflash, ds, mla):
        assert p["drafter"]["weights_grads_adam_gib"] == round(16 * p["drafter"]["params"] / 2**30, 2)
        assert p["drafter"]["weights_gib"] == round(2 * p["drafter"]["params"] / 2**30, 2)
    assert ds["drafter"]["frozen_embed_head_gib"] == round((2 * v + vp) * h * 2 / 2**30, 2)
    assert dflash["drafter"]["frozen_embed_head_gib"] == round(2 * v * h * 2 / 2**30, 2)
    assert ds["logits"]["vocab"] == vp and ds["logits"]["chunk_gib"] == round(64 * 8 * vp * 12 / 2**30, 2)
    assert dflash["logits"]["vocab"] == v and mla["drafter"]["activations_gib"] != ds["drafter"]["activations_gib"]
    assert main(["plan", K26, "8x141", "drafter.type=dspark", "drafter.draft_vocab_size=32768", *rd]) == 0
    table = capsys.readouterr().out
    assert "drafter parts" in table and "markov_head 50.3M, confidence_head 7.2K" in table
    assert "draft vocab 32768" in table and "32768 wide" in table
