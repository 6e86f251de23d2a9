"""`dflashkit prepare` on agent data: OpenAI and ShareGPT agent JSONL and `path: bfcl` write records that keep
their tools; malformed agent records are counted by kind (skip) or exit 2 naming file:line (fail) with the
previous outputs untouched; BFCL categories are checked; agent conversations that `generate` would have to
regenerate are refused (exit 2) by prepare, dry run included, before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dflashkit.cli import main

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


def openai_rec(city: str, arguments: str | None = None) -> dict:
    args = arguments if arguments is not None else json.dumps({"city": city})
    return {"messages": [{"role": "user", "content": f"Weather in {city}?"},
                         {"role": "assistant", "content": None, "reasoning_content": "Use the tool.",
                          "tool_calls": [{"id": "c1", "type": "function",
                                          "function": {"name": "get_weather", "arguments": args}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
                         {"role": "assistant", "content": f"{city}: 18 C."}], "tools": [TOOL]}


def sharegpt_rec(city: str) -> dict:
    return {"conversations": [{"from": "human", "value": f"And {city}?"},
                              {"from": "function_call", "value": json.dumps({"name": "get_weather",
                                                                             "arguments": {"city": city}})},
                              {"from": "observation", "value": "9 C"},
                              {"from": "gpt", "value": f"{city}: 9 C."}],
            "tools": json.dumps([TOOL["function"]])}


def agent_file(tmp_path: Path, bad: bool = True) -> Path:
    rows = [openai_rec("Paris"), sharegpt_rec("Oslo"), openai_rec("Rome")]
    if bad:
        no_result = openai_rec("Lyon")
        no_result["messages"][2:3] = [{"role": "user", "content": "well?"}]
        rows += [openai_rec("Nice", arguments="{city: Nice"), no_result]
    path = tmp_path / "agent.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def prepare(tmp_path, capsys, sources, *extra, **data):
    cfg = {"run": {"run_dir": str(tmp_path / "run")}, "data": {"sources": sources, "heldout": 0, **data}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    code = main(["prepare", "-c", str(tmp_path / "run.yaml"), *extra, "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    return code, out


def rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x]


def test_agent_jsonl_keeps_tools_and_counts_malformed_by_kind(tmp_path, capsys):
    path = agent_file(tmp_path)
    code, out = prepare(tmp_path, capsys, [{"path": str(path), "answers": "original"}])
    assert code == 0, out
    src = out["sources"]["agent"]
    assert src["kept"] == 3 and src["dropped"]["malformed"] == 2
    assert src["malformed_by"] == {"arguments_not_json": 1, "call_without_result": 1}
    recs = rows(tmp_path / "run/prepare/train.jsonl")
    assert len(recs) == 3 and all(r["tools"][0]["function"]["name"] == "get_weather" for r in recs)
    by_user = {r["messages"][0]["content"]: r for r in recs}
    paris = by_user["Weather in Paris?"]["messages"]
    assert paris[1]["content"].startswith("<think>\nUse the tool.\n</think>") and paris[2]["tool_call_id"] == "c1"
    assert by_user["And Oslo?"]["messages"][2]["tool_call_id"] == by_user["And Oslo?"]["messages"][1]["tool_calls"][0]["id"]
    stats = json.loads((tmp_path / "run/prepare/stats.json").read_text())
    assert stats["sources"]["agent"]["malformed_by"] == src["malformed_by"]
    assert any("agent.jsonl:4" in e and "arguments are not a JSON object" in e for e in stats["sources"]["agent"]["examples"])
    counts = json.loads((tmp_path / "run/prepare/manifest.json").read_text())["counts"]
    assert counts["malformed_by:arguments_not_json"] == 1 and counts["malformed_by:call_without_result"] == 1


def test_malformed_agent_record_fails_naming_file_and_line_and_keeps_outputs(tmp_path, capsys):
    good = agent_file(tmp_path, bad=False)
    assert prepare(tmp_path, capsys, [{"path": str(good), "answers": "original"}])[0] == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "run/prepare").iterdir()}
    with good.open("a") as fh:
        fh.write(json.dumps(openai_rec("Nice", arguments="[1, 2]")) + "\n")
    code, out = prepare(tmp_path, capsys, [{"path": str(good), "answers": "original"}], on_malformed="fail")
    assert code == 2 and f"{good}:4" in out["error"] and "arguments are not a JSON object" in out["error"]
    assert "on_malformed=skip" in out["hint"]
    assert {p.name: p.read_bytes() for p in (tmp_path / "run/prepare").iterdir()} == before


def write_bfcl_fixture(root: Path) -> Path:
    """Two categories in bfcl-eval's layout (made-up content)."""
    (root / "possible_answer").mkdir(parents=True)
    fn = {"name": "math.add", "description": "Add.", "parameters": {
        "type": "dict", "properties": {"a": {"type": "integer"}, "b": {"type": "float"}}, "required": ["a", "b"]}}
    q = [{"id": f"simple_python_{i}", "question": [[{"role": "user", "content": f"{i} plus 2?"}]], "function": [fn]}
         for i in range(3)]
    a = [{"id": f"simple_python_{i}", "ground_truth": [{"math.add": {"a": [i], "b": [2.0, 2]}}]} for i in range(3)]
    (root / "BFCL_v4_simple_python.json").write_text("".join(json.dumps(r) + "\n" for r in q))
    (root / "possible_answer/BFCL_v4_simple_python.json").write_text("".join(json.dumps(r) + "\n" for r in a))
    irr = [{"id": "irrelevance_0", "question": [[{"role": "user", "content": "Capital of Peru?"}]], "function": [fn]}]
    (root / "BFCL_v4_irrelevance.json").write_text("".join(json.dumps(r) + "\n" for r in irr))
    return root


def test_bfcl_dir_writes_records_with_tools_and_counts_skips(tmp_path, capsys):
    root = write_bfcl_fixture(tmp_path / "bfcl_data")
    code, out = prepare(tmp_path, capsys, [{"path": str(root), "name": "bfcl", "answers": "original",
                                            "bfcl_categories": ["simple_python", "irrelevance"]}])
    assert code == 0, out
    assert out["sources"]["bfcl"]["kept"] == 3 and out["sources"]["bfcl"]["skipped"] == {"no_ground_truth:irrelevance": 1}
    recs = rows(tmp_path / "run/prepare/train.jsonl")
    assert all(r["tools"][0]["function"]["name"] == "math_add" for r in recs)
    assert sorted(json.loads(r["messages"][1]["tool_calls"][0]["function"]["arguments"])["a"] for r in recs) == [0, 1, 2]


@pytest.mark.parametrize("source, needle", [
    ({"path": "bfcl", "bfcl_categories": ["simple"]}, "unknown BFCL category 'simple'"),
    ({"path": "bfcl", "bfcl_categories": ["multi_turn_base"]}, "cannot be read as training data"),
    ({"path": "x.jsonl", "bfcl_categories": ["simple_python"]}, "only a BFCL source reads it"),
])
def test_bad_bfcl_categories_exit_2_before_reading(tmp_path, capsys, source, needle):
    code, out = prepare(tmp_path, capsys, [{"answers": "original", **source}])
    assert code == 2 and "data.sources[0].bfcl_categories" in out["error"] and needle in out["error"]
    assert not (tmp_path / "run/prepare").exists()


def test_real_bfcl_asset_through_prepare(tmp_path, capsys):
    from dflashkit.assets import asset_path

    root = asset_path("bfcl")
    code, out = prepare(tmp_path, capsys, [{"path": "bfcl", "answers": "original",
                                            "bfcl_categories": ["simple_python", "parallel"]}])
    assert code == 0, out
    lines = sum(1 for c in ("simple_python", "parallel") for x in (root / f"BFCL_v4_{c}.json").open() if x.strip())
    src = out["sources"]["bfcl"]
    assert src["read"] == lines and src["kept"] + src["dropped"]["duplicate"] == lines and not src["malformed_by"]
    recs = rows(tmp_path / "run/prepare/train.jsonl")
    assert len(recs) == src["kept"] and all(r["tools"] and r["messages"][-1]["tool_calls"] for r in recs)


def test_bfcl_categories_key_leaves_existing_prepare_hashes_alone():
    """A run dir prepared before the key existed stays up to date: the key is hashed only when set."""
    from dflashkit.config import load_config
    from dflashkit.config.loader import _hashed
    from dflashkit.stage_table import stage_hash

    plain = load_config(None, ["data.sources=[{path: sharegpt}]"])
    assert "bfcl_categories" not in _hashed(plain.data)["sources"][0]
    chosen = load_config(None, ["data.sources=[{path: bfcl, bfcl_categories: [parallel]}]"])
    default = load_config(None, ["data.sources=[{path: bfcl}]"])
    assert stage_hash("prepare", chosen) != stage_hash("prepare", default)


def test_agent_conversations_to_regenerate_are_prepared_for_generate(tmp_path, capsys):
    """`generate` regenerates agent turns (tools sent, calls kept): prepare passes them on with their tools."""
    code, out = prepare(tmp_path, capsys, [{"path": str(agent_file(tmp_path, bad=False)), "answers": "regenerate"}])
    assert code == 0, out
    kept = rows(tmp_path / "run/prepare/train.jsonl")
    assert len(kept) == 3 and all(r["tools"] for r in kept)
