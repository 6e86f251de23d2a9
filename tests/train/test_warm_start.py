"""`drafter.init: <dir>`: a warm start begins where the source drafter ended, in either export format.

Oracle: the held-out loss a warm-started run logs at step 0 (before any update) equals the held-out
loss the source run recorded for the drafter it exported (`train/best/best.json`), on the same
held-out samples; with another block size it is still far below a cold start's at that block size.
"""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from dflashkit.cli import main
from tests.helpers import make_run, overrides

STEPS = dict(train__max_steps=40, train__lr=1e-2, train__eval_every=0, train__batch_size=4)


def _rows(rd):
    return [json.loads(x) for x in (rd / "train" / "metrics.jsonl").read_text().splitlines()]


def _heldout(rd):
    return [r for r in _rows(rd) if r.get("split") == "heldout"]


def _ok(argv, capsys):
    rc = main(argv)
    out = capsys.readouterr()
    assert rc == 0, f"{argv[0]} exited {rc}\n{out.err[-3000:]}"
    return json.loads(out.out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def source(tmp_path_factory, tiny_qwen3):
    """A trained run (reduced draft vocab) exported in both formats; the held-out loss of what it exported."""
    tmp = tmp_path_factory.mktemp("warm")
    rd = make_run(tmp / "src", tiny_qwen3)
    assert main(["train", "--json", *overrides(rd, tiny_qwen3, **STEPS), "drafter.draft_vocab_size=64"]) == 0
    best = json.loads((rd / "train" / "best" / "best.json").read_text())
    common = [f"run.run_dir={rd}", f"target.path={tiny_qwen3}", "export.dtype=float32"]
    assert main(["export", "--json", *common]) == 0
    assert main(["export", "--json", *common, "export.format=speculators", f"export.out_dir={rd / 'export-spec'}"]) == 0
    return {"zlab": rd / "export", "speculators": rd / "export-spec", "best": best, "tmp": tmp,
            "d2t": load_file(rd / "train" / "best" / "model.safetensors")["d2t"]}


def _warm(source, target, name, init, *extra, **contract):
    rd = make_run(source["tmp"] / name, target, **contract)
    argv = ["train", "--json", *overrides(rd, target, train__max_steps=1, train__lr=1e-12),
            *([f"drafter.init={init}"] if init else []), *extra]
    return main(argv), rd


@pytest.mark.parametrize("fmt", ["zlab", "speculators"])
def test_warm_start_begins_at_the_exports_heldout_loss(source, tiny_qwen3, fmt, capsys):
    rc, rd = _warm(source, tiny_qwen3, f"warm-{fmt}", source[fmt], "drafter.draft_vocab_size=64")
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0, out
    first = _heldout(rd)[0]
    assert first["step"] == 0, _heldout(rd)
    want = source["best"]["loss"]
    assert abs(first["loss"] - want) <= 1e-4 * max(1.0, abs(want)), (first["loss"], want)
    assert out["warm_start"]["format"] == fmt and out["warm_start"]["draft_vocab"] == "kept"
    # the same draft_vocab_size keeps the source's d2t (not re-chosen from today's data)
    assert (load_file(rd / "train" / "final" / "model.safetensors")["d2t"] == source["d2t"]).all()


def test_warm_start_with_another_block_size_beats_a_cold_start(source, tiny_qwen3, capsys):
    rc, warm = _warm(source, tiny_qwen3, "warm-b8", source["zlab"], "drafter.draft_vocab_size=64", block_size=8)
    assert rc == 0, capsys.readouterr().err[-3000:]
    rc, cold = _warm(source, tiny_qwen3, "cold-b8", None, "drafter.draft_vocab_size=64", block_size=8)
    assert rc == 0, capsys.readouterr().err[-3000:]
    w0 = _heldout(warm)[0]
    c1 = _heldout(cold)[-1]  # lr ~ 0: the cold drafter after one step is the random init
    gain = c1["loss"] - source["best"]["loss"]  # what the source run learned, in held-out loss
    assert gain > 0.1, (c1, source["best"])
    assert w0["step"] == 0 and w0["loss"] < c1["loss"] - 0.5 * gain, (w0, c1, source["best"])


def test_another_vocab_size_rebuilds_the_draft_vocab(source, tiny_qwen3, capsys):
    rc, rd = _warm(source, tiny_qwen3, "warm-full", source["zlab"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["warm_start"]["draft_vocab"] == "rebuilt", out
    assert "d2t" not in load_file(rd / "train" / "final" / "model.safetensors")  # null: the full vocab


def test_a_mismatched_contract_is_refused_by_name(source, tiny_qwen3, tmp_path, capsys):
    rc, _ = _warm(source, tiny_qwen3, "bad-ids", source["zlab"], n_feat=3, mask_token_id=301)
    err = capsys.readouterr().err
    assert rc == 2, err[-2000:]
    assert "target_layer_ids" in err and "mask_token_id" in err and str(source["zlab"]) in err, err[-2000:]
    assert "hidden_size" not in err  # only what differs is named

    from dflashkit.export.hf import save_drafter
    from dflashkit.model.drafter import DFlashDraftModel
    from tests.helpers import tiny_contract

    other = save_drafter(DFlashDraftModel(tiny_contract(hidden=32, vocab=320)), tmp_path / "other", dtype="float32")
    rc, rd = _warm(source, tiny_qwen3, "bad-hidden", other)
    err = capsys.readouterr().err
    assert rc == 2 and "hidden_size" in err, err[-2000:]
    assert not (rd / "train" / "final").exists()

    rc, _ = _warm(source, tiny_qwen3, "bad-dir", tmp_path / "nope")
    err = capsys.readouterr().err
    assert rc == 2 and "drafter.init" in err and "not a directory" in err, err[-2000:]
