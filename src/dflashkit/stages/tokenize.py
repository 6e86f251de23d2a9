"""`dflashkit tokenize`: render conversations with the target's chat template → ids + loss masks.

Inputs:  `generate/conversations.jsonl` (or `prepare/train.jsonl` with tokenize.source=prepare),
         the target tokenizer (`target.path` / `target.tokenizer`; the model is not loaded) and its
         chat template (`target.chat_template` overrides), `contract.json` if present (block size).
Outputs: `tokenize/shard-XXXXX.parquet` (id, input_ids list<int32>, loss_mask list<int8>),
         `tokenize/stats.json` (per-shard samples/tokens/supervised, the same per source and per
         thinking mode, drop reasons, template events, server-token checks, prompt checks,
         teacher-forced agreement), manifest.
Example: dflashkit tokenize -c run.yaml tokenize.thinking=mask tokenize.max_length=4096

Drift checks (`dflashkit.data.drift`, `dflashkit.data.agreement`): the server's prompt per turn
(usage.prompt_tokens / prompt ids, recorded by generate) vs the prompt rendered here, failing
above `tokenize.max_prompt_mismatch`; then `tokenize.agreement_samples` samples per source go
through the target (`target.path`, loaded here) and a greedily regenerated source whose labels
agree with the target's argmax less than `tokenize.min_agreement` fails the run (exit 2).

Masks come from the template itself with the source's variables (`dflashkit.data.chat`). Samples with fewer than `tokenize.min_supervised` supervised tokens
(default 2·block_size) are dropped; a dataset whose masks are all zero or all one is refused (exit 2),
and so are agent conversations (tools, tool calls) when the chat template does not render tools,
before anything is tokenized (`--dry-run` too).
Shards are staged and moved into place only after the whole dataset passed, so a failing run leaves
the previous shards untouched. The pass itself is `dflashkit.data.tokenizing`.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from dflashkit.config import RunConfig
from dflashkit.context import StageContext
from dflashkit.data.agreement import agreement_lines
from dflashkit.data.chat import load_chat
from dflashkit.data.drift import answer_line, prompt_line, refuse_drift
from dflashkit.data.tokenizing import (generate_manifest, input_paths, log_warnings, min_supervised, publish_shards,
                                       refuse_degenerate, refuse_empty, refuse_unrendered_tools, teacher_forced,
                                       tokenize_shards, tokenize_stats)
from dflashkit.generate.conversations import regenerated_file
from dflashkit.rundir import RunDir, atomic_write_json, file_digest, write_manifest
from dflashkit.stage_table import stage_hash

log = logging.getLogger("dflashkit.tokenize")


def run(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict[str, Any]:
    t0 = time.time()
    tc = cfg.tokenize
    paths = input_paths(cfg, rd, regenerated_file)
    src = paths[0][0]
    chat = load_chat(cfg)
    refuse_unrendered_tools(chat, paths)
    need = min_supervised(cfg, rd)
    if ctx.dry_run:
        return {"dry_run": True, "input": str(src), "inputs": [str(p) for p, _ in paths], "min_supervised": need}
    created = not (rd.tokenize_dir).exists()
    out = rd.stage_dir("tokenize")
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=out))
    try:
        tok = tokenize_shards(cfg, chat, paths, need, staging)
        totals = tok.totals
        if tok.conversations == 0:
            refuse_empty(rd, [p for p, _ in paths], rd.generate_failures)
        refuse_degenerate(totals, src, need, tok.first_error and f"{chat.origin}: {tok.first_error}",
                          tok.events["truncated"], tc.max_length)
        elapsed = time.time() - t0
        agreement = teacher_forced(cfg, rd, tok.pick)
        refuse_drift(tok.prompts, agreement, max_prompt_mismatch=tc.max_prompt_mismatch,
                     min_agreement=tc.min_agreement)
        publish_shards(staging, out, tok.shards)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if created and not any(out.iterdir()):  # a failed first run leaves no empty tokenize/ behind
            out.rmdir()
    log_warnings(tok)
    checks, prompts, shards = tok.checks, tok.prompts, tok.shards
    stats = tokenize_stats(cfg, paths, need, tok, agreement, elapsed)
    atomic_write_json(out / "stats.json", stats)
    write_manifest(out, stage="tokenize",
                   config_hash=stage_hash("tokenize", cfg),
                   inputs={"conversations": {"path": str(src), "digest": file_digest(src)},
                           **{f"conversations{i}": {"path": str(p), "digest": file_digest(p)}
                              for i, (p, _) in enumerate(paths[1:], 1)}},
                   counts={**totals, **stats["dropped"]}, outputs=[s["file"] for s in shards] + ["stats.json"],
                   started=t0)
    lines = [answer_line(checks["server_turns"], checks["server_mismatches"], checks["server_turns_without_ids"],
                         generate_manifest(cfg, rd).get("request_token_ids")),
             prompt_line(prompts), *agreement_lines(agreement)]
    for line in lines:
        log.info("%s", line)
    if not ctx.json:
        print(f"{tok.conversations} conversations → {totals['samples']} samples in {len(shards)} shards, "
              f"{totals['tokens']} tokens ({totals['supervised']} supervised, "
              f"{stats['supervised_fraction']:.1%}); dropped {stats['dropped']}\n" + "\n".join(lines))
    return {k: stats[k] for k in ("conversations", "samples", "tokens", "supervised", "dropped",
                                   "supervised_fraction", "tokens_per_s", "by_mode")} | {
        "shards": len(shards), "server_mismatches": checks["server_mismatches"],
        "server_turns": checks["server_turns"], "prompt_mismatches": prompts["mismatches"],
        "prompt_checked": prompts["checked"],
        "agreement": {k: v["agreement"] for k, v in agreement.get("sources", {}).items()}}
