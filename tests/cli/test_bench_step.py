"""`dflashkit bench step` on a tiny target: both paths measured, each against the memory floor."""

from __future__ import annotations

import json

import pytest

from dflashkit.cli import main


@pytest.mark.parametrize("packed", ["auto", "off"])
def test_bench_step_measures_both_paths_against_the_floor(tmp_path, tiny_qwen3, capsys, packed):
    args = ["bench", "step", "--json", f"target.path={tiny_qwen3}", "target.device=cpu", "eval.dtype=float32",
            f"eval.packed_weights={packed}", f"run.run_dir={tmp_path / 'r'}"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["subject"] == "step" and out["dtype"] == "float32"
    for path in ("as_loaded", "decoder"):
        r = out[path]
        assert set(r["t_s"]) == {"1", "2", "4", "8"} and all(v > 0 for v in r["t_s"].values())
        assert r["t1_share"] == pytest.approx(r["t1_roofline_s"] / r["t_s"]["1"], rel=1e-2, abs=1e-3)
        assert r["weight_bytes"] > 0 and r["bandwidth_gb_s"] > 0
    assert (out["packed"]["packed"] > 0) == (packed == "auto" and "oneDNN" in out["packed"]["reason"])
    assert (tmp_path / "r" / "bench" / "step.json").is_file()
