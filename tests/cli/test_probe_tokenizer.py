"""probe with real tokenizers: mask-row rules, real loads, one-line diagnoses, GGUF headers."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import pytest

from dflashkit.assets import asset_path
from dflashkit.cli import main
from dflashkit.inspect.tokenizer_facts import is_installed, read_tokenizer_facts

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "configs"

# Kimi K2.x ships a tiktoken rank file (163,584 ranks) + custom `tokenization_kimi.py`; its named
# specials sit at 163584.. and the rest of the 256 special ids are unnamed reserved rows.
KIMI_SPECIALS = {163584: "[BOS]", 163585: "[EOS]", 163586: "<|im_end|>", 163587: "<|im_user|>",
                 163588: "<|im_assistant|>", 163590: "<|start_header_id|>", 163591: "<|end_header_id|>",
                 163593: "[EOT]", 163594: "<|im_system|>", 163595: "<|tool_calls_section_begin|>",
                 163596: "<|tool_calls_section_end|>", 163597: "<|tool_call_begin|>",
                 163598: "<|tool_call_argument_begin|>", 163599: "<|tool_call_end|>", 163601: "<|im_middle|>",
                 163606: "<think>", 163607: "</think>", 163838: "[UNK]", 163839: "[PAD]"}
KIMI_TEMPLATE = ("{%- for m in messages -%}<|im_{{ m.role }}|>{{ m.role }}<|im_middle|>{{ m.content }}<|im_end|>"
                 "{%- endfor -%}{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}")


def last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def with_tokenizer(tmp_path: Path, fixture: str, tokenizer_asset: str) -> Path:
    d = tmp_path / fixture
    d.mkdir()
    shutil.copy(FIXTURES / fixture / "config.json", d / "config.json")
    for f in asset_path(tokenizer_asset).iterdir():
        shutil.copy(f, d / f.name)
    return d


def test_qwen3_8b_real_tokenizer_mask_151669(tmp_path, capsys):
    d = with_tokenizer(tmp_path, "qwen3-8b", "tokenizer-qwen3")
    run = tmp_path / "run"
    assert main(["probe", str(d), "--run-dir", str(run), "--json"]) == 0
    out = last_json(capsys)
    tok = out["tokenizer"]
    assert tok["loaded"]["ok"] is True and tok["loaded"]["len"] == 151669 and tok["size"] == 151669
    assert tok["special_tokens"]["eos"] == "<|im_end|>" and tok["chat_template_source"] == "tokenizer_config.json"
    c = json.loads((run / "contract.json").read_text())
    assert c["mask_token_id"] == 151669 and "first unused embedding row" in c["mask_token_reason"]
    assert c["target_layer_ids"] == [1, 9, 17, 25, 33] and c["vocab_size"] == 151936
    assert (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (4096, 32, 8, 128)
    assert out["contract"] == c and json.loads((run / "probe" / "probe.json").read_text())["contract"] == c


def test_llama31_reserved_special_token(tmp_path, capsys):
    d = with_tokenizer(tmp_path, "llama-3.1-8b", "tokenizer-llama3")
    assert main(["probe", str(d), "--run-dir", str(tmp_path / "run"), "--json", "--dry-run"]) == 0
    out = last_json(capsys)
    assert out["contract"]["mask_token_id"] == 128002
    assert "<|reserved_special_token_0|>" in out["contract"]["mask_token_reason"]
    assert out["dry_run"] is True and not (tmp_path / "run").exists()


def make_kimi_dir(tmp_path: Path) -> Path:
    d = tmp_path / "kimi"
    d.mkdir()
    shutil.copy(FIXTURES / "kimi-k2.6" / "config.json", d / "config.json")
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": True} for i, t in KIMI_SPECIALS.items()}
    (d / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": added, "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "tokenizer_class": "TikTokenTokenizer", "model_max_length": 1048576, "chat_template": KIMI_TEMPLATE}))
    (d / "tokenization_kimi.py").write_text(
        "import os\nimport tiktoken\nfrom tiktoken.load import load_tiktoken_bpe\n"
        "from transformers.tokenization_utils import PreTrainedTokenizer\n\n"
        "class TikTokenTokenizer(PreTrainedTokenizer):\n    pass\n")
    with open(d / "tiktoken.model", "w") as fh:  # "base64(token bytes) rank" per line
        fh.writelines(f"{base64.b64encode(i.to_bytes(3, 'big')).decode()} {i}\n" for i in range(163584))
    return d


@pytest.mark.skipif(is_installed("tiktoken"), reason="the diagnosis needs an env without tiktoken")
def test_kimi_tokenizer_needs_tiktoken_diagnosis(tmp_path, capsys):
    d = make_kimi_dir(tmp_path)
    tok = read_tokenizer_facts(d)
    assert tok.backend == "tiktoken" and tok.base_vocab_size == 163584 and tok.needs_remote_code
    assert "tiktoken" in tok.required_packages and tok.custom_code == ["tokenization_kimi.py"]
    for extra in ([], ["target.trust_remote_code=true"]):
        assert main(["probe", str(d), *extra, "--run-dir", str(tmp_path / "run"), "--json"]) == 0
        out = last_json(capsys)
        loaded = out["tokenizer"]["loaded"]
        assert loaded["ok"] is False and "`tiktoken`" in loaded["diagnosis"] and "\n" not in loaded["diagnosis"]
        assert "pip install tiktoken" in loaded["fix"]
        assert ("target.trust_remote_code=true" in loaded["fix"]) == (not extra)
    c = out["contract"]
    # files only: ranks 0..163583 + the named specials; the first unnamed row is the mask
    assert c["mask_token_id"] == 163589 and c["mask_token_id"] not in KIMI_SPECIALS
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["hidden_size"]) == (64, 8, 128, 7168)
    assert out["facts"]["wrapper"] == "text_config" and c["eos_token_id"] == 163586


def test_smollm2_real_dir(smollm2_dir, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["probe", "smollm2-135m-instruct", "--run-dir", str(run), "--json"]) == 2
    out = last_json(capsys)
    assert "drafter.mask_token_id" in out["hint"] and "<empty_output>=16" in out["hint"] and not run.exists()
    assert main(["probe", str(smollm2_dir), "drafter.mask_token_id=16", "--run-dir", str(run)]) == 0
    out = last_json(capsys)
    f, tok, c = out["facts"], out["tokenizer"], out["contract"]
    assert (f["num_layers"], f["hidden_size"], f["vocab_size"], f["tie_word_embeddings"]) == (30, 576, 49152, True)
    assert tok["loaded"]["ok"] is True and tok["chat_template_source"] == "chat_template.jinja"
    assert tok["size"] == 49152 and tok["special_tokens"]["eos"] == "<|im_end|>"
    assert c["mask_token_id"] == 16 and c["target_layer_ids"] == [1, 8, 14, 20, 27] and c["tie_word_embeddings"]
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (9, 3, 64)
    assert c["rope_theta"] == 100000.0


def test_tiny_targets_and_kimi_wrapper(tiny_targets, tmp_path, capsys):
    from dflashkit.target.tiny import make_tiny_target

    assert main(["probe", str(tiny_targets["qwen3"]), "--run-dir", str(tmp_path / "q"), "--json"]) == 0
    c = last_json(capsys)["contract"]
    assert c["mask_token_id"] == 259 and c["vocab_size"] == 320 and c["target_layer_ids"] == [1, 2, 2, 2, 3]
    k = make_tiny_target(tmp_path / "k", "deepseek_v3", wrapper="kimi_k25")
    assert main(["probe", str(k), "drafter.num_target_features=3", "--run-dir", str(tmp_path / "kr"), "--json"]) == 0
    out = last_json(capsys)
    assert out["facts"]["model_type"] == "kimi_k25" and out["facts"]["attention"] == "MLA"
    assert out["contract"]["mask_token_id"] == 259 and out["contract"]["target_layer_ids"] == [1, 2, 3]


def write_gguf(path: Path) -> None:
    import numpy as np
    from gguf import GGUFWriter, TokenType

    tokens = [f"t{i}" for i in range(300)]
    types = [int(TokenType.CONTROL) if i < 3 else int(TokenType.UNUSED) if i >= 290 else int(TokenType.NORMAL)
             for i in range(300)]
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(8)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_feed_forward_length(128)
    w.add_context_length(2048)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}")
    w.add_tensor("token_embd.weight", np.zeros((300, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_header_facts_and_unused_rows(tmp_path, capsys):
    g = tmp_path / "m.gguf"
    write_gguf(g)
    assert main(["probe", str(g), "--run-dir", str(tmp_path / "run"), "--json"]) == 0
    out = last_json(capsys)
    f, c = out["facts"], out["contract"]
    assert f["format"] == "gguf" and (f["num_layers"], f["hidden_size"], f["num_key_value_heads"]) == (8, 64, 2)
    assert f["vocab_size"] == 300 and f["tie_word_embeddings"] is True and f["rope"]["theta"] == 500000.0
    assert c["mask_token_id"] == 290 and c["eos_token_id"] == 2
    assert out["tokenizer"]["chat_template_source"] == "gguf"
    assert out["tokenizer"]["loaded"]["ok"] is not None  # attempted; a failure is a one-line diagnosis
    assert main(["plan", str(g), "1x8", "--run-dir", str(tmp_path / "run"), "--json"]) == 0
    assert last_json(capsys)["plan"]["target"]["weights_bytes"] == g.stat().st_size
    (tmp_path / "bad.gguf").write_bytes(b"GGUF\x03\x00garbage")
    assert main(["probe", str(tmp_path / "bad.gguf"), "--run-dir", str(tmp_path / "run2")]) == 2
    assert "bad.gguf" in last_json(capsys)["error"]


def test_sentencepiece_without_tokenizer_json_diagnosed(tmp_path, capsys):
    d = tmp_path / "sp"
    d.mkdir()
    shutil.copy(FIXTURES / "mistral-7b" / "config.json", d / "config.json")
    (d / "tokenizer.model").write_bytes(b"not a sentencepiece model")
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer", "eos_token": "</s>"}))
    tok = read_tokenizer_facts(d)
    assert tok.backend == "sentencepiece" and {"sentencepiece", "protobuf"} <= set(tok.required_packages)
    assert main(["probe", str(d), "drafter.mask_token_id=0", "--run-dir", str(tmp_path / "r"), "--json"]) == 0
    loaded = last_json(capsys)["tokenizer"]["loaded"]
    assert loaded["ok"] is False and loaded["diagnosis"].startswith("tokenizer cannot load")
    assert "\n" not in loaded["diagnosis"] and loaded["fix"]
