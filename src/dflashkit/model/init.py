"""Initialise draft layers from target decoder layers (`drafter.init: target`).

Usage:
    report = init_from_target(drafter, target, layer_ids=None)   # None = the last L_d target layers
    report["copied"], report["skipped"]                           # tensor names, with reasons

Draft layer i takes target layer `layer_ids[i]`'s attention (q/k/v/o projections), MLP
(gate/up/down) and norms (input/post-attention) when the tensor shapes match (Llama / Qwen-style
targets whose drafter geometry was copied from the target, the default). `q_norm` / `k_norm` are
copied from Qwen3-style targets; targets without QK-norm (Llama) leave them at ones, which makes
the copied attention start as the target's attention up to the per-head RMS normalisation.
An MLA drafter (`drafter.attention_type: mla`) takes an MLA target's (DeepSeek-V3, Kimi K2) q_a_proj,
q_a_layernorm, q_b_proj / q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj and o_proj the same way.
Anything whose shape differs (MLA into GQA, MoE experts, custom dims) is skipped and left randomly
initialised. The drafter's final `norm` (applied before the shared target head) takes the target's
final norm (`model.norm`), when its shape matches; `fc` and `hidden_norm` are never copied.
"""

from __future__ import annotations

import logging

import torch

from dflashkit.errors import UsageError

log = logging.getLogger("dflashkit.train")

LAYER_TENSORS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight")
MLA_TENSORS = ("self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight",
               "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight", "self_attn.kv_b_proj.weight")


@torch.no_grad()
def init_from_target(drafter: torch.nn.Module, target, layer_ids: list[int] | None = None) -> dict:
    """Copy matching target-layer tensors into the draft layers (see the module docstring).

    Raises:
        UsageError: a layer id is outside the target.
    """
    n_draft = len(drafter.layers)
    layers = target.decoder_layers
    ids = list(layer_ids) if layer_ids is not None else list(range(len(layers) - n_draft, len(layers)))
    if len(ids) != n_draft or any(not 0 <= i < len(layers) for i in ids):
        raise UsageError(f"drafter.init_layer_ids {ids}: need {n_draft} ids inside the target's "
                         f"{len(layers)} layers", hint="fix drafter.init_layer_ids or use null")
    copied, skipped = [], []
    for di, ti in enumerate(ids):
        src = dict(layers[ti].named_parameters())
        dst = dict(drafter.layers[di].named_parameters())
        for name in LAYER_TENSORS + MLA_TENSORS:
            if name not in dst:  # the other attention's tensor (a GQA drafter has no kv_b_proj, an MLA one no k_proj)
                continue
            t = src.get(name)
            if t is None:
                skipped.append(f"layers.{di}.{name}: target layer {ti} has none")
                continue
            if t.shape != dst[name].shape:
                skipped.append(f"layers.{di}.{name}: shape {tuple(t.shape)} != {tuple(dst[name].shape)}")
                continue
            dst[name].copy_(t.to(dst[name].dtype))
            copied.append(f"layers.{di}.{name}")
    final = _target_final_norm(target)
    dst = drafter.norm.weight
    if final is None:
        skipped.append("norm.weight: the target has no final norm weight")
    elif final.shape != dst.shape:
        skipped.append(f"norm.weight: shape {tuple(final.shape)} != {tuple(dst.shape)}")
    else:
        dst.copy_(final.to(dst.dtype))
        copied.append("norm.weight")
    log.info("init from target layers %s: %d tensors copied, %d skipped", ids, len(copied), len(skipped))
    return {"layer_ids": ids, "copied": copied, "skipped": skipped}


def _target_final_norm(target) -> torch.Tensor | None:
    """The weight of the target's final norm (the one before its LM head), or None."""
    model = target.model
    inner = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    norm = getattr(inner, "norm", None)
    return getattr(norm, "weight", None) if norm is not None else None
