"""Exceptions a user can cause, each with a stable exit code and a "what to do next" hint.

Usage:
    raise ConfigError(["train.lr: must be > 0, got -1"])
    raise MissingArtifactError("tokenized shards", path, run="dflashkit tokenize -c run.yaml")

`cli.main` turns these into one clear stderr message and the exit code; anything else is exit 1.
"""

from __future__ import annotations

from pathlib import Path

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_MISSING = 3


class DflashkitError(Exception):
    """Base class: a problem the user can fix. `exit_code` is what the CLI returns."""

    exit_code = EXIT_FAILURE

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message + (f"\n  hint: {self.hint}" if self.hint else "")


class UsageError(DflashkitError):
    """Bad input: a bad file, argument or value (exit 2)."""

    exit_code = EXIT_USAGE


class ConfigError(UsageError):
    """One or more config problems, each naming its dotted key (exit 2)."""

    def __init__(self, problems: list[str] | str, *, hint: str | None = None):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        head = "config error" if len(self.problems) == 1 else f"{len(self.problems)} config errors"
        body = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{head}:\n{body}", hint=hint)


class MissingArtifactError(DflashkitError):
    """An upstream stage's output is missing (exit 3); `run` names the command that makes it."""

    exit_code = EXIT_MISSING

    def __init__(self, what: str, path: Path | str, *, run: str):
        super().__init__(f"missing {what}: {path}", hint=f"run `{run}` first")
        self.path = Path(path)
        self.run = run


class NotImplementedStage(UsageError):
    """A CLI entry whose stage is not built yet (exit 2)."""


class ServerError(DflashkitError):
    """An OpenAI-compatible endpoint could not be used (exit 1)."""
