"""Normalise, filter, dedupe, mix and split conversations (the library half of `prepare`).

Usage:
    conv = normalise("sharegpt", messages, max_turns=8, max_prompt_chars=16000)  # RecordError(reason)
    picked = mix({"a": convs_a, "b": convs_b}, {"a": 1.0, "b": 3.0}, total=1000, seed=0)
    heldout, train = picked[:32], picked[32:]

Normalisation (documented policy): contents are stripped; consecutive turns of the same role are
merged with a blank line; a system turn is allowed only first; the first non-system turn must be
the user's; the conversation is cut before its first empty turn and after its `max_turns`-th user
turn (with that turn's answer). Drop reasons: `malformed`, `empty`, `first_turn_not_user`,
`too_long`, `duplicate`.

Mixing: each source gets `total · w / Σw` records (rounded by largest remainder); what a source
cannot supply is redistributed over the others by weight. Each source's records are shuffled
with a seed derived from `run.seed` and the source name, and the union is shuffled again, so
the same config gives the same files.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import TYPE_CHECKING

from dflashkit.data.records import Conversation

from dflashkit.data.sources import RecordError

if TYPE_CHECKING:
    from dflashkit.config import RunConfig, SourceSection


def normalise(source: str, messages: list[dict[str, str]], *, max_turns: int,
              max_prompt_chars: int) -> Conversation:
    """Apply the policy above and return the conversation (with its content id).

    Raises:
        RecordError: reason "malformed" | "empty" | "first_turn_not_user" | "too_long".
    """
    merged: list[dict[str, str]] = []
    for m in messages:
        content = m["content"].strip()
        try:
            content.encode("utf-8")
        except UnicodeEncodeError:
            raise RecordError("malformed", "content is not valid UTF-8") from None
        if merged and merged[-1]["role"] == m["role"] and content and merged[-1]["content"]:
            merged[-1] = {"role": m["role"], "content": merged[-1]["content"] + "\n\n" + content}
        else:
            merged.append({"role": m["role"], "content": content})
    if any(m["role"] == "system" for m in merged[1:]):
        raise RecordError("malformed", "a system turn after the first turn")
    kept: list[dict[str, str]] = []
    users = 0
    for m in merged:
        if not m["content"]:
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
    conv = Conversation.from_messages(source, kept)
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
