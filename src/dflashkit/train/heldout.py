"""Held-out evaluation and best keeping: what `fit` measures on the held-out samples and keeps.

Usage:
    ev = evaluate_heldout(tr, step)          # simulated τ / accuracy / loss, overall, by_source and by_mode
    log_eval(sink, ev)                       # its metrics.jsonl row
    best = BestKeeper(rd.best_dir, tr, enabled=cfg.train.keep_best)
    best.restore(start, state); best.offer(ev)   # train/best/ (+ best.json) when τ beats the record

An evaluation sums `train/stats.StepStats` over its batches (the loss as loss·Σw, normalised per Σw
at the end), per data source and pooled; the drafter family adds its own metrics (`Objective.stats`).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dflashkit.rundir import check_replaceable
from dflashkit.train import checkpoint as ckpt
from dflashkit.train.parallel import all_reduce_sum, barrier
from dflashkit.train.stats import StepStats
from dflashkit.train.trainer import Trainer

if TYPE_CHECKING:
    from dflashkit.train.logging import MetricSink

log = logging.getLogger("dflashkit.train")


@torch.no_grad()
def evaluate_heldout(tr: Trainer, step: int) -> dict | None:
    """Simulated τ / per-position accuracy on the held-out samples (fixed anchors; same on every rank).

    Blocks are scored with `tr.heldout_labels` ("target_path": the target's own greedy path;
    "on_path_positions": its argmax labels on the positions on that path only; "raw": the training labels,
    `train/target_side.py`); `tau_raw` / `acc_raw` beside them score the same blocks with the training
    labels, as before on-path scoring, so old and new curves compare. Samples are batched within their data
    source, so the result also holds `by_source` (the same numbers per source; the overall numbers are
    their pooled sums) and `by_mode` (pooled per thinking mode, `data.chat.mode_of` of the source's template
    variables, each with its `sources`); `modes` maps every data source of the run to its mode."""
    if not tr.heldout:
        return None
    B = tr.contract.block_size
    src = tr.sources()
    modes = dict(tr.modes)
    groups: dict[str, list[int]] = {}
    for j in tr.heldout:
        groups.setdefault(src[j], []).append(j)
    bs = tr.train.batch_size
    fam, how = tr.contract.family, tr.heldout_labels
    total, total_raw = StepStats.zeros(B, fam), StepStats.zeros(B, fam)
    per_mode: dict[str, list] = {}  # mode -> [stats, raw stats, sources]
    by_source = {}
    for name in sorted(groups):
        stats, raw = StepStats.zeros(B, fam), StepStats.zeros(B, fam)
        idx = groups[name]
        for i in range(0, len(idx), bs):
            b = tr.batch([(j, -1) for j in idx[i:i + bs]], heldout=True)
            a = tr.anchors(b)
            tout = tr.target_outputs(b, a)
            stats.add_heldout(tr.micro_loss(b, a, None, tout, scoring=how))
            if how != "raw":
                raw.add_heldout(tr.micro_loss(b, a, None, tout, scoring="raw"))
        raw = raw if how != "raw" else stats
        total += stats
        total_raw += raw
        pooled = per_mode.setdefault(modes[name], [StepStats.zeros(B, fam), StepStats.zeros(B, fam), []])
        pooled[0] += stats  # `+=` makes a new StepStats: the list item is rebound
        pooled[1] += raw
        pooled[2].append(name)
        by_source[name] = {**stats.heldout_row(step, samples=len(idx)), **_raw(raw, step)}
    by_mode = {mode: {**m.heldout_row(step, samples=sum(len(groups[n]) for n in names)), **_raw(r, step),
                      "sources": names} for mode, (m, r, names) in sorted(per_mode.items())}
    return {"split": "heldout", **total.heldout_row(step), "heldout_labels": how, **_raw(total_raw, step),
            "by_source": by_source, "by_mode": by_mode, "modes": modes}


def _raw(stats: StepStats, step: int) -> dict:
    """`tau_raw` / `acc_raw`: the held-out numbers scored with the training labels."""
    m = stats.heldout_row(step)
    return {"tau_raw": m["tau"], "acc_raw": m["acc"]}


def log_eval(sink: MetricSink, ev: dict) -> None:
    """The metrics.jsonl row of a held-out evaluation (per-source and per-mode numbers only with several)."""
    row = {k: v for k, v in ev.items() if k not in ("by_source", "by_mode", "modes")}
    for key in ("by_source", "by_mode"):
        if len(ev.get(key, {})) > 1:
            row[key] = {k: {"tau": v["tau"], "acc": v["acc"], "loss": v["loss"], "tau_raw": v.get("tau_raw")}
                        for k, v in ev[key].items()}
    sink.log(row)


class BestKeeper:
    """`train/best/`: the drafter of the held-out evaluation with the highest τ so far (earliest on ties)."""

    def __init__(self, best_dir: Path, tr: Trainer, enabled: bool):
        self.dir, self.tr, self.enabled = Path(best_dir), tr, enabled
        self.record: dict | None = None

    def restore(self, start: int, state: dict | None) -> None:
        """Fresh run (or keep_best off): a stale best/ is removed. Resume: the checkpoint's record
        (else best.json, if it is not newer than the checkpoint) is the best so far."""
        if start == 0 or not self.enabled:
            if self.tr.dist.is_main and self.dir.exists():
                check_replaceable(self.dir, owner="train", marker="model.safetensors")  # never a user's dir
                log.info("removing %s from an earlier run", self.dir)
                shutil.rmtree(self.dir)
            barrier(self.tr.dist)
            return
        if state is not None and "best" in state:
            self.record = state["best"]
            return
        rec = ckpt.read_best(self.dir)
        self.record = rec if rec is not None and rec["step"] <= start else None

    def offer(self, ev: dict | None) -> bool:
        """Save the drafter as best when `ev` beats the record; True when it did."""
        if not self.enabled or not ev:
            return False
        better = (self.record is None or ev["tau"] > self.record["tau"]
                  or self.record.get("heldout_labels", "raw") != ev.get("heldout_labels", "raw"))  # another yardstick
        if self.tr.dist.world > 1:  # every rank gathers the weights: follow the main rank's decision
            flag = torch.tensor([1.0 if better and self.tr.dist.is_main else 0.0], dtype=torch.float64)
            better = float(all_reduce_sum(flag, self.tr.dist)[0]) > 0
        if not better:
            return False
        acc1 = ev["acc"][0] if ev["acc"] else None
        self.record = {"step": ev["step"], "tau": ev["tau"], "acc": ev["acc"], "acc_pos1": acc1,
                       "loss": ev["loss"], "heldout_labels": ev.get("heldout_labels", "raw")}
        ckpt.save_final(self.dir, self.tr.drafter, self.tr.contract, is_main=self.tr.dist.is_main, best=self.record)
        barrier(self.tr.dist)
        log.info("best held-out τ %.4f at step %d → %s", ev["tau"], ev["step"], self.dir)
        return True
