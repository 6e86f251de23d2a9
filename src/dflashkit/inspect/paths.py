"""Which dflashkit paths work on a target, from its config facts alone (what `probe` and `plan` print).

Usage:
    rows = target_paths(facts.to_dict())      # [{"path": "local: …", "verdict": "yes …"}, …]

Two properties of a target decide it: its quantization (`facts["quantization"]`, `target/quantized.py`:
FP8 block-wise and compressed-tensors INT4 load dequantized on the local paths, MXFP4 as transformers
loads it, anything else is refused there) and recurrent layers (`facts["layer_types"]`: Gated DeltaNet /
Mamba layers, docs/hybrid-targets.md: lossless rollback in the local decoder, `train.on_path=rollout`
refused, vLLM's CPU build refused). A checkpoint whose tensors cannot be what its config says
(`facts["checkpoint"]`, `target/quantized.check_checkpoint`) is refused on the local paths first. The
verdicts are what the stages do; each refusal is exit 2 before any work, naming the target and what to
use instead.
"""

from __future__ import annotations

from typing import Any

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
RECURRENT = ("linear_attention", "conv", "hybrid", "hybrid_sliding", "mamba")  # target/load.py's kinds

LOCAL = "local: capture.engine=local, train online (replicate / shard), eval, serve"
ENGINE = "engine: capture.engine=vllm, train.features=engine, verify-engine"
HEAD = "head parts (engine-fed / cached training)"
ROLLOUT = "train.on_path=rollout"


def _recurrent(facts: dict[str, Any]) -> str | None:
    types = facts.get("layer_types") or {}
    rec = {k: v for k, v in types.items() if k in RECURRENT}
    if not rec:
        return None
    return " + ".join(f"{v} {k}" for k, v in rec.items()) + " layers"


def _partial_fp8(facts: dict[str, Any]) -> str | None:
    """An FP8 block-wise target's weight known from the config not to be whole blocks: MLA's
    kv_a_proj_with_mqa has kv_lora_rank + qk_rope_head_dim rows (576 in DeepSeek-V3, 4.5 blocks of 128).
    The load itself checks every weight (`target/quantized.py`); this is the config-only view."""
    q, mla = facts.get("quantization") or {}, facts.get("mla") or {}
    block = q.get("block")
    if q.get("method") != "fp8" or not block or not mla.get("kv_lora_rank"):
        return None
    rows = int(mla["kv_lora_rank"]) + int(mla.get("qk_rope_head_dim") or 0)
    return f"MLA's kv_a_proj_with_mqa ({rows} rows in {block[0]}-row blocks)" if rows % int(block[0]) else None


def target_paths(facts: dict[str, Any]) -> list[dict[str, str]]:
    """One row per path family: {"path", "verdict"} (verdict starts with yes / refused)."""
    q = facts.get("quantization") or {}
    label = q.get("label") or q.get("method")
    rec = _recurrent(facts)
    local_load = q.get("local_load")
    partial = _partial_fp8(facts)
    if facts.get("checkpoint"):  # tensors that cannot be what config.json says: every load refuses them
        local = f"refused (exit 2): {facts['checkpoint']}"
    elif partial:
        local = (f"refused (exit 2): {label}, and {partial} is not a whole number of blocks (transformers'"
                 " dequantize mishandles it); use the engine paths")
    elif q and local_load == "refused":
        local = f"refused (exit 2): {label} is not loadable here; use the engine paths"
    else:
        local = "yes"
        if q and local_load == "dequantized":
            dtype = str(facts.get("dtype") or "bfloat16")
            size = int(facts.get("params_total") or 0) * DTYPE_BYTES.get(dtype, 2) / 2**30
            local += (f", {label} dequantized into target.dtype (≈ {size:,.0f} GiB of weights in {dtype}, "
                      "not the bits: plan's local_weights)" + ("; needs pip install 'dflashkit[quantized]'"
                                                               if q.get("method") == "compressed-tensors" else ""))
        elif q:
            local += f", {label} loaded by transformers itself"
        if rec:
            local += f"; {rec}: the decoder rolls their state back exactly (docs/hybrid-targets.md)"
    engine = "yes, on a vLLM that serves the architecture"
    if q:
        engine += f" ({label} as shipped: the served numerics)"
    if rec:
        engine = (f"GPU vLLM only ({rec}): refused (exit 2) on vLLM's CPU build, the one dflashkit installs; "
                  "point capture.server_url at a GPU vLLM")
    head = "yes, read by name" + (" (a quantized head or embedding is dequantized on read)" if q else "")
    if facts.get("checkpoint"):  # the head reader and a server read the same files
        head = "refused (exit 2): the checkpoint's tensors are not what its config.json says (local, above)"
        engine += "; but a server reads the same files: fix the checkpoint first (local, above)"
    rollout = (f"refused (exit 2): {rec} cannot hold the rollout's tree of paths; use train.on_path=mask"
               if rec else "yes")
    return [{"path": LOCAL, "verdict": local}, {"path": ENGINE, "verdict": engine},
            {"path": HEAD, "verdict": head}, {"path": ROLLOUT, "verdict": rollout}]


def paths_text(rows: list[dict[str, str]], indent: int = 18) -> str:
    """The rows as `path → verdict` lines, the first unindented (a value in probe's / plan's table)."""
    pad = "\n" + " " * indent
    return pad.join(f"{r['path']} → {r['verdict']}" for r in rows)
