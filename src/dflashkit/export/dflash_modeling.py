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
context, the new context and the whole block (no mask) — or, for a causal drafter (`is_causal: true`,
else `dflash_config.causal: true`, read in that order as vLLM and SGLang do), block offset i to the
context and offsets j <= i (neither key: causal in the sliding layers only, as vLLM reads it). A
sliding-window layer (`layer_types[i] == "sliding_attention"`, window W = `dflash_config.swa_window_size`,
else the top-level `sliding_window`, as vLLM reads them) sees, from block query i, only the last W − 1 − i
context keys (positions p − W < k for a query at p; the block follows the context). With a cache
(`transformers.DynamicCache`)
only the context keys/values are stored; the block's are transient, so no crop is needed.

An MLA drafter (`dflash_config.attention: "mla"`, or a config with DeepSeek's `kv_lora_rank`) builds its
attention from the DeepSeek-V3 keys q_lora_rank (null: one q_proj), kv_lora_rank, qk_nope_head_dim,
qk_rope_head_dim, v_head_dim, under DeepSeek's tensor names (q_a_proj, q_a_layernorm, q_b_proj,
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj); RoPE turns interleaved pairs of the rope dims.

Weights use the z-lab names: fc, hidden_norm, layers.{i}.{self_attn,mlp,...}, norm. A DFlash2 export
(`DFlash2DraftModel`, below) adds layers.{i}.{attention_conv,mlp_conv}.* and candidate_selector.*; a LiLiCorr
export (`LiLiCorrDraftModel`, below) adds the lattice head lilicorr.* (and the convolutions when it has them); a
DSpark export (`Qwen3DSparkModel`, below) adds markov_head.* and confidence_head.*.
"""

from __future__ import annotations

import copy

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


def _causal(config, layer_idx: int = 0) -> bool:
    """In-block causality of a layer: the top-level `is_causal`, else `dflash_config.causal`, else causal exactly
    in a sliding-window layer (vLLM's reading of a config that states neither)."""
    top = getattr(config, "is_causal", None)
    if top is not None:
        return bool(top)
    inner = (getattr(config, "dflash_config", None) or {}).get("causal")
    if inner is not None:
        return bool(inner)
    types = getattr(config, "layer_types", None) or []
    return layer_idx < len(types) and types[layer_idx] == "sliding_attention"


def _window(config, layer_idx: int):
    """The sliding window W of draft layer `layer_idx`, or None for a full-attention layer."""
    types = getattr(config, "layer_types", None) or []
    if layer_idx >= len(types) or types[layer_idx] != "sliding_attention":
        return None
    window = _dflash(config, "swa_window_size", None) or getattr(config, "sliding_window", None)
    if not window:
        raise ValueError(f"draft layer {layer_idx} is sliding_attention but the config has no sliding_window")
    return int(window)


def _block_mask(past: int, q_len: int, device, causal: bool = True, window=None) -> torch.Tensor:
    """[q, past + q] bool: the context keys (within the window: key c for query i iff c > past + i − W), and
    block keys j <= i for query i (causal) or the whole block."""
    ctx = torch.ones(q_len, past, dtype=torch.bool, device=device)
    if window is not None:
        q_pos = torch.arange(past, past + q_len, device=device)
        ctx = torch.arange(past, device=device)[None, :] > q_pos[:, None] - window
    block = torch.ones(q_len, q_len, dtype=torch.bool, device=device)
    return torch.cat([ctx, block.tril() if causal else block], dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class DFlashSelfAttention(nn.Module):
    """Queries from the block; keys/values from [context features ; block] through shared projections."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.causal = _causal(config, layer_idx)
        self.window = _window(config, layer_idx)
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(config.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _q(self, x, cos, sin):
        b, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, n, self.heads, self.head_dim)).transpose(1, 2)
        return _rope(q, cos, sin)

    def _kv(self, x, cos, sin):
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, n, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        return _rope(k, cos, sin), v

    def forward(self, x, context, cos, sin, attention_mask=None, cache=None):
        b, q_len, _ = x.shape
        t = context.shape[1]
        q = self._q(x, cos[:, t:], sin[:, t:])
        ck, cv = self._kv(context, cos[:, :t], sin[:, :t])
        if cache is not None:
            ck, cv = cache.update(ck, cv, self.layer_idx)
        bk, bv = self._kv(x, cos[:, t:], sin[:, t:])
        k, v = torch.cat([ck, bk], dim=-2), torch.cat([cv, bv], dim=-2)
        if attention_mask is None and (self.causal or self.window is not None):
            attention_mask = _block_mask(ck.shape[-2], q_len, x.device, self.causal, self.window)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask,
                                             enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


def _rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs (x0, x1), (x2, x3), … (DeepSeek's MLA layout), written de-interleaved."""
    return _rope(torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1), cos, sin)


def _is_mla(config) -> bool:
    return _dflash(config, "attention", "mla" if getattr(config, "kv_lora_rank", None) else "gqa") == "mla"


class DFlashMLASelfAttention(DFlashSelfAttention):
    """Multi-head latent attention (DeepSeek-V3 / Kimi names: q_a_proj, q_a_layernorm, q_b_proj or q_proj,
    kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj) in the same context/block structure: RoPE on the
    `qk_rope_head_dim` dims of each head (the key's shared by all heads), scale 1/sqrt(qk_nope + qk_rope)."""

    def __init__(self, config, layer_idx: int):
        nn.Module.__init__(self)
        self.layer_idx = layer_idx
        self.causal = _causal(config, layer_idx)
        self.window = _window(config, layer_idx)
        h, self.heads = config.hidden_size, config.num_attention_heads
        self.kv_heads = self.heads
        self.q_rank, self.kv_rank = int(config.q_lora_rank or 0), int(config.kv_lora_rank)
        self.nope, self.rope, self.v_dim = (int(config.qk_nope_head_dim), int(config.qk_rope_head_dim),
                                            int(config.v_head_dim))
        bias = bool(getattr(config, "attention_bias", False))
        if self.q_rank:
            self.q_a_proj = nn.Linear(h, self.q_rank, bias=bias)
            self.q_a_layernorm = Qwen3RMSNorm(self.q_rank, eps=config.rms_norm_eps)
            self.q_b_proj = nn.Linear(self.q_rank, self.heads * (self.nope + self.rope), bias=False)
        else:
            self.q_proj = nn.Linear(h, self.heads * (self.nope + self.rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.kv_rank + self.rope, bias=bias)
        self.kv_a_layernorm = Qwen3RMSNorm(self.kv_rank, eps=config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_rank, self.heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.heads * self.v_dim, h, bias=bias)

    def _q(self, x, cos, sin):
        b, n, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_rank else self.q_proj(x)
        q_nope, q_rope = q.view(b, n, self.heads, -1).transpose(1, 2).split([self.nope, self.rope], dim=-1)
        return torch.cat([q_nope, _rope_pairs(q_rope, cos, sin)], dim=-1)

    def _kv(self, x, cos, sin):
        b, n, _ = x.shape
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, n, self.heads, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_rope = _rope_pairs(k_rope.view(b, 1, n, self.rope), cos, sin).expand(-1, self.heads, -1, -1)
        return torch.cat([k_nope, k_rope], dim=-1), v


class DFlashLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.self_attn = (DFlashMLASelfAttention if _is_mla(config) else DFlashSelfAttention)(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, context, cos, sin, attention_mask=None, cache=None, block_len: int = 0):
        """`block_len`: DFlash2's convolutions read it; a DFlash layer does not."""
        x = x + self.self_attn(self.input_layernorm(x), context, cos, sin, attention_mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(Qwen3PreTrainedModel):
    """The draft network; `dflash_config` carries block_size, mask_token_id, target_layer_ids (and `causal`)."""

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
        rope_config = config
        if _is_mla(config):  # MLA turns the qk_rope_head_dim dims of each head only
            rope_config = copy.copy(config)
            rope_config.head_dim = int(config.qk_rope_head_dim)
        self.rotary_emb = Qwen3RotaryEmbedding(rope_config)
        self.post_init()

    def forward(self, noise_embedding: torch.Tensor, target_hidden: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None, past_key_values=None, use_cache: bool = False,
                **_unused) -> torch.Tensor:
        """→ [b, q, H] normed block states (apply the target's lm_head for logits); the q block tokens are one
        block (DFlash2's convolutions, where a subclass's layers have them, read its length)."""
        context = self.hidden_norm(self.fc(target_hidden))
        scale = getattr(self, "input_embedding_scale", 1.0)
        x = noise_embedding * scale if scale != 1.0 else noise_embedding
        cos, sin = self.rotary_emb(x, position_ids)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        cache = past_key_values if use_cache else None
        for layer in self.layers:
            x = layer(x, context, cos, sin, attention_mask, cache, block_len=x.shape[1])
        return self.norm(x)


# DFlash2 (`architectures: ["DFlash2DraftModel"]`): every layer's attention and MLP wrapped in a
# block-local grouped dynamic convolution, plus the candidate selector's parameters.


class DFlash2GroupedConv(nn.Module):
    """`attention_conv` / `mlp_conv`: y_t = Σ_{j ≤ pos(t)} (base[side, j] + δ_t[side, j, group]) · x_{t−j}."""

    def __init__(self, hidden_size: int, taps: int, group_size: int):
        super().__init__()
        self.taps, self.groups = taps, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)

    def deltas(self, u: torch.Tensor) -> torch.Tensor:
        """[b, T, H] normed sublayer input → [b, T, 2 sides, taps, groups]."""
        return self.kernel_projection(u).unflatten(-1, (2, self.taps, self.groups))

    def convolve(self, x: torch.Tensor, delta: torch.Tensor, side: int, block_len: int) -> torch.Tensor:
        t = x.shape[1]
        xg = x.unflatten(-1, (self.groups, -1))                                    # [b, T, G, gs]
        pos = (torch.arange(t, device=x.device) % block_len).view(1, t, 1, 1)
        out = torch.zeros_like(xg)
        for j in range(self.taps):  # tap j reads j positions back, never across the block's start
            coef = self.base_kernel[side, j].to(x.dtype).view(self.groups, -1) + delta[:, :, side, j, :, None]
            out = out + torch.where(pos >= j, coef * torch.roll(xg, j, dims=1), torch.zeros_like(xg))
        return out.flatten(-2)


class DFlash2Layer(DFlashLayer):
    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        taps, group = int(_dflash(config, "conv_kernel_size", 2)), int(_dflash(config, "conv_group_size", 16))
        self.attention_conv = DFlash2GroupedConv(config.hidden_size, taps, group)
        self.mlp_conv = DFlash2GroupedConv(config.hidden_size, taps, group)

    def forward(self, x, context, cos, sin, attention_mask=None, cache=None, block_len: int = 0):
        n = block_len or x.shape[1]
        u = self.input_layernorm(x)
        d = self.attention_conv.deltas(u)
        a = self.self_attn(self.attention_conv.convolve(u, d, 0, n), context, cos, sin, attention_mask, cache)
        x = x + self.attention_conv.convolve(a, d, 1, n)
        u = self.post_attention_layernorm(x)
        d = self.mlp_conv.deltas(u)
        return x + self.mlp_conv.convolve(self.mlp(self.mlp_conv.convolve(u, d, 0, n)), d, 1, n)


class DFlash2CandidateSelector(nn.Module):
    """Edge score of candidate b after token a at a position with drafter output h: U(b) + ⟨P[a] ⊙ W·h, S[b]⟩."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int):
        super().__init__()
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def forward(self, prev_ids: torch.Tensor, cand_ids: torch.Tensor, unary: torch.Tensor,
                hidden: torch.Tensor) -> torch.Tensor:
        """prev_ids [..., P], cand_ids / unary [..., C], hidden [..., H] → scores [..., P, C]."""
        w = self.hidden_projection(hidden).unsqueeze(-2)
        return unary.unsqueeze(-2) + (self.predecessor_codebook[prev_ids] * w) @ self.successor_codebook[cand_ids].transpose(-1, -2)


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash2: the DFlash draft network with convolution-wrapped layers and a candidate selector.

    `forward` returns the block's hidden states as DFlash's does; drafting (the top-K of the target
    head's logits × output_multiplier, soft-capped, and the walk over `candidate_selector`'s scores)
    is the engine's (vLLM's DFlash2 speculator) or dflashkit's.
    """

    _no_split_modules = ["DFlash2Layer"]

    def __init__(self, config):
        super().__init__(config)
        self.layers = nn.ModuleList(DFlash2Layer(config, i) for i in range(config.num_hidden_layers))
        self.candidate_selector = DFlash2CandidateSelector(config.hidden_size, config.vocab_size,
                                                           int(_dflash(config, "selector_rank", 256)))
        self.input_embedding_scale = float(_dflash(config, "input_embedding_scale", None) or 1.0)
        self.post_init()


# LiLiCorr (`architectures: ["LiLiCorrDraftModel"]`): the DFlash network (with DFlash2's convolutions when
# dflash_config sets conv_kernel_size and conv_group_size) plus the lattice head `lilicorr.*` over each block
# position's top-K candidates.


class LiLiCorrMLP(nn.Module):
    def __init__(self, width: int, inner: int, out: int):
        super().__init__()
        self.up_proj, self.down_proj = nn.Linear(width, inner), nn.Linear(inner, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.up_proj(x)))


class LiLiCorrAttention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.in_proj_weight = nn.Parameter(torch.zeros(3 * width, width))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * width))
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, n, w = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2)
                   for t in F.linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1))
        return self.out_proj(F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).reshape(b, n, w))


class LiLiCorrLayer(nn.Module):
    def __init__(self, width: int, heads: int, ratio: float, eps: float):
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(width, eps=eps), nn.RMSNorm(width, eps=eps)
        self.attn, self.mlp = LiLiCorrAttention(width, heads), LiLiCorrMLP(width, int(width * ratio), width)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), bias)
        return x + self.mlp(self.mlp_norm(x))


class LiLiCorrLattice(nn.Module):
    """`lilicorr`: scores [b, n, K, K] of the walk from the candidates' target embeddings [b, n, K, H], their
    draft log-probs [b, n, K], the drafter's outputs at the n positions [b, n, H] and the anchor
    hidden_norm(fc(features of the token before the block)) [b, H] (`valid` [b]: there is one)."""

    def __init__(self, config):
        super().__init__()
        big, block = config.hidden_size, int(_dflash(config, "block_size", 16))
        w = int(_dflash(config, "lilicorr_hidden_size", 0)) or big
        heads, k, f = (int(_dflash(config, name)) for name in ("lilicorr_num_heads", "lilicorr_candidate_topk",
                                                                "lilicorr_factor_dim"))
        self.block_size, self.k, self.w = block, k, w
        self.eps, self.scale = float(_dflash(config, "lilicorr_vector_eps")), float(_dflash(config, "lilicorr_logit_scale"))
        self.token_proj = nn.Identity() if w == big else nn.Linear(big, w)
        self.pass_hidden_proj, self.context_proj = nn.Linear(big, w), nn.Linear(big, w)
        self.feature_norm, self.feature_mlp = nn.LayerNorm(5), LiLiCorrMLP(5, w, w)
        self.slot_embedding = nn.Parameter(torch.zeros(1, 1, block - 1, 1, w))
        self.rank_embedding = nn.Parameter(torch.zeros(1, 1, 1, k, w))
        self.relative_slot_bias = nn.Parameter(torch.zeros(heads, 2 * block - 1))
        self.same_slot_bias = nn.Parameter(torch.zeros(heads))
        self.layers = nn.ModuleList(LiLiCorrLayer(w, heads, float(_dflash(config, "lilicorr_mlp_ratio")),
                                                  config.rms_norm_eps)
                                    for _ in range(int(_dflash(config, "lilicorr_num_layers"))))
        self.output_norm, self.anchor_norm = nn.RMSNorm(w, eps=config.rms_norm_eps), nn.RMSNorm(w, eps=config.rms_norm_eps)
        self.factor_input_proj = nn.Linear(3 * w, w)
        self.out_head, self.in_head, self.anchor_out_head = nn.Linear(w, f), nn.Linear(w, f), nn.Linear(w, f)

    def forward(self, embeds, log_probs, hidden, anchor, valid) -> torch.Tensor:
        b, n, k = log_probs.shape
        lp = log_probs.float()
        rank = torch.arange(k, device=lp.device, dtype=torch.float32) / max(k - 1, 1)
        feats = torch.stack([lp, lp.exp(), lp - lp.max(-1, keepdim=True).values, rank.expand_as(lp),
                             (torch.arange(k, device=lp.device) == 0).float().expand_as(lp)], dim=-1)
        dt = self.slot_embedding.dtype  # the head's own dtype: the target's embeddings may arrive in another
        embeds, hidden, anchor = embeds.to(dt), hidden.to(dt), anchor.to(dt)
        x = self.token_proj(embeds) + self.pass_hidden_proj(hidden).unsqueeze(-2)
        x = x + self.feature_mlp(self.feature_norm(feats.to(x.dtype))) + self.slot_embedding[:, 0, :n] + self.rank_embedding[:, 0]
        slot = torch.arange(n, device=x.device).repeat_interleave(k)
        rel = slot[:, None] - slot[None, :]
        bias = self.relative_slot_bias[:, rel + self.block_size - 1] + (rel == 0).to(x.dtype) * self.same_slot_bias[:, None, None]
        x = x.reshape(b, n * k, self.w)
        for layer in self.layers:
            x = layer(x, bias[None])
        x = self.output_norm(x).view(b, n, k, self.w)
        a = self.anchor_norm(self.context_proj(anchor) * valid[:, None].to(x.dtype))
        row = a[:, None, None, :].expand_as(x)
        u = F.silu(self.factor_input_proj(torch.cat([x, row, x * row], dim=-1)))
        out_v, in_v = (F.normalize(h(u), dim=-1, eps=self.eps) for h in (self.out_head, self.in_head))
        start = (F.normalize(self.anchor_out_head(a), dim=-1, eps=self.eps)[:, None, :] * in_v[:, 0]).sum(-1)
        pairs = out_v[:, :-1] @ in_v[:, 1:].transpose(-1, -2)
        return self.scale * torch.cat([start[:, None, None, :].expand(-1, 1, k, -1), pairs], dim=1).float()


class LiLiCorrDraftModel(DFlashDraftModel):
    """LiLiCorr: `forward` returns the block's hidden states as DFlash's does; `lilicorr` scores the lattice of
    the top-K candidates (of the target head's log-softmax) that the walk (the engine's, or dflashkit's) follows."""

    _no_split_modules = ["DFlashLayer", "DFlash2Layer"]

    def __init__(self, config):
        super().__init__(config)
        if int(_dflash(config, "conv_kernel_size", 0) or 0) and int(_dflash(config, "conv_group_size", 0) or 0):
            self.layers = nn.ModuleList(DFlash2Layer(config, i) for i in range(config.num_hidden_layers))
        self.lilicorr = LiLiCorrLattice(config)
        self.post_init()


# DSpark (`architectures: ["Qwen3DSparkModel"]`, vLLM's name): the DFlash network plus a Markov head (the previous
# token's rank-r embedding `markov_head.markov_w1` [V, r], projected by `markov_head.markov_w2` [V', r] to a bias on
# the head's logits) and, with `enable_confidence_head`, `confidence_head.proj` (the acceptance estimate).


class DSparkMarkovHead(nn.Module):
    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)


class DSparkConfidenceHead(nn.Module):
    def __init__(self, input_dim: int, with_markov: bool):
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(input_dim, 1, bias=True)


class Qwen3DSparkModel(DFlashDraftModel):
    """DSpark: `forward` returns the block's hidden states as DFlash's does (block position j predicts the token at
    j: `sample_from_anchor: false`). Drafting walks the positions left to right: position t's logits are the head's
    plus `markov_logits`' bias of the token before it (the anchor for t = 1, then the drafted tokens)."""

    _no_split_modules = ["DFlashLayer"]

    def __init__(self, config):
        super().__init__(config)
        rank = int(config.markov_rank)
        self.markov_head = DSparkMarkovHead(config.vocab_size, int(getattr(config, "draft_vocab_size", None)
                                                                   or config.vocab_size), rank)
        self.confidence_head = None
        if getattr(config, "enable_confidence_head", False):
            with_markov = bool(getattr(config, "confidence_head_with_markov", False))
            self.confidence_head = DSparkConfidenceHead(config.hidden_size + (rank if with_markov else 0), with_markov)
        self.post_init()

    def markov_logits(self, base_logits: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """base_logits [..., V'] + the Markov bias of prev_ids [...] (the token before each position)."""
        return base_logits + self.markov_head.markov_w2(self.markov_head.markov_w1(prev_ids)).to(base_logits.dtype)

    def confidence(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """[..., H], [...] → [...] the estimated probability that each drafted position is accepted."""
        head = self.confidence_head
        if head is None:
            raise ValueError("this DSpark checkpoint has no confidence head (enable_confidence_head is false)")
        x = hidden
        if head.with_markov:
            x = torch.cat([hidden, self.markov_head.markov_w1(prev_ids).to(hidden.dtype)], dim=-1)
        return torch.sigmoid(head.proj(x.to(head.proj.weight.dtype)).float()).squeeze(-1)
