"""Paths that cannot handle a hybrid target (linear-attention / state-space layers) refuse it before any work:
exit 2, naming the target, its layer types and what to use instead; nothing is written."""

from __future__ import annotations

import pytest

from dflashkit.cli import main
from dflashkit.errors import UsageError
from tests.cli.test_refusals import _refused, _snapshot
from tests.helpers import make_run, overrides


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    from tests.harness.hybrid import make_tiny_hybrid_target

    return make_tiny_hybrid_target(tmp_path_factory.mktemp("hybrid") / "bamba", "bamba")


ROLLOUT = ["train.on_path=rollout", "train.labels=target", "train.loss=ce"]


@pytest.mark.parametrize("argv, key, instead", [
    (["capture", "capture.engine=vllm"], "capture.engine=vllm", "capture.engine: local"),
    (["train", "capture.engine=vllm", "train.features=engine"], "train.features=engine",
     "train.features: online or cached"),
    (["train", *ROLLOUT], "train.on_path=rollout", "train.on_path=mask"),
    (["capture", *ROLLOUT], "train.on_path=rollout", "train.on_path=mask"),
], ids=["capture-engine", "train-engine", "train-rollout", "capture-rollout"])
def test_a_hybrid_target_is_refused_naming_its_layer_types(argv, key, instead, hybrid_dir, tmp_path, capsys):
    rd = make_run(tmp_path / "run", hybrid_dir)
    before = _snapshot(rd)
    _refused([*argv, *overrides(rd, hybrid_dir)], 2, capsys, key, str(hybrid_dir), "BambaForCausalLM",
             "3 linear_attention + 1 full_attention", instead)
    assert _snapshot(rd) == before and not (rd / "capture").exists() and not (rd / "train").exists()


def test_capture_cached_training_and_export_on_a_hybrid_target(hybrid_dir, tmp_path):
    """The rollout-free paths work: capture (local; it plans no held-out greedy paths for a hybrid), training on
    the cached features with train.on_path=mask, export with its reload check."""
    rd = make_run(tmp_path / "run", hybrid_dir)
    o = [*overrides(rd, hybrid_dir), "train.labels=target", "train.on_path=mask"]
    assert main(["capture", *o]) == 0 and (rd / "capture").is_dir()
    assert main(["train", *o, "train.features=cached"]) == 0
    assert main(["export", *o]) == 0
    assert (rd / "export" / "model.safetensors").is_file()


@pytest.mark.parametrize("what", ["verify-engine", "server.engine=vllm (server.urls is empty)"])
def test_vllm_is_refused_for_a_hybrid_target_before_it_is_looked_for(what, hybrid_dir):
    from dflashkit.config import config_from_dict
    from dflashkit.engines.launch import check_vllm_for_target

    cfg = config_from_dict({"target": {"path": str(hybrid_dir)}})
    with pytest.raises(UsageError) as e:
        check_vllm_for_target(cfg, what)
    msg = f"{e.value} {e.value.hint}"
    assert e.value.exit_code == 2 and what in msg and "3 linear_attention + 1 full_attention" in msg
    assert ("dflashkit eval" if what == "verify-engine" else "server.engine: dflashkit") in msg


def test_a_full_attention_target_passes_the_hybrid_check(tiny_qwen3):
    from dflashkit.config import config_from_dict
    from dflashkit.engines.launch import check_engine_architecture

    check_engine_architecture(config_from_dict({"target": {"path": str(tiny_qwen3)}}), tiny_qwen3, "verify-engine")
