"""`dflashkit train` with the recipe levers and the forecast, end to end on the tiny target."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from dflashkit.cli import main
from tests.helpers import make_run, overrides


def _train(rd, target, *extra, **kw):
    if not (rd / "contract.json").exists():
        make_run(rd, target)
    return main(["train", "--json", *overrides(rd, target, **kw), *extra])


def _losses(rd):
    rows = [json.loads(x) for x in (rd / "train" / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "split" not in r]


def test_feature_scale_changes_training_and_the_saved_drafter_is_plain_and_equivalent(tmp_path, tiny_qwen3, capsys):
    from dflashkit.model.drafter import DFlashDraftModel
    from dflashkit.family.contract import DrafterContract
    from dflashkit.train.checkpoint import latest_checkpoint

    a, b = tmp_path / "a", tmp_path / "b"
    assert _train(a, tiny_qwen3, train__max_steps=3, train__log_every=1, train__save_every=3) == 0
    assert _train(b, tiny_qwen3, "drafter.feature_scale=rms", train__max_steps=3, train__log_every=1,
                  train__save_every=3) == 0
    la, lb = _losses(a), _losses(b)
    assert la[0] != lb[0], (la, lb)                       # the scale reaches the first forward already
    final = load_file(b / "train" / "final" / "model.safetensors")
    assert "feature_scale" not in final                   # folded into fc.weight: a plain z-lab drafter
    raw = load_file(latest_checkpoint(b / "train" / "checkpoints") / "model.safetensors")
    assert "feature_scale" in raw                         # the resumable checkpoint keeps it
    contract = DrafterContract.load(b / "contract.json")
    scaled = DFlashDraftModel(contract, feature_scale=raw["feature_scale"])
    scaled.load_state_dict(raw)
    plain = DFlashDraftModel(contract)
    plain.load_state_dict(final)
    x = torch.randn(1, 5, scaled.fc.in_features) * 30
    torch.testing.assert_close(plain.fuse(x), scaled.fuse(x), rtol=1e-4, atol=1e-4)


def test_muon_changes_the_updates(tmp_path, tiny_qwen3):
    # resume equivalence under Muon: tests/cli/test_train_loop.py::test_kill_and_resume_equals_uninterrupted[muon]
    muon, adam = tmp_path / "muon", tmp_path / "adam"
    assert _train(muon, tiny_qwen3, "train.optimizer=muon", train__max_steps=3, train__log_every=1) == 0
    assert _train(adam, tiny_qwen3, train__max_steps=3, train__log_every=1) == 0
    lm, la = _losses(muon), _losses(adam)
    assert lm[0] == la[0] and lm[1:] != la[1:], (lm, la)    # the same start; the first update differs


def test_train_says_what_the_curve_forecasts(tmp_path, tiny_qwen3, capsys):
    rd = tmp_path / "r"
    assert _train(rd, tiny_qwen3, train__max_steps=10, train__eval_every=2) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    curve = json.loads((rd / "train" / "curve.json").read_text())
    assert len(curve["points"]) == 5 and curve["supervised_per_sample"] > 0
    assert all(p["train_s"] > 0 for p in curve["points"])
    fc = out["forecast"]
    assert fc["target_tau"] == 2.0 and "τ 2" in fc["text"]
    # a number comes with its rates, or no number comes with the reason
    assert (fc["tokens"] is not None and fc["hours"] is not None) or fc["warning"]
    # plan with the curve: the same forecast, hours at the plan's estimate
    capsys.readouterr()
    assert main(["plan", "--json", *overrides(rd, tiny_qwen3), "1x80", str(rd / "train" / "curve.json")]) == 0
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plan["forecast"]["tokens"] == fc["tokens"] and plan["forecast"]["curve"].endswith("curve.json")
    assert main(["plan", "--json", *overrides(rd, tiny_qwen3), str(tmp_path / "missing.json")]) == 3


def test_train_samples_trains_on_a_nested_subset_and_keeps_the_held_out_set(tmp_path, tiny_qwen3, capsys, monkeypatch):
    """train.train_samples: data-vs-epochs on one run dir. The held-out samples stay the same, a smaller set is
    a subset of a larger one, and the steps only ever read the chosen samples."""
    import dflashkit.train.loop as loop
    from dflashkit.train.data import first_of

    idx = list(range(3, 40, 2))
    for n in range(1, len(idx)):
        small, large = first_of(idx, n, seed=0), first_of(idx, n + 1, seed=0)
        assert len(small) == n and small == sorted(small) and set(small) < set(large) <= set(idx)
    assert first_of(idx, None, seed=0) == idx == first_of(idx, 99, seed=0)
    assert first_of(idx, 5, seed=0) != first_of(idx, 5, seed=1)

    from dflashkit.train.data import BatchPlan

    seen: dict[str, tuple[list[int], set[int]]] = {}
    real_setup, real_micro = loop._setup, BatchPlan.micro_batches
    read: set[int] = set()

    def setup(cfg, rd, *a, **k):
        tr = real_setup(cfg, rd, *a, **k)
        read.clear()
        seen[rd.root.name] = (list(tr.heldout), read)
        return tr

    def micro_batches(self, step, rank):
        out = real_micro(self, step, rank)
        read.update(i for mb in out for i, _ in mb)
        return out

    monkeypatch.setattr(BatchPlan, "micro_batches", micro_batches)
    monkeypatch.setattr(loop, "_setup", setup)
    results = {}
    for name, n in (("all", None), ("two", 2)):
        extra = [] if n is None else [f"train.train_samples={n}"]
        assert _train(tmp_path / name, tiny_qwen3, *extra, train__max_steps=3, train__batch_size=1) == 0
        results[name] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    held_all, held_two = seen["all"][0], seen["two"][0]
    read_two = set(seen["two"][1])
    assert held_all == held_two and len(read_two) == 2 and not set(held_two) & read_two
    assert results["two"]["samples"] == 2 and results["all"]["samples"] > 2
