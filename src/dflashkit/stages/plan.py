"""`dflashkit plan`: estimate disk, memory and time for a target + data size, and the mode that fits.

Inputs:  the drafter contract + target facts (`contract.json`, `probe/probe.json`), or a probe of
         the positional MODEL / `target.path` (nothing is written); the data size from
         `tokenize/stats.json`, else `prepare/train.jsonl` lines (or `data.num_prompts`, else 10,000)
         × `data.mean_tokens`; the GPUs from a positional `NxMEM` (e.g. `8x80` = 8 GPUs of 80 GiB),
         else the visible CUDA devices, else 1x80. `train.*` (batch, anchors, loss_chunk_blocks,
         loss) and `capture.dtype` shape the estimate.
         Times: from this machine's saved calibration (`dflashkit run --budget M` measures one) when it
         matches the config, else FLOPs at an assumed 400 TFLOP/s per GPU; the table says which. A calibration
         file that is not valid (corrupt, cut short, another machine's or config's, a rate that is not a finite
         number > 0: `sizing.calibration.find_calibration`) is not used: a warning and the table's
         "calibration" row (the JSON's `calibration_ignored`) say "ignored <file>: <why>", exit 0.
         A positional `CURVE.json` (a `train/curve.json`) adds the data-budget forecast for
         `train.forecast_tau` (`sizing/forecast.py`), with hours at this plan's training speed.
Outputs: nothing on disk; a table and the JSON (`sizing/estimate.py` gathers the inputs, `sizing/budget.py`
         holds every formula).

Example:
    dflashkit plan -c run.yaml 8x80
    dflashkit plan path/to/Kimi-K2.6 8x141 data.num_prompts=800000 data.mean_tokens=3000 --json
"""

from __future__ import annotations

import logging
from typing import Any

from dflashkit.config import RunConfig
from dflashkit.context import StageContext
from dflashkit.data.records import prepared_lines
from dflashkit.errors import UsageError
from dflashkit.sizing.estimate import estimate
from dflashkit.inspect.paths import paths_text
from dflashkit.rundir import RunDir
from dflashkit.sizing.calibration import find_calibration
from dflashkit.sizing.forecast import curve_file_forecast

log = logging.getLogger("dflashkit.plan")


def _lookups(d: dict[str, Any]) -> str:
    n = d.get("lookup_params") or 0
    return f" (of which {n / 1e6:.1f}M looked up, not multiplied)" if n else ""


def _n(n: float) -> str:
    """A parameter count: 1.79B, 154.1M, 7.2K, 12."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.{2 if unit == 'B' else 1}f}{unit}"
    return str(int(n))


def _parts(d: dict[str, Any]) -> str:
    """The drafter's parameters part by part (`sizing.budget.drafter_parts`) and its weights at the export dtype."""
    p, layer = d["parts"], d["parts"]["layer"]
    fam = "".join(f", {name} {_n(n)}" for name, n in p["family"].items())
    vocab = f"; draft vocab {d['draft_vocab_size']}" if d.get("draft_vocab_size") else ""
    return (f"{d['num_draft_layers']} layers × {_n(sum(layer.values()))} (attention {_n(layer['attention'])}, "
            f"MLP {_n(layer['mlp'])}, norms {_n(layer['norms'])}) = {_n(p['layers'])}, fc {_n(p['fc'])}, "
            f"norms {_n(p['norms'])}{fam}; total {_n(d['params'])}{vocab}; weights {d['weights_gib']} GiB at "
            f"{d['weights_dtype']}")


def _table(r: dict[str, Any]) -> str:
    p = r["plan"]
    t = p["target"]
    local = (f"; loaded locally {t['local_weights_gib']} GiB at {t['local_bytes_per_param']} B/param"
             if t.get("local_weights_bytes", t["weights_bytes"]) != t["weights_bytes"] else "")
    rows = [("target", f"{r['source']} ({t['params_total'] / 1e9:.2f}B params, "
                       f"{t['weights_gib']} GiB at {t['bytes_per_param']} B/param{local})"),
            ("data", f"{r['sequences']} sequences, {r['tokens']} tokens ({r['data_source']})"),
            ("gpus", f"{r['gpus']} × {r['gpu_mem_gib']:.0f} GiB ({r['gpu_source']})"),
            ("cached features", f"{p['features']['bytes_per_token']} B/token → {p['features']['total_gib']} GiB"),
            ("drafter", f"{p['drafter']['type']}, {p['drafter']['params'] / 1e6:.1f}M params "
                        f"({p['drafter']['params']}; attention {p['drafter']['attention']}, "
                        f"{p['drafter']['attention_params_per_layer'] / 1e6:.1f}M per layer)"
                        f"{_lookups(p['drafter'])}; weights+grads+Adam "
                        f"{p['drafter']['weights_grads_adam_gib']} GiB, "
                        f"activations {p['drafter']['activations_gib']} GiB, frozen embedding + head "
                        f"{p['drafter']['frozen_embed_head_gib']} GiB"),
            ("drafter parts", _parts(p["drafter"])),
            ("logits", f"{p['logits']['vocab']} wide, {p['logits']['per_sequence_gib']} GiB/sequence unchunked; chunk "
                       f"{p['logits']['loss_chunk_blocks']} blocks = {p['logits']['chunk_gib']} GiB; max that "
                       f"fits {p['logits']['max_loss_chunk_blocks']}")]
    for m in p["modes"]:
        extra = f", disk {m['disk_gib']} GiB, capture fits: {m['capture_fits']}" if m["mode"] == "cached" else ""
        if m["mode"] == "engine":
            extra = f", disk {m['disk_gib']} GiB ({m['disk_bytes']} B: the bounded queue; the engine serves the target)"
        rows.append((m["mode"], f"{m['per_gpu_gib']} GiB/GPU, fits: {m['fits']}{extra}  [{m['config']}]"))
    tm = p["time"]
    if p.get("paths"):
        rows.append(("paths", paths_text(p["paths"])))
    rows += [("recommended", str(p["recommended"] or "nothing fits: more GPUs, smaller train.batch_size or "
                                 "train.num_anchors")),
             ("time / epoch", f"online {tm['hours_per_epoch_online']} h, cached {tm['hours_per_epoch_cached']} h "
                              f"(+ capture {tm['hours_capture']} h): {tm['source']}")]
    return "\n".join(f"{k.ljust(16)}  {v}" for k, v in rows)


def run(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict[str, Any]:
    curves = [p for p in ctx.positionals if p.endswith(".json")]  # a train/curve.json: the forecast at scale
    ignored: list[str] = []

    def calibration(c: RunConfig, r: RunDir) -> dict[str, Any] | None:
        cal, notes = find_calibration(c, r)
        ignored.extend(f"ignored {n}" for n in notes)
        return cal

    result = estimate(cfg, rd, [p for p in ctx.positionals if not p.endswith(".json")], prepared_lines=prepared_lines,
                      calibration=calibration)
    for note in ignored:
        log.warning("calibration: %s", note)
    if ignored:
        result["calibration_ignored"] = ignored
    if len(curves) > 1:
        raise UsageError(f"`dflashkit plan` takes one CURVE.json, got {curves}",
                         hint="dflashkit plan [MODEL] [8x80] [runs/x/train/curve.json]")
    if curves:
        result["forecast"] = curve_file_forecast(curves[0], cfg.train.forecast_tau,
                                                 hours_per_epoch=result["plan"]["time"]["hours_per_epoch_online"],
                                                 epoch_tokens=result["tokens"])
    if not ctx.json:
        print(_table(result), flush=True)
        for note in ignored:
            print(f"{'calibration'.ljust(16)}  {note}", flush=True)
        if curves:
            print(f"{'forecast'.ljust(16)}  {result['forecast']['text']}", flush=True)
    return result
