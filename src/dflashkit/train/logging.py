"""Rank-0 metric sinks: `train/metrics.jsonl`, a tqdm bar, optional TensorBoard / W&B.

Usage:
    sink = MetricSink(rd.stage_dir("train"), total_steps=1000, start_step=0, train=cfg.train, enabled=is_main)
    sink.log({"step": 10, "loss": 2.3, "tau": 1.8, "tok_s": 5e3, "lr": 6e-4})
    sink.close()

metrics.jsonl is appended line by line (one JSON object per logged step or eval); on resume the
lines after the resumed step are dropped first so the file matches an uninterrupted run.
TensorBoard and W&B are imported only when asked for (`train.tensorboard`, `train.wandb`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("dflashkit.train")


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
    from dflashkit.rundir import atomic_write_text

    atomic_write_text(path, "".join(x + "\n" for x in keep))


class MetricSink:
    """Writes metrics on the main rank only; every method is a no-op elsewhere."""

    def __init__(self, out_dir: Path, *, total_steps: int, start_step: int, train, enabled: bool = True,
                 show_bar: bool = True):
        self.enabled = enabled
        self.path = Path(out_dir) / "metrics.jsonl"
        self.bar = self.tb = self.wandb = None
        if not enabled:
            return
        truncate_metrics(self.path, start_step)
        self.fh = open(self.path, "a")
        if show_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)
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
            self.bar.n = step
            self.bar.set_postfix({k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in shown.items()},
                                 refresh=True)

    def close(self) -> None:
        if not self.enabled:
            return
        self.fh.close()
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
