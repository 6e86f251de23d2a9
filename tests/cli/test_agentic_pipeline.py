"""An agent conversation through the whole pipeline (issue #40's acceptance): tools, thinking, two parallel calls,
their results and a final answer go prepare → generate → tokenize → capture → train → eval on the tiny Qwen3
target with the real Qwen3 template (over its byte tokens).

`generate` talks to a scripted OpenAI server standing in for the target's engine (the random tiny target calls
no tools): it renders each request with the target's tokenizer, template and the request's tools, as a serving
engine does, returns those prompt ids, and answers with the data's own turn (its thinking as reasoning_content,
its calls as tool_calls with the server's ids). So tokenize's drift check compares a real server-side rendering
of every turn, tool turns included, with its own, and must find them equal. The agent sample's loss mask is the
slow turn-by-turn oracle's; eval decodes the agent prompts (tools rendered) losslessly and reports them as a
source of their own, beside prompt lookup."""

from __future__ import annotations

import json
import re
from typing import Any, ContextManager

import pytest
import yaml

from dflashkit.cli import main
from tests.data.test_agent_masks import agent_convs, oracle
from tests.helpers import openai_stub

B = 4


@pytest.fixture(scope="module")
def qwen3_dir():
    from dflashkit.assets import asset_path

    return asset_path("tokenizer-qwen3")


THINK = re.compile(r"<think>\n(.*?)\n</think>\n\n", re.S)


def scripted_target(tokenizer: Any, template: str, data: dict[str, list[dict]]) -> ContextManager[str]:
    """An OpenAI chat server that renders each request as the target's engine would and answers the turn with
    the data's own (`data`: first user message → the conversation's messages)."""
    calls = iter(range(1 << 30))

    def answer(body: dict) -> tuple[int, dict]:
        msgs = body["messages"]
        ids = tokenizer.apply_chat_template(msgs, tools=body.get("tools"), chat_template=template,
                                            add_generation_prompt=True, tokenize=True, return_dict=False)
        convo = data[next(m["content"] for m in msgs if m["role"] == "user")]
        turn = [m for m in convo if m["role"] == "assistant"][sum(m["role"] == "assistant" for m in msgs)]
        found = THINK.match(turn["content"])
        message: dict[str, Any] = {"role": "assistant", "content": turn["content"][found.end() if found else 0:],
                                   **({"reasoning_content": found.group(1)} if found else {})}
        if turn.get("tool_calls"):
            message["tool_calls"] = [{**c, "id": f"srv_{next(calls)}"} for c in turn["tool_calls"]]
        return 200, {"model": "target", "choices": [{"index": 0, "message": message, "finish_reason":
                                                     "tool_calls" if turn.get("tool_calls") else "stop"}],
                     "usage": {"prompt_tokens": len(ids), "completion_tokens": 1}, "prompt_token_ids": ids}

    return openai_stub(answer)


def test_agent_conversation_from_prepare_to_eval(tmp_path, capsys, tiny_qwen3, qwen3_dir):
    from transformers import AutoTokenizer

    from dflashkit.data.records import Conversation
    from dflashkit.data.shards import load_tokenized
    from dflashkit.rundir import RunDir

    template = tmp_path / "qwen3.jinja"  # the real Qwen3 template over the tiny target's byte tokens
    template.write_text(json.loads((qwen3_dir / "tokenizer_config.json").read_text())["chat_template"])
    parallel = agent_convs()[0]  # system, user, thinking + 2 parallel calls, 2 results, thinking + final answer
    variants = []
    for i in range(12):  # the same shape with other cities: enough samples for a held-out split
        msgs = json.loads(json.dumps(parallel.messages).replace("Paris", f"Paris{i}").replace("Rome", f"Rome{i}"))
        variants.append({"messages": msgs, "tools": parallel.tools})
    (tmp_path / "agent.jsonl").write_text("".join(json.dumps(v) + "\n" for v in variants))
    chats = [{"messages": [{"role": "user", "content": f"Count to {i}."},
                           {"role": "assistant", "content": " ".join(str(k) for k in range(1, i + 2))}]}
             for i in range(6)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    by_question = {r["messages"][0]["content"] if r["messages"][0]["role"] == "user" else r["messages"][1]["content"]:
                   r["messages"] for r in variants + chats}
    cfg = {"run": {"run_dir": str(tmp_path / "run"), "seed": 0},
           "target": {"path": str(tiny_qwen3), "chat_template": str(template), "dtype": "float32"},
           "drafter": {"block_size": B, "num_draft_layers": 1},
           "data": {"sources": [{"path": str(tmp_path / "agent.jsonl"), "name": "agent"},
                                {"path": str(tmp_path / "chat.jsonl"), "name": "chat"}],
                    "heldout": 6, "max_turns": 8},
           "generate": {"max_tokens": 64, "concurrency": 4, "request_token_ids": False, "progress": False},
           "tokenize": {"max_length": 2048, "agreement_samples": 0, "workers": 1},
           "train": {"features": "cached", "labels": "target", "max_steps": 4, "batch_size": 4,
                     "heldout_samples": 0, "eval_every": 0, "save_every": 0, "log_every": 2},
           "eval": {"num_prompts": 6, "max_new_tokens": 12, "block_sizes": [B], "warmup": 0,
                    "diagnostics": False, "adaptive_length": False},
           "export": {"dtype": "float32"}}
    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    with scripted_target(tok, template.read_text(), by_question) as url:
        cfg["server"] = {"urls": [url]}
        path = tmp_path / "run.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        code = main(["run", "-c", str(path), "--to", "eval", "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err[-4000:]
    run = tmp_path / "run"
    stages = {s["stage"]: s["action"] for s in json.loads(out.out.strip().splitlines()[-1])["stages"]}
    assert all(stages[s] == "run" for s in ("prepare", "generate", "tokenize", "capture", "train", "eval")), stages

    # generate kept the target's calls (the server's ids) and re-paired the data's results to them
    train = [json.loads(x) for x in (run / "generate" / "conversations.jsonl").read_text().splitlines()]
    for r in (r for r in train if r["source"] == "agent"):
        first = r["messages"][2]
        assert [c["id"] for c in first["tool_calls"]] == [m["tool_call_id"] for m in r["messages"][3:5]]
        assert all(c["id"].startswith("srv_") for c in first["tool_calls"])
        assert first["content"].startswith("<think>\nTwo cities") and r["tools"] == parallel.tools
    # tokenize: the server's prompt of every turn (tool turns included) == the local rendering with the tools
    check = json.loads((run / "tokenize" / "stats.json").read_text())["prompt_check"]
    assert check["ids_checked"] == check["checked"] == len(train) + sum(r["source"] == "agent" for r in train)
    assert check["mismatches"] == check["ids_mismatches"] == 0, check
    # each agent sample is the oracle's, the calls supervised, declarations and results not
    data = load_tokenized(RunDir(run))
    agent = {r["id"]: Conversation.from_dict(r) for r in train if r["source"] == "agent"}
    checked = 0
    for sid, src, ids, mask in zip(data.ids, data.source, data.input_ids, data.loss_mask):
        if src != "agent":
            continue
        want = oracle(tok, agent[sid.split(":")[0]], "keep", template.read_text())
        assert (ids.tolist(), mask.tolist()) in want
        text = tok.decode([t for t, m in zip(ids.tolist(), mask.tolist()) if m])
        assert text.count("<tool_call>") == 2 and "<tool_response>" not in text and "<tools>" not in text
        checked += 1
    assert checked == len(agent) > 0

    # eval: the agent prompts (tools and earlier tool turns rendered) decode losslessly, reported per source
    res = json.loads((run / "eval" / "results.json").read_text())
    assert res["lossless"]["verdict"] == "exact", res["lossless"]
    held = {json.loads(x)["source"] for x in (run / "prepare" / "heldout.jsonl").read_text().splitlines()}
    assert "agent" in set(res["by_source"]) == held
    for name, entry in res["by_source"].items():
        tau = entry["speculative"][str(B)]["tau"]
        assert 1.0 <= tau <= B, (name, tau)
        assert "prompt_lookup" in entry
