"""Tiny hybrid targets built in code from transformers' own configs: linear-attention and Mamba layers beside
full attention (tests, and a target dir for `dflashkit run` on a hybrid).

Usage:
    make_tiny_hybrid_target("/tmp/h", "qwen3_next")      # Qwen3NextForCausalLM + byte tokenizer
    hybrid_config("bamba", vocab=8, hidden=32)            # the config only
    python -m tests.harness.hybrid /tmp/h qwen3_next      # from the repo root

Architectures (4 decoder layers, hidden 64 by default, run on CPU with transformers' reference kernels):
  qwen3_next   3 Gated DeltaNet (linear_attention) + 1 full attention, sparse MoE MLPs
  qwen3_5      Qwen3.5's text model: 3 Gated DeltaNet + 1 full attention, dense MLPs
  bamba        3 Mamba-2 + 1 full attention
  nemotron_h   Mamba-2, MLP, Mamba-2, attention blocks (an MLP block keeps no cache)
  falcon_h1    every layer runs attention and Mamba-2 side by side (transformers' "hybrid" layer type)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from dflashkit.target.tiny import TINY_VOCAB, make_byte_tokenizer

HYBRID_ARCHS = ("qwen3_next", "qwen3_5", "bamba", "nemotron_h", "falcon_h1")


def hybrid_config(arch: str = "qwen3_next", *, vocab: int = TINY_VOCAB, hidden: int = 64) -> Any:
    """A transformers config for a tiny random hybrid target (see the module doc)."""
    from transformers import BambaConfig, FalconH1Config, NemotronHConfig, Qwen3NextConfig
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    common: dict[str, Any] = dict(vocab_size=vocab, hidden_size=hidden, max_position_embeddings=2048,
                                  rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=min(258, vocab - 1),
                                  pad_token_id=min(256, vocab - 1), tie_word_embeddings=False)
    heads = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, intermediate_size=2 * hidden)
    mamba = dict(mamba_n_heads=4, mamba_d_head=hidden // 2, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4,
                 mamba_expand=2, mamba_chunk_size=16)
    gdn = dict(linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
               linear_num_value_heads=4, num_hidden_layers=4,
               layer_types=["linear_attention"] * 3 + ["full_attention"])
    if arch == "qwen3_next":
        return Qwen3NextConfig(**common, **heads, **gdn, num_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=hidden // 2, shared_expert_intermediate_size=hidden // 2)
    if arch == "qwen3_5":
        return Qwen3_5TextConfig(**common, **heads, **gdn)
    if arch == "bamba":
        return BambaConfig(**common, **{k: v for k, v in heads.items() if k != "head_dim"}, **mamba,
                           num_hidden_layers=4, attn_layer_indices=[3])
    if arch == "nemotron_h":
        common["layer_norm_epsilon"] = common.pop("rms_norm_eps")  # Nemotron-H's own key
        return NemotronHConfig(**common, **heads, layers_block_type=["mamba", "mlp", "mamba", "attention"],
                               ssm_state_size=16, mamba_num_heads=4, mamba_head_dim=hidden // 2, n_groups=1,
                               conv_kernel=4, expand=2, chunk_size=16)
    if arch == "falcon_h1":
        return FalconH1Config(**common, **heads, **mamba, num_hidden_layers=3, mamba_d_ssm=2 * hidden)
    raise ValueError(f"unknown tiny hybrid arch {arch!r} (one of {', '.join(HYBRID_ARCHS)})")


def make_tiny_hybrid_target(out_dir: str | Path, arch: str = "qwen3_next", *, seed: int = 0) -> Path:
    """Save a tiny random hybrid target (safetensors) + the byte tokenizer of `target.tiny` into `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hybrid_config(arch), dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    make_byte_tokenizer(out)
    return out


if __name__ == "__main__":
    make_tiny_hybrid_target(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "qwen3_next")
    print(sys.argv[1])
