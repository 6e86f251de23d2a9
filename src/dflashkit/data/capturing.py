"""What `capture` writes and how: the plan (which tokenized shards still need features, their size on
disk against the free space) and the capture through the target in this process. The feature-shard
format, its writer and its reader are `data/features.py`; the vLLM path is `engines/capture.py`.

Usage:
    plan = plan_capture(cfg, contract, data, rd.capture_dir)   # plan.todo, plan.need (bytes), plan.message()
    plan.refuse_if_too_big(cfg.capture.max_disk_fraction, out_dir)
    for dest, samples, tokens in capture_local(cfg, contract, data, plan, where=str(rd.contract_path)): ...
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from dflashkit.data.features import ST_DTYPES, local_batches, shard_matches, shard_metadata_for, shard_path, write_shard
from dflashkit.errors import UsageError
from dflashkit.family import reads_target_law
from dflashkit.progress import Progress
from dflashkit.rundir import file_digest

log = logging.getLogger("dflashkit.capture")


@dataclass
class CapturePlan:
    """Which shards to (re)write and what they cost; `todo` holds (shard index, shard, digest, dest)."""

    layer_ids: list[int]
    dtype: str
    engine: str
    autocast: Any  # the torch dtype online training's target forward runs under, or None
    keep_last: bool
    width: int
    hidden: int
    per_token: int
    tokens: int
    todo: list[tuple[int, Path, str, Path]]
    need: int
    free: int
    what: str

    def message(self, shards: int) -> str:
        return (f"capture: {self.tokens} tokens x ({self.what}) = {self.per_token} B/token = "
                f"{self.tokens * self.per_token / 1e9:.3f} GB in total, {self.need / 1e9:.3f} GB to write "
                f"({len(self.todo)}/{shards} shards); {self.free / 1e9:.1f} GB free")

    def refuse_if_too_big(self, max_disk_fraction: float, out_dir: Path) -> None:
        if self.need > max_disk_fraction * self.free:
            raise UsageError(f"capture needs {self.need / 1e9:.3f} GB but only {self.free / 1e9:.3f} GB is free in "
                             f"{out_dir} (capture.max_disk_fraction={max_disk_fraction})",
                             hint="free disk space, use capture.dtype=bfloat16, or train with train.features=online")


def capture_layer_ids(cfg: Any, contract: Any) -> list[int]:
    """The target layers a capture writes: the contract's `target_layer_ids` (in its order, the drafter's
    feature order), then `capture.extra_layer_ids` not among them, ascending."""
    ids = list(contract.target_layer_ids)
    extra = sorted(set(cfg.capture.extra_layer_ids) - set(ids))
    bad = [i for i in extra if not 0 <= i < contract.num_target_layers]
    if bad:
        raise UsageError(f"capture.extra_layer_ids: {bad} outside the target's {contract.num_target_layers} "
                         f"decoder layers (0 … {contract.num_target_layers - 1})",
                         hint="use 0-based decoder layer ids, as drafter.target_layer_ids does")
    return ids + extra


def plan_capture(cfg: Any, contract: Any, data: Any, out_dir: Path) -> CapturePlan:
    """The shards whose features are missing or stale (layer ids, source digest, dtype, autocast, engine)."""
    from dflashkit.model.target import resolve_device, resolve_dtype, target_autocast

    dtype = cfg.capture.dtype
    layer_ids = capture_layer_ids(cfg, contract)
    width = len(layer_ids) * contract.hidden_size
    # the forward online training would run (train.target_dtype), so cached ≡ online
    dev = resolve_device(cfg.target.device)
    engine = cfg.capture.engine
    autocast = None if engine == "vllm" else target_autocast(cfg.train.target_dtype, dev,
                                                              resolve_dtype(cfg.target.dtype, dev))
    keep_last = cfg.capture.last_hidden == "true" or (cfg.capture.last_hidden == "auto"
                                                      and reads_target_law(cfg.train, contract.family))
    per_token = (width + (contract.hidden_size if keep_last else 0)) * ST_DTYPES[dtype][1] + 4
    tokens = sum(len(x) for x in data.input_ids)
    todo = []
    for si, shard in enumerate(data.shards):
        digest = file_digest(shard, limit=None)
        dest = shard_path(out_dir, shard)
        if not shard_matches(dest, layer_ids=layer_ids, digest=digest, dtype=dtype, last_hidden=keep_last,
                             autocast=str(autocast or "none"), engine=engine):
            todo.append((si, shard, digest, dest))
    todo_ids = {t[0] for t in todo}
    need = sum(len(data.input_ids[i]) for i, (si, _) in enumerate(data.where) if si in todo_ids) * per_token
    free = shutil.disk_usage(next(p for p in (out_dir, *out_dir.parents) if p.exists())).free
    what = f"{len(layer_ids)}{' + 1 (last hidden)' if keep_last else ''} x {contract.hidden_size} x " \
           f"{ST_DTYPES[dtype][1]} B + 4 B (next ids)"
    return CapturePlan(layer_ids=layer_ids, dtype=dtype, engine=engine, autocast=autocast, keep_last=keep_last,
                       width=width, hidden=contract.hidden_size, per_token=per_token, tokens=tokens, todo=todo,
                       need=need, free=free, what=what)


def shard_rows(data: Any, si: int) -> list[Any]:
    """The input ids of tokenized shard `si`'s samples, in row order (torch tensors)."""
    import torch

    return [torch.from_numpy(data.input_ids[i]) for i, (s, _) in enumerate(data.where) if s == si]


def capture_local(cfg: Any, contract: Any, data: Any, plan: CapturePlan, *, where: str) -> Iterator[tuple[Path, int, int]]:
    """Load the target here (checked against the contract), write every planned shard; yields
    (shard path, samples, tokens) as each one is in place."""
    from dflashkit.model.drafter_config import REPROBE_HINT
    from dflashkit.model.target import load_target

    target = load_target(cfg.target)
    contract.check(target, where=where, hint=REPROBE_HINT)
    pad = (target.tokenizer.pad_token_id if target.tokenizer is not None else 0) or 0
    if plan.autocast is not None:
        log.info("capture: target forward under %s autocast (train.target_dtype=%s)", plan.autocast,
                 cfg.train.target_dtype)
    bar = Progress("capture", total=plan.need // plan.per_token, unit="tok")
    for si, shard, digest, dest in plan.todo:
        rows = shard_rows(data, si)
        meta = shard_metadata_for(layer_ids=plan.layer_ids, source=shard.name, digest=digest, dtype=plan.dtype,
                                  hidden=plan.hidden, samples=len(rows), autocast=str(plan.autocast or "none"))
        batches = bar.track(local_batches(target, rows, plan.layer_ids, batch_size=cfg.capture.batch_size,
                                          pad_id=pad, last_hidden=plan.keep_last, autocast=plan.autocast),
                            size=lambda batch: sum(len(r[2]) for r in batch))
        n = write_shard(dest, [len(r) for r in rows], batches, dtype=plan.dtype, metadata=meta, width=plan.width,
                        hidden=plan.hidden, last_hidden=plan.keep_last)
        yield dest, len(rows), n
    bar.close()
