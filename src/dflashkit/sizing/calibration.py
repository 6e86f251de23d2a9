"""This machine's speeds for the run's shapes: what `run.budget_minutes` sizes a run from, and `plan` reads.

Usage:
    cal = saved_calibration(cfg, rd)           # <run_dir>/calibration.json, else the cache's; None if neither
    cal = cal or calibrate(cfg, rd)            # measure (a few forwards and steps), then save
    rates(cal)                                 # the `sizing.plan.Rates` a plan takes
    cal, ignored = find_calibration(cfg, rd)   # the same, and ["<file>: <why it was ignored>", …] (`plan`)

What it measures, each in the dtype its stage will use:
  * capture_tok_s — capture's forward (`data.features.local_batches`: features, last hidden state and the
    next ids) over a few random rows of the prior's sample length, under `train.target_dtype`'s autocast;
  * train_step_s — one drafter step (forward, chunked loss, backward, optimizer) on a batch of the configured
    shape (train.batch_size × that length, train.num_anchors anchors), random features given;
  * decode_s — t(n) for n = 1 and eval's block sizes (`sizing.step_cost.step_times`: every n warmed up, then
    timed in turns) in eval's verify dtype; a t(n) below a smaller n's cannot be a step's cost (a step over more
    tokens streams the same weights and does more work): it is logged as an unreliable measurement
    (`decode.metrics.timing_flags`) and raised to that smaller n's, so eval is never under-planned;
  * load_s — loading the target once.
A calibration is keyed by the machine (`machine`: CPU model, a hash of its flags, torch threads and the
ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA settings; or the GPU's name and count) and by the config it measured
(`shape_key`: target, drafter, capture, the train keys of a step's cost, eval's dtype and block sizes). It is saved
to `<run_dir>/calibration.json` and to `<cache>/calibration/<machine>-<shape>.json` (`assets.cache_dir`), so
a second run on this machine, in any run dir, does not measure again.

A saved file is used only when it is valid (`calibration_problem`): a JSON object of this `VERSION`, this
machine's key and this config's shape, with capture_tok_s, train_step_s and every decode_s t(n) (n ≥ 1, t(1)
included) finite numbers > 0, and load_s / calibrate_s (when present) finite and ≥ 0. Any other file — corrupt,
cut short, edited, another machine's or config's — is named in a warning with the reason and skipped, so the run
measures again and overwrites it (one bad cache entry never breaks a run); `plan`, which only reads, says it
ignored the file and estimates without it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import platform
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dflashkit.assets import cache_dir
from dflashkit.config import section_hash
from dflashkit.decode.metrics import timing_flags
from dflashkit.errors import UsageError
from dflashkit.inspect.contract import run_contract
from dflashkit.target.packed import prepare_for_decode
from dflashkit.timing import fastest
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
    from dflashkit.target.load import resolve_device  # lazy: loads transformers; `plan` reads calibrations without

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


class CalibrationError(UsageError):
    """A calibration that cannot size a run (`calibration_problem` says why)."""


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def rates_problem(cal: dict[str, Any]) -> str | None:
    """Why `cal`'s rates cannot size a run, or None: capture_tok_s, train_step_s and each decode_s t(n) must be
    finite numbers > 0 (n a whole number ≥ 1, t(1) among them); load_s and calibrate_s, when present, ≥ 0."""
    for k in ("capture_tok_s", "train_step_s"):
        if k not in cal:
            return f"{k} is missing"
        if not (_number(cal[k]) and cal[k] > 0):
            return f"{k} is {cal[k]!r}, not a finite number > 0"
    for k in ("load_s", "calibrate_s"):
        if k in cal and not (_number(cal[k]) and cal[k] >= 0):
            return f"{k} is {cal[k]!r}, not a finite number >= 0"
    dec = cal.get("decode_s")
    if not isinstance(dec, dict) or not dec:
        return f"decode_s is {dec!r}, not {{n: seconds}} with n = 1 and eval's block sizes"
    for n, t in dec.items():
        if not str(n).isdigit() or int(n) < 1:
            return f"decode_s has the key {n!r}, not a number of tokens >= 1"
        if not (_number(t) and t > 0):
            return f"decode_s t({n}) is {t!r}, not a finite number > 0"
    if 1 not in {int(n) for n in dec}:
        return "decode_s has no t(1)"
    return None


def calibration_problem(cal: Any, *, key: str, shape: str) -> str | None:
    """Why a calibration file's JSON `cal` is not this machine's (`key`: `machine_key`) calibration for this config
    (`shape`: `shape_key`), or None when it is (see the module docstring)."""
    if not isinstance(cal, dict):
        return f"not a calibration (a JSON {type(cal).__name__}, not an object)"
    if cal.get("version") != VERSION:
        return f"version {cal.get('version')!r}, this dflashkit reads version {VERSION}"
    if cal.get("machine_key") != key:
        return f"measured on another machine ({cal.get('machine_key')!r}; this one is {key!r})"
    if cal.get("shape") != shape:
        return f"measured for another config (shape {cal.get('shape')!r}; this config's is {shape!r})"
    return rates_problem(cal)


def _read(path: Path) -> tuple[Any, str | None]:
    """(the JSON of `path`, None), or (None, why it cannot be read); (None, None) when there is no such file."""
    try:
        return json.loads(path.read_text(encoding="utf-8")), None
    except FileNotFoundError:
        return None, None
    except UnicodeDecodeError:
        return None, "not UTF-8 text"
    except json.JSONDecodeError as e:
        return None, f"not valid JSON ({e.msg} at line {e.lineno} column {e.colno}: cut short or edited?)"
    except OSError as e:
        return None, f"unreadable ({e.strerror or e})"


def find_calibration(cfg: RunConfig, rd: RunDir) -> tuple[dict[str, Any] | None, list[str]]:
    """(the run dir's calibration, else the cache's, for this machine and config, with its "path"; None when
    neither holds a valid one) and each file ignored on the way as "<file>: <why>"."""
    key, shape = machine_key(machine(cfg.target.device)), shape_key(cfg)
    ignored: list[str] = []
    for path in (rd.root / "calibration.json", cache_path(key, shape)):
        cal, why = _read(path)
        if cal is None and why is None:
            continue
        why = why or calibration_problem(cal, key=key, shape=shape)
        if why is None:
            return {**cal, "path": str(path)}, ignored
        ignored.append(f"{path}: {why}")
    return None, ignored


def saved_calibration(cfg: RunConfig, rd: RunDir) -> dict[str, Any] | None:
    """The run dir's calibration, else the cache's, for this machine and config; None when neither has a valid one
    (each file ignored is logged as a warning naming it and why: `find_calibration`)."""
    cal, ignored = find_calibration(cfg, rd)
    for note in ignored:
        log.warning("calibration: ignored %s%s", note, "" if cal else " (a run measures this machine again)")
    return cal


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
    """The `Rates` of a calibration; CalibrationError when `rates_problem` finds one."""
    why = rates_problem(cal) if isinstance(cal, dict) else f"a {type(cal).__name__}, not a calibration"
    if why:
        where = f" {cal['path']}" if isinstance(cal, dict) and cal.get("path") else ""
        raise CalibrationError(f"calibration{where}: {why}",
                               hint="delete it: `dflashkit run --budget M` measures this machine again")
    return Rates(capture_tok_s=float(cal["capture_tok_s"]), train_step_s=float(cal["train_step_s"]),
                 decode_s={int(k): float(v) for k, v in (cal.get("decode_s") or {}).items()},
                 load_s=float(cal.get("load_s", 5.0)), calibrate_s=float(cal.get("calibrate_s", 0.0)))


def _sig(x: float) -> float:
    """`x` to 5 significant digits (a rate or a time of any size keeps its precision, never rounds to 0)."""
    return float(f"{x:.5g}")


def monotone_steps(times: dict[int, float]) -> dict[int, float]:
    """`times` ({n: t(n)}) with each t(n) raised to the largest t(m) of a smaller m: a step over more tokens costs
    at least one over fewer, so a smaller one was timed under other conditions (another job's burst). Each t(n)
    below t(1) beyond noise is logged as an unreliable measurement (`decode.metrics.timing_flags`)."""
    out: dict[int, float] = {}
    floor = 0.0
    for n in sorted(times):
        t = float(times[n])
        if 1 in times and n != 1 and (flags := timing_flags(t1=times[1], tb=t)):
            log.warning("calibration: unreliable decode step timing (%s): t(%d) taken as %.4f s", "; ".join(flags),
                        n, max(floor, t))
        floor = max(floor, t)
        out[n] = floor
    return out


def _capture_rate(cfg: RunConfig, target: Any, contract: Any, seq: int) -> tuple[float, str]:
    from dflashkit.data.capturing import capture_layer_ids  # lazy (this and below): measuring loads transformers
    from dflashkit.data.features import local_batches
    from dflashkit.target.load import target_autocast

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
    from dflashkit.sizing.step_probe import drafter_step  # lazy: measuring loads transformers, `plan` does not

    dev, bs = target.device, cfg.train.batch_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (bs, seq), generator=gen).to(dev)
    lm = torch.zeros(bs, seq, dtype=torch.long, device=dev)
    lm[:, seq // 4:] = 1
    lens = torch.full((bs,), seq, device=dev)
    feats = torch.randn(bs, seq, len(contract.target_layer_ids) * contract.hidden_size, generator=gen).to(dev)
    step = drafter_step(cfg.train, contract, target, ids, lm, lens, feats,
                        draft_vocab_size=cfg.drafter.draft_vocab_size, seed=cfg.run.seed)
    return fastest(step, dev, 2)


def calibrate(cfg: RunConfig, rd: RunDir, *, save: bool = True) -> dict[str, Any]:
    """Measure this machine for `cfg` (the module docstring) and save it (`save_calibration`); the dict saved."""
    from dflashkit.decode.evaluation import block_sizes_for, verify_dtype, verify_target_config  # lazy: transformers
    from dflashkit.sizing.step_cost import step_times
    from dflashkit.target.load import load_target

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
        decode = monotone_steps(step_times(vt, ns, context=64, reps=2))
    cal = {"version": VERSION, "machine": m, "machine_key": machine_key(m), "shape": shape_key(cfg),
           "target": str(target.model_dir), "device": str(target.device), "capture_dtype": capture_dtype,
           "verify_dtype": verify.name, "sample_tokens": seq, "batch_size": cfg.train.batch_size,
           "capture_tok_s": _sig(capture_tok_s), "train_step_s": _sig(train_step_s),
           "decode_s": {str(n): _sig(t) for n, t in decode.items()}, "load_s": round(load_s, 3),
           "calibrate_s": round(time.perf_counter() - t0, 2),
           "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    log.info("calibrated in %.1f s: capture %.0f tok/s (%s), a train step %.3f s, decode t(1) %.4f s%s",
             cal["calibrate_s"], capture_tok_s, capture_dtype, train_step_s, decode.get(1, 0.0),
             "".join(f", t({n}) {t:.4f} s" for n, t in decode.items() if n != 1))
    if why := rates_problem(cal):  # a timer that failed (an infinite or zero time) is not saved for later runs
        raise CalibrationError(f"calibration: measured {why}", hint="run again; `dflashkit doctor` checks the device")
    if save:
        save_calibration(cal, rd)
    return cal
