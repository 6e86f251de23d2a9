"""`dflashkit bench train` on a tiny target: measured on the run's first batch, written to bench/train.json."""

from __future__ import annotations

import json

import pytest

from dflashkit.cli import main
from tests.helpers import make_run, overrides, tokenize_texts


@pytest.mark.parametrize("vocab", [None, 24])
def test_bench_train_reports_consistent_numbers(tmp_path, tiny_qwen3, capsys, monkeypatch, vocab):
    from dflashkit.train.loss import DraftLoss

    calls: list[int] = []  # one entry per drafter step the bench runs: each a real loss + backward + AdamW step
    real = DraftLoss.__call__

    def counted(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        calls.append(int(out.loss.requires_grad))
        return out

    monkeypatch.setattr(DraftLoss, "__call__", counted)
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

    from dflashkit.target.load import cpu_facts, target_autocast

    cpu = torch.device("cpu")
    assert target_autocast("float32", cpu, torch.float32) is None
    assert target_autocast("bfloat16", cpu, torch.float32) is torch.bfloat16
    assert target_autocast("bfloat16", cpu, torch.bfloat16) is None  # already 16-bit: nothing to do
    fast = bool({"amx_bf16", "avx512_bf16"} & set(cpu_facts().get("bf16", [])))
    assert target_autocast("auto", cpu, torch.float32) is (torch.bfloat16 if fast else None)


@pytest.mark.parametrize("flags,fast", [([], False), (["avx512_bf16"], True), (["amx_bf16"], True),
                                        (["avx512_bf16", "amx_bf16"], True)])
def test_bf16_is_chosen_on_every_cpu_with_bf16_matmuls_and_only_there(monkeypatch, flags, fast):
    """auto → bf16 wherever the CPU multiplies bf16 natively (AVX512-BF16 or AMX), for the target's autocast,
    the drafter's dtype in decoding and Muon's Newton-Schulz alike; emulated bf16 (neither) stays float32."""
    import torch

    import dflashkit.target.load as target_mod
    from dflashkit.decode.spec_decode import fast_draft_dtype
    from dflashkit.train.optim import Fp32Muon, build_optimizer

    monkeypatch.setattr(target_mod, "cpu_facts", lambda: {"cpu": "test", "bf16": list(flags)})
    cpu = torch.device("cpu")
    assert target_mod.fast_bf16(cpu) is fast
    assert target_mod.target_autocast("auto", cpu, torch.float32) is (torch.bfloat16 if fast else None)

    class FakeTarget:
        device, dtype = cpu, torch.float32

    assert fast_draft_dtype(FakeTarget()) is (torch.bfloat16 if fast else torch.float32)  # type: ignore[arg-type]

    class Train:
        optimizer, lr, weight_decay, muon_momentum, betas = "muon", 1e-3, 0.0, 0.95, (0.9, 0.95)

    opt = build_optimizer(torch.nn.Linear(4, 4, bias=False), Train())
    assert isinstance(opt.inner[0], Fp32Muon) is (not fast)
