"""The DFlash draft network (dflash-spec §1): single-device, no loss, no loop.

Usage:
    model = DFlashDraftModel(contract)                       # random init
    h = model(noise_embedding, target_hidden, position_ids)  # [b, q, H]
    logits = lm_head(h)                                      # the *target's* frozen head
    small = DFlashDraftModel(contract, draft_vocab=vocab)     # reduced draft vocab (sorted target ids)
    logits = restricted_head(lm_head, small.draft_vocab)(h)  # [b, q, V']; target id = vocab[argmax]

Structure (parameter names = the z-lab checkpoint, §2.2): `fc` + `hidden_norm` fuse the target
features once per forward into a context `c`; each of `layers.{i}` is a Qwen3 decoder layer whose
keys/values are `[k_proj(c); k_proj(x)]` / `[v_proj(c); v_proj(x)]` while the queries come from the
block `x` only; final `norm`. No embedding and no LM head of its own. A reduced draft vocabulary adds
the int64 buffer `d2t` (`model/draft_vocab.py`), `drafter.feature_scale: rms` the `feature_scale`
folded into `fc.weight` on save (`model/feature_scale.py`); both travel in checkpoints.

Attention: `attention_mask` is a dense bool `[b|1, 1, q, kv]` (SDPA), a flex `BlockMask` (GPU
training), a dict {(window, causal): mask} when layers differ (`masks.layer_masks`), or None
(inference: one block seeing all the context, in-block causal with the `causal` knob; sliding
layers masked from the positions, `masks.window_mask`). Training masks are `model/masks.py`'s.
Per-layer windows and causality: `model.layer_windows`, `model.layer_causal`. Inference keeps only
*context* K/V in a `DraftKVCache`; block K/V are never stored (§4.3).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from typing import TYPE_CHECKING, Any
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import flex_attention
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

from dflashkit.model.draft_vocab import check_draft_vocab, from_offsets, to_offsets
from dflashkit.model.masks import inference_mask, window_mask

if TYPE_CHECKING:
    from dflashkit.model.spec import DraftSpec



def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [b, heads, t, d]; cos/sin: [b, t, d] (neox layout, as Qwen3/Llama)."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


@dataclass
class DraftKVCache:
    """Per-layer context keys/values ([b, kv_heads, t, d], RoPE applied). Only committed context; a sliding layer's
    too, in full (the forward masks the keys outside its window)."""

    keys: list[torch.Tensor | None] = field(default_factory=list)
    values: list[torch.Tensor | None] = field(default_factory=list)

    @property
    def length(self) -> int:
        return 0 if not self.keys or self.keys[0] is None else self.keys[0].shape[-2]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        while len(self.keys) <= layer:
            self.keys.append(None)
            self.values.append(None)
        if self.keys[layer] is None:
            self.keys[layer], self.values[layer] = k, v
        else:
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=-2)
            self.values[layer] = torch.cat([self.values[layer], v], dim=-2)
        return self.keys[layer], self.values[layer]

    def crop(self, length: int) -> None:
        self.keys = [None if k is None else k[..., :length, :] for k in self.keys]
        self.values = [None if v is None else v[..., :length, :] for v in self.values]


def hf_config(contract: DraftSpec) -> Qwen3Config:
    cfg = contract.to_hf_config(dtype="float32")
    for k in ("architectures", "auto_map", "dflash_config", "block_size", "num_target_layers", "dtype", "is_causal"):
        cfg.pop(k, None)
    if cfg.get("rope_scaling") is None:
        cfg.pop("rope_scaling")
    config = Qwen3Config(**cfg)
    knobs = contract.knobs
    config.draft_attention = getattr(knobs, "attention_type", "gqa")
    if config.draft_attention == "mla":  # the rotary tables cover the rope part of each head only
        config.head_dim = knobs.mla_qk_rope_head_dim
        config.q_lora_rank, config.kv_lora_rank = knobs.mla_q_lora_rank, knobs.mla_kv_lora_rank
        config.qk_nope_head_dim, config.qk_rope_head_dim = knobs.mla_qk_nope_head_dim, knobs.mla_qk_rope_head_dim
        config.v_head_dim = knobs.mla_v_head_dim
    return config


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, *,
                    repeat_kv: bool | None = None) -> torch.Tensor:
    """SDPA of queries [b, heads, q, d] over grouped keys/values [b, kv_heads, t, d] under a dense bool mask.

    With a mask on CUDA the keys/values are repeated per query head (`repeat_kv`, default: mask and CUDA):
    torch's fused CUDA kernels take a mask or grouped K/V (`enable_gqa`), not both, and fall back to the math
    kernel, which materialises the [b, heads, q, kv] scores (tens of GB for a Qwen3-8B-sized drafter's batch:
    4 × 32 heads × 8192 block queries × 10240 keys); repeated K/V cost [b, heads, t, d] and let the
    memory-efficient kernel take the mask. Same result either way (query head h reads K/V head h // groups)."""
    groups = q.shape[1] // k.shape[1]
    if repeat_kv is None:
        repeat_kv = mask is not None and q.is_cuda
    if repeat_kv and groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        groups = 1
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=groups > 1)


class DFlashAttention(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.n_heads, self.n_kv, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        bias = bool(config.attention_bias)
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=bias)
        self.q_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)

    def context_kv(self, c: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of context features c [b, t, H] → [b, kv, t, d] each (keys normed + RoPE)."""
        b, t, _ = c.shape
        k = self.k_norm(self.k_proj(c).view(b, t, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(c).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, attention_mask) -> torch.Tensor:
        b, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.n_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        bk, bv = self.context_kv(x, cos, sin)  # the block's own keys/values, same projections
        k = torch.cat([ctx_k, bk], dim=-2)
        v = torch.cat([ctx_v, bv], dim=-2)
        if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
            out = flex_attention(q, k, v, block_mask=attention_mask, enable_gqa=self.n_heads != self.n_kv)
        else:
            out = block_attention(q, k, v, attention_mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs (x0, x1), (x2, x3), … each turned by one frequency (DeepSeek's layout; vLLM's
    `is_neox_style=False`): x [b, heads, t, d], cos/sin [b, t, d] as `apply_rope` takes them. The result holds
    the turned pairs de-interleaved (evens then odds); queries and keys leave alike, so their products are
    those of the interleaved rotation."""
    return apply_rope(torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1), cos, sin)


class MLAAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2/K3) in DFlash's context/block structure.

    Queries: `q_a_proj` → `q_a_layernorm` → `q_b_proj` (or one `q_proj` when `q_lora_rank` is 0), per head
    [qk_nope | qk_rope]. Keys/values of any rows (context features or the block): `kv_a_proj_with_mqa` → split
    into the compressed kv [kv_lora_rank] and one shared k_rope [qk_rope] → `kv_a_layernorm` on the compressed
    part → `kv_b_proj` → per head (k_nope [qk_nope], v [v_head_dim]); the key is [k_nope | k_rope]. RoPE turns
    only the rope dims (interleaved pairs), the softmax scale is 1/sqrt(qk_nope + qk_rope) (SDPA's default at that
    width), `o_proj` maps heads × v_head_dim back. Tensor names are the DeepSeek checkpoints' (what vLLM's
    `DeepseekV2MLAAttention` loads). The cache holds expanded per-head context keys/values, as for GQA."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        h = config.hidden_size
        self.n_heads = self.n_kv = config.num_attention_heads
        self.q_lora_rank, self.kv_lora_rank = int(config.q_lora_rank), int(config.kv_lora_rank)
        self.nope, self.rope, self.v_dim = (int(config.qk_nope_head_dim), int(config.qk_rope_head_dim),
                                            int(config.v_head_dim))
        self.head_dim = self.nope + self.rope
        bias = bool(config.attention_bias)
        if self.q_lora_rank:
            self.q_a_proj = nn.Linear(h, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = Qwen3RMSNorm(self.q_lora_rank, eps=config.rms_norm_eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.kv_lora_rank + self.rope, bias=bias)
        self.kv_a_layernorm = Qwen3RMSNorm(self.kv_lora_rank, eps=config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.n_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.v_dim, h, bias=bias)

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Block rows x [b, q, H] → queries [b, heads, q, qk_nope + qk_rope] (rope dims turned)."""
        b, n, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora_rank else self.q_proj(x)
        q_nope, q_rope = q.view(b, n, self.n_heads, self.head_dim).transpose(1, 2).split([self.nope, self.rope], -1)
        return torch.cat([q_nope, apply_rope_interleaved(q_rope, cos, sin)], dim=-1)

    def context_kv(self, c: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of rows c [b, t, H] → keys [b, heads, t, qk_nope + qk_rope], values [b, heads, t, v_head_dim]."""
        b, t, _ = c.shape
        latent, k_rope = self.kv_a_proj_with_mqa(c).split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, t, self.n_heads, self.nope + self.v_dim)
        k_nope, v = kv.transpose(1, 2).split([self.nope, self.v_dim], dim=-1)
        k_rope = apply_rope_interleaved(k_rope.view(b, 1, t, self.rope), cos, sin)
        return torch.cat([k_nope, k_rope.expand(-1, self.n_heads, -1, -1)], dim=-1), v

    def forward(self, x: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, attention_mask) -> torch.Tensor:
        b, q_len, _ = x.shape
        q = self.queries(x, cos, sin)
        bk, bv = self.context_kv(x, cos, sin)  # the block's own keys/values, same projections
        k, v = torch.cat([ctx_k, bk], dim=-2), torch.cat([ctx_v, bv], dim=-2)
        if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
            out = flex_attention(q, k, v, block_mask=attention_mask)
        else:
            out = block_attention(q, k, v, attention_mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


def draft_attention(config: Qwen3Config) -> nn.Module:
    """A draft layer's attention: MLA when the contract's `attention_type` is mla (`hf_config`), else GQA."""
    return MLAAttention(config) if getattr(config, "draft_attention", "gqa") == "mla" else DFlashAttention(config)


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.self_attn = draft_attention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, ctx_k, ctx_v, cos, sin, attention_mask, block_len: int = 0) -> torch.Tensor:
        del block_len  # DFlash layers do not mix block positions outside attention (DFlash2's do)
        x = x + self.self_attn(self.input_layernorm(x), ctx_k, ctx_v, cos, sin, attention_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(nn.Module):
    """DFlash drafter; `state_dict()` keys are exactly the z-lab checkpoint's."""

    def __init__(self, contract: DraftSpec, draft_vocab: torch.Tensor | None = None,
                 feature_scale: torch.Tensor | None = None):
        super().__init__()
        contract.check()
        # the contract as given: a DrafterContract, which the rooms above read whole (`contract.family`, its
        # formats); this room reads only what `DraftSpec` declares
        self.contract: Any = contract
        self.config = hf_config(contract)
        self.block_size = contract.block_size
        self.mask_token_id = contract.mask_token_id
        self.causal = bool(contract.knobs.causal)  # in-block attention (family/dflash.py): offsets j <= i only
        windows = getattr(contract, "layer_windows", None)  # per layer: a sliding window W, or None (full)
        self.layer_windows: list[int | None] = list(windows) if windows else [None] * contract.num_draft_layers
        causal = getattr(contract, "layer_causal", None)  # per layer in-block causality (a released mixed drafter's)
        self.layer_causal: list[bool] = list(causal) if causal else [self.causal] * contract.num_draft_layers
        self.target_layer_ids = list(contract.target_layer_ids)
        h = contract.hidden_size
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = Qwen3RMSNorm(h, eps=contract.rms_norm_eps)
        self.layers = nn.ModuleList(self.make_layer() for _ in range(contract.num_draft_layers))
        self.norm = Qwen3RMSNorm(h, eps=contract.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(self.config)
        if draft_vocab is not None:
            vocab = torch.as_tensor(draft_vocab, device="cpu")  # explicit: also under a meta default device (`plan`)
            check_draft_vocab(vocab, vocab_size=contract.vocab_size, source="draft vocabulary")
            self.register_buffer("d2t", to_offsets(vocab.long()))
        if feature_scale is not None:  # drafter.feature_scale (model/feature_scale.py): folded into fc on save
            self.register_buffer("feature_scale", torch.as_tensor(feature_scale, dtype=torch.float32).flatten())
        self.reset_parameters()

    def make_layer(self) -> nn.Module:
        """One draft decoder layer (DFlash2 wraps its sublayers in convolutions)."""
        return DFlashDecoderLayer(self.config)

    @property
    def draft_vocab(self) -> torch.Tensor | None:
        """Sorted target ids [V'] of the reduced draft vocabulary (None: the full target vocab)."""
        d2t = getattr(self, "d2t", None)
        if d2t is None:
            return None

        return from_offsets(d2t)

    @property
    def draft_vocab_size(self) -> int | None:
        d2t = getattr(self, "d2t", None)
        return None if d2t is None else int(d2t.numel())

    def reset_parameters(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, Qwen3RMSNorm):
                nn.init.ones_(m.weight)

    def fuse(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """[b, t, n_feat·H] target features → context c [b, t, H]."""
        scale = getattr(self, "feature_scale", None)
        if scale is not None:
            target_hidden = target_hidden * scale.to(target_hidden.dtype)
        return self.hidden_norm(self.fc(target_hidden))

    def forward(self, noise_embedding: torch.Tensor, target_hidden: torch.Tensor, position_ids: torch.Tensor,
                attention_mask=None, cache: DraftKVCache | None = None, block_len: int = 0) -> torch.Tensor:
        """One draft pass.

        Args:
            noise_embedding: [b, q, H] target embeddings of the block tokens ([x, MASK, ...]).
            target_hidden: [b, t, n_feat·H] features of context tokens not yet in `cache`.
            position_ids: [b, t + q] absolute positions of those context tokens then the block.
            attention_mask: None (one block; a causal drafter masks offsets j > i itself, a sliding layer its
                context outside the window), a bool [b|1, 1, q, cache_len + t + q] tensor or a flex BlockMask
                (every layer), or a dict {(window, causal): mask} (each layer its own: `masks.layer_masks`).
            cache: context K/V of earlier tokens; the new context K/V are appended to it.
            block_len: tokens per block in the q queries (0: `block_size` with a mask, else all q are one
                block); only DFlash2's convolution uses it.
        Returns:
            [b, q, H] normed hidden states; apply the target lm_head for logits.
        """
        t = target_hidden.shape[1]
        c = self.fuse(target_hidden) if t else noise_embedding.new_zeros(noise_embedding.shape[0], 0,
                                                                          noise_embedding.shape[-1])
        cos, sin = self.rotary_emb(noise_embedding, position_ids)
        cos, sin = cos.to(noise_embedding.dtype), sin.to(noise_embedding.dtype)
        ctx_cos, ctx_sin, q_cos, q_sin = cos[:, :t], sin[:, :t], cos[:, t:], sin[:, t:]
        x = noise_embedding
        block_len = block_len or (self.block_size if attention_mask is not None else x.shape[1])
        masks = attention_mask if isinstance(attention_mask, dict) else None
        if attention_mask is None:
            masks = self._decode_masks(position_ids, t, cache.length if cache is not None else 0, x.shape[1])
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.context_kv(c, ctx_cos, ctx_sin)
            if cache is not None:
                k, v = cache.append(i, k, v)
            m = masks[self.layer_windows[i], self.layer_causal[i]] if masks is not None else attention_mask
            x = layer(x, k, v, q_cos, q_sin, m, block_len=block_len)
        return self.norm(x)

    def _decode_masks(self, position_ids: torch.Tensor, t: int, past: int, q_len: int
                      ) -> dict[tuple[int | None, bool], torch.Tensor | None]:
        """{(window, causal): mask} of one block after `past` cached and `t` new context tokens: None (see
        everything) for a bidirectional full layer, else a bool [b, 1, q, past + t + q] (causal offsets, the
        window's context)."""
        dev = position_ids.device
        q_pos = position_ids[:, t:]                                                    # [b, q]
        ctx_pos = position_ids[:, :1] - past + torch.arange(past + t, device=dev)     # [b, past + t]
        out: dict[tuple[int | None, bool], torch.Tensor | None] = {}
        for w, causal in dict.fromkeys(zip(self.layer_windows, self.layer_causal)):
            ctx = window_mask(q_pos, ctx_pos, w)
            if ctx is None and not causal:
                out[w, causal] = None
                continue
            if ctx is None:
                ctx = torch.ones(q_len, past + t, dtype=torch.bool, device=dev).expand(q_pos.shape[0], -1, -1)
            block = inference_mask(ctx_len=0, q_len=q_len, device=dev) if causal else \
                torch.ones(q_len, q_len, dtype=torch.bool, device=dev)
            out[w, causal] = torch.cat([ctx, block.expand(ctx.shape[0], -1, -1)], dim=-1)[:, None]
        return out
