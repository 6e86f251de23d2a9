"""The drafter contract: the facts every stage agrees on, and the z-lab `config.json` built from it.

Usage:
    ids = build_target_layer_ids(36, 5)          # [1, 9, 17, 25, 33]
    contract = DrafterContract.load(rd.contract_path)
    hf_config = contract.to_hf_config()          # dict for config.json (z-lab format)
    contract.family                              # its drafter family (dflashkit.family): what consumers ask
    contract.knobs                               # the family's own fields (DFlash2: conv_kernel_size, …)
    contract.layer_windows, contract.layer_causal  # per draft layer: sliding window W or None; in-block causality

The contract is family-agnostic data plus the family's `knobs`; what they mean (their checks, their
`dflash_config` keys, how a config.json declares them) is the family's, asked through `family`.
`contract.json` stays flat: the knobs are written and read as top-level keys.

Convention (dflash-spec §1.7, §2.3): `target_layer_ids` are 0-based decoder-layer indices; the
feature of layer `id` is the *output* of that decoder layer, i.e. HF `hidden_states[id + 1]`
(`hidden_states[0]` is the embedding output). Concatenation order = order of the ids.
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from dflashkit import family as families
from dflashkit.errors import MissingArtifactError, UsageError
from dflashkit.family.base import json_int, knob_problems
from dflashkit.family.dflash import attention_fields, mla_problems

log = logging.getLogger("dflashkit.contract")


def build_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """The reference formula: spread `num_features` ids over layers 1..L-3.

    Python's `round` (half to even) is part of the contract: (62, 5) → [1, 16, 30, 44, 59].
    """
    if num_features < 1:
        raise UsageError(f"number of target features must be >= 1, got {num_features}")
    if num_features == 1:
        return [num_target_layers // 2]
    if num_target_layers < 4:
        raise UsageError(f"the target has {num_target_layers} layers; DFlash needs >= 4 to pick "
                         "features by the reference formula",
                         hint="set drafter.target_layer_ids explicitly")
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + i * span / (num_features - 1))) for i in range(num_features)]


REPROBE_HINT = "re-run `dflashkit probe -c run.yaml` for this target"
STORED_DTYPES = ("float32", "bfloat16", "float16", "float64")  # what a drafter config.json's dtype / torch_dtype may say
FULL, SLIDING = "full_attention", "sliding_attention"   # the draft layer types (HF `layer_types` values)


def sliding_fields(layer_types: list[str] | None, sliding_window: int | None, num_layers: int) -> dict[str, Any]:
    """The contract's `layer_types` / `sliding_window` for `drafter.layer_types` / `drafter.sliding_window`: the
    explicit per-layer list and W when any layer slides, else both None (full attention, as before)."""
    types = resolve_layer_types(layer_types, sliding_window, num_layers)
    if SLIDING not in types:
        return {"layer_types": None, "sliding_window": None}
    return {"layer_types": types, "sliding_window": sliding_window}


def resolve_layer_types(layer_types: list[str] | None, sliding_window: int | None, num_layers: int) -> list[str]:
    """The explicit per-layer list: `layer_types` as given, else every layer sliding when a window is set
    (HF's reading of a config with `sliding_window` and no `layer_types`), else every layer full."""
    if layer_types is not None:
        return list(layer_types)
    return [SLIDING if sliding_window is not None else FULL] * num_layers


def layer_type_problems(layer_types: Any, sliding_window: Any, num_layers: int, *, key: str = "layer_types",
                        window_key: str = "sliding_window") -> list[str]:
    """What is wrong with a per-layer attention declaration (empty: fine), each problem naming its key (the
    config's `drafter.layer_types` and a drafter config.json's `layer_types` alike).

    `layer_types` is None (every layer full, or every layer sliding when a window is given) or one of
    `full_attention` / `sliding_attention` per draft layer; a sliding layer needs an integer window >= 1."""
    p = []
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        p.append(f"{window_key}: must be an integer >= 1 (or null), got {sliding_window!r}")
    if layer_types is None:
        return p
    if not isinstance(layer_types, list):
        return p + [f"{key}: must be a list of 'full_attention' / 'sliding_attention', one per draft layer, "
                    f"got {layer_types!r}"]
    if len(layer_types) != num_layers:
        p.append(f"{key}: {len(layer_types)} entries for {num_layers} draft layers (one per layer)")
    bad = sorted({str(t) for t in layer_types if t not in (FULL, SLIDING)})
    if bad:
        p.append(f"{key}: {bad} are not 'full_attention' or 'sliding_attention'")
    if SLIDING in layer_types and sliding_window is None:
        p.append(f"{key} has 'sliding_attention' layers but {window_key} is null (set the window W >= 1)")
    return p


def default_gamma(block_size: int) -> float:
    """Loss decay γ: 7 for B=16, 5 for B=10, 4 for B=8 (dflash-spec §3.4), else B/2 (min 1)."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, block_size / 2))


@dataclass(slots=True)  # slots: a misspelt (or another family's) field is an AttributeError, never ignored
class DrafterContract:
    """Everything later stages need about the target and the drafter. Written by `probe`."""

    block_size: int
    num_draft_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    num_target_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    target_model_type: str = ""
    target_architecture: str = ""
    mask_token_reason: str = ""
    bos_token_id: int | list[int] | None = None  # as the target config.json has it (like eos)
    eos_token_id: int | list[int] | None = None
    layer_types: list[str] | None = None  # per draft layer full_attention / sliding_attention; None = all full
    sliding_window: int | None = None     # W of the sliding layers: a block query at p sees context keys k > p − W
    # per draft layer in-block causality when it differs between layers: a released z-lab drafter with mixed
    # layer_types and no is_causal / dflash_config.causal, which vLLM runs causally in its sliding layers only
    # (`from_hf_config`); None = every layer the family's `causal` knob
    causal_layers: list[bool] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    drafter_type: str = "dflash"   # the drafter family (`drafter.type`, dflashkit.family)
    knobs: Any = None              # the family's own fields (its `knobs` dataclass); None = its defaults

    def __post_init__(self) -> None:
        if self.knobs is None and self.drafter_type in families.FAMILIES:
            self.knobs = families.FAMILIES[self.drafter_type].knobs()

    @property
    def family(self) -> families.Family:
        """The drafter family of `drafter_type` (UsageError naming it when unknown)."""
        return families.get(self.drafter_type, key="drafter_type")

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    @property
    def attention(self) -> dict[str, Any]:
        """What shapes the draft layers' attention tensors: {"attention_type": gqa | mla} plus MLA's ranks."""
        return attention_fields(self)

    @property
    def layer_windows(self) -> list[int | None]:
        """Per draft layer: its sliding window W, or None for a full-attention layer."""
        types = resolve_layer_types(self.layer_types, self.sliding_window, self.num_draft_layers)
        return [self.sliding_window if t == SLIDING else None for t in types]

    @property
    def layer_causal(self) -> list[bool]:
        """Per draft layer: causal in-block attention (offsets j <= i) or the whole block."""
        if self.causal_layers is not None:
            return list(self.causal_layers)
        return [bool(getattr(self.knobs, "causal", False))] * self.num_draft_layers

    def check(self, target: Any = None, *, where: str = "drafter", hint: str | None = None) -> None:
        """THE contract check: internal consistency and, given a target, whether the drafter fits it.

        Without `target` the layer ids and mask token are checked against the contract's own
        `num_target_layers` and `vocab_size`; with one (anything with `num_layers`, `hidden_size`,
        `vocab_size`: a loaded `Target` or `inspect_target` facts as a dict) against the target's,
        which must also match the contract's hidden and vocab sizes. Raises UsageError (exit 2)
        listing every problem; a different layer count alone is only a warning.
        """
        def fact(name: str) -> int:
            return int(target[name] if isinstance(target, dict) else getattr(target, name))

        layers = self.num_target_layers if target is None else fact("num_layers")
        vocab = self.vocab_size if target is None else fact("vocab_size")
        problems = []
        if self.hidden_size <= 0:
            problems.append(f"hidden_size must be > 0, got {self.hidden_size}")
        bad = [i for i in self.target_layer_ids if not 0 <= i < layers]
        if bad:
            problems.append(f"target_layer_ids {bad} are outside the target's layers [0, {layers})")
        if not 0 <= self.mask_token_id < vocab:
            problems.append(f"mask_token_id {self.mask_token_id} is outside the target vocab [0, {vocab})")
        if target is not None:
            if self.hidden_size != fact("hidden_size"):
                problems.append(f"hidden_size {self.hidden_size} != the target's {fact('hidden_size')}")
            if self.vocab_size and self.vocab_size != vocab:
                problems.append(f"vocab_size {self.vocab_size} != the target's {vocab}")
        if self.num_attention_heads % max(1, self.num_key_value_heads):
            problems.append(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                            f"num_key_value_heads {self.num_key_value_heads}")
        if self.block_size < 1:
            problems.append(f"block_size must be >= 1, got {self.block_size}")
        problems.extend(layer_type_problems(self.layer_types, self.sliding_window, self.num_draft_layers))
        if self.causal_layers is not None:
            sliding = [t == SLIDING for t in resolve_layer_types(self.layer_types, self.sliding_window,
                                                                 self.num_draft_layers)]
            if self.causal_layers != sliding or getattr(self.knobs, "causal", False):
                problems.append(f"causal_layers {self.causal_layers} must be causal exactly in the sliding layers "
                                f"({sliding}) with the causal knob false (the one per-layer causality a config.json "
                                "can declare: vLLM's reading of mixed layer_types without is_causal)")
        if self.drafter_type in families.FAMILIES:
            fam = self.family
            if type(self.knobs) is fam.knobs:  # exactly: DFlash2's knobs extend DFlash's
                # the declared types and ranges first: the family's cross-field rules compare values in range
                problems.extend(knob_problems(self) or fam.contract_problems(self) + mla_problems(self))
            else:
                problems.append(f"knobs {type(self.knobs).__name__} are not the {fam.title} family's "
                                f"{fam.knobs.__name__} (build the contract with DrafterContract.from_dict)")
        else:
            problems.append(f"drafter_type {self.drafter_type!r} is not one of {families.names()}")
        if problems:
            if target is None:
                raise UsageError("invalid drafter contract: " + "; ".join(problems), hint=hint)
            name = target.get("model_dir") if isinstance(target, dict) else getattr(target, "model_dir", None)
            raise UsageError(f"{where} does not fit the target{f' {name}' if name else ''}: " + "; ".join(problems),
                             hint=hint or "use a drafter trained for this target, or set target.path to its target")
        if target is not None and self.num_target_layers and self.num_target_layers != layers:
            log.warning("%s was built for a %d-layer target; this target has %d layers",
                        where, self.num_target_layers, layers)

    def to_dict(self) -> dict[str, Any]:
        """The flat `contract.json` record: the fields, then the family's knobs as top-level keys."""
        out = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self) if f.name != "knobs"}
        return {**out, **(asdict(self.knobs) if self.knobs is not None else {})}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DrafterContract":
        names = {f.name for f in fields(cls)} - {"knobs"}
        c = cls(**{k: v for k, v in data.items() if k in names})
        if c.drafter_type in families.FAMILIES:
            c.knobs = c.family.make_knobs(data)
        return c

    @classmethod
    def load(cls, path: str | Path) -> "DrafterContract":
        p = Path(path)
        if not p.is_file():
            raise MissingArtifactError("drafter contract", p, run="dflashkit probe -c run.yaml")
        try:
            return cls.from_dict(json.loads(p.read_text()))
        except (json.JSONDecodeError, TypeError) as e:
            raise UsageError(f"{p}: not a valid drafter contract ({e})",
                             hint="re-run `dflashkit probe -c run.yaml`") from None

    def to_hf_config(self, *, dtype: str = "bfloat16", draft_vocab_size: int | None = None) -> dict[str, Any]:
        """The z-lab `config.json` (dflash-spec §2.1): a Qwen3 config plus DFlash keys, and the family's own
        (`dflash_config` and top-level ones: a causal drafter's `is_causal`).

        `draft_vocab_size` (a reduced draft vocabulary) adds the top-level key vLLM reads and the
        same value in `dflash_config`; without it the config is exactly the full-vocab one.
        """
        fam = self.family
        cfg: dict[str, Any] = {
            "architectures": [fam.architecture],
            "model_type": "qwen3",
            "auto_map": {"AutoModel": f"dflash.{fam.architecture}"},
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_draft_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "layer_types": resolve_layer_types(self.layer_types, self.sliding_window, self.num_draft_layers),
            "sliding_window": None,
            "use_sliding_window": False,
            "tie_word_embeddings": False,
            "initializer_range": 0.02,
            "dtype": dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {
                "block_size": self.block_size,
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
                "num_target_layers": self.num_target_layers,
            },
        }
        if draft_vocab_size:
            items = list(cfg.items())
            at = [k for k, _ in items].index("vocab_size") + 1  # next to vocab_size, where readers look
            cfg = dict(items[:at] + [("draft_vocab_size", int(draft_vocab_size))] + items[at:])
            cfg["dflash_config"]["draft_vocab_size"] = int(draft_vocab_size)
        cfg["dflash_config"].update(fam.formats.dflash_config(self))
        cfg.update(fam.formats.hf_keys(self))
        if any(w is not None for w in self.layer_windows):
            cfg["sliding_window"], cfg["use_sliding_window"] = self.sliding_window, True
            # vLLM 0.32 makes a sliding layer's in-block attention causal unless is_causal / dflash_config.causal
            # say otherwise (`_dflash_layer_causal`): state it either way, unless that per-layer reading is the
            # drafter's own (`causal_layers`)
            if self.causal_layers is None:
                causal = bool(getattr(self.knobs, "causal", False))
                cfg["is_causal"] = cfg["dflash_config"]["causal"] = causal
        return cfg

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], *, source: str = "config.json") -> "DrafterContract":
        """Read a z-lab drafter `config.json` (import of an existing checkpoint); its family is the one its
        `architectures` declare (`family.by_architecture`), which reads its own knobs."""
        dc = cfg.get("dflash_config")
        if not isinstance(dc, dict):
            raise UsageError(f"{source}: no `dflash_config` (z-lab format) and no `speculators_model_type` "
                             "(vLLM speculators format) — not a DFlash drafter config",
                             hint="export with `dflashkit export`, or add dflash_config "
                             "{mask_token_id, target_layer_ids}")
        for key in ("dtype", "torch_dtype"):  # `import` copies config.json as it is: a bogus dtype would travel on
            if cfg.get(key) is not None and cfg[key] not in STORED_DTYPES:
                raise UsageError(f"{source}: {key} {cfg[key]!r} is not one of {list(STORED_DTYPES)}",
                                 hint=f"fix {source}: set {key} to the dtype of the drafter's weights")
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads") if k not in cfg]
        if "mask_token_id" not in dc:
            missing.append("dflash_config.mask_token_id")
        if missing:
            raise UsageError(f"{source}: missing keys {missing}")
        def num(value: Any, key: str) -> int:  # a JSON integer: "4" or true is an error naming the key
            return json_int(value, key, source)

        num_layers = num(cfg["num_hidden_layers"], "num_hidden_layers")
        n_target = num(dc.get("num_target_layers", cfg.get("num_target_layers", 0)) or 0, "num_target_layers")
        raw_ids = dc.get("target_layer_ids")
        if raw_ids is not None and not isinstance(raw_ids, list):
            raise UsageError(f"{source}: dflash_config.target_layer_ids must be a list, got {raw_ids!r}")
        ids = [num(i, "dflash_config.target_layer_ids[]") for i in raw_ids] if raw_ids else \
            build_target_layer_ids(n_target, num_layers)
        heads = num(cfg["num_attention_heads"], "num_attention_heads")
        hidden = num(cfg["hidden_size"], "hidden_size")
        fam = families.by_architecture(cfg.get("architectures"))
        types, window = read_layer_types(cfg, dc, num_layers, source)
        causal_layers = None
        if (types is not None and FULL in types and cfg.get("is_causal") is None and dc.get("causal") is None
                and cfg.get("layer_types") == types):
            # mixed layers, no explicit causality: vLLM attends causally in the sliding layers only
            causal_layers = [t == SLIDING for t in types]
            dc = {**dc, "causal": False}  # the family knob: the full layers' (bidirectional)
        return cls(
            block_size=num(dc.get("block_size", cfg.get("block_size", 16)), "block_size"),
            num_draft_layers=num_layers,
            target_layer_ids=ids,
            mask_token_id=num(dc["mask_token_id"], "dflash_config.mask_token_id"),
            num_target_layers=n_target or (max(ids) + 3),
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=num(cfg.get("num_key_value_heads", heads), "num_key_value_heads"),
            head_dim=num(cfg.get("head_dim") or hidden // heads, "head_dim"),
            intermediate_size=num(cfg.get("intermediate_size", 4 * hidden), "intermediate_size"),
            vocab_size=num(cfg.get("vocab_size", 0), "vocab_size"),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 1e4))),
            rope_scaling=cfg.get("rope_scaling"),
            max_position_embeddings=num(cfg.get("max_position_embeddings", 4096), "max_position_embeddings"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            layer_types=types,
            sliding_window=window,
            causal_layers=causal_layers,
            drafter_type=fam.name,
            knobs=fam.make_knobs(fam.formats.read_knobs(cfg, dc, source)),
        )


def read_layer_types(cfg: dict[str, Any], dc: dict[str, Any], num_layers: int, source: str
                     ) -> tuple[list[str] | None, int | None]:
    """(layer_types, sliding_window) of a z-lab drafter config.json, as vLLM 0.32 reads them: `layer_types`
    with the top-level `sliding_window` (or `dflash_config.swa_window_size`); `dflash_config.use_swa` without
    sliding layers makes every layer slide. (None, None) for an all-full-attention drafter; UsageError naming
    the key when the declaration is malformed."""
    types = cfg.get("layer_types")
    window = dc.get("swa_window_size", cfg.get("sliding_window"))
    if dc.get("use_swa") and not (isinstance(types, list) and SLIDING in types):
        types = [SLIDING] * num_layers
    if isinstance(types, list) and all(t == FULL for t in types):
        return None, None  # full attention everywhere: a stray window (HF's default 4096) means nothing
    problems = layer_type_problems(types, window, num_layers, window_key="dflash_config.swa_window_size"
                                   if "swa_window_size" in dc else "sliding_window")
    if problems:
        raise UsageError(f"{source}: " + "; ".join(problems),
                         hint="give layer_types one full_attention / sliding_attention per draft layer "
                         "(num_hidden_layers) and sliding_window W >= 1 when any layer slides")
    if types is None or SLIDING not in types or window is None:
        return None, None
    return list(types), int(window)
