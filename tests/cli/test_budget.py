"""`dflashkit run` under a compute budget (`run.budget_minutes` / `--budget`): calibrate, plan, re-plan, record plan
vs actual in pipeline.json, skip everything on a re-run, and `plan` from the saved calibration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dflashkit.cli import main
from dflashkit.sizing import calibration as calib

RATES = {"capture_tok_s": 4000.0, "train_step_s": 0.05, "decode_s": {"1": 0.004, "4": 0.005}, "load_s": 0.2,
         "calibrate_s": 1.0}


def last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private dflashkit cache (calibrations are saved there too)."""
    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def fake_calibrate(monkeypatch):
    """`calibrate` → fixed rates (saved as the real one saves them); the list of configs it was called for."""
    calls: list = []

    def fake(cfg, rd, *, save=True):
        calls.append(cfg)
        m = calib.machine(cfg.target.device)
        cal = {"version": calib.VERSION, "machine": m, "machine_key": calib.machine_key(m),
               "shape": calib.shape_key(cfg), "device": "cpu", "capture_dtype": "float32", "verify_dtype": "float32",
               "sample_tokens": 64, **RATES}
        if save:
            calib.save_calibration(cal, rd)
        return cal

    monkeypatch.setattr(calib, "calibrate", fake)
    return calls


def write_config(tmp_path: Path, target: Path, **run) -> Path:
    rows = [{"messages": [{"role": "user", "content": f"Question {i}: count to {i % 7 + 2}."},
                          {"role": "assistant", "content": " ".join(str(k) for k in range(1, i % 7 + 3)) + "."}]}
            for i in range(28)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {"run": {"run_dir": str(tmp_path / "run"), "seed": 0, **run},
           "target": {"path": str(target), "dtype": "float32"},
           "drafter": {"block_size": 4, "num_draft_layers": 1},
           "data": {"sources": [{"path": str(tmp_path / "chat.jsonl"), "name": "chat", "answers": "original"}],
                    "heldout": 3},
           "tokenize": {"max_length": 256, "agreement_samples": 0, "workers": 1},
           "train": {"features": "cached", "labels": "target", "batch_size": 4, "num_anchors": 8,
                     "heldout_samples": 2, "log_every": 5},
           "eval": {"max_new_tokens": 12, "block_sizes": [4], "warmup": 0, "diagnostics": False,
                    "adaptive_length": False, "prompt_lookup": False, "hybrid": False},
           "export": {"dtype": "float32"}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def test_a_budgeted_run_plans_records_and_then_skips(tmp_path, capsys, tiny_qwen3, cache, fake_calibrate):
    path = write_config(tmp_path, tiny_qwen3, budget_minutes=3)
    run = tmp_path / "run"
    code = main(["run", "-c", str(path), "--json"])
    stdout, err = capsys.readouterr()
    assert code == 0, err
    out = json.loads(stdout.strip().splitlines()[-1])
    assert len(fake_calibrate) == 1
    assert all(s["action"] == "run" for s in out["stages"])
    assert (run / "export" / "manifest.json").is_file()

    state = json.loads((run / "pipeline.json").read_text())
    rec = state["budget"]
    plan, sizes = rec["plan"], rec["sizes"]
    assert plan["planned_s"] <= 3 * 60 * plan["safety"] and plan["budget_minutes"] == 3
    assert plan["fixed"] == ["eval.max_new_tokens"] and sizes["eval.max_new_tokens"] == 12  # the YAML's value wins
    assert set(rec["replanned"]) == {"train", "eval"}
    ran = [s["stage"] for s in out["stages"]]
    assert set(rec["actual"]["stages"]) == {"calibrate", *ran}
    assert rec["actual"]["samples"] > 0 and rec["actual"]["tokens"] > 0
    # the run used the (re-planned) sizes: the resolved config, the train manifest, eval's results
    resolved = yaml.safe_load((run / "config.resolved.yaml").read_text())
    for key, value in sizes.items():
        section, name = key.split(".")
        assert resolved[section][name] == value, key
    assert rec["actual"]["sizes"] == sizes
    train_samples = rec["replanned"]["train"]["train_samples"]
    assert sizes["train.max_steps"] * 4 <= 10 * train_samples + 4  # ≤ 10 epochs of the real samples
    results = json.loads((run / "eval" / "results.json").read_text())
    assert results["prompts"] == sizes["eval.num_prompts"] <= 3
    # the saved calibration: in the run dir and in the cache
    cal = json.loads((run / "calibration.json").read_text())
    assert cal["capture_tok_s"] == RATES["capture_tok_s"] and list((cache / "calibration").glob("*.json"))
    # the summary shows plan vs actual; the report page too
    assert out["summary"]["budget"]["key"] == rec["key"]
    assert "budget, planned vs actual" in err and "fixed by you (kept): eval.max_new_tokens" in err
    assert "Budget: plan vs actual" in (run / "report" / "index.html").read_text()

    # the same command again: the saved plan, nothing measured, every stage up to date (report always runs)
    assert main(["run", "-c", str(path), "--json"]) == 0
    out = last_json(capsys)
    assert len(fake_calibrate) == 1
    assert {s["stage"] for s in out["stages"] if s["action"] == "run"} == {"report"}, out["stages"]
    again = json.loads((run / "pipeline.json").read_text())["budget"]
    assert again["key"] == rec["key"] and again["sizes"] == sizes

    # --budget 3 is run.budget_minutes=3: the same plan
    cfg = yaml.safe_load(path.read_text())
    del cfg["run"]["budget_minutes"]
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    assert main(["run", "-c", str(path), "--budget", "3", "--json"]) == 0
    assert {s["stage"] for s in last_json(capsys)["stages"] if s["action"] == "run"} == {"report"}
    assert len(fake_calibrate) == 1


def test_a_dry_run_plans_from_a_saved_calibration_and_never_measures(tmp_path, capsys, tiny_qwen3, cache,
                                                                     fake_calibrate, monkeypatch):
    path = write_config(tmp_path, tiny_qwen3)
    assert main(["run", "-c", str(path), "--dry-run", "--budget", "2.5", "--json"]) == 0
    out = last_json(capsys)
    assert out["budget"]["plan"] is None and "calibration" in out["budget"]["reason"] and not fake_calibrate
    assert not (tmp_path / "run" / "pipeline.json").exists()
    from dflashkit.config import load_config
    from dflashkit.rundir import RunDir

    cfg = load_config(path, ["run.budget_minutes=2.5"])
    calib.calibrate(cfg, RunDir(tmp_path / "elsewhere"))  # saved in the cache: any run dir of this machine finds it
    assert len(fake_calibrate) == 1
    monkeypatch.setattr(calib, "calibrate", lambda *a, **k: pytest.fail("a dry run calibrated"))
    assert main(["run", "-c", str(path), "--dry-run", "--budget", "2.5", "--json"]) == 0
    out = last_json(capsys)
    plan = out["budget"]["plan"]
    assert plan["budget_minutes"] == 2.5 and plan["planned_s"] <= 2.5 * 60 * plan["safety"]
    assert out["budget"]["calibration"]["source"].endswith(".json")
    assert not (tmp_path / "run" / "pipeline.json").exists()
    # `plan` reads the same calibration; another machine (ATEN_CPU_CAPABILITY) has none: the assumed throughput
    assert main(["plan", "-c", str(path), "--json"]) == 0
    assert last_json(capsys)["plan"]["time"]["source"].startswith("measured on this machine")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert main(["plan", "-c", str(path), "--json"]) == 0
    assert last_json(capsys)["plan"]["time"]["source"].startswith("assumed 400 TFLOP/s")


@pytest.mark.parametrize("args, keys", [
    (["--budget", "0"], ["run.budget_minutes"]),
    (["run.budget_minutes=-5"], ["run.budget_minutes"]),
    (["run.budget_minutes=.nan"], ["run.budget_minutes"]),
    (["--budget", "soon"], ["run.budget_minutes"]),
    (["--budget", "10", "run.scale=2"], ["run.budget_minutes", "run.scale"]),
])
def test_bad_budgets_exit_2_naming_the_key(tmp_path, capsys, tiny_qwen3, cache, fake_calibrate, args, keys):
    path = write_config(tmp_path, tiny_qwen3)
    assert main(["run", "-c", str(path), *args, "--json"]) == 2
    out = last_json(capsys)
    assert all(k in out["error"] for k in keys), out["error"]
    assert not fake_calibrate and not (tmp_path / "run").exists()


def test_the_real_calibration_measures_and_is_found_again(tmp_path, tiny_qwen3, cache, monkeypatch):
    from dflashkit.config import load_config
    from dflashkit.rundir import RunDir

    path = write_config(tmp_path, tiny_qwen3)
    cfg = load_config(path, ["eval.block_sizes=[2,4]"])
    rd = RunDir(tmp_path / "run")
    assert calib.saved_calibration(cfg, rd) is None
    cal = calib.calibrate(cfg, rd)
    assert cal["capture_tok_s"] > 0 and cal["train_step_s"] > 0 and cal["load_s"] >= 0
    assert set(cal["decode_s"]) == {"1", "2", "4"} and all(t > 0 for t in cal["decode_s"].values())
    found = calib.saved_calibration(cfg, rd)
    assert found is not None and found["path"] == str(rd.root / "calibration.json")
    (rd.root / "calibration.json").unlink()
    assert calib.saved_calibration(cfg, rd)["path"].startswith(str(cache))
    assert calib.saved_calibration(load_config(path, ["train.batch_size=2"]), rd) is None  # another shape
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert calib.saved_calibration(cfg, rd) is None  # another machine
