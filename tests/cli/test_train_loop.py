"""`dflashkit train` end to end on tiny real targets: artifacts, equivalences, resume, bad input."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dflashkit.cli import main
from tests.helpers import assert_same_weights, make_run, overrides


def _train(tmp_path, target, name="run", extra=(), **kw):
    rd = tmp_path / name
    if not (rd / "contract.json").exists():
        make_run(rd, target)
    rc = main(["train", "--json", *overrides(rd, target, **kw), *extra])
    return rc, rd


def _metrics(rd):
    return [json.loads(x) for x in (rd / "train" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("arch", ["qwen3", "llama", "deepseek_v3"])
def test_train_writes_final_zlab_dir(tmp_path, tiny_targets, arch, capsys):
    rc, rd = _train(tmp_path, tiny_targets[arch], train__max_steps=2)
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0, out
    cfg = json.loads((rd / "train" / "final" / "config.json").read_text())
    assert cfg["dflash_config"]["target_layer_ids"] == json.loads((rd / "contract.json").read_text())["target_layer_ids"]
    sd = load_file(rd / "train" / "final" / "model.safetensors")
    assert "fc.weight" in sd and "layers.0.self_attn.q_norm.weight" in sd and not any("embed" in k for k in sd)
    rows = [r for r in _metrics(rd) if "split" not in r]
    assert [r["step"] for r in rows] == [1, 2] and all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert (rd / "train" / "manifest.json").is_file()
    assert out["steps"] == 2 and out["heldout"]["tau"] >= 1.0


VOCAB_CASES = pytest.mark.parametrize("extra", [(), ("drafter.draft_vocab_size=24",)], ids=["full-vocab", "draft-vocab"])
RECIPE = ("train.position_weighting=dpace", "train.feature_noise=0.05")


@pytest.mark.parametrize("extra", [(), ("drafter.draft_vocab_size=24",), RECIPE + ("drafter.draft_vocab_size=24",)],
                         ids=["full-vocab", "draft-vocab", "dpace-noise"])
def test_micro_batch_times_grad_accum_equivalence(tmp_path, tiny_qwen3, extra):
    rc1, a = _train(tmp_path, tiny_qwen3, "a", extra, train__batch_size=4, train__grad_accum=1, train__max_steps=3)
    rc2, b = _train(tmp_path, tiny_qwen3, "b", extra, train__batch_size=2, train__grad_accum=2, train__max_steps=3)
    assert rc1 == rc2 == 0
    la = [r["loss"] for r in _metrics(a) if "split" not in r]
    lb = [r["loss"] for r in _metrics(b) if "split" not in r]
    assert torch.allclose(torch.tensor(la), torch.tensor(lb), atol=1e-5), (la, lb)
    wa = load_file(a / "train" / "final" / "model.safetensors")
    wb = load_file(b / "train" / "final" / "model.safetensors")
    assert_same_weights(wa, wb)


@pytest.mark.parametrize("extra", [(), ("drafter.draft_vocab_size=24",), ("train.optimizer=muon",)],
                         ids=["full-vocab", "draft-vocab", "muon"])
def test_kill_and_resume_equals_uninterrupted(tmp_path, tiny_qwen3, monkeypatch, extra):
    kw = dict(train__max_steps=5, train__save_every=2, train__eval_every=3, extra=extra)
    rc, full = _train(tmp_path, tiny_qwen3, "full", **kw)
    assert rc == 0
    from dflashkit.train import logging as tlog

    real_log = tlog.MetricSink.log

    def dying_log(self, row):
        if row.get("step") == 4 and "split" not in row:
            raise KeyboardInterrupt  # killed mid-run, before the step-4 checkpoint
        real_log(self, row)

    monkeypatch.setattr(tlog.MetricSink, "log", dying_log)
    rc, killed = _train(tmp_path, tiny_qwen3, "killed", **kw)
    ck = killed / "train" / "checkpoints"
    assert rc == 130 and (ck / "step-0000002").is_dir() and not (ck / "step-0000004").exists()
    assert not (killed / "train" / "final").exists()
    monkeypatch.setattr(tlog.MetricSink, "log", real_log)
    rc, killed = _train(tmp_path, tiny_qwen3, "killed", **kw)
    assert rc == 0
    assert _metrics(killed) and [r["step"] for r in _metrics(killed)] == [r["step"] for r in _metrics(full)]
    for x, y in zip(_metrics(full), _metrics(killed)):
        assert abs(x["loss"] - y["loss"]) < 1e-6 and x["tau"] == y["tau"], (x, y)
    for d in ("final", "best"):
        wa = load_file(full / "train" / d / "model.safetensors")
        wb = load_file(killed / "train" / d / "model.safetensors")
        assert all(torch.equal(wa[k], wb[k]) for k in wa), d
    assert _json(full, "best/best.json") == _json(killed, "best/best.json")
    assert _untimed(_json(full, "curve.json")) == _untimed(_json(killed, "curve.json"))
    assert [p["step"] for p in _json(full, "curve.json")["points"]] == [3, 5]


def _json(rd, rel):
    return json.loads((rd / "train" / rel).read_text())


def _untimed(curve):
    """curve.json without its wall-clock field (`train_s`: seconds, which no two runs share)."""
    for p in curve["points"]:
        assert p.pop("train_s") >= 0
    return curve


def test_best_keeps_the_early_peak_and_survives_resume(tmp_path, tiny_qwen3, monkeypatch, capsys):
    """Held-out τ forced to peak at step 2 (of evaluations at 2, 4, 6): train/best holds step 2's
    weights, eval/export would pick it, and a run killed after step 4 resumes to the same best/."""
    from dflashkit.train import logging as tlog
    from dflashkit.train import loop

    real_eval = loop.evaluate_heldout
    forced = {2: 1.9, 4: 1.5, 6: 1.9}  # step 6 ties the peak: the earliest one stays

    def fake_eval(tr, step):
        ev = real_eval(tr, step)
        return {**ev, "tau": forced.get(step, 1.0)}

    monkeypatch.setattr(loop, "evaluate_heldout", fake_eval)
    kw = dict(train__max_steps=6, train__eval_every=2, train__save_every=1, train__keep_checkpoints=0)
    rc, full = _train(tmp_path, tiny_qwen3, "full", **kw)
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["best"]["step"] == 2 and out["best"]["tau"] == 1.9
    best = load_file(full / "train" / "best" / "model.safetensors")
    at2 = load_file(full / "train" / "checkpoints" / "step-0000002" / "model.safetensors")
    final = load_file(full / "train" / "final" / "model.safetensors")
    assert all(torch.equal(best[k], at2[k]) for k in best)
    assert not all(torch.equal(best[k], final[k]) for k in best)
    assert _json(full, "best/best.json")["step"] == 2
    from dflashkit.rundir import RunDir
    from dflashkit.train.checkpoint import trained_drafter_dir
    assert trained_drafter_dir(RunDir(full)) == (full / "train" / "best", "best")
    # killed after the step-5 checkpoint (best.json at step 2 ≤ the checkpoint): resume keeps it
    real_log = tlog.MetricSink.log

    def dying_log(self, row):
        if row.get("step") == 6 and "split" not in row:
            raise KeyboardInterrupt
        real_log(self, row)

    monkeypatch.setattr(tlog.MetricSink, "log", dying_log)
    rc, killed = _train(tmp_path, tiny_qwen3, "killed", **kw)
    assert rc == 130
    monkeypatch.setattr(tlog.MetricSink, "log", real_log)
    rc, killed = _train(tmp_path, tiny_qwen3, "killed", **kw)
    assert rc == 0
    assert _json(killed, "best/best.json") == _json(full, "best/best.json")
    kb = load_file(killed / "train" / "best" / "model.safetensors")
    assert all(torch.equal(best[k], kb[k]) for k in best)
    assert _untimed(_json(killed, "curve.json")) == _untimed(_json(full, "curve.json"))
    # keep_best off: no best/ (a stale one from the earlier run is removed), eval falls back to final
    rc, _ = _train(tmp_path, tiny_qwen3, "full", extra=("train.keep_best=false", "train.max_steps=7"),
                   train__eval_every=2, train__save_every=1, train__keep_checkpoints=0)
    assert rc == 0 and not (full / "train" / "best").exists()


def test_learning_curve_counts_supervised_tokens_and_tracks_heldout(tmp_path, tiny_qwen3):
    rc, rd = _train(tmp_path, tiny_qwen3, train__max_steps=4, train__eval_every=2, train__batch_size=2)
    assert rc == 0
    curve = _json(rd, "curve.json")
    held = [r for r in _metrics(rd) if r.get("split") == "heldout"]
    assert [p["step"] for p in curve["points"]] == [r["step"] for r in held] == [2, 4]
    # oracle: Σ loss_mask of every sample of the global batches of steps 0..s-1
    from dflashkit.train.data import BatchPlan, load_tokenized, split_heldout
    from dflashkit.rundir import RunDir

    data = load_tokenized(RunDir(rd))
    train_idx, _ = split_heldout(len(data), 2, seed=0)  # overrides(): heldout_samples 2, run.seed 0
    plan = BatchPlan(train_idx, 2, 1, 1, 0)
    seen = 0
    want = {}
    for step in range(4):
        seen += sum(int(data.loss_mask[i].sum()) for i, _ in plan.global_indices(step))
        want[step + 1] = seen
    for p, h in zip(curve["points"], held):
        assert p["tokens"] == want[p["step"]] and p["by_source"]["all"]["tokens"] == p["tokens"]
        assert p["heldout"]["tau"] == h["tau"] and p["heldout"]["acc1"] == h["acc"][0]
        assert p["train"]["tau"] is not None and p["train"]["tau"] >= 1.0


def test_corrupt_checkpoint_is_a_clear_error(tmp_path, tiny_qwen3, capsys):
    rc, rd = _train(tmp_path, tiny_qwen3, train__max_steps=2, train__save_every=1)
    assert rc == 0
    st = rd / "train" / "checkpoints" / "step-0000002" / "model.safetensors"
    st.write_bytes(st.read_bytes()[:100])
    capsys.readouterr()
    rc, _ = _train(tmp_path, tiny_qwen3, train__max_steps=3)
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 2 and "model.safetensors" in out["error"] and "step-0000002" in out["hint"]


def _bad_contract(tmp_path, target, capsys, **change):
    rd = make_run(tmp_path / "bad", target)
    c = json.loads((rd / "contract.json").read_text())
    c.update(change)
    (rd / "contract.json").write_text(json.dumps(c))
    capsys.readouterr()
    rc = main(["train", "--json", *overrides(rd, target)])
    return rc, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_hidden_size_mismatch(tmp_path, tiny_qwen3, capsys):
    rc, out = _bad_contract(tmp_path, tiny_qwen3, capsys, hidden_size=96)
    assert rc == 2 and "hidden_size 96" in out["error"] and "contract.json" in out["error"]


def test_mask_id_outside_vocab(tmp_path, tiny_qwen3, capsys):
    rc, out = _bad_contract(tmp_path, tiny_qwen3, capsys, mask_token_id=320)
    assert rc == 2 and "mask_token_id 320" in out["error"]


def test_missing_upstream_artifacts(tmp_path, tiny_qwen3, capsys):
    rd = tmp_path / "empty"
    assert main(["train", "--json", *overrides(rd, tiny_qwen3)]) == 3
    assert "probe" in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["hint"]
    make_run(rd, tiny_qwen3)
    for p in (rd / "tokenize").glob("*.parquet"):
        p.unlink()
    assert main(["train", "--json", *overrides(rd, tiny_qwen3)]) == 3
    assert "dflashkit tokenize" in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["hint"]


def test_tied_target_head_is_the_embedding(tiny_targets):
    from dflashkit.config import load_config
    from dflashkit.target.load import load_target

    t = load_target(load_config(None, [f"target.path={tiny_targets['llama']}"]).target)
    assert t.lm_head.weight.data_ptr() == t.model.get_input_embeddings().weight.data_ptr()


def test_kl_loss_and_target_init_run_through_the_cli(tmp_path, tiny_qwen3):
    rc, rd = _train(tmp_path, tiny_qwen3, train__max_steps=2, train__loss="ce+kl", train__kl_weight=0.5,
                    extra=["drafter.init=target"])
    assert rc == 0
    rows = [r for r in _metrics(rd) if "split" not in r]
    assert len(rows) == 2 and all(r["loss"] > 0 for r in rows)


def test_reduced_draft_vocab_trains_saves_and_resumes_with_its_vocab(tmp_path, tiny_qwen3, capsys):
    """The vocab: top label tokens of the *training* samples (+ eos 258), in train/final as d2t offsets."""
    from dflashkit.model.draft_vocab import choose_draft_vocab, from_offsets
    from dflashkit.rundir import RunDir
    from dflashkit.train.data import load_tokenized, split_heldout

    rc, rd = _train(tmp_path, tiny_qwen3, train__max_steps=2, train__save_every=1,
                    extra=["drafter.draft_vocab_size=24"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0, out
    assert out["draft_vocab_size"] == 24 and out["heldout"]["tau"] >= 1.0
    cfg = json.loads((rd / "train" / "final" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == cfg["dflash_config"]["draft_vocab_size"] == 24 and cfg["dtype"] == "float32"
    sd = load_file(rd / "train" / "final" / "model.safetensors")
    data = load_tokenized(RunDir(rd))
    train_idx, held = split_heldout(len(data), 2, seed=0)
    want = choose_draft_vocab([data.input_ids[i] for i in train_idx], [data.loss_mask[i] for i in train_idx], 24,
                              320, always=[258])
    assert from_offsets(sd["d2t"]).tolist() == want.tolist() and 258 in want.tolist()
    # the held-out samples are not counted: a vocab over all samples differs on this data
    assert held and not torch.equal(choose_draft_vocab(data.input_ids, data.loss_mask, 24, 320, always=[258]), want)
    ck = rd / "train" / "checkpoints" / "step-0000002" / "model.safetensors"
    assert torch.equal(load_file(ck)["d2t"], sd["d2t"])
    rows = [r for r in _metrics(rd) if "split" not in r]
    assert all(0 <= r["acc_mean"] <= 1 and r["tau"] >= 1 for r in rows)
    # a resumed run keeps the checkpoint's vocab even when today's data would choose another one
    from safetensors.torch import save_file

    other = torch.tensor(sorted(set(range(24)) - {0} | {258}))
    state = load_file(ck)
    state["d2t"] = other - torch.arange(24)
    save_file(state, str(ck))
    rc, _ = _train(tmp_path, tiny_qwen3, train__max_steps=3, extra=["drafter.draft_vocab_size=24"])
    assert rc == 0
    capsys.readouterr()
    assert from_offsets(load_file(rd / "train" / "final" / "model.safetensors")["d2t"]).tolist() == other.tolist()
    # resuming with another vocab size (or none) is a clear error naming the key
    for other in ("drafter.draft_vocab_size=30", "drafter.draft_vocab_size=null"):
        rc, _ = _train(tmp_path, tiny_qwen3, train__max_steps=3, extra=[other])
        err = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert rc == 2 and "drafter.draft_vocab_size" in err["error"] and "checkpoints/step-" in err["error"], err


def test_bad_draft_vocab_size_is_a_usage_error(tmp_path, tiny_qwen3, capsys):
    for value, msg in (("-3", "drafter.draft_vocab_size: must be >= 0 (null or 0 = the full target vocab), got -3"),
                       ("321", "drafter.draft_vocab_size 321 exceeds the target vocab of 320")):
        rc, _ = _train(tmp_path, tiny_qwen3, extra=[f"drafter.draft_vocab_size={value}"])
        err = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert rc == 2 and msg in err["error"], err
    # the whole vocab (or 0) is the full-vocab drafter
    rc, rd = _train(tmp_path, tiny_qwen3, "whole", train__max_steps=1, extra=["drafter.draft_vocab_size=320"])
    assert rc == 0 and "d2t" not in load_file(rd / "train" / "final" / "model.safetensors")


def test_feature_noise_is_relative_per_sample_and_training_only(tmp_path, tiny_qwen3):
    from types import SimpleNamespace

    from dflashkit.train.trainer import feature_noise

    feats = torch.randn(2, 6, 2 * 8) * torch.tensor([1.0, 100.0]).repeat_interleave(8)  # two layers, 100× apart
    b = SimpleNamespace(seq_lens=torch.tensor([6, 4]), seeds=[11, 12])  # what feature_noise reads of a Batch
    out = feature_noise(feats, b, scale=0.1, n_feat=2)
    d = (out - feats).view(2, 6, 2, 8)
    rms = feats.view(2, 6, 2, 8).pow(2).mean(-1, keepdim=True).sqrt()
    assert (d.abs() <= 0.1 * rms + 1e-5).all() and d[0].abs().max() > 0
    assert d[1, 4:].eq(0).all()  # padding gets none
    one = feature_noise(feats[1:], SimpleNamespace(seq_lens=torch.tensor([4]), seeds=[12]), scale=0.1, n_feat=2)
    assert torch.equal(one[0], out[1])  # the same sample draws the same noise in any batch
    # training only: at lr 1e-30 the weights never move, so held-out τ/loss ignore even huge noise
    kw = dict(train__max_steps=2, train__lr=1e-30, train__eval_every=1)
    _, quiet = _train(tmp_path, tiny_qwen3, "quiet", **kw)
    _, noisy = _train(tmp_path, tiny_qwen3, "noisy", extra=("train.feature_noise=50",), **kw)
    hq = [r for r in _metrics(quiet) if r.get("split") == "heldout"]
    hn = [r for r in _metrics(noisy) if r.get("split") == "heldout"]
    assert hq and [(r["loss"], r["tau"]) for r in hq] == [(r["loss"], r["tau"]) for r in hn]
    tq = [r["loss"] for r in _metrics(quiet) if "split" not in r]
    tn = [r["loss"] for r in _metrics(noisy) if "split" not in r]
    assert tq != tn  # ... while the training loss sees it


def test_learning_curve_per_source(tmp_path, tiny_qwen3, monkeypatch):
    """With TokenData.source set (two sources), the curve splits tokens and held-out τ by source and
    the pooled numbers stay the overall ones."""
    from dflashkit.train import loop

    real_load = loop.load_tokenized

    def load_with_sources(rd):
        data = real_load(rd)
        data.source = ["even" if i % 2 == 0 else "odd" for i in range(len(data))]
        return data

    monkeypatch.setattr(loop, "load_tokenized", load_with_sources)
    rc, rd = _train(tmp_path, tiny_qwen3, train__max_steps=3, train__eval_every=0, train__heldout_samples=4)
    assert rc == 0
    (point,) = _json(rd, "curve.json")["points"]
    assert set(point["by_source"]) == {"even", "odd"}
    assert sum(v["tokens"] for v in point["by_source"].values()) == point["tokens"] > 0
    (held,) = [r for r in _metrics(rd) if r.get("split") == "heldout"]
    per = held["by_source"]  # metrics.jsonl carries the per-source numbers when there are several
    assert set(per) == {"even", "odd"}
    assert all(point["by_source"][k]["tau"] == per[k]["tau"] for k in per)
    # the overall τ pools the blocks of both sources: it lies between them
    lo, hi = min(v["tau"] for v in per.values()), max(v["tau"] for v in per.values())
    assert lo - 1e-9 <= point["heldout"]["tau"] <= hi + 1e-9
