"""`dflashkit flywheel` on a tiny target: two rounds of serve (recording) → replay → learn → hot swap run end to
end; round 2's traffic is served by round 1's promoted drafter and scored against the static one."""

from __future__ import annotations

import json

import pytest

from dflashkit.cli import main
from tests.helpers import TEXTS, make_run, overrides

pytestmark = pytest.mark.serial  # a server, its 2 replay clients and a training round in one process


def test_two_flywheel_rounds_promote_and_swap(tmp_path, tiny_qwen3, capsys, monkeypatch):
    run_dir = make_run(tmp_path / "run", tiny_qwen3)
    assert main(["train", "--json", *overrides(run_dir, tiny_qwen3, train__max_steps=2)]) == 0
    traffic = tmp_path / "traffic.jsonl"
    traffic.write_text("".join(json.dumps({"id": f"c{i}", "source": "chat", "messages": [
        {"role": "user", "content": f"{TEXTS[i % len(TEXTS)][0]} ({i})"}]}) + "\n" for i in range(18)))
    capsys.readouterr()
    # min_gain -4 is below any paired τ gain (τ in [1, 4]): the rule promotes whenever a held-out sample is scored;
    # min_supervised 1 keeps the tiny target's short, lossy-decoded answers (else the held-out slice may be empty)
    common = [*overrides(run_dir, tiny_qwen3), "learn.round_requests=6", "learn.replay_max_tokens=6",
              "learn.replay_concurrency=2", "learn.max_steps=2", "learn.min_gain=-4", f"learn.traffic=[\"{traffic}\"]",
              "learn.profile_prompts=1", "learn.profile_max_new_tokens=4", "serve.promoted_poll_s=0.05",
              "tokenize.min_supervised=1"]
    rc = main(["flywheel", "--json", *common, "learn.rounds=2", "learn.compare_regenerate=true"])
    out = capsys.readouterr()
    assert rc == 0, out.err[-3000:]
    rows = json.loads((run_dir / "learn" / "flywheel.json").read_text())["rounds"]
    assert [r["round"] for r in rows] == [1, 2]
    assert all(r["live"]["requests"] == 6 and r["live"]["failed"] == 0 and r["live"]["tau"] >= 1 for r in rows)
    assert rows[0]["decision"] == "promote" and rows[0]["served_by"].startswith("serve.drafter:")
    assert rows[1]["served_by"].startswith("r001-")  # swapped in between the rounds
    # the promotion rule scores the held-out slice (2 of 6); the curve all of round 2's traffic
    assert rows[1]["comparison"]["samples"] == 2 and rows[1]["serving_vs_static"]["samples"] == 6
    # every record is chat (no tools, no source recorded): the per-source comparison is the pooled one
    for key in ("serving_vs_static", "comparison"):
        assert set(rows[1][key]["by_source"]) == {"chat"}
        assert {k: v for k, v in rows[1][key]["by_source"]["chat"].items()} == {
            k: v for k, v in rows[1][key].items() if k not in ("by_source", "slice")}
    r1 = json.loads((run_dir / "learn" / "rounds" / "001" / "round.json").read_text())
    r2 = json.loads((run_dir / "learn" / "rounds" / "002" / "round.json").read_text())
    curve = r2["serving_vs_static"]["scores"]
    # the curve's samples are round 2's own traffic, held-out slice first, none of which round 1's drafter (serving
    # round 2) trained on; the held-out ones score as the promotion rule scored them
    assert sorted(curve["ids"]) == sorted(r2["ids"]["heldout"] + r2["ids"]["train"])
    assert curve["ids"][:2] == r2["ids"]["heldout"] and not set(curve["ids"]) & set(r1["ids"]["train"])
    assert curve["serving"][:2] == r2["scores"]["serving"]
    assert r2["samples"]["records"] == 6  # only round 2's traffic: round 1's was behind the cursor
    # the server recorded each reply's token ids, and the round trained on them (they spell the rendered replies)
    assert r2["tokenize"]["recorded_ids"]["used"] == r2["tokenize"]["conversations"] == 6, r2["tokenize"]
    assert r2["tokenize"]["recorded_ids"]["disagree_text_used"] == 0
    # the regenerate arm answered the training prompts again without the drafter: the served replies (lossless
    # speculative decoding, greedy) come back token for token; without --budget it trains the candidate's steps
    for row in rows:
        arm = row["regenerate_arm"]
        assert arm["basis"] == "steps" and arm["steps"] == 2 and "scores" not in arm, arm
        assert arm["prompts"]["regenerated"] == arm["prompts"]["available"] == arm["replies"]["compared"] == 4
        assert arm["replies"]["equal"] == 4 and arm["candidate_vs_regenerate"]["samples"] == 2
    # learn.rounds is the total: a larger one goes on after round 2, served by round 2's promoted drafter, replaying
    # the traffic not yet replayed; the same one again does nothing
    rc = main(["flywheel", "--json", *common, "learn.rounds=3"])
    out = capsys.readouterr()
    assert rc == 0, out.err[-3000:]
    rows3 = json.loads((run_dir / "learn" / "flywheel.json").read_text())["rounds"]
    assert rows3[:2] == rows and rows3[2]["round"] == 3 and rows3[2]["served_by"].startswith("r002-")
    r3 = json.loads((run_dir / "learn" / "rounds" / "003" / "round.json").read_text())
    assert r3["samples"]["records"] == 6 and r3["serving"]["id"] == rows3[2]["served_by"]
    convs = [json.loads(line) for line in (run_dir / "learn" / "rounds" / "003" / "generate" /
                                           "conversations.jsonl").read_text().splitlines()]
    assert sorted(c["messages"][0]["content"].rsplit("(", 1)[1] for c in convs) == [f"{i})" for i in range(12, 18)]
    monkeypatch.setattr("dflashkit.stages.flywheel.build_app", lambda *a, **k: pytest.fail("a server started"))
    assert main(["flywheel", "--json", *common, "learn.rounds=3"]) == 0  # nothing to do: no server either
    monkeypatch.undo()
    assert json.loads((run_dir / "learn" / "flywheel.json").read_text())["rounds"] == rows3
    # records no round learned from (a flywheel stopped between its replay and its round) are refused, named
    segs = sorted((run_dir / "learn" / "records").glob("records-*.jsonl"))
    (segs[-1].parent / "records-99999999.jsonl").write_text(segs[-1].read_text().splitlines(keepends=True)[0])
    capsys.readouterr()
    assert main(["flywheel", "--json", *common, "learn.rounds=4"]) == 2
    assert "no round learned from" in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["error"]
