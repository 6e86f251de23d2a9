"""`dflashkit prepare`: real ShareGPT (truncated) and HumanEval assets, formats, filters, dedupe,
deterministic weighted mixing, malformed-line policies, and failure atomicity."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import yaml

from dflashkit.cli import main
from dflashkit.data.mixing import quotas
from dflashkit.data.sources import SourceReport, iter_json_array


def prepare(tmp_path, capsys, sources, **data):
    cfg = {"run": {"run_dir": str(tmp_path / "run")}, "data": {"sources": sources, "heldout": 0, **data}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    code = main(["prepare", "-c", str(tmp_path / "run.yaml"), "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    return code, out


def lines(path):
    return [json.loads(x) for x in Path(path).read_text().split("\n") if x]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_sharegpt_full_truncated_file(tmp_path, capsys):
    from dflashkit.assets import asset_path

    size = asset_path("sharegpt").stat().st_size
    code, out = prepare(tmp_path, capsys, [{"path": "sharegpt"}], heldout=32)
    assert code == 0
    sg = out["sources"]["sharegpt"]
    assert sg["read"] == 17671  # every complete record of the truncated array
    tail = out["truncated"]["sharegpt"]
    assert tail["complete_records"] == 17671 and tail["bytes_dropped"] > 0
    assert tail["byte_offset"] + tail["bytes_dropped"] == size
    with open(asset_path("sharegpt"), "rb") as fh:
        fh.seek(tail["byte_offset"])
        assert fh.read(1) == b"{"  # the tail is exactly the incomplete record
    assert sg["kept"] + sum(sg["dropped"].values()) == 17671
    assert out["train"] + out["heldout"] == sg["kept"] and out["heldout"] == 32
    rows = lines(tmp_path / "run/prepare/train.jsonl")
    assert len(rows) == out["train"] and len({r["id"] for r in rows}) == len(rows)
    assert all(r["messages"][0]["role"] in ("user", "system") for r in rows[:200])


@pytest.mark.parametrize("cut", ["mid_record", "mid_utf8", "after_comma", "no_bracket", "complete"])
def test_truncated_array_recovers_complete_records(tmp_path, cut):
    recs = [{"id": i, "conversations": [{"from": "human", "value": f"q{i} é✓"}]} for i in range(50)]
    data = json.dumps(recs, ensure_ascii=False, indent=1).encode()
    last_start = data.rindex(b'{\n  "id": 49')
    cuts = {"mid_record": last_start + 20, "mid_utf8": data.rindex("✓".encode()) + 1,
            "after_comma": data.rindex(b",", 0, last_start) + 1, "no_bracket": len(data) - 1,
            "complete": len(data)}
    path = tmp_path / "a.json"
    path.write_bytes(data[:cuts[cut]])
    report = SourceReport("a", str(path))
    got = [obj["id"] for _, obj in iter_json_array(path, report)]
    assert got == list(range(49 if cut in ("mid_record", "mid_utf8", "after_comma") else 50))
    if cut == "complete":
        assert report.truncated_tail is None
    else:
        t = report.truncated_tail
        assert t["byte_offset"] + t["bytes_dropped"] == cuts[cut]
        assert t["complete_records"] == len(got)
        if cut != "no_bracket":
            assert data[:cuts[cut]][t["byte_offset"]:t["byte_offset"] + 1] in (b"{", b"")


def test_humaneval_164_with_reference_solutions(tmp_path, capsys):
    code, out = prepare(tmp_path, capsys, [{"path": "humaneval"}])
    assert code == 0 and out["train"] == 164
    rows = lines(tmp_path / "run/prepare/train.jsonl")
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant"] for r in rows)
    assert all("def " in r["messages"][0]["content"] for r in rows)
    # the answer is the prompt completed with the reference solution (what answers=original trains on)
    assert all(r["messages"][1]["content"].startswith("```python\n") and "return" in r["messages"][1]["content"]
               for r in rows)


def test_formats_and_drop_reasons(tmp_path, capsys):
    sg = [{"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "a"},
                             {"from": "gpt", "value": "b"}, {"from": "human", "value": "c"},
                             {"from": "human", "value": "c2"}, {"from": "gpt", "value": "d"}]},
          {"conversations": [{"from": "gpt", "value": "hello"}, {"from": "human", "value": "x"}]},
          {"conversations": [{"from": "human", "value": "   "}]},
          {"conversations": [{"from": "human", "value": "y" * 50}]},
          {"conversations": [{"from": "alien", "value": "z"}]}]
    msgs = [{"messages": [{"role": "user", "content": [{"type": "text", "text": "part"}]},
                          {"role": "assistant", "content": "ans"}]}]
    alpaca = [{"instruction": "Do it", "input": "ctx", "output": "done"}]
    prompts = [{"prompt": "plain"}]
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist([{"prompt": "from parquet"}]), tmp_path / "p.parquet")
    with gzip.open(tmp_path / "g.jsonl.gz", "wt") as fh:
        fh.write(json.dumps({"prompt": "from gzip"}) + "\n")
    sources = [{"path": write_jsonl(tmp_path / f"{name}.jsonl", rows)}
               for name, rows in (("sg", sg), ("m", msgs), ("al", alpaca), ("pr", prompts))]
    sources += [{"path": str(tmp_path / "p.parquet")}, {"path": str(tmp_path / "g.jsonl.gz")}]
    code, out = prepare(tmp_path, capsys, sources, max_prompt_chars=40, max_turns=1)
    assert code == 0
    assert out["sources"]["sg"]["dropped"] == {"malformed": 1, "empty": 1, "first_turn_not_user": 1,
                                               "too_long": 1, "duplicate": 0}
    by_text = {r["messages"][-1]["content"]: r for r in lines(tmp_path / "run/prepare/train.jsonl")}
    # max_turns=1 keeps the first user turn and its answer; system stays first
    assert [m["role"] for m in by_text["b"]["messages"]] == ["system", "user", "assistant"]
    assert by_text["ans"]["messages"][0]["content"] == "part"
    assert by_text["done"]["messages"][0]["content"] == "Do it\n\nctx"
    assert {"plain", "from parquet", "from gzip"} <= set(by_text)


def test_hf_datasets_dir(tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list([{"instruction": f"q{i}", "output": "a"} for i in range(5)]).save_to_disk(
        str(tmp_path / "ds"))
    code, out = prepare(tmp_path, capsys, [{"path": str(tmp_path / "ds"), "name": "hf"}])
    assert code == 0 and out["sources"]["hf"]["kept"] == 5


def test_malformed_skip_vs_fail(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c"\n\n{"prompt": "d"}\n')
    code, out = prepare(tmp_path, capsys, [{"path": str(path)}])
    assert code == 0 and out["train"] == 3 and out["dropped"]["malformed"] == 1
    code, out = prepare(tmp_path, capsys, [{"path": str(path)}], on_malformed="fail")
    assert code == 2 and f"{path}:3" in out["error"]


def test_dedupe(tmp_path, capsys):
    rows = [{"prompt": "same"}, {"prompt": "same "}, {"prompt": "other"}]
    a, b = write_jsonl(tmp_path / "a.jsonl", rows), write_jsonl(tmp_path / "b.jsonl", rows[:1])
    code, out = prepare(tmp_path, capsys, [{"path": a}, {"path": b}])
    assert out["train"] == 2 and out["sources"]["a"]["dropped"]["duplicate"] == 1
    assert out["sources"]["b"]["dropped"]["duplicate"] == 1
    code, out = prepare(tmp_path, capsys, [{"path": a}, {"path": b}], dedupe=False)
    assert out["train"] == 4


def test_quotas():
    assert quotas({"a": 100, "b": 100}, {"a": 1, "b": 3}, 40) == {"a": 10, "b": 30}
    assert quotas({"a": 5, "b": 100}, {"a": 3, "b": 1}, 40) == {"a": 5, "b": 35}
    assert quotas({"a": 7, "b": 8}, {"a": 1, "b": 1}, None) == {"a": 7, "b": 8}
    assert sum(quotas({"a": 10, "b": 10, "c": 10}, {"a": 1, "b": 1, "c": 1}, 10).values()) == 10


def test_mixing_is_deterministic_and_weighted(tmp_path, capsys):
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"a{i}"} for i in range(60)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": f"b{i}"} for i in range(60)])
    srcs = [{"path": a, "weight": 1}, {"path": b, "weight": 3}]
    code, out = prepare(tmp_path, capsys, srcs, num_prompts=40, heldout=8)
    assert code == 0 and out["train"] == 32 and out["heldout"] == 8
    assert out["sources"]["a"]["train"] + out["sources"]["a"]["heldout"] == 10
    first = (tmp_path / "run/prepare/train.jsonl").read_bytes()
    held = (tmp_path / "run/prepare/heldout.jsonl").read_bytes()
    prepare(tmp_path, capsys, srcs, num_prompts=40, heldout=8)
    assert (tmp_path / "run/prepare/train.jsonl").read_bytes() == first
    assert (tmp_path / "run/prepare/heldout.jsonl").read_bytes() == held
    assert not set(held.splitlines()) & set(first.splitlines())
    cfg = {"run": {"run_dir": str(tmp_path / "run2"), "seed": 1},
           "data": {"sources": srcs, "num_prompts": 40, "heldout": 8}}
    (tmp_path / "r2.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["prepare", "-c", str(tmp_path / "r2.yaml"), "--json"]) == 0
    assert (tmp_path / "run2/prepare/train.jsonl").read_bytes() != first


def test_failed_run_keeps_previous_outputs(tmp_path, capsys):
    good = write_jsonl(tmp_path / "good.jsonl", [{"prompt": f"p{i}"} for i in range(5)])
    assert prepare(tmp_path, capsys, [{"path": good}])[0] == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "run/prepare").iterdir()}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\nnot json\n')
    code, _ = prepare(tmp_path, capsys, [{"path": good}, {"path": str(bad)}], on_malformed="fail")
    assert code == 2
    code, _ = prepare(tmp_path, capsys, [{"path": str(tmp_path / "missing.jsonl")}])
    assert code == 2
    after = {p.name: p.read_bytes() for p in (tmp_path / "run/prepare").iterdir()}
    assert after == before


def test_truncated_array_fails_when_strict(tmp_path, capsys):
    recs = [{"prompt": f"p{i}"} for i in range(4)]
    data = json.dumps(recs).encode()
    path = tmp_path / "cut.json"
    path.write_bytes(data[:-8])
    code, out = prepare(tmp_path, capsys, [{"path": str(path)}])
    assert code == 0 and out["train"] == 3 and out["truncated"]["cut"]["complete_records"] == 3
    code, out = prepare(tmp_path, capsys, [{"path": str(path)}], on_malformed="fail")
    offset = data.rindex(b"{")
    assert code == 2 and f"truncated JSON array at byte {offset}" in out["error"]
