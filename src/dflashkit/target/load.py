"""The frozen target: load it (HF dir, GGUF, wrapped configs) and tap decoder-layer outputs.

Usage:
    target = load_target(cfg.target)                         # eval mode, requires_grad False
    feats = target.features(input_ids, layer_ids=[1, 3])     # [b, t, 2·H], stops after layer 3
    feats, out = target.features(ids, layer_ids=ids_, need_logits=True, past_key_values=cache,
                                 use_cache=True)             # verify pass: logits + features
    emb = target.embed(ids); logits = target.lm_head(h)      # shared, frozen
    c = announce(compute_dtype("native", dev, key="eval.dtype"))  # a compute dtype and why, logged once
    c.dtype, c.reason                      # torch.float32, "float32: bf16 is emulated on this CPU (no ...)"

Feature convention (dflash-spec §1.7): the feature of layer id is the output of decoder layer `id`
(= HF `hidden_states[id + 1]`), captured with forward hooks, so all hidden states are never
materialised. When logits are not needed the forward stops right after the deepest tapped layer.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import transformers
from torch import nn
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedConfig

from dflashkit.assets import cache_dir, convert_gguf
from dflashkit.errors import UsageError
from dflashkit.target.files import config_json, resolve_target_path, tensor_entries
from dflashkit.target.quantized import check_checkpoint, local_load_kwargs
from dflashkit.textfile import read_utf8

if TYPE_CHECKING:
    from dflashkit.target.spec import TargetSpec

log = logging.getLogger("dflashkit.target")

# model_type aliases transformers does not know, mapped to the architecture that implements them
MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}
WRAPPER_KEYS = ("text_config", "language_config", "llm_config", "thinker_config", "language_model_config")


class _StopForward(Exception):
    pass


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`target.dtype` → a torch dtype on `device` (`compute_dtype` decides; nothing is logged)."""
    return compute_dtype(dtype, device, key="target.dtype").dtype


# the CPU flags under which torch computes a 16-bit dtype's matrix products natively (oneDNN); without
# them it converts every element to float32 and back (emulation, several times slower than float32)
HALF_FLAGS = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}


# oneDNN ISA caps (`ONEDNN_MAX_CPU_ISA`) under which its bf16 / fp16 matrix kernels are still used
ONEDNN_HALF_ISAS = {"bfloat16": ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10_1_512", "AVX512_CORE_AMX",
                                 "AVX512_CORE_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2", "ALL", "DEFAULT"),
                    "float16": ("AVX512_CORE_FP16", "AVX10_1_512", "AVX512_CORE_AMX_FP16", "AVX10_2_512",
                                "AVX10_2_512_AMX_2", "ALL", "DEFAULT")}


def cpu_facts() -> dict[str, Any]:
    """The CPU's model name and the bf16 / fp16 matrix instructions torch may use on it (from /proc/cpuinfo;
    {} elsewhere). An `ONEDNN_MAX_CPU_ISA` below a dtype's kernels (e.g. AVX2, to imitate an older CPU) or
    `ATEN_CPU_CAPABILITY=avx2/default` hides that dtype's flags, as the kernels then cannot use them."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "")
    flags = set(next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), []))
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    aten_capped = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower() in ("avx2", "default")
    out: dict[str, Any] = {"cpu": name}
    for dtype, key in (("bfloat16", "bf16"), ("float16", "fp16")):
        capped = aten_capped or (bool(isa) and isa not in ONEDNN_HALF_ISAS[dtype])
        out[key] = [] if capped else [f for f in HALF_FLAGS[dtype] if f in flags]
    if isa or aten_capped:
        out["isa_cap"] = {"ONEDNN_MAX_CPU_ISA": isa or None,
                          "ATEN_CPU_CAPABILITY": os.environ.get("ATEN_CPU_CAPABILITY") or None}
    return out


def fast_bf16(device: torch.device) -> bool:
    """Whether bf16 matrix products beat float32 here: CUDA, or a CPU with AMX-BF16 or AVX512-BF16.

    Without either a CPU emulates bf16, which is slower than float32 (docs/architecture.md, "Verify dtype")."""
    if device.type == "cuda":
        return True
    return device.type == "cpu" and bool({"amx_bf16", "avx512_bf16"} & set(cpu_facts().get("bf16", [])))


def native_half(name: str, device: torch.device) -> tuple[bool, str]:
    """Whether `device` computes the 16-bit dtype `name` (bfloat16, float16) natively, and the evidence:
    ("CUDA"), the CPU flags it has ("avx512_bf16"), or those it lacks ("no avx512_bf16 / amx_bf16")."""
    if device.type == "cuda":
        return True, "CUDA"
    if device.type != "cpu":
        return False, f"not known to be native on {device.type}"
    flags = HALF_FLAGS[name]
    have = (cpu_facts().get("bf16" if name == "bfloat16" else "fp16") or [])
    native = fast_bf16(device) if name == "bfloat16" else bool(have)  # bf16: the same test as fast_bf16
    if native:
        return True, " / ".join(have)
    cap = cpu_facts().get("isa_cap")
    capped = f" usable ({', '.join(f'{k}={v}' for k, v in cap.items() if v)})" if cap else ""
    return False, "no " + " / ".join(flags) + capped


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype a stage computes in for one config key, and a one-line reason ("bfloat16: CUDA").

    `warning` is set for an explicit 16-bit dtype the device only emulates (the choice is kept: explicit
    settings win); `announce` logs it."""

    key: str
    setting: str
    dtype: torch.dtype
    reason: str
    warning: str | None = None

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def compute_dtype(setting: str, device: torch.device, *, key: str, auto: str = "cuda",
                 suggest: str = "native") -> DtypeChoice:
    """The one owner of a compute dtype: `setting` of config key `key` on `device`, decided instantly.

    native = bfloat16 where the device computes it natively (CUDA; CPUs with AVX512-BF16 or AMX-BF16:
    `fast_bf16`), else float32. auto = bfloat16 on CUDA, else float32 (`auto="cuda"`: target.dtype,
    train.dtype) or the same as native (`auto="native"`: train.target_dtype). float32 / bfloat16 / float16
    are kept as they are; a 16-bit one the CPU only emulates gets a `warning` naming the key, the missing
    CPU flags and `suggest` (the setting that keeps bf16 only where it is native) or float32.
    """
    if setting == "native" or (setting == "auto" and auto == "native"):
        native, why = native_half("bfloat16", device)
        if native:
            return DtypeChoice(key, setting, torch.bfloat16,
                               "bfloat16: CUDA" if why == "CUDA" else f"bfloat16: native on this CPU ({why})")
        return DtypeChoice(key, setting, torch.float32, f"float32: bf16 is emulated on this CPU ({why})"
                           if device.type == "cpu" else f"float32: bf16 is {why}")
    if setting == "auto":
        if device.type == "cuda":
            return DtypeChoice(key, setting, torch.bfloat16, f"bfloat16: {key}=auto on CUDA")
        return DtypeChoice(key, setting, torch.float32, f"float32: {key}=auto off CUDA")
    dtype = getattr(torch, setting, None)
    if not isinstance(dtype, torch.dtype):
        raise UsageError(f"{key}: unknown dtype {setting!r}", hint=f"use {suggest}, float32 or bfloat16")
    if setting not in HALF_FLAGS:
        return DtypeChoice(key, setting, dtype, f"{setting}: set by {key}")
    native, why = native_half(setting, device)
    if native or device.type != "cpu":
        return DtypeChoice(key, setting, dtype, f"{setting}: set by {key}")
    cpu = cpu_facts().get("cpu") or "this CPU"
    return DtypeChoice(key, setting, dtype, f"{setting}: set by {key}, emulated on this CPU ({why})",
                       warning=f"{key}: {setting} is emulated on this CPU ({cpu}: {why}), so its matrix products "
                               f"run several times slower than in float32; set {key}: {suggest} (bf16 only where "
                               f"the device computes it natively) or float32")


_ANNOUNCED: set[tuple[str, str, str]] = set()


def announce(choice: DtypeChoice) -> DtypeChoice:
    """Log a choice once per process: INFO `key=setting → reason`, and its WARNING when it has one."""
    seen = (choice.key, choice.setting, choice.reason)
    if seen not in _ANNOUNCED:
        _ANNOUNCED.add(seen)
        log.info("%s=%s → %s", choice.key, choice.setting, choice.reason)
        if choice.warning:
            log.warning("%s", choice.warning)
    return choice


def target_autocast(setting: str, device: torch.device, target_dtype: torch.dtype) -> torch.dtype | None:
    """Autocast dtype for the online target forward (`train.target_dtype`), or None for none.

    auto = bfloat16 where bf16 products are native (`compute_dtype`'s native: CUDA, CPUs with AMX-BF16 or
    AVX512-BF16), else the target's own dtype. Nothing to do when the target is already loaded in 16 bits.
    The choice is announced (once per process).
    """
    if target_dtype != torch.float32:
        return None
    choice = announce(compute_dtype(setting, device, key="train.target_dtype", auto="native", suggest="auto"))
    return None if choice.dtype == torch.float32 else choice.dtype


def cache_kwarg(model: nn.Module) -> str:
    """The keyword a model's forward takes its KV cache by: `cache` (transformers 5.2x) or `past_key_values`
    (earlier 5.x, e.g. 5.17). An unknown keyword is swallowed by transformers' `**kwargs` without an error, so
    passing the wrong one silently decodes without the cache."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


# layer kinds (transformers' names) that keep a recurrent / convolution state instead of per-token keys and values
RECURRENT_LAYER_TYPES = frozenset({"linear_attention", "conv", "hybrid", "hybrid_sliding", "mamba"})


def layer_types(config: Any) -> list[str]:
    """Per decoder layer, its kind as transformers names it (`config.layer_types`; full_attention for every layer
    of a config without the field). `config`: a HF config object or a config.json dict (its text config)."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    if not isinstance(config, dict) and hasattr(config, "get_text_config"):
        text = config.get_text_config(decoder=True)
        get = lambda k, d=None: getattr(text, k, d)  # noqa: E731
    types = get("layer_types", None)
    if isinstance(types, (list, tuple)) and types:
        return [str(t) for t in types]
    n = int(get("num_hidden_layers", 0) or 0)
    return ["full_attention"] * n


def text_config_dict(model_dir: Path) -> dict[str, Any]:
    """config.json with wrappers (text_config, …) resolved: the language model's own config."""
    raw = config_json(model_dir)
    for key in WRAPPER_KEYS:
        inner = raw.get(key)
        if isinstance(inner, dict) and ("num_hidden_layers" in inner or "hidden_size" in inner):
            return inner
    return raw


def remote_code_reason(model_dir: Path) -> str | None:
    """Why the model in `model_dir` can only load with its own Python code (its model_type is not built into
    the installed transformers), or None when transformers has it."""
    inner = dict(text_config_dict(model_dir))
    mt = inner.get("model_type", "")
    if MODEL_TYPE_ALIASES.get(mt, mt) in CONFIG_MAPPING:
        return None
    try:
        raw = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        raw = {}
    ships = "auto_map" in raw or "auto_map" in inner
    return (f"{model_dir / 'config.json'}: model_type {mt!r} is not built into transformers "
            f"{transformers.__version__}" + (" and the model ships its own code (auto_map)" if ships else ""))


def _hf_config(model_dir: Path, trust_remote_code: bool):
    inner = dict(text_config_dict(model_dir))
    # transformers writes inf / nan as {"__float__": "Infinity"} (e.g. a Mamba layer's time_step_limit) and
    # decodes them in from_pretrained; the raw dict handed to for_model needs the same
    decode = getattr(PreTrainedConfig, "_decode_special_floats", None)
    inner = decode(inner) if decode is not None else inner
    mt = inner.get("model_type", "")
    mt = MODEL_TYPE_ALIASES.get(mt, mt)
    if mt in CONFIG_MAPPING:
        inner.pop("model_type", None)
        for k in ("architectures", "auto_map", "transformers_version"):
            inner.pop(k, None)
        return AutoConfig.for_model(mt, **inner)
    reason = remote_code_reason(model_dir)
    if not trust_remote_code:
        raise UsageError(f"{reason}: loading it runs that code, and target.trust_remote_code is off",
                         hint=f"set target.trust_remote_code: true if you trust the Python files in {model_dir}, or "
                         "upgrade transformers to a version that has this model")
    try:
        return AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, OSError) as e:
        raise UsageError(f"{reason}; transformers cannot load it even with target.trust_remote_code: {e}",
                         hint="check the model dir's *.py files and config.json auto_map") from None


@dataclass
class Target:
    """A loaded, frozen target with hooks for feature taps."""

    model: nn.Module
    tokenizer: Any
    model_dir: Path
    device: torch.device
    dtype: torch.dtype

    @property
    def config(self):
        return self.model.config

    @property
    def num_layers(self) -> int:
        return len(self.decoder_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_input_embeddings().weight.shape[0])

    @property
    def decoder_layers(self) -> nn.ModuleList:
        inner = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.model
        return inner.layers

    @property
    def layer_types(self) -> list[str]:
        """Each decoder layer's kind as transformers names it: full_attention, sliding_attention, linear_attention
        (Gated DeltaNet, Mamba), hybrid (attention and Mamba in one layer), mlp, … (`target.hybrid`)."""
        return layer_types(self.config)

    @property
    def lm_head(self) -> nn.Module:
        """Output projection; for tied targets this shares the embedding weight (never random)."""
        return self.model.get_output_embeddings()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(input_ids)

    def features(self, input_ids: torch.Tensor, *, layer_ids: list[int], need_logits: bool = False,
                 need_last_hidden: bool = False, **forward_kwargs):
        """Run the target and capture the outputs of decoder layers `layer_ids` (concat, last dim).

        Returns `features` ([b, t, len(layer_ids)·H]), `(features, model_output)` if need_logits, or
        `(features, last_hidden)` if need_last_hidden: the final-norm output [b, t, H], from which
        `lm_head` gives the target's logits row by row (`next_token_ids`) without a [b, t, V] tensor.
        """
        if need_last_hidden and not need_logits:
            feats_out: list[torch.Tensor] = []
            out = self._taps(input_ids, layer_ids, True, feats_out, forward_kwargs, base=True)
            return feats_out[0], out.last_hidden_state
        feats_out = []
        out = self._taps(input_ids, layer_ids, need_logits, feats_out, forward_kwargs, base=False)
        return (feats_out[0], out) if need_logits else feats_out[0]

    @torch.no_grad()
    def next_token_ids(self, last_hidden: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
        """The target's greedy next token at every position: argmax lm_head(last_hidden), [b, t] int64.

        Computed `chunk` rows at a time, so the [b, t, V] logits never exist at once."""
        flat = last_hidden.reshape(-1, last_hidden.shape[-1])
        head = self.lm_head
        out = torch.empty(flat.shape[0], dtype=torch.long, device=flat.device)
        for i in range(0, flat.shape[0], chunk):
            out[i:i + chunk] = head(flat[i:i + chunk]).argmax(-1)
        return out.view(last_hidden.shape[:-1])

    def _taps(self, input_ids, layer_ids, run_all: bool, feats_out: list, forward_kwargs: dict, *, base: bool):
        layers = self.decoder_layers
        bad = [i for i in layer_ids if not 0 <= i < len(layers)]
        if bad:
            raise UsageError(f"target_layer_ids {bad} are outside the target's {len(layers)} layers",
                             hint="re-run `dflashkit probe` for this target, or fix drafter.target_layer_ids")
        captured: dict[int, torch.Tensor] = {}
        deepest = max(layer_ids)
        handles = []

        def make_hook(idx: int):
            def hook(_module, _inputs, output):
                captured[idx] = output[0] if isinstance(output, tuple) else output
                if not run_all and idx == deepest:
                    raise _StopForward
            return hook

        for idx in sorted(set(layer_ids)):
            handles.append(layers[idx].register_forward_hook(make_hook(idx)))
        out = None
        try:
            out = self.model.model(input_ids=input_ids, **forward_kwargs) if (base or not run_all) else \
                self.model(input_ids=input_ids, **forward_kwargs)
        except _StopForward:
            pass
        finally:
            for h in handles:
                h.remove()
        feats_out.append(torch.cat([captured[i] for i in layer_ids], dim=-1))
        return out


def load_tokenizer(model_dir: Path, *, gguf_file: str | None = None, trust_remote_code: bool = False,
                   tokenizer_dir: str | None = None):
    src = Path(tokenizer_dir) if tokenizer_dir else model_dir
    kw = {"gguf_file": gguf_file} if gguf_file and not tokenizer_dir else {}
    return AutoTokenizer.from_pretrained(src, trust_remote_code=trust_remote_code, **kw)


def _quantized_load_kwargs(model_dir: Path) -> dict[str, Any]:
    """`from_pretrained` keywords that load a quantized checkpoint dequantized into the target's dtype (FP8
    block-wise, compressed-tensors INT4), {} for an unquantized one; exit 2 naming the quantization and the
    engine command for one the local paths cannot load (`target.quantized`)."""
    q = check_checkpoint(model_dir)  # a corrupt file or tensors its config cannot describe: exit 2 naming them
    if q is not None:
        log.info("target %s: %s weights, loaded dequantized (the engine paths serve them as they are)",
                 model_dir, q.label)
    return local_load_kwargs(q, model_dir)


def _shape_mismatch(model_dir: Path, config: Any, trust_remote_code: bool) -> str:
    """The first tensor whose safetensors shape differs from the model `config` builds (on the meta device,
    no memory), as `file: tensor NAME has shape [..], config.json's model needs [..]`."""
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - only the message's detail is lost
        model = None
    want = {k: list(v.shape) for k, v in model.state_dict().items()} if model is not None else {}
    for name, e in sorted(tensor_entries(model_dir).items()):
        key = name.removeprefix("language_model.")
        if key in want and list(e.shape) != want[key]:
            return f"{e.file.name}: tensor {name} has shape {list(e.shape)}; config.json's model needs {want[key]}"
    return "a tensor's shape in the safetensors is not what config.json's model needs (transformers' report above)"


def load_target(section: TargetSpec, *, device: str | None = None, dtype: str | None = None,
                with_tokenizer: bool = True, announce_dtype: bool = True) -> Target:
    """Load the target described by a `TargetSection` (frozen, eval mode).

    Its dtype is `section.dtype` as `compute_dtype` resolves it, announced as `target.dtype` (once per process)
    unless `dtype` overrides it or `announce_dtype` is False: a caller that substitutes its own key's dtype
    into the section (eval's `eval.dtype`) announces that choice itself."""
    model_dir, gguf_file = resolve_target_path(section.path, section.gguf_file)
    dev = resolve_device(device or section.device)
    choice = compute_dtype(dtype or section.dtype, dev, key="target.dtype")
    if dtype is None and announce_dtype:
        announce(choice)
    dt = choice.dtype
    if gguf_file:
        converted = cache_dir() / "converted" / (model_dir.name + "-" + Path(gguf_file).stem)
        if not (converted / "model.safetensors").is_file():
            log.info("converting %s to safetensors in %s (once)", gguf_file, converted)
            convert_gguf(model_dir / gguf_file, converted)
        model_dir, gguf_file = converted, None
    if not (model_dir / "config.json").is_file():
        raise UsageError(f"{model_dir}: no config.json", hint="point target.path at a HF model directory")
    if not list(model_dir.glob("*.safetensors")):
        raise UsageError(f"{model_dir}: no *.safetensors weights (dflashkit loads safetensors only)",
                         hint="convert the checkpoint with save_pretrained(safe_serialization=True)")
    quant = _quantized_load_kwargs(model_dir)  # before any weight is read: exit 2 when not loadable here
    config = _hf_config(model_dir, section.trust_remote_code)
    with warnings.catch_warnings():  # ours only turns the checkpoint's own quantization_config's `dequantize` on
        warnings.filterwarnings("ignore", message="You passed `quantization_config`")
        try:
            model = AutoModelForCausalLM.from_pretrained(
                model_dir, config=config, dtype=dt, trust_remote_code=section.trust_remote_code,
                use_safetensors=True, key_mapping={r"^language_model\.": ""}, **quant)
        except RuntimeError as e:  # transformers refuses a tensor whose shape is not its config's
            if "mismatched" not in str(e):
                raise
            raise UsageError(f"{model_dir}: {_shape_mismatch(model_dir, config, section.trust_remote_code)}",
                             hint="the safetensors do not belong to this config.json: re-download the "
                                  "checkpoint, or restore the config it was saved with") from None
    model.to(dev).eval()
    model.requires_grad_(False)
    tok = load_tokenizer(model_dir, trust_remote_code=section.trust_remote_code,
                         tokenizer_dir=section.tokenizer) if with_tokenizer else None
    if tok is not None and section.chat_template:
        tok.chat_template = read_utf8(Path(section.chat_template).expanduser(), "target.chat_template")
    return Target(model=model, tokenizer=tok, model_dir=model_dir, device=dev, dtype=dt)
