"""Model and tokenizer facts from a GGUF file's metadata header (the `gguf` package).

Usage:
    facts, tok_meta = read_gguf_facts(Path("SmolLM2-135M-Instruct.Q4_1.gguf"))
    facts.num_layers, tok_meta["tokens"][:3], tok_meta["chat_template"]

The `{arch}.*` keys are mapped onto config.json names and then go through the same
`facts_from_config` as a HF dir, so every fact (MLA, MoE, RoPE, parameter estimate) is derived
one way. Only metadata is read (the file is memory-mapped; tensor data is never touched).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from dflashkit.errors import UsageError
from dflashkit.inspect.config_facts import ModelFacts, facts_from_config

# GGUF `{arch}.` key suffix -> config.json key
ARCH_KEYS = {
    "block_count": "num_hidden_layers", "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
    "feed_forward_length": "intermediate_size", "context_length": "max_position_embeddings",
    "rope.freq_base": "rope_theta", "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
    "expert_shared_count": "n_shared_experts", "expert_feed_forward_length": "moe_intermediate_size",
    "leading_dense_block_count": "first_k_dense_replace", "attention.kv_lora_rank": "kv_lora_rank",
    "attention.q_lora_rank": "q_lora_rank", "nextn_predict_layers": "num_nextn_predict_layers",
    "attention.sliding_window": "sliding_window", "vocab_size": "vocab_size",
}
# GGUF architecture names that differ from the HF model_type
ARCH_MODEL_TYPE = {"deepseek2": "deepseek_v3", "qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe",
                   "gemma3": "gemma3_text", "gpt-oss": "gpt_oss"}
UNUSED_TOKEN_TYPE = 5  # gguf.TokenType.UNUSED


def _fields(path: Path) -> tuple[dict[str, Any], list[str]]:
    if importlib.util.find_spec("gguf") is None:
        raise UsageError(f"{path}: reading a .gguf file needs the `gguf` package",
                         hint="pip install gguf   (or: pip install 'dflashkit[gguf]')")
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path), "r")
    except Exception as e:  # noqa: BLE001 - any parse failure is a bad input file
        raise UsageError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})",
                         hint="check the download (size, checksum) or convert the model again") from None
    values = {}
    for name, fld in reader.fields.items():
        try:
            values[name] = fld.contents()
        except Exception:  # noqa: BLE001 - a field we cannot decode is simply not a fact
            continue
    return values, [t.name for t in reader.tensors]


def read_gguf_facts(path: Path) -> tuple[ModelFacts, dict[str, Any]]:
    """(facts, tokenizer metadata) for one .gguf file. UsageError (exit 2) on a bad file."""
    if not path.is_file():
        raise UsageError(f"{path}: no such GGUF file")
    meta, tensors = _fields(path)
    arch = meta.get("general.architecture")
    if not arch:
        raise UsageError(f"{path}: GGUF metadata has no general.architecture")
    cfg: dict[str, Any] = {"model_type": ARCH_MODEL_TYPE.get(arch, arch), "architectures": [f"gguf:{arch}"]}
    for suffix, key in ARCH_KEYS.items():
        if f"{arch}.{suffix}" in meta:
            cfg[key] = meta[f"{arch}.{suffix}"]
    key_len = meta.get(f"{arch}.attention.key_length_mla") or meta.get(f"{arch}.attention.key_length")
    val_len = meta.get(f"{arch}.attention.value_length_mla") or meta.get(f"{arch}.attention.value_length")
    rope_dim = meta.get(f"{arch}.rope.dimension_count")
    if cfg.get("kv_lora_rank"):
        cfg["qk_rope_head_dim"] = rope_dim
        cfg["qk_nope_head_dim"] = (key_len - rope_dim) if key_len and rope_dim else None
        cfg["v_head_dim"] = val_len
    elif key_len:
        cfg["head_dim"] = key_len
    for k in ("num_attention_heads", "num_key_value_heads"):  # per-layer arrays in some files
        if isinstance(cfg.get(k), list):
            cfg[k] = max(cfg[k])
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling and scaling != "none":
        cfg["rope_scaling"] = {"rope_type": scaling, "factor": meta.get(f"{arch}.rope.scaling.factor"),
                               "original_max_position_embeddings":
                                   meta.get(f"{arch}.rope.scaling.original_context_length")}
    tokens = meta.get("tokenizer.ggml.tokens") or []
    cfg.setdefault("vocab_size", len(tokens) or None)
    cfg["tie_word_embeddings"] = "output.weight" not in tensors
    for ours, theirs in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                         ("pad_token_id", "padding_token_id")):
        if f"tokenizer.ggml.{theirs}" in meta:
            cfg[ours] = int(meta[f"tokenizer.ggml.{theirs}"])
    ftype = meta.get("general.file_type")
    if ftype is not None:
        try:
            from gguf import LlamaFileType

            cfg["dtype"] = LlamaFileType(int(ftype)).name.removeprefix("MOSTLY_").lower()
        except ValueError:
            cfg["dtype"] = f"file_type {ftype}"
    facts = facts_from_config(cfg, source=str(path), fmt="gguf")
    tok = {
        "model": meta.get("tokenizer.ggml.model"), "tokens": list(tokens),
        "types": list(meta.get("tokenizer.ggml.token_type") or []),
        "chat_template": meta.get("tokenizer.chat_template"),
        "bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg.get("eos_token_id"),
        "pad_token_id": cfg.get("pad_token_id"),
    }
    return facts, tok
