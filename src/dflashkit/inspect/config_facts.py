"""Model facts from `config.json` alone (the json module; no transformers, no weights).

Usage:
    raw = read_config_json(Path("Kimi-K2.6/config.json"))    # exit 2 naming file:line on bad JSON
    facts = facts_from_config(raw, source="Kimi-K2.6/config.json")
    facts.num_layers, facts.attention, facts.moe, facts.params_total, facts.params_active

Wrappers (`text_config`, `language_config`, `llm_config`, `thinker_config`, …) are resolved to
the language model's own config; keys the wrapper alone carries (vocab, eos, dtype, tying,
quantization) are read from the outer config. Key aliases cover GPT-2/Falcon/ChatGLM/MoE spellings.

Parameter estimate (weights only, biases ignored; `params_total` excludes MTP layers, which are
reported as `params_mtp`):
    embed      = V·H (+ V·H for the LM head unless tied)
    attention  = H·nh·d + 2·H·nkv·d + nh·d·H                     (MHA/GQA/MQA)
    MLA        = [H·q_lora + q_lora·nh·(nope+rope) | H·nh·(nope+rope)] + H·(kv_lora+rope)
                 + kv_lora·nh·(nope+v) + nh·v·H
    dense MLP  = m·H·I            (m = 3 for gated SwiGLU/GeGLU MLPs, 2 otherwise)
    MoE layer  = E·m·H·I_e + shared·m·H·I_s + H·E (router); active uses top-k instead of E
    norms      = 2·H per layer + H (+ 2·d per layer for q/k-norm families such as Qwen3)
    router     = H·E (+ E for DeepSeek-style score-correction bias)
MoE layers: L − first_k_dense_replace (DeepSeek/Kimi), every `decoder_sparse_step`-th layer not in
`mlp_only_layers` (Qwen MoE), else all L. Active parameters count the embedding and the LM head.
"""

from __future__ import annotations

import json
import numbers
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dflashkit.errors import UsageError
from dflashkit.target.quantized import LOCAL_METHODS, PASS_THROUGH, quant_info

WRAPPER_KEYS = ("text_config", "language_config", "llm_config", "thinker_config", "language_model_config",
                "lm_config", "decoder")
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
HIDDEN_KEYS = ("hidden_size", "d_model", "n_embd", "dim", "model_dim")
HEAD_KEYS = ("num_attention_heads", "n_head", "num_heads", "n_heads")
KV_KEYS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num", "n_kv_heads")
FFN_KEYS = ("intermediate_size", "ffn_hidden_size", "n_inner", "ffn_dim")
VOCAB_KEYS = ("vocab_size", "padded_vocab_size", "n_vocab")
EXPERT_KEYS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
TOPK_KEYS = ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "experts_per_token", "moe_k")
CTX_KEYS = ("max_position_embeddings", "n_positions", "seq_length", "max_sequence_length", "n_ctx")
MTP_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers")
# families whose MLP is not gated (two matrices instead of three)
NON_GATED = {"gpt2", "gpt_neox", "gptj", "gpt_bigcode", "opt", "bloom", "falcon", "phi", "starcoder2",
             "bert", "mpt"}
# families with per-head RMSNorm on q and k (2·head_dim weights per layer)
QK_NORM = {"qwen3", "qwen3_moe", "qwen3_next", "gemma3_text", "olmo2", "olmoe"}


@dataclass
class ModelFacts:
    """What probe reports about a target; `to_dict()` is the JSON form."""

    source: str
    format: str  # "hf" | "gguf"
    model_type: str  # the outer config's (e.g. kimi_k25)
    architecture: str
    wrapper: str | None  # dotted key of the language model's config inside the outer one
    text_model_type: str  # the language model's own (e.g. kimi_k2); = model_type when unwrapped
    text_architecture: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    attention: str  # MHA | GQA | MQA | MLA
    mla: dict[str, int | None] | None = None
    moe: dict[str, Any] | None = None
    rope: dict[str, Any] = field(default_factory=dict)
    max_position_embeddings: int | None = None
    tie_word_embeddings: bool = False
    mtp_layers: int = 0
    sliding_window: int | None = None
    layer_types: dict[str, int] | None = None
    hybrid_attention: bool = False
    dtype: str | None = None
    quantization: dict[str, Any] | None = None
    rms_norm_eps: float | None = None
    hidden_act: str | None = None
    bos_token_id: int | list[int] | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    params_total: int = 0
    params_active: int = 0
    params_mtp: int = 0
    defaults_filled: list[str] = field(default_factory=list)  # keys taken from transformers' defaults
    checkpoint: str | None = None  # why the safetensors cannot be what config.json says (`check_checkpoint`)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def read_config_json(path: Path) -> dict[str, Any]:
    """Parse a config.json; UsageError (exit 2) naming the file (and line:col for JSON errors)."""
    if not path.is_file():
        raise UsageError(f"{path}: no config.json", hint="point `dflashkit probe` at a HF model dir "
                         "(with config.json), a .gguf file, or an asset name such as smollm2-135m-instruct")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UsageError(f"{path}:{e.lineno}:{e.colno}: malformed JSON ({e.msg})",
                         hint="fix the file or re-download the model's config.json") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"{path}: not UTF-8 text ({e.reason})") from None
    if not isinstance(raw, dict) or not raw:
        raise UsageError(f"{path}: empty or not a JSON object",
                         hint="config.json must be the model's HF config (num_hidden_layers, hidden_size, …)")
    return raw


def _first(cfg: dict, keys: tuple[str, ...], default: Any = None) -> Any:
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


def resolve_wrapper(raw: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """Descend `text_config`-style wrappers (up to 3 levels) to the language model's config."""
    inner, path = raw, []  # type: dict[str, Any], list[str]
    for _ in range(3):
        for key in WRAPPER_KEYS:
            sub = inner.get(key)
            if isinstance(sub, dict) and (any(k in sub for k in LAYER_KEYS + HIDDEN_KEYS)
                                          or any(isinstance(sub.get(w), dict) for w in WRAPPER_KEYS)):
                inner, path = sub, path + [key]
                break
        else:
            break
    return inner, (".".join(path) or None)


def _fill_defaults(cfg: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Sparse nested configs (Gemma 3's `text_config` omits heads/vocab): the defaults of the
    transformers config class for that model_type, when transformers is importable. Wrapped
    configs only — a top-level config missing its layer count stays an error."""
    groups = (LAYER_KEYS, HIDDEN_KEYS, HEAD_KEYS, VOCAB_KEYS)
    if all(_first(cfg, g) is not None for g in groups) or not cfg.get("model_type"):
        return cfg, []
    try:
        from transformers import CONFIG_MAPPING

        kwargs = {k: v for k, v in cfg.items() if k != "model_type"}
        full = CONFIG_MAPPING[cfg["model_type"]](**kwargs).to_dict()
    except Exception:  # noqa: BLE001 - unknown type / transformers absent: report what the file has
        return cfg, []
    filled = sorted(k for k in full if k not in cfg and full[k] is not None)
    return {**full, **cfg}, filled


def _rope(cfg: dict[str, Any]) -> dict[str, Any]:
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        params = params.get("full_attention") or next(iter(params.values()))  # per-layer-type (Gemma 3)
    scaling = cfg.get("rope_scaling")
    if not isinstance(scaling, dict):
        scaling = params if isinstance(params, dict) else None
    theta = cfg.get("rope_theta") or (params or {}).get("rope_theta") or cfg.get("rotary_emb_base")
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    scaling = {k: v for k, v in (scaling or {}).items() if k != "rope_theta"} if kind != "default" else None
    return {"type": kind, "theta": float(theta) if theta is not None else 10000.0, "scaling": scaling,
            "partial_rotary_factor": cfg.get("partial_rotary_factor")}


def _layer_types(cfg: dict[str, Any], n: int) -> tuple[dict[str, int] | None, int | None]:
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False:
        window = None
    types = cfg.get("layer_types")
    if not isinstance(types, list) and window and cfg.get("sliding_window_pattern"):
        p = int(cfg["sliding_window_pattern"])  # Gemma: every p-th layer is global
        types = ["full_attention" if (i + 1) % p == 0 else "sliding_attention" for i in range(n)]
    if not isinstance(types, list):
        return None, window
    counts: dict[str, int] = {}
    for t in types:
        counts[str(t)] = counts.get(str(t), 0) + 1
    return counts, window


def _quant(cfg: dict[str, Any], source: str, key: str = "quantization_config") -> dict[str, Any] | None:
    info = quant_info(cfg, source=source, key=key)  # ConfigError naming `source` and the key when malformed
    q = cfg.get("quantization_config")
    if info is None or not isinstance(q, dict):
        return None
    bits = q.get("bits") or q.get("num_bits")
    for group in (q.get("config_groups") or {}).values():  # compressed-tensors
        bits = bits or ((group or {}).get("weights") or {}).get("num_bits")
    method = str(q.get("quant_method", "")).lower()
    if bits is None:
        bits = 8 if "fp8" in method else 4 if "fp4" in method else None

    method_ = info.method
    local = ("dequantized" if method_ in LOCAL_METHODS and (method_ != "fp8" or info.block)
             else "transformers" if method_ in PASS_THROUGH else "refused")
    return {"method": q.get("quant_method"), "bits": bits, "format": q.get("fmt") or q.get("format"),
            "label": info.label, "local_load": local,  # what the paths do: inspect/paths.py
            **({"block": list(info.block)} if info.block else {})}


def _positive_int(value: Any, what: str, source: str) -> int:
    """A count from config.json: a JSON integer >= 1 (a string, bool or fraction is an error naming the file)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or (not isinstance(value, numbers.Integral)
                                                                          and not float(value).is_integer()):
        raise UsageError(f"{source}: {what} must be an integer, got {value!r} ({type(value).__name__})",
                         hint=f"fix {source}: write the number without quotes")
    if value < 1:
        raise UsageError(f"{source}: {what} must be >= 1, got {value!r}", hint=f"fix {source}")
    return int(float(value))


def _shape(cfg: dict[str, Any], source: str, wrapper: str | None) -> tuple[int, int, int, int]:
    """(layers, hidden size, attention heads, key/value heads), each a count >= 1; UsageError naming `source` when
    one is missing or not a count."""
    n_layers = _first(cfg, LAYER_KEYS)
    if n_layers is None:
        raise UsageError(f"{source}: no layer count (looked for {', '.join(LAYER_KEYS)}"
                         + (f" under `{wrapper}`" if wrapper else "") + ")",
                         hint="is this a causal LM config.json? multimodal wrappers must nest the language "
                         "model under text_config/language_config/llm_config")
    hidden = _first(cfg, HIDDEN_KEYS)
    heads = _first(cfg, HEAD_KEYS)
    if hidden is None or heads is None:
        missing = [n for n, v in (("hidden size (" + "/".join(HIDDEN_KEYS) + ")", hidden),
                                  ("attention heads (" + "/".join(HEAD_KEYS) + ")", heads)) if v is None]
        raise UsageError(f"{source}: no {' and no '.join(missing)}")
    n_layers = _positive_int(n_layers, "layer count (" + "/".join(LAYER_KEYS) + ")", source)
    hidden = _positive_int(hidden, "hidden size (" + "/".join(HIDDEN_KEYS) + ")", source)
    heads = _positive_int(heads, "attention heads (" + "/".join(HEAD_KEYS) + ")", source)
    kv = _first(cfg, KV_KEYS)
    if kv is None:
        kv = 1 if cfg.get("multi_query") else heads
    kv = _positive_int(kv, "key/value heads (" + "/".join(KV_KEYS) + ")", source)
    return n_layers, hidden, heads, kv


def _mla(cfg: dict[str, Any]) -> dict[str, int | None] | None:
    """Multi-head latent attention's ranks and head dims (DeepSeek V2/V3, Kimi K2), or None without kv_lora_rank."""
    if not cfg.get("kv_lora_rank"):
        return None
    return {k: (int(cfg[k]) if cfg.get(k) is not None else None) for k in
            ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}


def _moe(cfg: dict[str, Any], n_layers: int, hidden: int, ffn: Any, model_type: str) -> dict[str, Any] | None:
    """The experts, their sizes and which layers are MoE layers (module docstring), or None for a dense model."""
    n_exp = _first(cfg, EXPERT_KEYS)
    if not (n_exp and int(n_exp) > 1):
        return None
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    step = int(cfg.get("decoder_sparse_step") or 1)
    mlp_only = set(cfg.get("mlp_only_layers") or [])
    moe_layers = [i for i in range(n_layers) if i >= first_dense and (i + 1) % step == 0 and i not in mlp_only]
    exp_ffn = int(cfg.get("moe_intermediate_size") or cfg.get("expert_intermediate_size") or ffn or 4 * hidden)
    shared = int(cfg.get("n_shared_experts") or cfg.get("num_shared_experts") or 0)
    shared_ffn = cfg.get("shared_expert_intermediate_size")
    if shared_ffn and not shared:
        shared = 1  # Qwen2-MoE: one shared expert with its own size
    return {"num_experts": int(n_exp), "num_shared_experts": shared,
            "experts_per_token": int(_first(cfg, TOPK_KEYS, 1)), "first_k_dense_replace": first_dense,
            "moe_intermediate_size": exp_ffn, "shared_intermediate_size": int(shared_ffn or exp_ffn),
            "num_moe_layers": len(moe_layers),
            "router_bias": cfg.get("topk_method") == "noaux_tc" or model_type in ("deepseek_v3", "kimi_k2")}


def facts_from_config(raw: dict[str, Any], *, source: str, fmt: str = "hf") -> ModelFacts:
    """Facts from a parsed config.json (or a GGUF metadata dict shaped like one).

    Args:
        raw: the parsed JSON object (wrappers are resolved here).
        source: file name used in error messages and in `facts.source`.
        fmt: "hf" or "gguf".
    Returns:
        ModelFacts with the parameter estimate filled in.
    Raises:
        UsageError: (exit 2) no layer count / hidden size / heads / vocab size, naming `source`.
    """
    cfg, wrapper = resolve_wrapper(raw)
    defaults_filled: list[str] = []
    if wrapper:
        cfg, defaults_filled = _fill_defaults(cfg)

    def get(keys: tuple[str, ...], default: Any = None) -> Any:  # inner first, then the wrapper
        v = _first(cfg, keys)
        return v if v is not None else _first(raw, keys, default)

    n_layers, hidden, heads, kv = _shape(cfg, source, wrapper)
    head_dim = int(cfg.get("head_dim") or cfg.get("kv_channels") or hidden // heads)
    model_type = str(cfg.get("model_type") or raw.get("model_type") or "")
    archs = cfg.get("architectures") or raw.get("architectures") or [""]
    act = cfg.get("hidden_act") or cfg.get("hidden_activation") or cfg.get("activation_function")
    mla = _mla(cfg)
    attention = "MLA" if mla else ("MHA" if kv == heads else "MQA" if kv == 1 else "GQA")
    ffn = get(FFN_KEYS)
    moe = _moe(cfg, n_layers, hidden, ffn, model_type)
    layer_types, window = _layer_types(cfg, n_layers)
    vocab = get(VOCAB_KEYS)
    if vocab is None:
        raise UsageError(f"{source}: no vocab size (looked for {', '.join(VOCAB_KEYS)})")
    vocab = _positive_int(vocab, "vocab size (" + "/".join(VOCAB_KEYS) + ")", source)
    tie = cfg.get("tie_word_embeddings")
    if tie is None:
        tie = raw.get("tie_word_embeddings", True if model_type.startswith("gemma") else False)
    facts = ModelFacts(
        source=source, format=fmt, model_type=str(raw.get("model_type") or model_type),
        architecture=str((raw.get("architectures") or archs)[0]), wrapper=wrapper,
        text_model_type=model_type, text_architecture=str(archs[0]), num_layers=n_layers,
        hidden_size=hidden, num_attention_heads=heads,
        num_key_value_heads=kv, head_dim=head_dim, intermediate_size=int(ffn or 4 * hidden),
        vocab_size=int(vocab), attention=attention, mla=mla, moe=moe, rope=_rope(cfg),
        max_position_embeddings=(int(get(CTX_KEYS)) if get(CTX_KEYS) else None),
        tie_word_embeddings=bool(tie), mtp_layers=int(_first(cfg, MTP_KEYS, 0) or 0),
        sliding_window=int(window) if window else None, layer_types=layer_types,
        hybrid_attention=bool(layer_types and len(layer_types) > 1),
        dtype=str(get(("dtype", "torch_dtype")) or "") or None,
        quantization=_quant(cfg, source, f"{wrapper}.quantization_config" if wrapper else "quantization_config")
        or _quant(raw, source), rms_norm_eps=get(("rms_norm_eps", "layer_norm_epsilon",
                                                                    "layer_norm_eps", "norm_eps")),
        hidden_act=str(act) if act else None, bos_token_id=get(("bos_token_id",)),
        eos_token_id=get(("eos_token_id",)), pad_token_id=get(("pad_token_id",)),
    )
    facts.defaults_filled = defaults_filled
    facts.params_total, facts.params_active, facts.params_mtp = estimate_params(facts)
    return facts


def _attention_params(f: ModelFacts) -> int:
    h = f.hidden_size
    if f.mla:
        m = f.mla
        nope, rope = m["qk_nope_head_dim"] or 128, m["qk_rope_head_dim"] or 64
        v, kvl, ql = m["v_head_dim"] or 128, m["kv_lora_rank"] or 0, m["q_lora_rank"]
        nh = f.num_attention_heads
        q = (h * ql + ql + ql * nh * (nope + rope)) if ql else h * nh * (nope + rope)
        return q + h * (kvl + rope) + kvl + kvl * nh * (nope + v) + nh * v * h
    d = f.head_dim
    qk_norm = 2 * d if f.text_model_type in QK_NORM else 0
    return h * f.num_attention_heads * d * 2 + 2 * h * f.num_key_value_heads * d + qk_norm


def estimate_params(f: ModelFacts) -> tuple[int, int, int]:
    """(total, active, mtp) weight counts by the formula in the module docstring."""
    h, n = f.hidden_size, f.num_layers
    mats = 2 if f.text_model_type in NON_GATED else 3
    embed = f.vocab_size * h * (1 if f.tie_word_embeddings else 2)
    attn = _attention_params(f)
    dense_mlp = mats * h * f.intermediate_size
    norms = 2 * h
    if f.moe:
        m = f.moe
        e_ffn, s_ffn = m["moe_intermediate_size"], m["shared_intermediate_size"]
        shared = m["num_shared_experts"] * mats * h * s_ffn
        router = h * m["num_experts"] + (m["num_experts"] if m.get("router_bias") else 0)
        moe_total = m["num_experts"] * mats * h * e_ffn + shared + router
        moe_active = m["experts_per_token"] * mats * h * e_ffn + shared + router
        n_moe = m["num_moe_layers"]
    else:
        moe_total = moe_active = n_moe = 0
    n_dense = n - n_moe
    body = n * (attn + norms) + n_dense * dense_mlp
    total = embed + body + n_moe * moe_total + h
    active = embed + body + n_moe * moe_active + h
    mtp_layer = attn + norms + (moe_total if f.moe else dense_mlp) + 2 * h * h + 3 * h
    return int(total), int(active), int(f.mtp_layers * mtp_layer)


def read_model_facts(model_dir: Path) -> ModelFacts:
    """Facts for a HF dir (its config.json); a GGUF file goes through `gguf_facts.read_gguf_facts`.

    Raises:
        UsageError: (exit 2) missing/empty/malformed config.json (file:line:col).
    """
    path = model_dir / "config.json"
    return facts_from_config(read_config_json(path), source=str(path))
