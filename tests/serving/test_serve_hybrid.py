"""`dflashkit serve` on hybrid targets (linear-attention / Mamba layers beside attention), over real HTTP on
127.0.0.1: the batched engine (a cache per row) and the speculative engine give the target's own greedy output."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from dflashkit.config import TargetSection
from dflashkit.export.hf import save_drafter
from dflashkit.target.load import load_target
from dflashkit.testing import random_drafter
from tests.harness.hybrid import make_tiny_hybrid_target
from tests.harness.servers import serving

MESSAGES = ["Hello, hybrid world", "Write a haiku about the sea, please.", "x" * 23, "ok"]


def _reference(target, ids: list[int], n: int) -> list[int]:
    tok = target.tokenizer
    with torch.inference_mode():
        out = target.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=n, do_sample=False, eos_token_id=tok.eos_token_id,
                                    pad_token_id=tok.pad_token_id)
    return out[0, len(ids):].tolist()


def _prompt_ids(target, content: str) -> list[int]:
    tok = target.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def _chat(url: str, content: str) -> dict:
    r = httpx.post(url + "/chat/completions", json={"messages": [{"role": "user", "content": content}],
                                                     "max_tokens": 16}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("arch", ["qwen3_next", "bamba"])
def test_serve_batches_a_hybrid_target_losslessly(tmp_path, arch):
    """Concurrent requests (rows joining and leaving a running batch) each get the target's greedy output."""
    path = make_tiny_hybrid_target(tmp_path / arch, arch)
    target = load_target(TargetSection(path=str(path), device="cpu", dtype="float32"))
    with serving({"target": {"path": str(path)}, "serve": {"max_batch": 4, "batch_wait_ms": 20}}) as (app, url):
        with ThreadPoolExecutor(len(MESSAGES)) as pool:
            outs = list(pool.map(lambda m: _chat(url, m), MESSAGES))
        metrics = httpx.get(url[: -len("/v1")] + "/metrics").json()
    assert metrics["errors"] == 0 and metrics["requests"] == len(MESSAGES)
    for msg, out in zip(MESSAGES, outs):
        ids = _prompt_ids(target, msg)
        assert out["usage"]["prompt_tokens"] == len(ids)
        ref = _reference(target, ids, 16)
        assert out["choices"][0]["token_ids"] == ref, msg


def test_serve_with_a_drafter_on_a_hybrid_target_is_lossless(tmp_path):
    path = make_tiny_hybrid_target(tmp_path / "qwen3_5", "qwen3_5")
    target = load_target(TargetSection(path=str(path), device="cpu", dtype="float32"))
    save_drafter(random_drafter(target, block_size=4), tmp_path / "drafter", dtype="float32")
    with serving({"target": {"path": str(path)}, "serve": {"drafter": str(tmp_path / "drafter")}}) as (_, url):
        out = _chat(url, MESSAGES[0])
    ref = _reference(target, _prompt_ids(target, MESSAGES[0]), 16)
    assert out["choices"][0]["token_ids"] == ref
    acc = out["usage"]["acceptance_lengths"]
    assert acc and all(1 <= a <= 4 for a in acc)
