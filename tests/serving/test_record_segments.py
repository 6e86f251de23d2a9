"""The record dir's listing for readers with their own cursor (`learn`): segments in write order, only complete
lines, a missing dir refused naming it as the caller called it."""

from __future__ import annotations

import pytest

from dflashkit.errors import UsageError
from dflashkit.serving.record import Recorder, complete_lines, segments


def test_segments_in_write_order_and_only_complete_lines(tmp_path):
    root = tmp_path / "rec"
    for run in range(2):  # every open starts a new segment
        rec = Recorder(root, fingerprint="fp").open()
        rec.write({"id": f"r{run}", "endpoint": "chat", "messages": []})
        rec.close()
    (root / "notes.jsonl").write_text("{}\n")  # not a segment
    segs = segments(root)
    assert [p.name for p in segs] == ["records-00000001.jsonl", "records-00000002.jsonl"]
    with open(segs[1], "ab") as fh:
        fh.write(b'{"id": "half')  # a line still being written (or torn by a kill)
    assert [len(complete_lines(p)) for p in segs] == [1, 1]
    assert b'"r1"' in complete_lines(segs[1])[0]


def test_a_missing_record_dir_is_named(tmp_path):
    with pytest.raises(UsageError, match=r"--records .*nope: not a directory"):
        segments(tmp_path / "nope", named="--records")
