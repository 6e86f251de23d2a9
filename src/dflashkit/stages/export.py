"""`dflashkit export`: the serving-ready drafter dir (z-lab format) with a model card, checked on reload.

Inputs:  `train/best/` (the best held-out simulated τ, `train.keep_best`), else `train/final/` (or a
         positional DIR), `eval/results.json` and manifests if present.
Outputs: `export.out_dir` (default `<run_dir>/export/`): config.json, model.safetensors (z-lab
         tensor names, `export.dtype`), dflash.py (our modeling file for `trust_remote_code`),
         README.md (model card with the SGLang and vLLM launch lines), manifest.json, and
         `speculation_profile.json` when one was measured on these weights (export/profile.py).
Example: dflashkit export -c run.yaml export.dtype=bfloat16
         dflashkit export -c run.yaml --format speculators   (vLLM's own format, export/speculators.py)

Invariants: the dir is built in a temp dir beside the destination, reloaded (our loader and the
shipped dflash.py) and compared with the source drafter on a fixed input — logits through the
target's head when its weights can be read, plus the family's own part (DFlash2: the walk) — and
only then renamed into place (`export/check.py`; the card is `export/card.py`). One export at a
time writes an out dir: `<parent>/.<name>.lock` is flock'ed (rundir.py `dir_lock`); a second exits 2.

Another family exports with its own architecture, keys and tensors (dflashkit/family/). A reduced
draft vocabulary also writes what vLLM needs (`lm_head.weight` rows, `t2d`, `draft_vocab_size`;
needs target.path). A speculation profile measured on other weights is never shipped (a warning);
one describing another drafter (K above B − 1, another block size or family) is refused before any
work, exit 2 (`profile_ship.refuse_other_drafter`). Formats in full: docs/architecture.md.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from dflashkit.config import RunConfig
from dflashkit.context import StageContext
from dflashkit.decode.evaluation import read_eval_results
from dflashkit.errors import MissingArtifactError
from dflashkit.export.card import model_card
from dflashkit.export.check import loaded_target_head, reload_check, target_head
from dflashkit.export.hf import MODELING_FILE, save_drafter, write_modeling_file
from dflashkit.export.profile import PROFILE_FILE, profile_path
from dflashkit.export.profile_ship import choose, drafter_contract, ship
from dflashkit.export.speculators import export_speculators, load_any_drafter
from dflashkit.rundir import RunDir, atomic_dir, check_replaceable, dir_lock, write_manifest
from dflashkit.stage_table import stage_hash
from dflashkit.train.checkpoint import read_best, trained_drafter_dir

log = logging.getLogger("dflashkit.export")


def run(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict[str, Any]:
    t0 = time.time()

    if ctx.positionals:
        src, which = Path(ctx.positionals[0]), "dir"
    else:
        src, which = trained_drafter_dir(rd)
    source = {"kind": which, **((read_best(src) or {}) if which == "best" else {})}
    if not (src / "config.json").is_file():
        raise MissingArtifactError("trained drafter", src, run="dflashkit train -c run.yaml")
    out = Path(cfg.export.out_dir) if cfg.export.out_dir else rd.export_dir
    check_replaceable(out, owner="export")  # what atomic_dir refuses, before the drafter loads (a dry run too)
    choice = choose([rd.eval_profile, profile_path(src)], src, drafter_contract(src))  # refuses another drafter's
    if ctx.dry_run:
        return {"dry_run": True, "source": str(src), "source_kind": which, "out_dir": str(out),
                "format": cfg.export.format}
    with dir_lock(out, "export", label="export.out_dir"):  # one export per out dir, inside the run dir or not
        if cfg.export.format == "speculators":
            return _run_speculators(cfg, rd, src, which, source, out, t0, choice)
        model, _ = load_any_drafter(src, dtype=torch.float32)  # a speculators source converts back to z-lab
        head = target_head(cfg)
        if head is not None and head.shape[-1] != model.contract.hidden_size:
            head = None
        if model.draft_vocab is not None and head is None:
            head = loaded_target_head(cfg, model.contract.hidden_size)
        with atomic_dir(out, owner="export") as tmp:
            save_drafter(model, tmp, dtype=cfg.export.dtype, head=head)
            write_modeling_file(tmp, model.contract.family)  # + a plugin family's class (modeling_source)
            (tmp / "README.md").write_text(model_card(cfg, model.contract, out.resolve(), rd, model.draft_vocab_size,
                                                      results=read_eval_results(rd)))
            check = reload_check(model, tmp, head, cfg.export.check_atol)
            profile = _ship_profile(cfg, choice, tmp, "zlab")
            write_manifest(tmp, stage="export", config_hash=stage_hash("export", cfg), started=t0,
                           inputs={"source": str(src), "source_kind": which},
                           counts={"tensors": len(model.state_dict())},
                           outputs=["config.json", "model.safetensors", MODELING_FILE, "README.md",
                                    *([PROFILE_FILE] if profile["shipped"] else [])],
                           extra={"reload_check": check, "speculation_profile": profile})
        if out.resolve() != rd.stage_dir("export", create=False).resolve():
            write_manifest(rd.stage_dir("export"), stage="export", config_hash=stage_hash("export", cfg), started=t0,
                           inputs={"source": str(src)}, outputs=[str(out)],
                           extra={"reload_check": check, "speculation_profile": profile})
    log.info("exported %s (%s) → %s (reload check: %s max diff %.2g)", src, which, out, check["compared"],
             check["max_diff_vs_source"])
    return {"out_dir": str(out), "source": str(src), "source_info": source, "dtype": cfg.export.dtype, "block_size": model.contract.block_size,
            "reload_check": check, "speculation_profile": profile,
            **({"draft_vocab_size": model.draft_vocab_size} if model.draft_vocab is not None else {})}


def _ship_profile(cfg: RunConfig, choice: dict[str, Any], tmp: Path, fmt: str) -> dict[str, Any]:
    """Ship the profile `choose` picked (eval's or the source dir's own) into the export, or say why not."""
    info = ship(choice, tmp, fmt=fmt, dtype=cfg.export.dtype)
    if info["shipped"]:
        log.info("%s: measured %s, %s tokens per step at K=%d", PROFILE_FILE, info["measured_at"],
                 info["mean_accept_length"], info["num_speculative_tokens"])
    else:
        log.warning("no %s beside the export: %s%s", PROFILE_FILE, info["reason"],
                    "".join(f"\n  not shipped: {x}" for x in info["skipped"]))
    return info


def outputs_present(rd: RunDir) -> bool:
    """`dflashkit run`: an export from before profiles were shipped runs again (once)."""
    return "speculation_profile" in (rd.manifest("export") or {})


def _run_speculators(cfg: RunConfig, rd: RunDir, src: Path, which: str, source: dict[str, Any], out: Path,
                     t0: float, choice: dict[str, Any]) -> dict[str, Any]:
    """export.format=speculators: vLLM's own format (export/speculators.py), checked the same way."""
    res = export_speculators(src, out, target=cfg.target, dtype=cfg.export.dtype, atol=cfg.export.check_atol,
                             readme=lambda m: model_card(cfg, m.contract, out.resolve(), rd, m.draft_vocab_size,
                                                         fmt="speculators", results=read_eval_results(rd)),
                             config_hash=stage_hash("export", cfg), inputs={"source_kind": which},
                             profile=lambda tmp: _ship_profile(cfg, choice, tmp, "speculators"))
    if out.resolve() != rd.stage_dir("export", create=False).resolve():
        write_manifest(rd.stage_dir("export"), stage="export", config_hash=stage_hash("export", cfg), started=t0,
                       inputs={"source": str(src)}, outputs=[str(out)],
                       extra={"format": "speculators", "reload_check": res["reload_check"],
                              "speculation_profile": res["speculation_profile"]})
    log.info("exported %s (%s) → %s, speculators format (reload check: max diff %.2g)", src, which, out,
             res["reload_check"]["max_diff_vs_source"])
    return {**res, "source": str(src), "source_info": source}
