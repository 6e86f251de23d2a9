"""`dflashkit bench suffix` with tiny contexts: every row measured, prompt lookup beside it; bad contexts refused."""

from __future__ import annotations

import json

from dflashkit.bench.suffix import synthetic_text
from dflashkit.cli import main


def test_bench_suffix_times_each_context(tmp_path, capsys):
    args = ["bench", "suffix", "--json", f"run.run_dir={tmp_path / 'r'}", "64", "300"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["subject"] == "suffix" and [r["context"] for r in out["rows"]] == [64, 300]
    for r in out["rows"]:
        for key in ("index_prompt_s", "index_pool_request_s", "suffix_step_s", "suffix_pool_step_s", "lookup_step_s"):
            assert r[key] > 0, key
        assert 0 < r["nodes_per_token"] <= 33            # at most max_depth + 1 nodes per token
    assert "cpu" in out and (tmp_path / "r" / "bench" / "suffix.json").is_file()


def test_bench_suffix_human_table(tmp_path, capsys):
    assert main(["bench", "suffix", f"run.run_dir={tmp_path / 'r'}", "40"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("CPU:") and "lookup µs/step" in lines[1]
    assert lines[2].split()[0] == "40" and json.loads(lines[-1])["rows"][0]["context"] == 40


def test_bench_suffix_refuses_a_bad_context(tmp_path, capsys):
    assert main(["bench", "suffix", f"run.run_dir={tmp_path / 'r'}", "8k"]) == 2
    assert "token counts" in capsys.readouterr().err
    assert not (tmp_path / "r" / "bench" / "suffix.json").exists()


def test_synthetic_text_repeats_itself():
    text = synthetic_text(2000, seed=3)
    assert len(text) == 2000 and text == synthetic_text(2000, seed=3)
    grams = [tuple(text[i:i + 4]) for i in range(len(text) - 3)]
    assert len(set(grams)) < 0.8 * len(grams)             # copied spans: many 4-grams recur
