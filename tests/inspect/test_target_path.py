"""One target-path resolver: a model dir, its config.json, a .gguf file, a dir with one .gguf, an asset name."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflashkit.config import TargetSection
from dflashkit.errors import UsageError
from dflashkit.inspect.target import resolve_target_path


def test_dir_and_config_json_resolve_to_the_same_dir(tiny_qwen3):
    d = Path(tiny_qwen3)
    assert resolve_target_path(str(d)) == (d, None)
    assert resolve_target_path(str(d / "config.json")) == (d, None)


def test_gguf_file_and_a_lone_gguf_in_a_dir(tmp_path):
    (tmp_path / "m.Q8_0.gguf").write_bytes(b"GGUF")
    assert resolve_target_path(str(tmp_path / "m.Q8_0.gguf")) == (tmp_path, "m.Q8_0.gguf")
    assert resolve_target_path(str(tmp_path)) == (tmp_path, "m.Q8_0.gguf")
    (tmp_path / "other.gguf").write_bytes(b"GGUF")  # two: ambiguous, so target.gguf_file must say which
    assert resolve_target_path(str(tmp_path)) == (tmp_path, None)
    assert resolve_target_path(str(tmp_path), "other.gguf") == (tmp_path, "other.gguf")


@pytest.mark.parametrize("name,expect", [("", "target.path is empty"), ("nope", "no such file or directory"),
                                         ("weights.bin", "neither a .gguf nor a config.json")])
def test_bad_paths_exit_2(tmp_path, name, expect):
    (tmp_path / "weights.bin").write_bytes(b"")
    path = str(tmp_path / name) if name else ""
    with pytest.raises(UsageError, match=expect):
        resolve_target_path(path)


def test_load_target_accepts_config_json(tiny_qwen3):
    """load_target and probe share the resolver: a config.json path loads the model beside it."""
    from dflashkit.target.load import load_target

    target = load_target(TargetSection(path=str(Path(tiny_qwen3) / "config.json")), with_tokenizer=False)
    assert target.model_dir == Path(tiny_qwen3) and target.num_layers > 0
