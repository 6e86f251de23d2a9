"""`read_window(..., since=base)` reads a `since_promotion` window in one pass: the same new records, cursor,
corrupt lines, spans and earlier records as reading the record dir twice (from the round cursor, then from the
promotion cursor, dropping the ids of the first read), which is what `learn_round` did before."""

from __future__ import annotations

import json

import pytest

from dflashkit.flywheel.traffic import read_window

FP = "f" * 64


def _rec(i: int, t: float) -> str:
    return json.dumps({"id": f"r{i:03d}", "time": t, "endpoint": "chat", "target": {"fingerprint": FP},
                       "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]})


@pytest.fixture()
def record_dir(tmp_path):
    """Two segments whose record times interleave, with corrupt lines, a /v1/completions record and a line still
    being written."""
    d = tmp_path / "rec"
    d.mkdir()
    one = [_rec(0, 5.0), _rec(1, 1.0), "not json", _rec(2, 9.0), json.dumps({"endpoint": "completions",
           "prompt": "p", "completion": "c"}), _rec(3, 2.0), "{broken", _rec(4, 7.0)]
    two = [_rec(10, 3.0), _rec(11, 8.0), "[1, 2]", _rec(12, 0.5), _rec(13, 6.0)]
    (d / "records-00000001.jsonl").write_text("\n".join(one) + "\n")
    (d / "records-00000002.jsonl").write_text("\n".join(two) + "\n" + '{"id": "r099", "ti')
    return d


def _two_reads(record_dir, cursor, base):
    win = read_window(record_dir, cursor, expected=FP, on_corrupt="skip")
    new_ids = {str(r["id"]) for r in win.records}
    earlier = [r for r in read_window(record_dir, base, expected=FP, on_corrupt="skip").records
               if str(r["id"]) not in new_ids]
    return win, earlier


@pytest.mark.parametrize("base, cursor", [
    ({}, {"records-00000001.jsonl": 4}),
    ({"records-00000001.jsonl": 2}, {"records-00000001.jsonl": 6, "records-00000002.jsonl": 2}),
    ({"records-00000001.jsonl": 3}, {"records-00000001.jsonl": 8, "records-00000002.jsonl": 4}),
    ({"records-00000001.jsonl": 8, "records-00000002.jsonl": 1}, {"records-00000001.jsonl": 8,
                                                                    "records-00000002.jsonl": 3}),
])
def test_one_read_finds_the_window_two_reads_found(record_dir, base, cursor):
    win, earlier = _two_reads(record_dir, cursor, base)
    one = read_window(record_dir, cursor, expected=FP, on_corrupt="skip", since=base)
    assert one.earlier == earlier and earlier  # never vacuous: every case has earlier records
    assert (one.records, one.cursor, one.corrupt, one.span, one.skipped) == (
        win.records, win.cursor, win.corrupt, win.span, win.skipped)
    assert read_window(record_dir, cursor, expected=FP, on_corrupt="skip").earlier == []


def test_the_earlier_records_are_those_between_the_cursors_oldest_first(record_dir):
    one = read_window(record_dir, {"records-00000001.jsonl": 6, "records-00000002.jsonl": 2}, expected=FP,
                      since={"records-00000001.jsonl": 2})
    assert [r["id"] for r in one.earlier] == ["r003", "r010", "r011", "r002"]  # times 2, 3, 8, 9
    assert [r["id"] for r in one.records] == ["r012", "r013", "r004"]  # times 0.5, 6, 7
    # only the new part's corrupt lines are reported (the earlier ones were, by the rounds that read them)
    assert [c.split(": ")[0].rsplit("/", 1)[1] for c in one.corrupt] == ["records-00000001.jsonl:7",
                                                                      "records-00000002.jsonl:3"]
