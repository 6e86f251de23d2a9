"""One `dflashkit run` under `run.budget_minutes`: calibrate, plan, re-plan from actuals, record plan vs actual.

Usage (what `stages/pipeline.py` does):
    b = BudgetSession.open(cfg, rd, state, active=stages, dry_run=False)   # state: pipeline.json's dict
    cfg = b.apply(cfg)                     # the plan's sizes (keys the user set are kept)
    cfg = b.before("train", cfg, rd)       # re-plans train (then eval) from the time left, once per plan
    b.finished("train", seconds, cfg, rd, state)   # the actual seconds and sizes → state["budget"]

A calibration file that is not valid for this machine and config is named in a warning and measured again
(`sizing/calibration.py`); a saved record whose plan or rates cannot be (`sizing.plan.check_plan`,
`calibration.rates_problem`) is planned again. The plan never asks for more prompts than prepare found in the
sources when this run dir's `prepare/stats.json` read the same sources.

The record (`pipeline.json` → "budget"): `key` (hash of the config as given, the budget and the machine),
`calibration` (the rates and where they came from), `plan` (`sizing.plan.plan_run`'s), `sizes` (what the run
uses now: the plan's, then each re-plan's), `replanned` (train / eval: the re-plan and the time left it saw)
and `actual` (seconds per stage, samples and tokens). A `run` whose key equals the saved one reuses the record,
sizes included, so a finished run's stages stay up to date and nothing is measured again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from dflashkit.config import dump_config, given_keys, set_given_keys
from dflashkit.data.mixing import source_names
from dflashkit.data.records import prepared_lines
from dflashkit.family.recipe import config_recipe
from dflashkit.rundir import atomic_write_text
from dflashkit.sizing import calibration as calib
from dflashkit.errors import UsageError
from dflashkit.sizing.plan import (ROLLOUT_CAPTURE, SIZED, check_plan, overhead_s, plan_lines, plan_run,
                                   replan_eval, replan_train)

if TYPE_CHECKING:
    from dflashkit.config import RunConfig
    from dflashkit.rundir import RunDir

log = logging.getLogger("dflashkit.run")


def apply_scale(cfg: RunConfig) -> RunConfig:
    """`run.scale` multiplies the data size, training steps and eval prompts (a fixed-size run's knob; with
    `run.budget_minutes` it must stay 1: `config/validate.py`)."""
    s = cfg.run.scale
    if s == 1.0:
        return cfg
    cfg = dataclasses.replace(cfg)
    if cfg.data.num_prompts:
        cfg.data = dataclasses.replace(cfg.data, num_prompts=max(1, round(cfg.data.num_prompts * s)))
    if cfg.train.max_steps:
        cfg.train = dataclasses.replace(cfg.train, max_steps=max(1, round(cfg.train.max_steps * s)))
    cfg.eval = dataclasses.replace(cfg.eval, num_prompts=max(1, round(cfg.eval.num_prompts * s)))
    return cfg


def with_sizes(cfg: RunConfig, sizes: dict[str, Any]) -> RunConfig:
    """`cfg` with the dotted `sizes` set (sections replaced, the given keys kept)."""
    given = given_keys(cfg)
    out = dataclasses.replace(cfg)
    for key, value in sizes.items():
        section, name = key.split(".", 1)
        setattr(out, section, dataclasses.replace(getattr(out, section), **{name: value}))
    if given is not None:
        set_given_keys(out, given)
    return out


def _tokenized(rd: RunDir) -> tuple[int, int] | None:
    """(samples, tokens) from tokenize's stats, or None."""
    try:
        s = json.loads(rd.tokenize_stats.read_text())
        tot = s.get("totals", s)
        return int(tot["samples"]), int(tot["tokens"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def available_prompts(cfg: RunConfig, rd: RunDir) -> int | None:
    """The prompts the sources hold (the records prepare kept, `prepare/stats.json`), when that file read the
    sources `cfg` names (same names and paths); else None."""
    try:
        srcs = json.loads(rd.prepare_stats.read_text())["sources"]
        names = source_names(cfg.data.sources)
        if list(srcs) != names or any(srcs[n]["path"] != str(s.path) for n, s in zip(names, cfg.data.sources)):
            return None
        n = sum(int(srcs[name]["kept"]) for name in names)
        return n if n > 0 else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _record_problem(record: dict[str, Any]) -> str | None:
    """Why a saved budget record cannot be reused (a plan or rates that cannot be), or None."""
    try:
        check_plan(record["plan"])
        calib.rates(record["calibration"])
    except (UsageError, KeyError, TypeError, AttributeError) as e:  # PlanError, calibration.CalibrationError
        return str(e).splitlines()[0]
    return None


class BudgetSession:
    """The budget's state for one `run` (see the module docstring); `record` is what pipeline.json keeps."""

    def __init__(self, record: dict[str, Any] | None, *, fixed: frozenset[str], started: float, reused: bool,
                 message: str = "") -> None:
        self.record = record
        self.fixed = fixed
        self.started = started
        self.reused = reused
        self.message = message
        # seconds this plan's earlier `run`s spent: an interrupted run resumed continues the same budget
        self.carried = float(((record or {}).get("actual") or {}).get("elapsed_s") or 0.0) if reused else 0.0

    @classmethod
    def open(cls, cfg: RunConfig, rd: RunDir, state: dict[str, Any], *, active: list[str],
             dry_run: bool) -> BudgetSession:
        """`state["budget"]` (pipeline.json's) when its key matches, else a new plan (calibrating first unless one is
        saved for this machine and config; a dry run never calibrates). Logs the plan."""
        started = time.time()
        saved = state.get("budget")
        fixed = frozenset(given_keys(cfg) or ()) - {"run.budget_minutes"}
        m = calib.machine(cfg.target.device)
        key = hashlib.sha256((dump_config(cfg) + calib.machine_key(m)).encode()).hexdigest()[:16]
        same = isinstance(saved, dict) and saved.get("key") == key and bool(saved.get("plan"))
        why = _record_problem(saved) if same and isinstance(saved, dict) else None
        if why:
            log.warning("budget: the plan saved in pipeline.json is not reused (%s): planning again", why)
        elif same and isinstance(saved, dict):
            s = cls(saved, fixed=fixed, started=started, reused=True)
            log.info("%s", "\n".join(["budget: the plan saved in pipeline.json (same budget, config and machine)",
                                      *plan_lines(saved)]))
            return s
        cal = calib.saved_calibration(cfg, rd)
        source = cal.pop("path") if cal else "measured now"
        if cal is None and dry_run:
            msg = (f"budget {cfg.run.budget_minutes:g} min: no calibration saved for this machine and config; "
                   "`dflashkit run` measures one first (a few target forwards and training steps), "
                   "then prints the plan")
            log.info("%s", msg)
            return cls(None, fixed=fixed, started=started, reused=False, message=msg)
        if cal is None:
            cal = calib.calibrate(cfg, rd)
        elif not dry_run:
            calib.save_calibration(cal, rd)
        spent = time.time() - started
        plan = plan_run(cfg, calib.rates(cal), budget_minutes=float(cfg.run.budget_minutes or 0), fixed=fixed,
                        active=active, available_prompts=available_prompts(cfg, rd))
        record = {"key": key, "budget_minutes": cfg.run.budget_minutes, "machine_key": calib.machine_key(m),
                  "calibration": {**{k: cal.get(k) for k in ("machine", "device", "capture_dtype", "verify_dtype",
                                                             "capture_tok_s", "train_step_s", "decode_s", "load_s",
                                                             "calibrate_s", "measured_at")}, "source": source},
                  "plan": plan, "sizes": dict(plan["sizes"]), "replanned": {},
                  "actual": {"stages": {"calibrate": round(spent, 1)}}}
        for w in plan["warnings"]:
            log.warning("budget: %s", w)
        log.info("%s", "\n".join(plan_lines(record)))
        if not dry_run:
            state["budget"] = record
        return cls(record, fixed=fixed, started=started, reused=False)

    def _rates(self) -> Any:
        assert self.record is not None
        return calib.rates(self.record["calibration"])

    def apply(self, cfg: RunConfig) -> RunConfig:
        """`cfg` with the record's sizes (a key the user set keeps its value)."""
        if self.record is None:
            return cfg
        return with_sizes(cfg, {k: v for k, v in self.record["sizes"].items() if k not in self.fixed})

    def before(self, stage: str, cfg: RunConfig, rd: RunDir) -> RunConfig:
        """Re-plan train or eval from the actuals and the time left (once per plan: a resumed run keeps it); the
        resolved config is rewritten with the new sizes."""
        r = self.record
        if r is None or stage not in ("train", "eval") or stage in r["replanned"]:
            return cfg
        elapsed = time.time() - self.started + self.carried  # a resumed run continues the same budget
        if stage == "train":
            got = _tokenized(rd)
            if got is None:
                return cfg
            samples = max(1, got[0] - cfg.train.heldout_samples)
            new = replan_train(r["plan"], self._rates(), cfg, self.fixed, train_samples=samples, elapsed_s=elapsed,
                               slowdown=self._slowdown(cfg, got[1]))
            new["train_samples"] = samples
        else:
            new = replan_eval(r["plan"], self._rates(), cfg, self.fixed, elapsed_s=elapsed)
        new["elapsed_s"] = round(elapsed, 1)
        r["replanned"][stage] = new
        r["sizes"].update({k: v for k, v in new["sizes"].items() if k not in self.fixed})
        log.info("budget: %s re-planned from %.1f min left: %s", stage, new["time_left_s"] / 60,
                 ", ".join(f"{k}={v}" for k, v in new["sizes"].items()) + (" (fixed: kept)" if any(
                     k in self.fixed for k in new["sizes"]) else ""))

        cfg = self.apply(cfg)
        atomic_write_text(rd.resolved_config_path, dump_config(cfg))
        return cfg

    def _slowdown(self, cfg: RunConfig, tokens: int) -> float:
        """Capture's measured seconds over the plan's for its tokens (0.75–2): the machine now against the
        calibration, applied to the train step. 1 when capture did not run in this plan."""
        r = self.record
        assert r is not None
        took = r["actual"]["stages"].get("capture")
        rates = self._rates()
        if not took or tokens <= 0:
            return 1.0
        paths = ROLLOUT_CAPTURE if config_recipe(cfg).rollout else 1.0
        predicted = overhead_s("capture", rates) + paths * tokens / rates.capture_tok_s
        return min(2.0, max(0.75, took / predicted))

    def finished(self, stage: str, seconds: float, cfg: RunConfig, rd: RunDir, state: dict[str, Any]) -> None:
        """Record a stage's actual seconds and the sizes it ran with, into `state["budget"]` (pipeline.json's)."""
        r = self.record
        if r is None:
            return
        state["budget"] = r
        act = r.setdefault("actual", {"stages": {}})
        act["stages"][stage] = round(seconds, 1)
        if stage == "prepare":
            n = prepared_lines(rd)
            act["prompts"] = n[0] if n else None
        if stage == "tokenize" and (got := _tokenized(rd)):
            act["samples"], act["tokens"] = got
        act["sizes"] = {k: _get(cfg, k) for k in SIZED}
        act["elapsed_s"] = round(time.time() - self.started + self.carried, 1)


def _get(cfg: RunConfig, key: str) -> Any:
    section, name = key.split(".", 1)
    return getattr(getattr(cfg, section), name)
