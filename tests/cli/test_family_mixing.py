"""Drafter families are never mixed silently (issue #33): `dflashkit import` of another family's drafter into a
run, and `train` with `drafter.init` at another family's drafter, exit 2 naming both families — unless the
run's family documents the conversion (a DFlash2 run starts from a DFlash checkpoint: `Family.init_from`),
which then begins exactly where the DFlash drafter was (identity convolutions)."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from dflashkit.cli import main
from tests.helpers import make_run, overrides

DFLASH2 = dict(drafter_type="dflash2", conv_group_size=16, selector_rank=16, selector_top_k=8)


def _run(argv, capsys):
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.err, json.loads(out.out.strip().splitlines()[-1])


def _heldout(rd):
    return [r for r in map(json.loads, (rd / "train" / "metrics.jsonl").read_text().splitlines())
            if r.get("split") == "heldout"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_qwen3):
    """A DFlash and a DFlash2 run, each trained and exported in both formats."""
    tmp = tmp_path_factory.mktemp("families")
    out = {}
    for name, contract, flags in (("dflash", {}, []), ("dflash2", DFLASH2, ["drafter.type=dflash2"])):
        rd = make_run(tmp / name, tiny_qwen3, **contract)
        assert main(["train", "--json", *overrides(rd, tiny_qwen3, train__max_steps=3), *flags]) == 0
        common = [f"run.run_dir={rd}", f"target.path={tiny_qwen3}", "export.dtype=float32", *flags]
        assert main(["export", "--json", *common]) == 0
        assert main(["export", "--json", *common, "export.format=speculators", f"export.out_dir={rd / 'spec'}"]) == 0
        out[name] = {"run": rd, "zlab": rd / "export", "speculators": rd / "spec"}
    return {**out, "tmp": tmp}


@pytest.mark.parametrize("fmt", ["zlab", "speculators"])
@pytest.mark.parametrize("kind,into", [("dflash2", "dflash"), ("dflash", "dflash2")])
def test_import_of_another_familys_drafter_is_exit_2_naming_both(trained, tiny_qwen3, capsys, kind, into, fmt):
    rd = make_run(trained["tmp"] / f"imp-{kind}-{into}-{fmt}", tiny_qwen3, **(DFLASH2 if into == "dflash2" else {}))
    rc, err, out = _run(["import", str(trained[kind][fmt]), f"target.path={tiny_qwen3}", "--run-dir", str(rd),
                         "--json"], capsys)
    title = {"dflash": "DFlash", "dflash2": "DFlash2"}[kind]
    assert rc == 2 and out["exit_code"] == 2, err[-2000:]
    assert f"is a {title} drafter (drafter_type {kind})" in out["error"], out["error"]
    assert f"contract {rd / 'contract.json'} is drafter_type {into}" in out["error"]
    assert f"set drafter.type={kind}" in out["hint"] and "import it into a run of that type" in out["hint"]
    assert not (rd / "train" / "final").exists() and not (rd / "import").exists()


def test_import_into_a_run_of_the_same_family_with_other_knobs_names_them(trained, tiny_qwen3, capsys):
    rd = make_run(trained["tmp"] / "imp-knobs", tiny_qwen3, **{**DFLASH2, "selector_top_k": 4})
    rc, err, out = _run(["import", str(trained["dflash2"]["zlab"]), f"target.path={tiny_qwen3}", "--run-dir", str(rd),
                         "--json"], capsys)
    assert rc == 2 and "selector_top_k: 8 in" in out["error"] and "4 in" in out["error"], err[-2000:]
    same = make_run(trained["tmp"] / "imp-same", tiny_qwen3, **DFLASH2)
    rc, err, _ = _run(["import", str(trained["dflash2"]["zlab"]), f"target.path={tiny_qwen3}", "--run-dir",
                       str(same), "--json"], capsys)
    assert rc == 0 and (same / "train" / "final" / "model.safetensors").is_file(), err[-2000:]


@pytest.mark.parametrize("fmt", ["zlab", "speculators"])
def test_warm_start_from_a_dflash2_drafter_in_a_dflash_run_is_exit_2_naming_both(trained, tiny_qwen3, capsys, fmt):
    rd = make_run(trained["tmp"] / f"warm-d2-{fmt}", tiny_qwen3)
    rc, err, out = _run(["train", "--json", *overrides(rd, tiny_qwen3, train__max_steps=1),
                         f"drafter.init={trained['dflash2'][fmt]}"], capsys)
    assert rc == 2, err[-2000:]
    assert "a DFlash2 drafter (drafter_type dflash2) cannot start this run's DFlash drafter (drafter_type dflash)" \
        in out["error"], out["error"]
    assert "set drafter.type=dflash2" in out["hint"] and "point drafter.init at a DFlash drafter" in out["hint"]
    assert not (rd / "train" / "final").exists() and not (rd / "train" / "metrics.jsonl").exists()


def test_a_dflash2_run_starts_from_a_dflash_drafter_where_it_ended(trained, tiny_qwen3, capsys):
    """The documented conversion: the shared tensors copied, identity convolutions, so at step 0 the DFlash2
    drafter's unary argmax is the DFlash drafter's — held-out unary τ / accuracy equal the source's final ones."""
    src = trained["dflash"]
    rd = make_run(trained["tmp"] / "warm-d-into-d2", tiny_qwen3, **DFLASH2)
    rc, err, out = _run(["train", "--json", *overrides(rd, tiny_qwen3, train__max_steps=1), "drafter.type=dflash2",
                         f"drafter.init={src['zlab']}"], capsys)
    assert rc == 0, err[-2000:]
    warm = out["warm_start"]
    shared = load_file(src["zlab"] / "model.safetensors")  # every DFlash tensor has its place in a DFlash2 drafter
    assert warm["converted"] == {"from": "dflash", "to": "dflash2", "skipped": 0} and warm["tensors"] == len(shared)
    first, last = _heldout(rd)[0], _heldout(src["run"])[-1]
    assert first["step"] == 0 and (first["unary_tau"], first["unary_acc"]) == (last["tau"], last["acc"])
