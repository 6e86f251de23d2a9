"""`dflashkit capture`: run the target over the tokenized shards and cache its features.

Inputs:  contract.json (probe), tokenize/shard-*.parquet (tokenize), the target (target.path).
Outputs: capture/shard-XXXXX.safetensors (one per tokenized shard), capture/manifest.json.
Example: dflashkit capture -c run.yaml capture.dtype=bfloat16

Each feature shard holds `features` [tokens, n_feat·H] (the target layers `target_layer_ids`,
concatenated), `next_ids` [tokens] (the target's greedy next token, what `train.labels=target`
learns), optionally `last_hidden` [tokens, H] (for `train.loss=kl|ce+kl`), `offsets` [samples+1] and
metadata (layer ids, source shard digest, dtype). The format, writer and reader are
`data/features.py`; the plan and the local capture are `data/capturing.py`.

Invariants: the target runs as online training runs it (`train.target_dtype`), so cached and online
training see the same features. The total size is logged before any work and the stage refuses
(exit 2) above capture.max_disk_fraction of the free disk. Shards are streamed and written atomically;
a complete shard whose layer ids and source digest match is skipped, so a killed run resumes.

With the local target, capture also writes the target's greedy path (`path_ids`, `model/path_labels.py`)
for the held-out samples, and for every sample with `train.on_path=rollout`; the manifest's
`counts.path_ids` records the extra target tokens decoded. `capture.engine: vllm` (`engines/capture.py`)
takes the features from vLLM's `extract_hidden_states` instead, one request per sample with its ids
checked, spooled per sample (`capture/engine-spool/`) so a killed run re-requests only what it lost.
"""

from __future__ import annotations

import logging
import shlex
import time
from functools import partial
from typing import Any

from dflashkit.config import RunConfig, redact_url, section_hash
from dflashkit.context import StageContext
from dflashkit.data.capturing import capture_local, plan_capture, shard_rows
from dflashkit.data.features import shard_metadata_for, write_shard
from dflashkit.engines.capture import (capture_shards, check_engine, drop_finished_spools, engine_facts, engine_source,
                                       engine_storage, serve_command_for)
from dflashkit.family.contract import REPROBE_HINT, DrafterContract
from dflashkit.target.quantized import check_local_target
from dflashkit.rundir import RunDir, read_json, remove_stale_temps, write_manifest
from dflashkit.sizing.roofline import log_capture_roofline
from dflashkit.stage_table import stage_hash
from dflashkit.train.data import load_tokenized
from dflashkit.train.levers import split_samples

log = logging.getLogger("dflashkit.capture")


def check(cfg: RunConfig, rd: RunDir) -> tuple[Any, Any, Any]:
    """Every refusal of capture before it computes a feature (the real run and --dry-run both call it):
    the contract and tokenized shards, the plan (layer ids, disk space), and the engine (the vLLM at
    capture.server_url answering, or vLLM installed to start one) or the target's config against the
    contract. Returns (contract, tokenized data, plan)."""
    contract = DrafterContract.load(rd.contract_path)
    data = load_tokenized(rd)
    t = cfg.train
    _, heldout = split_samples(data, heldout_samples=t.heldout_samples, heldout_sources=t.heldout_sources,
                               seed=cfg.run.seed)  # train's split: the held-out samples' greedy paths are captured
    plan = plan_capture(cfg, contract, data, rd.capture_dir, heldout=heldout)
    plan.refuse_if_too_big(cfg.capture.max_disk_fraction, rd.capture_dir)
    if plan.todo and plan.engine == "vllm":
        check_engine(cfg, contract, rd.capture_dir, what="capture.engine=vllm", layer_ids=plan.layer_ids)
    elif plan.todo or plan.patch:  # the local target computes the features, or the paths they lack
        contract.check(engine_facts(cfg)[1], where=str(rd.contract_path), hint=REPROBE_HINT)
        check_local_target(cfg.target)  # a quantization the local load cannot read: exit 2, the engine command
    return contract, data, plan


def run(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict:
    t0 = time.time()
    out_dir = rd.capture_dir
    contract, data, plan = check(cfg, rd)
    if not ctx.dry_run:  # a dry run creates nothing
        out_dir.mkdir(parents=True, exist_ok=True)
        # a shard's temp file from a killed capture: we hold the lock, so nobody writes it
        for p in remove_stale_temps(out_dir, "*.safetensors"):
            log.info("removed %s (left by an interrupted capture)", p)
    layer_ids, dtype, keep_last, todo = plan.layer_ids, plan.dtype, plan.keep_last, plan.todo
    msg = plan.message(len(data.shards))
    log.info("%s", msg)
    if not ctx.json:
        print(msg, flush=True)
    result: dict[str, Any] = {"shards": len(data.shards), "to_write": len(todo) + len(plan.patch), "written": 0,
                              "skipped": len(data.shards) - len(todo) - len(plan.patch), "tokens": plan.tokens,
                              "bytes_total": plan.tokens * plan.per_token, "bytes_written": plan.need, "dtype": dtype,
                              "target_layer_ids": layer_ids, "bytes_per_token": plan.per_token,
                              "last_hidden": keep_last}
    if plan.engine == "vllm":
        cmd = serve_command_for(cfg, layer_ids, engine_storage(out_dir))
        result["engine"] = {"server_url": cfg.capture.server_url and redact_url(cfg.capture.server_url),
                            "vllm_serve": shlex.join(cmd)}
        if ctx.dry_run and not ctx.json:
            print("capture.server_url mode: start vLLM with (GPU: vLLM's stock connector; a CPU build needs "
                  "dflashkit's, which capture.server_url=null starts for you):\n  " + shlex.join(cmd), flush=True)
    if ctx.dry_run:
        return {"dry_run": True, **result}
    if todo and plan.engine == "vllm":
        jobs = []
        for si, shard, digest, dest in todo:
            rows = shard_rows(data, si)
            jobs.append((dest, rows, shard_metadata_for(layer_ids=layer_ids, source=shard.name, digest=digest,
                                                        dtype=dtype, hidden=contract.hidden_size, samples=len(rows),
                                                        autocast="none")))
        with engine_source(cfg, contract, out_dir, last_hidden=keep_last, layer_ids=layer_ids) as src:
            for dest, n in capture_shards(src, jobs, out_dir, write_shard,
                                          concurrency=cfg.capture.concurrency, dtype=dtype, width=plan.width,
                                          hidden=contract.hidden_size, last_hidden=keep_last):
                log.info("captured %s through vLLM: %d tokens", dest.name, n)
                result["written"] += 1
    elif todo or plan.patch:
        for dest, samples, n in capture_local(cfg, contract, data, plan, where=str(rd.contract_path),
                                                  on_rate=partial(log_capture_roofline, plan=plan)):
            log.info("captured %s: %d samples, %d tokens", dest.name, samples, n)
            result["written"] += 1
        if plan.path_cost.tokens:
            log.info("%s", plan.path_message())
            if not ctx.json:
                print(plan.path_message(), flush=True)
    paths = {"depth": plan.path_depth, "rows": "all" if plan.recipe.rollout else "heldout",
             **plan.path_cost.as_dict()} if plan.path_depth else None
    before = ((rd.manifest("capture") or {}).get("counts") or {}).get("path_ids")
    if paths and not plan.path_cost.tokens and isinstance(before, dict) and \
            (before.get("depth"), before.get("rows")) == (paths["depth"], paths["rows"]):
        paths = before  # nothing computed now: the cost of the capture that computed them
    result["path_ids"] = paths

    if drop_finished_spools(out_dir):
        log.info("removed the engine spools of shards an interrupted run had already written")
    write_manifest(out_dir, stage="capture", config_hash=stage_hash("capture", cfg, layer_ids, keep_last),
                   inputs={"contract": section_hash(read_json(rd.contract_path)),
                           "tokenize": (rd.manifest("tokenize") or {}).get("config_hash")},
                   counts={"shards": len(data.shards), "tokens": plan.tokens, "path_ids": paths}, started=t0,
                   outputs=[f"{s.stem}.safetensors" for s in data.shards])
    return result
