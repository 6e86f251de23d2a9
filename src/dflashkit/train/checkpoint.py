"""Resumable training state and the final z-lab drafter directory.

Usage:
    save_checkpoint(rd, step=100, model=drafter, optimizer=opt, scheduler=sched, is_main=True)
    found = latest_run_checkpoint(rd)                   # Path | None (complete checkpoints only)
    step = load_checkpoint(found, model=drafter, optimizer=opt, scheduler=sched)
    save_final(rd.final_dir, drafter, contract)
    save_final(rd.best_dir, drafter, contract, best={"step": 100, "tau": 1.8})
    src, which = trained_drafter_dir(rd)              # train/best if kept, else train/final

A checkpoint `checkpoints/step-XXXXXXX/` holds `model.safetensors` (full drafter state, z-lab names,
`d2t` included), `optimizer.pt` (read with `weights_only=True`), `rng.pt` and `state.json` (step,
scheduler, data cursor, the drafter contract, the best-so-far record). It is written into a temp dir
and renamed, so a `step-*` dir is always complete; a resume under a changed contract is refused,
naming what changed. Works for plain, DDP and FSDP2 drafters (full state dicts gathered by
torch.distributed.checkpoint).

`train/best/` (`train.keep_best`) is `train/final/`'s layout plus `best.json`: the drafter with the
highest held-out simulated τ so far (earliest on ties); `eval` and `export` use it by default. This module owns these directories (`RunDir.checkpoints_dir`, `final_dir`, `best_dir`): checkpoints
are written by `save_checkpoint` and read only by `load_checkpoint` (+ `checkpoint_state`,
`latest_checkpoint`); `train/final` and `train/best` are written by `save_final` and loaded through
`export/hf.py` `load_drafter`, found by `trained_drafter_dir`; `best.json` has one writer
(`save_final(best=...)`) and one reader (`read_best`).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from dflashkit import family
from dflashkit.errors import UsageError
from dflashkit.model.feature_scale import fold_feature_scale
from dflashkit.rundir import atomic_dir, atomic_write_json

if TYPE_CHECKING:
    import torch

    from dflashkit.rundir import RunDir

log = logging.getLogger("dflashkit.train")


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded, CPU) drafter state dict with z-lab names, from plain/DDP/FSDP2 models."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    sd = get_model_state_dict(model, options=_options())
    return {k.removeprefix("module."): v.detach().to("cpu").contiguous() for k, v in sd.items()}


def save_checkpoint(rd: RunDir, *, step: int, model, optimizer, scheduler, is_main: bool, keep: int = 3,
                    extra: dict | None = None) -> Path | None:
    """Write `rd.checkpoint_dir(step)` atomically (gathers on every rank; writes on the main rank, which gets
    its path; the others get None), then drop all but the newest `keep` checkpoints."""
    import torch
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    msd = full_model_state(model)
    osd = get_optimizer_state_dict(model, optimizer, options=_options())
    if not is_main:
        return None
    final = rd.checkpoint_dir(step)
    with atomic_dir(final, owner="train", marker="state.json") as tmp:
        save_file(msd, str(tmp / "model.safetensors"))
        torch.save(osd, tmp / "optimizer.pt")
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        torch.save(rng, tmp / "rng.pt")
        contract = getattr(getattr(model, "module", model), "contract", None)
        atomic_write_json(tmp / "state.json", {"step": step, "data_cursor": step,
                                               "scheduler": scheduler.state_dict(),
                                               "contract": contract.to_dict() if contract is not None else None,
                                               **(extra or {})})
    for old in sorted(rd.checkpoints_dir.glob("step-*"))[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    log.info("checkpoint %s", final)
    return final


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint dir (temp dirs of killed writes are ignored)."""
    done = [p for p in sorted(root.glob("step-*")) if (p / "state.json").is_file()]
    return done[-1] if done else None


def latest_run_checkpoint(rd: RunDir) -> Path | None:
    """The newest complete checkpoint of the run dir `rd` (`train/checkpoints/step-*`), or None."""
    return latest_checkpoint(rd.checkpoints_dir)


def load_checkpoint(path: Path, *, model, optimizer, scheduler) -> int:
    """Restore weights, optimizer, scheduler and RNG from `path`; returns the step to continue from.

    Raises:
        UsageError: a file is missing or corrupt (names it; delete the dir to fall back to an older one).
    """
    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    hint = f"delete {path} to resume from the previous checkpoint (or train/ to start over)"
    current = None
    try:
        current = path / "state.json"
        state = json.loads(current.read_text())
        current = path / "model.safetensors"
        msd = load_file(str(current))
        current = path / "optimizer.pt"
        osd = torch.load(current, map_location="cpu", weights_only=True)
        current = path / "rng.pt"
        rng = torch.load(current, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - safetensors/pickle/json raise many types for torn files
        raise UsageError(f"corrupt or incomplete checkpoint file {current}: {type(e).__name__}: {e}",
                         hint=hint) from None
    _check_contract(path, state.get("contract"), model)
    _check_draft_vocab(path, msd, model)
    try:
        set_model_state_dict(model, msd, options=_options())
    except (RuntimeError, KeyError, ValueError) as e:
        raise UsageError(f"{path / 'model.safetensors'} does not fit this drafter: {e}", hint=hint) from None
    set_optimizer_state_dict(model, optimizer, osd, options=_options())
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    log.info("resumed from %s (step %d)", path, state["step"])
    return int(state["step"])


# Contract fields whose change makes a checkpoint a different drafter (labels are descriptive only), beside the
# knobs of the drafter family (`contract_keys`).
CONTRACT_KEYS = ("block_size", "num_draft_layers", "target_layer_ids", "mask_token_id", "num_target_layers",
                 "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                 "vocab_size", "rope_theta", "rope_scaling", "max_position_embeddings", "tie_word_embeddings",
                 "drafter_type", "layer_types", "sliding_window", "causal_layers")


def contract_keys(now: dict) -> tuple[str, ...]:
    """CONTRACT_KEYS and the knobs of the family of `now` (a contract dict); another family's knobs, which an
    earlier contract.json may hold, mean nothing to this drafter (a changed family is `drafter_type`)."""
    fam = family.FAMILIES.get(now.get("drafter_type", family.DEFAULT.name))
    return CONTRACT_KEYS + (fam.knob_names if fam is not None else ())


def _check_contract(path: Path, saved: dict | None, model) -> None:
    check_contract(path, saved, getattr(getattr(model, "module", model), "contract", None))


def check_contract(path: Path, saved: dict | None, current) -> None:
    """The checkpoint's recorded drafter contract must equal this run's (block size, layer ids, mask id …)."""
    if not saved or current is None:
        return  # checkpoints written before contracts were recorded
    changed = _contract_changes(saved, current.to_dict())
    if changed:
        raise UsageError(f"{path / 'state.json'}: the drafter contract changed since this checkpoint "
                         f"({'; '.join(changed)})",
                         hint=f"restore the previous settings (contract.json / drafter.*) to resume, or delete "
                         f"{path.parent.parent} to train from scratch")


def _contract_changes(saved: dict, now: dict) -> list[str]:
    """`key: then → now` for each contract field the checkpoint recorded that differs now."""
    return [f"{k}: {saved.get(k)!r} in the checkpoint, now {now.get(k)!r}" for k in contract_keys(now)
            if k in saved and saved.get(k) != now.get(k)]


def _check_draft_vocab(path: Path, msd: dict, model) -> None:
    """A checkpoint and this run must agree on having a reduced draft vocab and on its size."""
    inner = getattr(model, "module", model)
    have = getattr(inner, "d2t", None)
    got = msd.get("d2t")
    n_have = None if have is None else int(have.numel())
    n_got = None if got is None else int(got.numel())
    if n_have != n_got:
        def name(n):
            return "the full target vocab" if n is None else f"a {n}-token draft vocab"

        raise UsageError(f"{path / 'model.safetensors'} was trained with {name(n_got)}, but "
                         f"drafter.draft_vocab_size asks for {name(n_have)}",
                         hint=f"set drafter.draft_vocab_size={n_got or 'null'} to resume, or delete "
                         f"{path.parent.parent} to start over")


def shape_changes(path: Path, contract: dict | None, draft_vocab_size: int | None) -> list[str]:
    """What `load_checkpoint` would refuse the checkpoint at `path` for, without loading it: its drafter
    contract against `contract` (contract.json) and its draft vocab against `draft_vocab_size`."""
    from safetensors import safe_open

    saved = checkpoint_state(path).get("contract") or {}
    changed = _contract_changes(saved, contract) if contract else []
    try:
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            n = f.get_slice("d2t").get_shape()[0] if "d2t" in f.keys() else None
    except Exception:  # noqa: BLE001 - a torn file: load_checkpoint names it when it is read
        return changed
    vocab = (contract or {}).get("vocab_size")
    want = draft_vocab_size if draft_vocab_size and not (vocab and draft_vocab_size >= vocab) else None
    if n != want:  # None: the full target vocab (unset, 0, or the whole vocab: `train/vocab.py`)
        changed.append(f"drafter.draft_vocab_size: {n} in the checkpoint, now {want}")
    return changed


BEST_FILE = "best.json"


def save_final(out_dir: Path, model, contract, *, is_main: bool = True, best: dict | None = None) -> Path | None:
    """`train/final/`: the z-lab drafter dir (config.json = contract.to_hf_config(), model.safetensors).

    With `best` (a small JSON-able record), the dir also gets `best.json`, written inside the same
    atomic replacement (`train/best/`)."""
    from safetensors.torch import save_file

    sd = fold_feature_scale(full_model_state(model))  # a plain z-lab drafter: the scale lives in fc.weight
    if not is_main:
        return None
    out_dir = Path(out_dir)
    with atomic_dir(out_dir, owner="train", marker="model.safetensors") as tmp:
        dtype = str(next(v.dtype for v in sd.values() if v.is_floating_point())).removeprefix("torch.")
        vocab = int(sd["d2t"].numel()) if "d2t" in sd else None
        (tmp / "config.json").write_text(json.dumps(contract.to_hf_config(dtype=dtype, draft_vocab_size=vocab),
                                                    indent=2) + "\n")
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if best is not None:
            atomic_write_json(tmp / BEST_FILE, best)
    return out_dir


def read_best(best_dir: Path, *, complete: bool = True) -> dict | None:
    """The best.json record of a complete `train/best/`, or None (absent or torn). `complete=False` (report)
    also reads the record of a dir whose weights are missing."""
    best_dir = Path(best_dir)
    if complete and not (best_dir / "model.safetensors").is_file():
        return None
    try:
        rec = json.loads((best_dir / BEST_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return rec if isinstance(rec, dict) and "step" in rec and "tau" in rec else None


def trained_drafter_dir(rd: RunDir) -> tuple[Path, str]:
    """(`rd.best_dir`, "best") when a complete best drafter exists, else (`rd.final_dir`, "final")."""
    if (rd.best_dir / "config.json").is_file() and read_best(rd.best_dir) is not None:
        return rd.best_dir, "best"
    return rd.final_dir, "final"


def drop_checkpoints(rd: RunDir) -> None:
    """Remove a run's resumable checkpoints (`train/checkpoints/`); `train/final` and `train/best` stay."""
    shutil.rmtree(rd.checkpoints_dir, ignore_errors=True)


def checkpoint_state(path: Path) -> dict:
    """state.json of a complete checkpoint (the resume checks read it before `load_checkpoint` loads anything)."""
    file = Path(path) / "state.json"
    try:
        state = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"corrupt or incomplete checkpoint file {file}: {type(e).__name__}: {e}",
                         hint=f"delete {path} to resume from the previous checkpoint (or train/ to start over)"
                         ) from None
    if not isinstance(state, dict):
        raise UsageError(f"corrupt checkpoint file {file}: not a JSON object",
                         hint=f"delete {path} to resume from the previous checkpoint (or train/ to start over)")
    return state
