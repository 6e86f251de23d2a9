"""A drafter family defined in this file alone trains, decodes and exports through the real pipeline.

"toy" is DFlash's network with one more tensor (`toy_gain`, [H], a gain on the drafter's outputs that starts at
its knob `drafter.toy_scale`) and one more loss term (`train.toy_loss_weight` · the mean square of the drafter's
outputs). The CLI runs in subprocesses that register it through DFLASHKIT_FAMILIES; nothing outside this file
names it (the CLI's `family.load_plugins()` imports it). Module-level imports stay below the registry
(`dflashkit.family.base`, `knobs`, `dflash`, the DFlash network). Its hooks receive its own settings: the
loss terms get a `ToyWeights`, the network reads `contract.knobs`, a `ToyKnobs`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dflashkit.family.base import Decoding, Family, Formats, Network, Objective, StatField
from dflashkit.family.dflash import DFLASH, DFlashKnobs, propose
from dflashkit.family.knobs import knob
from dflashkit.model.drafter import DFlashDraftModel

ROOT = Path(__file__).resolve().parents[2]
ENV = {"DFLASHKIT_FAMILIES": "tests.family.test_toy_family:TOY"}  # this module, as the subprocesses import it


@dataclass(frozen=True)
class ToyKnobs(DFlashKnobs):
    toy_scale: float = knob(1.0, "toy: the initial gain on the drafter's outputs.", gt=0)


@dataclass(frozen=True)
class ToyWeights:
    toy_loss_weight: float = knob(0.1, "drafter.type=toy: weight of the mean square of the drafter's outputs.", ge=0)


class ToyDraftModel(DFlashDraftModel):
    def __init__(self, contract: Any, draft_vocab: Any = None, feature_scale: Any = None):
        super().__init__(contract, draft_vocab=draft_vocab, feature_scale=feature_scale)
        self.toy_gain = nn.Parameter(torch.full((contract.hidden_size,), float(contract.knobs.toy_scale)))

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return super().forward(*args, **kwargs) * self.toy_gain


MODELING = '''
class ToyDraftModel(DFlashDraftModel):
    def __init__(self, config):
        super().__init__(config)
        self.toy_gain = nn.Parameter(torch.ones(config.hidden_size))

    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs) * self.toy_gain
'''


@dataclass(frozen=True)
class ToyTerm:
    weight: float
    name: str = "toy"
    needs_prev: bool = False
    needs_target: bool = False

    def chunk(self, rows: Any) -> torch.Tensor:
        return rows.hidden.float().pow(2).mean(-1)

    def total(self, parts: list, row_w: torch.Tensor, *_: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        square = ((row_w * torch.cat(parts)).sum() if parts else row_w.new_zeros(()))
        return self.weight * square, {"toy_loss": float(square.detach())}

    def rescore(self, s: Any) -> tuple[None, dict[str, Any]]:
        return None, {}


def _dflash_config(c: Any) -> dict[str, Any]:
    return {**DFLASH.formats.dflash_config(c), "toy_scale": c.knobs.toy_scale}


def _read_knobs(cfg: dict, dc: dict, source: str) -> dict[str, Any]:
    return {**DFLASH.formats.read_knobs(cfg, dc, source), "toy_scale": float(dc.get("toy_scale", 1.0))}


TOY = Family(
    name="toy",
    title="Toy",
    network=Network(build=ToyDraftModel, tensor_markers=("toy_gain",), reduced_vocab=False),
    objective=Objective(loss_terms=lambda train: [ToyTerm(train.toy_loss_weight)], stats=(StatField("toy_loss", loss=True),),
                        metrics=lambda st: {"toy_loss": float(st.extra["toy_loss"])}, metric_names=("toy_loss",)),
    formats=Formats(architecture="ToyDraftModel", dflash_config=_dflash_config, hf_keys=DFLASH.formats.hf_keys,
                    read_knobs=_read_knobs, speculators=False, modeling_source=MODELING),
    decoding=Decoding(propose=propose),
    knobs=ToyKnobs,
    weights=ToyWeights,
)


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, **ENV, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "dflashkit", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow  # five CLI subprocesses (probe, train, eval, export and a refusal)
def test_a_family_defined_in_a_test_trains_decodes_and_exports(tmp_path, tiny_qwen3):
    from safetensors.torch import load_file

    from tests.helpers import tokenize_texts, write_shards

    rd = tmp_path / "run"
    yaml = tmp_path / "run.yaml"
    yaml.write_text(json.dumps({
        "run": {"run_dir": str(rd)}, "target": {"path": str(tiny_qwen3), "dtype": "float32"},
        "drafter": {"type": "toy", "toy_scale": 0.5, "block_size": 4, "num_draft_layers": 1,
                    "num_target_features": 2},
        "train": {"toy_loss_weight": 0.2, "batch_size": 2, "max_steps": 3, "heldout_samples": 2, "lr": 3e-3,
                  "warmup_ratio": 0.0, "log_every": 1, "eval_every": 0, "save_every": 0, "num_anchors": 8},
        "eval": {"num_prompts": 1, "max_new_tokens": 8, "warmup": 0, "block_sizes": [4], "diagnostics": False,
                 "prompt_lookup": False, "adaptive_length": False},
        "export": {"dtype": "float32"}}))
    # the toy knob is refused where the family that reads it is not the run's (exit 2, naming the key)
    bad = _cli("train", "--dry-run", "-c", str(yaml), "drafter.type=dflash", cwd=tmp_path)
    assert bad.returncode == 2 and "drafter.toy_scale: 0.5 is a knob of Toy" in bad.stderr, bad.stderr
    assert "train.toy_loss_weight: 0.2 is a knob of Toy" in bad.stderr

    probe = _cli("probe", "-c", str(yaml), cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr
    contract = json.loads((rd / "contract.json").read_text())
    assert contract["drafter_type"] == "toy" and contract["toy_scale"] == 0.5 and contract["causal"] is False
    write_shards(rd, tokenize_texts(tiny_qwen3))
    rows = [{"id": f"p{i}", "source": "t", "messages": [{"role": "user", "content": f"tell me {i} things"},
                                                        {"role": "assistant", "content": "ok"}]} for i in range(2)]
    (rd / "prepare").mkdir()
    (rd / "prepare" / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    train = _cli("train", "-c", str(yaml), cwd=tmp_path)
    assert train.returncode == 0, train.stderr
    steps = [json.loads(x) for x in (rd / "train" / "metrics.jsonl").read_text().splitlines()]
    assert steps and all(r["toy_loss"] > 0 for r in steps if "split" not in r)  # its own term, its own metric
    final = load_file(rd / "train" / "final" / "model.safetensors")
    assert not torch.allclose(final["toy_gain"], torch.full_like(final["toy_gain"], 0.5))  # trained from the knob

    ev = _cli("eval", "-c", str(yaml), cwd=tmp_path)
    assert ev.returncode == 0, ev.stderr
    res = json.loads((rd / "eval" / "results.json").read_text())
    assert res["lossless"]["verdict"] == "exact"  # speculative output == the target's greedy output
    assert all(1 <= r["tau"] <= int(bs) for bs, r in res["speculative"].items())

    ex = _cli("export", "-c", str(yaml), cwd=tmp_path)
    assert ex.returncode == 0, ex.stderr
    out = rd / "export"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["ToyDraftModel"] and cfg["dflash_config"]["toy_scale"] == 0.5
    assert "class ToyDraftModel(DFlashDraftModel)" in (out / "dflash.py").read_text()
    check = json.loads((out / "manifest.json").read_text())["reload_check"]
    assert check["max_diff_vs_source"] == 0 and check["max_diff_shipped_vs_ours"] <= 1e-4 * check["logit_scale"]
    assert torch.equal(load_file(out / "model.safetensors")["toy_gain"], final["toy_gain"])


def test_a_plugin_that_does_not_load_is_named(tmp_path):
    env = {**os.environ, "DFLASHKIT_FAMILIES": "no_such_module:TOY"}
    got = subprocess.run([sys.executable, "-m", "dflashkit", "train", "--dry-run"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert got.returncode == 2 and "DFLASHKIT_FAMILIES=no_such_module:TOY" in got.stderr, got.stderr
    assert "Traceback" not in got.stderr


def test_register_refuses_a_taken_name_or_architecture():
    from dataclasses import replace

    from dflashkit import family
    from dflashkit.errors import UsageError

    with pytest.raises(UsageError, match="clashes with the registered 'dflash'"):
        family.register(replace(TOY, name="dflash"))
    with pytest.raises(UsageError, match="clashes with the registered 'dflash2'"):
        family.register(replace(TOY, formats=replace(TOY.formats, architecture="DFlash2DraftModel")))
    assert "toy" not in family.FAMILIES
