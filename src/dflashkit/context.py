"""What a stage gets besides the config: the command's positionals and common flags.

Usage:
    ctx = StageContext(command="probe", positionals=["path/to/model"], json=True)
    path = require_positional(ctx, "model dir", cfg.target.path)
    dflashkit.stages.probe.run(cfg, RunDir(cfg.run.run_dir), ctx)

`cli.main` builds one from argv; `run` builds one per stage; benches build their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dflashkit.errors import UsageError


@dataclass
class StageContext:
    """What a stage gets besides the config: positionals and the common flags."""

    command: str
    positionals: list[str] = field(default_factory=list)
    config_path: str | None = None
    overrides: list[str] = field(default_factory=list)
    dry_run: bool = False
    json: bool = False
    from_stage: str | None = None
    to_stage: str | None = None
    force: list[str] = field(default_factory=list)
    nproc_per_node: int | None = None


def require_positional(ctx: StageContext, what: str, fallback: str | None = None) -> str:
    """The first positional, else `fallback` (usually a config key's value), else a usage error."""
    if ctx.positionals:
        return ctx.positionals[0]
    if fallback:
        return fallback
    raise UsageError(f"`dflashkit {ctx.command}` needs {what}",
                     hint=f"dflashkit {ctx.command} {what.upper().replace(' ', '_')} or set it in -c run.yaml")
