"""Linear layers with weights pre-packed for oneDNN: a CPU decode step over a few tokens at the memory floor.

Usage:
    ok, why = packable(target.device, target.dtype)
    n = pack_linears(target.model)          # every nn.Linear → PackedLinear, in place (inference only)
    info = prepare_for_decode(target, "auto")  # both, logged: {"packed": 211, "reason": "float32 on the CPU: …"}

A decode step multiplies a handful of rows (1 … B tokens) by every weight matrix. torch's default CPU path
for `F.linear` with 2–8 rows reads the weights in a layout its small-M kernels stream poorly, so a step over 4
tokens costs well above a one-token step; oneDNN's linear over a weight reordered once into its blocked
layout (`torch.ops.mkldnn._reorder_linear_weight`, what inductor's CPU freezing does) reads each weight once
at about the memory bandwidth for any M up to a few dozen, so t(n) ≈ t(1) for n ≤ B (docs/architecture.md,
"The decode step on a CPU", has the measurements). The products are the same up to float rounding (a different summation order); the
baseline and the speculative decoder run the same packed layers, so greedy output is compared like for like.

Invariants: inference only (a packed layer has no gradient; `weight` stays readable: the head's is shared with
a tied embedding, so it is kept, while other layers drop their unpacked copy to keep memory at ~1×); CPU only,
float32, or bfloat16 where the CPU computes it natively; a layer whose input is on another device or dtype
falls back to `F.linear` on its kept weight (the lm_head) or raises (others).

Grouped-KV attention (`use_grouped_attention`): transformers' SDPA path copies every layer's cached keys and values
`num_key_value_groups` times (`repeat_kv`) whenever the step carries a mask, i.e. for every verify over 2+ tokens,
while a one-token step attends to the grouped heads directly. At 1k tokens of context on SmolLM2-135M (3 KV heads
for 9 query heads) that copy is ~200 µs a layer, ~6 ms of a ~45 ms step, paid by drafter steps and not by the
one-token steps a proposer without a match takes. The registered `grouped_sdpa` attention gives torch's SDPA the
grouped heads and the mask (`enable_gqa`), the same product up to float rounding, so t(n) stops growing with the
context faster than t(1). Like the packing it is a decode-time change of the loaded target, made once for the
baseline and every speculative decoder alike.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("dflashkit.target")


def packable(device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether `pack_linears` applies on this device and dtype, and why (or why not)."""
    if device.type != "cpu":
        return False, f"{device.type}: packed oneDNN weights are a CPU path"
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False, "this torch has no oneDNN linear (torch.backends.mkldnn)"
    if dtype == torch.float32:
        return True, "float32 on the CPU: oneDNN packed weights"
    if dtype == torch.bfloat16:
        from dflashkit.target.load import native_half

        native, why = native_half("bfloat16", device)
        return (True, "bfloat16 on the CPU: oneDNN packed weights") if native else (False, why)
    return False, f"{dtype}: packed weights cover float32 and native bfloat16"


class PackedLinear(nn.Module):
    """`nn.Linear` for inference with its weight in oneDNN's blocked layout (see the module doc).

    `linear`: the layer, or a bare weight [out, in] with its `bias` (`decode/fast_draft.py` packs concatenated
    projections)."""

    def __init__(self, linear: nn.Linear | torch.Tensor, bias: torch.Tensor | None = None, *, rows: int = 4,
                 keep_weight: bool = False):
        super().__init__()
        weight, bias = (linear.weight, linear.bias) if isinstance(linear, nn.Linear) else (linear, bias)
        w = weight.detach()
        self.out_features, self.in_features = w.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
        self.bias = None if bias is None else bias.detach()
        self.weight = weight if keep_weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or x.dtype != self.packed.dtype:
            if self.weight is None:
                raise RuntimeError(f"a packed {self.packed.dtype} CPU linear got a {x.dtype} {x.device} input")
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed={self.packed.dtype}"


def pack_linears(model: nn.Module, *, rows: int = 4) -> int:
    """Replace every `nn.Linear` of `model` by a `PackedLinear` (in place) → how many were packed.

    The output embedding (`model.get_output_embeddings()`, when there is one) keeps its weight: a tied input
    embedding shares it, and the decoder's draft head reads it."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, PackedLinear(child, rows=rows, keep_weight=child is head))
                n += 1
    return n


def prepare_for_decode(target, setting: str = "auto") -> dict[str, object]:
    """Pack the target's linear layers for decoding where `packable` says so (`eval.packed_weights`) and log
    it → {"packed": how many layers, "reason": why (or why not)}."""
    if setting == "off":
        return {"packed": 0, "reason": "eval.packed_weights=off"}
    ok, why = packable(target.device, target.dtype)
    if not ok:
        log.info("decode: transformers' linear layers (%s)", why)
        return {"packed": 0, "reason": why}
    n = pack_linears(target.model)
    attention = use_grouped_attention(target.model)
    log.info("decode: %d linear layers use pre-packed weights (%s); attention: %s", n, why, attention)
    return {"packed": n, "reason": why, "attention": attention}


GROUPED_SDPA = "grouped_kv_sdpa"  # no "flash" in the name: transformers reads that as a flash-attention kernel


def grouped_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract ([b, h, q, d] in, [b, q, h, d] out) over grouped K/V heads.

    A step with a mask (a verify over 2+ tokens against the cache) goes to torch's SDPA with `enable_gqa`; any
    other call (no mask, or extras such as sinks, softcap or a position bias) is transformers' own SDPA path."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    extras = any(kwargs.get(k) is not None for k in ("s_aux", "sinks", "softcap", "position_bias"))
    if attention_mask is None or extras or dropout or kwargs.get("output_attentions"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    mask = attention_mask[:, :, :, : key.shape[-2]]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def use_grouped_attention(model: nn.Module) -> str:
    """Switch a CPU model that runs transformers' SDPA with grouped K/V heads to `grouped_sdpa` → what it runs."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    heads, kv = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    if impl != "sdpa" or not heads or not kv or kv >= heads:
        return f"{impl} (unchanged)"
    if GROUPED_SDPA not in AttentionInterface._global_mapping:
        AttentionInterface.register(GROUPED_SDPA, grouped_sdpa)
        ALL_MASK_ATTENTION_FUNCTIONS.register(GROUPED_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    try:
        model.set_attn_implementation(GROUPED_SDPA)
    except (ValueError, NotImplementedError, AttributeError) as e:  # a model that takes no registered attention
        return f"sdpa (unchanged: {str(e).splitlines()[0][:120] if str(e) else type(e).__name__})"
    return "grouped-KV sdpa"
