"""Normalise, filter, dedupe, mix and split conversations (the library half of `prepare`).

Usage:
    by_source, stats = read_sources(cfg)          # every data.sources[] entry read and normalised
    conv = normalise("sharegpt", messages, max_turns=8, max_prompt_chars=16000, tools=None)  # RecordError
    picked = mix({"a": convs_a, "b": convs_b}, {"a": 1.0, "b": 3.0}, total=1000, seed=0)
    if not any(by_source.values()): raise UsageError(none_survived(stats))   # counts and the first file:line
    heldout, train = picked[:32], picked[32:]

Normalisation (documented policy): contents are stripped; consecutive turns of the same role are
merged with a blank line; a system turn is allowed only first; the first non-system turn must be
the user's; the conversation is cut before its first empty turn and after its `max_turns`-th user
turn (with that turn's answer). Drop reasons: `malformed`, `empty`, `first_turn_not_user`,
`too_long`, `duplicate`. Agent turns (`data.records`): a tool result, and an assistant turn that
calls tools, keep their content as it is (a blank one becomes ""), are never merged and never cut
the conversation; the calls of a turn are answered before the next user turn, so a cut keeps them
paired. A conversation's tools stay with it.

Mixing: each source gets `total · w / Σw` records (rounded by largest remainder); what a source
cannot supply is redistributed over the others by weight. Each source's records are shuffled
with a seed derived from `run.seed` and the source name, and the union is shuffled again, so
the same config gives the same files.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflashkit.data import bfcl
from dflashkit.data.records import Conversation
from dflashkit.data.sources import RecordError, SourceReport, iter_source, to_record
from dflashkit.errors import ConfigError, UsageError
from dflashkit.progress import Progress

if TYPE_CHECKING:
    from dflashkit.config import RunConfig, SourceSection

log = logging.getLogger("dflashkit.prepare")

REASONS = ("malformed", "empty", "first_turn_not_user", "too_long", "duplicate")


def _agent_turn(m: dict[str, Any]) -> bool:
    return m["role"] == "tool" or "tool_calls" in m


def normalise(source: str, messages: list[dict[str, Any]], *, max_turns: int,
              max_prompt_chars: int, tools: list[dict[str, Any]] | None = None) -> Conversation:
    """Apply the policy above and return the conversation (with its content id).

    Raises:
        RecordError: reason "malformed" | "empty" | "first_turn_not_user" | "too_long".
    """
    merged: list[dict[str, Any]] = []
    for m in messages:
        content = (m["content"] if m["content"].strip() else "") if _agent_turn(m) else m["content"].strip()
        try:
            content.encode("utf-8")
        except UnicodeEncodeError:
            raise RecordError("malformed", "content is not valid UTF-8") from None
        if merged and merged[-1]["role"] == m["role"] and content and merged[-1]["content"] \
                and not _agent_turn(m) and not _agent_turn(merged[-1]):
            merged[-1] = {"role": m["role"], "content": merged[-1]["content"] + "\n\n" + content}
        else:
            merged.append({**m, "content": content})
    if any(m["role"] == "system" for m in merged[1:]):
        raise RecordError("malformed", "a system turn after the first turn")
    kept: list[dict[str, Any]] = []
    users = 0
    for m in merged:
        if not m["content"] and not _agent_turn(m):
            break
        if m["role"] == "user":
            if users == max_turns:
                break
            users += 1
        kept.append(m)
    body = kept[1:] if kept and kept[0]["role"] == "system" else kept
    if users == 0:
        if body and body[0]["role"] != "user":
            raise RecordError("first_turn_not_user", f"first turn is {body[0]['role']!r}")
        raise RecordError("empty", "no non-empty user turn")
    if body[0]["role"] != "user":
        raise RecordError("first_turn_not_user", f"first turn is {body[0]['role']!r}")
    conv = Conversation.from_messages(source, kept, tools=tools)
    if conv.user_chars > max_prompt_chars:
        raise RecordError("too_long", f"{conv.user_chars} user chars > data.max_prompt_chars")
    return conv


def _seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "big")


def quotas(available: dict[str, int], weights: dict[str, float], total: int | None) -> dict[str, int]:
    """How many records each source contributes (see the module docstring)."""
    if total is None or total >= sum(available.values()):
        return dict(available)
    take = {k: 0 for k in available}
    left = total
    open_ = [k for k in available if available[k] > 0]
    while left > 0 and open_:
        wsum = sum(weights[k] for k in open_)
        shares = {k: left * weights[k] / wsum for k in open_}
        base = {k: int(shares[k]) for k in open_}
        rest = left - sum(base.values())
        for k in sorted(open_, key=lambda k: (-(shares[k] - base[k]), k))[:rest]:
            base[k] += 1
        for k in open_:
            take[k] += min(base[k], available[k] - take[k])
        left = total - sum(take.values())
        open_ = [k for k in open_ if take[k] < available[k]]
    return take


def mix(by_source: dict[str, list[Conversation]], weights: dict[str, float], *, total: int | None,
        seed: int) -> list[Conversation]:
    """Deterministic weighted sample of `total` conversations (None = all), shuffled."""
    counts = quotas({k: len(v) for k, v in by_source.items()}, weights, total)
    picked: list[Conversation] = []
    for name in sorted(by_source):
        convs = list(by_source[name])
        random.Random(_seed(seed, name)).shuffle(convs)
        picked.extend(convs[:counts[name]])
    picked.sort(key=lambda c: c.id)  # independent of source order before the final shuffle
    random.Random(_seed(seed, "mix")).shuffle(picked)
    return picked


def source_names(sources: list[SourceSection]) -> list[str]:
    """`name`, else the file stem (or asset name); repeated names get `-2`, `-3`…"""
    names: list[str] = []
    for src in sources:
        base = src.name or Path(src.path).name.split(".")[0] or src.path
        name, k = base, 2
        while name in names:
            name, k = f"{base}-{k}", k + 1
        names.append(name)
    return names


def original_answer_sources(sources: list[SourceSection]) -> set[str]:
    """Names of the sources whose own answers are trained on as they are (`answers: original`)."""
    return {n for n, s in zip(source_names(sources), sources) if s.answers == "original"}


def needs_regeneration(cfg: RunConfig) -> bool:
    """Whether `generate` has work: tokenize reads generated answers and some source regenerates."""
    if cfg.tokenize.source == "prepare":
        return False
    return any(s.answers == "regenerate" for s in cfg.data.sources) or not cfg.data.sources


def is_agent(conv: Conversation | dict[str, Any]) -> bool:
    """Whether a conversation (or record dict) has tools, tool calls or tool results."""
    tools, messages = (conv.tools, conv.messages) if isinstance(conv, Conversation) else \
        (conv.get("tools"), conv.get("messages") or [])
    return bool(tools) or any(_agent_turn(m) for m in messages)


def check_sources(sources: list[SourceSection]) -> None:
    """The config checks of `data.sources` that need no data: BFCL categories (ConfigError, exit 2)."""
    for i, src in enumerate(sources):
        if src.bfcl_categories:
            key = f"data.sources[{i}].bfcl_categories"
            if src.path != "bfcl" and not bfcl.is_bfcl_dir(Path(src.path).expanduser()):
                raise ConfigError(f"{key}: only a BFCL source reads it (path: bfcl), not {src.path!r}",
                                  hint=f"remove {key}, or set data.sources[{i}].path=bfcl")
            bfcl.check_categories(key, src.bfcl_categories)


def none_survived(stats: dict[str, dict[str, Any]], shown: int = 3) -> str:
    """The error for a `read_sources` that kept no conversation: how many records each source gave, how many were
    dropped and why, and the first `shown` named reasons (`file:line: what was wrong`)."""
    read = sum(s["read"] for s in stats.values())
    drops = Counter({r: sum(s["dropped"][r] for s in stats.values()) for r in REASONS})
    examples = [e for s in stats.values() for e in s["examples"]]
    empty = [f"{n} ({s['path']})" for n, s in stats.items() if not s["read"] and not s["dropped"]["malformed"]]
    msg = f"no conversation survived reading and filtering: {read} records read, dropped {dict(+drops) or 'none'}"
    if empty:
        msg += f"; no record at all in {', '.join(empty)}"
    if examples:
        more = sum(drops.values()) - min(shown, len(examples))
        msg += "; the first: " + "; ".join(examples[:shown]) + (f" (and {more} more)" if more > 0 else "")
    return msg


def read_sources(cfg: Any) -> tuple[dict[str, list[Conversation]], dict[str, dict[str, Any]]]:
    """Read every source; returns (conversations by source, per-source stats).

    Raises:
        UsageError: a malformed line/record or a truncated file with data.on_malformed=fail.
        ConfigError: a bad BFCL category.
    """
    d = cfg.data
    check_sources(d.sources)
    seen: set[str] = set()
    by_source: dict[str, list[Conversation]] = {}
    stats: dict[str, dict[str, Any]] = {}
    for i, (name, src) in enumerate(zip(source_names(d.sources), d.sources)):
        report = SourceReport(name=name, path=str(src.path))
        drops: Counter[str] = Counter()
        convs: list[Conversation] = []
        records = iter_source(src, report, on_malformed=d.on_malformed)
        for where, obj in Progress(f"prepare {name}", total=src.max_records, unit="rec").track(records, close=True):
            try:
                messages, tools = to_record(obj, src.format)
                conv = normalise(name, messages, max_turns=d.max_turns, max_prompt_chars=d.max_prompt_chars,
                                 tools=tools)
            except RecordError as e:
                if e.reason == "malformed" and d.on_malformed == "fail":
                    raise UsageError(f"{where}: malformed record: {e}",
                                     hint="fix the record or set data.on_malformed=skip (agent records: "
                                     "docs/training-data.md, \"Agent conversations\")") from None
                drops[e.reason] += 1
                if e.reason == "malformed":
                    report.malformed_by[e.kind] += 1
                report.note(f"{where}: {e.reason}: {e}")
                continue
            if d.dedupe and conv.id in seen:
                drops["duplicate"] += 1
                continue
            seen.add(conv.id)
            convs.append(conv)
        drops["malformed"] += report.malformed_lines
        tail = report.truncated_tail
        if tail and d.on_malformed == "fail":
            raise UsageError(f"{report.path}: truncated JSON array at byte {tail['byte_offset']} "
                             f"({tail['bytes_dropped']} bytes after the last complete record)",
                             hint="set data.on_malformed=skip to keep the complete records")
        by_source[name] = convs
        stats[name] = {"path": report.path, "format": src.format, "weight": src.weight,
                       "read": report.read, "kept": len(convs),
                       "dropped": {r: drops.get(r, 0) for r in REASONS},
                       "malformed_by": dict(sorted((+report.malformed_by).items())),
                       "skipped": dict(sorted(report.skipped.items())),
                       "truncated_tail": tail, "examples": report.examples}
        log.info("%s: read %d, kept %d, dropped %s%s", name, report.read, len(convs),
                 dict(+drops) or "none", " (truncated tail)" if tail else "")
    return by_source, stats
