"""`dflashkit prepare`: read, normalise, dedupe, filter, mix and split the prompt sources.

Inputs:  `data.sources[]` (files, HF datasets dirs or asset names; see `dflashkit.data.sources`).
Outputs: `prepare/train.jsonl`, `prepare/heldout.jsonl` (one conversation record per line),
         `prepare/stats.json` (counts per source and per drop reason, malformed records by what was wrong
         (`malformed_by`), records left out on purpose (`skipped`), truncated tails), manifest.
Example: dflashkit prepare -c run.yaml data.num_prompts=2000 data.heldout=32

The held-out split is taken first from the shuffled mix, so `data.num_prompts` counts both
splits. All outputs are written only after every source was read, each atomically: a failing
run leaves the previous outputs untouched, and the same config always gives identical files.
"""

from __future__ import annotations

import time
from typing import Any

from dflashkit.config import RunConfig
from dflashkit.context import StageContext
from dflashkit.data.mixing import REASONS, mix, none_survived, read_sources
from dflashkit.data.records import write_prepared
from dflashkit.data.sources import resolve_source_path
from dflashkit.errors import ConfigError, UsageError
from dflashkit.rundir import RunDir, atomic_write_json, file_digest, write_manifest
from dflashkit.stage_table import stage_hash


def _table(stats: dict[str, dict[str, Any]], result: dict[str, Any]) -> str:
    cols = ("source", "read", "kept", "train", "heldout", *REASONS)
    rows = [cols] + [(n, s["read"], s["kept"], s["train"], s["heldout"], *s["dropped"].values())
                     for n, s in stats.items()]
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(cols))]
    lines = ["  ".join(str(v).rjust(w) if i else str(v).ljust(w) for i, (v, w) in
                       enumerate(zip(r, widths))) for r in rows]
    for n, s in stats.items():
        for what, counts in (("malformed", s["malformed_by"]), ("skipped", s["skipped"])):
            if counts:
                lines.append(f"{n}: {what}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
        if s["truncated_tail"]:
            t = s["truncated_tail"]
            lines.append(f"{n}: truncated file: kept {t['complete_records']} complete records, dropped "
                         f"{t['bytes_dropped']} bytes from byte {t['byte_offset']}")
    lines.append(f"wrote {result['train']} train + {result['heldout']} held-out conversations")
    return "\n".join(lines)


def run(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict[str, Any]:
    t0 = time.time()
    d = cfg.data
    if not d.sources:
        raise ConfigError("data.sources: no sources configured",
                          hint="add e.g. `data: {sources: [{path: sharegpt}]}` to run.yaml")
    by_source, stats = read_sources(cfg)
    total = sum(len(v) for v in by_source.values())
    if total == 0:
        raise UsageError(none_survived(stats), hint="fix the records named, or data.sources[].format if it does "
                         "not match the files; prepare/stats.json is not written")
    picked = mix(by_source, {n: s["weight"] for n, s in stats.items()}, total=d.num_prompts,
                 seed=cfg.run.seed)
    heldout, train = picked[:d.heldout], picked[d.heldout:]
    if not train:
        raise ConfigError(f"data.heldout: {d.heldout} held-out conversations take all {len(picked)} selected "
                          "ones, leaving 0 for training (nothing written)",
                          hint=f"set data.heldout below {len(picked)} (e.g. data.heldout={len(picked) // 4}) or "
                          "add data")
    for name, s in stats.items():
        s["train"] = sum(c.source == name for c in train)
        s["heldout"] = sum(c.source == name for c in heldout)
    dropped = {r: sum(s["dropped"][r] for s in stats.values()) for r in REASONS}
    result = {"train": len(train), "heldout": len(heldout), "read": sum(s["read"] for s in stats.values()),
              "dropped": dropped,
              "sources": {n: {k: s[k] for k in ("read", "kept", "train", "heldout", "dropped", "malformed_by",
                                                "skipped")} for n, s in stats.items()},
              "truncated": {n: s["truncated_tail"] for n, s in stats.items() if s["truncated_tail"]}}
    if ctx.dry_run:
        return {**result, "dry_run": True}
    out = rd.stage_dir("prepare")
    written = write_prepared(rd, (c.to_dict() for c in train), (c.to_dict() for c in heldout))
    atomic_write_json(rd.prepare_stats, {"seed": cfg.run.seed, "num_prompts": d.num_prompts,
                                           **{k: result[k] for k in ("train", "heldout", "read", "dropped")},
                                           "sources": stats})
    inputs = {}
    for name, src in zip(stats, d.sources):
        p = resolve_source_path(src.path)
        inputs[name] = {"path": str(p), "digest": file_digest(p) if p.is_file() else None}
    by_kind = {f"{what}:{k}": sum(s[what].get(k, 0) for s in stats.values())
               for what in ("malformed_by", "skipped") for k in sorted({k for s in stats.values() for k in s[what]})}
    write_manifest(out, stage="prepare", config_hash=stage_hash("prepare", cfg), inputs=inputs,
                   counts={"train": len(train), "heldout": len(heldout), **dropped, **by_kind},
                   outputs=["train.jsonl", "heldout.jsonl", "stats.json"], started=t0)
    if not ctx.json:
        print(_table(stats, result))
    return {**result, "outputs": [str(p) for p in written]}
