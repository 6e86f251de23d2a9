"""Start `dflashkit serve` for `target.path` as a subprocess on 127.0.0.1 and stop it afterwards.

Usage:
    with start_local_server(cfg) as base_url:       # "http://127.0.0.1:<port>/v1"
        ... requests ...
    # the server is terminated on exit, also when the body raises

Used by `generate` when `server.urls` is empty, and reusable by the pipeline/bench. The child
gets the fully resolved run config (a temp YAML) plus `serve.host/port`, so target dtype, device,
tokenizer and chat template are the same as in-process. Its stderr goes to `log_path` (default:
a temp file whose tail is shown if the server dies before answering /health).

The child lives and dies with its parent: it runs in its own process group, and on Linux gets
SIGTERM from the kernel when the parent dies (PR_SET_PDEATHSIG, set in the child before exec),
also after a SIGKILL of the parent. An orphaned child then removes the temp dir itself (its path
is in `TMPDIR_ENV`); on a normal exit, an exception, SIGTERM or interpreter exit the parent stops the
child and removes it. Call this from the main thread: the death signal follows the thread that
started the child.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from dflashkit.config import dump_config
from dflashkit.errors import ServerError
from dflashkit.http1 import HttpError, get_json, request_sync

if TYPE_CHECKING:
    from dflashkit.config import RunConfig

log = logging.getLogger("dflashkit.serve")

TMPDIR_ENV = "DFLASHKIT_SERVE_TMPDIR"  # "<parent pid>:<dir>": the child removes dir if it outlives the parent
PR_SET_PDEATHSIG = 1


def _death_signal_preexec(parent_pid: int):
    """A preexec_fn: SIGTERM this child when its parent dies (Linux), and exit now if it already did.

    prctl is looked up here, in the parent: after fork the child only makes two syscalls (no
    imports, no allocation), which is safe even when the parent has other threads."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: the parent's cleanup handlers still apply
        return None

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def _stop(proc: subprocess.Popen, tmpdir: str) -> None:
    """Terminate the child's process group (kill after 15 s) and remove the temp dir; idempotent."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                proc.kill()
            proc.wait()
    shutil.rmtree(tmpdir, ignore_errors=True)


def _raise_on_sigterm(signum, _frame) -> None:
    raise SystemExit(128 + signum)  # unwinds every `finally`: the child is stopped, files closed


def cleanup_on_exit_of_child() -> None:
    """In the child (`dflashkit serve` started by us): at exit, remove the temp dir if the parent is
    gone (a live parent still reads the log tail from it, then removes it itself)."""
    value = os.environ.get(TMPDIR_ENV, "")
    parent, _, tmpdir = value.partition(":")
    if not (parent.isdigit() and Path(tmpdir).name.startswith("dflashkit-serve-")):
        return

    def remove_if_orphaned() -> None:
        if os.getppid() != int(parent):
            shutil.rmtree(tmpdir, ignore_errors=True)

    atexit.register(remove_if_orphaned)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_for_health(base_url: str, *, timeout_s: float, proc: subprocess.Popen | None = None,
                    log_path: Path | None = None, served_name: str | None = None, what: str = "`dflashkit serve`",
                    exit_hint: str = "check target.path, or run `dflashkit serve -c run.yaml` by hand") -> None:
    """Poll `<base>/health` (base without /v1) until it answers 200 (and, given `served_name`, /v1/models
    lists it); raise ServerError with the log's tail when the child dies or time runs out."""
    root = base_url.removesuffix("/v1")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = _tail(log_path)
            raise ServerError(f"{what} exited with code {proc.returncode} before it was ready"
                              f"{f' (log {log_path})' if log_path else ''}{':' + chr(10) + tail if tail else ''}",
                              hint=exit_hint)
        try:
            if request_sync("GET", root + "/health", timeout_s=2.0)[0] == 200:
                if served_name is None:
                    return
                models = get_json(base_url + "/models", timeout_s=5.0).get("data", [])
                if any(m.get("id") == served_name for m in models):
                    return
        except (HttpError, ValueError, AttributeError):
            pass
        time.sleep(0.2 if served_name is None else 0.5)
    tail = _tail(log_path)
    raise ServerError(f"{what} did not answer {root}/health within {timeout_s:.0f}s"
                      f"{f' (log {log_path})' if log_path else ''}{':' + chr(10) + tail if tail else ''}",
                      hint="raise server.startup_timeout_s, or start the server yourself and set server.urls")


@contextmanager
def child_process(cmd: list[str], *, tmpdir: str, log_file: Path, env: dict[str, str], cwd: str | None = None,
                  stdout_to_log: bool = False) -> Iterator[subprocess.Popen]:
    """Run a server `cmd` as our child: its own process group, SIGTERM when we die (PDEATHSIG), stderr (and
    stdout, if asked) appended to `log_file`; on every exit path (return, exception, SIGTERM, interpreter
    exit) its group is stopped and `tmpdir` removed."""
    with open(log_file, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out if stdout_to_log else subprocess.DEVNULL, stderr=out,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=_death_signal_preexec(os.getpid()), env=env, cwd=cwd)
    stopper = functools.partial(_stop, proc, tmpdir)
    atexit.register(stopper)
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        yield proc
    finally:
        stopper()
        atexit.unregister(stopper)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _tail(path: Path | None, n: int = 20) -> str:
    """The last `n` non-blank lines of a child's log ("" when there is none)."""
    if path is None or not path.is_file():
        return ""
    return "\n".join([ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()][-n:])


@contextmanager
def start_local_server(cfg: RunConfig, *, host: str = "127.0.0.1", port: int | None = None,
                       log_path: str | Path | None = None, extra_overrides: list[str] | None = None,
                       ) -> Iterator[str]:
    """Run `dflashkit serve` for `cfg.target` in a subprocess; yield its base URL (…/v1).

    Args:
        cfg: the run config (its `target` and `serve` sections are used).
        host: bind address (loopback by default).
        port: port; None = a free one.
        log_path: where the child's stderr goes; None = a temp file.
        extra_overrides: more `key=value` overrides for the child (e.g. ["serve.max_batch=4"]).

    Raises:
        ServerError: the child died or did not answer /health within server.startup_timeout_s.
    """
    port = port or free_port(host)
    tmpdir = tempfile.mkdtemp(prefix="dflashkit-serve-")
    cfg_path = Path(tmpdir) / "run.yaml"
    cfg_path.write_text(dump_config(cfg))
    log_file = Path(log_path) if log_path else Path(tmpdir) / "serve.log"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "dflashkit", "serve", "-c", str(cfg_path), f"serve.host={host}",
           f"serve.port={port}", "--json", *(extra_overrides or [])]
    base_url = f"http://{host}:{port}/v1"
    log.info("starting a local server for %s on %s (log: %s)", cfg.target.path, base_url, log_file)
    env = {**os.environ, "TQDM_DISABLE": "1", TMPDIR_ENV: f"{os.getpid()}:{tmpdir}"}
    with child_process(cmd, tmpdir=tmpdir, log_file=log_file, env=env) as proc:
        wait_for_health(base_url, timeout_s=cfg.server.startup_timeout_s, proc=proc, log_path=log_file)
        yield base_url
