"""Rank-0 metric sinks: `train/metrics.jsonl`, `train/curve.json`, progress (`dflashkit.progress`: a bar on a
terminal, a periodic line with rate and ETA otherwise), optional TensorBoard / W&B.

Usage:
    sink = MetricSink(rd, total_steps=1000, start_step=0, train=cfg.train, enabled=is_main)   # rd.train_dir exists
    sink.log({"step": 10, "loss": 2.3, "tau": 1.8, "tok_s": 5e3, "lr": 6e-4})
    sink.close()
    lc = LearningCurve(rd, sources, enabled=is_main)  # train/curve.json (or a curve file's path)
    rows, curve = read_metrics(rd), read_curve(rd)   # report's inputs ([] / None when absent)

This module owns both files (`RunDir.train_metrics`, `RunDir.train_curve`): `MetricSink` and
`LearningCurve` are their writers, `read_metrics` and `read_curve` their readers (report, the run
summary, `sizing/forecast.py`'s `read_curve_forecast`). TensorBoard and W&B are imported only when
asked for (`train.tensorboard`, `train.wandb`).

metrics.jsonl gets one JSON object per logged step or eval. `train/curve.json` has one point per
held-out evaluation: the supervised tokens seen so far (all ranks; overall, `by_source`, `by_mode`),
held-out τ / position-1 accuracy / loss (overall, per source and per mode, with the held-out
`labels` scoring and `tau_raw` / `acc1_raw` on the training labels), the train τ and accuracy since
the previous point, and the optimizer seconds so far (`train_s`, with `supervised_per_sample`: what
the data-budget forecast turns tokens into samples and hours with). The curve is rewritten
atomically at every point and its counters travel in checkpoints. Invariant: on resume both files
drop what lies after the resumed step, so they equal an uninterrupted run's.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflashkit.progress import Progress
from dflashkit.rundir import atomic_write_json, atomic_write_text

if TYPE_CHECKING:
    from dflashkit.rundir import RunDir

log = logging.getLogger("dflashkit.train")


def read_metrics(rd: Any) -> list[dict]:
    """The rows of a run dir's `train/metrics.jsonl` ([] when absent; a torn or non-JSON line is skipped)."""
    path = rd.train_metrics
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def read_curve(where: Any) -> dict | None:
    """The learning curve of a run dir (`train/curve.json`) or of the curve file at a path; None when it is
    absent, unreadable or not a JSON object (a file that is not JSON is logged)."""
    path = Path(where) if isinstance(where, (str, Path)) else where.train_curve
    try:
        curve = json.loads(path.read_text())
    except OSError:
        return None
    except json.JSONDecodeError:
        log.warning("%s is not valid JSON; skipped", path)
        return None
    return curve if isinstance(curve, dict) else None


def truncate_metrics(path: Path, after_step: int) -> None:
    """Drop metric lines with step > after_step (a resumed run re-logs them)."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= after_step:
                keep.append(line)
        except json.JSONDecodeError:
            continue  # a torn last line from a killed run

    atomic_write_text(path, "".join(x + "\n" for x in keep))


class MetricSink:
    """Writes metrics on the main rank only; every method is a no-op elsewhere."""

    def __init__(self, rd: RunDir, *, total_steps: int, start_step: int, train, enabled: bool = True,
                 show_bar: bool = True):
        self.enabled = enabled
        self.path = rd.train_metrics
        out_dir = rd.train_dir
        self.bar = self.tb = self.wandb = None
        if not enabled:
            return
        truncate_metrics(self.path, start_step)
        self.fh = open(self.path, "a")

        # a bar on a terminal (unless show_bar=False), else a line with rate and ETA every ~15 s
        self.bar = Progress("train", total=total_steps, initial=start_step, unit="step", tty=None if show_bar else False)
        if train.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(Path(out_dir) / "tensorboard"))
            except ImportError:
                log.warning("train.tensorboard is on but tensorboard is not installed (pip install "
                            "'dflashkit[tensorboard]'); skipping")
        if train.wandb:
            try:
                import wandb

                self.wandb = wandb.init(project="dflashkit", dir=str(out_dir), resume="allow")
            except ImportError:
                log.warning("train.wandb is on but wandb is not installed (pip install 'dflashkit[wandb]'); skipping")

    def log(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.fh.write(json.dumps(row) + "\n")
        self.fh.flush()
        step = int(row.get("step", 0))
        scalars = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def progress(self, step: int, **shown: float) -> None:
        if self.enabled and self.bar is not None:
            self.bar.set(step, **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in shown.items()})

    def close(self, ok: bool = True) -> None:
        """`ok=False` (stopped by an error or a signal): no "train: done" line."""
        if not self.enabled:
            return
        self.fh.close()
        if self.bar is not None:
            self.bar.close(ok=ok)
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


class LearningCurve:
    """Learning-curve points (see the module docstring); writes only when `enabled` (main rank)."""

    def __init__(self, where: RunDir | str | Path, sources: list[str], *, enabled: bool = True,
                 supervised_per_sample: float | None = None, tokens_per_sample: float | None = None):
        """`where`: a run dir (its `train/curve.json`) or a curve file's path."""
        self.path = Path(where) if isinstance(where, (str, Path)) else where.train_curve
        self.enabled = enabled
        self.tokens = {s: 0 for s in sources}       # cumulative supervised tokens per source
        self.window = [0.0, 0.0, 0.0, 0.0]          # train τ-sum, blocks, pos-1 correct, pos-1 total
        self.train_s = 0.0                          # cumulative seconds in optimizer steps (no evals)
        self.supervised_per_sample, self.tokens_per_sample = supervised_per_sample, tokens_per_sample
        self.points: list[dict] = []

    def state_dict(self) -> dict:
        return {"tokens": dict(self.tokens), "window": list(self.window), "train_s": self.train_s}

    def restore(self, start_step: int, state: dict | None) -> None:
        """Counters from the checkpoint's `state` (None: a fresh run) and the file's points ≤ start_step."""
        if state is None:
            start_step = 0
        else:
            self.tokens.update({k: int(v) for k, v in state["tokens"].items()})
            self.window = [float(x) for x in state["window"]]
            self.train_s = float(state.get("train_s", 0.0))
        if start_step > 0 and self.path.is_file():
            try:
                self.points = [p for p in json.loads(self.path.read_text())["points"] if p["step"] <= start_step]
            except (json.JSONDecodeError, KeyError, TypeError):
                log.warning("%s is unreadable; the curve restarts at step %d", self.path, start_step)
        if self.enabled:
            self._write()

    def add_step(self, tokens_by_source: dict[str, int], window: list[float], seconds: float = 0.0) -> None:
        """Account one optimizer step: its global supervised tokens, its train τ / accuracy sums and its
        wall seconds (the forecast's time per token)."""
        self.train_s += float(seconds)
        for k, v in tokens_by_source.items():
            self.tokens[k] = self.tokens.get(k, 0) + int(v)
        self.window = [a + float(b) for a, b in zip(self.window, window)]

    def record(self, step: int, heldout: dict) -> dict:
        """Append the point of a held-out evaluation (`loop.evaluate_heldout`'s dict) and rewrite the file."""
        def acc1(r):
            return r["acc"][0] if r.get("acc") else None

        tau_sum, blocks, c1, t1 = self.window
        point = {"step": step, "tokens": sum(self.tokens.values()), "train_s": round(self.train_s, 3),
                 "heldout": {"tau": heldout["tau"], "acc1": acc1(heldout), "loss": heldout["loss"],
                             **({"unary_tau": heldout["unary_tau"]} if "unary_tau" in heldout else {}),
                             **({"labels": heldout["heldout_labels"], "tau_raw": heldout.get("tau_raw"),
                                 "acc1_raw": (heldout.get("acc_raw") or [None])[0]}
                                if "heldout_labels" in heldout else {})},
                 "train": {"tau": tau_sum / blocks if blocks else None, "acc1": c1 / t1 if t1 else None},
                 "by_source": {k: {"tokens": self.tokens.get(k, 0),
                                   **({"tau": v["tau"], "acc1": acc1(v), "loss": v["loss"]} if v else {})}
                               for k, v in {**{s: None for s in self.tokens},
                                            **heldout.get("by_source", {})}.items()}}
        modes = heldout.get("modes") or {}
        if modes:
            held = heldout.get("by_mode", {})
            point["by_mode"] = {
                m: {"tokens": sum(self.tokens.get(s, 0) for s, sm in modes.items() if sm == m),
                    "sources": sorted(s for s, sm in modes.items() if sm == m),
                    **({"tau": held[m]["tau"], "acc1": acc1(held[m]), "loss": held[m]["loss"],
                        "samples": held[m].get("samples")} if m in held else {})}
                for m in sorted(set(modes.values()))}
        self.points.append(point)
        self.window = [0.0, 0.0, 0.0, 0.0]
        if self.enabled:
            self._write()
        return point

    def _write(self) -> None:
        labels = next((p["heldout"]["labels"] for p in reversed(self.points) if "labels" in p["heldout"]), None)
        by_mode: dict[str, Any] = next((p["by_mode"] for p in reversed(self.points) if "by_mode" in p), {})
        atomic_write_json(self.path, {"x": "supervised tokens seen (loss_mask, all ranks)",
                                      "heldout_labels": labels,
                                      "sources": sorted(self.tokens),
                                      "modes": dict(sorted((s, m) for m, v in by_mode.items() for s in v["sources"])),
                                      "supervised_per_sample": self.supervised_per_sample,
                                      "tokens_per_sample": self.tokens_per_sample,
                                      "points": self.points})
