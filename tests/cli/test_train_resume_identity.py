"""A checkpoint resumes only the run it belongs to: `dflashkit train` refuses one trained on other data, seed or
optimisation settings (exit 2, naming what changed, nothing touched); more steps continue the run; and
`dflashkit run`'s restart (`stages.train.restart_if_changed`) then trains exactly what a fresh run trains."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
from safetensors.torch import load_file

from dflashkit.cli import main
from dflashkit.config import load_config
from dflashkit.rundir import RunDir, write_manifest
from tests.helpers import assert_same_weights, make_run, overrides


def _snapshot(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _tokenized_as(rd, config_hash: str) -> None:
    """Stand in for a tokenize run with this fingerprint (the trajectory reads tokenize's manifest)."""
    write_manifest(rd / "tokenize", stage="tokenize", config_hash=config_hash,
                   inputs={"conversations": {"path": "prepare/train.jsonl", "digest": config_hash[::-1]}})


def _train(rd, target, *extra, **kw):
    return main(["train", "--json", *overrides(rd, target, **kw), *extra])


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_qwen3):
    """`run`: tokenized (fingerprint aaaa) and trained 2 steps (checkpoint step-2), once for the module;
    `untrained`: the same run dir before training. Each test works on its own copy."""
    root = tmp_path_factory.mktemp("resume")
    rd = make_run(root / "run", tiny_qwen3)
    _tokenized_as(rd, "aaaa")
    shutil.copytree(rd, root / "untrained")
    assert _train(rd, tiny_qwen3, train__max_steps=2) == 0  # pytest shows its stderr on failure
    assert (rd / "train" / "checkpoints" / "step-0000002").is_dir()
    return root


def _copy(trained, tmp_path, name: str = "run", to: str | None = None):
    return shutil.copytree(trained / name, tmp_path / (to or name))


# train.optimizer: the checkpoint's optimizer state (AdamW's) is never loaded into Muon: the change is named first
@pytest.mark.parametrize("change", ["train.lr=1e-3", "run.seed=1", "train.num_anchors=4", "train.optimizer=muon",
                                    "data"])
def test_a_checkpoint_of_another_run_is_refused_naming_what_changed(change, trained, tmp_path, tiny_qwen3, capsys):
    rd = _copy(trained, tmp_path)
    before = _snapshot(rd / "train")
    capsys.readouterr()
    if change == "data":
        _tokenized_as(rd, "bbbb")  # tokenize re-ran on other prompts (a rescaled demo, another source)
        rc = _train(rd, tiny_qwen3, train__max_steps=4)
    else:
        rc = _train(rd, tiny_qwen3, change, train__max_steps=4)
    err = capsys.readouterr().err
    assert rc == 2, err
    named = "the tokenized data" if change == "data" else change.split("=")[0] + ": "
    assert named in err and "state.json" in err and "not the one the checkpoint belongs to" in err, err
    assert _snapshot(rd / "train") == before


def test_more_steps_continue_the_same_run(trained, tmp_path, tiny_qwen3, capsys):
    rd = _copy(trained, tmp_path)
    assert _train(rd, tiny_qwen3, train__max_steps=4) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["resumed_from"] == 2 and out["steps"] == 4


@pytest.mark.parametrize("change", [("train.lr=1e-3",), ("drafter.draft_vocab_size=24",), ()],
                         ids=["lr", "draft-vocab", "unchanged"])
def test_run_restart_trains_what_a_fresh_run_trains(change, trained, tmp_path, tiny_qwen3, capsys):
    from dflashkit.stages.train import restart_if_changed

    rd, fresh = _copy(trained, tmp_path), _copy(trained, tmp_path, "untrained", to="fresh")
    ov = [*overrides(rd, tiny_qwen3, train__max_steps=3), *change]
    changed = restart_if_changed(load_config(None, ov), RunDir(rd))
    if not change:  # the same run: nothing removed, train resumes it
        assert changed == [] and list((rd / "train" / "checkpoints").glob("step-*"))
        return
    assert len(changed) == 1 and changed[0].startswith(change[0].split("=")[0] + ": "), changed
    assert not list((rd / "train" / "checkpoints").glob("step-*"))
    capsys.readouterr()
    assert main(["train", "--json", *ov]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["resumed_from"] == 0
    assert main(["train", "--json", *overrides(fresh, tiny_qwen3, train__max_steps=3), *change]) == 0
    assert_same_weights(load_file(rd / "train" / "final" / "model.safetensors"),
                        load_file(fresh / "train" / "final" / "model.safetensors"))
    assert [json.loads(x)["loss"] for x in (rd / "train" / "metrics.jsonl").read_text().splitlines()] == \
        [json.loads(x)["loss"] for x in (fresh / "train" / "metrics.jsonl").read_text().splitlines()]
