"""`dflashkit train` with drafter.type=dflash2: walk and unary τ logged, best on the walk's τ, our checkpoint
format round-trips the DFlash2 drafter, micro-batch × accumulation and online ≡ cached."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dflashkit.cli import main
from tests.helpers import assert_same_weights, make_run, overrides

DFLASH2 = dict(drafter_type="dflash2", conv_group_size=16, selector_rank=16, selector_top_k=8)
FLAGS = ["drafter.type=dflash2"]


def _run(tmp_path, target, name="run", extra=(), **train):
    rd = make_run(tmp_path / name, target, **DFLASH2)
    rc = main(["train", "--json", *overrides(rd, target, **train), *FLAGS, *extra])
    return rc, rd


def _rows(rd):
    return [json.loads(x) for x in (rd / "train" / "metrics.jsonl").read_text().splitlines()]


def test_dflash2_trains_logs_the_walk_and_round_trips(tmp_path, tiny_qwen3, capsys):
    from dflashkit.export.hf import load_drafter
    from dflashkit.model.dflash2 import DFlash2DraftModel
    from dflashkit.train.checkpoint import read_best

    rc, rd = _run(tmp_path, tiny_qwen3, train__max_steps=4, train__eval_every=2)
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0, out
    rows = _rows(rd)
    steps = [r for r in rows if "split" not in r]
    evals = [r for r in rows if r.get("split") == "heldout"]
    assert len(evals) == 2 and all(0 <= r["topk_coverage"] <= 1 and 0 <= r["selector_acc"] <= r["topk_coverage"]
                                   for r in evals + steps)
    assert all(1 <= r["tau"] <= 4 and 1 <= r["unary_tau"] <= 4 and r["selector_loss"] > 0 for r in evals)
    best = read_best(rd / "train" / "best")
    assert best is not None and best["tau"] == max(r["tau"] for r in evals)  # the best is the walk's τ
    curve = json.loads((rd / "train" / "curve.json").read_text())["points"]
    assert [p["heldout"]["tau"] for p in curve] == [r["tau"] for r in evals]
    assert all("unary_tau" in p["heldout"] for p in curve)
    cfg = json.loads((rd / "train" / "final" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    assert {k: cfg["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                 "selector_top_k")} == {"conv_kernel_size": 2, "conv_group_size": 16,
                                                                        "selector_rank": 16, "selector_top_k": 8}
    sd = load_file(rd / "train" / "final" / "model.safetensors")
    assert tuple(sd["candidate_selector.predecessor_codebook"].shape) == (320, 16)
    assert "layers.0.mlp_conv.kernel_projection.weight" in sd
    # the training moved the convolution away from its identity init and the selector from its init
    assert sd["layers.0.attention_conv.kernel_projection.weight"].abs().sum() > 0
    model = load_drafter(rd / "train" / "final", dtype=torch.float32)
    assert isinstance(model, DFlash2DraftModel) and model.top_k == 8
    assert all(torch.equal(model.state_dict()[k], v) for k, v in sd.items())


@pytest.mark.parametrize("extra", [(), ("train.position_weighting=dpace",)], ids=["decay", "dpace"])
def test_dflash2_micro_batch_times_grad_accum_equivalence(tmp_path, tiny_qwen3, extra):
    rc1, a = _run(tmp_path, tiny_qwen3, "a", extra, train__batch_size=4, train__grad_accum=1, train__max_steps=3)
    rc2, b = _run(tmp_path, tiny_qwen3, "b", extra, train__batch_size=2, train__grad_accum=2, train__max_steps=3)
    assert rc1 == rc2 == 0
    la = [r["loss"] for r in _rows(a) if "split" not in r]
    lb = [r["loss"] for r in _rows(b) if "split" not in r]
    assert torch.allclose(torch.tensor(la), torch.tensor(lb), atol=1e-5), (la, lb)
    wa, wb = load_file(a / "train" / "final" / "model.safetensors"), load_file(b / "train" / "final" / "model.safetensors")
    assert_same_weights(wa, wb)  # AdamW's lr·g/eps on near-zero gradients: see the helper


@pytest.mark.parametrize("extra", [(), ("train.labels=target",)], ids=["data-labels", "target-labels"])
def test_dflash2_online_equals_cached(tmp_path, tiny_qwen3, extra):
    rd_on = make_run(tmp_path / "on", tiny_qwen3, **DFLASH2)
    rd_ca = make_run(tmp_path / "ca", tiny_qwen3, **DFLASH2)
    assert main(["capture", "--json", *overrides(rd_ca, tiny_qwen3), "capture.dtype=float32", *FLAGS, *extra]) == 0
    assert main(["train", "--json", *overrides(rd_on, tiny_qwen3, train__max_steps=3), *FLAGS, *extra]) == 0
    assert main(["train", "--json", *overrides(rd_ca, tiny_qwen3, train__max_steps=3, train__features="cached"),
                 *FLAGS, *extra]) == 0
    on, ca = _rows(rd_on), _rows(rd_ca)
    assert len(on) == len(ca) == 4
    for key in ("loss", "tau", "unary_tau", "selector_loss"):
        assert torch.allclose(torch.tensor([r[key] for r in on]), torch.tensor([r[key] for r in ca]), atol=1e-4), key


def test_drafter_type_must_match_the_contract(tmp_path, tiny_qwen3, capsys):
    rd = make_run(tmp_path / "run", tiny_qwen3)  # a DFlash contract
    assert main(["train", "--json", *overrides(rd, tiny_qwen3), *FLAGS]) == 2
    assert "drafter.type: 'dflash2' in the config, 'dflash' in" in capsys.readouterr().err
    rc = main(["train", "--json", *overrides(rd, tiny_qwen3), *FLAGS, "drafter.draft_vocab_size=24"])
    assert rc == 2 and "drafter.draft_vocab_size: 24 with drafter.type=dflash2" in capsys.readouterr().err


def test_probe_writes_the_dflash2_knobs_into_the_contract(tmp_path, tiny_qwen3, capsys):
    run = tmp_path / "run"
    assert main(["probe", str(tiny_qwen3), "--run-dir", str(run), "--json", "drafter.type=dflash2",
                 "drafter.selector_top_k=4", "drafter.final_logit_softcapping=30"]) == 0
    c = json.loads((run / "contract.json").read_text())
    assert (c["drafter_type"], c["selector_top_k"], c["selector_rank"], c["conv_kernel_size"]) == ("dflash2", 4, 256, 2)
    assert c["final_logit_softcapping"] == 30 and c["output_multiplier"] is None
    capsys.readouterr()
    assert main(["probe", str(tiny_qwen3), "--run-dir", str(tmp_path / "bad"), "--json", "drafter.type=dflash2",
                 "drafter.conv_group_size=7"]) == 2
    assert "conv_group_size 7 must divide hidden_size 64" in capsys.readouterr().err


def test_dflash2_kill_and_resume_equals_uninterrupted(tmp_path, tiny_qwen3, monkeypatch):
    from dflashkit.train import logging as tlog

    kw = dict(train__max_steps=5, train__save_every=2, train__eval_every=3)
    rc, full = _run(tmp_path, tiny_qwen3, "full", **kw)
    assert rc == 0
    real_log = tlog.MetricSink.log

    def dying_log(self, row):
        if row.get("step") == 4 and "split" not in row:
            raise KeyboardInterrupt  # killed before the step-4 checkpoint
        real_log(self, row)

    monkeypatch.setattr(tlog.MetricSink, "log", dying_log)
    rc, killed = _run(tmp_path, tiny_qwen3, "killed", **kw)
    assert rc == 130
    monkeypatch.setattr(tlog.MetricSink, "log", real_log)
    assert main(["train", "--json", *overrides(killed, tiny_qwen3, **kw), *FLAGS]) == 0
    for x, y in zip(_rows(full), _rows(killed)):
        assert abs(x["loss"] - y["loss"]) < 1e-6 and x["tau"] == y["tau"] and x.get("unary_tau") == y.get("unary_tau")
    for d in ("final", "best"):
        wa, wb = (load_file(r / "train" / d / "model.safetensors") for r in (full, killed))
        assert all(torch.equal(wa[k], wb[k]) for k in wa), d
