"""The run-directory contract: where each stage writes, manifests, atomic writes.

Usage:
    rd = RunDir(cfg.run.run_dir)
    rd.contract_path            # <run_dir>/contract.json (written by probe, read by everyone)
    atomic_write_json(rd.contract_path, {...})
    write_manifest(rd.stage_dir("tokenize"), stage="tokenize", inputs=[...], config_hash=h, counts={...}, started=t0)
    with run_dir_lock(rd.root, "generate"): ...   # one writer per run dir (cli.main takes it)

Layout (one folder per stage):
    config.resolved.yaml  contract.json  probe/  prepare/  generate/  tokenize/  capture/
    train/ (checkpoints/, final/, best/, metrics.jsonl, curve.json, engine-queue/)  eval/  export/  report/
Each stage folder holds a `manifest.json`; `dflashkit run` compares it with the current config
and the inputs' manifests to decide whether the stage is up to date. `<run_dir>/.lock` is flock'ed
by the command writing to the run dir (it names that process), so two writers never interleave.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dflashkit import __version__
from dflashkit.errors import DiskFull, RunDirLocked, UsageError


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def is_disk_full(exc: BaseException, where: Path) -> bool:
    """Whether `exc`, raised while writing under `where`, means the filesystem is full: ENOSPC/EDQUOT, or
    a writer that wraps it (safetensors' `StorageFull`, torch's `inline_container.cc … file write failed`,
    which names no errno: then the free space under `where` decides)."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(exc)
    if "No space left on device" in text or "StorageFull" in text or "Disk quota exceeded" in text:
        return True
    if "inline_container" in text or "file write failed" in text:
        try:
            st = os.statvfs(where)
            return st.f_bavail * st.f_frsize < 16 << 20
        except OSError:
            return False
    return False


def _disk_full_error(path: Path, exc: BaseException) -> Exception:
    detail = getattr(exc, "detail", None) or f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
    err = DiskFull(f"the disk is full: writing {path} failed ({detail})",
                   hint=f"free space on the filesystem of {path.parent} (`df -h {path.parent}`) and re-run the same "
                   "command; what existed before is unchanged (the partial write was removed)")
    err.detail = detail
    return err


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temp path beside `path`; on success it is fsync'd and renamed over `path`. A full disk
    raises `DiskFull` naming `path` (the old file stays)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        if tmp_path.is_file():
            os.chmod(tmp_path, 0o666 & ~_umask())  # writers such as safetensors leave 0600 behind
            with open(tmp_path, "rb") as fh:
                os.fsync(fh.fileno())
        os.replace(tmp_path, path)
        _fsync_dir(path.parent)
    except Exception as e:
        full = is_disk_full(e, path.parent)
        if tmp_path.exists():
            tmp_path.unlink()
        if full:
            raise _disk_full_error(path, e) from None
        raise
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def _owned_by(path: Path, stage: str | None, marker: str) -> bool:
    """True when `path` may be replaced: absent, an empty dir, or a dir holding our `marker` file
    (for `manifest.json`: one whose `stage` is `stage`)."""
    if not path.exists() and not path.is_symlink():
        return True
    if path.is_symlink() or not path.is_dir():
        return False
    if not any(path.iterdir()):
        return True
    if stage is None or not (path / marker).is_file():
        return False
    if marker != "manifest.json":
        return True
    try:
        return read_json(path / "manifest.json").get("stage") == stage
    except (OSError, ValueError, AttributeError):
        return False


def check_replaceable(path: str | Path, *, owner: str | None, marker: str = "manifest.json") -> None:
    """Raise `UsageError` naming `path` unless `atomic_dir(path, owner=..., marker=...)` may replace
    (or a stage may remove) it: absent, an empty directory, or a directory holding our `marker`.
    Call it before long work so the refusal comes first, not after hours of training."""
    path = Path(path)
    if _owned_by(path, owner, marker):
        return
    what = "a file" if path.is_file() else "a symlink" if path.is_symlink() else "a non-empty directory"
    made_by = f" made by `dflashkit {owner}`" if owner else ""
    raise UsageError(f"refusing to replace {path}: it is {what} that is not an output{made_by} "
                     f"(no {marker} of stage {owner!r} in it)",
                     hint="choose a new or empty directory, or remove it yourself if it is yours to delete")


def share_files(root: Path) -> None:
    """Give files under `root` that only their owner may read (safetensors, torch.save and mkstemp
    write 0600) the mode a normal `open` gives under the umask, so another user's serving engine can
    read train/final, train/best and checkpoints as it reads exports. Symlinks are left alone."""
    mode = 0o666 & ~_umask()
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            p = os.path.join(dirpath, name)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            if not os.path.islink(p) and (st.st_mode & 0o044) == 0 and (mode & 0o044):
                os.chmod(p, mode | (st.st_mode & 0o111 & ~_umask()))


@contextmanager
def atomic_dir(path: str | Path, *, owner: str | None = None, marker: str = "manifest.json") -> Iterator[Path]:
    """Yield a temp dir beside `path`; on success it replaces `path`.

    The old `path` is renamed aside before the new one is renamed in and is deleted only then,
    so a crash at any point leaves either the complete old or the complete new directory in place
    (plus a hidden `.name.*` leftover at worst). On an exception nothing changes.

    Only a directory this code owns is ever replaced: an absent path, an empty directory, or one
    whose `marker` file names stage `owner` (`manifest.json`; other markers, such as a
    checkpoint's `state.json`, only need to exist). Anything else (a file, a symlink, a user's
    non-empty directory) raises `UsageError` naming the path *before* any work is done, so a slip
    such as `export.out_dir=.` can never delete a user's files. The new directory gets the
    permissions of a normal `mkdir` (mkdtemp's 0700 would hide an export from a serving user).
    """
    path = Path(path)
    check_replaceable(path, owner=owner, marker=marker)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    os.chmod(tmp, 0o777 & ~_umask())
    old = None
    try:
        yield tmp
        share_files(tmp)
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old.", dir=path.parent))
            os.replace(path, old / "x")
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except Exception as e:
        full = isinstance(e, _disk_full_type()) or is_disk_full(e, path.parent)  # before the space is freed
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise _disk_full_error(path, e) from None  # named by the directory being replaced
        raise
    finally:
        for leftover in (tmp, old):
            if leftover is not None and leftover.exists():
                shutil.rmtree(leftover, ignore_errors=True)


def _disk_full_type() -> type:
    return DiskFull


def remove_stale_temps(directory: str | Path, name_glob: str) -> list[Path]:
    """Remove the temp files `atomic_path` left for outputs matching `name_glob` (`.{name}.XXXX.tmp`)
    when its process was killed; only call it while holding the run-dir lock (no live writer)."""
    removed = []
    for p in Path(directory).glob(f".{name_glob}.*.tmp"):
        if p.is_file() and not p.is_symlink():
            p.unlink()
            removed.append(p)
    return removed


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text())


def read_json_or_none(path: Path, log: logging.Logger) -> Any:
    """A small JSON file that may be absent; None when absent or not valid JSON (a warning on `log`)."""
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except json.JSONDecodeError:
        log.warning("%s is not valid JSON; skipped", path)
        return None


def file_digest(path: str | Path, limit: int | None = 1 << 20) -> str:
    """sha256 of a file's size + first `limit` bytes (cheap identity for big inputs)."""
    p = Path(path)
    h = hashlib.sha256(str(p.stat().st_size).encode())
    with open(p, "rb") as fh:
        h.update(fh.read(limit) if limit else fh.read())
    return h.hexdigest()[:16]


class RunDir:
    """Typed paths inside one run directory."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def stage_dir(self, stage: str, create: bool = True) -> Path:
        d = self.root / stage
        if create:
            d.mkdir(parents=True, exist_ok=True)
        return d

    @property
    def contract_path(self) -> Path:
        return self.root / "contract.json"

    # The typed paths of the run dir's artifacts: every module names a run-dir path through these
    # (tests/test_artifacts.py checks no module spells one by hand). Owner = the module holding the
    # artifact's writer and reader.
    @property
    def probe_json(self) -> Path:
        """`probe/probe.json` (owner: stages/probe.py; read by sizing/estimate.py)."""
        return self.root / "probe" / "probe.json"

    @property
    def prepared_train(self) -> Path:
        """`prepare/train.jsonl` prepared conversations (owner: data/records.py: `write_prepared`, `read_prepared`,
        `prepared_file`)."""
        return self.root / "prepare" / "train.jsonl"

    @property
    def prepared_heldout(self) -> Path:
        """`prepare/heldout.jsonl` held-out prompts (owner: data/records.py: `write_prepared`, `prepared_file`)."""
        return self.root / "prepare" / "heldout.jsonl"

    @property
    def prepare_stats(self) -> Path:
        """`prepare/stats.json` counts per source and drop reason (owner: stages/prepare.py; read by
        sizing/session.py: the prompts the sources hold)."""
        return self.root / "prepare" / "stats.json"

    @property
    def generate_dir(self) -> Path:
        """`generate/`: the append-only journal shards and engine logs (owner: generate/journal.py)."""
        return self.root / "generate"

    @property
    def conversations_path(self) -> Path:
        """`generate/conversations.jsonl` regenerated conversations (owner: generate/conversations.py:
        `write_conversations`, `regenerated_file`; also failures.jsonl and settings.json)."""
        return self.root / "generate" / "conversations.jsonl"

    @property
    def generate_failures(self) -> Path:
        """`generate/failures.jsonl` the turns that failed (owner: generate/conversations.py `write_failures`)."""
        return self.root / "generate" / "failures.jsonl"

    @property
    def tokenize_dir(self) -> Path:
        """`tokenize/`: shard-*.parquet + stats.json (owner: data/shards.py)."""
        return self.root / "tokenize"

    @property
    def tokenize_stats(self) -> Path:
        return self.tokenize_dir / "stats.json"

    @property
    def capture_dir(self) -> Path:
        """Feature shards (`data/features.py`: writer, reader and format)."""
        return self.root / "capture"

    @property
    def train_dir(self) -> Path:
        """`train/`: checkpoints/, final/, best/ (owner: train/checkpoint.py), metrics.jsonl, curve.json
        (owner: train/logging.py)."""
        return self.root / "train"

    @property
    def checkpoints_dir(self) -> Path:
        """`train/checkpoints/step-*` (owner: train/checkpoint.py: `save_checkpoint`, `load_checkpoint`)."""
        return self.train_dir / "checkpoints"

    def checkpoint_dir(self, step: int) -> Path:
        """`train/checkpoints/step-XXXXXXX/`, the checkpoint after optimizer step `step` (owner: train/checkpoint.py
        `save_checkpoint`)."""
        return self.checkpoints_dir / f"step-{int(step):07d}"

    @property
    def engine_queue_dir(self) -> Path:
        """`train/engine-queue/` (`train.features=engine`): the bounded on-disk queue of feature rows (owner:
        engines/feed.py `EngineFeed`; `rank-R/` per rank under torchrun)."""
        return self.train_dir / "engine-queue"

    @property
    def final_dir(self) -> Path:
        """`train/final/` (owner: train/checkpoint.py `save_final`; loaded by export/hf.py `load_drafter`)."""
        return self.train_dir / "final"

    @property
    def best_dir(self) -> Path:
        """`train/best/` + best.json (owner: train/checkpoint.py: `save_final(best=...)`, `read_best`)."""
        return self.train_dir / "best"

    @property
    def train_metrics(self) -> Path:
        """`train/metrics.jsonl` (owner: train/logging.py: `MetricSink`, `read_metrics`)."""
        return self.train_dir / "metrics.jsonl"

    @property
    def train_curve(self) -> Path:
        """`train/curve.json` (owner: train/logging.py: `LearningCurve`, `read_curve`)."""
        return self.train_dir / "curve.json"

    @property
    def eval_results(self) -> Path:
        """`eval/results.json` (owner: decode/evaluation.py: `write_eval_results`, `read_eval_results`)."""
        return self.root / "eval" / "results.json"

    @property
    def eval_profile(self) -> Path:
        """`eval/speculation_profile.json` (owner: export/profile.py: `write_profile`, `read_profile`)."""
        return self.root / "eval" / "speculation_profile.json"

    @property
    def export_dir(self) -> Path:
        """`export/`: the exported drafter (owner: export/hf.py, export/speculators.py)."""
        return self.root / "export"

    @property
    def bench_dir(self) -> Path:
        return self.root / "bench"

    def bench_result(self, subject: str) -> Path:
        """`bench/<subject>.json` (owner: bench/results.py: `write_bench_result`, `read_bench_result`)."""
        return self.bench_dir / f"{subject}.json"

    @property
    def verify_engine_dir(self) -> Path:
        """`verify-engine/`: results.json + engine logs (owner: engines/verify.py)."""
        return self.root / "verify-engine"

    @property
    def verify_engine_results(self) -> Path:
        """`verify-engine/results.json` (owner: engines/verify.py: `write_engine_results`, `read_engine_results`)."""
        return self.verify_engine_dir / "results.json"

    @property
    def verify_engine_profile(self) -> Path:
        """`verify-engine/speculation_profile.json`: the drafter's profile with the engine's figures, when the
        drafter dir is not an export of ours to update (owner: export/profile.py)."""
        return self.verify_engine_dir / "speculation_profile.json"

    @property
    def learn_dir(self) -> Path:
        """`learn/`: the flywheel's cursor, rounds and promotion pointer (owner: flywheel/rounds.py,
        flywheel/pointer.py)."""
        return self.root / "learn"

    @property
    def learn_records(self) -> Path:
        """`learn/records/`: where `dflashkit flywheel` records its own traffic when serve.record_dir is unset
        (format owner: serving/record.py)."""
        return self.learn_dir / "records"

    @property
    def flywheel_results(self) -> Path:
        """`learn/flywheel.json`: one row per flywheel round (owner: stages/flywheel.py)."""
        return self.learn_dir / "flywheel.json"

    @property
    def report_dir(self) -> Path:
        return self.root / "report"

    @property
    def gpu_check_dir(self) -> Path:
        """`gpu-check/`: `dflashkit gpu-check`'s default OUT_DIR, summary.json + gpu-check.log (owner:
        gpucheck/runner.py)."""
        return self.root / "gpu-check"

    @property
    def resolved_config_path(self) -> Path:
        return self.root / "config.resolved.yaml"

    def manifest_path(self, stage: str) -> Path:
        return self.root / stage / "manifest.json"

    def manifest(self, stage: str) -> dict | None:
        p = self.manifest_path(stage)
        if not p.is_file():
            return None
        try:
            return read_json(p)
        except (OSError, json.JSONDecodeError):
            return None


def versions() -> dict[str, str]:
    out = {"dflashkit": __version__, "python": platform.python_version()}
    for mod in ("torch", "transformers", "tokenizers", "safetensors"):
        m = sys.modules.get(mod)
        if m is not None:
            out[mod] = getattr(m, "__version__", "?")
    return out


def write_manifest(stage_dir: Path, *, stage: str, config_hash: str, inputs: dict[str, Any] | None = None,
                   counts: dict[str, Any] | None = None, outputs: list[str] | None = None,
                   started: float | None = None, extra: dict[str, Any] | None = None) -> dict:
    """Write `<stage_dir>/manifest.json` atomically and return it."""
    manifest = {
        "stage": stage,
        "config_hash": config_hash,
        "inputs": inputs or {},
        "counts": counts or {},
        "outputs": outputs or [],
        "versions": versions(),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "wall_time_s": round(time.time() - started, 3) if started else None,
    }
    if extra:
        manifest.update(extra)
    atomic_write_json(Path(stage_dir) / "manifest.json", manifest)
    return manifest


LOCK_ENV = "DFLASHKIT_RUN_DIR_LOCK"  # set while held: child processes (torchrun ranks) share the lock


def _holder(fd: int) -> tuple[int | None, str]:
    """The PID and a description of the process holding the lock file `fd` (as written by the lock)."""
    raw = os.pread(fd, 4096, 0).decode(errors="replace")
    try:
        holder = json.loads(raw)
        pid = int(holder["pid"])
        return pid, f"PID {pid} (`dflashkit {holder.get('command')}`, since {holder.get('since')})"
    except (ValueError, KeyError, TypeError):
        return None, "another process"


def _write_holder(fd: int, command: str) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps({"pid": os.getpid(), "command": command,
                               "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n").encode(), 0)


def _release(fd: int, lock: Path, created: list[Path], *, remove: bool) -> None:
    """Release a lock taken by `run_dir_lock` / `dir_lock`: empty the holder record and, when `remove`, delete
    the lock file and the directories the lock created (innermost first, stopping at the first non-empty one);
    closing `fd` releases the flock."""
    try:
        os.ftruncate(fd, 0)
        if remove:
            lock.unlink()
            for p in created:
                p.rmdir()
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def run_dir_lock(root: str | Path, command: str) -> Iterator[None]:
    """Hold an exclusive `flock` on `<root>/.lock` for the body; a second writer gets `RunDirLocked`.

    The lock dies with its process (no stale lock after a crash or SIGKILL). The file records the
    holder's PID and command so the refusal can name them. Child processes inherit the lock through
    `LOCK_ENV` (train re-launched under torchrun); under a user's torchrun only RANK 0 locks. A run
    dir that this call created and that is still empty afterwards is removed again.
    """
    root = Path(root)
    key = str(root.resolve())
    if os.environ.get(LOCK_ENV) == key or (int(os.environ.get("WORLD_SIZE", "1") or 1) > 1
                                           and os.environ.get("RANK", "0") != "0"):
        yield
        return
    created = [p for p in [root, *root.parents] if not p.exists()]
    if root.exists() and not root.is_dir():
        raise UsageError(f"run.run_dir {root} is a file, not a directory", hint="set run.run_dir to a directory")
    path = root / ".lock"
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:  # /proc/x, a read-only mount, no permission
        raise UsageError(f"run.run_dir {root}: cannot write there ({e.strerror or e})",
                         hint="set run.run_dir to a directory you can write to") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid, who = _holder(fd)
        os.close(fd)
        raise RunDirLocked(f"run dir {root} is in use by {who}: one writer per run dir",
                           hint=f"wait for PID {pid} to finish (or stop it), or use another run.run_dir"
                           if pid else "wait for it to finish, or use another run.run_dir") from None
    except OSError as e:  # a filesystem without flock (some network mounts): warn, do not block

        logging.getLogger("dflashkit").warning("cannot lock %s (%s); not guarding against a second writer",
                                               path, e)
        os.close(fd)
        yield
        return
    _write_holder(fd, command)
    previous = os.environ.get(LOCK_ENV)
    os.environ[LOCK_ENV] = key
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(LOCK_ENV, None)
        else:
            os.environ[LOCK_ENV] = previous
        _release(fd, path, created, remove=bool(created) and [p.name for p in root.iterdir()] == [".lock"])


def check_writable_dir(path: str | Path, *, label: str, hint: str) -> None:
    """Raise `UsageError` naming `path` (as `label`, e.g. "run.run_dir") unless it is, or can be made, a
    directory this process can write into: not a file, not under a file, not a place where it cannot create
    or write (/proc, a read-only mount, no permission). Leaves no trace: the directories and the probe file it
    creates to find out are removed again. Call it before any work, in `--dry-run` too."""
    path = Path(path)
    for p in (path, *path.parents):
        if p.is_dir():
            break
        if p.exists() or p.is_symlink():
            kind = "a file" if p.exists() else "a broken symlink"
            where = "is" if p == path else f"is under {p}, which is"
            raise UsageError(f"{label} {path} {where} {kind}, not a directory", hint=hint)
    created = [p for p in (path, *path.parents) if not p.exists()]  # innermost first
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe.", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:  # /proc/x, a read-only mount, no permission
        raise UsageError(f"{label} {path}: cannot write there ({e.strerror or e})", hint=hint) from None
    finally:
        for p in created:
            if p.is_dir():
                try:
                    p.rmdir()
                except OSError:
                    break


@contextmanager
def dir_lock(path: str | Path, command: str, *, label: str) -> Iterator[None]:
    """Hold an exclusive `flock` on `<parent>/.<name>.lock` while `command` writes the directory `path`
    (one that may lie outside any run dir, such as `export.out_dir`); a second writer gets `UsageError`
    (exit 2) naming `label`, `path` and the holder's PID and command.

    The lock dies with its process, and the lock file is removed on release (the parents this call
    created too, when empty), so nothing stale is left to block a later writer. A process that opened
    the file just before its holder removed it locks a file no longer at the path: it sees that and
    locks the new one. On a filesystem without flock it warns and does not guard.
    """
    path = Path(path)
    lock = path.parent / f".{path.name}.lock"
    created = [p for p in path.parents if not p.exists()]  # innermost first
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{label} {path}: cannot create {path.parent} ({e.strerror or e})",
                         hint=f"set {label} to a directory you can write to") from None
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:  # a read-only mount, no permission
            raise UsageError(f"{label} {path}: cannot write {lock} there ({e.strerror or e})",
                             hint=f"set {label} to a directory you can write to") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid, who = _holder(fd)
            os.close(fd)
            raise UsageError(f"{label} {path} is being written by {who} (lock {lock}): one writer at a time",
                             hint=(f"wait for PID {pid} to finish (or stop it), " if pid else "wait for it to finish, ")
                             + f"or set {label} to another directory") from None
        except OSError as e:  # a filesystem without flock (some network mounts): warn, do not block
            logging.getLogger("dflashkit").warning("cannot lock %s (%s); not guarding %s against a second writer",
                                                   lock, e, path)
            os.close(fd)
            yield
            return
        try:
            here = os.stat(lock)
            mine = os.fstat(fd)
            if (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino):
                break
        except FileNotFoundError:
            pass
        os.close(fd)  # its holder removed the file as it finished: lock the one now at the path
    try:
        _write_holder(fd, command)
        yield
    finally:
        _release(fd, lock, created, remove=True)
