"""Start `dflashkit serve` for `target.path` as a subprocess on 127.0.0.1 and stop it afterwards.

Usage:
    with start_local_server(cfg) as base_url:       # "http://127.0.0.1:<port>/v1"
        ... requests ...
    # the server is terminated on exit, also when the body raises

Used by `generate` when `server.urls` is empty, and reusable by the pipeline/bench. The child
gets the fully resolved run config (a temp YAML) plus `serve.host/port`, so target dtype, device,
tokenizer and chat template are the same as in-process. Its stderr goes to `log_path` (default:
a temp file whose tail is shown if the server dies before answering /health).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx

from dflashkit.errors import ServerError

log = logging.getLogger("dflashkit.serve")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_for_health(base_url: str, *, timeout_s: float, proc: subprocess.Popen | None = None,
                    log_path: Path | None = None) -> None:
    """Poll `<base>/health` (base without /v1) until it answers 200; raise ServerError otherwise."""
    root = base_url[:-3] if base_url.endswith("/v1") else base_url
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0) as http:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                tail = _tail(log_path)
                raise ServerError(f"`dflashkit serve` exited with code {proc.returncode} before it was "
                                  f"ready{':' + chr(10) + tail if tail else ''}",
                                  hint="check target.path, or run `dflashkit serve -c run.yaml` by hand")
            try:
                if http.get(root + "/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
    raise ServerError(f"{root}/health did not answer within {timeout_s:.0f}s",
                      hint="raise server.startup_timeout_s, or start the server yourself and set server.urls")


def _tail(path: Path | None, n: int = 15) -> str:
    if path is None or not path.is_file():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])


@contextmanager
def start_local_server(cfg, *, host: str = "127.0.0.1", port: int | None = None,
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
    from dflashkit.config import dump_config

    port = port or free_port(host)
    tmpdir = tempfile.TemporaryDirectory(prefix="dflashkit-serve-")
    cfg_path = Path(tmpdir.name) / "run.yaml"
    cfg_path.write_text(dump_config(cfg))
    log_file = Path(log_path) if log_path else Path(tmpdir.name) / "serve.log"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "dflashkit", "serve", "-c", str(cfg_path), f"serve.host={host}",
           f"serve.port={port}", "--json", *(extra_overrides or [])]
    base_url = f"http://{host}:{port}/v1"
    log.info("starting a local server for %s on %s (log: %s)", cfg.target.path, base_url, log_file)
    with open(log_file, "ab") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
                                env={**os.environ, "TQDM_DISABLE": "1"})
    try:
        wait_for_health(base_url, timeout_s=cfg.server.startup_timeout_s, proc=proc, log_path=log_file)
        yield base_url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        tmpdir.cleanup()
