"""What `capture` writes and how: the plan (which tokenized shards still need features, their size on
disk against the free space) and the capture through the target in this process. The feature-shard
format, its writer and its reader are `data/features.py`; the vLLM path is `engines/capture.py`.

Usage:
    plan = plan_capture(cfg, contract, data, rd.capture_dir, heldout=heldout_idx)   # plan.todo, plan.need (bytes)
    plan.refuse_if_too_big(cfg.capture.max_disk_fraction, out_dir)
    for dest, samples, tokens in capture_local(cfg, contract, data, plan, where=str(rd.contract_path)): ...
    plan.path_cost.as_dict()                                   # what the greedy paths cost (target tokens)

The target's greedy path (`path_ids`, `model/path_labels.py`) of depth B−1 is computed, from the same
forward as the features, for the held-out samples always (the yardstick scores held-out blocks on it)
and for every sample with `train.on_path=rollout`. A shard whose features still match but which lacks
some of those paths is not captured again: only its missing paths are computed and the shard is
rewritten with its stored rows (`plan.patch`).
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from dflashkit.data.features import (ST_DTYPES, PathCost, PathSpec, local_batches, missing_path_rows, shard_matches,
                                     shard_metadata, shard_metadata_for, shard_path, stored_rows, stored_width,
                                     write_shard)
from dflashkit.errors import UsageError
from dflashkit.family.contract import REPROBE_HINT
from dflashkit.family.recipe import Recipe, resolve_recipe
from dflashkit.target.files import resolve_target_path
from dflashkit.target.hybrid import dir_layer_types, recurrent_summary, refuse_recurrent
from dflashkit.model.path_labels import check_full_attention
from dflashkit.target.load import resolve_device, resolve_dtype, target_autocast, text_config_dict
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
    recipe: Recipe                                               # the run's (`family/recipe.py`)
    path_depth: int = 0                                          # D of the greedy paths (0: none, engine capture)
    path_rows: dict[int, Any] = field(default_factory=dict)      # shard index → PathRows it must hold
    patch: list[tuple[int, Path, Path, list[int]]] = field(default_factory=list)  # (shard, src, dest, rows)
    path_cost: PathCost = field(default_factory=PathCost)

    def message(self, shards: int) -> str:
        patch = f", {len(self.patch)} more to add greedy paths to" if self.patch else ""
        return (f"capture: {self.tokens} tokens x ({self.what}) = {self.per_token} B/token = "
                f"{self.tokens * self.per_token / 1e9:.3f} GB in total, {self.need / 1e9:.3f} GB to write "
                f"({len(self.todo)}/{shards} shards{patch}); {self.free / 1e9:.1f} GB free")

    def path_message(self) -> str:
        c = self.path_cost.as_dict()
        return (f"capture: greedy paths (depth {self.path_depth}) of {c['tokens']} tokens ({c['supervised_tokens']} "
                f"supervised): {c['rolled_tokens']} extra target tokens = {c['extra_per_token']} per token, "
                f"{c['extra_per_supervised_token']} per supervised token ({c['rollout_rows']} rows where the text "
                "differs from the target's argmax)")

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


def path_rows_wanted(recipe: Recipe, data: Any, heldout: list[int]) -> dict[int, Any]:
    """Per tokenized shard, the rows (PathRows) whose greedy path capture writes: all when the recipe learns
    the paths (`train.on_path=rollout`), else the held-out samples'."""
    if recipe.rollout:
        return {si: "all" for si in range(len(data.shards))}
    out: dict[int, Any] = {}
    for i in heldout:
        si, row = data.where[i]
        out.setdefault(si, []).append(row)
    return {si: sorted(rows) for si, rows in out.items()}


def rollout_reproduces_attention(cfg: Any, data: Any, recipe: Recipe) -> bool:
    """Whether the greedy-path rollout's full-prefix mask (of depth `recipe.path_depth`) is what the target
    attends to over these samples (`model/path_labels.attention_limit`, read from the target's config.json; a
    GGUF-only target is taken as full attention). When the recipe learns the paths (train.on_path=rollout) a
    target it is not raises UsageError (exit 2) before any work."""
    model_dir, gguf = resolve_target_path(cfg.target.path, cfg.target.gguf_file)
    if gguf or not (model_dir / "config.json").is_file():
        return True
    if recurrent_summary(dir_layer_types(model_dir, cfg.target.trust_remote_code)) is not None:
        if not recipe.rollout:
            return False
        refuse_recurrent("train.on_path=rollout", model_dir, why="the greedy-path rollout reads a tree of paths through "
                         "one full-attention KV cache, which a recurrent state cannot hold",
                         instead="use train.on_path=mask (free, no target work)",
                         trust_remote_code=cfg.target.trust_remote_code)
    tc = text_config_dict(model_dir)
    length = max((len(x) for x in data.input_ids), default=0) + recipe.path_depth - 1
    try:
        check_full_attention(tc, length)
    except UsageError:
        if recipe.rollout:
            raise
        return False
    return True


def plan_capture(cfg: Any, contract: Any, data: Any, out_dir: Path, *, heldout: list[int] | None = None) -> CapturePlan:
    """The shards whose features are missing or stale (layer ids, source digest, dtype, autocast, engine),
    and those whose features match but lack greedy paths (`heldout`: the held-out sample indices)."""
    dtype = cfg.capture.dtype
    layer_ids = capture_layer_ids(cfg, contract)
    width = len(layer_ids) * contract.hidden_size
    # the forward online training would run (train.target_dtype), so cached ≡ online
    dev = resolve_device(cfg.target.device)
    engine = cfg.capture.engine
    autocast = None if engine == "vllm" else target_autocast(cfg.train.target_dtype, dev,
                                                              resolve_dtype(cfg.target.dtype, dev))
    recipe = resolve_recipe(cfg.train, contract)
    keep_last = cfg.capture.last_hidden == "true" or (cfg.capture.last_hidden == "auto" and recipe.needs_target_logits)
    depth = recipe.path_depth if engine == "local" else 0  # an engine gives no greedy paths
    if depth > 1 and not rollout_reproduces_attention(cfg, data, recipe):
        depth = 0  # a sliding window the samples outgrow: no held-out paths (train scores argmax labels instead)
    wanted = path_rows_wanted(recipe, data, heldout or []) if depth else {}
    per_token = (width + (contract.hidden_size if keep_last else 0)) * ST_DTYPES[dtype][1] + 4 + \
        (4 * depth if wanted else 0)
    tokens = sum(len(x) for x in data.input_ids)
    todo, patch = [], []
    samples = [0] * len(data.shards)
    for si, _ in data.where:
        samples[si] += 1
    for si, shard in enumerate(data.shards):
        digest = file_digest(shard, limit=None)
        dest = shard_path(out_dir, shard)
        if not shard_matches(dest, layer_ids=layer_ids, digest=digest, dtype=dtype, last_hidden=keep_last,
                             autocast=str(autocast or "none"), engine=engine):
            todo.append((si, shard, digest, dest))
        elif missing := missing_path_rows(dest, wanted.get(si), samples[si], depth):
            patch.append((si, shard, dest, missing))
    todo_ids = {t[0] for t in todo} | {p[0] for p in patch}
    need = sum(len(data.input_ids[i]) for i, (si, _) in enumerate(data.where) if si in todo_ids) * per_token
    free = shutil.disk_usage(next(p for p in (out_dir, *out_dir.parents) if p.exists())).free
    what = f"{len(layer_ids)}{' + 1 (last hidden)' if keep_last else ''} x {contract.hidden_size} x " \
           f"{ST_DTYPES[dtype][1]} B + 4 B (next ids){f' + {depth} x 4 B (greedy path)' if wanted else ''}"
    return CapturePlan(layer_ids=layer_ids, dtype=dtype, engine=engine, autocast=autocast, keep_last=keep_last,
                       width=width, hidden=contract.hidden_size, per_token=per_token, tokens=tokens, todo=todo,
                       need=need, free=free, what=what, recipe=recipe, path_depth=depth, path_rows=wanted, patch=patch)


def shard_rows(data: Any, si: int) -> list[Any]:
    """The input ids of tokenized shard `si`'s samples, in row order (torch tensors)."""
    return [torch.from_numpy(data.input_ids[i]) for i, (s, _) in enumerate(data.where) if s == si]


def _path_spec(plan: CapturePlan, data: Any, si: int, rows: Any) -> PathSpec:
    masks = [data.loss_mask[i] for i, (s, _) in enumerate(data.where) if s == si]
    return PathSpec(depth=plan.path_depth if rows else 0, rows=rows, loss_masks=masks, cost=plan.path_cost)


def capture_local(cfg: Any, contract: Any, data: Any, plan: CapturePlan, *, where: str,
                  on_rate: Callable[[Any, int, float], object] | None = None) -> Iterator[tuple[Path, int, int]]:
    """Load the target here (checked against the contract), write every planned shard; yields
    (shard path, samples, tokens) as each one is in place. `on_rate(target, tokens, seconds)` is told the
    capture's rate once every new shard is written (the capture stage logs it against the roofline)."""
    from dflashkit.target.load import load_target

    target = load_target(cfg.target)
    contract.check(target, where=where, hint=REPROBE_HINT)
    pad = (target.tokenizer.pad_token_id if target.tokenizer is not None else 0) or 0
    if plan.autocast is not None:
        log.info("capture: target forward under %s autocast (train.target_dtype=%s)", plan.autocast,
                 cfg.train.target_dtype)
    bar = Progress("capture", total=plan.need // plan.per_token, unit="tok")
    t0, captured = time.perf_counter(), 0
    for si, shard, digest, dest in plan.todo:
        rows = shard_rows(data, si)
        meta = shard_metadata_for(layer_ids=plan.layer_ids, source=shard.name, digest=digest, dtype=plan.dtype,
                                  hidden=plan.hidden, samples=len(rows), autocast=str(plan.autocast or "none"))
        paths = _path_spec(plan, data, si, plan.path_rows.get(si))
        batches = bar.track(local_batches(target, rows, plan.layer_ids, batch_size=cfg.capture.batch_size,
                                          pad_id=pad, last_hidden=plan.keep_last, autocast=plan.autocast,
                                          paths=paths),
                            size=lambda batch: sum(len(r[2]) for r in batch))
        n = write_shard(dest, [len(r) for r in rows], batches, dtype=plan.dtype, metadata=meta, width=plan.width,
                        hidden=plan.hidden, last_hidden=plan.keep_last, path_depth=paths.depth)
        captured += n
        yield dest, len(rows), n
    if captured and on_rate is not None:
        on_rate(target, captured, time.perf_counter() - t0)
    for si, _shard, dest, missing in plan.patch:  # features kept: the target runs over the missing paths' samples
        rows = shard_rows(data, si)
        masks = _path_spec(plan, data, si, missing).loss_masks or []
        paths = PathSpec(depth=plan.path_depth, rows="all", loss_masks=[masks[r] for r in missing],
                         cost=plan.path_cost)  # local_batches numbers the rows it is given: all of them
        new: dict[int, Any] = {}
        for batch in bar.track(local_batches(target, [rows[r] for r in missing], plan.layer_ids,
                                             batch_size=cfg.capture.batch_size, pad_id=pad, last_hidden=False,
                                             autocast=plan.autocast, paths=paths),
                               size=lambda batch: sum(len(r[2]) for r in batch)):
            new.update((missing[r[0]], r[4]) for r in batch)
        meta = dict(shard_metadata(dest) or {})
        n = write_shard(dest, [len(r) for r in rows], stored_rows(dest, [len(r) for r in rows], new,
                                                                  depth=plan.path_depth),
                        dtype=plan.dtype, metadata=meta, width=stored_width(dest), hidden=plan.hidden,
                        last_hidden=meta.get("last_hidden") == "1", path_depth=plan.path_depth)
        log.info("%s: added the greedy paths of %d samples (features kept)", dest.name, len(missing))
        yield dest, len(rows), n
    bar.close()
