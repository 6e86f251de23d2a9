"""`dflashkit bench suffix`: the suffix proposer's cost per decode step at long contexts, prompt lookup beside it.

Usage:
    dflashkit bench suffix -c run.yaml                   # contexts of 1k, 8k and 32k tokens
    dflashkit bench suffix -c run.yaml 2048 65536        # other contexts (positionals, in tokens)

Needs nothing from the run (no target, no run dir artifacts): the text is synthetic, token ids drawn from a
32k vocabulary with a Zipf law, with 60 % of it copied from earlier spans of 1–32 tokens (the repeats suffix
matching lives on, as agent traffic's tool arguments and identifiers). Per context n, in one process: the
one-time cost of indexing an n-token prompt (`SuffixProposer.begin`), then `steps` decode steps that each
propose B − 1 = 7 tokens and commit 2 (the next call indexes them), timed per step; the same with a pool that
holds one earlier request of n tokens of the same text; and prompt lookup's propose at the same lengths.
Each per-step number is the median over the steps. The CPU is printed: these are Python-level costs.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import TYPE_CHECKING, Any

from dflashkit.decode.ngram import PromptLookupProposer
from dflashkit.decode.suffix import SuffixPool, SuffixProposer
from dflashkit.errors import UsageError

if TYPE_CHECKING:
    from dflashkit.config import RunConfig
    from dflashkit.context import StageContext
    from dflashkit.rundir import RunDir

CONTEXTS = (1024, 8192, 32768)
DRAFT = 7       # B − 1 at B = 8
COMMIT = 2      # tokens committed per step


def synthetic_text(n: int, seed: int = 0, vocab: int = 32768) -> list[int]:
    """n token ids: Zipf-distributed fresh tokens, and copies of earlier spans (60 % of the tokens)."""
    rng = random.Random(seed)
    weights = [1.0 / (r + 1) for r in range(vocab)]
    fresh = iter(rng.choices(range(vocab), weights=weights, k=n + 1))
    out: list[int] = [next(fresh)]
    while len(out) < n:
        if rng.random() < 0.6 and len(out) > 8:
            s = rng.randrange(len(out))
            out += out[s:s + rng.randint(1, 32)]
        else:
            out.append(next(fresh))
    return out[:n]


def _per_step(propose: Any, text: list[int], n: int, steps: int) -> list[float]:
    times = []
    for i in range(steps):
        seq = text[: n + i * COMMIT]
        t0 = time.perf_counter()
        propose(seq, DRAFT)
        times.append(time.perf_counter() - t0)
    return times


def measure(n: int, steps: int) -> dict[str, Any]:
    """One context's row (seconds)."""
    text = synthetic_text(n + steps * COMMIT, seed=n)
    prompt = text[:n]
    sp = SuffixProposer()
    t0 = time.perf_counter()
    sp.begin(prompt)
    index_s = time.perf_counter() - t0
    suffix = _per_step(sp.propose, text, n, steps)
    nodes = sp._trie.live
    pool = SuffixPool(max_tokens=4 * n)
    t0 = time.perf_counter()
    pool.add(synthetic_text(n, seed=n + 1))
    pool_index_s = time.perf_counter() - t0
    pooled = SuffixProposer(pool=pool)
    pooled.begin(prompt)
    with_pool = _per_step(pooled.propose, text, n, steps)
    lookup = _per_step(PromptLookupProposer().propose, text, n, steps)
    return {"context": n, "steps": steps, "index_prompt_s": index_s, "index_pool_request_s": pool_index_s,
            "suffix_step_s": statistics.median(suffix), "suffix_pool_step_s": statistics.median(with_pool),
            "lookup_step_s": statistics.median(lookup), "nodes_per_token": round(nodes / n, 3)}


def contexts_from(positionals: list[str]) -> tuple[int, ...]:
    """The contexts named on the command line (after the subject), else 1k / 8k / 32k."""
    if not positionals:
        return CONTEXTS
    try:
        out = tuple(int(p) for p in positionals)
    except ValueError:
        raise UsageError(f"bench suffix: contexts are token counts, got {' '.join(positionals)}",
                         hint="e.g. dflashkit bench suffix -c run.yaml 1024 8192") from None
    if any(c < 2 for c in out):
        raise UsageError(f"bench suffix: each context must be >= 2 tokens, got {' '.join(positionals)}")
    return out


def bench_suffix(cfg: RunConfig, rd: RunDir, ctx: StageContext, *, steps: int = 200) -> dict[str, Any]:
    from dflashkit.target.load import cpu_facts

    contexts = contexts_from(list(ctx.positionals[1:]))
    cpu = cpu_facts()
    if not ctx.json:
        print(f"CPU: {cpu.get('cpu') or 'unknown'}  (Python-level costs; B = {DRAFT + 1}, {COMMIT} tokens "
              f"committed per step, median of {steps} steps)", flush=True)
        print(f"{'context':>8} {'index prompt ms':>16} {'suffix µs/step':>15} {'+pool µs/step':>14} "
              f"{'lookup µs/step':>15} {'nodes/token':>12}", flush=True)
    rows = []
    for n in contexts:
        r = measure(n, steps)
        rows.append(r)
        if not ctx.json:
            print(f"{n:>8} {r['index_prompt_s'] * 1e3:>16.1f} {r['suffix_step_s'] * 1e6:>15.1f} "
                  f"{r['suffix_pool_step_s'] * 1e6:>14.1f} {r['lookup_step_s'] * 1e6:>15.1f} "
                  f"{r['nodes_per_token']:>12.3f}", flush=True)
    return {"cpu": cpu, "draft_tokens": DRAFT, "commit_per_step": COMMIT, "rows": rows}
