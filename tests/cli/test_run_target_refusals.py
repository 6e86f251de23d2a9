"""What a stage refuses of the target itself, `dflashkit run` refuses before its first stage does any work, and
its dry run refuses too: a hybrid target (linear-attention / state-space layers) under train.on_path=rollout,
a quantization the local paths cannot load. `generate` refuses such a quantization before it starts its own
`dflashkit serve` (whose log would bury the refusal). Exit 2, the stage's own message, nothing written."""

from __future__ import annotations

import json
import shutil

import pytest

from dflashkit.cli import main
from tests.cli.test_generate_serve import write_prepared
from tests.cli.test_refusals import _refused, _snapshot

ROLLOUT = ["train.on_path=rollout", "train.labels=target", "train.loss=ce"]
LAYERS = "3 linear_attention + 1 full_attention"


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    from tests.harness.hybrid import make_tiny_hybrid_target

    return make_tiny_hybrid_target(tmp_path_factory.mktemp("hybrid") / "bamba", "bamba")


@pytest.fixture
def awq_dir(tiny_qwen3, tmp_path):
    """The tiny Qwen3 whose config.json declares AWQ (a method the local paths do not load)."""
    out = tmp_path / "awq"
    shutil.copytree(tiny_qwen3, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                                  "version": "gemm"}
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _prepared(tmp_path, target) -> tuple[object, list[str]]:
    rd = tmp_path / "run"
    write_prepared(rd)
    return rd, [f"run.run_dir={rd}", f"target.path={target}", "generate.max_tokens=4", "generate.progress=false"]


def test_run_refuses_rollout_on_a_hybrid_target_before_generate(hybrid_dir, tmp_path, capsys):
    rd, o = _prepared(tmp_path, hybrid_dir)
    before = _snapshot(rd)
    for dry in (["--dry-run"], []):
        _refused(["run", "--from", "generate", *dry, *o, *ROLLOUT], 2, capsys, "train.on_path=rollout",
                 str(hybrid_dir), "BambaForCausalLM", LAYERS, "train.on_path=mask")
        assert _snapshot(rd) == before  # nothing written: no generate/, no tokenize/, no pipeline.json
    assert not (rd / "generate").exists() and not (rd / "tokenize").exists()


def test_run_lets_rollout_on_a_full_attention_target_and_mask_on_a_hybrid_one_through(hybrid_dir, tiny_qwen3,
                                                                                       tmp_path, capsys):
    _, o = _prepared(tmp_path, tiny_qwen3)
    assert main(["run", "--from", "generate", "--dry-run", *o, *ROLLOUT]) == 0, capsys.readouterr().err
    _, o = _prepared(tmp_path, hybrid_dir)
    assert main(["run", "--from", "generate", "--dry-run", *o, "train.on_path=mask", "train.labels=target"]) == 0, \
        capsys.readouterr().err


def test_run_and_generate_refuse_an_awq_target_before_any_work(awq_dir, tmp_path, capsys):
    rd, o = _prepared(tmp_path, awq_dir)
    before = _snapshot(rd)
    for argv in (["run", "--from", "generate", "--dry-run"], ["run", "--from", "generate"], ["generate", "--dry-run"],
                 ["generate"]):
        _refused([*argv, *o], 2, capsys, str(awq_dir), "awq", "capture.engine=vllm", "train.features=engine")
        assert _snapshot(rd) == before  # no file written: no serve.log that buries the refusal, no journal
        assert argv == ["generate"] or not (rd / "generate").exists()  # (the stage holds its lock in it)
