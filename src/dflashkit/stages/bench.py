"""`dflashkit bench SUBJECT`: in-process benchmarks and endpoint sweeps. Human table + final JSON.

Inputs:  the run config (and, per subject, the run dir's artifacts or `bench.urls`).
Outputs: `<run_dir>/bench/<subject>.json`.
Example: dflashkit bench decode -c run.yaml

Subjects: generate (client req/s vs a local zero-latency server), tokenize (vs raw batched
tokenizer), train (drafter step vs target forward), decode (speculative vs block_size=1 vs the
reference dflash_generate), draft (one draft step: the drafter module's forward vs the lean one, fp32
and bf16), step (the target's decode step as loaded vs packed, against the memory floor), serve
(concurrency sweep over one or two OpenAI-compatible endpoints),
recipe (short training runs of recipe variants on this run's data: held-out τ, acc@1, bigram),
seqlen (train peak memory and step time of one packed row at S = 2k / 8k / 32k),
suffix (the suffix proposer's index and per-step cost at 1k / 8k / 32k-token contexts, prompt lookup beside it),
record (time to first byte and total through the recording proxy vs direct, against a local stub upstream).
Every ratio is measured in one run, warm-up excluded.
"""

from __future__ import annotations

from typing import Any, Callable

from dflashkit.bench.decode import bench_decode
from dflashkit.bench.draft import bench_draft
from dflashkit.bench.generate import bench_generate
from dflashkit.bench.recipe import bench_recipe
from dflashkit.bench.results import write_bench_result
from dflashkit.bench.seqlen import bench_seqlen
from dflashkit.bench.serve import bench_serve, check_bench_serve, failed_requests
from dflashkit.bench.step import bench_step
from dflashkit.bench.suffix import bench_suffix, contexts_from
from dflashkit.bench.tokenize import bench_tokenize
from dflashkit.bench.train import bench_train
from dflashkit.config import RunConfig
from dflashkit.context import StageContext
from dflashkit.data.chat import load_chat
from dflashkit.data.tokenizing import input_paths
from dflashkit.decode.evaluation import check_target_fits, decode_inputs
from dflashkit.errors import PartialFailure, UsageError
from dflashkit.generate.conversations import regenerated_file
from dflashkit.rundir import RunDir


def _generate(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict[str, Any]:
    return bench_generate(cfg, rd, ctx)


def _serve(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict[str, Any]:
    return bench_serve(cfg, rd, ctx)


def _tokenize(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict[str, Any]:
    return bench_tokenize(cfg, ctx, input_paths(cfg, rd, regenerated_file)[0][0], lambda: load_chat(cfg))


def _train(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict[str, Any]:
    return bench_train(cfg, rd, ctx)


def _decode(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict[str, Any]:
    return bench_decode(cfg, rd, ctx)


def _draft(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict[str, Any]:
    return bench_draft(cfg, rd, ctx)


def _step(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict[str, Any]:
    return bench_step(cfg, rd, ctx)


def _recipe(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict[str, Any]:
    return bench_recipe(cfg, rd, ctx)


def _seqlen(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict[str, Any]:
    return bench_seqlen(cfg, rd, ctx)


def _suffix(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict[str, Any]:
    return bench_suffix(cfg, rd, ctx)


def _record(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict[str, Any]:
    from dflashkit.bench.record import bench_record

    return bench_record(cfg, rd, ctx)


# subject -> the bench (each imports its module lazily: a bench's heavy imports load only when it runs)
SUBJECTS: dict[str, Callable[[RunConfig, RunDir, StageContext], dict[str, Any]]] = {
    "generate": _generate, "serve": _serve, "tokenize": _tokenize, "train": _train, "decode": _decode,
    "draft": _draft, "recipe": _recipe, "step": _step, "seqlen": _seqlen, "suffix": _suffix,
    "record": _record,
}


def _check_serve(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> None:
    check_bench_serve(cfg)


def _check_tokenize(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> None:
    input_paths(cfg, rd, regenerated_file)
    load_chat(cfg)


def _check_decode(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> None:
    check_target_fits(decode_inputs(cfg, rd, ctx.positionals[1:], num_prompts=cfg.eval.num_prompts), cfg.target)


def _check_suffix(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> None:
    contexts_from(list(ctx.positionals[1:]))


# subject -> what the bench checks before it runs (recipe checks every variant itself: `plan_variants`)
CHECKS: dict[str, Callable[[RunConfig, RunDir, StageContext], None]] = {
    "serve": _check_serve, "tokenize": _check_tokenize, "decode": _check_decode,
    "suffix": _check_suffix,
}


def run(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict:
    if not ctx.positionals or ctx.positionals[0] not in SUBJECTS:
        raise UsageError(f"`dflashkit bench` needs a subject: {' | '.join(SUBJECTS)}",
                         hint="e.g. dflashkit bench decode -c run.yaml")
    subject = ctx.positionals[0]
    if subject in CHECKS:  # the refusals a bench makes before it runs: the real run and the dry run alike
        CHECKS[subject](cfg, rd, ctx)
    if ctx.dry_run:  # nothing runs, nothing is written (and no run-dir lock is taken)
        if subject == "recipe":  # every variant is built and checked, none trains
            return {"subject": subject, **SUBJECTS[subject](cfg, rd, ctx)}
        return {"subject": subject, "dry_run": True, "would_write": str(rd.bench_result(subject))}
    result = SUBJECTS[subject](cfg, rd, ctx)
    write_bench_result(rd, subject, result)
    if subject == "serve":  # a sweep whose requests failed measured nothing: never a silent 0 tok/s

        failed, sent = failed_requests(result)
        if failed:
            raise PartialFailure(f"bench serve: {failed} of {sent} timed requests failed (their rows in "
                                 f"{rd.bench_result(subject)} count only the answered ones)",
                                 result={"subject": subject, **result},
                                 hint="check the endpoint (bench.urls, server.model) and its log, then re-run")
    return {"subject": subject, **result}
