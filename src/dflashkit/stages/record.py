"""`dflashkit record --upstream URL`: a recording proxy in front of any OpenAI-compatible server.

Inputs:  record.upstream (--upstream; …/v1 of vLLM, SGLang, `dflashkit serve`), record.dir (the record dir).
Outputs: record.dir: the segments of recorded requests (`serving.record`: format, rotation, redaction), 0600
         files in a 0700 dir; serves until SIGTERM/Ctrl-C, then prints a JSON summary.
Example: dflashkit record --upstream http://127.0.0.1:8000/v1 --port 8001 record.dir=runs/traffic

Clients talk to http://record.host:record.port/v1 as they would to the upstream; see `serving.proxy`. Each
record's fingerprint: record.target_fingerprint, else target.path's files (the same fingerprint `serve`
writes for that target), else `upstream:<the model id the upstream serves>`.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading

from dflashkit.config import RunConfig
from dflashkit.context import StageContext
from dflashkit.errors import MissingArtifactError, UsageError
from dflashkit.http1 import HttpError, get_json
from dflashkit.redact import redact_url
from dflashkit.rundir import RunDir
from dflashkit.serving.proxy import RecordingProxy, Upstream
from dflashkit.serving.record import Recorder, RecordPolicy, section_fingerprint

log = logging.getLogger("dflashkit.record")


def _check(cfg: RunConfig) -> tuple[str, str, str | None]:
    """(upstream URL, record dir, api key or None); UsageError naming the key for what is missing or wrong."""
    r = cfg.record
    if not r.upstream:
        raise UsageError("`dflashkit record` needs the server to record", hint="pass --upstream http://HOST:PORT/v1")
    if not r.dir:
        raise UsageError("`dflashkit record` needs record.dir", hint="pass record.dir=DIR (where records go)")
    Upstream(r.upstream)
    RecordPolicy.from_config(cfg).check()
    key = None
    if r.api_key_env:
        key = os.environ.get(r.api_key_env)
        if not key:
            raise UsageError(f"record.api_key_env: the environment variable {r.api_key_env} is not set",
                             hint=f"export {r.api_key_env}=..., or set record.api_key_env=null")
    try:
        with socket.socket(socket.AF_INET6 if ":" in r.host else socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((r.host, r.port))
    except OSError as e:
        raise UsageError(f"record.port: cannot bind {r.host}:{r.port}: {e.strerror or e}",
                         hint="pick another --port (0 = any free port)") from None
    return r.upstream, r.dir, key


def _fingerprint(cfg: RunConfig, upstream: str, key: str | None) -> tuple[str, str]:
    if cfg.record.target_fingerprint or cfg.target.path:
        return section_fingerprint(cfg.target, cfg.record.target_fingerprint)
    up = Upstream(upstream)
    url = f"{'https' if up.https else 'http'}://{up.host}:{up.port}{up.base}/models"
    headers = {"Authorization": up.basic or f"Bearer {key}"} if (up.basic or key) else None
    try:
        ids = [str(m["id"]) for m in get_json(url, headers=headers, timeout_s=30)["data"]]
    except HttpError as e:
        err = MissingArtifactError(f"a server answering at record.upstream ({e})", redact_url(upstream),
                                   run="vllm serve <model>")
        err.hint = "start the server first, or set record.target_fingerprint"
        raise err from None
    except (KeyError, TypeError, ValueError):
        ids = []
    if not ids:
        raise UsageError(f"record.upstream: {redact_url(upstream)}/models lists no model",
                         hint="point --upstream at an OpenAI-compatible …/v1, or set record.target_fingerprint")
    log.warning("records carry the fingerprint upstream:%s (a name, not the weights): set target.path or "
                "record.target_fingerprint so `learn` can tell a changed target apart", ids[0])
    return f"upstream:{ids[0]}", "upstream"


def run(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict:
    upstream, root, key = _check(cfg)
    if ctx.dry_run:
        return {"dry_run": True, "upstream": redact_url(upstream), "dir": root, "host": cfg.record.host,
                "port": cfg.record.port}
    fp, how = _fingerprint(cfg, upstream, key)
    recorder = Recorder(root, fingerprint=fp, how=how, policy=RecordPolicy.from_config(cfg)).open()
    proxy = RecordingProxy(upstream, recorder, timeout_s=cfg.record.timeout_s, api_key=key)
    try:
        server = proxy.make_server(cfg.record.host, cfg.record.port)
    except OSError as e:
        recorder.close()
        raise UsageError(f"cannot bind {cfg.record.host}:{cfg.record.port}: {e}", hint="pick another --port") from None
    host, port = server.server_address[:2]
    url = f"http://{host}:{port}/v1"  # type: ignore[str-bytes-safe]  # AF_INET: host is a str
    log.info("recording %s on %s into %s", redact_url(upstream), url, root)

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
        recorder.close()
    return {"url": url, "upstream": redact_url(upstream), "dir": root, "requests": proxy.requests,
            "recorded": proxy.recorded, "failed": proxy.failed, "repaired": recorder.repaired}
