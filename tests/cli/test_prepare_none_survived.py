"""`prepare` over sources whose every record is dropped: the error counts what was read and dropped and names the
first reasons with their `file:line`, and nothing is written."""

from __future__ import annotations

import json

import yaml

from dflashkit.cli import main


def test_every_record_malformed_names_the_first_reasons(tmp_path, capsys):
    src = tmp_path / "bad.jsonl"
    rows = ['{"conversations": [{"from": "human", "value": 3}]}',  # 1: content not a string
            "{not json",  # 2: not JSON
            '{"conversations": [{"from": "gpt", "value": "an answer first"}]}',  # 3: first turn not the user's
            '{"conversations": []}',  # 4: empty
            "[1, 2]"]  # 5: not a record
    src.write_text("\n".join(rows) + "\n")
    cfg = {"run": {"run_dir": str(tmp_path / "run")},
           "data": {"sources": [{"path": str(src), "format": "sharegpt"}], "heldout": 0, "on_malformed": "skip"}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    rc = main(["prepare", "-c", str(tmp_path / "run.yaml"), "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 2 and out["ok"] is False
    err = out["error"]
    assert err.startswith("no conversation survived reading and filtering")
    named = [n for n in range(1, 6) if f"{src}:{n}:" in err]
    assert len(named) == 3, err  # the first three reasons, each with its file:line
    assert "(and 2 more)" in err and "records read" in err, err
    assert not (tmp_path / "run" / "prepare" / "stats.json").exists()
