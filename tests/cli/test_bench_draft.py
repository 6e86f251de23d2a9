"""`dflashkit bench draft`: one draft step through the drafter module's forward and the lean one, per dtype.

Structure only, never speed: both paths timed in float32 and bfloat16, module / lean the ratio of the two
times, and the two paths computing the same logits on the bench's inputs (the bench compares like with like)."""

from __future__ import annotations

import json

import pytest
import torch

from dflashkit.sizing.draft_cost import time_draft_step
from dflashkit.cli import main
from dflashkit.config import TargetSection
from dflashkit.errors import UsageError
from dflashkit.family import new_drafter
from dflashkit.family.contract import DrafterContract
from dflashkit.model.drafter import DFlashDraftModel
from dflashkit.target.load import load_target
from tests.helpers import run_dir_with_drafter, with_fields

CONTRACT = DrafterContract(block_size=4, num_draft_layers=2, target_layer_ids=[0, 2, 3], mask_token_id=3,
                           num_target_layers=6, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, intermediate_size=96, vocab_size=300, rope_theta=1e4)
ATOL = {"float32": 1e-4, "bfloat16": 5e-2}


def _check(res: dict, block_size: int) -> None:
    assert res["block_size"] == block_size and set(res["dtypes"]) == {"float32", "bfloat16"}
    for name, r in res["dtypes"].items():
        assert r["module_ms"] > 0 and r["lean_ms"] > 0, r
        assert r["module_over_lean"] == pytest.approx(r["module_ms"] / r["lean_ms"], rel=2e-2), r
        assert 0 <= r["max_abs_logit_diff"] <= ATOL[name], (name, r)


def test_time_draft_step_times_both_paths_in_each_dtype():
    torch.manual_seed(0)
    m = DFlashDraftModel(CONTRACT)
    m.reset_parameters(std=0.2)
    m.eval()
    head = torch.randn(CONTRACT.vocab_size, CONTRACT.hidden_size) * 0.3
    mask = torch.randn(1, 1, CONTRACT.hidden_size)
    res = time_draft_step(m, head, None, mask, context=12, new=2, reps=1, warmup=0)
    _check(res, 4)
    assert res["context"] == 12 and res["new"] == 2 and res["reps"] == 1
    assert next(m.parameters()).dtype == torch.float32  # the drafter itself is left as it was


def test_time_draft_step_refuses_a_drafter_the_lean_forward_does_not_take():
    d2 = new_drafter(with_fields(CONTRACT, drafter_type="dflash2", conv_group_size=16, selector_rank=8,
                                 selector_top_k=4))
    with pytest.raises(UsageError, match="lean draft forward"):
        time_draft_step(d2, torch.randn(300, 64), None, torch.randn(1, 1, 64), reps=1, warmup=0)


def test_bench_draft_on_a_run_prints_and_writes_both_paths(tmp_path, tiny_qwen3, capsys):
    target = load_target(TargetSection(path=str(tiny_qwen3), device="cpu", dtype="float32"))
    rd = run_dir_with_drafter(tmp_path, target, block_size=4, layers=2)
    assert main(["bench", "draft", f"target.path={tiny_qwen3}", "target.device=cpu", "--run-dir", str(rd)]) == 0
    out = capsys.readouterr().out
    assert "module/lean" in out and "float32" in out and "bfloat16" in out, out
    written = json.loads((rd / "bench" / "draft.json").read_text())
    _check(written, 4)
    assert written["head_rows"] == target.vocab_size and written["drafter_type"] == "dflash"
