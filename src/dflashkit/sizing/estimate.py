"""What `dflashkit plan` (and `run --dry-run`'s `plan_estimates`) estimate: the inputs of `plan_budget`.

Usage:
    gpus, mem_gib, source, rest = parse_gpus(["8x80"])        # NxMEM, else the visible GPUs, else 1x80
    result = estimate(cfg, rd, ["8x80"], prepared_lines=records.prepared_lines,
                      calibration=sizing.calibration.saved_calibration)        # the JSON `dflashkit plan` prints

The data size comes from `tokenize/stats.json`, else `prepare/train.jsonl` lines (or
`data.num_prompts`, else 10,000) × `data.mean_tokens`; the contract and target facts from the run
dir's `contract.json` + `probe/probe.json`, else a probe of MODEL / `target.path` (nothing is
written). Every formula is in `sizing/budget.py`; its times come from this machine's saved calibration
when there is one (`calibration_for`), else from an assumed throughput.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from dflashkit.errors import MissingArtifactError, UsageError
from dflashkit.family.contract import DrafterContract
from dflashkit.sizing.budget import plan_budget
from dflashkit.inspect.contract import derive_contract
from dflashkit.inspect.target import inspect_target

if TYPE_CHECKING:
    from dflashkit.config import RunConfig
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


def data_size(cfg: RunConfig, rd: RunDir, prepared_lines: Callable[[RunDir], tuple[int, Path] | None],
              ) -> tuple[int, int, str]:
    """(tokens, sequences, where the numbers come from). `prepared_lines` counts prepare's train split (the
    stage hands in `data.records.prepared_lines`, the file's owner)."""
    stats = rd.tokenize_stats
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
    counted = prepared_lines(rd)
    if counted is not None:
        n, train = counted
        src = f"{train} lines × data.mean_tokens"
    elif cfg.data.num_prompts:
        n, src = cfg.data.num_prompts, "data.num_prompts × data.mean_tokens"
    else:
        n, src = DEFAULT_PROMPTS, f"assumed {DEFAULT_PROMPTS} prompts (set data.num_prompts) × data.mean_tokens"
    return n * cfg.data.mean_tokens, n, src


def contract_and_facts(cfg: RunConfig, rd: RunDir, model: str | None) -> tuple[Any, dict[str, Any], str]:
    """The contract and target facts: probe the given model, else the run dir, else target.path."""
    probe_json = rd.probe_json
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


def calibration_for(cfg: RunConfig, rd: RunDir, saved: Callable[[RunConfig, RunDir], dict[str, Any] | None] | None,
                    *, model: str | None, gpu_source: str) -> tuple[dict[str, Any] | None, str]:
    """This machine's saved calibration for `cfg` (`saved`: the stage hands in
    `sizing.calibration.saved_calibration`), or None and why not: none saved, another MODEL than the config's
    target, or GPUs given as an argument on a CPU calibration."""
    if model is not None and model != cfg.target.path:
        return None, f"a calibration measures target.path, not {model}"
    if saved is None:
        return None, "no calibration given"
    try:
        cal = saved(cfg, rd)
    except Exception as e:  # noqa: BLE001 - the calibration only refines an estimate
        log.debug("calibration unavailable: %s", e)
        cal = None
    if cal is None:
        return None, "no calibration saved for this machine and config: `dflashkit run --budget M` measures one"
    if gpu_source == "argument" and (cal.get("machine") or {}).get("kind") != "cuda":
        return None, "the GPUs are an argument and this machine's calibration is of its CPU"
    return cal, ""


def estimate(cfg: RunConfig, rd: RunDir, positionals: list[str] | tuple[str, ...] = (), *,
             prepared_lines: Callable[[RunDir], tuple[int, Path] | None],
             calibration: Callable[[RunConfig, RunDir], dict[str, Any] | None] | None = None) -> dict[str, Any]:
    """The plan for `positionals` ([MODEL] [NxMEM]): target, data size, GPUs and `plan_budget`'s plan
    (`prepared_lines`: see `data_size`; `calibration`: see `calibration_for`)."""
    gpus, mem, gpu_source, rest = parse_gpus(list(positionals))
    if len(rest) > 1:
        raise UsageError(f"`dflashkit plan` takes one MODEL and one NxMEM, got {rest}",
                         hint="dflashkit plan [MODEL] [8x80]")
    contract, facts, source = contract_and_facts(cfg, rd, rest[0] if rest else None)
    tokens, seqs, data_source = data_size(cfg, rd, prepared_lines)
    cal, why = calibration_for(cfg, rd, calibration, model=rest[0] if rest else None, gpu_source=gpu_source)
    plan = plan_budget(contract, facts, cfg, tokens=tokens, sequences=seqs, gpus=gpus, mem_gib=mem,
                       calibration=cal, no_calibration=why)
    return {"source": source, "tokens": tokens, "sequences": seqs, "data_source": data_source,
            "gpus": gpus, "gpu_mem_gib": round(mem, 2), "gpu_source": gpu_source, "plan": plan}
