"""`dflashkit train`: train the DFlash drafter (one process, or every rank under torchrun).

Inputs:  contract.json (probe), tokenize/shard-*.parquet (tokenize), capture/*.safetensors when
         train.features=cached, the target (target.path); train.features=engine: a vLLM
         (capture.server_url, or one started here) feeding train/engine-queue/ (bounded by
         train.engine_prefetch; the summary's engine_peak_disk_bytes is its measured peak).
Outputs: train/checkpoints/step-XXXXXXX/ (resumable), train/best/ (+ best.json: the best held-out
         simulated τ, train.keep_best), train/curve.json (learning curve), train/final/ (z-lab drafter dir:
         config.json + model.safetensors), train/metrics.jsonl, train/manifest.json.
Example: dflashkit train -c run.yaml train.max_steps=200
         torchrun --nproc-per-node 2 -m dflashkit train -c run.yaml     (or --nproc-per-node 2)

Re-running resumes from the latest complete checkpoint (weights, optimizer, scheduler, data
cursor, RNG), so a killed run continues exactly where it stopped. A checkpoint of another run (other
tokenized data, seed, objective or optimisation settings: `train/guards.py` `resume_changes`) is
refused with exit 2 naming what changed; `dflashkit run`, which re-runs train because its config or
inputs changed, starts it over instead (`restart_if_changed`).
"""

from __future__ import annotations

import logging
import os
import shutil
import time

from dflashkit.config import RunConfig, section_hash
from dflashkit.context import StageContext
from dflashkit.decode.suffix import SuffixProposer
from dflashkit.engines.feed import check_engine_feed
from dflashkit.family.contract import DrafterContract
from dflashkit.rundir import RunDir, check_replaceable, read_json, write_manifest
from dflashkit.stage_table import stage_hash
from dflashkit.train import checkpoint as ckpt, guards
from dflashkit.train.checkpoint import latest_checkpoint
from dflashkit.sizing.forecast import read_curve_forecast
from dflashkit.train.loop import fit, preflight
from dflashkit.train.parallel import leave_distributed, relaunch_under_torchrun


def run(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict:
    if ctx.nproc_per_node and "WORLD_SIZE" not in os.environ:
        argv = ["train"] + (["-c", ctx.config_path] if ctx.config_path else []) + list(ctx.overrides) + ["--json"]
        relaunch_under_torchrun(ctx.nproc_per_node, argv)
        manifest = rd.manifest("train") or {}
        return {"relaunched_nproc": ctx.nproc_per_node, **manifest.get("result", {})}
    if ctx.dry_run:
        check_engine(cfg, rd)
        checked = preflight(cfg, rd)  # what `fit` checks first
        return {"dry_run": True, "contract": str(rd.contract_path), "contract_exists": rd.contract_path.is_file(),
                "tokenized_shards": len(checked.shards), "features": cfg.train.features,
                "resume_from": _latest(rd)}

    t0 = time.time()

    try:
        from dflashkit.engines.feed import open_engine_feed  # passed down: train/ never reaches up to engines/

        check_engine(cfg, rd)  # before fit writes anything (the feed checks it again when it opens)
        result = fit(cfg, rd, show_bar=not ctx.json, open_feed=open_engine_feed,  # opened for features=engine only
                     suffix_proposer=SuffixProposer)  # train.suffix_complement's, passed down like the feed
    except BaseException:
        leave_distributed(ok=False)  # a torchrun rank: leave the group even on an error path (no barrier)
        raise
    leave_distributed(ok=True)  # every rank meets at a barrier, then the group is destroyed
    if int(os.environ.get("RANK", "0")) == 0:
        inputs = {"contract": section_hash(read_json(rd.contract_path)),
                  "tokenize": (rd.manifest("tokenize") or {}).get("config_hash")}
        if cfg.train.features == "cached":
            inputs["capture"] = (rd.manifest("capture") or {}).get("config_hash")

        fc = read_curve_forecast(rd.train_curve, cfg.train.forecast_tau)
        if fc is not None:
            result["forecast"] = fc.to_dict()
            result["forecast"]["text"] = fc.text()
        write_manifest(rd.stage_dir("train"), stage="train",
                       config_hash=stage_hash("train", cfg), inputs=inputs,
                       counts={"steps": result["steps"], "samples": result["samples"]},
                       outputs=["final/config.json", "final/model.safetensors", "metrics.jsonl"],
                       started=t0, extra={"result": result})
        if not ctx.json:
            _table(result)
    return result


def check_engine(cfg: RunConfig, rd: RunDir) -> None:
    """train.features=engine: the checks `open_engine_feed` makes (`engines/feed.py` check_engine_feed), run
    before `fit` and by `--dry-run` (which then makes `fit`'s own checks, `train.loop.preflight`)."""
    if cfg.train.features != "engine":
        return

    check_engine_feed(cfg, DrafterContract.load(rd.contract_path), rd.stage_dir("train", create=False),
                      world=int(os.environ.get("WORLD_SIZE", "1")))


def restart_if_changed(cfg: RunConfig, rd: RunDir) -> list[str]:
    """Before `dflashkit run` re-runs train: when the latest checkpoint belongs to another run (the data,
    seed, objective, optimisation settings, drafter contract or draft vocab changed since), remove
    train/checkpoints so that train starts over (a fresh start also replaces train/best; train/final is replaced when it finishes) instead of
    continuing that run's drafter. Returns what changed (empty: nothing to remove, an interrupted run of
    this config resumes)."""
    latest = ckpt.latest_checkpoint(rd.checkpoints_dir)
    if latest is None:
        return []
    contract = read_json(rd.contract_path) if rd.contract_path.is_file() else None
    state = ckpt.checkpoint_state(latest)
    changed = guards.resume_changes(state, cfg.train, cfg.run.seed, rd) + ckpt.shape_changes(
        latest, contract, cfg.drafter.draft_vocab_size)
    if changed:
        logging.getLogger("dflashkit.train").warning(
            "train starts over: the checkpoints in %s belong to another run (%s)", rd.checkpoints_dir,
            "; ".join(changed))
        guards.check_outputs_ours(rd, cfg.drafter.init)
        for step_dir in sorted(rd.checkpoints_dir.glob("step-*")):
            if step_dir.is_dir() and (step_dir / "state.json").is_file():
                check_replaceable(step_dir, owner="train", marker="state.json")
                shutil.rmtree(step_dir)
    return changed


def _latest(rd) -> str | None:
    found = latest_checkpoint(rd.checkpoints_dir)
    return str(found) if found else None


def _table(result: dict) -> None:
    rows = [("steps", result["steps"]), ("resumed from", result["resumed_from"]),
            ("train loss", (result.get("train") or {}).get("loss")),
            ("train tau", (result.get("train") or {}).get("tau")),
            ("held-out tau", (result.get("heldout") or {}).get("tau")),
            ("tokens/s", result.get("tokens_per_s")), ("final", result["final_dir"]),
            ("best", (f"{result['best']['dir']} (step {result['best']['step']}, held-out tau "
                      f"{result['best']['tau']:.4f})") if result.get("best") else None)]
    if "engine_peak_disk_bytes" in result:
        rows.append(("engine queue", f"peak {result['engine_peak_disk_bytes']} B on disk "
                                     f"(train.engine_prefetch={result['engine_prefetch']})"))
    for k, v in rows:
        print(f"{k:>14}  {v if not isinstance(v, float) else round(v, 4)}")
    if result.get("forecast"):
        print(f"{'forecast':>14}  {result['forecast']['text']}")
