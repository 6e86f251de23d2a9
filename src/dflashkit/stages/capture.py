"""`dflashkit capture`: run the target over the tokenized shards and cache its features.

Inputs:  contract.json (probe), tokenize/shard-*.parquet (tokenize), the target (target.path).
Outputs: capture/shard-XXXXX.safetensors (one per tokenized shard), capture/manifest.json.
Example: dflashkit capture -c run.yaml capture.dtype=bfloat16

Each feature shard holds `features` [tokens, n_feat·H] (capture.dtype; the concatenated outputs
of target decoder layers `target_layer_ids`, rows of all samples back to back), `next_ids`
[tokens] (int32: the target's greedy next token at every position, argmax lm_head; what
`train.labels=target` learns, 4 B/token), optionally `last_hidden` [tokens, H] (capture.dtype: the
target's final-norm output, from which training recomputes the target's distribution for
`train.loss=kl|ce+kl`; `capture.last_hidden`), `offsets` [samples+1] (int64 row offsets, in
tokenized-shard order) and metadata: the target_layer_ids, the source shard's digest, the dtype.
The target runs as online training would run it (`train.target_dtype`: float32, or under bf16
autocast), so cached and online training see the same features. The total size is logged BEFORE
any work, and the stage refuses (exit 2) when it exceeds capture.max_disk_fraction of the free disk.
The format, its writer and its reader are `data/features.py` (the `safetensors` library writes
it). Shards are written through a temp file + rename and streamed (never held in memory whole); a
complete shard whose layer ids and source digest still match is skipped, so a killed run resumes.
`dflashkit train train.features=cached` refuses shards captured at other layer ids.

`capture.engine: vllm` (`engines/capture.py`): the features come from vLLM's `extract_hidden_states`
(started here with dflashkit's CPU-safe connector, or `capture.server_url`; `--dry-run` prints the
`vllm serve` flags), one request per sample, its ids checked; labels and `last_hidden` from the
target's final norm + LM head only. Rows are spooled per sample (`capture/engine-spool/`, atomic), so
a killed run re-requests only what it lost, and the shard is written by the same `write_shard`.
"""

from __future__ import annotations

import logging
import shlex
import shutil
import time
from typing import Any

import torch

from dflashkit.config import RunConfig, section_hash
from dflashkit.data.features import (ST_DTYPES, local_batches, shard_matches, shard_metadata_for, shard_path,
                                     write_shard)
from dflashkit.context import StageContext
from dflashkit.errors import UsageError
from dflashkit.progress import Progress
from dflashkit.rundir import RunDir, file_digest, read_json, remove_stale_temps, write_manifest
from dflashkit.stage_table import stage_hash

log = logging.getLogger("dflashkit.capture")

def run(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict:
    from dflashkit.model.drafter_config import DrafterContract
    from dflashkit.train.data import load_tokenized

    t0 = time.time()
    contract = DrafterContract.load(rd.contract_path)
    data = load_tokenized(rd)
    out_dir = rd.capture_dir
    if not ctx.dry_run:  # a dry run creates nothing
        out_dir.mkdir(parents=True, exist_ok=True)
    if not ctx.dry_run:  # a shard's temp file from a killed capture: we hold the lock, so nobody writes it
        for p in remove_stale_temps(out_dir, "*.safetensors"):
            log.info("removed %s (left by an interrupted capture)", p)
    dtype = cfg.capture.dtype
    width = contract.num_features * contract.hidden_size
    from dflashkit.model.target import resolve_device, resolve_dtype, target_autocast

    # the forward online training would run (train.target_dtype), so cached ≡ online
    dev = resolve_device(cfg.target.device)
    engine = cfg.capture.engine
    autocast = None if engine == "vllm" else target_autocast(cfg.train.target_dtype, dev,
                                                              resolve_dtype(cfg.target.dtype, dev))
    keep_last = cfg.capture.last_hidden == "true" or (cfg.capture.last_hidden == "auto" and cfg.train.loss != "ce")
    per_token = (width + (contract.hidden_size if keep_last else 0)) * ST_DTYPES[dtype][1] + 4
    tokens = sum(len(x) for x in data.input_ids)
    layer_ids = list(contract.target_layer_ids)
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
    what = f"{contract.num_features}{' + 1 (last hidden)' if keep_last else ''} x {contract.hidden_size} x " \
           f"{ST_DTYPES[dtype][1]} B + 4 B (next ids)"
    msg = (f"capture: {tokens} tokens x ({what}) = {per_token} B/token = "
           f"{tokens * per_token / 1e9:.3f} GB in total, {need / 1e9:.3f} GB to write "
           f"({len(todo)}/{len(data.shards)} shards); {free / 1e9:.1f} GB free")
    log.info("%s", msg)
    if not ctx.json:
        print(msg, flush=True)
    if need > cfg.capture.max_disk_fraction * free:
        raise UsageError(f"capture needs {need / 1e9:.3f} GB but only {free / 1e9:.3f} GB is free in {out_dir} "
                         f"(capture.max_disk_fraction={cfg.capture.max_disk_fraction})",
                         hint="free disk space, use capture.dtype=bfloat16, or train with train.features=online")
    result: dict[str, Any] = {"shards": len(data.shards), "to_write": len(todo), "written": 0, "skipped": len(data.shards) - len(todo),
              "tokens": tokens, "bytes_total": tokens * per_token, "bytes_written": need, "dtype": dtype,
              "target_layer_ids": layer_ids, "bytes_per_token": per_token, "last_hidden": keep_last}
    if engine == "vllm":
        from dflashkit.engines.capture import serve_command_for

        cmd = serve_command_for(cfg, layer_ids, out_dir / "engine-files")
        result["engine"] = {"server_url": cfg.capture.server_url, "vllm_serve": shlex.join(cmd)}
        if ctx.dry_run and not ctx.json:
            print("capture.server_url mode: start vLLM with (GPU: vLLM's stock connector; a CPU build needs "
                  "dflashkit's, which capture.server_url=null starts for you):\n  " + shlex.join(cmd), flush=True)
    if ctx.dry_run:
        return {"dry_run": True, **result}
    if todo and engine == "vllm":
        from dflashkit.engines.capture import capture_shards, engine_source

        jobs = []
        for si, shard, digest, dest in todo:
            rows = [torch.from_numpy(data.input_ids[i]) for i, (s, _) in enumerate(data.where) if s == si]
            jobs.append((dest, rows, shard_metadata_for(layer_ids=layer_ids, source=shard.name, digest=digest,
                                                        dtype=dtype, hidden=contract.hidden_size, samples=len(rows),
                                                        autocast="none")))
        with engine_source(cfg, contract, out_dir, last_hidden=keep_last) as src:
            for dest, n in capture_shards(src, jobs, out_dir / "engine-spool", write_shard,
                                          concurrency=cfg.capture.concurrency, dtype=dtype, width=width,
                                          hidden=contract.hidden_size, last_hidden=keep_last):
                log.info("captured %s through vLLM: %d tokens", dest.name, n)
                result["written"] += 1
    elif todo:
        from dflashkit.model.target import load_target
        from dflashkit.model.drafter_config import REPROBE_HINT

        target = load_target(cfg.target)
        contract.check(target, where=str(rd.contract_path), hint=REPROBE_HINT)
        pad = (target.tokenizer.pad_token_id if target.tokenizer is not None else 0) or 0
        if autocast is not None:
            log.info("capture: target forward under %s autocast (train.target_dtype=%s)", autocast,
                     cfg.train.target_dtype)
        bar = Progress("capture", total=need // per_token, unit="tok")
        for si, shard, digest, dest in todo:
            rows = [torch.from_numpy(data.input_ids[i]) for i, (s, _) in enumerate(data.where) if s == si]
            meta = shard_metadata_for(layer_ids=layer_ids, source=shard.name, digest=digest, dtype=dtype,
                                      hidden=contract.hidden_size, samples=len(rows), autocast=str(autocast or "none"))
            batches = bar.track(local_batches(target, rows, layer_ids, batch_size=cfg.capture.batch_size,
                                              pad_id=pad, last_hidden=keep_last, autocast=autocast),
                                size=lambda batch: sum(len(r[2]) for r in batch))
            n = write_shard(dest, [len(r) for r in rows], batches, dtype=dtype, metadata=meta, width=width,
                            hidden=contract.hidden_size, last_hidden=keep_last)
            log.info("captured %s: %d samples, %d tokens", dest.name, len(rows), n)
            result["written"] += 1
        bar.close()
    write_manifest(out_dir, stage="capture", config_hash=stage_hash("capture", cfg, layer_ids, keep_last),
                   inputs={"contract": section_hash(read_json(rd.contract_path)),
                           "tokenize": (rd.manifest("tokenize") or {}).get("config_hash")},
                   counts={"shards": len(data.shards), "tokens": tokens}, started=t0,
                   outputs=[f"{s.stem}.safetensors" for s in data.shards])
    return result
