"""Tokenizing conversations into shards: which files `tokenize` reads, the (forked) worker pool over
the chat template, the per-batch counters, the checks that refuse a degenerate dataset, and the
stats `tokenize/stats.json` holds (the stage writes it; the shard format is `data/shards.py`).

Usage:
    paths = input_paths(cfg, rd, regenerated_file)   # [(jsonl, sources to keep or None)]
    refuse_unrendered_tools(chat, paths)             # agent data + a template without tools: exit 2
    tok = tokenize_shards(cfg, chat, paths, min_supervised(cfg, rd), staging_dir)
    refuse_degenerate(tok.totals, ...); agreement = teacher_forced(cfg, rd, tok.pick)
    publish_shards(staging_dir, rd.tokenize_dir, tok.shards)
    stats = tokenize_stats(cfg, paths, need, tok, agreement, elapsed_s)

Each conversation is rendered with its source's template variables (`ChatTemplate.for_source`); the stats
count samples, tokens and supervised tokens per source (`by_source`) and per thinking mode (`by_mode`,
`data.chat.mode_of`).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from itertools import islice
from pathlib import Path
from typing import Any, Callable, Iterator

from dflashkit.data.agreement import Reservoir, check_sources
from dflashkit.data.chat import ChatTemplate, source_modes, source_template_kwargs, tokenize_batch
from dflashkit.data.drift import merge_checks, new_checks
from dflashkit.data.mixing import needs_regeneration, original_answer_sources
from dflashkit.data.records import Conversation, iter_conversations, prepared_file
from dflashkit.data.shards import SHARD_GLOB, shard_name, write_parquet_shard
from dflashkit.errors import UsageError
from dflashkit.family.contract import DrafterContract
from dflashkit.progress import Progress
from dflashkit.rundir import RunDir

log = logging.getLogger("dflashkit.tokenize")

DROPS = ("no_assistant_turn", "no_aligned_turn", "template_error", "too_few_supervised")


def input_paths(cfg: Any, rd: RunDir, regenerated: Callable[[RunDir], Path]) -> list[tuple[Path, set[str] | None]]:
    """The conversation files to tokenize, each with the source names to keep from it (None = all).

    `tokenize.source=prepare`: prepare's own answers for every source. Else the regenerated answers
    (`generate/conversations.jsonl`) plus, from `prepare/train.jsonl`, the sources configured with
    `answers: original` (raw text trained on as it is). MissingArtifactError (exit 3) names the stage
    to run. `regenerated` is the generated file's owner's path check (the stage hands in
    `generate.conversations.regenerated_file`: `generate/` ranks above `data/`)."""
    if cfg.tokenize.source == "prepare":
        return [(prepared_file(rd), None)]
    out: list[tuple[Path, set[str] | None]] = []
    if needs_regeneration(cfg):
        out.append((regenerated(rd), None))
    original = original_answer_sources(cfg.data.sources)
    if original:
        out.append((prepared_file(rd), original))
    return out


def min_supervised(cfg: Any, rd: RunDir) -> int:
    if cfg.tokenize.min_supervised is not None:
        return cfg.tokenize.min_supervised
    if rd.contract_path.is_file():
        return 2 * DrafterContract.load(rd.contract_path).block_size
    return 2 * cfg.drafter.block_size


AGENT_KEYS = (b'"tools"', b'"tool_calls"', b'"tool_call_id"')  # in a JSON string its quotes would be escaped


def first_agent_record(paths: list[tuple[Path, set[str] | None]]) -> tuple[str, dict[str, Any]] | None:
    """("file:line", record) of the first kept conversation with tools, tool calls or tool results, or None.
    Lines are parsed only where one of those keys appears in the raw text."""
    for path, keep in paths:
        with open(path, "rb") as fh:
            for line_no, raw in enumerate(fh, 1):
                if not any(k in raw for k in AGENT_KEYS):
                    continue
                try:
                    obj = json.loads(raw)
                except ValueError:
                    continue  # malformed: the pass itself names it
                if not isinstance(obj, dict) or (keep is not None and obj.get("source") not in keep):
                    continue
                msgs = obj["messages"] if isinstance(obj.get("messages"), list) else []
                if obj.get("tools") or any(isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool")
                                           for m in msgs):
                    return f"{path}:{line_no}", obj
    return None


def refuse_unrendered_tools(chat: ChatTemplate, paths: list[tuple[Path, set[str] | None]]) -> None:
    """Refuse (exit 2) agent conversations when the chat template cannot render tools: their renderings
    would lose the tool declarations, calls or results without a word (`ChatTemplate.tool_rendering_problem`)."""
    problem = chat.tool_rendering_problem()
    if problem is None:
        return
    first = first_agent_record(paths)
    if first is None:
        return
    where, obj = first
    source = obj.get("source") or "?"
    raise UsageError(f"{where}: conversation {obj.get('id')} of source {source!r} has tools or tool calls, but "
                     f"{chat.origin} does not render them ({problem}); tokenizing it would drop them from the "
                     "training data",
                     hint="set target.chat_template to a Jinja template that renders `tools` and `tool_calls` "
                     f"(the target's own, as its server applies it), or drop source {source!r} from data.sources "
                     "and re-run `dflashkit prepare`")


def _lines(path: Path) -> int:
    """Non-empty lines of a JSONL file (the progress total; cheap next to tokenizing them)."""
    with open(path, "rb") as fh:
        return sum(1 for line in fh if line.strip())


def _batches(paths: list[tuple[Path, set[str] | None]], size: int) -> Iterator[list[Conversation]]:
    batch: list[Conversation] = []
    for path, keep in paths:
        for conv in iter_conversations(path):
            if keep is not None and conv.source not in keep:
                continue
            batch.append(conv)
            if len(batch) >= size:
                yield batch
                batch = []
    if batch:
        yield batch


@dataclass
class Tokenized:
    """What one pass over the conversations produced: shards (staged), counters and checks."""

    shards: list[dict[str, Any]]
    pick: Reservoir
    conversations: int = 0
    events: Counter[str] = field(default_factory=Counter)
    checks: dict[str, Any] = field(default_factory=lambda: {"server_turns": 0, "server_mismatches": 0,
                                                            "first_mismatch": None, "server_turns_without_ids": 0})
    prompts: dict[str, Any] = field(default_factory=new_checks)
    by_source: dict[str, dict[str, int]] = field(default_factory=dict)
    first_error: str | None = None

    @property
    def totals(self) -> dict[str, int]:
        return {k: sum(s[k] for s in self.shards) for k in ("samples", "tokens", "supervised")}


def tokenize_shards(cfg: Any, chat: ChatTemplate, paths: list[tuple[Path, set[str] | None]], need: int,
                    staging: Path) -> Tokenized:
    """Tokenize every conversation of `paths` into `tokenize.shard_size`-sample shards under `staging`;
    samples with fewer than `need` supervised tokens are dropped (counted)."""
    tc = cfg.tokenize
    tok = Tokenized(shards=[], pick=Reservoir(tc.agreement_samples, seed=cfg.run.seed))
    checks, shards = tok.checks, tok.shards
    pending: list[dict[str, Any]] = []

    def flush(force: bool) -> None:
        while pending and (force or len(pending) >= tc.shard_size):
            name = shard_name(len(shards))
            part = pending[:tc.shard_size]
            del pending[:tc.shard_size]
            shards.append({"file": name, **write_parquet_shard(staging / name, part)})

    bar = Progress("tokenize", total=sum(len(keep) if keep is not None else _lines(p) for p, keep in paths),
                   unit="conv")
    for samples, ev, c, err in _results(chat, _batches(paths, tc.batch_size), tc):
        tok.first_error = tok.first_error or err
        tok.conversations += ev["conversations"]
        bar.update(ev.pop("conversations"))
        tok.events.update(ev)
        checks["server_turns"] += c["server_turns"]
        checks["server_mismatches"] += c["server_mismatches"]
        checks["first_mismatch"] = checks["first_mismatch"] or c["first_mismatch"]
        checks["server_turns_without_ids"] += c["server_turns_without_ids"]
        merge_checks(tok.prompts, c["prompt"])
        for s in samples:
            if int(s.loss_mask.sum()) < need:
                tok.events["too_few_supervised"] += 1
                continue
            pending.append({"id": s.id, "input_ids": s.input_ids, "loss_mask": s.loss_mask, "source": s.source})
            if tc.agreement_samples:
                tok.pick.offer((s.source, s.regenerated), (s.input_ids, s.loss_mask))
            n_sup = int(s.loss_mask.sum())
            row = tok.by_source.setdefault(s.source, {"samples": 0, "tokens": 0, "supervised": 0})
            row["samples"] += 1
            row["tokens"] += len(s.input_ids)
            row["supervised"] += n_sup
        flush(False)
    flush(True)
    bar.close()
    return tok


def publish_shards(staging: Path, out: Path, shards: list[dict[str, Any]]) -> None:
    """Move the staged shards into `out` and delete the shards of an earlier run that this one lacks."""
    for sh in shards:
        os.replace(staging / sh["file"], out / sh["file"])
    keep = {sh["file"] for sh in shards}
    for stale in out.glob(SHARD_GLOB):
        if stale.name not in keep:
            stale.unlink()


def log_warnings(tok: Tokenized) -> None:
    if tok.first_error:
        log.warning("%d conversations skipped: the chat template raised (first: %s)",
                    tok.events["template_errors"], tok.first_error)
    if tok.checks["server_mismatches"]:
        log.warning("%d of %d answers differ from the server's token ids (first: %s); the server's "
                    "ids were used", tok.checks["server_mismatches"], tok.checks["server_turns"],
                    tok.checks["first_mismatch"])
    if tok.events["recorded_ids_disagree"]:
        log.warning("%d recorded replies' completion_token_ids do not spell the reply as the chat template renders "
                    "it (another template or tool-call serialisation?); their text was tokenized instead",
                    tok.events["recorded_ids_disagree"])


def by_mode(cfg: Any, by_source: dict[str, dict[str, int]]) -> dict[str, dict[str, Any]]:
    """The per-source counts summed per thinking mode (`data.chat.mode_of`), each with its `sources`."""
    out: dict[str, dict[str, Any]] = {}
    for name, mode in source_modes(cfg, by_source).items():
        row = out.setdefault(mode, {"samples": 0, "tokens": 0, "supervised": 0, "sources": []})
        for k in ("samples", "tokens", "supervised"):
            row[k] += by_source[name][k]
        row["sources"].append(name)
    return dict(sorted(out.items()))


def tokenize_stats(cfg: Any, paths: list[tuple[Path, set[str] | None]], need: int, tok: Tokenized,
                   agreement: dict[str, Any], elapsed: float) -> dict[str, Any]:
    """`tokenize/stats.json`'s dict."""
    tc, totals, events = cfg.tokenize, tok.totals, tok.events
    return {"input": str(paths[0][0]), "inputs": [str(p) for p, _ in paths], "conversations": tok.conversations,
            **totals, "by_source": dict(sorted(tok.by_source.items())), "by_mode": by_mode(cfg, tok.by_source),
            "supervised_fraction": round(totals["supervised"] / max(totals["tokens"], 1), 4),
            "dropped": {k: events[k] for k in DROPS},
            "events": {k: v for k, v in sorted(events.items()) if k not in DROPS},
            "server_token_check": tok.checks, "prompt_check": tok.prompts, "teacher_forced": agreement,
            "shards": tok.shards,
            "settings": {"max_length": tc.max_length, "min_supervised": need, "thinking": tc.thinking,
                         "system_prompt": tc.system_prompt, "chat_template_kwargs": tc.chat_template_kwargs,
                         "source_chat_template_kwargs": source_template_kwargs(cfg),
                         "chat_template": cfg.target.chat_template or "tokenizer"},
            "tokens_per_s": round(totals["tokens"] / max(elapsed, 1e-9), 1)}


def generate_manifest(cfg: Any, rd: RunDir) -> dict[str, Any]:
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
    temperature = (generate_manifest(cfg, rd).get("sampling") or {}).get("temperature", cfg.generate.temperature)
    return check_sources(cfg.target, pick, temperature=temperature, min_agreement=cfg.tokenize.min_agreement)


_WORKER_CHAT: ChatTemplate | None = None  # set once in each forked worker (by the pool's initializer)


def _init_worker(chat: ChatTemplate) -> None:
    global _WORKER_CHAT
    _WORKER_CHAT = chat


def _work(batch: list[Conversation], tc: Any, chat: ChatTemplate | None = None) -> tuple:
    chat = chat or _WORKER_CHAT
    assert chat is not None
    samples, events, checks = tokenize_batch(chat, batch, max_length=tc.max_length, thinking=tc.thinking,
                                             system_prompt=tc.system_prompt,
                                             rewritten_turns=tc.rewritten_turns)
    events["conversations"] = len(batch)
    return samples, events, checks, chat.first_error


def _results(chat: ChatTemplate, batches: Iterator[list[Conversation]], tc: Any) -> Iterator[tuple]:
    """Batch results in input order: in this process, or in `tokenize.workers` forked processes (each
    inherits the chat template through the fork: the initializer's arguments are not pickled)."""
    workers = tc.workers or os.cpu_count() or 1
    if workers <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        for batch in batches:
            yield _work(batch, tc, chat)
        return
    with _forked_pool(workers, chat) as pool:
        while window := list(islice(batches, 4 * workers)):  # bounded read-ahead
            yield from pool.imap(partial(_work, tc=tc), window)


def _forked_pool(workers: int, chat: ChatTemplate) -> Any:
    """The fork pool, its workers forked with SIGTERM at the default action.

    The CLI's SIGTERM handler is Python code, which a worker only runs between bytecodes of its main
    thread; a worker stuck in native code (a lock some other parent thread held at the fork) then
    ignores the pool's closing `terminate()`, and the parent's join waits forever — seen under load in
    the test suite: all batches done, the parent hung in `Pool.__exit__`. With the default action the
    kernel ends the worker wherever it is."""
    ctx = multiprocessing.get_context("fork")
    try:
        previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except ValueError:  # not the main thread: nothing installed a Python handler here
        return ctx.Pool(workers, initializer=_init_worker, initargs=(chat,))
    try:
        return ctx.Pool(workers, initializer=_init_worker, initargs=(chat,))
    finally:
        signal.signal(signal.SIGTERM, previous)


def refuse_empty(rd: RunDir, paths: list[Path], failures: Path) -> None:
    """No conversation to tokenize: say where they should have come from (not the chat template);
    `failures` is generate's failures.jsonl (`RunDir.generate_failures`)."""
    counts = (rd.manifest("generate") or {}).get("counts") or {}
    failed = counts.get("turns_failed") or 0
    why = (f": `generate` wrote none ({failed} of {counts.get('turns_total')} turns failed; see "
           f"{failures})" if failed else "")
    raise UsageError(f"{', '.join(map(str, paths))}: no conversations to tokenize{why}",
                     hint="re-run `dflashkit generate -c run.yaml` (it retries the failed turns)" if failed
                     else "check data.sources and re-run `dflashkit prepare -c run.yaml` / `dflashkit generate`")


def refuse_degenerate(totals: dict[str, int], src: Path, need: int, template_error: str | None,
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
