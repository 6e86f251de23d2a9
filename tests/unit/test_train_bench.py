"""`dflashkit bench train` on a tiny target: measured on the run's first batch, written to bench/train.json."""

from __future__ import annotations

import json

import pytest

from dflashkit.cli import main
from tests.helpers import make_run, overrides, tokenize_texts


@pytest.mark.parametrize("vocab", [None, 24])
def test_bench_train_reports_consistent_numbers(tmp_path, tiny_qwen3, capsys, vocab):
    rd = make_run(tmp_path / "r", tiny_qwen3)
    extra = [f"drafter.draft_vocab_size={vocab}"] if vocab else []
    assert main(["bench", "train", "1", "--json", *overrides(rd, tiny_qwen3), *extra]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["vocab_projected"] == (vocab or 320)
    # the step is measured on the run's first global batch (train.batch_size=2 samples), as tokenized
    assert out["subject"] == "train" and out["batch_size"] == 2
    assert out["tokens"] == sum(len(r["input_ids"]) for r in tokenize_texts(tiny_qwen3)[:2])
    assert 0 < out["anchors"] <= 2 * 8  # train.num_anchors=8 per sample
    assert all(out[k] > 0 for k in ("target_forward_s", "features_s", "drafter_step_s"))
    written = json.loads((rd / "bench" / "train.json").read_text())
    assert written == {k: v for k, v in out.items() if k not in ("command", "ok", "subject", "wall_time_s")}
