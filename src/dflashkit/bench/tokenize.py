"""`dflashkit bench tokenize`: our render + mask path vs a raw batched `tokenizer(texts)` call.

Usage:
    dflashkit bench tokenize -c run.yaml            # first 1000 conversations of tokenize's input
    dflashkit bench tokenize -c run.yaml 300        # or the first N

Both paths see the same conversations and produce the same rendered texts; the raw baseline is
`tokenizer(texts, add_special_tokens=False)` over the final rendered texts (no masks, no
rendering). Reported: tokens/s of (a) our whole path (template rendering + piece tokenization +
masks), (b) our tokenization + masks given the rendered plans, (c) the raw call, and the ratios
a/c and b/c. Each timing is the best of `repeats` runs after one warm-up, all in this process.
"""

from __future__ import annotations

import logging
import os
import platform
import time
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from dflashkit.data.chat import build_samples
from dflashkit.data.records import Conversation, read_jsonl

if TYPE_CHECKING:
    from dflashkit.config import RunConfig
    from dflashkit.context import StageContext

log = logging.getLogger("dflashkit.bench")


def _best(fn, repeats: int) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def bench_tokenize(cfg: RunConfig, ctx: StageContext, src: Path, load_chat: Callable[[], Any], *,
                   repeats: int = 3) -> dict[str, Any]:
    """Tokenize the conversations in `src` our way and the raw way; `load_chat()` gives the chat template
    (`stages/bench.py` passes tokenize's input file and loader, so this module needs no stage)."""
    limit = int(ctx.positionals[1]) if len(ctx.positionals) > 1 and ctx.positionals[1].isdigit() else 1000
    convs = [Conversation.from_dict(o, f"{src}:{n}") for n, o in islice(read_jsonl(src), limit)]
    chat = load_chat()
    tok = chat.tokenizer
    tc = cfg.tokenize
    big = 1 << 30  # no truncation: both paths tokenize the same full texts

    def plan_all():
        return [p for c in convs for p in chat.plan(c, thinking=tc.thinking, system_prompt=tc.system_prompt,
                                                    rewritten_turns=tc.rewritten_turns)[0]]

    def ours_full():
        return build_samples(tok, plan_all(), max_length=big, thinking=tc.thinking)[0]

    plans = plan_all()
    texts = [p.text for p in plans]

    def ours_tok():
        return build_samples(tok, plans, max_length=big, thinking=tc.thinking)[0]

    def raw():
        return tok(texts, add_special_tokens=False)["input_ids"]

    head = plans[:32]
    build_samples(tok, head, max_length=big)  # warm-up
    tok([p.text for p in head], add_special_tokens=False)
    t_full, samples = _best(ours_full, repeats)
    t_tok, _ = _best(ours_tok, repeats)
    t_raw, raw_ids = _best(raw, repeats)
    t_render, _ = _best(plan_all, 1)
    n_ours = sum(len(s.input_ids) for s in samples)
    n_raw = sum(len(x) for x in raw_ids)
    same = sum(list(s.input_ids) == list(r) for s, r in zip(samples, raw_ids))
    result = {
        "conversations": len(convs), "samples": len(samples), "tokens": n_ours, "raw_tokens": n_raw,
        "identical_token_sequences": same,
        "ours_full_tokens_per_s": round(n_ours / t_full, 1),
        "ours_tokenize_mask_tokens_per_s": round(n_ours / t_tok, 1),
        "raw_tokens_per_s": round(n_raw / t_raw, 1),
        "ratio_full_vs_raw": round((n_ours / t_full) / (n_raw / t_raw), 3),
        "ratio_tokenize_mask_vs_raw": round((n_ours / t_tok) / (n_raw / t_raw), 3),
        "render_s": round(t_render, 4), "full_s": round(t_full, 4), "tokenize_mask_s": round(t_tok, 4),
        "raw_s": round(t_raw, 4), "repeats": repeats,
        "hardware": {"cpu_count": os.cpu_count(), "machine": platform.machine(),
                     "tokenizers_parallelism": os.environ.get("TOKENIZERS_PARALLELISM", "unset")},
    }
    if not ctx.json:
        print(f"tokenize bench: {len(samples)} samples, {n_ours} tokens | ours (render+tokenize+mask) "
              f"{result['ours_full_tokens_per_s']:.0f} tok/s | ours (tokenize+mask) "
              f"{result['ours_tokenize_mask_tokens_per_s']:.0f} tok/s | raw tokenizer(texts) "
              f"{result['raw_tokens_per_s']:.0f} tok/s | ratios {result['ratio_full_vs_raw']} / "
              f"{result['ratio_tokenize_mask_vs_raw']}")
    return result
