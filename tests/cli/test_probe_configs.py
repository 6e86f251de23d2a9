"""probe on real-shaped config.json fixtures (tests/fixtures/configs) and on bad input."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from dflashkit.cli import main
from dflashkit.config import config_from_dict
from dflashkit.errors import UsageError
from dflashkit.inspect.config_facts import read_model_facts
from dflashkit.inspect.contract import derive_contract
from dflashkit.inspect.tokenizer_facts import TokenizerFacts

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "configs"


def last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def facts(name: str):
    return read_model_facts(FIXTURES / name)


def close(value: float, expected: float, rel: float = 0.02) -> bool:
    return math.isclose(value, expected, rel_tol=rel)


def test_kimi_k26_wrapped_mla_moe():
    f = facts("kimi-k2.6")
    assert (f.model_type, f.wrapper, f.text_model_type) == ("kimi_k25", "text_config", "kimi_k2")
    assert f.architecture == "KimiK25ForConditionalGeneration" and f.text_architecture == "DeepseekV3ForCausalLM"
    assert (f.num_layers, f.hidden_size, f.vocab_size, f.num_attention_heads) == (61, 7168, 163840, 64)
    assert f.attention == "MLA"
    assert f.mla == {"kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                     "v_head_dim": 128}
    m = f.moe
    assert (m["num_experts"], m["num_shared_experts"], m["experts_per_token"]) == (384, 1, 8)
    assert (m["first_k_dense_replace"], m["moe_intermediate_size"], m["num_moe_layers"]) == (1, 2048, 60)
    assert f.max_position_embeddings == 262144
    assert f.rope["type"] == "yarn" and f.rope["theta"] == 50000.0 and f.rope["scaling"]["factor"] == 64.0
    assert f.quantization["bits"] == 4 and f.tie_word_embeddings is False and f.eos_token_id == 163586
    assert close(f.params_total, 1.03e12) and close(f.params_active, 32.9e9)  # "1T total, 32B active"


def test_deepseek_v3_mla_moe_mtp():
    f = facts("deepseek-v3")
    assert (f.num_layers, f.hidden_size, f.vocab_size, f.attention) == (61, 7168, 129280, "MLA")
    m = f.moe
    assert (m["num_experts"], m["num_shared_experts"], m["experts_per_token"], m["first_k_dense_replace"]) == \
        (256, 1, 8, 3)
    assert f.mtp_layers == 1 and f.params_mtp > 10e9
    assert {k: f.quantization[k] for k in ("method", "bits", "format", "local_load")} == \
        {"method": "fp8", "bits": 8, "format": "e4m3", "local_load": "dequantized"}
    assert close(f.params_total, 671e9, 0.01) and close(f.params_active, 37e9, 0.03)


def test_qwen3_dense_and_moe():
    f = facts("qwen3-8b")
    assert (f.num_layers, f.hidden_size, f.num_attention_heads, f.num_key_value_heads, f.head_dim) == \
        (36, 4096, 32, 8, 128)
    assert (f.attention, f.vocab_size, f.rope["theta"], f.moe) == ("GQA", 151936, 1e6, None)
    assert f.sliding_window is None  # use_sliding_window: false
    assert close(f.params_total, 8.19e9, 0.01)
    m = facts("qwen3-30b-a3b")
    assert (m.num_layers, m.hidden_size) == (48, 2048)
    assert (m.moe["num_experts"], m.moe["experts_per_token"], m.moe["moe_intermediate_size"]) == (128, 8, 768)
    assert m.moe["num_moe_layers"] == 48 and m.moe["num_shared_experts"] == 0
    assert close(m.params_total, 30.5e9) and close(m.params_active, 3.3e9)


def test_llama31_gemma3_gptoss_mistral_mixtral_smollm2():
    ll = facts("llama-3.1-8b")
    assert (ll.num_layers, ll.rope["type"], ll.rope["scaling"]["factor"]) == (32, "llama3", 8.0)
    assert ll.eos_token_id == [128001, 128008, 128009] and close(ll.params_total, 8.03e9, 0.01)
    g = facts("gemma-3-4b-it")
    assert (g.wrapper, g.text_model_type, g.num_layers, g.hidden_size, g.head_dim) == \
        ("text_config", "gemma3_text", 34, 2560, 256)
    assert g.sliding_window == 1024 and g.layer_types == {"sliding_attention": 29, "full_attention": 5}
    assert g.hybrid_attention and g.tie_word_embeddings and g.eos_token_id == [1, 106]
    assert g.rope["type"] == "linear" and close(g.params_total, 3.88e9)  # 4.3B minus the 0.42B vision tower
    o = facts("gpt-oss-20b")
    assert (o.num_layers, o.moe["num_experts"], o.moe["experts_per_token"]) == (24, 32, 4)
    assert o.layer_types == {"sliding_attention": 12, "full_attention": 12} and o.sliding_window == 128
    assert close(o.params_total, 20.9e9) and close(o.params_active - o.vocab_size * o.hidden_size, 3.6e9, 0.03)
    mi = facts("mistral-7b")
    assert (mi.attention, mi.sliding_window, mi.layer_types, mi.moe) == ("GQA", 4096, None, None)
    assert close(mi.params_total, 7.24e9, 0.01)
    mx = facts("mixtral-8x7b")
    assert (mx.moe["num_experts"], mx.moe["experts_per_token"]) == (8, 2)
    assert close(mx.params_total, 46.7e9, 0.01) and close(mx.params_active, 12.9e9, 0.01)
    s = facts("smollm2-135m")
    assert (s.num_layers, s.hidden_size, s.vocab_size, s.tie_word_embeddings) == (30, 576, 49152, True)
    assert s.params_total == 134_515_008  # exact: the real checkpoint's tensor sizes


def test_estimate_is_exact_on_real_tiny_models(tiny_targets):
    """The formula against the numel of real safetensors (Qwen3 q/k-norm, tied Llama, MLA + MoE)."""
    from safetensors import safe_open

    for arch, d in tiny_targets.items():
        with safe_open(str(d / "model.safetensors"), "pt") as fh:
            numel = sum(math.prod(fh.get_slice(k).get_shape()) for k in fh.keys())
        assert read_model_facts(d).params_total == numel, arch


def test_aliases_gpt2_style(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}))
    f = read_model_facts(tmp_path)
    assert (f.num_layers, f.hidden_size, f.num_attention_heads, f.attention) == (12, 768, 12, "MHA")
    assert f.max_position_embeddings == 1024 and f.intermediate_size == 3072


@pytest.mark.parametrize("layers,n,ids", [
    (64, 5, [1, 16, 31, 46, 61]), (36, 5, [1, 9, 17, 25, 33]), (61, 6, [1, 12, 24, 35, 47, 58]),
    (62, 5, [1, 16, 30, 44, 59]), (61, 5, [1, 15, 30, 44, 58])])
def test_contract_layer_ids(layers, n, ids):
    f = facts("qwen3-8b")
    f.num_layers = layers
    tok = TokenizerFacts(source="x", base_vocab_size=10, assigned_ids=set(range(10)))
    d = config_from_dict({"drafter": {"num_target_features": n}}).drafter
    c = derive_contract(d, f, tok)
    assert c.target_layer_ids == ids and c.num_target_layers == layers and c.mask_token_id == 10


def test_mla_draft_dims_and_overrides():
    f = facts("kimi-k2.6")
    tok = TokenizerFacts(source="x", base_vocab_size=163584, assigned_ids=set(range(163584)))
    c = derive_contract(config_from_dict({}).drafter, f, tok)
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (7168, 64, 8, 128)
    assert c.intermediate_size == 18432 and c.rope_scaling["factor"] == 64.0 and c.max_position_embeddings == 262144
    assert c.target_layer_ids == [1, 15, 30, 44, 58] and c.mask_token_id == 163584
    assert c.extra["layer_convention"] == "output of decoder layer id = HF hidden_states[id+1]"
    d = config_from_dict({"drafter": {"num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 64,
                                      "target_layer_ids": [2, 60]}}).drafter
    c = derive_contract(d, f, tok)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.target_layer_ids) == (32, 4, 64, [2, 60])
    with pytest.raises(UsageError, match="drafter.hidden_size=4096 differs"):
        derive_contract(config_from_dict({"drafter": {"hidden_size": 4096}}).drafter, f, tok)
    with pytest.raises(UsageError, match=r"drafter.target_layer_ids \[61\]"):
        derive_contract(config_from_dict({"drafter": {"target_layer_ids": [1, 61]}}).drafter, f, tok)


def test_cli_config_only_dir_needs_tokenizer_or_explicit_mask(tmp_path, capsys):
    shutil.copy(FIXTURES / "deepseek-v3" / "config.json", tmp_path / "config.json")
    run = tmp_path / "run"
    assert main(["probe", str(tmp_path), "--run-dir", str(run), "--json"]) == 2
    assert "drafter.mask_token_id" in last_json(capsys)["hint"] and not run.exists()
    assert main(["probe", str(tmp_path), "drafter.mask_token_id=128815", "--run-dir", str(run), "--json"]) == 0
    out = last_json(capsys)
    assert out["facts"]["moe"]["num_experts"] == 256 and out["contract"]["mask_token_id"] == 128815
    assert json.loads((run / "contract.json").read_text())["target_layer_ids"] == [1, 15, 30, 44, 58]
    assert (run / "probe" / "manifest.json").is_file() and (run / "probe" / "probe.json").is_file()
    assert main(["probe", str(tmp_path), "drafter.mask_token_id=129280", "--run-dir", str(run)]) == 2
    assert "outside the target vocab" in last_json(capsys)["error"]


@pytest.mark.parametrize("content,expect", [
    (None, "no config.json"), ("{}", "empty or not a JSON object"),
    ('{"hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10}', "no layer count"),
    ('{\n  "num_hidden_layers": 4,\n  "hidden_size": 64,\n}', "config.json:4:1: malformed JSON")])
def test_bad_input_exit_2_nothing_written(tmp_path, capsys, content, expect):
    model = tmp_path / "model"
    model.mkdir()
    if content is not None:
        (model / "config.json").write_text(content)
    run = tmp_path / "run"
    run.mkdir()
    (run / "contract.json").write_text("previous contract\n")
    assert main(["probe", str(model), "drafter.mask_token_id=1", "--run-dir", str(run)]) == 2
    out = last_json(capsys)
    assert out["exit_code"] == 2 and expect in out["error"] and str(model) in out["error"]
    assert (run / "contract.json").read_text() == "previous contract\n" and not (run / "probe").exists()


def test_missing_path_and_no_path(tmp_path, capsys):
    assert main(["probe", str(tmp_path / "nope"), "--run-dir", str(tmp_path / "r")]) == 2
    assert "no such file or directory" in last_json(capsys)["error"]
    assert main(["probe", "--run-dir", str(tmp_path / "r")]) == 2
    assert "needs model dir" in last_json(capsys)["error"]


def test_sparse_wrapped_config_uses_transformers_defaults(tmp_path):
    """The real gemma-3-4b-it text_config omits heads/kv/head_dim/vocab (class defaults)."""
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024}}))
    f = read_model_facts(tmp_path)
    assert (f.num_attention_heads, f.num_key_value_heads, f.head_dim, f.vocab_size) == (8, 4, 256, 262208)
    assert {"num_attention_heads", "vocab_size"} <= set(f.defaults_filled)
    assert f.layer_types == {"sliding_attention": 29, "full_attention": 5} and f.rope["scaling"]["factor"] == 8.0
    assert close(f.params_total, facts("gemma-3-4b-it").params_total, 0.001)
