"""Which decoder layers of a target keep a recurrent state instead of per-token keys and values, and the refusals
of paths that cannot handle them.

Usage:
    layer_types(model.config)                   # ["linear_attention", "linear_attention", "full_attention", …]
    dir_layer_types(model_dir)                  # the same from a model dir's config.json (no weights)
    recurrent_summary(types)                    # "3 linear_attention + 1 full_attention", None without recurrent layers
    refuse_recurrent("train.on_path=rollout", model_dir, why="…", instead="use train.on_path=mask")   # exit 2

Layer kinds are transformers' names (`config.layer_types`, the keys of its cache-layer mapping):
full_attention / sliding_attention / chunked_attention keep keys and values per token; linear_attention (Gated
DeltaNet in Qwen3-Next and Qwen3.5, Mamba-2 in Bamba, Nemotron-H, Jamba), conv (short convolutions) and hybrid /
hybrid_sliding (attention and Mamba side by side in one layer, Falcon-H1) keep a recurrent and convolution state
that a rollback has to restore (decode/rollback.py); mlp / moe layers keep nothing. The HF config object knows
each architecture's types (Bamba derives them from `attn_layer_indices`, Nemotron-H from `layers_block_type`),
so they are read from it, not from config.json's keys. `layer_types` and `RECURRENT_LAYER_TYPES` live in
`target.load` (the target's facts) and are re-exported here.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from dflashkit.errors import UsageError
from dflashkit.target.load import RECURRENT_LAYER_TYPES, _hf_config, layer_types, text_config_dict

__all__ = ["RECURRENT_LAYER_TYPES", "architecture_of", "dir_layer_types", "layer_types", "recurrent_summary",
           "refuse_recurrent"]

log = logging.getLogger("dflashkit.target")


def dir_layer_types(model_dir: str | Path, trust_remote_code: bool = False) -> list[str]:
    """`layer_types` of the model in `model_dir`, from its config alone (no weights): the HF config object when
    transformers can build it, else config.json's own `layer_types` (its text config)."""
    model_dir = Path(model_dir)
    try:
        return layer_types(_hf_config(model_dir, trust_remote_code))
    except Exception as e:  # noqa: BLE001 - an unbuildable config: fall back to the raw field
        log.debug("%s: reading layer_types from config.json (%s)", model_dir, e)
        return layer_types(text_config_dict(model_dir))


def recurrent_summary(types: list[str]) -> str | None:
    """"3 linear_attention + 1 full_attention" (counts in first-seen order) when some layer keeps a recurrent
    state, else None."""
    if not RECURRENT_LAYER_TYPES & set(types):
        return None
    counts: dict[str, int] = {}
    for t in types:
        counts[t] = counts.get(t, 0) + 1
    return " + ".join(f"{n} {t}" for t, n in counts.items())


def architecture_of(model_dir: Path) -> str:
    """The architecture config.json names (its `architectures[0]`, else its model_type), for messages."""
    try:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return "?"
    arch = raw.get("architectures") or []
    return str(arch[0]) if arch else str(raw.get("model_type", "?"))


def refuse_recurrent(what: str, model_dir: str | Path, *, why: str, instead: str,
                     trust_remote_code: bool = False) -> None:
    """Raise UsageError (exit 2) when the target in `model_dir` has linear-attention / state-space layers:
    `what` (the key or stage) cannot handle them because `why`; the message names the target, its architecture
    and its layer types, the hint says `instead`. Nothing happens for a target of attention layers only."""
    summary = recurrent_summary(dir_layer_types(model_dir, trust_remote_code))
    if summary is None:
        return
    raise UsageError(f"{what}: the target {model_dir} ({architecture_of(Path(model_dir))}) has linear-attention / "
                     f"state-space layers ({summary}); {why}", hint=instead)
