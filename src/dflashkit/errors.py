"""Exceptions a user can cause, each with a stable exit code and a "what to do next" hint.

Usage:
    raise ConfigError(["train.lr: must be > 0, got -1"])
    raise MissingArtifactError("tokenized shards", path, run="dflashkit tokenize -c run.yaml")

`cli.main` turns these into one clear stderr message and the exit code; anything else is exit 1.
Exit codes: 0 ok, 1 failure, 2 usage/config error (also: the run dir is locked by another writer),
3 missing upstream artifact, 4 finished with failures (re-run to retry).
"""

from __future__ import annotations

from pathlib import Path

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_MISSING = 3
EXIT_PARTIAL = 4  # the stage finished, but some items failed: re-run the same command to retry them


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


class RunDirLocked(UsageError):
    """Another process is writing to the same run dir (exit 2); the message names its PID."""


class StageFailed(DflashkitError):
    """A stage ran to the end but its verdict is a failure; `result` is still printed as JSON.

    `PartialFailure` (exit 4) is the usual case: "N of M failed: re-run to retry".
    """

    def __init__(self, message: str, *, result: dict | None = None, hint: str | None = None):
        super().__init__(message, hint=hint)
        self.result = dict(result or {})


class PartialFailure(StageFailed):
    """Some items of a stage failed; finished work is kept and a re-run retries the rest (exit 4)."""

    exit_code = EXIT_PARTIAL


class PermanentFailure(StageFailed):
    """Items failed with errors a re-run repeats (HTTP 400/401/404 …): fix the input, not a retry (exit 2)."""

    exit_code = EXIT_USAGE


class DiskFull(DflashkitError):
    """A write failed because the filesystem is full (exit 1); the message names the path, the old data stays."""

    detail: str | None = None
