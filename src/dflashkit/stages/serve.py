"""`dflashkit serve [MODEL_DIR]`: an OpenAI-compatible HTTP server over a local HF model.

Inputs:  MODEL_DIR (else `target.path`), optionally `--drafter DIR` (an exported/trained drafter dir).
Outputs: nothing on disk unless serve.record_dir is set (then every answered request is recorded there:
         `serving.record`); serves until SIGTERM/Ctrl-C, then prints a JSON summary (requests, tokens).
Example: dflashkit serve runs/x/export/target --port 8000 --drafter runs/x/export

Without a proposer, concurrent requests are decoded with continuous padded batching of up to
`serve.max_batch` rows (greedy output is the same batched or alone). With one (`serve.proposer`: the
drafter, prompt lookup, the suffix proposer or the hybrid of drafter and suffix), requests are decoded one
at a time by the speculative decoder and `usage` gains `acceptance_lengths` and `mean_acceptance`; suffix
and hybrid match each request against its tenant's earlier ones (OpenAI `user` or header X-Tenant).
See `dflashkit.serving.server` for the routes.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading

import torch

from dflashkit.config import RunConfig
from dflashkit.context import StageContext
from dflashkit.errors import UsageError
from dflashkit.rundir import RunDir
from dflashkit.serve_app import build_app, check_serve_proposer, serve_proposer
from dflashkit.serving.local import _raise_on_sigterm, cleanup_on_exit_of_child
from dflashkit.serving.server import make_server

log = logging.getLogger("dflashkit.serve")


def check_port(cfg: RunConfig) -> None:
    """Bind serve.host:serve.port and let go, before the model loads (a dry run too): a busy or invalid port
    fails in a second, not after the load."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in cfg.serve.host else socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((cfg.serve.host, cfg.serve.port))
    except OSError as e:
        raise UsageError(f"serve.port: cannot bind {cfg.serve.host}:{cfg.serve.port}: {e.strerror or e}",
                         hint="pick another --port (0 = any free port), or stop what is using it") from None


def run(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict:
    model_path = ctx.positionals[0] if ctx.positionals else cfg.target.path
    if not model_path:
        raise UsageError("`dflashkit serve` needs a model", hint="dflashkit serve MODEL_DIR, or set target.path")
    check_port(cfg)
    check_serve_proposer(cfg)
    if ctx.dry_run:
        return {"dry_run": True, "model": model_path, "host": cfg.serve.host, "port": cfg.serve.port,
                "drafter": cfg.serve.drafter, "proposer": serve_proposer(cfg)}

    cleanup_on_exit_of_child()
    if threading.current_thread() is threading.main_thread():  # SIGTERM while loading: exit cleanly
        signal.signal(signal.SIGTERM, _raise_on_sigterm)
    if cfg.serve.cpu_threads:
        torch.set_num_threads(cfg.serve.cpu_threads)  # this process is the server: its own setting
    app = build_app(cfg, model_path)
    try:
        server = make_server(app, cfg.serve.host, cfg.serve.port)
    except OSError as e:
        app.engine.stop()
        raise UsageError(f"cannot bind {cfg.serve.host}:{cfg.serve.port}: {e}",
                         hint="pick another --port (0 = any free port)") from None
    host, port = server.server_address[:2]
    url = f"http://{host}:{port}/v1"  # type: ignore[str-bytes-safe]  # AF_INET: host is a str
    proposer = serve_proposer(cfg)
    log.info("serving %s on %s (%s)", app.model_name, url, f"max_batch {cfg.serve.max_batch}" if proposer is None
             else f"proposer {proposer}" + (f", drafter {cfg.serve.drafter}" if cfg.serve.drafter else ""))

    def on_term(_sig, _frame) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_term)
    try:
        server.serve_forever(poll_interval=0.1)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        app.engine.stop()
        if app.recording is not None:
            app.recording.recorder.close()
    log.info("server stopped")
    out = {"url": url, "model": app.model_name, "metrics": app.metrics()}
    if app.recording is not None:
        out["recorded"] = {"dir": cfg.serve.record_dir, "records": app.recording.recorder.written}
    return out
