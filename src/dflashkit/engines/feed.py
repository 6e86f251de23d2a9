"""`train.features: engine`: feature rows requested from a serving engine as training consumes them.

Usage:
    with engine_source(cfg, contract, rd.train_dir, last_hidden=kl) as src:          # engines/capture.py
        feed = EngineFeed(src, data, rd.engine_queue_dir, prefetch=2, concurrency=4, key=...)
        data.features = feed                       # the reader `collate` and the levers use (FeatureStore's API)
        feed.start(item, count)                    # item(k) = (step, micro, samples): the k-th training micro-batch
        feed.stage(samples)                        # before collating a batch: its rows, then their files go
        feed.stats()                               # {"engine_peak_disk_bytes": ..., "engine_rows_requested": ...}
        feed.close()

The queue: a background thread walks the schedule of training micro-batches and requests each one's
samples from the engine (`capture.concurrency` in flight) into `<queue>/step-SSSSSSSS-mMM/`, one
safetensors file per row, written atomically. Invariant: at most `prefetch` micro-batches are on
disk at a time (a slot is taken before a batch is requested and freed once `stage` has read and
deleted its files). Any other request (held-out evaluation, feature scale, draft-vocab labels) is
answered from the engine directly, in memory. Rows are exactly what a `capture.engine=vllm` shard
holds (`EngineSource.row`), so engine-fed training reads what cached training would read.

The bytes on disk are counted as files come and go (`engine_peak_disk_bytes`). Resume: batch dirs
are named by (step, micro-batch) and the schedule starts at the resumed step, so a re-run requests
only what it still needs; `queue.json` records what the queue was built for, and a queue built for
another batch plan or feature recipe is emptied.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

import torch

from dflashkit.engines.capture import EngineSource, FeatureRow, Spool, check_engine, engine_source
from dflashkit.errors import DflashkitError, UsageError
from dflashkit.rundir import atomic_write_json

log = logging.getLogger("dflashkit.train")

NAMES = ("features", "next_ids", "last_hidden")


def batch_dir(root: Path, step: int, micro: int) -> Path:
    return Path(root) / f"step-{step:08d}-m{micro:02d}"


class _Slot:
    """One scheduled micro-batch: its samples, its spool, when it is ready (or why it failed)."""

    def __init__(self, step: int, micro: int, samples: list[int], spool: Spool):
        self.step, self.micro, self.samples, self.spool = step, micro, samples, spool
        self.ready = threading.Event()
        self.error: BaseException | None = None


class EngineFeed:
    """The bounded queue of engine rows (see the module doc); `get/has/require` as `FeatureStore`."""

    def __init__(self, src: EngineSource, data: Any, root: Path, *, prefetch: int, concurrency: int,
                 key: dict[str, Any]):
        if prefetch < 1:
            raise UsageError(f"train.engine_prefetch: must be >= 1, got {prefetch}")
        self.src, self.data, self.root = src, data, Path(root)
        self.prefetch, self.concurrency = int(prefetch), max(1, int(concurrency))
        self.index = {tuple(w): i for i, w in enumerate(data.where)}
        self._lock = threading.Lock()
        self._free = threading.Semaphore(self.prefetch)
        self._stop = threading.Event()
        self._slots: dict[int, _Slot] = {}  # scheduled, not yet staged (the producer adds, stage pops)
        self._item: Callable[[int], tuple[int, int, list[int]]] = lambda k: (0, 0, [])
        self._count_items = self._k = 0
        self._have = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._rows: dict[tuple[int, int], FeatureRow] = {}   # the staged batch (or one on-demand row)
        self.bytes_now = self.peak_bytes = self.batch_max_bytes = 0
        self.requested = self.reused = self.on_demand = 0
        self._batch_bytes: dict[Path, int] = {}
        self.engine: Any = None  # the ExitStack holding the engine `open_engine_feed` entered (closed last)
        self._open_queue(key)

    # -- FeatureStore's reading API -------------------------------------------------------------
    def has(self, name: str) -> bool:
        return name in ("features", "next_ids") or (name == "last_hidden" and self.src.last_hidden)

    def require(self, name: str, why: str) -> None:
        if not self.has(name):
            raise UsageError(f"train.features=engine: the engine rows carry no `{name}` ({why})",
                             hint="train.loss=kl|ce+kl asks the engine for the last hidden state")

    def get(self, where: tuple[int, int], length: int, name: str = "features") -> torch.Tensor:
        w = tuple(where)
        row = self._rows.get(w)  # type: ignore[arg-type]
        if row is None:  # not in the staged batch: from the engine, in memory (held-out, levers)
            row = self._fetch([self.index[w]])[0]
            self._rows = {w: row}  # type: ignore[dict-item]
            self.on_demand += 1
        t = {"features": row.features, "next_ids": row.next_ids, "last_hidden": row.last_hidden}[name]
        if t is None or t.shape[0] != length:
            raise DflashkitError(f"engine row of sample {self.index[w]}: `{name}` "
                                 f"{None if t is None else tuple(t.shape)} for a {length}-token sample")
        return t

    # -- the queue ------------------------------------------------------------------------------
    def _open_queue(self, key: dict[str, Any]) -> None:
        marker = self.root / "queue.json"
        try:
            old = json.loads(marker.read_text()) if marker.is_file() else None
        except (OSError, json.JSONDecodeError):
            old = None
        if old != key and self.root.exists():
            log.info("emptying %s (built for another batch plan or feature recipe)", self.root)
            shutil.rmtree(self.root)
        self.root.mkdir(parents=True, exist_ok=True)
        if old != key:
            atomic_write_json(marker, key)

    def start(self, item: Callable[[int], tuple[int, int, list[int]]], count: int) -> None:
        """Begin prefetching the schedule: `item(k)` = (step, micro-batch, sample indices) of the k-th
        training micro-batch, k < `count`, in consumption order."""
        self._item, self._count_items, self._k = item, int(count), 0
        if count:  # batch dirs of steps before the first scheduled one are never read again
            first = batch_dir(self.root, *item(0)[:2]).name
            for p in sorted(self.root.glob("step-*")):
                if p.name < first:
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    self._count(p, sum(f.stat().st_size for f in p.glob("*.safetensors")))
        self._thread = threading.Thread(target=self._produce, name="dflashkit-engine-feed", daemon=True)
        self._thread.start()

    def _count(self, d: Path, n: int) -> None:
        with self._lock:
            self._batch_bytes[d] = self._batch_bytes.get(d, 0) + n
            self.bytes_now += n
            self.peak_bytes = max(self.peak_bytes, self.bytes_now)
            self.batch_max_bytes = max(self.batch_max_bytes, self._batch_bytes[d])

    def _produce(self) -> None:
        for k in range(self._count_items):
            while not self._free.acquire(timeout=0.2):
                if self._stop.is_set():
                    return
            if self._stop.is_set():
                return
            step, micro, samples = self._item(k)
            slot = _Slot(step, micro, list(samples), Spool(batch_dir(self.root, step, micro)))
            with self._have:
                self._slots[k] = slot
                self._have.notify_all()
            try:
                self._fill(slot)
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
                slot.error = e
                slot.ready.set()
                return
            slot.ready.set()

    def _fill(self, slot: _Slot) -> None:
        spool = slot.spool
        spool.root.mkdir(parents=True, exist_ok=True)
        have = set(spool.done(len(slot.samples)))
        self.reused += len(have)

        def one(j: int) -> None:
            if self._stop.is_set():
                return
            ids = [int(x) for x in self.data.input_ids[slot.samples[j]]]
            spool.write(j, self.src.sample(ids), len(ids))
            self._count(spool.root, spool.path(j).stat().st_size)
            with self._lock:
                self.requested += 1

        todo = [j for j in range(len(slot.samples)) if j not in have]
        with ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="dflashkit-engine") as pool:
            list(pool.map(one, todo))

    def _fetch(self, samples: list[int]) -> list[FeatureRow]:
        def one(i: int) -> FeatureRow:
            row = self.src.sample([int(x) for x in self.data.input_ids[i]])
            return FeatureRow(row.features, row.next_ids.to(torch.int32).long(), row.last_hidden)

        with ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="dflashkit-engine") as pool:
            return list(pool.map(one, samples))

    def stage(self, samples: list[int]) -> None:
        """Make `samples`' rows the ones `get` returns: the next scheduled batch (its files are then
        deleted and its slot freed), or, for any other batch, rows requested now, in memory."""
        samples = [int(i) for i in samples]
        k = self._k
        if k < self._count_items and list(self._item(k)[2]) == samples:
            with self._have:
                while k not in self._slots:
                    if self._thread is None or not self._thread.is_alive():
                        raise DflashkitError("train.features=engine: the engine feed stopped before batch "
                                             f"{k} of its schedule", hint="read the log above for the cause")
                    self._have.wait(timeout=0.2)
                slot = self._slots.pop(k)
            self._k += 1
            slot.ready.wait()
            if slot.error is not None:
                raise slot.error
            rows = [slot.spool.read(j) for j in range(len(samples))]
            slot.spool.remove()
            with self._lock:
                self.bytes_now -= self._batch_bytes.pop(slot.spool.root, 0)
            self._free.release()
        else:
            rows = self._fetch(samples)
            self.on_demand += len(samples)
        self._rows = {tuple(self.data.where[i]): r for i, r in zip(samples, rows)}  # type: ignore[misc]

    def stats(self) -> dict[str, Any]:
        return {"engine_peak_disk_bytes": self.peak_bytes, "engine_batch_max_bytes": self.batch_max_bytes,
                "engine_prefetch": self.prefetch, "engine_rows_requested": self.requested,
                "engine_rows_reused": self.reused, "engine_rows_on_demand": self.on_demand}

    def close(self) -> None:
        """Stop the prefetcher and the engine this feed started (if any); the queue dir goes."""
        self._stop.set()
        self._free.release()  # a producer waiting for a slot sees the stop flag
        if self._thread is not None:
            self._thread.join(timeout=60)
        self._rows = {}
        shutil.rmtree(self.root, ignore_errors=True)
        if self.engine is not None:
            self.engine.close()


FEED_KEY = "train.features=engine"


def check_world(cfg: Any, world: int) -> None:
    """Under torchrun the ranks share one engine: capture.server_url (exit 2 without it)."""
    if world > 1 and not cfg.capture.server_url:
        raise UsageError("train.features=engine under torchrun needs capture.server_url (one engine for "
                         f"every rank; {world} ranks would each start a vLLM)",
                         hint="start vLLM with the flags `dflashkit capture --dry-run` prints and set "
                         "capture.server_url, or train in one process")


def check_engine_feed(cfg: Any, contract: Any, out_dir: Path, *, world: int) -> None:
    """Every check `open_engine_feed` makes before any work (`train --dry-run` calls it): one engine for
    every rank, and `engines/capture.py` `check_engine` (the vLLM at capture.server_url, or what starting
    one needs)."""
    check_world(cfg, world)
    check_engine(cfg, contract, Path(out_dir), what=FEED_KEY)


def open_engine_feed(cfg: Any, contract: Any, data: Any, out_dir: Path, *, queue_dir: Path, last_hidden: bool,
                     rank: int, world: int, key: dict[str, Any]) -> EngineFeed:
    """The engine (`capture.server_url`, or a vLLM started here: `<out_dir>/engine.log`,
    `<out_dir>/engine-files`) and this rank's feed over it (`queue_dir[/rank-R]`, `RunDir.engine_queue_dir`);
    `last_hidden`: the rows carry the target's final-norm output (the recipe's `needs_target_logits`).
    `feed.close()` stops both."""
    check_world(cfg, world)
    stack = ExitStack()
    try:
        src = stack.enter_context(engine_source(cfg, contract, Path(out_dir), last_hidden=last_hidden, what=FEED_KEY))
        root = Path(queue_dir)
        feed = EngineFeed(src, data, root / f"rank-{rank}" if world > 1 else root,
                          prefetch=cfg.train.engine_prefetch, concurrency=cfg.capture.concurrency, key=key)
    except BaseException:
        stack.close()
        raise
    feed.engine = stack
    return feed
