"""Command line: `dflashkit COMMAND [-c run.yaml] [POSITIONAL ...] [key.path=value ...]`.

Usage:
    dflashkit probe path/to/model --json
    dflashkit train -c run.yaml train.lr=3e-4
    dflashkit run -c configs/smollm2-135m.yaml --from train
    python -m dflashkit doctor

Every command logs to stderr and prints one JSON object as its last stdout line. Exit codes:
0 ok, 1 failure, 2 usage/config error (or the run dir is in use by another writer), 3 missing
upstream artifact (the message names the command), 4 finished with failures (re-run to retry).
Commands that write to the run dir hold `<run_dir>/.lock` while they run (not with --dry-run).
Each command is `dflashkit.stages.<module>.run(cfg, rd, ctx) -> dict` (the table in `stage_table.py`);
tests call `main([...])`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import shlex
import signal
import sys
import threading
import time
from contextlib import ExitStack
from typing import Any

from dflashkit import __version__, family
from dflashkit.config import RunConfig, load_config
from dflashkit.context import StageContext, require_positional  # noqa: F401  (re-exported)
from dflashkit.errors import EXIT_FAILURE, EXIT_USAGE, DflashkitError, NotImplementedStage, StageFailed
from dflashkit.redact import redact_text
from dflashkit.rundir import RunDir, run_dir_lock
from dflashkit.stage_table import READ_ONLY, TABLE  # READ_ONLY: commands that take no run-dir lock

log = logging.getLogger("dflashkit")

# command -> (module under dflashkit.stages, one-line help), from the one stage table
COMMANDS: dict[str, tuple[str, str]] = {s.name: (s.module, s.help) for s in TABLE}
EXIT_CODES = ("Exit codes: 0 ok, 1 failure, 2 usage/config error or run dir in use, 3 missing upstream "
              "artifact, 4 finished with failures (re-run to retry).")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflashkit",
        description="Train and prove DFlash block-diffusion speculative-decoding drafters.",
        epilog=EXIT_CODES,
    )
    parser.add_argument("--version", action="version", version=f"dflashkit {__version__}")
    subs = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sp = subs.add_parser(name, help=help_text, description=help_text)
        sp.add_argument("-c", "--config", help="run YAML (default: built-in defaults)")
        sp.add_argument("args", nargs="*", metavar="ARG",
                        help="positionals for the command, and dotted key=value config overrides")
        sp.add_argument("--run-dir", help="shortcut for run.run_dir=...")
        sp.add_argument("--dry-run", action="store_true", help="print what would run; change nothing")
        sp.add_argument("--json", action="store_true", help="print the full result as JSON (no table)")
        sp.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
        if name == "run":
            sp.add_argument("--from", dest="from_stage", help="first stage to run")
            sp.add_argument("--to", dest="to_stage", help="last stage to run")
            sp.add_argument("--force", action="append", default=[], metavar="STAGE",
                            help="re-run STAGE even if up to date (repeatable; 'all' for every stage)")
            sp.add_argument("--budget", metavar="MINUTES",
                            help="size the run to this many minutes of this machine (run.budget_minutes)")
        if name == "serve":
            sp.add_argument("--drafter", help="exported drafter dir: decode with DFlash (serve.drafter)")
            sp.add_argument("--host", help="bind address (serve.host)")
            sp.add_argument("--port", type=int, help="port (serve.port)")
        if name == "flywheel":
            sp.add_argument("--budget", metavar="MINUTES", help="minutes for all the rounds (run.budget_minutes)")
            sp.add_argument("--rounds", type=int, help="rounds to run (learn.rounds)")
        if name == "learn":
            sp.add_argument("--records", help="record dir to learn from (learn.records)")
            sp.add_argument("--budget", metavar="MINUTES", help="minutes a round may take (run.budget_minutes)")
            sp.add_argument("--rounds", type=int, help="rounds to run (learn.rounds)")
            sp.add_argument("--every", metavar="MINUTES", help="start a round every MINUTES (learn.every_minutes)")
        if name == "record":
            sp.add_argument("--upstream", help="base URL (…/v1) of the server to record (record.upstream)")
            sp.add_argument("--host", help="bind address (record.host)")
            sp.add_argument("--port", type=int, help="port (record.port)")
        if name == "export":
            sp.add_argument("--format", help="checkpoint format: zlab or speculators (export.format)")
        if name == "train":
            sp.add_argument("--nproc-per-node", type=int,
                            help="re-launch under torchrun with this many processes")
    return parser


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is now (tests swap it between calls of `main`)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


class _RedactingFormatter(logging.Formatter):
    """Every log line (a traceback included) with the secrets of any URL in it hidden (`dflashkit.redact`):
    an exception's message may quote a URL that no dflashkit code formatted."""

    def format(self, record: logging.LogRecord) -> str:
        return redact_text(super().format(record))


def _setup_logging(level: str) -> None:
    root = logging.getLogger("dflashkit")
    if not root.handlers:
        handler = _StderrHandler()
        handler.setFormatter(_RedactingFormatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
        root.addHandler(handler)
    root.setLevel(level.upper())
    root.propagate = False


def _emit(result: dict[str, Any]) -> None:
    sys.stdout.flush()
    print(redact_text(json.dumps(result, default=str)), flush=True)


def _parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace | int:
    """The parsed command line, or the exit code argparse chose (0 for --help, 2 for bad usage). Positionals and
    key=value overrides may come after flags (`--json train.lr=1e-3`)."""
    try:
        ns, extra = parser.parse_known_args(argv)
        unknown = [a for a in extra if a.startswith("-")]
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        if extra:
            ns.args = list(getattr(ns, "args", [])) + extra
    except SystemExit as e:
        return int(e.code or 0)
    return ns


def _overrides(ns: argparse.Namespace) -> list[str]:
    """The key=value config overrides of the command line, the flags that are shortcuts for one (--run-dir,
    --drafter, --host, --port, --budget, --format) after those written out."""
    overrides = [a for a in ns.args if "=" in a]
    if ns.run_dir:
        overrides.append(f"run.run_dir={ns.run_dir}")
    section = "record" if ns.command == "record" else "serve"  # `record` binds its own host and port
    for flag in ("drafter", "host", "port", "upstream"):
        if getattr(ns, flag, None) is not None:
            overrides.append(f"{section}.{flag}={getattr(ns, flag)}")
    if getattr(ns, "budget", None) is not None:
        overrides.append(f"run.budget_minutes={ns.budget}")
    for flag, key in (("records", "learn.records"), ("rounds", "learn.rounds"), ("every", "learn.every_minutes")):
        if getattr(ns, flag, None) is not None:
            overrides.append(f"{key}={getattr(ns, flag)}")
    if getattr(ns, "format", None) is not None:
        overrides.append(f"export.format={ns.format}")
    return overrides


def _run_stage(cfg: RunConfig, ns: argparse.Namespace, ctx: StageContext) -> dict[str, Any]:
    """Import the command's stage module and run it, holding the run-dir lock unless the command is read-only
    or a dry run."""
    module_name, _ = COMMANDS[ns.command]
    try:  # one stage module per command, imported on demand: `--help` and light commands never load torch
        module = importlib.import_module(f"dflashkit.stages.{module_name}")
    except ModuleNotFoundError as e:
        if e.name == f"dflashkit.stages.{module_name}":
            raise NotImplementedStage(f"`dflashkit {ns.command}` is not implemented yet") from None
        raise
    with ExitStack() as stack:
        if ns.command not in READ_ONLY and not ns.dry_run:
            stack.enter_context(run_dir_lock(cfg.run.run_dir, ns.command))
        return module.run(cfg, RunDir(cfg.run.run_dir), ctx) or {}


def _failed(command: str, e: DflashkitError, config: str | None, overrides: list[str]) -> int:
    """Log and emit a dflashkit error (its message and hint naming the config this command was given);
    returns its exit code."""
    e.message = _with_config(e.message, config, overrides) or e.message
    e.hint = _with_config(e.hint, config, overrides)
    e.args = (e.message,)
    log.error("%s", e)
    log.debug("traceback", exc_info=True)
    partial = e.result if isinstance(e, StageFailed) else {}
    _emit({"command": command, "ok": False, **partial, "exit_code": e.exit_code, "error": e.message, "hint": e.hint})
    return e.exit_code


def _crashed(command: str, e: Exception) -> int:
    """Log and emit an unexpected exception: one line, the traceback at debug level; returns EXIT_FAILURE."""
    log.error("%s failed: %s: %s", command, type(e).__name__, e)
    log.debug("traceback", exc_info=True)
    if log.isEnabledFor(logging.DEBUG) is False:
        log.error("re-run with --log-level debug for the traceback")
    _emit({"command": command, "ok": False, "exit_code": EXIT_FAILURE, "error": f"{type(e).__name__}: {e}"})
    return EXIT_FAILURE


def main(argv: list[str] | None = None) -> int:
    """Run one command (module docstring) and return its exit code; the last stdout line is its result as JSON."""
    family.load_plugins()  # the plugin drafter families, before any config is read (one that fails: exit 2 there)
    parser = build_parser()
    ns = _parse(parser, argv)
    if isinstance(ns, int):
        return ns
    if ns.command is None:
        parser.print_help(sys.stderr)
        _emit({"ok": False, "exit_code": EXIT_USAGE, "error": "no command given"})
        return EXIT_USAGE

    overrides = _overrides(ns)
    ctx = StageContext(
        command=ns.command, positionals=[a for a in ns.args if "=" not in a], config_path=ns.config,
        overrides=overrides, dry_run=ns.dry_run, json=ns.json, from_stage=getattr(ns, "from_stage", None),
        to_stage=getattr(ns, "to_stage", None), force=getattr(ns, "force", []) or [],
        nproc_per_node=getattr(ns, "nproc_per_node", None),
    )
    started = time.time()
    level = ns.log_level or "info"
    previous_term = _on_sigterm()
    try:
        cfg = load_config(ns.config, overrides, checks=family.checks)
        level = ns.log_level or cfg.run.log_level
        _setup_logging(level)
        result = _run_stage(cfg, ns, ctx)
        _emit({"command": ns.command, "ok": True, **result, "wall_time_s": round(time.time() - started, 3)})
        return 0
    except DflashkitError as e:
        _setup_logging(level)
        return _failed(ns.command, e, ns.config, overrides)
    except KeyboardInterrupt:
        log.error("interrupted; completed work is kept, re-run the same command to resume")
        _emit({"command": ns.command, "ok": False, "exit_code": 130, "error": "interrupted"})
        return 130
    except SystemExit as e:  # SIGTERM (ours, or a child-server guard's) unwinds as SystemExit(128 + signum)
        code = e.code if isinstance(e.code, int) else EXIT_FAILURE
        if code < 128:
            raise
        _setup_logging(level)
        log.error("terminated by signal %d; completed work is kept, re-run the same command to resume", code - 128)
        _emit({"command": ns.command, "ok": False, "exit_code": code, "error": f"terminated by signal {code - 128}"})
        return code
    except Exception as e:  # noqa: BLE001 - last resort: a one-line error plus the traceback at debug
        _setup_logging(level)
        return _crashed(ns.command, e)
    finally:
        if previous_term is not None:
            signal.signal(signal.SIGTERM, previous_term)


def _with_config(text: str | None, config: str | None, overrides: list[str]) -> str | None:
    """Messages name commands as `dflashkit X -c run.yaml`: say the config this command was given instead
    (`-c PATH`, or the run dir override when there is no YAML)."""
    if not text or "-c run.yaml" not in text:
        return text
    if config:
        return text.replace("-c run.yaml", f"-c {shlex.quote(config)}")
    run_dir = [o for o in overrides if o.startswith("run.run_dir=")]
    return text.replace(" -c run.yaml", f" {shlex.quote(run_dir[-1])}" if run_dir else "")


_MAIN_PID = os.getpid()


def _raise_on_sigterm(signum, _frame) -> None:
    if os.getpid() != _MAIN_PID:  # a forked worker (tokenize's pool) inherited this: die as before
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise SystemExit(128 + signum)  # unwinds every `finally`: locks released, children stopped, temp files gone


def _on_sigterm():
    """SIGTERM → SystemExit(143) for the command's duration (main thread only), so the command still prints
    its JSON line; returns the previous handler (None when not installed)."""
    global _MAIN_PID
    if threading.current_thread() is not threading.main_thread():
        return None
    _MAIN_PID = os.getpid()
    return signal.signal(signal.SIGTERM, _raise_on_sigterm)
