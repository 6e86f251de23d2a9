"""`dflashkit tokenize`: render conversations with the target's chat template → ids + loss masks.

Inputs:  `generate/conversations.jsonl` (or `prepare/train.jsonl` with tokenize.source=prepare),
         the target tokenizer (`target.path` / `target.tokenizer`; the model is not loaded) and its
         chat template (`target.chat_template` overrides), `contract.json` if present (block size).
Outputs: `tokenize/shard-XXXXX.parquet` (id, input_ids list<int32>, loss_mask list<int8>),
         `tokenize/stats.json` (per-shard samples/tokens/supervised, drop reasons, template
         events, server-token checks, prompt checks, teacher-forced agreement), manifest.
Example: dflashkit tokenize -c run.yaml tokenize.thinking=mask tokenize.max_length=4096

Drift checks (`dflashkit.data.drift`, `dflashkit.data.agreement`): the server's prompt per turn
(usage.prompt_tokens / prompt ids, recorded by generate) vs the prompt rendered here, failing
above `tokenize.max_prompt_mismatch`; then `tokenize.agreement_samples` samples per source go
through the target (`target.path`, loaded here) and a greedily regenerated source whose labels
agree with the target's argmax less than `tokenize.min_agreement` fails the run (exit 2).

Masks come from the template itself (see `dflashkit.data.chat`). Samples with fewer than
`tokenize.min_supervised` supervised tokens (default 2·block_size) are dropped; a dataset whose
masks are all zero or all one is refused (exit 2). Shards are staged and moved into place only
after the whole dataset passed, so a failing run leaves the previous shards untouched.
"""

from __future__ import annotations

import json
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
from dflashkit.data.agreement import Reservoir, agreement_lines, check_sources
from dflashkit.data.chat import ChatTemplate, load_chat, tokenize_batch
from dflashkit.data.drift import answer_line, merge_checks, new_checks, prompt_line, refuse_drift
from dflashkit.data.mixing import needs_regeneration, original_answer_sources
from dflashkit.data.records import Conversation, read_jsonl
from dflashkit.data.shards import SHARD_GLOB, shard_name, write_parquet_shard
from dflashkit.errors import MissingArtifactError, UsageError
from dflashkit.progress import Progress
from dflashkit.rundir import RunDir, atomic_write_json, file_digest, write_manifest

log = logging.getLogger("dflashkit.tokenize")

DROPS = ("no_assistant_turn", "no_aligned_turn", "template_error", "too_few_supervised")


def input_paths(cfg: Any, rd: RunDir) -> list[tuple[Path, set[str] | None]]:
    """The conversation files to tokenize, each with the source names to keep from it (None = all).

    `tokenize.source=prepare`: prepare's own answers for every source. Else the regenerated answers
    (`generate/conversations.jsonl`) plus, from `prepare/train.jsonl`, the sources configured with
    `answers: original` (raw text trained on as it is). MissingArtifactError (exit 3) names the stage
    to run."""
    prepared = rd.prepared_train
    if cfg.tokenize.source == "prepare":
        if not prepared.is_file():
            raise MissingArtifactError("prepared conversations", prepared, run="dflashkit prepare -c run.yaml")
        return [(prepared, None)]
    out: list[tuple[Path, set[str] | None]] = []
    if needs_regeneration(cfg):
        p = rd.conversations_path
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


def min_supervised(cfg: Any, rd: RunDir) -> int:
    if cfg.tokenize.min_supervised is not None:
        return cfg.tokenize.min_supervised
    if rd.contract_path.is_file():
        from dflashkit.model.drafter_config import DrafterContract

        return 2 * DrafterContract.load(rd.contract_path).block_size
    return 2 * cfg.drafter.block_size


def _lines(path: Path) -> int:
    """Non-empty lines of a JSONL file (the progress total; cheap next to tokenizing them)."""
    with open(path, "rb") as fh:
        return sum(1 for line in fh if line.strip())


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
    paths = input_paths(cfg, rd)
    src = paths[0][0]
    chat = load_chat(cfg)
    need = min_supervised(cfg, rd)
    if ctx.dry_run:
        return {"dry_run": True, "input": str(src), "inputs": [str(p) for p, _ in paths], "min_supervised": need}
    created = not (rd.tokenize_dir).exists()
    out = rd.stage_dir("tokenize")
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=out))
    events: Counter[str] = Counter()
    checks: dict[str, Any] = {"server_turns": 0, "server_mismatches": 0, "first_mismatch": None,
                              "server_turns_without_ids": 0}
    prompts = new_checks()
    pick = Reservoir(tc.agreement_samples, seed=cfg.run.seed)
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

    bar = Progress("tokenize", total=sum(len(keep) if keep is not None else _lines(p) for p, keep in paths),
                   unit="conv")
    try:
        for samples, ev, c, err in _results(chat, _batches(paths, tc.batch_size), tc):
            first_error = first_error or err
            conversations += ev["conversations"]
            bar.update(ev.pop("conversations"))
            events.update(ev)
            checks["server_turns"] += c["server_turns"]
            checks["server_mismatches"] += c["server_mismatches"]
            checks["first_mismatch"] = checks["first_mismatch"] or c["first_mismatch"]
            checks["server_turns_without_ids"] += c["server_turns_without_ids"]
            merge_checks(prompts, c["prompt"])
            for s in samples:
                if int(s.loss_mask.sum()) < need:
                    events["too_few_supervised"] += 1
                    continue
                pending.append({"id": s.id, "input_ids": s.input_ids, "loss_mask": s.loss_mask, "source": s.source})
                if tc.agreement_samples:
                    pick.offer((s.source, s.regenerated), (s.input_ids, s.loss_mask))
                n_sup = int(s.loss_mask.sum())
                by_source.setdefault(s.source, {"samples": 0, "tokens": 0, "supervised": 0})
                by_source[s.source]["samples"] += 1
                by_source[s.source]["tokens"] += len(s.input_ids)
                by_source[s.source]["supervised"] += n_sup
            flush(False)
        flush(True)
        bar.close()
        totals = {k: sum(s[k] for s in shards) for k in ("samples", "tokens", "supervised")}
        if conversations == 0:
            _refuse_empty(rd, [p for p, _ in paths])
        _refuse_degenerate(totals, src, need, first_error and f"{chat.origin}: {first_error}", events["truncated"],
                           tc.max_length)
        elapsed = time.time() - t0
        agreement = teacher_forced(cfg, rd, pick)
        refuse_drift(prompts, agreement, max_prompt_mismatch=tc.max_prompt_mismatch,
                     min_agreement=tc.min_agreement)
        for sh in shards:
            os.replace(staging / sh["file"], out / sh["file"])
        keep = {sh["file"] for sh in shards}
        for stale in out.glob(SHARD_GLOB):
            if stale.name not in keep:
                stale.unlink()
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        if created and not any(out.iterdir()):  # a failed first run leaves no empty tokenize/ behind
            out.rmdir()
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
             "server_token_check": checks, "prompt_check": prompts, "teacher_forced": agreement,
             "shards": shards,
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
    lines = [answer_line(checks["server_turns"], checks["server_mismatches"], checks["server_turns_without_ids"],
                         _generate_manifest(cfg, rd).get("request_token_ids")),
             prompt_line(prompts), *agreement_lines(agreement)]
    for line in lines:
        log.info("%s", line)
    if not ctx.json:
        print(f"{conversations} conversations → {totals['samples']} samples in {len(shards)} shards, "
              f"{totals['tokens']} tokens ({totals['supervised']} supervised, "
              f"{stats['supervised_fraction']:.1%}); dropped {stats['dropped']}\n" + "\n".join(lines))
    return {k: stats[k] for k in ("conversations", "samples", "tokens", "supervised", "dropped",
                                   "supervised_fraction", "tokens_per_s")} | {
        "shards": len(shards), "server_mismatches": checks["server_mismatches"],
        "server_turns": checks["server_turns"], "prompt_mismatches": prompts["mismatches"],
        "prompt_checked": prompts["checked"],
        "agreement": {k: v["agreement"] for k, v in agreement.get("sources", {}).items()}}


def _generate_manifest(cfg: Any, rd: RunDir) -> dict[str, Any]:
    p = rd.manifest_path("generate")
    if cfg.tokenize.source != "generate" or not p.is_file():
        return {}
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return {}


def teacher_forced(cfg: Any, rd: RunDir, pick: Reservoir) -> dict[str, Any]:
    """The teacher-forced check on the sampled sequences (`tokenize.agreement_samples` per source)."""
    if not cfg.tokenize.agreement_samples:
        return {"status": "off"}
    if not cfg.target.path:
        return {"status": "skipped", "detail": "target.path is not set (the check runs the target)"}
    temperature = (_generate_manifest(cfg, rd).get("sampling") or {}).get("temperature", cfg.generate.temperature)
    return check_sources(cfg.target, pick, temperature=temperature, min_agreement=cfg.tokenize.min_agreement)




_CHAT: ChatTemplate | None = None  # the template a forked worker inherits from the parent


def _work(batch: list[Conversation], tc: Any, chat: ChatTemplate | None = None) -> tuple:
    chat = chat or _CHAT
    assert chat is not None
    samples, events, checks = tokenize_batch(chat, batch, max_length=tc.max_length, thinking=tc.thinking,
                                             system_prompt=tc.system_prompt,
                                             rewritten_turns=tc.rewritten_turns)
    events["conversations"] = len(batch)
    return samples, events, checks, chat.first_error


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


def _refuse_empty(rd: RunDir, paths: list[Path]) -> None:
    """No conversation to tokenize: say where they should have come from (not the chat template)."""
    counts = (rd.manifest("generate") or {}).get("counts") or {}
    failed = counts.get("turns_failed") or 0
    why = (f": `generate` wrote none ({failed} of {counts.get('turns_total')} turns failed; see "
           f"{rd.generate_dir / 'failures.jsonl'})" if failed else "")
    raise UsageError(f"{', '.join(map(str, paths))}: no conversations to tokenize{why}",
                     hint="re-run `dflashkit generate -c run.yaml` (it retries the failed turns)" if failed
                     else "check data.sources and re-run `dflashkit prepare -c run.yaml` / `dflashkit generate`")


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
