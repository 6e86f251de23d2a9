"""`serve.proposer: suffix | lookup | hybrid` over real HTTP: the target's greedy output, and a suffix pool per tenant."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from dflashkit.cli import main
from dflashkit.config import TargetSection, config_from_dict
from dflashkit.errors import UsageError
from dflashkit.export.hf import save_drafter
from dflashkit.target.load import load_target
from dflashkit.serve_app import build_app, check_serve_proposer
from dflashkit.testing import random_drafter
from tests.harness.servers import serving

PROMPTS = ["Hello, suffix world", "a b c a b c a b", "Write a haiku about the sea, please."]
N = 24


def _reference(target, content: str) -> list[int]:
    tok = target.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True), add_special_tokens=False)
    with torch.inference_mode():
        out = target.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=N, do_sample=False, eos_token_id=tok.eos_token_id,
                                    pad_token_id=tok.pad_token_id)
    return out[0, len(ids):].tolist()


def _chat(url: str, content: str, user: str | None = None, header: str | None = None) -> dict:
    body: dict = {"messages": [{"role": "user", "content": content}], "max_tokens": N}
    if user is not None:
        body["user"] = user
    r = httpx.post(url + "/chat/completions", json=body, headers={"X-Tenant": header} if header else {}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("proposer", ["suffix", "lookup"])
def test_training_free_proposers_answer_as_the_plain_target(tiny_qwen3, proposer):
    target = load_target(TargetSection(path=str(tiny_qwen3)))
    with serving({"target": {"path": str(tiny_qwen3)}, "serve": {"proposer": proposer}}) as (app, url):
        outs = [_chat(url, p) for p in PROMPTS]
        models = httpx.get(url + "/models").json()["data"][0]
    for p, out in zip(PROMPTS, outs):
        ids, acc = out["choices"][0]["token_ids"], out["usage"]["acceptance_lengths"]
        assert ids == _reference(target, p), p
        assert acc and all(1 <= a <= 8 for a in acc) and sum(acc) >= len(ids) - 1
    assert models["speculative"] is True and type(app.engine.decoder.proposer).__name__ == {
        "suffix": "SuffixProposer", "lookup": "PromptLookupProposer"}[proposer]


def test_each_tenant_matches_only_its_own_earlier_requests(tiny_qwen3):
    content = PROMPTS[2]
    with serving({"target": {"path": str(tiny_qwen3)}, "serve": {"proposer": "suffix"}}) as (app, url):
        first = _chat(url, content, user="alice")
        again = _chat(url, content, user="alice")                 # alice's pool holds her first request
        other = _chat(url, content, header="bob")                 # bob's pool is empty
        bad = httpx.post(url + "/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "user": 5})
        pool = app.engine.decoder.proposer.pool
        alice, bob = pool.requests("alice"), pool.requests("bob")
    assert bad.status_code == 400 and "`user`" in bad.json()["error"]["message"]
    ids = first["choices"][0]["token_ids"]
    assert again["choices"][0]["token_ids"] == ids == other["choices"][0]["token_ids"]
    # the repeat is drafted from alice's first answer: every step but a cut last one verifies a full block
    acc = again["usage"]["acceptance_lengths"]
    assert acc[:-1] == [8] * (len(acc) - 1)
    assert other["usage"]["acceptance_lengths"] == first["usage"]["acceptance_lengths"] != acc
    assert len(alice) == 2 and len(bob) == 1 and alice[0][-len(ids):] == ids and bob[0] == alice[0]


def test_shared_tenants_share_one_pool(tiny_qwen3):
    content = PROMPTS[2]
    cfg = {"target": {"path": str(tiny_qwen3)}, "serve": {"proposer": "suffix", "suffix_share_tenants": True}}
    with serving(cfg) as (_, url):
        _chat(url, content, user="alice")
        acc = _chat(url, content, user="bob")["usage"]["acceptance_lengths"]
    assert acc[:-1] == [8] * (len(acc) - 1)


def test_hybrid_serves_the_target_output(tiny_qwen3, tmp_path):
    target = load_target(TargetSection(path=str(tiny_qwen3)))
    save_drafter(random_drafter(target, block_size=4), tmp_path / "drafter", dtype="float32")
    cfg = {"target": {"path": str(tiny_qwen3)}, "serve": {"proposer": "hybrid", "drafter": str(tmp_path / "drafter"),
                                                         "hybrid_min_match": 2}}
    with serving(cfg) as (app, url):
        outs = [_chat(url, p, user="t") for p in PROMPTS[1:]]
        pool = app.engine.decoder.hybrid.suffix.pool
        kept = pool.requests("t")
    for p, out in zip(PROMPTS[1:], outs):
        assert out["choices"][0]["token_ids"] == _reference(target, p), p
    assert len(kept) == 2


def test_proposers_that_need_a_drafter_are_refused_before_loading(tmp_path, capsys):
    for proposer in ("drafter", "hybrid"):
        with pytest.raises(UsageError, match=f"serve.proposer={proposer} needs a drafter"):
            check_serve_proposer(config_from_dict({"serve": {"proposer": proposer}}))
    with pytest.raises(UsageError, match="suffix_pool_tokens"):             # before the (absent) model loads
        build_app(config_from_dict({"target": {"path": str(tmp_path / "none")},
                                    "serve": {"proposer": "suffix", "suffix_pool_tokens": -1}}))
    assert main(["serve", str(tmp_path), "--dry-run", "serve.port=0", "serve.proposer=hybrid"]) == 2
    assert "needs a drafter" in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--dry-run", "--json", "serve.port=0", "serve.proposer=suffix"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["proposer"] == "suffix"
