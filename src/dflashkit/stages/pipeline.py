"""`dflashkit run`: every stage from one YAML, in order, skipping those already up to date.

Inputs:  the run YAML; whatever each stage reads from the run dir.
Outputs: every stage's outputs, `<run_dir>/config.resolved.yaml`, `<run_dir>/pipeline.json`
         (the fingerprint each stage last completed with) and a closing summary.
Example: dflashkit run -c configs/smollm2-135m.yaml [--from train] [--to eval] [--force tokenize]

Order: probe → prepare → generate → tokenize → (capture, when train.features=cached) → train →
eval → export → report. A stage is up to date when its manifest exists and its fingerprint — a
hash of the config sections it reads plus the fingerprint and completion time of the stage before
it — equals the one recorded after its last success. So editing `train.lr` re-runs train (from
scratch: checkpoints of another run are not resumed) and everything after it, and a forced re-run of
prepare invalidates what follows. Each stage is itself resumable (generate keeps finished rows, train
resumes from its last checkpoint of the same run), so an interrupted `run` continues where it stopped.
With `server.urls` empty, `generate` starts `dflashkit serve` on 127.0.0.1 for the target and stops it
afterwards. What a stage refuses of the target itself comes before any stage works (`check_target`).
With `run.budget_minutes` (`--budget`) the run is sized to it first (`sizing/session.py`, docs/budget.md),
with the plan and the actuals in `pipeline.json` under "budget".
"""

from __future__ import annotations

import importlib
import logging
import time
from typing import Any

from dflashkit.config import RunConfig, dump_config
from dflashkit.context import StageContext
from dflashkit.data.mixing import needs_regeneration
from dflashkit.data.records import prepared_lines
from dflashkit.engines.target_checks import check_target
from dflashkit.errors import UsageError
from dflashkit.family.recipe import config_recipe
from dflashkit.sizing.estimate import estimate
from dflashkit.report.summary import run_summary, summary_lines
from dflashkit.rundir import RunDir, atomic_write_json, atomic_write_text, read_json
from dflashkit.sizing.calibration import saved_calibration
from dflashkit.sizing.session import BudgetSession, apply_scale
from dflashkit.stage_table import PIPELINE, STAGES, stage_hash

log = logging.getLogger("dflashkit.run")

ORDER = PIPELINE  # from the one stage table (`dflashkit.stage_table`), with each stage's config sections


def active_stages(cfg: RunConfig) -> list[str]:
    """The stages this config needs: capture only for cached features; generate only when some source
    is regenerated (not for tokenize.source=prepare, nor when every source is `answers: original`)."""
    skip = set()
    if not config_recipe(cfg).cached:
        skip.add("capture")
    if not needs_regeneration(cfg):  # tokenize reads prepare's answers, or every source is answers=original
        skip.add("generate")
    return [s for s in ORDER if s not in skip]


def selected_stages(cfg: RunConfig, from_stage: str | None, to_stage: str | None) -> list[str]:
    for name, value in (("--from", from_stage), ("--to", to_stage)):
        if value is not None and value not in ORDER:
            raise UsageError(f"{name} {value!r} is not a stage", hint=f"stages: {', '.join(ORDER)}")
    stages = active_stages(cfg)
    lo = stages.index(from_stage) if from_stage in stages else 0
    hi = stages.index(to_stage) if to_stage in stages else len(stages) - 1
    if lo > hi:
        raise UsageError(f"--from {from_stage} comes after --to {to_stage}")
    return stages[lo:hi + 1]


def _fingerprint(cfg: RunConfig, rd: RunDir, stage: str, previous: str | None, prev_fp: str) -> str:
    prev_done = (rd.manifest(previous) or {}).get("finished_at") if previous else None
    return stage_hash(stage, cfg, prev_fp, prev_done or "")


def _stage_module(stage: str):
    return importlib.import_module(f"dflashkit.stages.{STAGES[stage].module}")


def run(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict:
    cfg = apply_scale(cfg)
    stages = selected_stages(cfg, ctx.from_stage, ctx.to_stage)
    force = set(ORDER) if "all" in ctx.force else set(ctx.force)
    if force - set(ORDER):
        raise UsageError(f"--force {sorted(force - set(ORDER))}: not a stage", hint=f"stages: {', '.join(ORDER)}")
    check_target(cfg, stages)  # what a stage would refuse of the target, before any stage (or the budget) works
    state_path = rd.root / "pipeline.json"
    state: dict[str, Any] = read_json(state_path) if state_path.is_file() else {}  # stage → fingerprint, + "budget"
    budget = BudgetSession.open(cfg, rd, state, active=active_stages(cfg), dry_run=ctx.dry_run) \
        if cfg.run.budget_minutes is not None else None  # calibrate, plan, print the plan
    cfg = budget.apply(cfg) if budget else cfg
    if not ctx.dry_run:
        rd.root.mkdir(parents=True, exist_ok=True)
        atomic_write_text(rd.resolved_config_path, dump_config(cfg))
        if budget:
            atomic_write_json(state_path, state)  # the plan, before any stage runs

    plan: list[dict[str, Any]] = []
    results: dict[str, Any] = {}
    prev_fp, previous = "", None
    for stage in active_stages(cfg):
        fp = _fingerprint(cfg, rd, stage, previous, prev_fp)
        if stage in stages:
            fresh = state.get(stage) == fp and rd.manifest(stage) is not None and stage != "report"
            present = getattr(_stage_module(stage), "outputs_present", None) if fresh else None
            fresh = fresh and (present is None or present(rd))  # outputs it writes now, missing from an older run
            action = "run" if (stage in force or not fresh) else "skip"
            plan.append({"stage": stage, "action": action})
            if ctx.dry_run:
                log.info("%-9s would %s", stage, action)
            elif action == "skip":
                log.info("%-9s up to date — skipped", stage)
            else:
                cfg = budget.before(stage, cfg, rd) if budget else cfg  # train, eval: re-planned from the time left
                log.info("%-9s running …", stage)
                t0 = time.time()
                sub = StageContext(command=stage, config_path=ctx.config_path, json=True)
                try:
                    module = _stage_module(stage)
                    restart = getattr(module, "restart_if_changed", None)  # train: not another run's checkpoints
                    if restart is not None:
                        restart(cfg, rd)
                    results[stage] = module.run(cfg, rd, sub) or {}
                except Exception:
                    log.error("stage %s failed; completed work is kept — fix the cause and re-run "
                              "`dflashkit run` to continue from %s", stage, stage)
                    raise
                log.info("%-9s done in %.1f s", stage, time.time() - t0)
                fp = _fingerprint(cfg, rd, stage, previous, prev_fp)
                state[stage] = fp
                if budget:
                    budget.finished(stage, time.time() - t0, cfg, rd, state)  # plan vs actual into state["budget"]
                atomic_write_json(state_path, state)
        prev_fp, previous = fp, stage
    out: dict[str, Any] = {"run_dir": str(rd.root), "stages": plan}
    if budget:
        out["budget"] = budget.record or {"plan": None, "reason": budget.message}
    if ctx.dry_run:
        out["plan_estimates"] = _plan_estimates(cfg, rd)
        return out
    out["summary"] = run_summary(rd, cfg.train.forecast_tau)
    log.info("\n".join(summary_lines(out["summary"])))
    return out


def _plan_estimates(cfg: RunConfig, rd: RunDir) -> dict[str, Any] | None:
    try:
        return estimate(cfg, rd, prepared_lines=prepared_lines, calibration=saved_calibration)
    except Exception as e:  # noqa: BLE001 - estimates are advisory in a dry run
        log.warning("plan estimates unavailable: %s", e)
        return None
