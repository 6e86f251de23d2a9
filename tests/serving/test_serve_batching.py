"""The batched engine's preallocated KV cache: greedy rows equal one-sequence `generate()`.

Continuous batching is exercised directly on `BatchEngine` (no HTTP): mixed prompt lengths, rows
finishing at different steps, requests joining a running batch (also with a prompt wider than the
running columns, which shifts them right), a tiny initial capacity so the buffers grow, and the
slot-freeing `keep_rows` a cancellation uses.
"""

from __future__ import annotations

import time

import pytest
import torch

from dflashkit.serving.batching import BatchEngine
from dflashkit.decode.api import SamplingParams
from dflashkit.serving.kvcache import SlotCache


def _target(path):
    from dflashkit.config import config_from_dict
    from dflashkit.target.load import load_target

    return load_target(config_from_dict({"target": {"path": str(path)}}).target)


def _reference(model, ids: list[int], n: int, eos: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    return out[0, len(ids):].tolist()


def _wait_steps(engine: BatchEngine, steps: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while engine.metrics["decode_steps"] < steps:
        assert time.monotonic() < deadline, "the engine stopped decoding"
        time.sleep(0.002)


@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v3"])
def test_continuous_batching_greedy_equals_single_sequence(tiny_targets, arch):
    target = _target(tiny_targets[arch])
    model, eos = target.model, 258
    g = torch.Generator().manual_seed(1)
    prompt = lambda n: torch.randint(0, 250, (n,), generator=g).tolist()  # noqa: E731
    # (prompt length, max_new_tokens): waves join a running batch; the 3rd wave is wider than the
    # running columns; rows finish at different steps
    waves = [[(3, 30), (17, 9), (1, 22), (9, 40)], [(5, 14), (60, 25)], [(2, 33), (41, 6), (12, 18)]]
    jobs = [[(prompt(n), m) for n, m in wave] for wave in waves]
    engine = BatchEngine(target, max_batch=8, batch_wait_ms=0, stop_token_ids=(eos,))
    engine.kv_capacity = 4
    engine._reset()
    engine.start()
    try:
        reqs = []
        for w, wave in enumerate(jobs):
            reqs += [engine.submit(ids, SamplingParams(max_new_tokens=m)) for ids, m in wave]
            if w + 1 < len(jobs):
                _wait_steps(engine, engine.metrics["decode_steps"] + 3)
        outs = [r.wait(timeout=120) for r in reqs]
    finally:
        engine.stop()
    m = engine.metrics
    assert m["batches"] >= 2 and m["decode_rows"] / m["decode_steps"] > 1.5, m  # rows really joined
    for (ids, n), out in zip([j for wave in jobs for j in wave], outs):
        ref = _reference(model, ids, n, eos)
        assert out.token_ids == ref, (len(ids), n)
        assert out.finish_reason == ("stop" if ref[-1] == eos else "length")


def _cache_kw(model) -> str:
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _dyn_layers(model, ids, mask):
    from transformers import DynamicCache

    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **{_cache_kw(model): cache})
    return cache


def test_slot_cache_keep_rows_trim_and_growth(tiny_qwen3):
    """Every cache operation leaves rows whose next-token logits equal a fresh one-row prefill."""
    model = _target(tiny_qwen3).model
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 250, (n,), generator=g).tolist() for n in (6, 2, 11, 4)]

    def prefill(rows):
        w = max(len(s) for s in rows)
        ids = torch.zeros(len(rows), w, dtype=torch.long)
        mask = torch.zeros(len(rows), w, dtype=torch.long)
        for i, s in enumerate(rows):
            ids[i, w - len(s):], mask[i, w - len(s):] = torch.tensor(s), 1
        return _dyn_layers(model, ids, mask), mask

    def next_logits(cache, rows, tok):
        mask = cache.open_column()
        pos = torch.tensor([[len(s)] for s in rows])
        out = model(input_ids=torch.tensor([[tok]] * len(rows)), attention_mask=mask, position_ids=pos,
                    use_cache=True, **{_cache_kw(model): cache}).logits[:, -1]
        cache.advance()
        for s in rows:
            s.append(tok)
        return out

    def single(s):
        return model(input_ids=torch.tensor([s])).logits[0, -1]

    with torch.inference_mode():
        cache = SlotCache(max_rows=4, capacity=2)
        cache.add_rows(*prefill(seqs[:2]))
        rows = [list(s) for s in seqs[:2]]
        for tok in (7, 8, 9):  # grows past the initial capacity
            next_logits(cache, rows, tok)
        cache.add_rows(*prefill(seqs[2:]))  # 11 tokens > 5 running columns: running rows shift right
        rows += [list(s) for s in seqs[2:]]
        out = next_logits(cache, rows, 5)
        for i, s in enumerate(rows):
            torch.testing.assert_close(out[i], single(s), rtol=1e-4, atol=1e-4)
        cache.keep_rows([1, 3])  # free slots 0 and 2 (e.g. a cancelled request)
        rows = [rows[1], rows[3]]
        assert cache.rows == 2
        lead = cache.trim()
        assert lead > 0 and bool(cache.mask[:2, 0].any())  # columns padded in both rows are gone
        out = next_logits(cache, rows, 6)
        for i, s in enumerate(rows):
            torch.testing.assert_close(out[i], single(s), rtol=1e-4, atol=1e-4)
        cache.keep_rows([])
        assert cache.rows == 0 and cache.length == 0
