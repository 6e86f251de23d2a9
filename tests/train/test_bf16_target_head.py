"""A bf16 target (`target.dtype: auto` on CUDA) trains: its head projects the drafter's float32 output (the final
norm's weight is float32) in bf16, under bf16 autocast and without it. Before, F.linear refused the mixed dtypes
at the first step, so the default CUDA configuration could not train."""

from __future__ import annotations

import math

import pytest

from dflashkit.cli import main
from dflashkit.rundir import RunDir
from dflashkit.train.logging import read_metrics
from tests.helpers import make_run, overrides


@pytest.mark.parametrize("train_dtype", ["float32", "bfloat16"])
def test_a_bf16_target_trains(tmp_path, tiny_qwen3, train_dtype):
    rd = make_run(tmp_path / "run", tiny_qwen3)
    argv = overrides(rd, tiny_qwen3, target__dtype="bfloat16", train__dtype=train_dtype, train__max_steps=2,
                     train__loss="ce+kl")  # KL: the target head also takes the target's bf16 last hidden state
    assert main(["train", "--json", *argv]) == 0
    rows = read_metrics(RunDir(rd))
    assert len(rows) == 3 and all(math.isfinite(r["loss"]) for r in rows), rows


def test_a_lilicorr_drafter_trains_online_on_a_bf16_targets_features(tmp_path, tiny_qwen3):
    """LiLiCorr's lattice anchor (hidden_norm(fc(features)) of the row before each block) is computed in the loss,
    outside the drafter's autocast: online features of a bf16 target must reach its float32 fc in fc's dtype."""
    rd = make_run(tmp_path / "run", tiny_qwen3, drafter_type="lilicorr", lilicorr_candidate_topk=4,
                  lilicorr_num_heads=4, lilicorr_factor_dim=16)
    argv = overrides(rd, tiny_qwen3, target__dtype="bfloat16", train__dtype="bfloat16", train__max_steps=2,
                     train__features="online", drafter__type="lilicorr", drafter__draft_vocab_size="null")
    assert main(["train", "--json", *argv]) == 0
    rows = read_metrics(RunDir(rd))
    assert rows and all(math.isfinite(r["loss"]) for r in rows), rows
    assert any(r.get("lattice_supervised", 0) > 0 for r in rows), rows  # the lattice terms ran
