"""`dflashkit tokenize`: render conversations with the target's chat template → ids + loss masks.

Inputs:  `generate/conversations.jsonl` (or `prepare/train.jsonl` with tokenize.source=prepare),
         the target tokenizer (`target.path` / `target.tokenizer`; the model is not loaded) and its
         chat template (`target.chat_template` overrides), `contract.json` if present (block size).
Outputs: `tokenize/shard-XXXXX.parquet` (id, input_ids list<int32>, loss_mask list<int8>),
         `tokenize/stats.json` (per-shard samples/tokens/supervised, drop reasons, template
         events, server-token checks), manifest.
Example: dflashkit tokenize -c run.yaml tokenize.thinking=mask tokenize.max_length=4096

Masks come from the template itself (see `dflashkit.data.chat`). Samples with fewer than
`tokenize.min_supervised` supervised tokens (default 2·block_size) are dropped; a dataset whose
masks are all zero or all one is refused (exit 2). Shards are staged and moved into place only
after the whole dataset passed, so a failing run leaves the previous shards untouched.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from collections import Counter
from functools import partial
from itertools import islice
from pathlib import Path
from typing import Any, Iterator

from dflashkit.config import RunConfig, section_hash
from dflashkit.context import StageContext
from dflashkit.data.chat import ChatTemplate, tokenize_batch
from dflashkit.data.mixing import needs_regeneration, original_answer_sources
from dflashkit.data.records import Conversation, read_jsonl
from dflashkit.data.shards import SHARD_GLOB, shard_name, write_parquet_shard
from dflashkit.errors import ConfigError, MissingArtifactError, UsageError
from dflashkit.rundir import RunDir, atomic_write_json, file_digest, write_manifest

log = logging.getLogger("dflashkit.tokenize")

DROPS = ("no_assistant_turn", "no_aligned_turn", "template_error", "too_few_supervised")


def input_paths(cfg: Any, rd: RunDir) -> list[tuple[Path, set[str] | None]]:
    """The conversation files to tokenize, each with the source names to keep from it (None = all).

    `tokenize.source=prepare`: prepare's own answers for every source. Else the regenerated answers
    (`generate/conversations.jsonl`) plus, from `prepare/train.jsonl`, the sources configured with
    `answers: original` (raw text trained on as it is). MissingArtifactError (exit 3) names the stage
    to run."""
    prepared = rd.root / "prepare" / "train.jsonl"
    if cfg.tokenize.source == "prepare":
        if not prepared.is_file():
            raise MissingArtifactError("prepared conversations", prepared, run="dflashkit prepare -c run.yaml")
        return [(prepared, None)]
    out: list[tuple[Path, set[str] | None]] = []
    if needs_regeneration(cfg):
        p = rd.root / "generate" / "conversations.jsonl"
        if not p.is_file():
            raise MissingArtifactError("generated conversations (or set tokenize.source=prepare to train on "
                                       "the dataset's own answers)", p, run="dflashkit generate -c run.yaml")
        out.append((p, None))
    original = original_answer_sources(cfg.data.sources)
    if original:
        if not prepared.is_file():
            raise MissingArtifactError("prepared conversations", prepared, run="dflashkit prepare -c run.yaml")
        out.append((prepared, original))
    return out


def load_chat(cfg: Any) -> ChatTemplate:
    """The target tokenizer (no model) and its chat template or the `target.chat_template` file."""
    from dflashkit.model.target import load_tokenizer, resolve_target_path

    t = cfg.target
    if t.tokenizer:
        model_dir, gguf = Path(t.tokenizer), None
    else:
        model_dir, gguf = resolve_target_path(t.path, t.gguf_file)
    tok = load_tokenizer(model_dir, gguf_file=gguf, trust_remote_code=t.trust_remote_code,
                         tokenizer_dir=t.tokenizer)
    template = None
    if t.chat_template:
        p = Path(t.chat_template).expanduser()
        if not p.is_file():
            raise ConfigError(f"target.chat_template: file not found: {p}")
        template = p.read_text()
    return ChatTemplate(tok, template, cfg.tokenize.chat_template_kwargs)


def min_supervised(cfg: Any, rd: RunDir) -> int:
    if cfg.tokenize.min_supervised is not None:
        return cfg.tokenize.min_supervised
    if rd.contract_path.is_file():
        from dflashkit.model.drafter_config import DrafterContract

        return 2 * DrafterContract.load(rd.contract_path).block_size
    return 2 * cfg.drafter.block_size


def _batches(paths: list[tuple[Path, set[str] | None]], size: int) -> Iterator[list[Conversation]]:
    batch: list[Conversation] = []
    for path, keep in paths:
        for line_no, obj in read_jsonl(path, on_malformed="fail"):
            conv = Conversation.from_dict(obj, f"{path}:{line_no}")
            if keep is not None and conv.source not in keep:
                continue
            batch.append(conv)
            if len(batch) >= size:
                yield batch
                batch = []
    if batch:
        yield batch


def run(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict[str, Any]:
    t0 = time.time()
    tc = cfg.tokenize
    if tc.shard_size < 1 or tc.batch_size < 1:
        raise ConfigError("tokenize.shard_size and tokenize.batch_size must be >= 1")
    paths = input_paths(cfg, rd)
    src = paths[0][0]
    chat = load_chat(cfg)
    need = min_supervised(cfg, rd)
    if ctx.dry_run:
        return {"dry_run": True, "input": str(src), "inputs": [str(p) for p, _ in paths], "min_supervised": need}
    out = rd.stage_dir("tokenize")
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=out))
    events: Counter[str] = Counter()
    checks: dict[str, Any] = {"server_turns": 0, "server_mismatches": 0, "first_mismatch": None}
    shards: list[dict[str, Any]] = []
    pending: list[dict[str, Any]] = []
    conversations = 0
    first_error: str | None = None
    by_source: dict[str, dict[str, int]] = {}

    def flush(force: bool) -> None:
        while pending and (force or len(pending) >= tc.shard_size):
            name = shard_name(len(shards))
            part = pending[:tc.shard_size]
            del pending[:tc.shard_size]
            shards.append({"file": name, **write_parquet_shard(staging / name, part)})

    try:
        for samples, ev, c, err, sources in _results(chat, _batches(paths, tc.batch_size), tc):
            first_error = first_error or err
            conversations += ev.pop("conversations")
            events.update(ev)
            checks["server_turns"] += c["server_turns"]
            checks["server_mismatches"] += c["server_mismatches"]
            checks["first_mismatch"] = checks["first_mismatch"] or c["first_mismatch"]
            for s, source in zip(samples, sources):
                if int(s.loss_mask.sum()) < need:
                    events["too_few_supervised"] += 1
                    continue
                pending.append({"id": s.id, "input_ids": s.input_ids, "loss_mask": s.loss_mask, "source": source})
                n_sup = int(s.loss_mask.sum())
                by_source.setdefault(source, {"samples": 0, "tokens": 0, "supervised": 0})
                by_source[source]["samples"] += 1
                by_source[source]["tokens"] += len(s.input_ids)
                by_source[source]["supervised"] += n_sup
            flush(False)
        flush(True)
        totals = {k: sum(s[k] for s in shards) for k in ("samples", "tokens", "supervised")}
        _refuse_degenerate(totals, src, need, first_error, events["truncated"], tc.max_length)
        for sh in shards:
            os.replace(staging / sh["file"], out / sh["file"])
        keep = {sh["file"] for sh in shards}
        for stale in out.glob(SHARD_GLOB):
            if stale.name not in keep:
                stale.unlink()
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    elapsed = time.time() - t0
    if first_error:
        log.warning("%d conversations skipped: the chat template raised (first: %s)",
                    events["template_errors"], first_error)
    if checks["server_mismatches"]:
        log.warning("%d of %d answers differ from the server's token ids (first: %s); the server's "
                    "ids were used", checks["server_mismatches"], checks["server_turns"],
                    checks["first_mismatch"])
    stats = {"input": str(src), "inputs": [str(p) for p, _ in paths], "conversations": conversations, **totals,
             "by_source": dict(sorted(by_source.items())),
             "supervised_fraction": round(totals["supervised"] / max(totals["tokens"], 1), 4),
             "dropped": {k: events[k] for k in DROPS},
             "events": {k: v for k, v in sorted(events.items()) if k not in DROPS},
             "server_token_check": checks, "shards": shards,
             "settings": {"max_length": tc.max_length, "min_supervised": need, "thinking": tc.thinking,
                          "system_prompt": tc.system_prompt, "chat_template_kwargs": tc.chat_template_kwargs,
                          "chat_template": cfg.target.chat_template or "tokenizer"},
             "tokens_per_s": round(totals["tokens"] / max(elapsed, 1e-9), 1)}
    atomic_write_json(out / "stats.json", stats)
    write_manifest(out, stage="tokenize",
                   config_hash=section_hash(tc, cfg.target.tokenizer, cfg.target.chat_template),
                   inputs={"conversations": {"path": str(src), "digest": file_digest(src)},
                           **{f"conversations{i}": {"path": str(p), "digest": file_digest(p)}
                              for i, (p, _) in enumerate(paths[1:], 1)}},
                   counts={**totals, **stats["dropped"]}, outputs=[s["file"] for s in shards] + ["stats.json"],
                   started=t0)
    if not ctx.json:
        print(f"{conversations} conversations → {totals['samples']} samples in {len(shards)} shards, "
              f"{totals['tokens']} tokens ({totals['supervised']} supervised, "
              f"{stats['supervised_fraction']:.1%}); dropped {stats['dropped']}; "
              f"server-token mismatches {checks['server_mismatches']}/{checks['server_turns']}")
    return {k: stats[k] for k in ("conversations", "samples", "tokens", "supervised", "dropped",
                                   "supervised_fraction", "tokens_per_s")} | {
        "shards": len(shards), "server_mismatches": checks["server_mismatches"]}


_CHAT: ChatTemplate | None = None  # the template a forked worker inherits from the parent


def _work(batch: list[Conversation], tc: Any, chat: ChatTemplate | None = None) -> tuple:
    chat = chat or _CHAT
    assert chat is not None
    samples, events, checks = tokenize_batch(chat, batch, max_length=tc.max_length, thinking=tc.thinking,
                                             system_prompt=tc.system_prompt,
                                             rewritten_turns=tc.rewritten_turns)
    events["conversations"] = len(batch)
    source_of = {c.id: c.source for c in batch}
    sources = [source_of.get(s.id, source_of.get(s.id.rsplit("-t", 1)[0], "")) for s in samples]
    return samples, events, checks, chat.first_error, sources


def _results(chat: ChatTemplate, batches: Iterator[list[Conversation]], tc: Any) -> Iterator[tuple]:
    """Batch results in input order: in this process, or in `tokenize.workers` forked processes."""
    workers = tc.workers or os.cpu_count() or 1
    if workers <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        for batch in batches:
            yield _work(batch, tc, chat)
        return
    global _CHAT
    _CHAT = chat
    try:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            while window := list(islice(batches, 4 * workers)):  # bounded read-ahead
                yield from pool.imap(partial(_work, tc=tc), window)
    finally:
        _CHAT = None


def _refuse_degenerate(totals: dict[str, int], src: Path, need: int, template_error: str | None,
                       truncated: int, max_length: int) -> None:
    if totals["samples"] == 0 or totals["supervised"] == 0:
        why = f" (first chat-template error: {template_error})" if template_error else ""
        if truncated:
            why += (f" ({truncated} samples were cut at tokenize.max_length={max_length}; their answers "
                    "start later: raise tokenize.max_length)")
        raise UsageError(f"{src}: no sample has >= {need} supervised (assistant) tokens; loss masks would "
                         f"be all zero{why}", hint="check the conversations have assistant answers, "
                         "tokenize.max_length, tokenize.min_supervised and target.chat_template")
    if totals["supervised"] == totals["tokens"]:
        raise UsageError(f"{src}: every token is supervised (loss masks all one): the chat template did "
                         "not separate prompts from answers", hint="set target.chat_template to the "
                         "target's real chat template")
