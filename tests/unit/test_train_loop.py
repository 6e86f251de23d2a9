"""`dflashkit train` end to end on tiny real targets: artifacts, equivalences, resume, bad input."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dflashkit.cli import main
from tests.unit.test_train_setup import make_run, overrides


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
