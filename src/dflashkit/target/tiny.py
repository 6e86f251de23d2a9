"""Tiny real targets built in code (tests, the `tiny` assets, the Kimi-architecture run).

Usage:
    make_tiny_target("/tmp/t", arch="qwen3")                  # Qwen3ForCausalLM + byte tokenizer
    make_tiny_target("/tmp/k", arch="deepseek_v3", wrapper="kimi_k25")   # MLA + MoE, nested config
    python -m dflashkit.target.tiny /tmp/t qwen3

The tokenizer is byte-level (256 byte tokens + ChatML specials) with a real ChatML chat template,
so chat rendering, loss masks, serving and decoding all run on real HF objects. The model's
`vocab_size` is larger than the tokenizer, leaving unused embedding rows for the mask token.
This module imports nothing from dflashkit (`assets` builds the tiny assets with it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_VOCAB = 320  # 256 bytes + 3 specials = 259 real tokens; rows 259..319 are unused


def make_byte_tokenizer(out_dir: str | Path):
    """A byte-level fast tokenizer with ChatML specials; saved to `out_dir` and returned."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_vocab = {tok: i for i, tok in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet(),
                                                        key=lambda c: ord(c)))}
    model = models.BPE(vocab=byte_vocab, merges=[])
    tk = Tokenizer(model)
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=None, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token=None)
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def tiny_config(arch: str = "qwen3", *, num_layers: int = 6, hidden: int = 64, seed: int = 0):
    """A transformers config for a tiny random target of the given architecture."""
    from transformers import DeepseekV3Config, LlamaConfig, Qwen3Config

    common = dict(vocab_size=TINY_VOCAB, hidden_size=hidden, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, intermediate_size=2 * hidden,
                  max_position_embeddings=2048, rms_norm_eps=1e-6, bos_token_id=None,
                  eos_token_id=258, pad_token_id=256, tie_word_embeddings=False)
    if arch == "qwen3":
        return Qwen3Config(head_dim=hidden // 4, rope_theta=10000.0, **common)
    if arch == "llama":
        return LlamaConfig(rope_theta=10000.0, **{**common, "tie_word_embeddings": True})
    if arch == "deepseek_v3":
        common.update(num_key_value_heads=4)
        return DeepseekV3Config(
            **common, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
            moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1,
            rope_theta=50000.0)
    raise ValueError(f"unknown tiny arch {arch!r}")


def make_tiny_target(out_dir: str | Path, arch: str = "qwen3", *, wrapper: str | None = None,
                     num_layers: int = 6, hidden: int = 64, seed: int = 0) -> Path:
    """Save a tiny random target (safetensors) + byte tokenizer into `out_dir`.

    `wrapper="kimi_k25"` rewrites config.json the way Kimi K2.5/K2.6 ship it: the language model
    under `text_config`, `model_type` `kimi_k25` at the top.
    """
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = tiny_config(arch, num_layers=num_layers, hidden=hidden, seed=seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    make_byte_tokenizer(out)
    if wrapper == "kimi_k25":
        inner = json.loads((out / "config.json").read_text())
        inner["model_type"] = "kimi_k2"
        wrapped = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
                   "text_config": inner, "vision_config": {"model_type": "moonvit", "hidden_size": 32},
                   "media_placeholder_token_id": 259, "tie_word_embeddings": False}
        (out / "config.json").write_text(json.dumps(wrapped, indent=2))
    return out


if __name__ == "__main__":
    make_tiny_target(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "qwen3",
                     wrapper=sys.argv[3] if len(sys.argv) > 3 else None)
    print(sys.argv[1])


