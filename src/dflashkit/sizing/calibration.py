"""This machine's speeds for the run's shapes: what `run.budget_minutes` sizes a run from, and `plan` reads.

Usage:
    cal = saved_calibration(cfg, rd)           # <run_dir>/calibration.json, else the cache's; None if neither
    cal = cal or calibrate(cfg, rd)            # measure (a few forwards and steps), then save
    rates(cal)                                 # the `sizing.plan.Rates` a plan takes

What it measures, each in the dtype its stage will use:
  * capture_tok_s — capture's forward (`data.features.local_batches`: features, last hidden state and the
    next ids) over a few random rows of the prior's sample length, under `train.target_dtype`'s autocast;
  * train_step_s — one drafter step (forward, chunked loss, backward, optimizer) on a batch of the configured
    shape (train.batch_size × that length, train.num_anchors anchors), random features given;
  * decode_s — t(n) for n = 1 and eval's block sizes (`decode.step_cost.step_times`) in eval's verify dtype;
  * load_s — loading the target once.
A calibration is keyed by the machine (`machine`: CPU model, a hash of its flags, torch threads and the
ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA settings; or the GPU's name and count) and by the config it measured
(`shape_key`: target, drafter, capture, the train keys of a step's cost, eval's dtype and block sizes). It is saved
to `<run_dir>/calibration.json` and to `<cache>/calibration/<machine>-<shape>.json` (`assets.cache_dir`), so
a second run on this machine, in any run dir, does not measure again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dflashkit.assets import cache_dir
from dflashkit.config import section_hash
from dflashkit.inspect.contract import run_contract
from dflashkit.model.packed import prepare_for_decode
from dflashkit.model.roofline import fastest
from dflashkit.rundir import atomic_write_json
from dflashkit.sizing.plan import Rates, tokens_per_sample

if TYPE_CHECKING:
    from dflashkit.config import RunConfig
    from dflashkit.rundir import RunDir

log = logging.getLogger("dflashkit.sizing")
VERSION = 1
CPU_TOKENS = 512      # capture's timed forward on CPU (GPU: GPU_TOKENS)
GPU_TOKENS = 16_384
ENV_KEYS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def machine(device: str = "auto") -> dict[str, Any]:
    """What a calibration is valid for: the GPU(s), else the CPU model, its flags (hashed) and torch's threads."""
    from dflashkit.model.target import resolve_device  # lazy: loads transformers; `plan` reads calibrations without

    dev = resolve_device(device)
    if dev.type == "cuda":
        return {"kind": "cuda", "name": torch.cuda.get_device_name(dev), "count": torch.cuda.device_count()}
    name, flags = "", ""
    try:
        info = Path("/proc/cpuinfo").read_text()
        name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "")
        flags = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("flags")), "")
    except OSError:
        name = platform.processor() or platform.machine()
    return {"kind": "cpu", "name": name, "flags": hashlib.sha256(flags.encode()).hexdigest()[:12],
            "threads": torch.get_num_threads(), **{k.lower(): os.environ[k] for k in ENV_KEYS if os.environ.get(k)}}


def machine_key(m: dict[str, Any]) -> str:
    """A file-name-safe key: the device name's words and a hash of everything in `m`."""
    words = "".join(c if c.isalnum() else "-" for c in str(m.get("name") or m.get("kind"))).strip("-").lower()
    digest = hashlib.sha256(json.dumps(m, sort_keys=True).encode()).hexdigest()[:10]
    return f"{m.get('kind')}-{'-'.join(w for w in words.split('-') if w)[:40]}-{digest}"


def shape_key(cfg: RunConfig) -> str:
    """The hash of the config a calibration measured (not the sizes a budget chooses)."""
    train = dataclasses.replace(cfg.train, max_steps=None, eval_every=0, save_every=0)
    return section_hash(cfg.target, cfg.drafter, cfg.capture, train, cfg.tokenize.max_length, cfg.eval.dtype,
                        cfg.eval.block_sizes, VERSION)[:12]


def cache_path(key: str, shape: str) -> Path:
    return cache_dir() / "calibration" / f"{key}-{shape}.json"


def saved_calibration(cfg: RunConfig, rd: RunDir) -> dict[str, Any] | None:
    """The run dir's calibration, else the cache's, for this machine and config; None when neither has one."""
    key, shape = machine_key(machine(cfg.target.device)), shape_key(cfg)
    for path in (rd.root / "calibration.json", cache_path(key, shape)):
        try:
            cal = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(cal, dict) and cal.get("machine_key") == key and cal.get("shape") == shape \
                and cal.get("version") == VERSION:
            return {**cal, "path": str(path)}
    return None


def save_calibration(cal: dict[str, Any], rd: RunDir | None) -> None:
    """Write `cal` to the cache and (unless `rd` is None) to `<run_dir>/calibration.json`."""
    body = {k: v for k, v in cal.items() if k != "path"}
    targets = [cache_path(cal["machine_key"], cal["shape"])] + ([rd.root / "calibration.json"] if rd else [])
    for path in targets:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(path, body)
        except OSError as e:  # an unwritable cache costs a re-measure next time, nothing else
            log.warning("calibration: could not write %s (%s)", path, e)


def rates(cal: dict[str, Any]) -> Rates:
    return Rates(capture_tok_s=float(cal["capture_tok_s"]), train_step_s=float(cal["train_step_s"]),
                 decode_s={int(k): float(v) for k, v in (cal.get("decode_s") or {}).items()},
                 load_s=float(cal.get("load_s", 5.0)), calibrate_s=float(cal.get("calibrate_s", 0.0)))


def _capture_rate(cfg: RunConfig, target: Any, contract: Any, seq: int) -> tuple[float, str]:
    from dflashkit.data.capturing import capture_layer_ids  # lazy (this and below): measuring loads transformers
    from dflashkit.data.features import local_batches
    from dflashkit.model.target import target_autocast

    dev = target.device
    amp = target_autocast(cfg.train.target_dtype, dev, target.dtype)
    layers = capture_layer_ids(cfg, contract)
    n = max(1, (GPU_TOKENS if dev.type == "cuda" else CPU_TOKENS) // seq)
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, target.vocab_size, (seq,), generator=gen) for _ in range(n)]

    def forward() -> None:
        for _ in local_batches(target, rows, layers, batch_size=cfg.capture.batch_size, pad_id=0,
                               last_hidden=False, autocast=amp):
            pass

    return n * seq / fastest(forward, dev, 2), str(amp or target.dtype).removeprefix("torch.")


def _train_step(cfg: RunConfig, target: Any, contract: Any, seq: int) -> float:
    from dflashkit.train.step_probe import drafter_step  # lazy: measuring loads transformers, `plan` does not

    dev, bs = target.device, cfg.train.batch_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (bs, seq), generator=gen).to(dev)
    lm = torch.zeros(bs, seq, dtype=torch.long, device=dev)
    lm[:, seq // 4:] = 1
    lens = torch.full((bs,), seq, device=dev)
    feats = torch.randn(bs, seq, len(contract.target_layer_ids) * contract.hidden_size, generator=gen).to(dev)
    return fastest(drafter_step(cfg, contract, target, ids, lm, lens, feats), dev, 2)


def calibrate(cfg: RunConfig, rd: RunDir, *, save: bool = True) -> dict[str, Any]:
    """Measure this machine for `cfg` (the module docstring) and save it (`save_calibration`); the dict saved."""
    from dflashkit.decode.evaluation import block_sizes_for, verify_dtype, verify_target_config  # lazy: transformers
    from dflashkit.decode.step_cost import step_times
    from dflashkit.model.target import load_target

    t0 = time.perf_counter()
    m = machine(cfg.target.device)
    log.info("calibrating this machine (%s) for run.budget_minutes …", m.get("name") or m["kind"])
    target = load_target(cfg.target)
    load_s = time.perf_counter() - t0
    contract = run_contract(cfg, rd)
    seq = max(8, min(cfg.tokenize.max_length, round(tokens_per_sample(cfg, ()))))
    capture_tok_s, capture_dtype = _capture_rate(cfg, target, contract, seq)
    train_step_s = _train_step(cfg, target, contract, seq)
    verify = verify_dtype(cfg)
    vt = target if verify.dtype == target.dtype else load_target(verify_target_config(cfg, verify),
                                                                 announce_dtype=False)
    prepare_for_decode(vt, cfg.eval.packed_weights)  # as eval will run it (capture and train are measured already)
    ns = [1, *block_sizes_for(cfg.eval.block_sizes, contract)]
    with torch.inference_mode():
        decode = step_times(vt, ns, context=64, reps=2)
    cal = {"version": VERSION, "machine": m, "machine_key": machine_key(m), "shape": shape_key(cfg),
           "target": str(target.model_dir), "device": str(target.device), "capture_dtype": capture_dtype,
           "verify_dtype": verify.name, "sample_tokens": seq, "batch_size": cfg.train.batch_size,
           "capture_tok_s": round(capture_tok_s, 2), "train_step_s": round(train_step_s, 5),
           "decode_s": {str(n): round(t, 6) for n, t in decode.items()}, "load_s": round(load_s, 3),
           "calibrate_s": round(time.perf_counter() - t0, 2),
           "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    log.info("calibrated in %.1f s: capture %.0f tok/s (%s), a train step %.3f s, decode t(1) %.4f s%s",
             cal["calibrate_s"], capture_tok_s, capture_dtype, train_step_s, decode.get(1, 0.0),
             "".join(f", t({n}) {t:.4f} s" for n, t in decode.items() if n != 1))
    if save:
        save_calibration(cal, rd)
    return cal
