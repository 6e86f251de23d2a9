"""The target's embedding, final norm and LM head alone, read by name from its safetensors.

Usage:
    parts = load_head_parts(model_dir, dtype=torch.float32)        # three tensors, never the whole model
    last = parts.final_norm(pre_norm)                              # [.., H]: the target's last hidden state
    ids = parts.next_token_ids(last)                               # argmax lm_head, chunked
    target = parts.as_target(tokenizer)                            # what training needs (embed, head, sizes)

When the features come from a serving engine (`capture.engine: vllm`, `train.features: engine`)
the labels (`train.labels: target`) and the KL target (`train.loss: kl`) need only the target's
final norm and LM head, applied to the engine's last-layer output (vLLM's aux id
`num_hidden_layers` is that layer's output *before* the norm), and training needs the input
embedding for the drafter's noise block. Those are a small share of a large target's
checkpoint, so they are read here by name through `model.safetensors.index.json` (or the
files' headers), with the prefixes wrapped checkpoints use (`language_model.` as in Kimi K2.x,
`model.language_model.` as in newer transformers) and the config's nested `text_config`. Tied
targets (or ones without an `lm_head.weight`) use the embedding as the head. Quantized checkpoints
usually leave these tensors unquantized; when one is not, it is dequantized on read (an FP8
`weight` with its `weight_scale_inv`, or compressed-tensors' `weight_packed` / `weight_scale` /
`weight_shape`: `target.quantized`), never cast raw.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dflashkit.errors import UsageError
from dflashkit.target.files import resolve_target_path
from dflashkit.target.quantized import QuantInfo, check_checkpoint, dequantize_fp8_blocks, unpack_int4
from dflashkit.target.load import announce, compute_dtype, load_tokenizer, resolve_device, text_config_dict

if TYPE_CHECKING:
    from dflashkit.target.spec import TargetSpec

log = logging.getLogger("dflashkit.target")

PREFIXES = ("", "language_model.", "model.language_model.")  # model.norm / language_model.model.norm / ...
NORM_NAMES = tuple(p + n for p in ("", "language_model.") for n in ("model.norm.weight",)) + (
    "model.language_model.norm.weight",
    "model.final_layernorm.weight", "backbone.norm_f.weight")  # Bamba / Falcon-H1, Nemotron-H
HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight")
EMBED_NAMES = ("model.embed_tokens.weight", "language_model.model.embed_tokens.weight",
               "model.language_model.embed_tokens.weight", "backbone.embeddings.weight")  # the last: Nemotron-H
OFFSET_NORM_TYPES = ("gemma", "gemma2", "gemma3", "gemma3_text",  # RMSNorm scales by (1 + w)
                     "qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")


def weight_map(model_dir: Path) -> dict[str, str]:
    """tensor name → file name, from the index (or every *.safetensors header when there is none)."""
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            return dict(json.loads(index.read_text())["weight_map"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise UsageError(f"{index}: not a safetensors index ({e})",
                             hint="restore the model's model.safetensors.index.json") from None
    out: dict[str, str] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        try:
            with safe_open(str(f), "pt") as fh:
                out.update({k: f.name for k in fh.keys()})
        except Exception as e:  # noqa: BLE001 - safetensors raises several types for bad files
            raise UsageError(f"{f}: cannot read safetensors ({e})", hint="the file is corrupt; re-download it") from None
    if not out:
        raise UsageError(f"{model_dir}: no *.safetensors weights (dflashkit loads safetensors only)",
                         hint="point target.path at the HF model dir")
    return out


def _read(model_dir: Path, wmap: dict[str, str], name: str) -> torch.Tensor:
    from safetensors import safe_open

    path = model_dir / wmap[name]
    try:
        with safe_open(str(path), "pt") as fh:
            return fh.get_tensor(name)
    except Exception as e:  # noqa: BLE001
        raise UsageError(f"{path}: cannot read tensor {name} ({e})", hint="the file is corrupt; re-download it") from None


def _first(wmap: dict[str, str], names: tuple[str, ...]) -> str | None:
    """The first of `names` in the checkpoint, stored plain or as compressed-tensors' `weight_packed`."""
    return next((n for n in names if n in wmap or _packed(n) in wmap), None)


def _packed(name: str) -> str:
    return name.removesuffix("weight") + "weight_packed"


def _read_weight(model_dir: Path, wmap: dict[str, str], name: str, q: QuantInfo | None) -> torch.Tensor:
    """A 2-D weight by name, dequantized to float32 when the checkpoint stores it quantized: FP8 with a
    `weight_scale_inv` beside it, or compressed-tensors `weight_packed` + `weight_scale` + `weight_shape`."""
    stem = name.removesuffix("weight")
    if name in wmap:
        w = _read(model_dir, wmap, name)
        if w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            if stem + "weight_scale_inv" not in wmap:
                raise UsageError(f"{model_dir}: {name} is stored in {w.dtype} without {stem}weight_scale_inv",
                                 hint="the FP8 checkpoint is incomplete; re-download it")
            block = q.block if q is not None else None
            log.info("%s: FP8 %s, dequantized block-wise", name, list(block) if block else "per-tensor")
            return dequantize_fp8_blocks(w, _read(model_dir, wmap, stem + "weight_scale_inv"), block)
        return w
    parts = [stem + k for k in ("weight_packed", "weight_scale", "weight_shape")]
    if any(p not in wmap for p in parts) or stem + "weight_zero_point" in wmap:
        raise UsageError(f"{model_dir}: {name} is stored quantized in a layout dflashkit does not read "
                         f"(needs {', '.join(parts)}, symmetric)",
                         hint="take an unquantized copy of the head, or the engine path (docs/kimi-k2.6.md)")
    log.info("%s: compressed-tensors int4, unpacked", name)
    return unpack_int4(*(_read(model_dir, wmap, p) for p in parts))


@dataclass
class HeadParts:
    """The target's input embedding [V, H], final norm weight [H] (+ eps) and LM head [V, H]."""

    embed: nn.Embedding
    norm_weight: torch.Tensor
    eps: float
    lm_head: nn.Linear
    offset_norm: bool = False          # Gemma-style RMSNorm: x̂ · (1 + w)
    num_layers: int = 0
    model_dir: Path | None = None
    names: tuple[str, ...] = ()        # the tensors read, for the record

    @property
    def hidden_size(self) -> int:
        return int(self.norm_weight.shape[0])

    @property
    def vocab_size(self) -> int:
        return int(self.embed.weight.shape[0])

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        """RMSNorm of the last decoder layer's output: the target's last hidden state (as HF computes it)."""
        x = h.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.norm_weight.float().to(x.device)
        return (x * (1 + w if self.offset_norm else w)).to(h.dtype)

    @torch.no_grad()
    def next_token_ids(self, last_hidden: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
        """argmax lm_head(last_hidden) at every position, [..] int64, `chunk` rows at a time."""
        flat = last_hidden.reshape(-1, last_hidden.shape[-1]).to(self.lm_head.weight.dtype)
        out = torch.empty(flat.shape[0], dtype=torch.long, device=flat.device)
        for i in range(0, flat.shape[0], chunk):
            out[i:i + chunk] = self.lm_head(flat[i:i + chunk]).argmax(-1)
        return out.view(last_hidden.shape[:-1])


def load_head_parts(model_dir: str | Path, *, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> HeadParts:
    """Read the embedding, the final norm and the LM head of a HF target dir by name (nothing else).

    Raises:
        UsageError: config.json or a tensor is missing or unreadable (the message names the file).
    """
    d = Path(model_dir)
    q = check_checkpoint(d)  # tensors that cannot be what config.json says: exit 2 before any is read
    tc = text_config_dict(d)
    wmap = weight_map(d)
    norm, embed = _first(wmap, NORM_NAMES), _first(wmap, EMBED_NAMES)
    head = None if tc.get("tie_word_embeddings") else _first(wmap, HEAD_NAMES)
    missing = [what for what, n in (("final norm (model.norm.weight)", norm),
                                    ("embedding (model.embed_tokens.weight)", embed)) if n is None]
    if missing:
        raise UsageError(f"{d}: no {' and no '.join(missing)} among the checkpoint's tensor names "
                         f"(looked for the prefixes {[p for p in PREFIXES if p]} too)",
                         hint="point target.path at the target's HF dir")
    assert norm is not None and embed is not None
    e = _read_weight(d, wmap, embed, q).to(dtype)
    h = _read_weight(d, wmap, head, q).to(dtype) if head else e
    w = _read(d, wmap, norm).to(dtype)
    if h.shape[-1] != w.shape[0] or e.shape[-1] != w.shape[0]:
        raise UsageError(f"{d}: embedding {tuple(e.shape)}, head {tuple(h.shape)} and final norm {tuple(w.shape)} "
                         "do not agree on the hidden size", hint="the checkpoint is inconsistent")
    emb = nn.Embedding.from_pretrained(e, freeze=True)
    lin = nn.Linear(h.shape[1], h.shape[0], bias=False)
    lin.weight = emb.weight if head is None else nn.Parameter(h, requires_grad=False)
    lin.requires_grad_(False)
    names = tuple(n for n in (embed, norm, head) if n)
    log.info("target head parts from %s: %s (%.1f MB; the rest of the checkpoint is not read)", d,
             ", ".join(names), sum(t.numel() * t.element_size() for t in {id(x): x for x in (e, h, w)}.values()) / 1e6)
    return HeadParts(emb.to(device), w.to(device), float(tc.get("rms_norm_eps") or tc.get("layer_norm_epsilon") or 1e-6), lin.to(device),
                     offset_norm=str(tc.get("model_type", "")) in OFFSET_NORM_TYPES,
                     num_layers=int(tc.get("num_hidden_layers") or 0), model_dir=d, names=names)


@dataclass
class HeadOnlyTarget:
    """What training needs of the target when the features come from elsewhere (no decoder layers).

    Quacks like `target.load.Target` for the contract check, the draft vocab, padding and the
    loss's embedding and head; `features` is never called (the loop reads every target output from
    the feature store or the engine)."""

    parts: HeadParts
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype

    @property
    def model_dir(self) -> Path | None:
        return self.parts.model_dir

    @property
    def num_layers(self) -> int:
        return self.parts.num_layers

    @property
    def hidden_size(self) -> int:
        return self.parts.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.parts.vocab_size

    @property
    def lm_head(self) -> nn.Module:
        return self.parts.lm_head

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.parts.embed(input_ids)

    def next_token_ids(self, last_hidden: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
        return self.parts.next_token_ids(last_hidden, chunk)

    def features(self, *args: Any, **kwargs: Any):
        raise RuntimeError("a head-only target has no decoder layers: its features come from the feature "
                           "store or the engine")


def load_head_only_target(section: TargetSpec, *, device: str | None = None) -> HeadOnlyTarget:
    """`load_target`'s light twin for a `TargetSection`: embedding + final norm + head, and the tokenizer."""
    model_dir, gguf = resolve_target_path(section.path, section.gguf_file)
    if gguf:
        raise UsageError(f"target.path {section.path}: a GGUF target has no safetensors to read the head from",
                         hint="point target.path at a HF model dir")
    dev = resolve_device(device or section.device)
    dt = announce(compute_dtype(section.dtype, dev, key="target.dtype")).dtype
    parts = load_head_parts(model_dir, dtype=dt, device=dev)
    tok = load_tokenizer(model_dir, trust_remote_code=section.trust_remote_code, tokenizer_dir=section.tokenizer)
    return HeadOnlyTarget(parts, tok, dev, dt)
