"""Did the server see the prompt we train on? Compare a server's prompt tokens with the local rendering.

Usage:
    summary = ids_summary(reply.prompt_token_ids)        # compact record kept per turn by `generate`
    check = compare_prompt(local_ids, server_tokens=reply.usage["prompt_tokens"], server_ids=summary)
    check.differs, check.delta, check.ids_equal          # delta = server − local tokens
    checks = new_checks(); add_prompt_check(checks, check, where="abc-t0", tokenizer=tok)
    prompt_line(checks), answer_line(checks, asked=True)  # "prompt tokens: 12/12 differ …"

A server renders chat messages with its own chat template and may add or drop tokens (a default
system prompt, a BOS). `usage.prompt_tokens` arrives with every OpenAI-compatible reply, so the
length comparison works with any server; where the server also returns the prompt's token ids
(vLLM with `return_token_ids`, `dflashkit serve`) they are compared exactly. `generate` keeps the
server's numbers per turn (`meta.prompt_tokens`, `meta.prompt_ids`), `tokenize` compares them with
its own rendering; `generate` and `doctor` do the same on one request before starting.

A turn the server gave no numbers for is counted as not checked, never as agreeing.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

from dflashkit.errors import UsageError

HEAD = 48  # leading prompt ids kept per turn, to show where a drifted prompt starts to differ


def ids_digest(ids: Sequence[int]) -> str:
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]


def ids_summary(ids: Sequence[int] | None) -> dict[str, Any] | None:
    """{"n", "sha256", "head"} of a prompt's token ids (None when the server returned none)."""
    if ids is None:
        return None
    ids = [int(i) for i in ids]
    return {"n": len(ids), "sha256": ids_digest(ids), "head": ids[:HEAD]}


@dataclass
class PromptCheck:
    """One prompt compared: local token count vs the server's (and ids when it returned them)."""

    local_tokens: int
    server_tokens: int | None          # usage.prompt_tokens (None: not reported)
    ids_equal: bool | None             # None: the server returned no prompt ids
    first_diff: int | None = None      # first differing position (within the kept head), ids only
    local_head: list[int] | None = None
    server_head: list[int] | None = None

    @property
    def checked(self) -> bool:
        return self.server_tokens is not None or self.ids_equal is not None

    @property
    def delta(self) -> int | None:
        return None if self.server_tokens is None else self.server_tokens - self.local_tokens

    @property
    def differs(self) -> bool:
        return bool(self.delta) or self.ids_equal is False


def compare_prompt(local_ids: Sequence[int], *, server_tokens: int | None,
                   server_ids: dict[str, Any] | list[int] | None) -> PromptCheck:
    """Compare the local rendering's ids with what the server reported for the same prompt.

    Args:
        local_ids: the prompt as rendered and tokenized here.
        server_tokens: the reply's `usage.prompt_tokens`, or None.
        server_ids: the server's prompt ids (a list, or an `ids_summary`), or None.
    """
    local = [int(i) for i in local_ids]
    if isinstance(server_ids, list):
        server_ids = ids_summary(server_ids)
    n = server_tokens if isinstance(server_tokens, int) and not isinstance(server_tokens, bool) else None
    check = PromptCheck(local_tokens=len(local), server_tokens=n, ids_equal=None)
    if server_ids:
        if n is None:
            check.server_tokens = int(server_ids["n"])
        check.ids_equal = server_ids["n"] == len(local) and server_ids["sha256"] == ids_digest(local)
        if not check.ids_equal:
            head = list(server_ids.get("head") or [])
            at = next((k for k, (a, b) in enumerate(zip(local, head)) if a != b), min(len(local), len(head)))
            check.first_diff = at
            check.local_head, check.server_head = local[max(0, at - 4):at + 12], head[max(0, at - 4):at + 12]
    return check


def new_checks() -> dict[str, Any]:
    """Counters for prompt checks (tokenize's stats.json `prompt_check`)."""
    return {"turns": 0, "checked": 0, "mismatches": 0, "ids_checked": 0, "ids_mismatches": 0,
            "delta_counts": {}, "first_mismatch": None}


def add_prompt_check(checks: dict[str, Any], check: PromptCheck | None, *, where: str, tokenizer: Any = None,
                     ) -> None:
    """Count one turn's check (None = nothing reported by the server) into `checks`."""
    checks["turns"] += 1
    if check is None or not check.checked:
        return
    checks["checked"] += 1
    checks["ids_checked"] += check.ids_equal is not None
    checks["ids_mismatches"] += check.ids_equal is False
    if not check.differs:
        return
    checks["mismatches"] += 1
    key = str(check.delta)
    checks["delta_counts"][key] = checks["delta_counts"].get(key, 0) + 1
    if checks["first_mismatch"] is None:
        first: dict[str, Any] = {"where": where, "server_tokens": check.server_tokens,
                                 "local_tokens": check.local_tokens, "delta": check.delta}
        if check.first_diff is not None:
            first["first_diff_token"] = check.first_diff
            if tokenizer is not None:
                first["local"] = tokenizer.decode(check.local_head or [])
                first["server"] = tokenizer.decode(check.server_head or [])
        checks["first_mismatch"] = first


def merge_checks(total: dict[str, Any], part: dict[str, Any]) -> None:
    """Add the counters of `part` into `total` (both from `new_checks`)."""
    for k in ("turns", "checked", "mismatches", "ids_checked", "ids_mismatches"):
        total[k] += part[k]
    deltas = Counter(total["delta_counts"])
    deltas.update(part["delta_counts"])
    total["delta_counts"] = dict(deltas)
    total["first_mismatch"] = total["first_mismatch"] or part["first_mismatch"]


def describe(check: PromptCheck) -> str:
    """One line: "server 9 tokens, local 25 (−16); ids differ from token 1" etc."""
    if not check.checked:
        return "not checked (the server reported neither usage.prompt_tokens nor prompt ids)"
    parts = [f"server {check.server_tokens} tokens, local rendering {check.local_tokens}"
             + (f" ({check.delta:+d})" if check.delta else "")]
    if check.ids_equal is True:
        parts.append("ids equal")
    elif check.ids_equal is False:
        parts.append(f"ids differ from token {check.first_diff}")
    else:
        parts.append("ids not returned")
    return "; ".join(parts)


def prompt_line(checks: dict[str, Any]) -> str:
    """Human summary of prompt checks over many turns."""
    if not checks["turns"]:
        return "prompt tokens: not checked (no regenerated turns)"
    if not checks["checked"]:
        return (f"prompt tokens: not checked ({checks['turns']} turns without usage.prompt_tokens from the "
                "server; re-run generate to record them)")
    deltas = ", ".join(f"{int(k):+d} on {v}" for k, v in sorted(checks["delta_counts"].items(),
                                                                 key=lambda kv: -kv[1]))
    ids = (f"; ids compared on {checks['ids_checked']} ({checks['ids_mismatches']} differ)"
           if checks["ids_checked"] else "; ids not returned")
    return (f"prompt tokens: {checks['mismatches']}/{checks['checked']} server prompts differ from the local "
            f"rendering" + (f" (server − local: {deltas})" if deltas else "") + ids)


def answer_line(turns: int, mismatches: int, without_ids: int, asked: bool | None) -> str:
    """Human summary of the answer token-id check: counts, or why it was not checked."""
    if turns:
        tail = f" ({without_ids} turns without ids)" if without_ids else ""
        return f"answer token ids: {mismatches}/{turns} differ{tail}"
    if asked is False:
        return "answer token ids: not checked (generate.request_token_ids was off)"
    if without_ids:
        return (f"answer token ids: not checked (asked for, none returned by the server on {without_ids} "
                "turns)")
    return "answer token ids: not checked (none recorded)"


def is_regenerated(meta: dict[str, Any]) -> bool:
    """Were a conversation's answers written by the target? `generate` records finish reasons per turn;
    a source that skips generate can say so with `meta.regenerated: false`."""
    return bool(meta.get("regenerated", "finish_reasons" in meta))


def refuse_drift(prompts: dict[str, Any], agreement: dict[str, Any], *, max_prompt_mismatch: float,
                 min_agreement: float) -> None:
    """Raise UsageError (exit 2) naming the numbers when the data do not match what the target does.

    Args:
        prompts: prompt-check counters (`new_checks`).
        agreement: `dflashkit.data.agreement.check_sources` output.
    """
    problems = []
    if prompts["checked"] and prompts["mismatches"] / prompts["checked"] > max_prompt_mismatch:
        fm = prompts["first_mismatch"] or {}
        problems.append(f"{prompt_line(prompts)} > tokenize.max_prompt_mismatch {max_prompt_mismatch:.0%} "
                        f"(first: {fm.get('where')}: server {fm.get('server_tokens')} tokens, local "
                        f"{fm.get('local_tokens')})")
    for name, r in agreement.get("sources", {}).items():
        if r["judged"] and r["agreement"] < min_agreement:
            problems.append(f"source {name!r}: teacher-forced agreement {r['agreement']:.1%} ({r['agree']}/"
                            f"{r['labels']} supervised labels are the target's argmax) < tokenize.min_agreement "
                            f"{min_agreement}")
    if problems:
        raise UsageError("the training data do not match what the target does:\n  - " + "\n  - ".join(problems),
                         hint="the server that ran `generate` rendered prompts with another chat template or "
                         "sampled with its own defaults (repetition penalty, min_p): serve the target with its "
                         "own template, keep generate.neutral_sampling on or set generate.endpoint=completions, "
                         "then delete generate/shards and re-run generate. To keep the data anyway: "
                         "tokenize.min_agreement=0 tokenize.max_prompt_mismatch=1")
