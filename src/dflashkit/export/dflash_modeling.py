"""DFlash block-diffusion draft model: the standalone modeling file dflashkit ships as `dflash.py`.

Usage (in an exported dir; needs only torch + transformers):
    from transformers import AutoModel
    drafter = AutoModel.from_pretrained("runs/x/export", trust_remote_code=True)
    h = drafter(noise_embedding, target_hidden, position_ids, past_key_values=cache, use_cache=True)
    logits = target.lm_head(h)        # the drafter has no head or embedding of its own

Inputs: `noise_embedding` [b, q, H] = target embeddings of the block `[x_start, MASK, ...]`;
`target_hidden` [b, t, n·H] = concatenated outputs of the target decoder layers
`dflash_config.target_layer_ids` for the t context tokens not yet in the cache; `position_ids`
[b, t + q] = their absolute positions followed by the block's. Block queries attend to all cached
context, the new context and the whole block (no mask). With a cache (`transformers.DynamicCache`)
only the context keys/values are stored; the block's are transient, so no crop is needed.

Weights use the z-lab names: fc, hidden_norm, layers.{i}.{self_attn,mlp,...}, norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3PreTrainedModel,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
)


def _dflash(config, key, default=None):
    extra = getattr(config, "dflash_config", None) or {}
    return extra.get(key, getattr(config, key, default))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class DFlashSelfAttention(nn.Module):
    """Queries from the block; keys/values from [context features ; block] through shared projections."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(config.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _kv(self, x, cos, sin):
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, n, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        return _rope(k, cos, sin), v

    def forward(self, x, context, cos, sin, attention_mask=None, cache=None):
        b, q_len, _ = x.shape
        t = context.shape[1]
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.heads, self.head_dim)).transpose(1, 2)
        q = _rope(q, cos[:, t:], sin[:, t:])
        ck, cv = self._kv(context, cos[:, :t], sin[:, :t])
        if cache is not None:
            ck, cv = cache.update(ck, cv, self.layer_idx)
        bk, bv = self._kv(x, cos[:, t:], sin[:, t:])
        k, v = torch.cat([ck, bk], dim=-2), torch.cat([cv, bv], dim=-2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask,
                                             enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class DFlashLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashSelfAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, context, cos, sin, attention_mask=None, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), context, cos, sin, attention_mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(Qwen3PreTrainedModel):
    """The draft network; `dflash_config` carries block_size, mask_token_id, target_layer_ids."""

    _no_split_modules = ["DFlashLayer"]
    # A reduced-vocab export also holds the vLLM draft-vocab tensors; this module drafts with the
    # target's full head (like SGLang) and does not need them.
    _keys_to_ignore_on_load_unexpected = [r"^d2t$", r"^t2d$", r"^lm_head\.weight$"]

    def __init__(self, config):
        super().__init__(config)
        n_target = _dflash(config, "num_target_layers", 0)
        self.target_layer_ids = list(_dflash(config, "target_layer_ids") or [n_target // 2])
        self.block_size = int(_dflash(config, "block_size", 16))
        self.mask_token_id = int(_dflash(config, "mask_token_id", 0))
        h = config.hidden_size
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.post_init()

    def forward(self, noise_embedding: torch.Tensor, target_hidden: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None, past_key_values=None, use_cache: bool = False,
                **_unused) -> torch.Tensor:
        """→ [b, q, H] normed block states (apply the target's lm_head for logits)."""
        context = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self.rotary_emb(noise_embedding, position_ids)
        cos, sin = cos.to(noise_embedding.dtype), sin.to(noise_embedding.dtype)
        cache = past_key_values if use_cache else None
        x = noise_embedding
        for layer in self.layers:
            x = layer(x, context, cos, sin, attention_mask, cache)
        return self.norm(x)
