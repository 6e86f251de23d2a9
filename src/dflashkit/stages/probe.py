"""`dflashkit probe`: read a target's config + tokenizer files and write the drafter contract.

Inputs:  a HF model dir (config.json + tokenizer files), a .gguf file, or an asset name — the
         positional argument, else `target.path`; `target.tokenizer` / `target.chat_template`
         override the tokenizer dir / template; explicit `drafter.*` values win over derived ones.
Outputs: `<run_dir>/contract.json` (DrafterContract JSON), `<run_dir>/probe/probe.json`
         (facts + tokenizer + contract) and `probe/manifest.json`. Nothing is written on error
         or with --dry-run.

Example:
    dflashkit probe smollm2-135m-instruct drafter.mask_token_id=16 --run-dir runs/smol
    dflashkit probe path/to/Qwen3-8B --json

Facts come from the files with the json module only (see `dflashkit.inspect`); the tokenizer is
then loaded for real only if its packages are importable, else a one-line diagnosis + fix.
Layer convention: output of decoder layer id = HF hidden_states[id+1].
"""

from __future__ import annotations

import logging
import time
from typing import Any

from dflashkit.config import RunConfig
from dflashkit.context import StageContext, require_positional
from dflashkit.inspect.contract import LAYER_CONVENTION, derive_contract
from dflashkit.inspect.paths import paths_text, target_paths
from dflashkit.inspect.target import inspect_target
from dflashkit.rundir import RunDir, atomic_write_json, file_digest, write_manifest
from dflashkit.stage_table import stage_hash

log = logging.getLogger("dflashkit.probe")


def _fmt_params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def table(facts: Any, tok: Any) -> str:
    """The human-readable summary (stdout unless --json)."""
    f = facts
    rows = [("target", f"{f.source} ({f.format})"),
            ("model", f"{f.model_type}" + (f" → {f.wrapper}: {f.text_model_type}" if f.wrapper else "")
             + f" / {f.architecture}"),
            ("layers · hidden", f"{f.num_layers} · {f.hidden_size}"),
            ("attention", f"{f.attention}: {f.num_attention_heads} heads, {f.num_key_value_heads} kv, "
             f"head_dim {f.head_dim}" + (f"; {f.mla}" if f.mla else "")),
            ("mlp", f"intermediate {f.intermediate_size}" + (
                f"; MoE {f.moe['num_experts']} routed + {f.moe['num_shared_experts']} shared, top-"
                f"{f.moe['experts_per_token']}, expert size {f.moe['moe_intermediate_size']}, "
                f"first_k_dense {f.moe['first_k_dense_replace']}" if f.moe else "")),
            ("rope", f"{f.rope.get('type')} theta {f.rope.get('theta')}"
             + (f" scaling {f.rope.get('scaling')}" if f.rope.get("scaling") else "")),
            ("context · vocab", f"{f.max_position_embeddings} · {f.vocab_size} (tied: {f.tie_word_embeddings})"),
            ("sliding / hybrid", f"window {f.sliding_window}, layer types {f.layer_types}"),
            ("mtp · dtype", f"{f.mtp_layers} · {f.dtype}"
             + (f" · quant {f.quantization}" if f.quantization else "")),
            ("params", f"total {_fmt_params(f.params_total)}, active {_fmt_params(f.params_active)}"
             + (f", mtp {_fmt_params(f.params_mtp)}" if f.params_mtp else "")),
            ("paths", paths_text(target_paths(f.to_dict())))]  # what works on this target (inspect/paths.py)
    if tok is not None:
        rows += [("tokenizer", f"{tok.backend} {tok.tokenizer_class or ''} size {tok.size}; template "
                  f"{tok.chat_template_source}; eos {tok.special_tokens.get('eos')}"),
                 ("tokenizer load", "ok " + str(tok.loaded.get("class")) if tok.loaded.get("ok")
                  else f"{tok.loaded.get('diagnosis')} — fix: {tok.loaded.get('fix')}")]
    return _rows(rows)


def table_contract(c: Any) -> str:
    """The contract part of the summary."""
    return _rows([("contract", f"block {c.block_size}, {c.num_draft_layers} draft layers, target_layer_ids "
                  f"{c.target_layer_ids} (output of decoder layer id = HF hidden_states[id+1])"),
                 ("mask token", f"{c.mask_token_id}: {c.mask_token_reason}"),
                 ("draft dims", f"heads {c.num_attention_heads}, kv {c.num_key_value_heads}, head_dim "
                  f"{c.head_dim}, intermediate {c.intermediate_size}")])


def _rows(rows: list[tuple[str, str]]) -> str:
    width = 16
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def _remote_code(model_dir: Any, gguf_file: str | None) -> str | None:
    """Why loading this target needs its own code (None: transformers has it, or not a HF dir)."""
    if gguf_file or not (model_dir / "config.json").is_file():
        return None
    try:
        from dflashkit.target.load import remote_code_reason
    except ImportError:  # transformers missing: probe still works without it
        return None
    return remote_code_reason(model_dir)


def run(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict[str, Any]:
    t0 = time.time()
    path = require_positional(ctx, "model dir", cfg.target.path)
    model_dir, gguf_file, facts, tok = inspect_target(cfg, path)
    if not ctx.json:
        print(table(facts, tok), flush=True)  # the facts, even if the contract fails below
    contract = derive_contract(cfg.drafter, facts, tok)
    remote = _remote_code(model_dir, gguf_file)
    if remote and not cfg.target.trust_remote_code:
        log.warning("%s: `train`, `capture` and `eval` will refuse to load it until you set "
                    "target.trust_remote_code: true (only if you trust its Python files)", remote)
    if not ctx.json:
        print(table_contract(contract), flush=True)
    result: dict[str, Any] = {
        "target": str(model_dir / gguf_file) if gguf_file else str(model_dir),
        "facts": facts.to_dict(), "paths": target_paths(facts.to_dict()), "tokenizer": tok.to_dict() if tok else None,
        "contract": contract.to_dict(), "layer_convention": LAYER_CONVENTION,
        **({"needs_remote_code": remote} if remote else {}),
    }
    if ctx.dry_run:
        return {**result, "dry_run": True, "written": []}
    probe_dir = rd.stage_dir("probe")
    atomic_write_json(probe_dir / "probe.json", result)
    atomic_write_json(rd.contract_path, contract.to_dict())
    source = model_dir / gguf_file if gguf_file else model_dir / "config.json"
    write_manifest(probe_dir, stage="probe", config_hash=stage_hash("probe", cfg, str(source)),
                   inputs={str(source): file_digest(source)},
                   counts={"num_layers": facts.num_layers, "vocab_size": facts.vocab_size,
                           "params_total": facts.params_total},
                   outputs=["contract.json", "probe/probe.json"], started=t0)
    log.info("wrote %s and %s", rd.contract_path, probe_dir / "probe.json")
    return {**result, "contract_path": str(rd.contract_path), "probe_path": str(probe_dir / "probe.json")}
