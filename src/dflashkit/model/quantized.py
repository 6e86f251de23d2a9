"""Quantized targets: what a checkpoint's `quantization_config` says, and how the local paths load it.

Usage:
    q = target_quantization(model_dir)              # QuantInfo | None (None: an unquantized checkpoint)
    kwargs = local_load_kwargs(q, model_dir)        # {"quantization_config": …} for from_pretrained, or exit 2
    check_local_target(cfg.target)                  # the same refusal, for a stage before any work
    w = dequantize_fp8_blocks(w_fp8, scale_inv, (128, 128))           # [out, in] float32
    w = unpack_int4(weight_packed, weight_scale, weight_shape)        # [out, in] float32

Two formats are supported, as the field ships them:
- FP8 block-wise (DeepSeek-V3, Qwen3-FP8): `quant_method: fp8`, `weight_block_size: [128, 128]`;
  each quantized Linear stores `weight` in float8_e4m3fn and `weight_scale_inv` [⌈out/128⌉, ⌈in/128⌉]
  (float32), the real weight being `weight · weight_scale_inv` block by block. transformers loads it
  itself (`integrations/finegrained_fp8.py`).
- INT4 W4A16 (Kimi K2.x): `quant_method: compressed-tensors`, format `pack-quantized`; each quantized
  Linear stores `weight_packed` (int32, eight 4-bit values per word, lowest bits first, offset by 8),
  `weight_scale` [out, in/group] and `weight_shape`; the `ignore` list names the modules left
  unquantized (usually `lm_head`). transformers loads it through the `compressed-tensors` package
  (`pip install 'dflashkit[quantized]'`).

The local paths (local capture, online training, eval, serve) load the weights dequantized into
`target.dtype`: the checkpoint's quantized values, at params · bytes(target.dtype) of memory; the
engine paths run the served numerics instead. Any other `quant_method` but MXFP4 (which transformers
dequantizes itself) is refused before loading (exit 2) with the engine command to use instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflashkit.errors import UsageError
from dflashkit.model.files import config_json, resolve_target_path, tensor_shapes

if TYPE_CHECKING:
    import torch

LOCAL_METHODS = ("fp8", "compressed-tensors")  # quant_method values the local paths load (dequantized)
PASS_THROUGH = ("mxfp4",)  # loaded as transformers does by itself (gpt-oss: dequantized without a GPU), untested here
ENGINE_ROUTE = ("features from vLLM, which serves the checkpoint's own numerics: `dflashkit capture -c CFG "
                "capture.engine=vllm` (cached training) or `dflashkit train -c CFG train.features=engine "
                "capture.engine=vllm` (engine-fed training); docs/kimi-k2.6.md#quantized-targets")


@dataclass(frozen=True)
class QuantInfo:
    """A checkpoint's quantization: `method` (quant_method), `label` for messages, weight `bits`,
    FP8 `block` size or INT4 `group` size, and the modules left unquantized (`ignore`)."""

    method: str
    label: str
    bits: int | None = None
    block: tuple[int, int] | None = None
    group: int | None = None
    ignore: tuple[str, ...] = field(default_factory=tuple)


def quant_info(config: dict[str, Any]) -> QuantInfo | None:
    """The `quantization_config` of a config.json dict (outer or text config), or None when there is none."""
    q = config.get("quantization_config")
    if not isinstance(q, dict):
        return None
    method = str(q.get("quant_method") or "").lower()
    if method == "fp8":
        block = q.get("weight_block_size")
        blk = (int(block[0]), int(block[1])) if isinstance(block, (list, tuple)) and len(block) == 2 else None
        fmt = q.get("fmt") or "e4m3"
        label = f"FP8 {fmt} " + (f"block-wise {list(blk)}" if blk else "per-tensor")
        return QuantInfo("fp8", label, 8, block=blk,
                         ignore=tuple(q.get("modules_to_not_convert") or q.get("ignored_layers") or ()))
    if method == "compressed-tensors":
        weights: dict[str, Any] = {}
        for group in (q.get("config_groups") or {}).values():
            weights = (group or {}).get("weights") or {}
            break
        bits, gsize = weights.get("num_bits"), weights.get("group_size")
        fmt = q.get("format") or "?"
        label = (f"compressed-tensors {fmt} int{bits}" + (f" (W{bits}A16, group {gsize})" if gsize else "")
                 if bits else f"compressed-tensors {fmt}")
        return QuantInfo("compressed-tensors", label, int(bits) if bits else None,
                         group=int(gsize) if gsize else None, ignore=tuple(q.get("ignore") or ()))
    bits = q.get("bits") or q.get("num_bits")
    return QuantInfo(method or "unknown", f"{method or 'unknown'} quantization" + (f" ({bits}-bit)" if bits else ""),
                     int(bits) if bits else None)


def local_load_kwargs(q: QuantInfo | None, model_dir: Path) -> dict[str, Any]:
    """Keyword arguments for `from_pretrained` that load `q`'s checkpoint dequantized, or exit 2 naming the
    target, its quantization and the engine command when the local paths cannot load it."""
    if q is None:
        return {}
    if q.method == "fp8" and q.block is None:
        raise UsageError(f"target {model_dir}: {q.label} weights; dflashkit's local paths load block-wise FP8 "
                         "(quantization_config.weight_block_size) only", hint="take the " + ENGINE_ROUTE)
    if q.method == "fp8":
        from transformers import FineGrainedFP8Config

        try:
            import accelerate  # noqa: F401  (transformers' FP8 loader needs it)
        except ImportError:
            raise UsageError(f"target {model_dir}: {q.label} weights; transformers loads them only with "
                             "`accelerate` installed",
                             hint="pip install accelerate, or take the " + ENGINE_ROUTE) from None
        partial = _partial_fp8_block(model_dir, q.block)
        if partial:
            import transformers

            raise UsageError(f"target {model_dir}: {q.label} weights; {partial}, and transformers "
                             f"{transformers.__version__}'s dequantize mishandles such a weight (it divides the "
                             "weight evenly over the scale grid: it raises, or puts the scales on the wrong rows)",
                             hint="take the " + ENGINE_ROUTE + ", or point target.path at a bf16 copy")
        return {"quantization_config": FineGrainedFP8Config(weight_block_size=q.block, dequantize=True)}
    if q.method == "compressed-tensors":
        from transformers import CompressedTensorsConfig
        from transformers.utils import is_compressed_tensors_available

        try:
            import compressed_tensors  # noqa: F401
            usable = is_compressed_tensors_available()
        except ImportError:
            usable = False
        if not usable:
            raise UsageError(f"target {model_dir}: {q.label} weights; loading them locally needs the "
                             "`compressed-tensors` package (0.15 or newer), which is not installed",
                             hint="pip install 'dflashkit[quantized]' (or compressed-tensors), or take the "
                                  + ENGINE_ROUTE)

        return {"quantization_config": CompressedTensorsConfig(dequantize=True)}
    if q.method in PASS_THROUGH:
        return {}
    raise UsageError(f"target {model_dir}: {q.label} weights; dflashkit's local paths load only FP8 block-wise and "
                     "compressed-tensors checkpoints", hint="take the " + ENGINE_ROUTE + ", or point target.path "
                     "at an unquantized (bf16) copy")


def _partial_fp8_block(model_dir: Path, block: tuple[int, int] | None) -> str | None:
    """The first FP8 weight whose shape is not a whole number of blocks (its last block row or column is
    partial, as DeepSeek-V3's kv_a_proj_with_mqa [576, 7168] in 128-blocks), read from the safetensors
    headers only; None when every one divides evenly."""
    if block is None:
        return None
    shapes = tensor_shapes(model_dir)
    for name in sorted(shapes):
        wname = name.removesuffix("_scale_inv")
        shape = shapes.get(wname) if name.endswith("weight_scale_inv") else None
        if shape and len(shape) >= 2 and (shape[-2] % block[0] or shape[-1] % block[1]):
            return f"{wname} {list(shape)} is not a whole number of {list(block)} blocks"
    return None


def target_quantization(model_dir: Path) -> QuantInfo | None:
    """The quantization of the HF target in `model_dir` (config.json's outer or text config), or None."""
    raw = config_json(model_dir)
    nested = (v for v in raw.values() if isinstance(v, dict) and "quantization_config" in v)  # text_config, …
    return quant_info(raw) or next((quant_info(v) for v in nested), None)


def check_local_target(section: Any) -> None:
    """Exit 2 (naming the target, its quantization and the engine command) when the local paths cannot load
    the target of a `TargetSection`; what a stage calls before any work. A GGUF or a dir without config.json
    is left to `load_target`'s own checks."""
    model_dir, gguf = resolve_target_path(section.path, section.gguf_file)
    if gguf or not (model_dir / "config.json").is_file():
        return
    local_load_kwargs(target_quantization(model_dir), model_dir)


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor,
                          block: tuple[int, int] | None) -> torch.Tensor:
    """`weight` (float8) · `scale_inv` block by block → float32 [out, in]. `block` None: one scale per tensor."""
    import torch

    w = weight.to(torch.float32)
    s = scale_inv.to(torch.float32)
    if block is None or s.numel() == 1:
        return w * s.reshape(())
    r, c = w.shape
    s = s.repeat_interleave(block[0], 0)[:r].repeat_interleave(block[1], 1)[:, :c]
    return w * s


def unpack_int4(packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor | tuple[int, int]) -> torch.Tensor:
    """compressed-tensors `pack-quantized` symmetric 4-bit weights → float32 [out, in]: eight values per int32
    word, lowest bits first, stored offset by 8; value = q · scale, one scale per group of columns."""
    import torch

    rows, cols = (int(x) for x in (shape.tolist() if isinstance(shape, torch.Tensor) else shape))
    words = packed.to(torch.int64) & 0xFFFFFFFF
    nib = torch.stack([(words >> (4 * i)) & 0xF for i in range(8)], dim=-1).reshape(rows, -1)[:, :cols]
    q = nib.to(torch.float32) - 8.0
    s = scale.to(torch.float32)
    group = -(-cols // s.shape[-1])
    s = s.repeat_interleave(group, dim=-1)[:, :cols]
    return q * s
