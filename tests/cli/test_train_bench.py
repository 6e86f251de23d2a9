"""`dflashkit bench train` on a tiny target: measured on the run's first batch, written to bench/train.json."""

from __future__ import annotations

import json

import pytest

from dflashkit.cli import main
from tests.helpers import make_run, overrides, tokenize_texts


@pytest.mark.parametrize("vocab", [None, 24])
def test_bench_train_reports_consistent_numbers(tmp_path, tiny_qwen3, capsys, vocab):
    rd = make_run(tmp_path / "r", tiny_qwen3)
    # the reduced-vocab case also runs the online target forward under bf16 autocast
    extra = [f"drafter.draft_vocab_size={vocab}", "train.target_dtype=bfloat16"] if vocab else []
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
    assert abs(out["online_step_s"] - out["features_s"] - out["drafter_step_s"]) < 1e-4
    assert abs(out["drafter_over_target_forward"] - out["drafter_step_s"] / out["target_forward_s"]) < 0.01
    step = out["online_step_s"]
    assert abs(out["context_tokens_per_s"] - out["tokens"] / step) <= 0.1 + 1e-3 * out["context_tokens_per_s"]
    assert abs(out["features_share"] + out["drafter_share"] - 1) < 0.01
    assert out["target_autocast"] == ("torch.bfloat16" if vocab else None)
    timed = out["features_bf16_autocast_s"] if vocab else out["features_float32_s"]
    assert timed == out["features_s"] and out["features_float32_s"] > 0 and out["features_bf16_autocast_s"] > 0


def test_target_autocast_setting():
    import torch

    from dflashkit.model.target import cpu_facts, target_autocast

    cpu = torch.device("cpu")
    assert target_autocast("float32", cpu, torch.float32) is None
    assert target_autocast("bfloat16", cpu, torch.float32) is torch.bfloat16
    assert target_autocast("bfloat16", cpu, torch.bfloat16) is None  # already 16-bit: nothing to do
    amx = "amx_bf16" in cpu_facts().get("bf16", [])
    assert target_autocast("auto", cpu, torch.float32) is (torch.bfloat16 if amx else None)
