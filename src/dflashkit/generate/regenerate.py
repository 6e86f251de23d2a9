"""The regeneration loop of `dflashkit generate`: the journal's missing turns → requests → journal, then outputs.

Usage (what `stages/generate.py` does; `bench generate` times the same call):
    out = generate_conversations(cfg, convs, stage_dir, servers=lambda: list(cfg.server.urls))
    out.summary["turns_ok"], out.failures, out.settings, out.preflight

`convs` are prepared conversations (`data.records.read_prepared`); `stage_dir` holds the journal
(`shards/`, `journal.py`), `settings.json`, `conversations.jsonl` and `failures.jsonl` (written through
`conversations.py`, their owner). Resuming is exactly-once:
the (id, turn) pairs the journal holds are skipped, failed turns are retried. `servers` is called
only when there is a turn to generate (the stage starts a local server there).

Agent conversations (`conversations.py`): each request carries the record's `tools`, and a journal
record keeps the target's `tool_calls` (ids made unique in the conversation when the record is
written, so a resumed run prompts and assembles with the same ids). Whether an answer cuts the
conversation (`tool_mismatch`) is decided from the journal record alone: the run stops that
conversation there, a resumed run finds it settled (`settled`) and sends nothing for it.
`tool_mismatch_cut` counts the conversations written cut, `turns_cut` the turns after their cuts,
never generated (turns_total = turns_skipped_done + turns_ok + turns_failed + turns_not_attempted +
turns_cut).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from dflashkit.config import RunConfig, redact_url
from dflashkit.data.drift import describe, ids_summary
from dflashkit.data.mixing import is_agent
from dflashkit.errors import ConfigError, UsageError
from dflashkit.generate.conversations import (answer_message, assemble, build_prompt, own_call_ids, plan_turns,
                                             read_settings, settled, tool_mismatch, write_conversations,
                                             write_failures, write_settings)
from dflashkit.generate.journal import Journal, read_records
from dflashkit.generate.openai_client import OpenAIClient, RequestFailed
from dflashkit.generate.preflight import (Sender, local_chat, local_prompt_ids, preflight, request_body,
                                          sampling_settings, source_settings)
from dflashkit.progress import Progress

if TYPE_CHECKING:
    from dflashkit.data.chat import ChatTemplate as Chat

log = logging.getLogger("dflashkit.generate")

SUMMARY_KEYS = ("turns_total", "turns_skipped_done", "turns_ok", "turns_retried", "turns_failed",
                "turns_not_attempted", "requests_sent", "retries", "torn_lines_dropped", "conversations_written",
                "conversations_dropped_length", "conversations_failed", "conversations_no_user_turn",
                "tool_mismatch_cut", "turns_cut")


@dataclass
class Regenerated:
    """What one pass over the missing turns did."""

    counts: Counter = field(default_factory=Counter)  # turns_ok/failed/retried/not_attempted, requests_sent, retries
    reasons: Counter = field(default_factory=Counter)  # failed turns by reason ("http 500", "timeout", ...)
    failures: list[dict] = field(default_factory=list)  # one row per failed turn (failures.jsonl)
    settings: dict[str, Any] = field(default_factory=dict)  # the sampling settings sent (model from the server)
    chat_template_sha256: str | None = None
    preflight: dict[str, Any] | None = None
    fields_refused: list[str] = field(default_factory=list)


@dataclass
class Generated:
    """A whole generate run over a stage dir (what the stage's manifest and JSON report)."""

    summary: dict[str, Any]  # SUMMARY_KEYS + failed_by_reason, conversations_total
    failures: list[dict]
    settings: dict[str, Any]
    urls: list[str]  # the endpoints used (a local server's URL included); [] when nothing was left to do
    chat_template_sha256: str | None = None
    preflight: dict[str, Any] | None = None
    fields_refused: list[str] = field(default_factory=list)


async def _preflight(cfg: RunConfig, sender: Sender, settings: dict[str, Any], chat: Chat | None,
                     convs: list[dict]) -> dict[str, Any]:
    """One request for the first turn: the server's prompt vs the local rendering (generate.preflight)."""
    mode = cfg.generate.preflight
    if mode == "off":
        return {"status": "off"}
    if chat is None:
        return {"status": "skipped", "detail": "no local tokenizer (set target.path or target.tokenizer)"}
    conv = next((c for c in convs if plan_turns(c["messages"])), None)
    if conv is None:
        return {"status": "skipped", "detail": "no user turn"}
    messages = build_prompt(conv["messages"], plan_turns(conv["messages"]), [], 0)
    text = chat.render(messages, add_generation_prompt=True, tools=conv.get("tools"))
    prompt = text if cfg.generate.endpoint == "completions" else None
    body = request_body(settings, messages, token_ids=cfg.generate.request_token_ids, prompt=prompt,
                        tools=conv.get("tools"))
    try:
        check = await preflight(sender, body, local_prompt_ids(chat, text=text))
    except RequestFailed as e:
        return {"status": "skipped", "detail": f"the request failed: {e}"}
    out = {"status": "differs" if check.differs else "ok" if check.checked else "not checked",
           "detail": describe(check), "id": conv["id"], "server_tokens": check.server_tokens,
           "local_tokens": check.local_tokens, "ids_equal": check.ids_equal}
    if not check.differs:
        log.info("pre-flight: %s", out["detail"])
        return out
    where = ""
    if check.first_diff is not None:
        where = (f"\n  local : {chat.tokenizer.decode(check.local_head or [])!r}"
                 f"\n  server: {chat.tokenizer.decode(check.server_head or [])!r}")
    msg = (f"pre-flight: the server did not see the prompt the target's chat template renders here "
           f"(conversation {conv['id']}, turn 0): {out['detail']}{where}")
    if mode == "warn":
        log.warning("%s", msg)
        return out
    raise UsageError(msg, hint="serve the target with its own chat template (vLLM/SGLang --chat-template, "
                     "llama.cpp --jinja), or set generate.endpoint=completions to render prompts here; "
                     "generate.preflight=warn goes on anyway")


class _Progress:
    """`dflashkit.progress` for generate: turns done/total, turns/s, ETA, generated tokens/s beside."""

    def __init__(self, total: int, initial: int, enabled: bool):
        self.tokens = 0
        self.t0 = time.monotonic()
        self.bar = Progress("generate", total=total, initial=initial, unit="turn", enabled=enabled)

    def update(self, tokens: int) -> None:
        self.tokens += tokens
        self.bar.update(1, tok_s=round(self.tokens / max(time.monotonic() - self.t0, 1e-9)))

    def close(self) -> None:
        self.bar.close()


@dataclass
class _Conversations:
    """What `regenerate`'s workers share: sends each conversation's missing turns, appends each answer to the
    journal and counts it in `out`."""

    cfg: RunConfig
    sender: Sender
    settings: dict[str, Any]  # the sampling settings sent
    model: str  # the model a reply that names none is recorded with
    chat: Chat | None
    journal: Journal
    progress: _Progress
    out: Regenerated
    by_source: dict[str, dict[str, Any]]  # source → what its requests add (`source_settings`)

    async def run(self, conv: dict[str, Any], have: dict[int, dict]) -> None:
        """Every turn of `conv` that `have` (its journal records by turn) lacks, in order, up to the first failed
        turn, an answer whose tool calls cut the conversation, or (generate.on_length=drop) a cut answer."""
        g = self.cfg.generate
        turns = plan_turns(conv["messages"])
        answers: list[dict[str, Any]] = []
        used_ids: set[str] = set()  # the ids of the target's calls so far
        for t in range(len(turns)):
            rec = have.get(t)
            if rec is None:
                rec = await self._turn(conv, turns, answers, t, used_ids)
                if rec is None:
                    self.out.counts["turns_not_attempted"] += len(turns) - t - 1
                    return
            else:
                used_ids.update(c["id"] for c in rec.get("tool_calls") or [])
            answers.append(answer_message(rec, g.reasoning))
            if tool_mismatch(conv["messages"], turns, t, rec.get("tool_calls")) is not None:
                return  # the conversation ends on this answer (`turns_cut` counts the rest)
            if g.on_length == "drop" and rec.get("finish_reason") == "length":
                self.out.counts["turns_not_attempted"] += len(turns) - t - 1
                return

    async def _turn(self, conv: dict[str, Any], turns: list[int], answers: list[dict[str, Any]], t: int,
                    used_ids: set[str]) -> dict[str, Any] | None:
        """Send turn `t` and append its journal record (returned); None when the request failed (counted, and
        a row for failures.jsonl)."""
        g, counts, tools = self.cfg.generate, self.out.counts, conv.get("tools")
        prompt = build_prompt(conv["messages"], turns, answers, t)
        text = self.chat.render(prompt, add_generation_prompt=True, tools=tools) \
            if g.endpoint == "completions" and self.chat is not None else None
        try:
            reply = await self.sender.send(request_body(self.settings, prompt, token_ids=g.request_token_ids,
                                                        prompt=text, tools=tools,
                                                        source=self.by_source.get(conv.get("source", ""))))
        except RequestFailed as e:
            counts["turns_failed"] += 1
            counts["turns_retried"] += e.attempts > 1
            self.out.reasons[e.reason] += 1
            self.out.failures.append({"id": conv["id"], "turn": t, "reason": e.reason, "detail": e.detail,
                                      "attempts": e.attempts})
            return None
        rec = {"id": conv["id"], "turn": t, "content": reply.content, "reasoning": reply.reasoning,
               **({"tool_calls": own_call_ids(reply.tool_calls, t, used_ids)} if reply.tool_calls else {}),
               "finish_reason": reply.finish_reason, "token_ids": reply.token_ids,
               "model": reply.model or self.model, "url": redact_url(reply.url), "attempts": reply.attempts,
               "completion_tokens": reply.usage.get("completion_tokens"),
               "prompt_tokens": reply.usage.get("prompt_tokens"),
               "prompt_ids": ids_summary(reply.prompt_token_ids)}
        self.journal.append(rec)
        counts["turns_ok"] += 1
        counts["turns_retried"] += reply.attempts > 1
        self.progress.update(int(reply.usage.get("completion_tokens") or 0))
        return rec


async def _model_info(cfg: RunConfig, client: OpenAIClient) -> dict[str, Any]:
    """The server's /v1/models entry; {} when it has none to give and server.model names the model."""
    try:
        return await client.model_info()
    except Exception:  # noqa: BLE001 - /v1/models is optional when server.model is set
        if not cfg.server.model:
            raise
        return {}


async def regenerate(cfg: RunConfig, convs: list[dict], journal: Journal, done: dict[str, dict[int, dict]],
                     urls: list[str], chat: Chat | None, progress: _Progress, stage_dir: Path) -> Regenerated:
    """Generate every turn of `convs` that `done` lacks, appending each finished one to `journal`.

    A conversation stops at its first failed turn (the later ones are counted not attempted), at an
    answer whose tool calls cut it (`tool_mismatch`) and, with generate.on_length=drop, at its first turn
    cut by max_tokens. Writes settings.json once the server named its model."""
    g = cfg.generate
    out = Regenerated()
    client = OpenAIClient(urls, concurrency=g.concurrency, timeout_s=cfg.server.timeout_s,
                          max_retries=g.max_retries, backoff_s=g.backoff_s,
                          api_key_env=cfg.server.api_key_env, seed=cfg.run.seed)
    async with client:
        info = await _model_info(cfg, client)
        model = cfg.server.model or str(info["id"])
        settings = out.settings = sampling_settings(cfg, model)
        write_settings(stage_dir, settings)
        out.chat_template_sha256 = info.get("chat_template_sha256")
        sender = Sender(client, "completions" if g.endpoint == "completions" else "chat")
        out.preflight = await _preflight(cfg, sender, settings, chat, convs)
        conversations = _Conversations(cfg, sender, settings, model, chat, journal, progress, out,
                                       source_settings(cfg))
        queue: asyncio.Queue = asyncio.Queue()
        for conv in convs:
            queue.put_nowait(conv)

        async def worker() -> None:
            while True:
                try:
                    conv = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                await conversations.run(conv, done.get(conv["id"], {}))

        await asyncio.gather(*(worker() for _ in range(min(g.concurrency, max(1, len(convs))))))
        out.counts["requests_sent"] = client.stats["requests"]
        out.counts["retries"] = client.stats["retries"]
        out.fields_refused = sorted(sender.dropped)
    return out


def check_generate(cfg: RunConfig, convs: list[dict], stage_dir: Path) -> int:
    """Every refusal of generate before its first request, read-only (the stage calls it on a real run and a
    dry run alike): the sampling settings against those of an existing journal, and the local chat template
    when generate.endpoint=completions renders prompts here (which cannot read tool calls back: agent
    conversations are refused there), and a local template that does not render the tools of agent
    conversations. Returns how many conversations still have a turn to generate (none: no server is needed)."""
    done: dict[str, dict[int, dict]] = {}
    for rec in read_records(stage_dir / "shards"):
        done.setdefault(rec["id"], {})[int(rec["turn"])] = rec
    _check_settings(stage_dir, sampling_settings(cfg, cfg.server.model), sum(map(len, done.values())))
    todo = [c for c in convs if not _finished(c, done.get(c["id"], {}))]
    agent = next((c for c in todo if is_agent(c)), None)
    if agent is not None and cfg.generate.endpoint == "completions":
        raise ConfigError(f"generate.endpoint=completions: conversation {agent['id']} (source "
                          f"{agent.get('source')!r}) is an agent conversation, and a text completion does not "
                          "give its tool calls back", hint="set generate.endpoint=chat, with a server that parses "
                          "the target's tool calls (vLLM: --enable-auto-tool-choice --tool-call-parser NAME)")
    if agent is not None and not cfg.server.urls and cfg.server.engine == "vllm" and not cfg.server.tool_call_parser:
        raise ConfigError(f"server.tool_call_parser: conversation {agent['id']} (source {agent.get('source')!r}) is "
                          "an agent conversation, and the vLLM that generate starts would return the target's tool "
                          "calls as plain text", hint="set server.tool_call_parser to the parser of the target's "
                          "template (hermes for <tool_call> JSON blocks, kimi_k2 for Kimi K2.x)")
    required = sorted({c.get("source", "") for c in todo if is_agent(c)
                       and source_settings(cfg).get(c.get("source", ""), {}).get("tool_choice") == "required"})
    if required and not cfg.server.urls and cfg.server.engine == "dflashkit":
        raise ConfigError(f"data.sources[].tool_choice: required (source {required[0]!r}) needs a server that "
                          "constrains decoding to a call; the `dflashkit serve` generate starts does not",
                          hint="set server.engine=vllm with server.tool_call_parser, or tool_choice to auto / null")
    if todo and cfg.generate.endpoint == "completions":
        local_chat(cfg)
    if agent is not None and (cfg.target.path or cfg.target.tokenizer):
        _check_tool_template(cfg, agent)
    return len(todo)


def _finished(conv: dict[str, Any], have: dict[int, dict]) -> bool:
    n, cut = settled(conv, have)
    return cut is not None or n == len(plan_turns(conv["messages"]))


def _check_tool_template(cfg: RunConfig, conv: dict[str, Any]) -> None:
    """Refuse (exit 2) agent conversations when the target's chat template here does not render tools:
    `tokenize` could not train on them (a template that does not load is left to pre-flight)."""
    try:
        chat = local_chat(cfg)
    except Exception:  # noqa: BLE001 - no local template: pre-flight says so, tokenize refuses later
        return
    problem = chat.tool_rendering_problem() if chat is not None else None
    if chat is not None and problem is not None:
        raise ConfigError(f"target.chat_template: conversation {conv['id']} (source {conv.get('source')!r}) has "
                          f"tools, but {chat.origin} does not render them ({problem})",
                          hint="set target.chat_template to a Jinja template that renders `tools` and "
                          "`tool_calls` (the target's own, as its server applies it; configs/templates/"
                          "smollm2-tools.jinja for SmolLM2), or leave the source out")


def _check_settings(stage_dir: Path, settings: dict[str, Any], journal_keys: int) -> None:
    old = read_settings(stage_dir) if journal_keys else None
    if old is not None:
        # keys an older journal's settings.json lacks were not settings then: not a change
        changed = sorted(k for k in settings if k != "model" and k in old and old.get(k) != settings.get(k))
        if changed:
            raise ConfigError([f"generate.{k}: {old.get(k)!r} in the existing journal, now {settings.get(k)!r}"
                               for k in changed],
                              hint=f"restore the setting, or delete {stage_dir / 'shards'} to regenerate")


def write_outputs(stage_dir: Path, convs: list[dict], journal_recs: dict[str, dict[int, dict]], cfg: RunConfig,
                  failures: list[dict]) -> tuple[Counter, list[dict]]:
    """Write conversations.jsonl (every conversation whose turns are all in the journal, or all up to the one
    that cuts it: `settled`) and failures.jsonl.

    Returns the conversation counts (`tool_mismatch_cut` and `turns_cut` included) and the failures written
    (`failures` plus one "not generated" row per incomplete conversation that had no failed turn this run)."""
    counts: Counter = Counter()
    failures = list(failures)
    failed_ids = {f["id"] for f in failures}

    def rows() -> Iterator[dict]:
        for conv in convs:
            turns = plan_turns(conv["messages"])
            have = journal_recs.get(conv["id"], {})
            if not turns:
                counts["conversations_no_user_turn"] += 1
                continue
            n, cut = settled(conv, have)
            recs = [have.get(t) for t in range(n if cut else len(turns))]
            if cut is not None:
                counts["turns_cut"] += len(turns) - n
            if any(r is None for r in recs):
                if cfg.generate.on_length == "drop" and any(r and r.get("finish_reason") == "length" for r in recs):
                    counts["conversations_dropped_length"] += 1
                else:
                    counts["conversations_failed"] += 1
                    if conv["id"] not in failed_ids:
                        failures.append({"id": conv["id"], "turn": recs.index(None), "reason": "not generated"})
                continue
            row = assemble(conv, [r for r in recs if r is not None], reasoning=cfg.generate.reasoning,
                           on_length=cfg.generate.on_length, cut=cut)
            if row is None:
                counts["conversations_dropped_length"] += 1
                continue
            counts["conversations_written"] += 1
            counts["tool_mismatch_cut"] += cut is not None
            yield row

    write_conversations(stage_dir, rows())
    write_failures(stage_dir, failures)
    return counts, failures


def _load_chat(cfg: RunConfig) -> Chat | None:
    """The target's chat template rendered here, when pre-flight or completions mode needs it."""
    if cfg.generate.preflight == "off" and cfg.generate.endpoint != "completions":
        return None
    try:
        return local_chat(cfg)
    except Exception as e:  # noqa: BLE001 - only completions mode needs it to go on
        if cfg.generate.endpoint == "completions":
            raise
        log.warning("pre-flight skipped: cannot render the target's chat template here (%s)", e)
        return None


def generate_conversations(cfg: RunConfig, convs: list[dict], stage_dir: Path,
                           servers: Callable[[], list[str]]) -> Generated:
    """Resume the journal in `stage_dir`, generate the missing turns, write the outputs.

    Args:
        cfg: the run config (`generate`, `server`, `run.seed`, `target` for the local chat template).
        convs: prepared conversations.
        stage_dir: the generate stage's directory.
        servers: returns the endpoint URLs (…/v1); called only when a turn is left to generate (a
            local server it starts is the caller's to stop).

    Raises:
        ConfigError: a sampling setting differs from the one an existing journal was written with.
    """
    journal = Journal(stage_dir / "shards", shard_size=cfg.generate.shard_size)
    prior = journal.open()
    done: dict[str, dict[int, dict]] = {}
    for rec in prior:
        done.setdefault(rec["id"], {})[int(rec["turn"])] = rec
    wanted = {c["id"]: len(plan_turns(c["messages"])) for c in convs}
    total_turns = sum(wanted.values())
    skipped = sum(1 for r in prior if int(r["turn"]) < wanted.get(r["id"], 0))
    counts: Counter = Counter({"turns_total": total_turns, "turns_skipped_done": skipped, "turns_ok": 0,
                               "turns_failed": 0, "turns_retried": 0, "turns_not_attempted": 0,
                               "torn_lines_dropped": journal.torn_dropped})
    todo = [c for c in convs if not _finished(c, done.get(c["id"], {}))]
    settings = sampling_settings(cfg, cfg.server.model)
    try:
        _check_settings(stage_dir, settings, len(prior))
    except BaseException:
        journal.close()
        raise
    log.info("%d conversations, %d turns (%d already done); %d conversations to go",
             len(convs), total_turns, skipped, len(todo))
    urls: list[str] = []
    run = Regenerated(settings=settings)
    progress = _Progress(total_turns, skipped, cfg.generate.progress and bool(todo))
    try:
        if todo:
            urls = servers()
            run = asyncio.run(regenerate(cfg, todo, journal, done, urls, _load_chat(cfg), progress, stage_dir))
    finally:
        progress.close()
        journal.close()
    for rec in read_records(journal.dir):
        done.setdefault(rec["id"], {})[int(rec["turn"])] = rec
    written, failures = write_outputs(stage_dir, convs, done, cfg, run.failures)
    counts.update(run.counts)
    counts.update(written)
    summary: dict[str, Any] = {k: counts[k] for k in SUMMARY_KEYS}
    summary["failed_by_reason"] = dict(run.reasons)
    summary["conversations_total"] = len(convs)
    return Generated(summary=summary, failures=failures, settings=run.settings, urls=urls,
                     chat_template_sha256=run.chat_template_sha256, preflight=run.preflight,
                     fields_refused=run.fields_refused)
