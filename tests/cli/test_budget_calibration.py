"""A corrupt, partial or foreign calibration in the run dir or the cache, through the CLI: `run --budget` names it and
plans without it (a dry run) or measures again; `plan` says "ignored <file>: <why>" and estimates without it, exit 0;
never a raw exception, never a negative or non-finite number."""

from __future__ import annotations

import json

import pytest

from dflashkit.cli import main
from dflashkit.config import load_config
from dflashkit.sizing import calibration as calib
from tests.cli.test_budget import cache, fake_calibrate, write_config  # noqa: F401 - fixtures

pytestmark = pytest.mark.usefixtures("cache", "fake_calibrate")

BAD = {"partial": lambda cal: json.dumps(cal)[:40],
       "negative": lambda cal: json.dumps({**cal, "capture_tok_s": -4000.0, "train_step_s": -0.05}),
       "foreign": lambda cal: json.dumps({**cal, "machine_key": "cuda-another-0123456789"}),
       "infinite": lambda cal: json.dumps({**cal, "decode_s": {"1": float("inf"), "4": 0.005}})}


def bad_file(tmp_path, path, where: str, case: str):
    cfg = load_config(path, ["run.budget_minutes=2.5"])
    calib.calibrate(cfg, None)  # (fake_calibrate) a valid body, written to the cache
    m = calib.machine(cfg.target.device)
    entry = calib.cache_path(calib.machine_key(m), calib.shape_key(cfg))
    body = json.loads(entry.read_text())
    target = entry if where == "cache" else tmp_path / "run" / "calibration.json"
    if where != "cache":
        entry.unlink()
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(BAD[case](body))
    return target


def numbers(obj):
    if isinstance(obj, bool):
        return
    if isinstance(obj, (int, float)):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from numbers(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from numbers(v)


@pytest.mark.parametrize("where", ["run dir", "cache"])
@pytest.mark.parametrize("case", sorted(BAD))
def test_plan_ignores_a_bad_calibration_by_name(tmp_path, capsys, tiny_qwen3, where, case):
    path = write_config(tmp_path, tiny_qwen3)
    bad = bad_file(tmp_path, path, where, case)
    assert main(["plan", "-c", str(path), "--json"]) == 0
    got = capsys.readouterr()
    out = json.loads(got.out.strip().splitlines()[-1])
    assert out["calibration_ignored"] and out["calibration_ignored"][0].startswith(f"ignored {bad}: ")
    assert out["plan"]["time"]["source"].startswith("assumed")
    assert f"ignored {bad}" in got.err  # the warning
    hours = {k: v for k, v in out["plan"]["time"].items() if k.startswith("hours")}
    assert hours and all(v >= 0 for v in hours.values()), hours
    assert main(["plan", "-c", str(path)]) == 0  # the table names it too
    assert f"ignored {bad}: " in capsys.readouterr().out


@pytest.mark.parametrize("where", ["run dir", "cache"])
@pytest.mark.parametrize("case", ["partial", "negative"])
def test_a_budgeted_dry_run_names_a_bad_calibration_and_plans_nothing_from_it(tmp_path, capsys, tiny_qwen3,
                                                                               where, case):
    path = write_config(tmp_path, tiny_qwen3)
    bad = bad_file(tmp_path, path, where, case)
    assert main(["run", "-c", str(path), "--dry-run", "--budget", "2.5", "--json"]) == 0
    got = capsys.readouterr()
    out = json.loads(got.out.strip().splitlines()[-1])
    assert out["budget"]["plan"] is None and "no calibration" in out["budget"]["reason"]
    assert f"calibration: ignored {bad}: " in got.err
    assert all(v == v and abs(v) != float("inf") for v in numbers(out))
