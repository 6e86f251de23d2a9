"""Asset fetches are atomic (`rundir.atomic_dir`): a whole directory or none, never a user's dir replaced."""

from __future__ import annotations

import pytest

from dflashkit import assets
from dflashkit.errors import UsageError
from dflashkit.model.tiny import make_tiny_target


def test_fetch_and_refetch_leave_one_complete_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path))
    path = assets.asset_path("tiny-qwen3", build=make_tiny_target)
    assert path == tmp_path / "tiny-qwen3" and (path / "config.json").is_file() and assets.is_fetched("tiny-qwen3")
    before = (path / "config.json").read_text()
    assets._fetch("tiny-qwen3", make_tiny_target)  # a second fetcher (another process) replaces the copy in one rename
    assert (path / ".complete").is_file() and (path / "config.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-qwen3"]  # no temp or old dir left


def test_a_dir_without_the_marker_is_not_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path))
    mine = tmp_path / "tiny-qwen3"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(UsageError, match="refusing to replace"):
        assets.asset_path("tiny-qwen3", build=make_tiny_target)
    assert (mine / "notes.txt").read_text() == "keep me"
