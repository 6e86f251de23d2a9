"""Held-out evaluation and best keeping: what `fit` measures on the held-out samples and keeps.

Usage:
    ev = evaluate_heldout(tr, step)          # simulated τ / accuracy / loss, overall and by_source
    log_eval(sink, ev)                       # its metrics.jsonl row
    best = BestKeeper(rd.train_dir, tr, enabled=cfg.train.keep_best)
    best.restore(start, state); best.offer(ev)   # train/best/ (+ best.json) when τ beats the record
    metrics_of(stats, B, step)               # a step's (or an evaluation's) summed statistics → metrics

The statistics vector of a step or an evaluation: loss, τ sum, blocks, tokens, correct [B], total
[B] (summed over micro-batches and ranks).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from dflashkit.train import checkpoint as ckpt
from dflashkit.train.parallel import all_reduce_sum, barrier

if TYPE_CHECKING:
    from dflashkit.train.logging import MetricSink

Trainer = Any  # train.loop.Trainer (not imported: loop imports this module)

log = logging.getLogger("dflashkit.train")


def stats_size(B: int) -> int:
    """Length of a step's summable statistics: loss, τ sum, blocks, tokens, correct [B], total [B], then
    DFlash2's unary τ sum, unary correct [B] and selector rows, covered, correct, loss."""
    return 4 + 2 * B + 1 + B + 4


def dflash2_stats(out, B: int, *, loss_scale: float) -> torch.Tensor:
    """The DFlash2 tail of the statistics (zeros for a DFlash drafter)."""
    tail = torch.zeros(1 + B + 4, dtype=torch.float64)
    if out.selector is None:
        return tail
    tail[0] = out.unary_tau_sum
    tail[1:1 + B] = out.unary_correct.double()
    sel = out.selector.as_list()
    tail[1 + B:] = torch.tensor(sel[:3] + [sel[3] * loss_scale], dtype=torch.float64)
    return tail


def _ratio(a: torch.Tensor, b: torch.Tensor) -> float | None:
    return round(float(a / b), 4) if b > 0 else None


def metrics_of(stats: torch.Tensor, B: int, step: int, *, dflash2: bool = False, **extra) -> dict:
    """Metrics of summed statistics; a DFlash2 drafter's τ / acc are the walk's, `unary_*` the argmax's."""
    correct, total = stats[4:4 + B], stats[4 + B:4 + 2 * B]
    acc = [_ratio(c, t) for c, t in zip(correct[1:], total[1:])]
    out = {"step": step, "loss": float(stats[0]), "tau": float(stats[1] / max(stats[2], 1)),
           "acc": acc, "acc_mean": float(correct[1:].sum() / max(total[1:].sum(), 1)),
           "blocks": int(stats[2]), "tokens": int(stats[3]),
           "_window": [float(stats[1]), float(stats[2]), float(correct[1]), float(total[1])], **extra}
    if dflash2:
        tail = stats[4 + 2 * B:]
        unary = tail[1:1 + B]
        rows, covered, sel_ok, sel_loss = tail[1 + B:]
        out.update(unary_tau=float(tail[0] / max(stats[2], 1)),
                   unary_acc=[_ratio(c, t) for c, t in zip(unary[1:], total[1:])],
                   selector_acc=_ratio(sel_ok, rows), topk_coverage=_ratio(covered, rows),
                   selector_loss=float(sel_loss))
    return out


@torch.no_grad()
def evaluate_heldout(tr: Trainer, step: int) -> dict | None:
    """Simulated τ / per-position accuracy on the held-out samples (fixed anchors; same on every rank).

    Blocks are scored with `tr.heldout_labels` ("target_path": the target's own greedy path;
    "on_path_positions": its argmax labels on the positions on that path only; "raw": the training labels,
    `train/target_side.py`); `tau_raw` / `acc_raw` beside them score the same blocks with the training
    labels, as before on-path scoring, so old and new curves compare. Samples are batched within their data
    source, so the result also holds `by_source` (the same numbers per source; the overall numbers are
    their pooled sums)."""
    if not tr.heldout:
        return None
    B = tr.contract.block_size
    src = tr.sources()
    groups: dict[str, list[int]] = {}
    for j in tr.heldout:
        groups.setdefault(src[j], []).append(j)
    bs = tr.cfg.train.batch_size
    how = tr.heldout_labels
    total, total_raw = (torch.zeros(stats_size(B), dtype=torch.float64) for _ in range(2))
    by_source = {}
    for name in sorted(groups):
        stats, raw = (torch.zeros(stats_size(B), dtype=torch.float64) for _ in range(2))
        idx = groups[name]
        for i in range(0, len(idx), bs):
            b = tr.batch([(j, -1) for j in idx[i:i + bs]], heldout=True)
            a = tr.anchors(b)
            tout = tr.target_outputs(b, a)
            _add(stats, tr.micro_loss(b, a, None, tout, scoring=how), B)
            if how != "raw":
                _add(raw, tr.micro_loss(b, a, None, tout, scoring="raw"), B)
        total += stats
        total_raw += raw if how != "raw" else stats
        by_source[name] = {**_heldout_row(stats, B, step, dflash2=tr.contract.is_dflash2, samples=len(idx)),
                           **_raw(raw if how != "raw" else stats, B, step)}
    row = _heldout_row(total, B, step, dflash2=tr.contract.is_dflash2)
    return {"split": "heldout", **row, "heldout_labels": how, **_raw(total_raw, B, step), "by_source": by_source}


def _add(stats: torch.Tensor, out, B: int) -> None:
    """Add one held-out micro-batch's `LossOutput` to the summed statistics."""
    stats[0] += float(out.loss) * out.weight_sum
    stats[1] += out.tau_sum
    stats[2] += out.blocks
    stats[3] += out.weight_sum
    stats[4:4 + 2 * B] += torch.cat([out.correct, out.total]).double()
    stats[4 + 2 * B:] += dflash2_stats(out, B, loss_scale=1.0)


def _raw(stats: torch.Tensor, B: int, step: int) -> dict:
    """`tau_raw` / `acc_raw`: the held-out numbers scored with the training labels."""
    m = _heldout_row(stats, B, step)
    return {"tau_raw": m["tau"], "acc_raw": m["acc"]}


def _heldout_row(stats: torch.Tensor, B: int, step: int, *, dflash2: bool = False, **extra) -> dict:
    stats = stats.clone()
    stats[0] /= max(float(stats[3]), 1e-6)
    stats[-1] /= max(float(stats[3]), 1e-6)   # DFlash2's selector loss: Σ w·CE / Σ w, as the loss
    m = metrics_of(stats, B, step, dflash2=dflash2)
    keys = ("unary_tau", "unary_acc", "selector_acc", "topk_coverage", "selector_loss") if dflash2 else ()
    return {"step": step, "loss": m["loss"], "tau": m["tau"], "acc": m["acc"], "acc_mean": m["acc_mean"],
            "blocks": m["blocks"], **{k: m[k] for k in keys}, **extra}


def log_eval(sink: MetricSink, ev: dict) -> None:
    """The metrics.jsonl row of a held-out evaluation (per-source numbers only with several sources)."""
    row = {k: v for k, v in ev.items() if k != "by_source"}
    if len(ev.get("by_source", {})) > 1:
        row["by_source"] = {k: {"tau": v["tau"], "acc": v["acc"], "loss": v["loss"], "tau_raw": v.get("tau_raw")}
                            for k, v in ev["by_source"].items()}
    sink.log(row)


class BestKeeper:
    """`train/best/`: the drafter of the held-out evaluation with the highest τ so far (earliest on ties)."""

    def __init__(self, out_dir, tr: Trainer, enabled: bool):
        self.dir, self.tr, self.enabled = out_dir / "best", tr, enabled
        self.record: dict | None = None

    def restore(self, start: int, state: dict | None) -> None:
        """Fresh run (or keep_best off): a stale best/ is removed. Resume: the checkpoint's record
        (else best.json, if it is not newer than the checkpoint) is the best so far."""
        if start == 0 or not self.enabled:
            if self.tr.dist.is_main and self.dir.exists():
                import shutil

                from dflashkit.rundir import check_replaceable

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
