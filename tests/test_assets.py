"""Asset fetches are atomic (`rundir.atomic_dir`): a whole directory or none, never a user's dir replaced;
concurrent fetchers of one asset build it once."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from dflashkit import assets
from dflashkit.errors import UsageError
from dflashkit.target.tiny import make_tiny_target


def test_fetch_and_refetch_leave_one_complete_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path))
    path = assets.asset_path("tiny-qwen3", build=make_tiny_target)
    assert path == tmp_path / "tiny-qwen3" and (path / "config.json").is_file() and assets.is_fetched("tiny-qwen3")
    before = (path / "config.json").read_text()
    assets._fetch("tiny-qwen3", make_tiny_target)  # a second fetcher (another process) replaces the copy in one rename
    assert (path / ".complete").is_file() and (path / "config.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tiny-qwen3.lock", "tiny-qwen3"]  # no temp or old dir left


def test_concurrent_fetchers_build_once_and_both_get_the_whole_dir(tmp_path, monkeypatch):
    """Two fetchers at once (two test workers, two runs on one cache): the second waits for the first's
    copy instead of building its own and renaming it over the directory the first is reading."""
    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path))
    builds, started = [], threading.Event()

    def slow_build(out, arch, wrapper=None):
        builds.append(arch)
        started.set()
        time.sleep(0.5)  # the second fetcher arrives meanwhile
        return make_tiny_target(out, arch, wrapper=wrapper)

    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(assets.asset_path, "tiny-qwen3", build=slow_build)
        assert started.wait(60)
        second = pool.submit(assets.asset_path, "tiny-qwen3", build=slow_build)
        paths = [first.result(timeout=120), second.result(timeout=120)]
    assert builds == ["qwen3"] and paths == [tmp_path / "tiny-qwen3"] * 2
    assert assets.is_fetched("tiny-qwen3") and (paths[0] / "config.json").is_file()


def test_a_dir_without_the_marker_is_not_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path))
    mine = tmp_path / "tiny-qwen3"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(UsageError, match="refusing to replace"):
        assets.asset_path("tiny-qwen3", build=make_tiny_target)
    assert (mine / "notes.txt").read_text() == "keep me"
