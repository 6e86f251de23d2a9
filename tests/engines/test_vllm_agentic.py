"""`generate` regenerates agent conversations through the real vLLM CPU build (marker `engine`; `make test-engine`).

vLLM serves SmolLM2-135M-Instruct with `configs/templates/smollm2-tools.jinja` (its ChatML with tools) and its
`hermes` tool-call parser (`server.tool_call_parser`). The 135M target does not call tools reliably by itself,
so every request carries a structured-output regex (`generate.extra_body`) that makes its answer exactly one
`<tool_call>` of `get_weather` with a city the target picks: what vLLM's parser returns is then the target's own
call, on every CPU. Checked: the calls are kept with vLLM's ids and the data's results re-paired to them; a data
turn the target answers with another number of calls is cut there and flagged; tokenize's drift check finds the
server's prompt ids equal to the local rendering with the same tools on every turn, tool turns included; the loss
mask covers the calls and never a tool result. (The teacher-forced agreement is off: constrained decoding is not
the target's free argmax.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from transformers import AutoTokenizer

from dflashkit.cli import main

pytestmark = pytest.mark.engine

TEMPLATE = Path(__file__).resolve().parents[2] / "configs" / "templates" / "smollm2-tools.jinja"
REGEX = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,12}"\}\}\n</tool_call>'
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _call(cid: str, city: str) -> dict:
    return {"id": cid, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}


CONVERSATIONS = {
    "ends-on-a-call": [{"role": "user", "content": "What is the weather in Paris?"},
                       {"role": "assistant", "content": "", "tool_calls": [_call("a1", "Paris")]}],
    "call-result-answer": [{"role": "user", "content": "Is it raining in Rome?"},
                           {"role": "assistant", "content": "", "tool_calls": [_call("b1", "Rome")]},
                           {"role": "tool", "tool_call_id": "b1", "content": '{"rain": true, "temp_c": 14}'},
                           {"role": "assistant", "content": "Yes, it is raining in Rome (14 C)."}],
    "two-parallel-calls": [{"role": "user", "content": "Weather in Oslo and in Lima?"},
                           {"role": "assistant", "content": "", "tool_calls": [_call("c1", "Oslo"), _call("c2", "Lima")]},
                           {"role": "tool", "tool_call_id": "c1", "content": '{"temp_c": 3}'},
                           {"role": "tool", "tool_call_id": "c2", "content": '{"temp_c": 19}'},
                           {"role": "assistant", "content": "Oslo 3 C, Lima 19 C."}],
}


def _ok(capsys, *argv: str) -> dict:
    code = main(list(argv))
    out = capsys.readouterr()
    assert code == 0, f"`dflashkit {' '.join(argv)}` exited {code}\n{out.err[-4000:]}\n{out.out[-2000:]}"
    return json.loads(out.out.strip().splitlines()[-1])


def test_vllm_regenerates_agent_turns_with_their_tools(tmp_path, capsys):
    data = tmp_path / "agent.jsonl"
    data.write_text("".join(json.dumps({"messages": m, "tools": [WEATHER], "meta": {"name": k}}) + "\n"
                            for k, m in CONVERSATIONS.items()))
    cfg = {"run": {"name": "engine-agentic", "run_dir": str(tmp_path / "run"), "seed": 0},
           "target": {"path": "smollm2-135m-instruct", "dtype": "float32", "chat_template": str(TEMPLATE)},
           "drafter": {"block_size": 4, "num_draft_layers": 1, "num_target_features": 2, "mask_token_id": 16},
           "data": {"sources": [{"path": str(data), "name": "agent"}], "heldout": 0, "max_turns": 4},
           "server": {"engine": "vllm", "tool_call_parser": "hermes"},
           "generate": {"temperature": 0.0, "max_tokens": 64, "concurrency": 3,
                        "extra_body": {"structured_outputs": {"regex": REGEX}}},
           "tokenize": {"max_length": 512, "min_agreement": 0.0}}
    c = tmp_path / "run.yaml"
    c.write_text(yaml.safe_dump(cfg, sort_keys=False))
    _ok(capsys, "prepare", "-c", str(c), "--json")
    gen = _ok(capsys, "generate", "-c", str(c), "--json")["generate"]
    assert gen["turns_failed"] == 0 and gen["tool_mismatch_cut"] == 1, gen
    run = tmp_path / "run"
    out = {}
    for line in (run / "generate" / "conversations.jsonl").read_text().splitlines():
        rec = json.loads(line)
        first_user = rec["messages"][0]["content"]
        out[next(k for k, m in CONVERSATIONS.items() if m[0]["content"] == first_user)] = rec
    assert set(out) == set(CONVERSATIONS)
    for rec in out.values():
        assert rec["tools"] == [WEATHER]
        for m in rec["messages"]:
            if m["role"] == "assistant":  # every answer is the target's one call, as vLLM's parser returned it
                (call,) = m["tool_calls"]
                assert call["id"] and call["function"]["name"] == "get_weather"
                assert set(json.loads(call["function"]["arguments"])) == {"city"}
    rome = out["call-result-answer"]["messages"]
    assert [m["role"] for m in rome] == ["user", "assistant", "tool", "assistant"]
    assert rome[2]["tool_call_id"] == rome[1]["tool_calls"][0]["id"] != "b1"  # re-paired to the target's call
    assert rome[2]["content"] == CONVERSATIONS["call-result-answer"][2]["content"]  # the data's result
    cut = out["two-parallel-calls"]
    assert [m["role"] for m in cut["messages"]] == ["user", "assistant"]  # one call where the data made two
    assert cut["meta"]["cut_at_tool_mismatch"]["turn"] == 0

    tok = _ok(capsys, "tokenize", "-c", str(c), "--json")
    stats = json.loads((run / "tokenize" / "stats.json").read_text())
    check = stats["prompt_check"]  # every turn's server prompt == the local rendering with the same tools
    assert check["checked"] == check["ids_checked"] == 4 and check["mismatches"] == check["ids_mismatches"] == 0
    assert tok["ok"] is True
    import pyarrow.parquet as pq

    hf = AutoTokenizer.from_pretrained(str(_target_dir()))
    table = pq.read_table(next((run / "tokenize").glob("shard-*.parquet"))).to_pylist()
    supervised = [hf.decode([t for t, m in zip(r["input_ids"], r["loss_mask"]) if m]) for r in table]
    unsupervised = [hf.decode([t for t, m in zip(r["input_ids"], r["loss_mask"]) if not m]) for r in table]
    assert all("<tool_call>" in s and "get_weather" in s for s in supervised)
    assert all("<tool_response>" not in s and "<tools>" not in s for s in supervised)
    assert any("<tool_response>" in u for u in unsupervised) and all("<tools>" in u for u in unsupervised)


def _target_dir() -> Path:
    from dflashkit.assets import asset_path

    return Path(asset_path("smollm2-135m-instruct"))
