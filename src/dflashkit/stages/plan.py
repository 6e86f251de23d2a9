"""`dflashkit plan`: estimate disk, memory and time for a target + data size, and the mode that fits.

Inputs:  the drafter contract + target facts (`contract.json`, `probe/probe.json`), or a probe of
         the positional MODEL / `target.path` (nothing is written); the data size from
         `tokenize/stats.json`, else `prepare/train.jsonl` lines (or `data.num_prompts`, else 10,000)
         × `data.mean_tokens`; the GPUs from a positional `NxMEM` (e.g. `8x80` = 8 GPUs of 80 GiB),
         else the visible CUDA devices, else 1x80. `train.*` (batch, anchors, loss_chunk_blocks,
         loss) and `capture.dtype` shape the estimate.
Outputs: nothing on disk; a table and the JSON (see `dflashkit.inspect.budget` for every formula).

A positional `CURVE.json` (a `train/curve.json`) adds the data-budget forecast for
`train.forecast_tau` (`dflashkit.train.forecast`), its hours at this plan's training speed.

Example:
    dflashkit plan -c run.yaml 8x80 runs/demo/train/curve.json
    dflashkit plan -c run.yaml 8x80
    dflashkit plan path/to/Kimi-K2.6 8x141 data.num_prompts=800000 data.mean_tokens=3000 --json
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from typing import Any

from dflashkit.config import RunConfig
from dflashkit.context import StageContext
from dflashkit.errors import MissingArtifactError, UsageError
from dflashkit.rundir import RunDir

log = logging.getLogger("dflashkit.plan")
GPU_SPEC = re.compile(r"^(\d+)x(\d+(?:\.\d+)?)(?:gib|gb|g)?$", re.I)
DEFAULT_PROMPTS = 10_000


def parse_gpus(positionals: list[str]) -> tuple[int, float, str, list[str]]:
    """(gpus, GiB per GPU, source, remaining positionals)."""
    rest, spec = [], None
    for p in positionals:
        m = GPU_SPEC.match(p)
        if m and spec is None:
            spec = (int(m.group(1)), float(m.group(2)))
        else:
            rest.append(p)
    if spec:
        if spec[0] < 1 or spec[1] <= 0:
            raise UsageError(f"GPU spec {positionals}: need N >= 1 GPUs and memory > 0, e.g. 8x80")
        return spec[0], spec[1], "argument", rest
    try:
        import torch

        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            return n, torch.cuda.get_device_properties(0).total_memory / 2**30, "detected", rest
    except ImportError:
        pass
    return 1, 80.0, "assumed (pass e.g. 8x80 for 8 GPUs of 80 GiB)", rest


def data_size(cfg: Any, rd: Any) -> tuple[int, int, str]:
    """(tokens, sequences, where the numbers come from)."""
    stats = rd.root / "tokenize" / "stats.json"
    if stats.is_file():
        try:
            s = json.loads(stats.read_text())
            tot = s.get("totals", s) if isinstance(s, dict) else {}
            seqs = tot.get("samples") or tot.get("sequences")
            toks = tot.get("tokens")
            if seqs and toks:
                return int(toks), int(seqs), str(stats)
        except (OSError, json.JSONDecodeError, AttributeError):
            log.warning("%s: unreadable, estimating the data size instead", stats)
    train = rd.root / "prepare" / "train.jsonl"
    if train.is_file():
        with open(train, "rb") as fh:
            n = sum(1 for line in fh if line.strip())
        src = f"{train} lines × data.mean_tokens"
    elif cfg.data.num_prompts:
        n, src = cfg.data.num_prompts, "data.num_prompts × data.mean_tokens"
    else:
        n, src = DEFAULT_PROMPTS, f"assumed {DEFAULT_PROMPTS} prompts (set data.num_prompts) × data.mean_tokens"
    return n * cfg.data.mean_tokens, n, src


def contract_and_facts(cfg: Any, rd: Any, model: str | None) -> tuple[Any, dict[str, Any], str]:
    """The contract and target facts: probe the given model, else the run dir, else target.path."""
    from dflashkit.inspect.contract import derive_contract
    from dflashkit.inspect.target import inspect_target
    from dflashkit.model.drafter_config import DrafterContract

    probe_json = rd.root / "probe" / "probe.json"
    if model is None and rd.contract_path.is_file():
        contract = DrafterContract.load(rd.contract_path)
        facts = json.loads(probe_json.read_text())["facts"] if probe_json.is_file() else {}
        if facts or not cfg.target.path:
            return contract, facts, str(rd.contract_path)
        _, _, f, _ = inspect_target(cfg, cfg.target.path, load_tokenizer=False)
        return contract, f.to_dict(), str(rd.contract_path)
    path = model or cfg.target.path
    if not path:
        raise MissingArtifactError("drafter contract", rd.contract_path, run="dflashkit probe -c run.yaml")
    _, _, facts, _ = inspect_target(cfg, path, load_tokenizer=False)
    # the mask row does not change any estimate: plan never fails on it
    d = dataclasses.replace(cfg.drafter, mask_token_id=cfg.drafter.mask_token_id or 0)
    return derive_contract(d, facts, None), facts.to_dict(), str(facts.source)


def _table(r: dict[str, Any]) -> str:
    p = r["plan"]
    rows = [("target", f"{r['source']} ({p['target']['params_total'] / 1e9:.2f}B params, "
                       f"{p['target']['weights_gib']} GiB at {p['target']['bytes_per_param']} B/param)"),
            ("data", f"{r['sequences']} sequences, {r['tokens']} tokens ({r['data_source']})"),
            ("gpus", f"{r['gpus']} × {r['gpu_mem_gib']:.0f} GiB ({r['gpu_source']})"),
            ("cached features", f"{p['features']['bytes_per_token']} B/token → {p['features']['total_gib']} GiB"),
            ("drafter", f"{p['drafter']['params'] / 1e6:.1f}M params; weights+grads+Adam "
                        f"{p['drafter']['weights_grads_adam_gib']} GiB, "
                        f"activations {p['drafter']['activations_gib']} GiB"),
            ("logits", f"{p['logits']['per_sequence_gib']} GiB/sequence unchunked; chunk "
                       f"{p['logits']['loss_chunk_blocks']} blocks = {p['logits']['chunk_gib']} GiB; max that "
                       f"fits {p['logits']['max_loss_chunk_blocks']}")]
    for m in p["modes"]:
        extra = f", disk {m['disk_gib']} GiB, capture fits: {m['capture_fits']}" if m["mode"] == "cached" else ""
        rows.append((m["mode"], f"{m['per_gpu_gib']} GiB/GPU, fits: {m['fits']}{extra}  [{m['config']}]"))
    tm = p["time"]
    rows += [("recommended", str(p["recommended"] or "nothing fits: more GPUs, smaller train.batch_size or "
                                 "train.num_anchors")),
             ("time / epoch", f"online {tm['hours_per_epoch_online']} h, cached {tm['hours_per_epoch_cached']} h "
                              f"(+ capture {tm['hours_capture']} h) at {tm['assumed_tflops_per_gpu']:.0f} TFLOP/s/GPU")]
    return "\n".join(f"{k.ljust(16)}  {v}" for k, v in rows)


def run(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict[str, Any]:
    from dflashkit.inspect.budget import plan_budget

    gpus, mem, gpu_source, rest = parse_gpus(ctx.positionals)
    curves = [p for p in rest if p.endswith(".json")]
    rest = [p for p in rest if not p.endswith(".json")]
    if len(rest) > 1 or len(curves) > 1:
        raise UsageError(f"`dflashkit plan` takes one MODEL, one NxMEM and one CURVE.json, got {ctx.positionals}",
                         hint="dflashkit plan [MODEL] [8x80] [runs/x/train/curve.json]")
    contract, facts, source = contract_and_facts(cfg, rd, rest[0] if rest else None)
    tokens, seqs, data_source = data_size(cfg, rd)
    plan = plan_budget(contract, facts, cfg, tokens=tokens, sequences=seqs, gpus=gpus, mem_gib=mem)
    result = {"source": source, "tokens": tokens, "sequences": seqs, "data_source": data_source,
              "gpus": gpus, "gpu_mem_gib": round(mem, 2), "gpu_source": gpu_source, "plan": plan}
    forecast = forecast_at_scale(curves[0], plan, tokens, cfg.train.forecast_tau) if curves else None
    if forecast is not None:
        result["forecast"] = forecast
    if not ctx.json:
        print(_table(result), flush=True)
        if forecast is not None:
            print(f"{'forecast'.ljust(16)}  {forecast['text']}", flush=True)
    return result


def forecast_at_scale(curve_path: str, plan: dict[str, Any], tokens: int, target_tau: float) -> dict[str, Any]:
    """The learning curve's forecast (train/forecast.py) with hours at this plan's training speed."""
    from pathlib import Path

    from dflashkit.train.forecast import forecast_at_rate

    p = Path(curve_path)
    if not p.is_file():
        raise MissingArtifactError("learning curve", p, run="dflashkit train -c run.yaml (it writes train/curve.json)")
    try:
        curve = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise UsageError(f"{p}:{e.lineno}: not JSON ({e.msg})", hint="pass a train/curve.json") from None
    if not isinstance(curve, dict) or not isinstance(curve.get("points"), list):
        raise UsageError(f"{p}: not a learning curve (no `points` list)", hint="pass a train/curve.json")
    fc = forecast_at_rate(curve, target_tau, hours_per_epoch=plan.get("time", {}).get("hours_per_epoch_online"),
                          epoch_tokens=tokens)
    out = fc.to_dict()
    out["text"] = fc.text().replace("on this machine", "at this plan's throughput")
    out["curve"] = str(p)
    return out
