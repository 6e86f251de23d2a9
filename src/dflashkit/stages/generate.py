"""`dflashkit generate`: regenerate every assistant turn with the target through OpenAI-compatible servers.

Inputs:  `prepare/train.jsonl`; `server.urls` (SGLang, vLLM, llama.cpp, `dflashkit serve`), or none:
         then `dflashkit serve` is started for `target.path` on 127.0.0.1 and stopped at the end.
Outputs: `generate/shards/part-*.jsonl` (append-only journal, one line per finished turn),
         `generate/conversations.jsonl` (rebuilt atomically: conversations whose every turn is ok),
         `generate/failures.jsonl`, `generate/settings.json`, `generate/manifest.json`.
Example: dflashkit generate -c run.yaml server.urls='[http://gpu1:30000/v1,http://gpu2:30000/v1]'

Resuming is exactly-once: a re-run (after a crash, kill or failures) skips the (id, turn) pairs the
journal holds and generates the rest; turns that failed are retried. Changing a sampling setting
with a non-empty journal is refused (delete `generate/shards` to start over).

Drift guards (see `dflashkit.serving.preflight`): requests name every sampling knob servers default
differently (`generate.neutral_sampling`); before the first turn one request compares the server's
prompt with the target's chat template rendered here (`generate.preflight`, needs the target's
tokenizer); each turn keeps `usage.prompt_tokens` and the prompt ids (if returned) for `tokenize`
to compare. `generate.endpoint: completions` renders prompts here and sends text.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections import Counter
from contextlib import ExitStack
from typing import Any

from dflashkit.config import RunConfig, redact_url, section_hash
from dflashkit.context import StageContext
from dflashkit.data.drift import describe, ids_summary
from dflashkit.errors import ConfigError, PartialFailure, UsageError
from dflashkit.rundir import RunDir, atomic_path, atomic_write_json, file_digest, read_json, write_manifest
from dflashkit.data.mixing import original_answer_sources
from dflashkit.serving.conversations import assemble, build_prompt, load_prepared, plan_turns
from dflashkit.serving.journal import Journal, read_records
from dflashkit.serving.openai_client import OpenAIClient, RequestFailed
from dflashkit.serving.preflight import (Sender, local_chat, local_prompt_ids, preflight, request_body,
                                         sampling_settings)

log = logging.getLogger("dflashkit.generate")


async def _preflight(cfg, sender: Sender, settings: dict[str, Any], chat, convs) -> dict[str, Any]:
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
    text = chat.render(messages, add_generation_prompt=True)
    prompt = text if cfg.generate.endpoint == "completions" else None
    body = request_body(settings, messages, token_ids=cfg.generate.request_token_ids, prompt=prompt)
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
    """tqdm on stderr: turns done/total, requests/s, generated tokens/s, ETA."""

    def __init__(self, total: int, initial: int, enabled: bool):
        self.bar = None
        self.tokens = 0
        self.t0 = time.monotonic()
        self._last = 0.0
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="turn", file=sys.stderr, dynamic_ncols=True,
                            desc="generate", smoothing=0.1)

    def update(self, tokens: int) -> None:
        self.tokens += tokens
        if self.bar is None:
            return
        self.bar.update(1)
        now = time.monotonic()
        if now - self._last > 0.5:
            self._last = now
            self.bar.set_postfix_str(f"{self.tokens / max(now - self.t0, 1e-9):.0f} tok/s", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


async def _regenerate(cfg, convs, journal: Journal, done: dict[str, dict[int, dict]], urls: list[str],
                      counts: Counter, reasons: Counter, failures: list[dict], progress: _Progress,
                      settings_box: dict[str, Any], stage_dir, server_info: dict[str, Any], chat) -> None:
    g = cfg.generate
    client = OpenAIClient(urls, concurrency=g.concurrency, timeout_s=cfg.server.timeout_s,
                          max_retries=g.max_retries, backoff_s=g.backoff_s,
                          api_key_env=cfg.server.api_key_env, seed=cfg.run.seed, http_client=g.http_client)
    async with client:
        try:
            info = await client.model_info()
        except Exception:  # noqa: BLE001 - /v1/models is optional when server.model is set
            if not cfg.server.model:
                raise
            info = {}
        model = cfg.server.model or str(info["id"])
        settings_box.update(sampling_settings(cfg, model))
        settings = dict(settings_box)
        atomic_write_json(stage_dir / "settings.json", settings)
        server_info["chat_template_sha256"] = info.get("chat_template_sha256")
        sender = Sender(client, "completions" if g.endpoint == "completions" else "chat")
        server_info["preflight"] = await _preflight(cfg, sender, settings, chat, convs)
        queue: asyncio.Queue = asyncio.Queue()
        for conv in convs:
            queue.put_nowait(conv)

        async def run_conversation(conv: dict[str, Any]) -> None:
            turns = plan_turns(conv["messages"])
            have = done.get(conv["id"], {})
            answers: list[str] = []
            for t in range(len(turns)):
                rec = have.get(t)
                if rec is None:
                    prompt = build_prompt(conv["messages"], turns, answers, t)
                    text = chat.render(prompt, add_generation_prompt=True) if g.endpoint == "completions" \
                        else None
                    try:
                        reply = await sender.send(request_body(settings, prompt, token_ids=g.request_token_ids,
                                                               prompt=text))
                    except RequestFailed as e:
                        counts["turns_failed"] += 1
                        counts["turns_retried"] += e.attempts > 1
                        reasons[e.reason] += 1
                        failures.append({"id": conv["id"], "turn": t, "reason": e.reason, "detail": e.detail,
                                         "attempts": e.attempts})
                        counts["turns_not_attempted"] += len(turns) - t - 1
                        return
                    rec = {"id": conv["id"], "turn": t, "content": reply.content, "reasoning": reply.reasoning,
                           "finish_reason": reply.finish_reason, "token_ids": reply.token_ids,
                           "model": reply.model or model, "url": redact_url(reply.url), "attempts": reply.attempts,
                           "completion_tokens": reply.usage.get("completion_tokens"),
                           "prompt_tokens": reply.usage.get("prompt_tokens"),
                           "prompt_ids": ids_summary(reply.prompt_token_ids)}
                    journal.append(rec)
                    counts["turns_ok"] += 1
                    counts["turns_retried"] += reply.attempts > 1
                    progress.update(int(reply.usage.get("completion_tokens") or 0))
                answers.append(rec["content"])
                if g.on_length == "drop" and rec.get("finish_reason") == "length":
                    counts["turns_not_attempted"] += len(turns) - t - 1
                    return

        async def worker() -> None:
            while True:
                try:
                    conv = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                await run_conversation(conv)

        await asyncio.gather(*(worker() for _ in range(min(g.concurrency, max(1, len(convs))))))
        counts["requests_sent"] = client.stats["requests"]
        counts["retries"] = client.stats["retries"]
        server_info["fields_refused"] = sorted(sender.dropped)


def _check_settings(stage_dir, settings: dict[str, Any], journal_keys: int) -> None:
    path = stage_dir / "settings.json"
    if journal_keys and path.is_file():
        old = read_json(path)
        # keys an older journal's settings.json lacks were not settings then: not a change
        changed = sorted(k for k in settings if k != "model" and k in old and old.get(k) != settings.get(k))
        if changed:
            raise ConfigError([f"generate.{k}: {old.get(k)!r} in the existing journal, now {settings.get(k)!r}"
                               for k in changed],
                              hint=f"restore the setting, or delete {stage_dir / 'shards'} to regenerate")


def _write_outputs(stage_dir, convs, journal_recs: dict[str, dict[int, dict]], cfg, failures, counts: Counter,
                   ) -> None:
    failed_ids = {f["id"] for f in failures}
    with atomic_path(stage_dir / "conversations.jsonl") as tmp, open(tmp, "w", encoding="utf-8") as out:
        for conv in convs:
            turns = plan_turns(conv["messages"])
            have = journal_recs.get(conv["id"], {})
            recs = [have.get(t) for t in range(len(turns))]
            if not turns:
                counts["conversations_no_user_turn"] += 1
                continue
            if any(r is None for r in recs):
                if cfg.generate.on_length == "drop" and any(r and r.get("finish_reason") == "length" for r in recs):
                    counts["conversations_dropped_length"] += 1
                else:
                    counts["conversations_failed"] += 1
                    if conv["id"] not in failed_ids:
                        failures.append({"id": conv["id"], "turn": recs.index(None), "reason": "not generated"})
                continue
            row = assemble(conv, recs, reasoning=cfg.generate.reasoning, on_length=cfg.generate.on_length)
            if row is None:
                counts["conversations_dropped_length"] += 1
                continue
            counts["conversations_written"] += 1
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
    with atomic_path(stage_dir / "failures.jsonl") as tmp:
        tmp.write_text("".join(json.dumps(f, ensure_ascii=False) + "\n" for f in failures), encoding="utf-8")


def run(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict:
    t0 = time.time()
    src = rd.stage_dir("prepare", create=False) / "train.jsonl"
    convs = load_prepared(src)
    original = original_answer_sources(cfg.data.sources)
    if original:  # sources trained on their own answers (raw text) are not regenerated
        kept = [c for c in convs if c.get("source") not in original]
        log.info("%d of %d conversations come from answers=original sources (%s): not regenerated",
                 len(convs) - len(kept), len(convs), ", ".join(sorted(original)))
        convs = kept
    stage_dir = rd.stage_dir("generate", create=not ctx.dry_run)
    total_turns = sum(len(plan_turns(c["messages"])) for c in convs)
    if ctx.dry_run:
        return {"dry_run": True, "conversations": len(convs), "turns": total_turns,
                "urls": [redact_url(u) for u in cfg.server.urls] or [f"<local {cfg.server.engine}>"]}
    journal = Journal(stage_dir / "shards", shard_size=cfg.generate.shard_size)
    prior = journal.open()
    done: dict[str, dict[int, dict]] = {}
    for rec in prior:
        done.setdefault(rec["id"], {})[int(rec["turn"])] = rec
    wanted = {c["id"]: len(plan_turns(c["messages"])) for c in convs}
    skipped = sum(1 for r in prior if int(r["turn"]) < wanted.get(r["id"], 0))
    counts: Counter = Counter({"turns_total": total_turns, "turns_skipped_done": skipped, "turns_ok": 0,
                               "turns_failed": 0, "turns_retried": 0, "turns_not_attempted": 0,
                               "torn_lines_dropped": journal.torn_dropped})
    reasons: Counter = Counter()
    failures: list[dict] = []
    todo = [c for c in convs if len(done.get(c["id"], {})) < wanted[c["id"]]]
    settings_box: dict[str, Any] = sampling_settings(cfg, cfg.server.model)
    _check_settings(stage_dir, settings_box, len(prior))
    urls = list(cfg.server.urls)
    server_info: dict[str, Any] = {}
    log.info("%d conversations, %d turns (%d already done); %d conversations to go",
             len(convs), total_turns, skipped, len(todo))
    progress = _Progress(total_turns, skipped, cfg.generate.progress and bool(todo))
    try:
        with ExitStack() as stack:
            if todo:
                if not urls:
                    from dflashkit.engines.launch import start_target_server

                    urls = [stack.enter_context(start_target_server(cfg, log_dir=stage_dir))]
                chat = None
                if cfg.generate.preflight != "off" or cfg.generate.endpoint == "completions":
                    try:
                        chat = local_chat(cfg)
                    except Exception as e:  # noqa: BLE001 - only completions mode needs it to go on
                        if cfg.generate.endpoint == "completions":
                            raise
                        log.warning("pre-flight skipped: cannot render the target's chat template here (%s)", e)
                asyncio.run(_regenerate(cfg, todo, journal, done, urls, counts, reasons, failures, progress,
                                        settings_box, stage_dir, server_info, chat))
    finally:
        progress.close()
        journal.close()
    for rec in read_records(journal.dir):
        done.setdefault(rec["id"], {})[int(rec["turn"])] = rec
    _write_outputs(stage_dir, convs, done, cfg, failures, counts)
    counts["turns_failed_by_reason"] = dict(reasons)  # type: ignore[assignment]
    summary = {k: counts[k] for k in ("turns_total", "turns_skipped_done", "turns_ok", "turns_retried",
                                      "turns_failed", "turns_not_attempted", "requests_sent", "retries",
                                      "torn_lines_dropped", "conversations_written",
                                      "conversations_dropped_length", "conversations_failed",
                                      "conversations_no_user_turn")}
    summary["failed_by_reason"] = dict(reasons)
    summary["conversations_total"] = len(convs)
    write_manifest(stage_dir, stage="generate", config_hash=section_hash(cfg.generate, cfg.server.model),
                   inputs={"prepare/train.jsonl": file_digest(src)}, counts=summary,
                   outputs=["conversations.jsonl", "failures.jsonl", "shards/"], started=t0,
                   extra={"model": settings_box.get("model"), "server_urls": [redact_url(u) for u in urls]
                          if cfg.server.urls else [f"<local {cfg.server.engine}>"], "sampling": settings_box,
                          "chat_template_sha256": server_info.get("chat_template_sha256"),
                          "preflight": server_info.get("preflight"),
                          "request_token_ids": cfg.generate.request_token_ids
                          and "return_token_ids" not in server_info.get("fields_refused", []),
                          "fields_refused": server_info.get("fields_refused", [])})
    log.info("generate: %d turns ok (%d already done), %d failed %s, %d retried; %d conversations written",
             summary["turns_ok"], skipped, summary["turns_failed"], dict(reasons) or "", summary["turns_retried"],
             summary["conversations_written"])
    if not ctx.json:
        print(f"turns: {summary['turns_ok']} ok, {skipped} done before, {summary['turns_failed']} failed, "
              f"{summary['turns_not_attempted']} not attempted / {total_turns}; conversations written: "
              f"{summary['conversations_written']}/{len(convs)}", file=sys.stderr)
    result = {"generate": summary, "conversations": str(stage_dir / "conversations.jsonl"),
              "preflight": server_info.get("preflight")}
    if summary["turns_failed"] or summary["conversations_failed"]:
        raise PartialFailure(
            f"generate: {summary['turns_failed']} of {total_turns} turns failed "
            f"({summary['conversations_failed']} of {len(convs)} conversations incomplete: "
            f"{dict(reasons) or 'not generated'}): re-run to retry",
            result=result, hint=f"see {stage_dir / 'failures.jsonl'}; finished turns are kept, a re-run "
                                "of the same command retries only the failed ones")
    return result
