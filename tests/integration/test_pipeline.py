"""End to end through the real CLI: `dflashkit run` on tiny targets (regeneration through
`dflashkit serve` on 127.0.0.1 included), skip-when-up-to-date, and the Kimi-K2 architecture."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflashkit.cli import main

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _run(capsys, *args) -> dict:
    code = main(list(args))
    out = _last_json(capsys)
    assert code == 0, out
    return out


def _check_run_dir(run_dir: Path) -> dict:
    for stage in ("probe", "prepare", "generate", "tokenize", "train", "eval", "export", "report"):
        assert (run_dir / stage / "manifest.json").is_file(), f"{stage} wrote no manifest"
    contract = json.loads((run_dir / "contract.json").read_text())
    cfg = json.loads((run_dir / "export" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["dflash_config"]["target_layer_ids"] == contract["target_layer_ids"]
    assert cfg["dflash_config"]["mask_token_id"] == contract["mask_token_id"]
    results = json.loads((run_dir / "eval" / "results.json").read_text())
    from dflashkit.export.profile import read_profile, weights_digest

    profile = read_profile(run_dir / "export" / "speculation_profile.json")  # run ends with one beside the export
    assert profile is not None and profile["draft_checkpoint"]["export"]["weights_sha256"] == \
        weights_digest(run_dir / "export")
    return results


@pytest.mark.slow
@pytest.mark.parametrize("config", ["tiny.yaml", "kimi-k2-tiny.yaml"])
def test_run_end_to_end_then_skip(tmp_path, capsys, config):
    run_dir = tmp_path / "run"
    out = _run(capsys, "run", "-c", str(CONFIGS / config), f"run.run_dir={run_dir}")
    assert all(s["action"] == "run" for s in out["stages"])
    results = _check_run_dir(run_dir)
    summary = results.get("summary", results)
    assert summary["greedy_identical"] is True
    assert 1.0 <= summary["tau"] <= 4.0
    if config.startswith("kimi"):
        contract = json.loads((run_dir / "contract.json").read_text())
        assert contract["target_model_type"] in ("kimi_k2", "deepseek_v3", "kimi_k25")
        assert summary["tau"] > 1.0, "the drafter on the Kimi-architecture target accepts nothing"

    # A second run skips everything but the report; changing eval re-runs eval onwards only.
    out = _run(capsys, "run", "-c", str(CONFIGS / config), f"run.run_dir={run_dir}")
    actions = {s["stage"]: s["action"] for s in out["stages"]}
    assert {k for k, v in actions.items() if v == "run"} == {"report"}, actions
    # an export from before the profile (its manifest does not mention one) runs again, once
    manifest = json.loads((run_dir / "export" / "manifest.json").read_text())
    manifest.pop("speculation_profile")
    (run_dir / "export" / "manifest.json").write_text(json.dumps(manifest))
    (run_dir / "export" / "speculation_profile.json").unlink()
    out = _run(capsys, "run", "-c", str(CONFIGS / config), f"run.run_dir={run_dir}")
    assert [s["stage"] for s in out["stages"] if s["action"] == "run"] == ["export", "report"], out["stages"]
    _check_run_dir(run_dir)
    out = _run(capsys, "run", "-c", str(CONFIGS / config), f"run.run_dir={run_dir}", "eval.max_new_tokens=16")
    actions = {s["stage"]: s["action"] for s in out["stages"]}
    assert [k for k, v in actions.items() if v == "run"] == ["eval", "export", "report"], actions
    if config != "tiny.yaml":
        return
    # A reduced draft vocab re-runs train onwards, never the data stages. `train` alone refuses to resume
    # the full-vocab checkpoints with it (exit 2, naming the key); `run` starts train over instead.
    small = ["-c", str(CONFIGS / config), f"run.run_dir={run_dir}", "eval.max_new_tokens=16",
             "drafter.draft_vocab_size=64"]
    assert main(["train", *small]) == 2 and "drafter.draft_vocab_size" in _last_json(capsys)["error"]
    out = _run(capsys, "run", *small)
    actions = {s["stage"]: s["action"] for s in out["stages"]}
    assert [k for k, v in actions.items() if v == "run"] == ["train", "eval", "export", "report"], actions
    assert json.loads((run_dir / "train" / "manifest.json").read_text())["result"]["resumed_from"] == 0
    results = _check_run_dir(run_dir)
    assert results["summary"]["greedy_identical"] is True
    assert json.loads((run_dir / "export" / "config.json").read_text())["draft_vocab_size"] == 64


def test_dry_run_changes_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    out = _run(capsys, "run", "-c", str(CONFIGS / "tiny.yaml"), f"run.run_dir={run_dir}", "--dry-run")
    assert [s["stage"] for s in out["stages"]][:2] == ["probe", "prepare"]
    assert all(s["action"] == "run" for s in out["stages"])
    assert not run_dir.exists()


def test_from_to_validation(tmp_path, capsys):
    assert main(["run", "-c", str(CONFIGS / "tiny.yaml"), f"run.run_dir={tmp_path}", "--from", "trian"]) == 2
    assert "not a stage" in _last_json(capsys)["error"]
    assert main(["run", "-c", str(CONFIGS / "tiny.yaml"), f"run.run_dir={tmp_path}", "--from", "eval",
                 "--to", "prepare"]) == 2
