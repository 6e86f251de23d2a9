"""The GPU check's orchestration: checks, time boxes, one process per check, the summary and the log.

Usage:
    summary = run_gpu_check(Path("out"))                         # every check on CUDA → out/summary.json + log
    summary = run_gpu_check(out, checks=["decode"], deadline_s=120)
    summary = run_gpu_check(out, device="cpu", isolate=False)     # the checks' CPU halves, in process (tests)
    python -m dflashkit.gpucheck SPEC.json                        # one check in a child (what the runner starts)

Isolation: each check runs in a child process (`python -m dflashkit.gpucheck`) in a session of its own; when
its time box ends the whole process group (torchrun's ranks too) gets SIGTERM, then SIGKILL. A hang, a CUDA
error that poisons the context, or an OOM costs that check alone: the rest still run. The run as a whole has a
deadline (`DEADLINE_S`): a check's box is cut to what is left, and a check that no longer fits `MIN_BOX_S` is
skipped with that reason. In process (`isolate=False`) the boxes are only advisory: the checks skip their
optional parts when `ctx.remaining()` runs low, but nothing is killed.

A check is `fn(ctx: CheckContext) -> dict` returning `verdict(parts)`: its status (passed, failed, or
skipped with a reason) and one row per part with the numbers. The runner adds duration and time box.
Exit status: 0 when every check passed or was skipped with a reason, 1 when one failed (`failed` names them).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from dflashkit import __version__
from dflashkit.errors import UsageError
from dflashkit.rundir import atomic_write_text, check_writable_dir

log = logging.getLogger("dflashkit.gpucheck")

DEADLINE_S = 470.0     # the whole run: under 8 minutes on one H200, start-up of the children included
MIN_BOX_S = 20.0       # a check with less than this left is skipped (its imports alone take ~10 s)
GRACE_S = 10.0         # after a box ends: SIGTERM, then this long before SIGKILL
LOG_TAIL = 60_000      # characters of each child's output kept in the human log
SUMMARY, LOG = "summary.json", "gpu-check.log"
TOOL = "dflashkit gpu-check"  # the summary's `tool`: how a later run recognises an OUT_DIR as its own
NO_CUDA = "no CUDA device: the GPU check did not run"


@dataclass(frozen=True)
class CheckSpec:
    """One check: its name, `module:function`, time box (s) and what it shows."""

    name: str
    target: str
    box_s: float
    what: str


CHECKS: tuple[CheckSpec, ...] = (
    CheckSpec("flex", "dflashkit.gpucheck.train_checks:flex_vs_sdpa", 110,
              "flex attention = SDPA in the trainer's loss: loss and gradients, tiny and medium drafter"),
    CheckSpec("bf16-8b", "dflashkit.gpucheck.train_checks:bf16_steps", 110,
              "bf16 training steps on a random Qwen3-8B-shaped target, 1- and 5-layer drafter"),
    CheckSpec("cpu-gpu", "dflashkit.gpucheck.train_checks:cpu_equals_gpu", 60,
              "`fit` on the tiny target, float32: CPU = GPU losses and weights"),
    CheckSpec("decode", "dflashkit.gpucheck.decode_check:decoder_equals_baseline", 100,
              "the GPU decoder's greedy output = the baseline (block size 1): tiny and 8B-shaped targets"),
    CheckSpec("distributed", "dflashkit.gpucheck.dist_check:one_equals_two_processes", 90,
              "1 = 2 processes of `dflashkit train` (NCCL on 2 GPUs; gloo sharing 1 GPU)"),
)


@dataclass
class CheckContext:
    """What a check gets: its device, its scratch dir, one shared by every check of the run (the tiny target
    is built there once), and when its time box ends (`time.monotonic()`)."""

    device: str
    work_dir: Path
    deadline: float
    shared_dir: Path | None = None

    @property
    def shared(self) -> Path:
        return self.shared_dir or self.work_dir

    @property
    def small(self) -> bool:
        """The CPU halves: the 8B and medium shapes become `fixtures.SMALL`, sequences a few dozen tokens."""
        return not self.device.startswith("cuda")

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def no_time(self, need_s: float) -> str | None:
        """The skip reason when fewer than `need_s` seconds are left in the box, else None."""
        left = self.remaining()
        return f"skipped: {left:.0f} s left in the time box, {need_s:.0f} s needed" if left < need_s else None


def part(name: str, ok: bool | None, reason: str | None = None, **numbers: Any) -> dict[str, Any]:
    """One part of a check: passed (ok), failed (not ok), or skipped (ok None, with the reason)."""
    status = "skipped" if ok is None else "passed" if ok else "failed"
    return {"name": name, "status": status, **({"reason": reason} if reason else {}), **numbers}


def verdict(parts: list[dict[str, Any]], **numbers: Any) -> dict[str, Any]:
    """A check's result: failed if a part failed, passed if one passed, else skipped (every reason kept)."""
    states = [p["status"] for p in parts]
    status = "failed" if "failed" in states else "passed" if "passed" in states else "skipped"
    out: dict[str, Any] = {"status": status}
    if status == "skipped":
        out["reason"] = "; ".join(p.get("reason", p["name"]) for p in parts) or "nothing to run"
    return {**out, **numbers, "parts": parts}


def failure(exc: BaseException) -> dict[str, Any]:
    """A check that raised: failed, with the error and the end of its traceback."""
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return {"status": "failed", "reason": f"{type(exc).__name__}: {exc}", "traceback": "".join(tb)[-4000:]}


def guarded(name: str, fn: Callable[[], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The part rows `fn()` returns, or one failed part naming its exception (an OOM, a kernel error): the
    check's next part still runs."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - recorded as the part's failure
        row = failure(e)
        log.warning("%s: %s", name, row["reason"])
        return [part(name, False, row["reason"], traceback=row["traceback"])]


def resolve(target: str) -> Callable[[CheckContext], dict]:
    module, _, fn = target.partition(":")
    return getattr(importlib.import_module(module), fn)


def environment(device: str) -> dict[str, Any]:
    """The GPU (name, count, memory, capability) and the versions that matter, for the summary's head."""
    import torch

    versions: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                                "cuda": torch.version.cuda, "dflashkit": __version__}
    for pkg in ("transformers", "triton", "safetensors", "numpy"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    gpu: dict[str, Any] = {"cuda_available": torch.cuda.is_available(), "count": 0}
    if device.startswith("cuda") and gpu["cuda_available"]:
        try:
            p = torch.cuda.get_device_properties(0)
            gpu.update(count=torch.cuda.device_count(), name=p.name, memory_gib=round(p.total_memory / 2**30, 1),
                       capability=f"{p.major}.{p.minor}", multiprocessors=p.multi_processor_count,
                       cudnn=torch.backends.cudnn.version())
        except Exception as e:  # noqa: BLE001 - a broken driver: the checks still run and say what fails
            gpu["error"] = f"{type(e).__name__}: {e}"
    return {"gpu": gpu, "versions": versions, "git": _git_commit()}


def _git_commit() -> str | None:
    src = Path(__file__).resolve().parents[3]
    try:
        out = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def child_env() -> dict[str, str]:
    """The children's environment: this dflashkit importable however it was installed, output unbuffered."""
    src = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": src + (os.pathsep + path if path else ""), "PYTHONUNBUFFERED": "1",
            "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_isolated(spec: CheckSpec, *, device: str, work_dir: Path, box_s: float) -> tuple[dict[str, Any], str]:
    """Run one check in a child process within `box_s` seconds → (its result, its output)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    result_path, out_path = work_dir / "result.json", work_dir / "output.txt"
    spec_path = work_dir / "spec.json"
    spec_path.write_text(json.dumps({"name": spec.name, "target": spec.target, "device": device,
                                     "work_dir": str(work_dir), "shared_dir": str(work_dir.parent),
                                     "budget_s": box_s, "result": str(result_path)}))
    with open(out_path, "wb") as out:
        child = subprocess.Popen([sys.executable, "-m", "dflashkit.gpucheck", str(spec_path)], stdout=out,
                                 stderr=subprocess.STDOUT, env=child_env(), start_new_session=True)
        timed_out = False
        try:
            child.wait(timeout=box_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(child)
    text = out_path.read_text(errors="replace")
    if timed_out:
        return {"status": "failed", "reason": f"ran past its time box of {box_s:.0f} s (killed)"}, text
    try:
        return json.loads(result_path.read_text()), text
    except (OSError, ValueError):
        tail = "\n".join(text.strip().splitlines()[-15:])
        return {"status": "failed", "reason": f"its process exited {child.returncode} without a result",
                "output_tail": tail}, text


def _kill_group(child: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            return
        try:
            child.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_in_process(spec: CheckSpec, *, device: str, work_dir: Path, box_s: float) -> tuple[dict[str, Any], str]:
    work_dir.mkdir(parents=True, exist_ok=True)
    ctx = CheckContext(device=device, work_dir=work_dir, deadline=time.monotonic() + box_s, shared_dir=work_dir.parent)
    try:
        return resolve(spec.target)(ctx), ""
    except Exception as e:  # noqa: BLE001 - a check's failure is a result, the next check still runs
        return failure(e), ""


@dataclass
class Report:
    """The summary (JSON) and the human log, rewritten after every check."""

    out_dir: Path
    summary: dict[str, Any]
    outputs: dict[str, str] = field(default_factory=dict)

    def write(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.out_dir / SUMMARY, json.dumps(self.summary, indent=1, default=str) + "\n")
        atomic_write_text(self.out_dir / LOG, human_log(self.summary, self.outputs))


def human_log(summary: dict[str, Any], outputs: dict[str, str]) -> str:
    """One line per check (and per part), then each child's output (its tail when long)."""
    env = summary.get("gpu", {})
    lines = [f"dflashkit gpu-check: {env.get('name', 'no GPU')} × {env.get('count', 0)}, "
             f"torch {summary['versions'].get('torch')} (CUDA {summary['versions'].get('cuda')}), "
             f"transformers {summary['versions'].get('transformers')}, git {summary.get('git')}"]
    if not summary.get("ran", True):
        lines.append(summary.get("reason", NO_CUDA))
    for name, res in summary.get("checks", {}).items():
        lines.append(f"[{res['status']:>7}] {name} ({res.get('duration_s', 0):.1f} s of {res.get('time_box_s', 0):.0f})"
                     + (f": {res['reason']}" if res.get("reason") else ""))
        for p in res.get("parts", []):
            nums = {k: v for k, v in p.items()
                    if k not in ("name", "status", "reason") and not isinstance(v, (list, dict))}
            why = str(p.get("reason") or "").removeprefix("skipped: ")
            lines.append(f"    {p['status']:>7}  {p['name']}" + (f": {why}" if why else "")
                         + ("  " + ", ".join(f"{k}={_short(v)}" for k, v in nums.items()) if nums else ""))
    if "exit_code" in summary:
        lines.append(f"exit {summary['exit_code']}" + (f": failed {', '.join(summary['failed'])}"
                                                       if summary.get("failed") else ""))
    for name, text in outputs.items():
        kept = text[-LOG_TAIL:]
        lines += ["", f"===== {name}: output" + (" (tail)" if len(kept) < len(text) else "") + " =====", kept.rstrip()]
    return "\n".join(lines) + "\n"


def _short(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def owns_out_dir(out_dir: Path) -> bool:
    """Whether gpu-check may write into `out_dir`: absent, empty (but for the temp files of an interrupted
    write), or holding a `summary.json` that a gpu-check wrote (a JSON object whose `tool` is `TOOL`)."""
    if not out_dir.is_dir():
        return not out_dir.exists() and not out_dir.is_symlink()
    temps = tuple(f".{name}." for name in (SUMMARY, LOG))
    if not [p for p in out_dir.iterdir() if not (p.name.startswith(temps) and p.name.endswith(".tmp"))]:
        return True
    try:
        summary = json.loads((out_dir / SUMMARY).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(summary, dict) and summary.get("tool") == TOOL


def check_out_dir(out_dir: str | Path, *, label: str = "gpu-check OUT_DIR") -> None:
    """Raise `UsageError` naming `out_dir` unless gpu-check may write its summary and log there: a directory
    it can create or write (not a file, not under a file, not /proc or a read-only place) that is new, empty,
    or a previous gpu-check's OUT_DIR. A user's non-empty directory is refused before anything is written."""
    out = Path(out_dir)
    hint = f"give gpu-check a new or empty directory you can write to as {label}"
    if out.is_dir() and not owns_out_dir(out):
        raise UsageError(f"refusing to write into {out}: it is a non-empty directory that `{TOOL}` did not "
                         f"write (no {SUMMARY} of gpu-check in it), so {SUMMARY} and {LOG} there are not its to "
                         "overwrite", hint=f"{hint}, or remove it yourself if it is yours to delete")
    check_writable_dir(out, label=label, hint=hint)


def select(names: list[str] | None, specs: tuple[CheckSpec, ...] = CHECKS) -> list[CheckSpec]:
    """The checks to run, in their order (all when `names` is empty); an unknown name is a usage error."""
    if not names:
        return list(specs)
    known = {s.name for s in specs}
    bad = [n for n in names if n not in known]
    if bad:
        raise UsageError(f"unknown GPU check {', '.join(bad)}", hint=f"choose from {', '.join(sorted(known))}")
    return [s for s in specs if s.name in names]


def run_gpu_check(out_dir: str | Path, *, checks: list[str] | None = None, device: str = "cuda",
                  deadline_s: float = DEADLINE_S, isolate: bool = True, specs: tuple[CheckSpec, ...] = CHECKS,
                  min_box_s: float = MIN_BOX_S, scratch: str | Path | None = None) -> dict[str, Any]:
    """Run the checks on `device` within `deadline_s`, writing `summary.json` and the log into `out_dir`.

    `out_dir` must pass `check_out_dir` (new, empty, or a previous gpu-check's), else `UsageError` before
    anything runs. `scratch`: the checks' shared scratch dir (default a temp dir, removed at the end).
    Returns the summary: `ran` (False without CUDA, and then `device` is None), `exit_code`, `failed`, and
    `checks` by name."""
    t0 = time.monotonic()
    chosen = select(checks, specs)
    check_out_dir(out_dir)
    summary: dict[str, Any] = {"tool": TOOL, "ran": True, "ok": None, "exit_code": None,
                               "failed": [], "device": device, **environment(device), "deadline_s": deadline_s,
                               "wall_s": 0.0, "checks": {}}
    report = Report(Path(out_dir), summary)
    if device.startswith("cuda") and not summary["gpu"]["cuda_available"]:
        summary.update(ran=False, ok=True, exit_code=0, reason=NO_CUDA, device=None)  # nothing ran anywhere
        report.write()
        return summary
    run = run_isolated if isolate else run_in_process
    with tempfile.TemporaryDirectory(prefix="dflashkit-gpu-check-") as tmp:
        root = Path(scratch or tmp)
        for spec in chosen:
            left = deadline_s - (time.monotonic() - t0)
            box = min(spec.box_s, left)
            if box < min_box_s:
                why = f"the run's deadline of {deadline_s:.0f} s leaves {max(left, 0):.0f} s"
                res: dict[str, Any] = {"status": "skipped", "reason": why}
                text = ""
            else:
                log.info("gpu-check: %s (time box %.0f s): %s", spec.name, box, spec.what)
                ts = time.monotonic()
                res, text = run(spec, device=device, work_dir=root / spec.name, box_s=box)
                res["duration_s"] = round(time.monotonic() - ts, 2)
                log.info("gpu-check: %s %s in %.1f s%s", spec.name, res["status"], res["duration_s"],
                         f": {res['reason']}" if res.get("reason") else "")
            res["time_box_s"] = round(box, 1)
            res["what"] = spec.what
            summary["checks"][spec.name] = res
            if text:
                report.outputs[spec.name] = text
            failed = [n for n, r in summary["checks"].items() if r["status"] == "failed"]
            summary.update(ok=not failed, exit_code=1 if failed else 0, failed=failed,
                           wall_s=round(time.monotonic() - t0, 1))
            report.write()
    if not chosen:
        summary.update(ok=True, exit_code=0)
    return summary


def child_main(argv: list[str]) -> int:
    """`python -m dflashkit.gpucheck SPEC.json`: run one check, write its result JSON (also when it raises)."""
    spec = json.loads(Path(argv[0]).read_text())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    start = time.monotonic()
    ctx = CheckContext(device=spec["device"], work_dir=Path(spec["work_dir"]), shared_dir=Path(spec["shared_dir"]),
                       deadline=start + float(spec["budget_s"]) - 5.0)  # 5 s to write the result and exit
    try:
        result = resolve(spec["target"])(ctx)
    except Exception as e:  # noqa: BLE001 - recorded as the check's failure
        traceback.print_exc()
        result = failure(e)
    atomic_write_text(spec["result"], json.dumps(result, default=str))
    return 0
