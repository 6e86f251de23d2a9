"""`dflashkit bench SUBJECT`: in-process benchmarks and endpoint sweeps. Human table + final JSON.

Inputs:  the run config (and, per subject, the run dir's artifacts or `bench.urls`).
Outputs: `<run_dir>/bench/<subject>.json`.
Example: dflashkit bench decode -c run.yaml

Subjects: generate (client req/s vs a local zero-latency server), tokenize (vs raw batched
tokenizer), train (drafter step vs target forward), decode (speculative vs block_size=1 vs the
reference dflash_generate), serve (concurrency sweep over one or two OpenAI-compatible endpoints),
recipe (short training runs of recipe variants on this run's data: held-out τ, acc@1, bigram).
Every ratio is measured in one run, warm-up excluded.
"""

from __future__ import annotations

import importlib

from dflashkit.errors import UsageError
from dflashkit.rundir import atomic_write_json

SUBJECTS = {
    "generate": "dflashkit.serving.bench:bench_generate",
    "serve": "dflashkit.serving.bench:bench_serve",
    "tokenize": "dflashkit.data.bench:bench_tokenize",
    "train": "dflashkit.train.bench:bench_train",
    "decode": "dflashkit.decode.bench:bench_decode",
    "recipe": "dflashkit.train.ablation:bench_recipe",
}


def run(cfg, rd, ctx) -> dict:
    if not ctx.positionals or ctx.positionals[0] not in SUBJECTS:
        raise UsageError(f"`dflashkit bench` needs a subject: {' | '.join(SUBJECTS)}",
                         hint="e.g. dflashkit bench decode -c run.yaml")
    subject = ctx.positionals[0]
    module_name, fn_name = SUBJECTS[subject].split(":")
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except (ModuleNotFoundError, AttributeError):
        raise UsageError(f"`dflashkit bench {subject}` is not implemented yet") from None
    result = fn(cfg, rd, ctx)
    atomic_write_json(rd.stage_dir("bench") / f"{subject}.json", result)
    return {"subject": subject, **result}
