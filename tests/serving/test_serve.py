"""`dflashkit serve` over a tiny Qwen3: template, batching invariance, streaming, routes, errors."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from dflashkit.config import config_from_dict
from dflashkit.stages.serve import build_app
from tests.harness.servers import serving

PROMPTS = ["hi", "Write a haiku about the sea, please.", "x" * 37, "What is 2+2?", "Tell me a story",
           "ok", "Explain speculative decoding in one paragraph."]


@pytest.fixture(scope="module")
def served(tiny_qwen3):
    with serving({"target": {"path": str(tiny_qwen3)},
                  "serve": {"max_batch": 8, "batch_wait_ms": 40, "model_name": "tiny"}}) as app_url:
        yield app_url


def chat(url: str, content: str, **kw) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 24, **kw}
    r = httpx.post(url + "/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_routes(served):
    app, url = served
    root = url[: -len("/v1")]
    assert httpx.get(root + "/health").json() == {"status": "ok"}
    models = httpx.get(url + "/models").json()["data"]
    assert models[0]["id"] == "tiny" and len(models[0]["chat_template_sha256"]) == 64
    chat(url, "hello")
    m = httpx.get(root + "/metrics").json()
    assert m["requests"] >= 1 and m["completion_tokens"] >= 1 and m["prompt_tokens"] >= 1
    assert httpx.get(url + "/nope").status_code == 404


def test_chat_template_and_greedy_match_hf(served):
    app, url = served
    tok = app.tok
    msgs = [{"role": "system", "content": "be nice"}, {"role": "user", "content": "Hello there"}]
    out = httpx.post(url + "/chat/completions", json={"messages": msgs, "max_tokens": 20}, timeout=60).json()
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok.encode(text, add_special_tokens=False)
    assert out["usage"]["prompt_tokens"] == len(ids)
    model = app.engine.target.model
    ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=20, do_sample=False, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
    choice = out["choices"][0]
    assert choice["token_ids"] == ref
    assert choice["message"]["content"] == tok.decode(ref, skip_special_tokens=True)
    assert choice["finish_reason"] == ("stop" if ref[-1] == tok.eos_token_id else "length")
    assert out["usage"]["completion_tokens"] == len(ref)


def test_batched_greedy_equals_single(served):
    app, url = served
    single = [chat(url, p, max_tokens=12 + 3 * i)["choices"][0] for i, p in enumerate(PROMPTS)]
    before = dict(app.engine.metrics)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        batched = list(pool.map(lambda ip: chat(url, ip[1], max_tokens=12 + 3 * ip[0])["choices"][0],
                                enumerate(PROMPTS)))
    batches = app.engine.metrics["batches"] - before["batches"]
    assert batches < len(PROMPTS), "requests were not batched"
    for s, b in zip(single, batched):
        assert s["token_ids"] == b["token_ids"] and s["message"] == b["message"]
    # staggered arrivals join the running batch between decode steps (continuous batching): request i is sent
    # once the engine has run i decode steps of this phase, while the earlier ones (12 + 3j tokens) still
    # decode, whatever this machine's step time (arrivals 30 ms apart found the batch empty on a fast machine,
    # where a request's 12 tokens take less)
    before = dict(app.engine.metrics)

    def late(ip):
        deadline = time.monotonic() + 60
        while app.engine.metrics["decode_steps"] < before["decode_steps"] + ip[0] and time.monotonic() < deadline:
            time.sleep(0.001)
        return chat(url, ip[1], max_tokens=12 + 3 * ip[0])["choices"][0]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        staggered = list(pool.map(late, enumerate(PROMPTS)))
    m = app.engine.metrics
    rows = (m["decode_rows"] - before["decode_rows"]) / (m["decode_steps"] - before["decode_steps"])
    assert rows > 1.5, f"mean running batch {rows:.2f}: late requests did not join"
    assert m["batches"] - before["batches"] > 1
    for s, b in zip(single, staggered):
        assert s["token_ids"] == b["token_ids"]


def test_stream_equals_non_stream(served):
    _, url = served
    for p in PROMPTS[:3]:
        full = chat(url, p, max_tokens=30)["choices"][0]
        body = {"messages": [{"role": "user", "content": p}], "max_tokens": 30, "stream": True}
        pieces, final = [], None
        with httpx.stream("POST", url + "/chat/completions", json=body, timeout=60) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        for ln in lines[:-1]:
            c = json.loads(ln[6:])["choices"][0]
            pieces.append(c.get("delta", {}).get("content") or "")
            if c["finish_reason"]:
                final = c
        assert "".join(pieces) == full["message"]["content"]
        assert final["token_ids"] == full["token_ids"] and final["finish_reason"] == full["finish_reason"]
    plain = httpx.post(url + "/completions", json={"prompt": "abc", "max_tokens": 20}, timeout=60).json()
    with httpx.stream("POST", url + "/completions", json={"prompt": "abc", "max_tokens": 20, "stream": True},
                      timeout=60) as r:
        chunks = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["choices"][0]["text"]
    assert chunks[-1]["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]


def test_completions_stop_strings_and_sampling(served):
    app, url = served
    r = httpx.post(url + "/completions", json={"prompt": "Once upon", "max_tokens": 16}, timeout=60).json()
    text = r["choices"][0]["text"]
    assert r["object"] == "text_completion"
    assert r["usage"]["completion_tokens"] == 16 == len(r["choices"][0]["token_ids"])
    stop = text[5:7]
    cut = httpx.post(url + "/completions", json={"prompt": "Once upon", "max_tokens": 16, "stop": [stop]},
                     timeout=60).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["text"] == text[: text.find(stop)]
    a = chat(url, "roll", temperature=1.0, seed=7)["choices"][0]["token_ids"]
    b = chat(url, "roll", temperature=1.0, seed=7)["choices"][0]["token_ids"]
    c = chat(url, "roll", temperature=1.0, seed=8)["choices"][0]["token_ids"]
    assert a == b and a != c


def test_bad_requests_are_400(served):
    _, url = served
    for body in ({"messages": []}, {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
                 {"messages": [{"role": "user", "content": "x"}], "n": 2}, {"prompt": {"a": 1}}, {"prompt": ""},
                 {"prompt": "y" * 2100}):
        path = "/completions" if "prompt" in body else "/chat/completions"
        r = httpx.post(url + path, json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["message"], body
    r = httpx.post(url + "/chat/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400


def test_drafter_missing_dir_is_usage_error(tiny_qwen3):
    from dflashkit.errors import UsageError

    cfg = config_from_dict({"target": {"path": str(tiny_qwen3)}, "serve": {"drafter": "/nonexistent/drafter"}})
    with pytest.raises(UsageError, match="serve.drafter"):
        build_app(cfg)
