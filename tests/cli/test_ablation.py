"""`dflashkit bench recipe`: variants trained on shared data, scored on the same held-out samples."""

from __future__ import annotations

import json

from dflashkit.cli import main
from dflashkit.rundir import RunDir
from dflashkit.bench.recipe import bigram_accuracy

from tests.helpers import make_run, overrides


def test_recipe_variants_share_the_data_and_differ_where_they_should(tmp_path, tiny_qwen3, capsys):
    rd = make_run(tmp_path / "r", tiny_qwen3)
    variants = '{base: [], no-features: [train.ablate_features=true], labels=data: [train.labels=data]}'
    rc = main(["bench", "recipe", "--json", *overrides(rd, tiny_qwen3), "train.labels=target",
               "bench.recipe_steps=2", f"bench.recipe_variants={variants}"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0, out
    rows = {r["variant"]: r for r in out["variants"]}
    assert set(rows) == {"base", "no-features", "labels=data"} and all(r["steps"] == 2 for r in rows.values())
    # the data is linked, not copied, and each variant trained in its own dir
    for name in rows:
        vdir = rd / "bench" / "recipe" / name
        assert (vdir / "tokenize").is_symlink() and (vdir / "train" / "final" / "config.json").is_file()
    # zeroed features and data labels change what the drafter sees, so the held-out loss moves
    assert abs(rows["base"]["heldout_loss"] - rows["no-features"]["heldout_loss"]) > 1e-4
    assert abs(rows["base"]["heldout_loss"] - rows["labels=data"]["heldout_loss"]) > 1e-4
    assert all(1.0 <= r["heldout_tau"] <= 4.0 for r in rows.values())
    assert 0.0 <= out["bigram_acc1"] <= 1.0


def test_bigram_baseline_is_perfect_on_a_text_it_has_seen(tmp_path, tiny_qwen3):
    # every answer character has one successor, so the bigram table predicts held-out copies exactly
    rd = make_run(tmp_path / "same", tiny_qwen3, texts=[("Say it.", "abcdefghijklmnop")] * 8)
    assert bigram_accuracy(RunDir(rd), 2, 0) == 1.0
    rd2 = make_run(tmp_path / "mixed", tiny_qwen3)
    assert bigram_accuracy(RunDir(rd2), 2, 0) < bigram_accuracy(RunDir(rd), 2, 0)


def test_recipe_dflash2_variant_trains_from_its_own_contract(tmp_path, tiny_qwen3, capsys):
    rd = make_run(tmp_path / "r", tiny_qwen3)  # a DFlash contract, with a reduced draft vocab in the run config
    variants = ('{base: [], dflash2: [drafter.type=dflash2, drafter.draft_vocab_size=null, drafter.selector_rank=8, '
                'drafter.selector_top_k=4]}')
    rc = main(["bench", "recipe", "--json", *overrides(rd, tiny_qwen3), "drafter.draft_vocab_size=40",
               "bench.recipe_steps=2", f"bench.recipe_variants={variants}"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0, out
    rows = {r["variant"]: r for r in out["variants"]}
    assert rows["base"]["drafter_type"] == "dflash" and rows["dflash2"]["drafter_type"] == "dflash2"
    assert rows["base"]["heldout_unary_tau"] == rows["base"]["heldout_tau"]
    assert 1.0 <= rows["dflash2"]["heldout_unary_tau"] <= 4.0 and 1.0 <= rows["dflash2"]["heldout_tau"] <= 4.0
    own = rd / "bench" / "recipe" / "dflash2" / "contract.json"
    assert not own.is_symlink() and json.loads(own.read_text())["selector_top_k"] == 4
    assert (rd / "bench" / "recipe" / "base" / "contract.json").is_symlink()
    assert json.loads((rd / "contract.json").read_text())["drafter_type"] == "dflash"  # the run's is untouched
    cfg = json.loads((rd / "bench" / "recipe" / "dflash2" / "train" / "final" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and "draft_vocab_size" not in cfg


def test_recipe_causal_variants_train_causal_drafters_from_their_own_contract(tmp_path, tiny_qwen3, capsys):
    """The JetSpec rows the lead runs: `causal` and `causal + forward KL (uniform weights)` (online features: the KL
    target is the target's logits)."""
    rd = make_run(tmp_path / "r", tiny_qwen3)
    variants = ('{base: [], causal: [drafter.causal=true], causal-kl-uniform: [drafter.causal=true, train.loss=kl, '
                'train.position_weighting=uniform]}')
    rc = main(["bench", "recipe", "--json", *overrides(rd, tiny_qwen3), "bench.recipe_steps=2",
               f"bench.recipe_variants={variants}"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0, out
    rows = {r["variant"]: r for r in out["variants"]}
    assert set(rows) == {"base", "causal", "causal-kl-uniform"} and all(r["steps"] == 2 for r in rows.values())
    for name, causal in (("base", False), ("causal", True), ("causal-kl-uniform", True)):
        vdir = rd / "bench" / "recipe" / name
        cfg = json.loads((vdir / "train" / "final" / "config.json").read_text())
        assert cfg.get("is_causal", False) is causal and cfg["dflash_config"].get("causal", False) is causal, name
        assert json.loads((vdir / "contract.json").read_text())["causal"] is causal, name
        assert (vdir / "contract.json").is_symlink() is (not causal), name   # its own contract when causal
    assert json.loads((rd / "contract.json").read_text()).get("causal", False) is False  # the run's is untouched
    assert len({round(r["heldout_loss"], 6) for r in rows.values()}) == 3  # three different objectives / masks


def test_equal_cpu_minutes_stop_each_variant_on_its_budget_and_a_grid_varies_one_key(tmp_path, tiny_qwen3, capsys,
                                                                                    monkeypatch):
    import itertools
    import time
    from types import SimpleNamespace

    from dflashkit.train import loop

    # the loop reads the process's CPU time before and after each optimizer step: here every step costs 0.5 s,
    # so the budget, not this machine's speed, decides where a variant stops (a fast machine's real steps could
    # reach the 1000-step cap before 3 CPU-s, a loaded one's spend them in a few steps)
    ticks = itertools.count()
    monkeypatch.setattr(loop, "time", SimpleNamespace(perf_counter=time.perf_counter,
                                                      process_time=lambda: 0.5 * next(ticks)))
    rd = make_run(tmp_path / "r", tiny_qwen3)
    budget = 0.05  # CPU-minutes: 3 s of optimizer steps per variant, 6 steps of 0.5 s, not the 1000-step cap
    rc = main(["bench", "recipe", "--json", *overrides(rd, tiny_qwen3), "bench.recipe_steps=1000",
               f"bench.cpu_minutes={budget}", "bench.recipe_grid={drafter.num_draft_layers: [1, 2]}",
               "drafter.num_target_features=2"])  # the contract's 2 features whatever the layer count
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0, out
    rows = out["variants"]
    assert [r["variant"] for r in rows] == ["drafter.num_draft_layers=1", "drafter.num_draft_layers=2"]
    for r in rows:
        # stopped by the budget: the step that spent it is the last one, long before the cap
        assert r["cpu_minutes"] == budget and r["steps"] == 6, r
        assert r["supervised_tokens"] > 0 and len(r["heldout_acc"]) >= 1 and r["load_before"] is not None
    cfgs = [json.loads((rd / "bench" / "recipe" / r["variant"] / "train" / "final" / "config.json").read_text())
            for r in rows]
    # a variant that changes the drafter's shape trains under its own contract (the run's is not touched)
    assert [c["num_hidden_layers"] for c in cfgs] == [1, 2]
    assert json.loads((rd / "contract.json").read_text())["num_draft_layers"] == 1
    assert (rd / "bench" / "recipe" / rows[0]["variant"] / "contract.json").is_symlink()
    assert not (rd / "bench" / "recipe" / rows[1]["variant"] / "contract.json").is_symlink()


def test_bad_variants_fail_before_any_training_and_dry_run_trains_nothing(tmp_path, tiny_qwen3, capsys):
    rd = make_run(tmp_path / "r", tiny_qwen3)
    rc = main(["bench", "recipe", "--json", *overrides(rd, tiny_qwen3),
               "bench.recipe_variants={ok: [], bad: [train.lr=-1]}"])
    assert rc == 2 and not (rd / "bench" / "recipe" / "ok").exists()
    capsys.readouterr()
    # a name YAML reads as a boolean (off) is refused naming it, before anything trains
    rc = main(["bench", "recipe", "--json", *overrides(rd, tiny_qwen3),
               "bench.recipe_variants={ok: [], off: [train.on_path=off]}"])
    err = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["error"]
    assert rc == 2 and "bench.recipe_variants.False" in err and "quote it" in err, err
    assert not (rd / "bench" / "recipe").exists()
    rc = main(["bench", "recipe", "--json", "--dry-run", *overrides(rd, tiny_qwen3),
               "bench.recipe_grid={drafter.block_size: [2, 8], train.lr: [1e-3]}"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["dry_run"] and not (rd / "bench" / "recipe").exists()
    v = out["variants"]
    assert list(v) == ["drafter.block_size=2", "drafter.block_size=8", "train.lr=1e-3"]
    assert [x["own_contract"] for x in v.values()] == [True, True, False]


def test_each_recipe_row_carries_its_learning_curve(tmp_path, tiny_qwen3, capsys):
    """bench.recipe_eval_every: one held-out point every N steps and one at the end, in the row; the end point is
    the row's held-out τ, and supervised tokens and optimizer seconds only grow along it."""
    rd = make_run(tmp_path / "r", tiny_qwen3)
    rc = main(["bench", "recipe", "--json", *overrides(rd, tiny_qwen3), "bench.recipe_steps=5",
               "bench.recipe_eval_every=2", "bench.recipe_variants={base: []}"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0, out
    (row,) = out["variants"]
    curve = row["curve"]
    assert [p[0] for p in curve] == [2, 4, 5] and curve[-1][3] == row["heldout_tau"]
    assert all(a[1] < b[1] and a[2] < b[2] for a, b in zip(curve, curve[1:]))
    assert all(1.0 <= p[3] <= 4.0 and 0.0 <= p[4] <= 1.0 for p in curve)


def test_recipe_sliding_window_variant_trains_from_its_own_contract(tmp_path, tiny_qwen3, capsys):
    """The sliding-window recipe row: a variant with drafter.sliding_window gets a contract of its own (train
    refuses a window the linked contract lacks) and its drafter exports the window."""
    rd = make_run(tmp_path / "r", tiny_qwen3)
    rc = main(["bench", "recipe", "--json", *overrides(rd, tiny_qwen3), "bench.recipe_steps=2",
               "bench.recipe_variants={full: [], sliding-4: [drafter.sliding_window=4]}"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0, out
    rows = {r["variant"]: r for r in out["variants"]}
    assert set(rows) == {"full", "sliding-4"} and all(r["steps"] == 2 for r in rows.values())
    own = rd / "bench" / "recipe" / "sliding-4" / "contract.json"
    assert not own.is_symlink() and json.loads(own.read_text())["sliding_window"] == 4
    assert json.loads((rd / "bench" / "recipe" / "sliding-4" / "train" / "final" / "config.json").read_text()
                      )["sliding_window"] == 4
    assert (rd / "bench" / "recipe" / "full" / "contract.json").is_symlink()
