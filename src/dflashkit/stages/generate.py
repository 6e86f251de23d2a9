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

The loop lives in `dflashkit.generate.regenerate`. Drift guards (see `dflashkit.generate.preflight`): requests name every sampling knob servers default
differently (`generate.neutral_sampling`); before the first turn one request compares the server's
prompt with the target's chat template rendered here (`generate.preflight`, needs the target's
tokenizer); each turn keeps `usage.prompt_tokens` and the prompt ids (if returned) for `tokenize`
to compare. `generate.endpoint: completions` renders prompts here and sends text.

Agent conversations (tools, tool calls, tool results) are regenerated turn by turn with their tools; the
tool results come from the data, and a conversation whose target calls other functions than the data
answers is cut there (`dflashkit.generate.conversations`; docs/training-data.md "Regenerating agent
turns"). The server must parse the target's tool calls (vLLM: --enable-auto-tool-choice
--tool-call-parser NAME; `dflashkit serve` reads Hermes-style <tool_call> blocks).
"""

from __future__ import annotations

import logging
import sys
import time
from contextlib import ExitStack

from dflashkit.config import RunConfig, redact_url
from dflashkit.context import StageContext
from dflashkit.data.mixing import original_answer_sources
from dflashkit.data.records import read_prepared
from dflashkit.engines.launch import check_target_server, start_target_server
from dflashkit.errors import PartialFailure, PermanentFailure
from dflashkit.generate.openai_client import permanent_reason
from dflashkit.generate.conversations import plan_turns
from dflashkit.generate.regenerate import check_generate, generate_conversations
from dflashkit.target.quantized import check_local_target
from dflashkit.rundir import RunDir, file_digest, write_manifest
from dflashkit.stage_table import stage_hash

log = logging.getLogger("dflashkit.generate")


def run(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict:
    t0 = time.time()
    src = rd.prepared_train
    convs = read_prepared(src)
    original = original_answer_sources(cfg.data.sources)
    if original:  # sources trained on their own answers (raw text) are not regenerated
        kept = [c for c in convs if c.get("source") not in original]
        log.info("%d of %d conversations come from answers=original sources (%s): not regenerated",
                 len(convs) - len(kept), len(convs), ", ".join(sorted(original)))
        convs = kept
    stage_dir = rd.stage_dir("generate", create=not ctx.dry_run)
    total_turns = sum(len(plan_turns(c["messages"])) for c in convs)
    todo = check_generate(cfg, convs, stage_dir)  # every refusal before a request: the dry run's too
    if todo and not cfg.server.urls:
        check_target_server(cfg)
        if cfg.server.engine == "dflashkit":  # its `dflashkit serve` loads the target as the local paths do
            check_local_target(cfg.target)  # an unsupported quantization: exit 2 here, not in the child's log
    if ctx.dry_run:
        return {"dry_run": True, "conversations": len(convs), "turns": total_turns,
                "urls": [redact_url(u) for u in cfg.server.urls] or [f"<local {cfg.server.engine}>"]}
    with ExitStack() as stack:

        def servers() -> list[str]:
            if cfg.server.urls:
                return list(cfg.server.urls)

            return [stack.enter_context(start_target_server(cfg, log_dir=stage_dir))]

        out = generate_conversations(cfg, convs, stage_dir, servers)
    summary, reasons = out.summary, out.summary["failed_by_reason"]
    skipped = summary["turns_skipped_done"]
    urls = out.urls or list(cfg.server.urls)
    write_manifest(stage_dir, stage="generate", config_hash=stage_hash("generate", cfg),
                   inputs={"prepare/train.jsonl": file_digest(src)}, counts=summary,
                   outputs=["conversations.jsonl", "failures.jsonl", "shards/"], started=t0,
                   extra={"model": out.settings.get("model"), "server_urls": [redact_url(u) for u in urls]
                          if cfg.server.urls else [f"<local {cfg.server.engine}>"], "sampling": out.settings,
                          "chat_template_sha256": out.chat_template_sha256,
                          "preflight": out.preflight,
                          "request_token_ids": cfg.generate.request_token_ids
                          and "return_token_ids" not in out.fields_refused,
                          "fields_refused": out.fields_refused})
    log.info("generate: %d turns ok (%d already done), %d failed %s, %d retried; %d conversations written",
             summary["turns_ok"], skipped, summary["turns_failed"], reasons or "", summary["turns_retried"],
             summary["conversations_written"])
    if not ctx.json:
        print(f"turns: {summary['turns_ok']} ok, {skipped} done before, {summary['turns_failed']} failed, "
              f"{summary['turns_not_attempted']} not attempted, {summary['turns_cut']} after a tool-call cut / "
              f"{total_turns}; conversations written: {summary['conversations_written']}/{len(convs)} "
              f"({summary['tool_mismatch_cut']} cut at a tool-call mismatch)", file=sys.stderr)
    result = {"generate": summary, "conversations": str(rd.conversations_path),
              "preflight": out.preflight}
    if summary["turns_failed"] and reasons and all(permanent_reason(r) for r in reasons):
        raise PermanentFailure(
            f"generate: {summary['turns_failed']} of {total_turns} turns failed with errors a re-run repeats "
            f"({reasons}): the server refused the request itself",
            result=result, hint=f"read the server's answer in {stage_dir / 'failures.jsonl'} and fix the request "
            "(server.model, generate.max_tokens, generate.extra_body, the prompts) before re-running")
    if summary["turns_failed"] or summary["conversations_failed"]:
        raise PartialFailure(
            f"generate: {summary['turns_failed']} of {total_turns} turns failed "
            f"({summary['conversations_failed']} of {len(convs)} conversations incomplete: "
            f"{reasons or 'not generated'}): re-run to retry",
            result=result, hint=f"see {stage_dir / 'failures.jsonl'}; finished turns are kept, a re-run "
                                "of the same command retries only the failed ones")
    return result
