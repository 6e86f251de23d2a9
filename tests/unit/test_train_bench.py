"""`dflashkit bench train` on a tiny target: numbers present, consistent, written to bench/train.json."""

from __future__ import annotations

import json

import pytest

from dflashkit.cli import main
from tests.helpers import make_run, overrides


@pytest.mark.parametrize("vocab", [None, 24])
def test_bench_train_reports_consistent_numbers(tmp_path, tiny_qwen3, capsys, vocab):
    rd = make_run(tmp_path / "r", tiny_qwen3)
    extra = [f"drafter.draft_vocab_size={vocab}"] if vocab else []
    assert main(["bench", "train", "1", "--json", *overrides(rd, tiny_qwen3), *extra]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["vocab_projected"] == (vocab or 320)
    assert out["subject"] == "train" and out["tokens"] > 0 and out["anchors"] > 0
    assert abs(out["online_step_s"] - out["features_s"] - out["drafter_step_s"]) < 1e-4
    assert abs(out["drafter_over_target_forward"] - out["drafter_step_s"] / out["target_forward_s"]) < 0.01
    assert json.loads((rd / "bench" / "train.json").read_text())["tokens"] == out["tokens"]
