"""`dflashkit report`: one self-contained HTML page (plus the PNGs) summarising a run directory.

Inputs:  whatever exists of `train/metrics.jsonl`, `train/curve.json`, `train/best/best.json`,
         `eval/results.json`, `bench/decode.json`,
         `bench/serve.json`, `config.resolved.yaml`, `contract.json` and the stage manifests.
Outputs: `report/index.html` (inline CSS, plots embedded as base64 PNG data URIs, drawn by
         matplotlib), `report/*.png`, manifest.
Example: dflashkit report -c run.yaml   (then open runs/x/report/index.html)

Plots: training loss and simulated τ per step (train and held-out), per-position acceptance and
the τ histogram from eval, speedup vs concurrency from `bench serve`, and the learning curve
(held-out τ and position-1 accuracy against supervised tokens seen, per data source, beside train τ:
the train-vs-held-out gap; `curve_section`). Tables: eval numbers with the bound τ·t(1)/t(B)
beside the measured speedup; the drafter vs the prompt-lookup proposer (τ, speedup, position-1
acceptance), the bigram baseline and the no-feature ablation, the lossless verdict (exact / ties
only, with the count and the largest tie margin; `eval.dtype=auto`'s choice); the decode bench,
the contract, provenance (per-stage manifests: time, counts, versions) and the resolved config. The plots
and the page are `dflashkit.report` (`plots.py`, `page.py`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from dflashkit.bench.results import read_bench_result
from dflashkit.config import RunConfig
from dflashkit.context import StageContext
from dflashkit.decode.evaluation import read_eval_results
from dflashkit.engines.verify import read_engine_results
from dflashkit.errors import MissingArtifactError
from dflashkit.report.page import curve_section, figure_html, render_html
from dflashkit.report.plots import draw_png, plot_specs
from dflashkit.rundir import RunDir, atomic_write_bytes, atomic_write_text, write_manifest
from dflashkit.train.checkpoint import read_best
from dflashkit.train.logging import read_curve, read_metrics

log = logging.getLogger("dflashkit.report")


def run(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict[str, Any]:
    t0 = time.time()
    metrics = read_metrics(rd)
    results = read_eval_results(rd)
    serve = read_bench_result(rd, "serve")
    bench = read_bench_result(rd, "decode")
    curve = read_curve(rd)
    best = read_best(rd.best_dir, complete=False)
    if not metrics and not results and not serve and not bench and not curve:
        raise MissingArtifactError("training metrics or eval results", rd.train_metrics,
                                   run="dflashkit train -c run.yaml (and dflashkit eval)")
    specs = plot_specs(metrics, results, serve)
    curve_specs, curve_html = curve_section(curve, best, cfg.train.forecast_tau)
    specs += curve_specs
    if ctx.dry_run:
        return {"dry_run": True, "plots": [s[0] for s in specs]}
    out = rd.stage_dir("report")
    figures, files = [], []
    for spec in specs:
        png = draw_png(spec)
        atomic_write_bytes(out / f"{spec[0]}.png", png)
        files.append(f"{spec[0]}.png")
        figures.append(figure_html(spec[1], png))
    page = render_html(rd, cfg.run.name, figures, results, bench, metrics, curve_html,
                       engine=read_engine_results(rd))
    atomic_write_text(out / "index.html", page)
    write_manifest(out, stage="report", config_hash="", started=t0, outputs=["index.html", *files],
                   counts={"plots": len(specs)})
    log.info("report: %s (%d plots)", out / "index.html", len(specs))
    return {"html": str(out / "index.html"), "plots": [s[0] for s in specs], "png": files}
