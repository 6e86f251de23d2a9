"""`dflashkit doctor`: check the environment — packages, devices, tools, asset cache, endpoints.

Inputs:  the config (optional): `server.urls` are probed with GET <url>/models (short timeout,
         API key from `server.api_key_env`, never logged); `target.path` is resolved if set.
         With both, each endpoint gets generate's pre-flight: one short chat request whose prompt
         (usage.prompt_tokens, prompt ids if returned) is compared with the target's chat
         template rendered here ("drift <url>": error when they differ).
Outputs: nothing on disk. One line per check: ok | missing | absent (optional) | error, with the
         fix command; the JSON has `checks` and `healthy` (false if a required check failed).
         Exit code 0 when healthy, 1 when a required check failed (an unreachable endpoint too).

Example:
    dflashkit doctor
    dflashkit doctor -c run.yaml --json

Packages are looked up with importlib.util.find_spec / importlib.metadata (nothing heavy is
imported, except torch when installed, to list CUDA devices). The checks are `dflashkit.doctor`.
"""

from __future__ import annotations

from typing import Any

from dflashkit.config import RunConfig
from dflashkit.context import StageContext
from dflashkit.doctor import (device_checks, drift_checks, endpoint_checks, engine_checks, package_checks,
                              target_check, tool_checks)
from dflashkit.errors import StageFailed
from dflashkit.rundir import RunDir


def run(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict[str, Any]:
    endpoints = endpoint_checks(cfg.server)
    reachable = [c["name"].split(" ", 1)[1] for c in endpoints if c["status"] == "ok"]
    targets = target_check(cfg)
    checks = (package_checks() + device_checks() + tool_checks(cfg.run.run_dir) + engine_checks(cfg) + targets + endpoints
              + (drift_checks(cfg, reachable) if all(c["status"] == "ok" for c in targets) else []))
    problems = [c["name"] for c in checks if c["status"] in ("missing", "error")]
    if not ctx.json:
        width = max(len(c["name"]) for c in checks)
        for c in checks:
            fix = f"   → {c['fix']}" if c["fix"] else ""
            print(f"{c['name'].ljust(width)}  {c['status']:<7} {c['detail']}{fix}", flush=True)
    result = {"healthy": not problems, "problems": problems, "checks": checks}
    if problems:
        raise StageFailed(f"doctor: {len(problems)} problem{'s' if len(problems) > 1 else ''}: "
                          f"{', '.join(problems)}", result=result,
                          hint="each failed check above names its fix (exit 1 = not healthy)")
    return result
