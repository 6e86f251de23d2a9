"""Quantized targets: what a checkpoint's `quantization_config` says, and how the local paths load it.

Usage:
    q = target_quantization(model_dir)              # QuantInfo | None (None: an unquantized checkpoint)
    kwargs = local_load_kwargs(q, model_dir)        # {"quantization_config": …} for from_pretrained, or exit 2
    check_local_target(cfg.target)                  # the same refusal, for a stage before any work
    q = check_checkpoint(model_dir)                 # exit 2: tensors that cannot be what config.json says
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

from dflashkit.errors import ConfigError, UsageError
from dflashkit.target.files import (FLOAT_DTYPES, LOW_FLOAT_DTYPES, check_safetensors, config_json,
                                   resolve_target_path, tensor_entries, tensor_shapes)

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


def quant_info(config: dict[str, Any], *, source: str = "config.json",
               key: str = "quantization_config") -> QuantInfo | None:
    """The `quantization_config` of a config.json dict (outer or text config), or None when there is none.

    ConfigError (exit 2) naming `source` and the dotted key when the section is not what a quantized checkpoint
    ships: not an object, a non-string `quant_method`, a `weight_block_size` that is not two sizes >= 1,
    `config_groups` that are not objects, a bit width or group size that is not an integer >= 1."""
    q = config.get("quantization_config")
    if q is None:
        return None
    bad = _Bad(source, key)
    if not isinstance(q, dict):
        raise bad("", q, 'an object such as {"quant_method": "fp8", "weight_block_size": [128, 128]}')
    method = q.get("quant_method")
    if method is not None and not isinstance(method, str):
        raise bad("quant_method", method, 'a string ("fp8", "compressed-tensors", …)')
    method = (method or "").lower()
    if method == "fp8":
        block = q.get("weight_block_size")
        if block is not None and not (isinstance(block, list) and len(block) == 2 and all(_size(b) for b in block)):
            raise bad("weight_block_size", block, "two block sizes >= 1, such as [128, 128]")
        blk = (block[0], block[1]) if block else None
        fmt = _text(q, "fmt", bad) or "e4m3"
        label = f"FP8 {fmt} " + (f"block-wise {list(blk)}" if blk else "per-tensor")
        return QuantInfo("fp8", label, 8, block=blk, ignore=_names(q, ("modules_to_not_convert", "ignored_layers"),
                                                                    bad))
    if method == "compressed-tensors":
        groups = q.get("config_groups")
        if groups is not None and not (isinstance(groups, dict) and all(isinstance(g, dict) for g in groups.values())):
            raise bad("config_groups", groups, 'an object of named groups, such as {"group_0": {"weights": '
                      '{"num_bits": 4, …}, "targets": ["Linear"]}}')
        weights: dict[str, Any] = {}
        for name, group in (groups or {}).items():
            weights = group.get("weights") or {}
            if not isinstance(weights, dict):
                raise bad(f"config_groups.{name}.weights", weights, "an object (num_bits, group_size, …)")
            for k in ("num_bits", "group_size"):
                if weights.get(k) is not None and not _size(weights[k]):
                    raise bad(f"config_groups.{name}.weights.{k}", weights[k], "an integer >= 1")
        bits, gsize = weights.get("num_bits"), weights.get("group_size")
        fmt = _text(q, "format", bad) or "?"
        label = (f"compressed-tensors {fmt} int{bits}" + (f" (W{bits}A16, group {gsize})" if gsize else "")
                 if bits else f"compressed-tensors {fmt}")
        return QuantInfo("compressed-tensors", label, bits, group=gsize, ignore=_names(q, ("ignore",), bad))
    for k in ("bits", "num_bits"):
        if q.get(k) is not None and not _size(q[k]):
            raise bad(k, q[k], "an integer >= 1")
    bits = q.get("bits") or q.get("num_bits")
    return QuantInfo(method or "unknown", f"{method or 'unknown'} quantization" + (f" ({bits}-bit)" if bits else ""),
                     bits)


class _Bad:
    """Builds the ConfigError for one malformed `quantization_config` key of `source`."""

    def __init__(self, source: str, key: str):
        self.source, self.key = source, key

    def __call__(self, sub: str, value: Any, want: str) -> ConfigError:
        key = f"{self.key}.{sub}" if sub else self.key
        return ConfigError(f"{self.source}: {key} is {value!r} ({type(value).__name__}); expected {want}",
                           hint=f"restore {key} in {self.source} from the checkpoint's source (the quantizer "
                                "writes it), or point target.path at an unquantized copy")


def _size(x: Any) -> bool:
    """A JSON integer >= 1 (not a bool, not a string)."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


def _text(q: dict[str, Any], k: str, bad: _Bad) -> str | None:
    v = q.get(k)
    if v is not None and not isinstance(v, str):
        raise bad(k, v, "a string")
    return v


def _names(q: dict[str, Any], keys: tuple[str, ...], bad: _Bad) -> tuple[str, ...]:
    for k in keys:
        v = q.get(k)
        if v is not None and not (isinstance(v, list) and all(isinstance(x, str) for x in v)):
            raise bad(k, v, "a list of module names")
        if v:
            return tuple(v)
    return ()


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
    """The quantization of the HF target in `model_dir` (config.json's outer or text config), or None;
    ConfigError naming config.json and the key when the section is malformed (`quant_info`)."""
    raw = config_json(model_dir)
    source = str(Path(model_dir) / "config.json")
    found = quant_info(raw, source=source)
    for k, v in raw.items():  # text_config, …
        if isinstance(v, dict) and "quantization_config" in v:
            inner = quant_info(v, source=source, key=f"{k}.quantization_config")
            found = found or inner
    return found


def check_checkpoint(model_dir: Path) -> QuantInfo | None:
    """Refuse (exit 2) a HF checkpoint whose tensors cannot be what its config says, before any weight is read;
    returns its quantization (None: unquantized).

    From config.json and the safetensors headers and sizes only:
    - every safetensors file is whole and self-consistent (`files.check_safetensors`);
    - `quantization_config` is well formed (`quant_info`);
    - without one, no tensor is FP8/FP4/FP6 (raw values without their scales) and no weight is stored as
      integers or bools (a header that lies about its bytes; integer buffers such as position ids pass);
    - with FP8 block-wise: float8 tensors exist, each float8 `weight` has its `weight_scale_inv`, whose shape
      is the weight's block grid, and no weight is stored as integers.
    Other quantizations store integers and scales by their own rules; the local paths refuse them anyway."""
    model_dir = Path(model_dir)
    source = model_dir / "config.json"
    for weights in sorted(model_dir.glob("*.safetensors")):
        check_safetensors(weights)
    q = target_quantization(model_dir)
    entries = tensor_entries(model_dir)
    if not entries or (q is not None and q.method != "fp8"):  # no weights here (a config-only dir): nothing to hold
        return q
    raw = config_json(model_dir)
    declared = raw.get("torch_dtype") or raw.get("dtype") or "float"
    for name, e in sorted(entries.items()):
        if q is None and e.dtype in LOW_FLOAT_DTYPES:
            raise UsageError(f"{e.file}: tensor {name} is {e.dtype}, but {source} has no quantization_config: "
                             "its raw 8-bit values would load without their scales",
                             hint="restore the checkpoint's quantization_config (quant_method, fmt, weight_block_size) "
                                  "in config.json from where the checkpoint came from, or point target.path at an "
                                  "unquantized copy")
        if e.dtype not in FLOAT_DTYPES + LOW_FLOAT_DTYPES and not _integer_buffer(name):
            why = f"{q.label} stores its weights as float8" if q else "there is no quantization_config"
            raise UsageError(f"{e.file}: tensor {name} is stored as {e.dtype}, but {source} declares {declared} "
                             f"weights and {why}: the integers would load as weights",
                             hint=f"the header of {e.file.name} does not describe its data (or the file belongs "
                                  "to another model): re-download or re-convert it")
    if q is not None and q.block:  # per-tensor FP8 is refused by local_load_kwargs
        _check_fp8_scales(q, entries, source)
    return q


def _integer_buffer(name: str) -> bool:
    """A tensor that is integers in any checkpoint: ids, indices, counters (not a weight)."""
    last = name.rsplit(".", 1)[-1]
    return last.endswith(("_ids", "_index", "_indices")) or last == "num_batches_tracked"


def _check_fp8_scales(q: QuantInfo, entries: dict[str, Any], source: Path) -> None:
    """FP8 block-wise: float8 weights exist, each with a `weight_scale_inv` of the weight's block grid."""
    fp8 = sorted(n for n, e in entries.items() if e.dtype in ("F8_E4M3", "F8_E5M2"))
    if not fp8:
        raise UsageError(f"{source}: quantization_config says {q.label}, but no tensor of the safetensors is "
                         "float8", hint="the config belongs to another copy of the model: remove its "
                                        "quantization_config if these are the unquantized weights")
    for name in fp8:
        if not name.endswith("weight"):
            continue
        scale = entries.get(name + "_scale_inv")
        e = entries[name]
        if scale is None:
            raise UsageError(f"{e.file}: tensor {name} is {e.dtype} with no {name}_scale_inv in the checkpoint: "
                             "its scales are missing", hint="re-download the checkpoint's safetensors files")
        if q.block and len(e.shape) == 2:
            grid = [-(-e.shape[0] // q.block[0]), -(-e.shape[1] // q.block[1])]
            if list(scale.shape) != grid:
                raise UsageError(f"{scale.file}: tensor {name}_scale_inv has shape {list(scale.shape)}; {name} "
                                 f"{list(e.shape)} in the [{q.block[0]}, {q.block[1]}] blocks of {source}'s "
                                 f"quantization_config.weight_block_size needs {grid}",
                                 hint="the block size in config.json does not match the checkpoint: restore it "
                                      "from the checkpoint's source")


def check_local_target(section: Any) -> None:
    """Exit 2 (naming the target, its quantization and the engine command) when the local paths cannot load
    the target of a `TargetSection`, or its tensors disagree with its config (`check_checkpoint`); what a
    stage calls before any work. A GGUF or a dir without config.json
    is left to `load_target`'s own checks."""
    model_dir, gguf = resolve_target_path(section.path, section.gguf_file)
    if gguf or not (model_dir / "config.json").is_file():
        return
    local_load_kwargs(check_checkpoint(model_dir), model_dir)


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
