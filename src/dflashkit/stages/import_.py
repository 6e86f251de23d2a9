"""`dflashkit import DIR [DEST]`: adopt an existing DFlash drafter dir (z-lab or speculators) for `eval` or `train`.

Inputs:  DIR with config.json (+ `dflash_config`, or vLLM speculators keys: told apart by config.json's
         `speculators_config` / `speculators_model_type`) and model.safetensors; the target (`target.path`).
Outputs: DEST (default `<run_dir>/train/final/`, a relative DEST is under the run dir) holding config.json,
         model.safetensors (and dflash.py if DIR had one) — always z-lab format, a speculators DIR is converted
         (its embedding and head copies dropped); `contract.json` if absent; `<run_dir>/import/manifest.json`.
Example: dflashkit import ~/ckpt/Qwen3-8B-DFlash-b16 -c run.yaml

Checks, all before anything is written (exit 2 with the key named): the config has `dflash_config` and the Qwen3
keys, the weights are readable safetensors whose names and shapes match the config, the drafter fits the target
(target_layer_ids < target layers, equal hidden size, mask id and vocab inside the target's) and, when the run has a
contract.json, it is of the run's drafter family with the run's shape and knobs. An existing DEST is never
overwritten. A `speculation_profile.json` beside the weights is validated (exit 2 naming the file: a broken one, or
one of another drafter, as export refuses it: profile_ship.py `profile_report`; none is fine) and its headline reported.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from dflashkit import family
from dflashkit.config import RunConfig
from dflashkit.context import StageContext
from dflashkit.errors import UsageError
from dflashkit.export.hf import MODELING_FILE, WEIGHTS, save_drafter
from dflashkit.export.profile_ship import profile_report
from dflashkit.export.speculators import head_mismatch, load_any_drafter
from dflashkit.inspect.target import resolve_target_path
from dflashkit.rundir import RunDir, atomic_dir, atomic_write_json, write_manifest
from dflashkit.stage_table import stage_hash
from dflashkit.train.guards import IMPORTED

log = logging.getLogger("dflashkit.import")


def target_facts(cfg: Any) -> dict[str, Any]:
    """num layers, hidden size, vocab, context of the target, from its config (no weights loaded)."""
    from dflashkit.target.load import load_target, text_config_dict

    if not cfg.target.path:
        raise UsageError("`dflashkit import` needs the target to check the drafter against",
                         hint="set target.path (in -c run.yaml or target.path=...)")
    model_dir, gguf = resolve_target_path(cfg.target.path, cfg.target.gguf_file)
    if not gguf and (model_dir / "config.json").is_file():
        tc = text_config_dict(model_dir)
        return {"num_layers": int(tc["num_hidden_layers"]), "hidden_size": int(tc["hidden_size"]),
                "vocab_size": int(tc["vocab_size"]), "max_position_embeddings": tc.get("max_position_embeddings"),
                "tie_word_embeddings": bool(tc.get("tie_word_embeddings", False)),
                "model_type": tc.get("model_type", ""), "architecture": (tc.get("architectures") or [""])[0]}
    t = load_target(cfg.target, with_tokenizer=False)
    return {"num_layers": t.num_layers, "hidden_size": t.hidden_size, "vocab_size": t.vocab_size,
            "max_position_embeddings": getattr(t.config, "max_position_embeddings", None),
            "tie_word_embeddings": bool(getattr(t.config, "tie_word_embeddings", False)),
            "model_type": getattr(t.config, "model_type", ""), "architecture": type(t.model).__name__}


MATCH_KEYS = ("block_size", "num_draft_layers", "target_layer_ids", "mask_token_id", "hidden_size", "layer_types",
              "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size",
              "sliding_window", "causal_layers")  # an imported drafter's fields that must equal the run's contract


def _fields(contract: Any) -> dict[str, Any]:
    return {**{k: getattr(contract, k) for k in MATCH_KEYS},
            **{k: getattr(contract.knobs, k) for k in contract.family.knob_names}}


def check_against_run_contract(contract: Any, contract_path: Path, src: Path) -> None:
    """Exit 2 naming both drafter families, or each field where the drafter differs from the run's contract.json."""
    if not contract_path.is_file():
        return
    try:
        have = json.loads(contract_path.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"{contract_path}: unreadable ({e})", hint="re-run `dflashkit probe -c run.yaml`") from None
    kind = have.get("drafter_type", family.DEFAULT.name)
    if contract.drafter_type != kind:  # adopting another family's drafter is never a conversion
        raise UsageError(f"the drafter {src} is a {contract.family.title} drafter (drafter_type "
                         f"{contract.drafter_type}) but this run's contract {contract_path} is drafter_type {kind}",
                         hint=f"set drafter.type={contract.drafter_type} and re-run `dflashkit probe`, or import it "
                         f"into a run of that type (run.run_dir=...)")
    diff = [f"{k}: {v!r} in {src}, {have.get(k)!r} in {contract_path}" for k, v in _fields(contract).items()
            if k in have and v != have.get(k)]
    if diff:
        raise UsageError(f"the drafter {src} does not fit this run's contract ({'; '.join(diff)})",
                         hint="import it into a fresh run dir (run.run_dir=...), or re-run `dflashkit probe` with "
                         "drafter.* set to the drafter's values")


def run(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict[str, Any]:
    t0 = time.time()
    if not ctx.positionals:
        raise UsageError("`dflashkit import` needs a drafter DIR", hint="dflashkit import DIR [DEST] -c run.yaml")
    src = Path(ctx.positionals[0])
    if not src.is_dir():
        raise UsageError(f"{src} is not a directory", hint="pass the drafter dir (config.json + model.safetensors)")
    dest = Path(ctx.positionals[1]) if len(ctx.positionals) > 1 else Path("train") / "final"
    dest = dest if dest.is_absolute() else rd.root / dest
    model, fmt = load_any_drafter(src)  # z-lab or speculators; validates keys, tensor names, shapes, integrity
    contract = model.contract
    profile = profile_report(src, contract)  # its speculation_profile.json, validated (exit 2 naming the field) or None
    facts = target_facts(cfg)
    if fmt == "speculators":  # its config does not record the target's depth; its head should be the target's
        contract.num_target_layers = facts["num_layers"]
        head_mismatch(src, cfg.target)
    contract.check(facts, where=f"drafter {src}")
    check_against_run_contract(contract, rd.contract_path, src)
    if dest.exists():
        raise UsageError(f"{dest} already exists; not overwriting it",
                         hint="pass another DEST (dflashkit import DIR DEST) or move the existing dir away")
    if ctx.dry_run:
        return {"dry_run": True, "source": str(src), "dest": str(dest), "fits": True, "speculation_profile": profile}

    with atomic_dir(dest) as tmp:  # dest does not exist (checked above): nothing is ever replaced
        for name in ("config.json", WEIGHTS, MODELING_FILE) if fmt == "zlab" else ():
            if (src / name).is_file():
                shutil.copyfile(src / name, tmp / name)
        if not (tmp / WEIGHTS).is_file():  # sharded or speculators source: write one file in our format

            save_drafter(model, tmp, dtype=str(next(model.parameters()).dtype).removeprefix("torch."))
        # marks the dir as imported: `train` will not replace it unless drafter.init starts from it
        atomic_write_json(tmp / IMPORTED, {"source": str(src.resolve()), "format": fmt,
                                           "imported_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")})

    wrote_contract = not rd.contract_path.is_file()
    if wrote_contract:
        contract.num_target_layers = facts["num_layers"]
        contract.vocab_size = facts["vocab_size"]
        contract.tie_word_embeddings = facts["tie_word_embeddings"]
        contract.target_model_type = facts["model_type"]
        contract.target_architecture = facts["architecture"]
        if facts["max_position_embeddings"]:
            contract.max_position_embeddings = int(facts["max_position_embeddings"])
        contract.mask_token_reason = f"imported from {src}"
        atomic_write_json(rd.contract_path, contract.to_dict())
    write_manifest(rd.stage_dir("import"), stage="import", config_hash=stage_hash("import", cfg), started=t0,
                   inputs={"source": str(src.resolve())}, outputs=[str(dest)],
                   counts={"tensors": len(model.state_dict())})
    log.info("imported %s (%s format) → %s%s", src, fmt, dest, " (wrote contract.json)" if wrote_contract else "")
    return {"source": str(src), "format": fmt, "dest": str(dest), "block_size": contract.block_size,
            "target_layer_ids": contract.target_layer_ids, "wrote_contract": wrote_contract,
            "speculation_profile": profile}
