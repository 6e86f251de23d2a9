"""A chat-template variable or JSON field whose YAML key is not a string (`{1: true}`, `{true: x}`) is refused when
the config loads (exit 2) naming the field and the key, before any stage runs."""

from __future__ import annotations

import json

import pytest

from dflashkit.cli import main


SOURCES = "data:\n  sources:\n    - path: sharegpt\n"


@pytest.mark.parametrize("yaml_text, key, bad", [
    ("data:\n  sources:\n    - path: sharegpt\n    - path: humaneval\n      chat_template_kwargs: {1: true}\n",
     "data.sources[1].chat_template_kwargs", "1"),
    ("data:\n  sources:\n    - path: sharegpt\n      chat_template_kwargs: {true: x, enable_thinking: false}\n",
     "data.sources[0].chat_template_kwargs", "True"),
    (f"{SOURCES}tokenize:\n  chat_template_kwargs: {{2.5: x}}\n", "tokenize.chat_template_kwargs", "2.5"),
    (f"{SOURCES}generate:\n  chat_template_kwargs: {{null: 1}}\n", "generate.chat_template_kwargs", "None"),
])
def test_non_string_template_kwargs_key_is_a_config_error(tmp_path, capsys, yaml_text, key, bad):
    (tmp_path / "run.yaml").write_text(yaml_text)
    rc = main(["prepare", "-c", str(tmp_path / "run.yaml"), f"run.run_dir={tmp_path / 'run'}", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 2 and out["ok"] is False
    assert f"{key}: the key {bad} is " in out["error"], out["error"]
    assert not (tmp_path / "run" / "prepare").exists()


def test_an_override_with_a_non_string_key_is_refused(tmp_path, capsys):
    rc = main(["prepare", f"run.run_dir={tmp_path / 'run'}", "data.sources=[{path: sharegpt}]",
               "tokenize.chat_template_kwargs={enable_thinking: false, 7: x}", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 2 and "tokenize.chat_template_kwargs: the key 7 is int" in out["error"], out


def test_string_keys_pass(tmp_path, capsys):
    (tmp_path / "run.yaml").write_text("data:\n  sources:\n    - path: sharegpt\n      "
                                       "chat_template_kwargs: {'1': true, enable_thinking: false}\n")
    rc = main(["prepare", "-c", str(tmp_path / "run.yaml"), f"run.run_dir={tmp_path / 'run'}", "--dry-run", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0, out
