"""`dflashkit serve --drafter`: speculative decoding behind the same API, lossless, with acceptance stats."""

from __future__ import annotations

import httpx
import torch

from dflashkit.config import TargetSection
from dflashkit.export.hf import save_drafter
from dflashkit.target.load import load_target
from dflashkit.testing import random_drafter
from tests.harness.servers import serving


def test_serve_with_drafter_is_lossless_and_reports_acceptance(tiny_qwen3, tmp_path):
    target = load_target(TargetSection(path=str(tiny_qwen3)))
    save_drafter(random_drafter(target, block_size=4), tmp_path / "drafter", dtype="float32")
    tok = target.tokenizer
    msgs = [{"role": "user", "content": "Hello, speculative world"}]
    ids = tok.encode(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)
    ref = target.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=24, do_sample=False, eos_token_id=tok.eos_token_id,
                                pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
    with serving({"target": {"path": str(tiny_qwen3)}, "serve": {"drafter": str(tmp_path / "drafter")}}) as (_, url):
        out = httpx.post(url + "/chat/completions", json={"messages": msgs, "max_tokens": 24}, timeout=120).json()
        metrics = httpx.get(url[:-3] + "/metrics").json()
        models = httpx.get(url + "/models").json()["data"][0]
    choice, usage = out["choices"][0], out["usage"]
    assert choice["token_ids"] == ref  # greedy speculative output == the target's own greedy output
    acc = usage["acceptance_lengths"]
    assert acc and all(1 <= a <= 4 for a in acc) and sum(acc) >= len(ref) - 1  # the first token comes from the prefill
    assert abs(usage["mean_acceptance"] - sum(acc) / len(acc)) < 1e-9
    assert metrics["acceptance_steps"] == len(acc) and metrics["mean_acceptance"] is not None
    assert models["speculative"] is True
