"""`dflashkit bench train` on a tiny target: measured on the run's first batch, written to bench/train.json."""

from __future__ import annotations

import json

import pytest

from dflashkit.cli import main
from tests.helpers import make_run, overrides, tokenize_texts


@pytest.mark.parametrize("vocab", [None, 24])
def test_bench_train_reports_consistent_numbers(tmp_path, tiny_qwen3, capsys, monkeypatch, vocab):
    import dflashkit.bench.train as bench_train
    from dflashkit.train.objective import dflash_loss

    calls: list[int] = []  # one entry per drafter step the bench runs: each a real loss + backward + AdamW step

    def counted(*args, **kwargs):
        out = dflash_loss(*args, **kwargs)
        calls.append(int(out.loss.requires_grad))
        return out

    monkeypatch.setattr(bench_train, "dflash_loss", counted)
    rd = make_run(tmp_path / "r", tiny_qwen3)
    # the reduced-vocab case also runs the online target forward under bf16 autocast
    extra = [f"drafter.draft_vocab_size={vocab}", "train.target_dtype=bfloat16"] if vocab else []
    assert main(["bench", "train", "3", "--json", *overrides(rd, tiny_qwen3), *extra]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["vocab_projected"] == (vocab or 320)
    # the step is measured on the run's first global batch (train.batch_size=2 samples), as tokenized
    assert out["subject"] == "train" and out["batch_size"] == 2
    assert out["tokens"] == sum(len(r["input_ids"]) for r in tokenize_texts(tiny_qwen3)[:2])
    assert 0 < out["anchors"] <= 2 * 8  # train.num_anchors=8 per sample
    assert all(out[k] > 0 for k in ("target_forward_s", "features_s", "drafter_step_s"))
    written = json.loads((rd / "bench" / "train.json").read_text())
    assert written == {k: v for k, v in out.items() if k not in ("command", "ok", "subject", "wall_time_s")}
    # 2 warm-up + 3 timed drafter steps; on CPU without train autocast also 1 warm-up + 3 timed under bf16
    bf16_too = "drafter_step_bf16_autocast_s" in out
    assert out["iters"] == 3 and len(calls) == 2 + 3 + (1 + 3 if bf16_too else 0) and all(calls)
    assert bf16_too == (out["autocast"] is None)
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
