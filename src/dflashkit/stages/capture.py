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
Shards are written through a temp file + rename and streamed (never held in memory whole); a
complete shard whose layer ids and source digest still match is skipped, so a killed run resumes.
`dflashkit train train.features=cached` refuses shards captured at other layer ids.

`capture.engine: vllm` (`engines/capture.py`): the features come from vLLM's `extract_hidden_states`
(started here with dflashkit's CPU-safe connector, or `capture.server_url`; `--dry-run` prints the
`vllm serve` flags), one request per sample, its ids checked; labels and `last_hidden` from the
target's final norm + LM head only. Rows are spooled per sample (`capture/engine-spool/`, atomic), so
a killed run re-requests only what it lost, and the shard is written by the same `write_shard`.
"""

from __future__ import annotations

import json
import logging
import shlex
import shutil
import struct
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from dflashkit.config import RunConfig, section_hash
from dflashkit.context import StageContext
from dflashkit.errors import UsageError
from dflashkit.rundir import RunDir, atomic_path, file_digest, read_json, write_manifest
from dflashkit.stage_table import stage_hash

log = logging.getLogger("dflashkit.capture")

ST_DTYPES = {"bfloat16": ("BF16", 2), "float16": ("F16", 2), "float32": ("F32", 4)}


def _existing_ok(path: Path, layer_ids: list[int], digest: str, dtype: str, last_hidden: bool,
                 autocast: str, engine: str = "local") -> bool:
    if not path.is_file():
        return False
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
    except Exception:  # noqa: BLE001 - a torn file is simply recomputed
        return False
    return (json.loads(meta.get("target_layer_ids", "null")) == list(layer_ids)
            and meta.get("source_digest") == digest and meta.get("dtype") == dtype
            and meta.get("next_ids") == "1" and (meta.get("last_hidden") == "1" or not last_hidden)
            and meta.get("target_autocast", "none") == autocast and meta.get("engine", "local") == engine)


def local_batches(target, rows: list[torch.Tensor], layer_ids: list[int], *, batch_size: int, pad_id: int,
                  last_hidden: bool, autocast: torch.dtype | None = None) -> Iterator[list[tuple]]:
    """The target in this process: samples in batches of similar length (sorted, so padding costs little);
    yields [(row index, features [n, W], next_ids [n], last_hidden [n, H] | None)] per batch."""
    lens = [len(r) for r in rows]
    order = sorted(range(len(rows)), key=lambda i: lens[i])
    for k in range(0, len(order), batch_size):
        part = order[k:k + batch_size]
        s = max(lens[i] for i in part)
        ids = torch.full((len(part), s), pad_id, dtype=torch.long)
        att = torch.zeros((len(part), s), dtype=torch.long)
        for j, i in enumerate(part):
            ids[j, :lens[i]], att[j, :lens[i]] = rows[i], 1
        with torch.no_grad(), torch.autocast(target.device.type, dtype=autocast, enabled=autocast is not None):
            feats, last = target.features(ids.to(target.device), layer_ids=layer_ids, need_last_hidden=True,
                                          attention_mask=att.to(target.device))
            nxt = target.next_token_ids(last)
        yield [(i, feats[j, :lens[i]], nxt[j, :lens[i]], last[j, :lens[i]] if last_hidden else None)
               for j, i in enumerate(part)]


def write_shard(path: Path, lens: list[int], batches: Iterable[list[tuple]], *, dtype: str, metadata: dict[str, str],
                width: int, hidden: int, last_hidden: bool = False) -> int:
    """Write one safetensors file: header, offsets, features, next_ids, last_hidden.

    `batches` yields [(row index, features [n, W], next_ids [n], last_hidden [n, H] | None)] in any
    order (`local_batches`: the target here; `engines/capture.py`: a serving engine's rows); each row is
    written at its own offset, so the file keeps tokenized-shard order. `next_ids` (small) is held in
    memory; `last_hidden` goes to a side file and is appended."""
    import tempfile

    st_name, nbytes = ST_DTYPES[dtype]
    offsets = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0)
    total = int(offsets[-1])
    off_bytes = offsets.numpy().tobytes()
    f_end = len(off_bytes) + total * width * nbytes
    header = {"offsets": {"dtype": "I64", "shape": [len(lens) + 1], "data_offsets": [0, len(off_bytes)]},
              "features": {"dtype": st_name, "shape": [total, width], "data_offsets": [len(off_bytes), f_end]},
              "next_ids": {"dtype": "I32", "shape": [total], "data_offsets": [f_end, f_end + 4 * total]}}
    if last_hidden:
        header["last_hidden"] = {"dtype": st_name, "shape": [total, hidden],
                                 "data_offsets": [f_end + 4 * total, f_end + 4 * total + total * hidden * nbytes]}
    header["__metadata__"] = {**metadata, "next_ids": "1", "last_hidden": "1" if last_hidden else "0"}
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    tdtype = getattr(torch, dtype)
    base = 8 + len(hb) + len(off_bytes)                      # where `features` starts in the file
    next_ids = np.zeros(total, dtype=np.int32)
    side = tempfile.TemporaryFile(dir=path.parent) if last_hidden else None
    seen = 0
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        fh.write(struct.pack("<Q", len(hb)) + hb + off_bytes)
        fh.truncate(base + total * width * nbytes)
        for batch in batches:
            for i, feats, nxt, last in batch:
                a, n = int(offsets[i]), lens[i]
                assert feats.shape == (n, width), (feats.shape, n, width)
                fh.seek(base + a * width * nbytes)
                fh.write(feats.to(tdtype).contiguous().cpu().view(torch.uint8).numpy().tobytes())
                next_ids[a:a + n] = nxt.cpu().numpy()
                if side is not None:
                    side.seek(a * hidden * nbytes)
                    side.write(last.to(tdtype).contiguous().cpu().view(torch.uint8).numpy().tobytes())
                seen += 1
        if seen != len(lens):
            raise RuntimeError(f"{path}: {seen} of {len(lens)} rows were produced")  # nothing is renamed
        fh.seek(base + total * width * nbytes)
        fh.write(next_ids.tobytes())
        if side is not None:
            side.seek(0)
            shutil.copyfileobj(side, fh, 1 << 24)
            side.close()
    return total


def run(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict:
    from dflashkit.model.drafter_config import DrafterContract
    from dflashkit.train.data import load_tokenized

    t0 = time.time()
    contract = DrafterContract.load(rd.contract_path)
    data = load_tokenized(rd)
    out_dir = rd.stage_dir("capture", create=not ctx.dry_run)  # a dry run creates nothing
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
        dest = out_dir / f"{shard.stem}.safetensors"
        if not _existing_ok(dest, layer_ids, digest, dtype, keep_last, str(autocast or "none"), engine):
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
            jobs.append((dest, rows, {"target_layer_ids": json.dumps(layer_ids), "source": shard.name,
                                      "source_digest": digest, "dtype": dtype, "hidden_size": str(contract.hidden_size),
                                      "samples": str(len(rows)), "target_autocast": "none"}))
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
        for si, shard, digest, dest in todo:
            rows = [torch.from_numpy(data.input_ids[i]) for i, (s, _) in enumerate(data.where) if s == si]
            meta = {"target_layer_ids": json.dumps(layer_ids), "source": shard.name, "source_digest": digest,
                    "dtype": dtype, "hidden_size": str(contract.hidden_size), "samples": str(len(rows)),
                    "target_autocast": str(autocast or "none")}
            batches = local_batches(target, rows, layer_ids, batch_size=cfg.capture.batch_size, pad_id=pad,
                                    last_hidden=keep_last, autocast=autocast)
            n = write_shard(dest, [len(r) for r in rows], batches, dtype=dtype, metadata=meta, width=width,
                            hidden=contract.hidden_size, last_hidden=keep_last)
            log.info("captured %s: %d samples, %d tokens", dest.name, len(rows), n)
            result["written"] += 1
    write_manifest(out_dir, stage="capture", config_hash=stage_hash("capture", cfg, layer_ids, keep_last),
                   inputs={"contract": section_hash(read_json(rd.contract_path)),
                           "tokenize": (rd.manifest("tokenize") or {}).get("config_hash")},
                   counts={"shards": len(data.shards), "tokens": tokens}, started=t0,
                   outputs=[f"{s.stem}.safetensors" for s in data.shards])
    return result
