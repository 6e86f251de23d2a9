"""`dflashkit gpu-check`: the CUDA paths no CPU test reaches, checked in under 8 minutes on one GPU.

Inputs:  nothing: the targets are built in place (the tiny target of `target/tiny.py`, random targets of
         Qwen3-8B's and a medium shape in memory); no weights, no network. Positionals: OUT_DIR (default
         `<run.run_dir>/gpu-check`), then the checks to run (default all: flex, bf16-8b, cpu-gpu, decode,
         distributed).
Outputs: OUT_DIR/summary.json (the GPU, torch / CUDA / transformers versions, each check's status, numbers
         and duration) and OUT_DIR/gpu-check.log (the human log, each check's own output after it). Nothing in
         a run dir; scratch run dirs live in a temp dir removed at the end. OUT_DIR must be new, empty, or a
         previous gpu-check's (its summary.json says `"tool": "dflashkit gpu-check"`); anything else (a user's
         directory, a file, a place it cannot write) is refused before any check runs, `--dry-run` too.
Exit:    0 when every check passed or was skipped with a reason, or when there is no CUDA device ("no CUDA
         device: the GPU check did not run"); 1 when a check failed (the JSON's `failed` names it); 2 when
         OUT_DIR is refused or a check's name is unknown.

Example (on a lent GPU machine, nothing installed: the image's python3 has torch and transformers):
    PYTHONPATH=src python3 -m dflashkit gpu-check "$OUT"
    dflashkit gpu-check /tmp/gpu-check decode distributed

The checks and their time boxes: `dflashkit.gpucheck` (runner.CHECKS).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflashkit.config import RunConfig
from dflashkit.context import StageContext
from dflashkit.errors import StageFailed
from dflashkit.gpucheck import runner
from dflashkit.rundir import RunDir


def run(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict[str, Any]:
    out = Path(ctx.positionals[0]) if ctx.positionals else rd.gpu_check_dir
    chosen = runner.select(ctx.positionals[1:])
    runner.check_out_dir(out, label="gpu-check OUT_DIR" if ctx.positionals
                         else "gpu-check's default OUT_DIR (run.run_dir/gpu-check)")
    if ctx.dry_run:
        return {"dry_run": True, "out_dir": str(out), "deadline_s": runner.DEADLINE_S,
                "checks": [{"name": s.name, "time_box_s": s.box_s, "what": s.what} for s in chosen]}
    summary = runner.run_gpu_check(out, checks=[s.name for s in chosen])
    brief = {"out_dir": str(out), "ran": summary["ran"], "gpu": summary["gpu"].get("name"),
             "checks": {n: r["status"] for n, r in summary["checks"].items()}, "failed": summary["failed"],
             "wall_s": summary.get("wall_s")}
    if not summary["ran"]:
        print(runner.NO_CUDA, flush=True)
        return {**brief, "reason": runner.NO_CUDA}
    if not ctx.json:
        print(runner.human_log(summary, {}), end="", flush=True)
    if summary["failed"]:
        raise StageFailed(f"gpu-check: {len(summary['failed'])} of {len(summary['checks'])} checks failed: "
                          f"{', '.join(summary['failed'])}", result=brief,
                          hint=f"each failed part and its numbers: {out / runner.SUMMARY}; the checks' output: "
                          f"{out / runner.LOG}")
    return brief
