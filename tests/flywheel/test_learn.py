"""`dflashkit learn`: refusals that name the file and line and leave the records untouched; rounds on a tiny
target whose held-out slice is the newest traffic, never trained on, and whose decision follows the rule."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from dflashkit.cli import main
from dflashkit.config import load_config
from dflashkit.flywheel.traffic import run_fingerprint
from tests.helpers import TEXTS, make_run, overrides


def _records(tiny, run_dir, n, start=0, fp=None):
    """Chat records as `serving/record.py` writes them (the reply is the last message)."""
    cfg = load_config(None, [f"target.path={tiny}", f"run.run_dir={run_dir}"])
    fp = fp or run_fingerprint(cfg)
    return [{"id": f"req{i:04d}", "v": 1, "time": 1000.0 + i, "endpoint": "chat",
             "messages": [{"role": "user", "content": TEXTS[i % len(TEXTS)][0]},
                          {"role": "assistant", "content": TEXTS[i % len(TEXTS)][1]}],
             "target": {"fingerprint": fp, "how": "files"}} for i in range(start, start + n)]


def _write(path: Path, rows, tail=""):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in rows) + tail)


def _digest(d: Path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def _learn(run_dir, tiny, records, capsys, *extra):
    rc = main(["learn", "--json", "--records", str(records), *overrides(run_dir, tiny, train__lr=3e-3),
               "learn.max_steps=3", "learn.profile_max_new_tokens=6", "learn.profile_prompts=1", *extra])
    out = capsys.readouterr()
    return rc, json.loads(out.out.strip().splitlines()[-1]), out.err


@pytest.fixture()
def run_dir(tmp_path, tiny_qwen3):
    return make_run(tmp_path / "run", tiny_qwen3)


def test_learn_refuses_foreign_traffic_naming_the_file(run_dir, tiny_qwen3, tmp_path, capsys):
    rec = tmp_path / "rec"
    _write(rec / "records-00000001.jsonl", _records(tiny_qwen3, run_dir, 3))
    _write(rec / "records-00000002.jsonl", _records(tiny_qwen3, run_dir, 1, 3, fp="0" * 64))
    before = _digest(rec)
    rc, out, _ = _learn(run_dir, tiny_qwen3, rec, capsys)
    assert rc == 2 and "records-00000002.jsonl:1" in out["error"] and "another target or tokenizer" in out["error"], out
    assert _digest(rec) == before and not (run_dir / "learn" / "cursor.json").exists()


def test_learn_refuses_an_empty_window_and_a_corrupt_record(run_dir, tiny_qwen3, tmp_path, capsys):
    rec = tmp_path / "rec"
    rec.mkdir()
    rc, out, _ = _learn(run_dir, tiny_qwen3, rec, capsys)
    assert rc == 2 and "no new record" in out["error"], out
    _write(rec / "records-00000001.jsonl", _records(tiny_qwen3, run_dir, 2))
    with open(rec / "records-00000001.jsonl", "a") as fh:
        fh.write('{"id": "broken", "messages": \n')
    _write(rec / "records-00000001.jsonl", [], tail='{"partial": ')  # a line still being written: not read at all
    before = _digest(rec)
    rc, out, _ = _learn(run_dir, tiny_qwen3, rec, capsys, "learn.on_corrupt=fail")
    assert rc == 2 and "records-00000001.jsonl:3: corrupt record" in out["error"], out
    assert _digest(rec) == before


def test_two_rounds_hold_out_the_newest_and_follow_the_rule(run_dir, tiny_qwen3, tmp_path, capsys):
    assert main(["train", "--json", *overrides(run_dir, tiny_qwen3, train__max_steps=2)]) == 0
    capsys.readouterr()
    rec = tmp_path / "rec"
    rows = _records(tiny_qwen3, run_dir, 10)
    _write(rec / "records-00000001.jsonl", rows[:6])
    _write(rec / "records-00000002.jsonl", rows[6:])
    with open(rec / "records-00000002.jsonl", "a") as fh:
        fh.write("not json\n")  # skipped and counted (learn.on_corrupt=skip)
    before = _digest(rec)
    rc, out, err = _learn(run_dir, tiny_qwen3, rec, capsys, "learn.min_gain=-4")  # below any τ gain (B 4): promotes
    assert rc == 0, err[-3000:]
    r1 = json.loads((run_dir / "learn" / "rounds" / "001" / "round.json").read_text())
    assert r1["ids"]["heldout"] == ["req0008", "req0009"]  # the newest two (fraction 0.2 of 10)
    assert set(r1) == {"round", "records_dir", "cursor_before", "cursor_after", "lines", "corrupt", "window", "samples",
                       "ids", "tokenize", "steps", "steps_rule", "budget_minutes", "serving", "warm_start", "scores", "comparison",
                       "serving_vs_static", "decision", "reason", "train", "export", "profile", "promoted",
                       "vllm_restart", "wall_s"}  # learn.compare_regenerate is off by default: no regenerate arm
    assert not set(r1["ids"]["train"]) & set(r1["ids"]["heldout"]) and len(r1["ids"]["train"]) == 8
    assert r1["corrupt"] and "records-00000002.jsonl:5" in r1["corrupt"][0]
    lo = r1["comparison"]["interval90"][0]
    assert lo is not None and lo > -4 and r1["decision"] == "promote", r1["comparison"]
    pointer = run_dir / "learn" / "promoted.json"
    p = json.loads(pointer.read_text())
    assert Path(p["drafter"], "speculation_profile.json").is_file() and p["round"] == 1
    assert p["drafter"] == str((run_dir / "learn" / "rounds" / "001" / "export").resolve())
    # round 2 reads only what came after the cursor; min_gain out of reach keeps the serving drafter
    _write(rec / "records-00000002.jsonl", _records(tiny_qwen3, run_dir, 5, 10))
    rc, out, err = _learn(run_dir, tiny_qwen3, rec, capsys, "learn.min_gain=100")
    assert rc == 0, err[-3000:]
    r2 = json.loads((run_dir / "learn" / "rounds" / "002" / "round.json").read_text())
    assert r2["samples"]["records"] == 5 and r2["ids"]["heldout"] == ["req0013", "req0014"]
    assert r2["ids"]["train"] == ["req0010", "req0011", "req0012"]
    assert r2["decision"] == "keep" and r2["serving"]["id"] == p["id"]  # round 2 fine-tuned round 1's drafter
    assert json.loads(pointer.read_text()) == p
    assert all(before[k] == v for k, v in _digest(rec).items() if k == "records-00000001.jsonl")
    rc, out, _ = _learn(run_dir, tiny_qwen3, rec, capsys)
    assert rc == 2 and "no new record" in out["error"]
    # round 3: round 2 kept the serving drafter, so its training records train round 3's candidate beside round 3's
    # own, and its held-out slice stays held out: the rule scores it again beside round 3's newest
    _write(rec / "records-00000002.jsonl", _records(tiny_qwen3, run_dir, 5, 15))
    rc, out, err = _learn(run_dir, tiny_qwen3, rec, capsys, "learn.min_gain=100")
    assert rc == 0, err[-3000:]
    r3 = json.loads((run_dir / "learn" / "rounds" / "003" / "round.json").read_text())
    assert r3["ids"]["heldout"] == ["req0013", "req0014", "req0018", "req0019"]
    assert r3["window"]["earlier_records"] == 3 and r3["window"]["earlier_heldout_records"] == 2
    assert r3["ids"]["train"] == [f"req{i:04d}" for i in (10, 11, 12, 15, 16, 17)]
    assert r3["comparison"]["samples"] == len(r3["scores"]["serving"]) == 4
    # the curve stays on round 3's own traffic (its new held-out pair first); those two score as the rule scored them
    curve = r3["serving_vs_static"]["scores"]
    assert curve["ids"][:2] == ["req0018", "req0019"]
    assert sorted(curve["ids"]) == [f"req{i:04d}" for i in range(15, 20)]
    assert curve["serving"][:2] == r3["scores"]["serving"][2:]
    # learn.heldout_pool=round: round 3's kept traffic, its held-out slices included, trains round 4's candidate
    _write(rec / "records-00000002.jsonl", _records(tiny_qwen3, run_dir, 5, 20))
    rc, out, err = _learn(run_dir, tiny_qwen3, rec, capsys, "learn.min_gain=100", "learn.heldout_pool=round")
    assert rc == 0, err[-3000:]
    r4 = json.loads((run_dir / "learn" / "rounds" / "004" / "round.json").read_text())
    assert r4["ids"]["heldout"] == ["req0023", "req0024"] and r4["window"]["earlier_records"] == 10
    assert r4["ids"]["train"] == [f"req{i:04d}" for i in range(10, 23)]
    # learn.window=round: only the records new since round 4 train; the pooled held-out slices are scored again
    _write(rec / "records-00000002.jsonl", _records(tiny_qwen3, run_dir, 5, 25))
    rc, out, err = _learn(run_dir, tiny_qwen3, rec, capsys, "learn.min_gain=100", "learn.window=round")
    assert rc == 0, err[-3000:]
    r5 = json.loads((run_dir / "learn" / "rounds" / "005" / "round.json").read_text())
    assert r5["ids"]["train"] == ["req0025", "req0026", "req0027"] and r5["window"]["earlier_records"] == 0
    assert r5["ids"]["heldout"] == [f"req{i:04d}" for i in (13, 14, 18, 19, 23, 24, 28, 29)]


def test_window_all_trains_on_every_learned_record_from_the_static_drafter_for_capped_epochs(
        run_dir, tiny_qwen3, tmp_path, capsys):
    """learn.window=all: after a promotion the next candidate still trains on the traffic before it (less the pooled
    held-out slices); learn.warm_start=static: every candidate starts from the static drafter; learn.max_epochs caps
    a round's steps at that many passes over its training samples (train.batch_size 2)."""
    assert main(["train", "--json", *overrides(run_dir, tiny_qwen3, train__max_steps=2)]) == 0
    capsys.readouterr()
    rec = tmp_path / "rec"
    _write(rec / "records-00000001.jsonl", _records(tiny_qwen3, run_dir, 10))
    knobs = ["learn.window=all", "learn.warm_start=static", "learn.max_epochs=1.5", "learn.max_steps=50"]
    rc, out, err = _learn(run_dir, tiny_qwen3, rec, capsys, "learn.min_gain=-4", *knobs)  # promotes
    assert rc == 0, err[-3000:]
    r1 = json.loads((run_dir / "learn" / "rounds" / "001" / "round.json").read_text())
    static = str(run_dir / "train" / "best") if (run_dir / "train" / "best").is_dir() else str(run_dir / "train" / "final")
    assert r1["decision"] == "promote" and r1["warm_start"] == static
    assert r1["steps"] == r1["train"]["steps"] == 6 and "learn.max_epochs=1.5 × 8 samples" in r1["steps_rule"]
    _write(rec / "records-00000001.jsonl", _records(tiny_qwen3, run_dir, 5, 10))
    rc, out, err = _learn(run_dir, tiny_qwen3, rec, capsys, "learn.min_gain=100", *knobs)  # keeps
    assert rc == 0, err[-3000:]
    r2 = json.loads((run_dir / "learn" / "rounds" / "002" / "round.json").read_text())
    assert r2["serving"]["id"] != "initial" and r2["warm_start"] == static
    # round 1's held-out pair was emptied from the pool by its promotion: it trains now, with everything else learned
    assert r2["ids"]["train"] == [f"req{i:04d}" for i in range(13)] and r2["window"]["earlier_records"] == 10
    assert r2["ids"]["heldout"] == ["req0013", "req0014"]
    assert r2["steps"] == 10  # ceil(1.5 × 13 / 2)
    # learn.warm_start=serving: the candidate starts from round 1's promoted drafter
    _write(rec / "records-00000001.jsonl", _records(tiny_qwen3, run_dir, 5, 15))
    rc, out, err = _learn(run_dir, tiny_qwen3, rec, capsys, "learn.min_gain=100", "learn.window=all")
    assert rc == 0, err[-3000:]
    r3 = json.loads((run_dir / "learn" / "rounds" / "003" / "round.json").read_text())
    assert r3["warm_start"] == r3["serving"]["dir"] == r2["serving"]["dir"]
    assert r3["ids"]["heldout"] == ["req0013", "req0014", "req0018", "req0019"]  # round 2 kept: its slice pooled
    assert r3["ids"]["train"] == [f"req{i:04d}" for i in (*range(13), 15, 16, 17)]


def test_every_block_of_a_sample_is_scored_unless_capped(run_dir, tiny_qwen3, tmp_path, capsys):
    """learn.score_anchors: null scores every block a held-out sample has (more than train.num_anchors=8 draws);
    an int caps them."""
    assert main(["train", "--json", *overrides(run_dir, tiny_qwen3, train__max_steps=2)]) == 0
    capsys.readouterr()
    rec = tmp_path / "rec"
    _write(rec / "records-00000001.jsonl", _records(tiny_qwen3, run_dir, 10))
    blocks = {}
    for cap in ("null", "3"):
        shutil.rmtree(run_dir / "learn", ignore_errors=True)
        rc, out, err = _learn(run_dir, tiny_qwen3, rec, capsys, f"learn.score_anchors={cap}")
        assert rc == 0, err[-3000:]
        r1 = json.loads((run_dir / "learn" / "rounds" / "001" / "round.json").read_text())
        blocks[cap] = [n for _, n in r1["scores"]["serving"]]
        assert [n for _, n in r1["scores"]["new"]] == blocks[cap]  # the same blocks for both drafters
    assert all(n <= 3 for n in blocks["3"]) and all(a >= b for a, b in zip(blocks["null"], blocks["3"]))
    assert max(blocks["null"]) > 8  # beyond what training draws a sample


def test_a_budget_without_calibration_still_bounds_the_round(run_dir, tiny_qwen3, tmp_path, capsys):
    """No saved calibration: the round plans learn.max_steps, and the budget's CPU time stops it early."""
    assert main(["train", "--json", *overrides(run_dir, tiny_qwen3, train__max_steps=2)]) == 0
    capsys.readouterr()
    rec = tmp_path / "rec"
    _write(rec / "records-00000001.jsonl", _records(tiny_qwen3, run_dir, 10))
    rc, out, err = _learn(run_dir, tiny_qwen3, rec, capsys, "learn.max_steps=400", "run.budget_minutes=0.002")
    assert rc == 0, err[-3000:]
    r1 = json.loads((run_dir / "learn" / "rounds" / "001" / "round.json").read_text())
    assert r1["steps"] == 400 and "CPU-time budget" in r1["steps_rule"]
    assert 1 <= r1["train"]["steps"] < 400, r1["train"]  # 0.072 CPU-s at most (0.002 min × 0.6 × threads)


def test_per_source_gain_scores_each_source_on_its_own_samples():
    from dflashkit.flywheel.rounds import by_source, paired_gain
    # agent samples: the new drafter better on every one; chat samples: identical scores
    new = [(2.0, 5), (2.5, 4), (1.2, 6), (1.4, 3), (3.0, 2)]
    old = [(1.5, 5), (2.0, 4), (1.2, 6), (1.4, 3), (2.0, 2)]
    src = ["agent", "agent", "chat", "chat", "agent"]
    per = by_source(new, old, src)
    assert set(per) == {"agent", "chat"}
    assert per["agent"]["samples"] == 3 and per["chat"]["samples"] == 2
    assert per["agent"]["interval90"][0] > 0 and per["agent"]["better_samples"] == 3
    assert per["chat"]["gain"] == 0 and per["chat"]["interval90"] == [0, 0]
    # the pooled gain over both sources lies between the two sources' gains
    pooled = paired_gain(new, old)["gain"]
    assert per["chat"]["gain"] < pooled < per["agent"]["gain"]


def test_the_rule_keeps_out_a_candidate_worse_on_one_source():
    from dflashkit.flywheel.rounds import by_source, decide, paired_gain
    # better on every agent sample by far, worse on every chat sample: pooled above 0, chat wholly below
    new = [(3.0, 5), (3.2, 5), (2.9, 5), (1.1, 5), (1.2, 5), (1.0, 5)]
    old = [(1.5, 5), (1.6, 5), (1.4, 5), (1.3, 5), (1.4, 5), (1.2, 5)]
    src = ["agent"] * 3 + ["chat"] * 3
    cmp = {**paired_gain(new, old), "by_source": by_source(new, old, src)}
    assert cmp["interval90"][0] > 0 and cmp["by_source"]["chat"]["interval90"][1] < 0
    promote, why = decide(cmp, min_gain=0.0, source_guard=True)
    assert not promote and "worse on chat" in why and "agent" not in why.split("worse on")[1]
    assert decide(cmp, min_gain=0.0, source_guard=False)[0]
    # the chat samples level instead: promoted with the guard on
    level = {**paired_gain(new[:3] + old[3:], old), "by_source": by_source(new[:3] + old[3:], old, src)}
    assert decide(level, min_gain=0.0, source_guard=True) == (True, decide(level, min_gain=0.0, source_guard=False)[1])
    assert decide({"interval90": None}, min_gain=0.0, source_guard=True) == (False, "no held-out sample to score")
