"""Refusals made when the config loads (issue #38), through `cli.main`: what `train` would refuse on config
values alone is refused by `--dry-run` and by the first stage of `dflashkit run` (exit 2 naming the keys),
another family's knobs are never silently unused, a drafter config.json's knob is a JSON number as its
block size is, and an online rollout over a sliding-window target is refused before the target loads.

Each case asserts the exit code, that stderr names the key (and the family) at fault, no traceback, and
that nothing was written the user did not ask for.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import pytest

from dflashkit import family
from dflashkit.cli import main
from dflashkit.config import DrafterSection, RunConfig, TargetSection, config_from_dict, flat_settings, iter_fields
from dflashkit.errors import ConfigError, UsageError
from dflashkit.export.hf import save_drafter
from dflashkit.family.contract import DrafterContract
from dflashkit.target.load import load_target
from dflashkit.testing import random_drafter
from tests.helpers import make_run, overrides, tiny_contract, with_fields

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
LILI = dict(drafter_type="lilicorr", lilicorr_candidate_topk=4, lilicorr_num_heads=4, lilicorr_factor_dim=16)
ROLLOUT = ["drafter.type=lilicorr", "train.labels=target", "train.on_path=rollout"]


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(root).rglob("*")) if p.is_file() and p.name != ".lock"}


def _refused(argv: list[str], capsys, *needles: str) -> dict:
    rc = main([argv[0], "--json", *argv[1:]])
    out, err = capsys.readouterr()
    assert rc == 2, f"exit {rc}, expected 2\n{err[-3000:]}"
    assert "Traceback" not in err, err
    for needle in needles:
        assert needle in err, f"{needle!r} not in stderr:\n{err}"
    res = json.loads(out.strip().splitlines()[-1])
    assert res["ok"] is False and res["exit_code"] == 2, res
    return res


def _tiny_run_config(tmp_path: Path, target: Path) -> list[str]:
    """configs/tiny.yaml on the tiny target with one local source of original answers (no server, no assets)."""
    data = tmp_path / "user" / "raw.jsonl"
    data.parent.mkdir(parents=True)
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Count to {i}."},
                                                     {"role": "assistant", "content": "One, two, three."}]}) + "\n"
                            for i in range(12)))
    return ["-c", str(CONFIGS / "tiny.yaml"), f"run.run_dir={tmp_path / 'run'}", f"target.path={target}",
            f"data.sources=[{{path: {data}, answers: original}}]", "data.num_prompts=12", "data.heldout=2"]


# -- defect 3: a combination train refuses is refused by the dry run and before prepare --------------------------
def test_run_dry_run_refuses_what_train_refuses_naming_the_keys_and_the_family(tmp_path, tiny_qwen3, capsys):
    argv = ["run", "--dry-run", *_tiny_run_config(tmp_path, tiny_qwen3), *ROLLOUT]
    res = _refused(argv, capsys, "train.on_path", "drafter.type=lilicorr", "LiLiCorr loss term 'lattice'")
    assert "train.on_path" in res["error"] and "lilicorr" in res["error"]
    assert not (tmp_path / "run").exists()


def test_run_refuses_before_prepare_writes_anything(tmp_path, tiny_qwen3, capsys):
    argv = ["run", *_tiny_run_config(tmp_path, tiny_qwen3), *ROLLOUT]
    before = _snapshot(tmp_path / "user")
    _refused(argv, capsys, "train.on_path", "drafter.type=lilicorr")
    assert not (tmp_path / "run" / "prepare").exists() and not (tmp_path / "run" / "contract.json").exists()
    assert _snapshot(tmp_path / "user") == before


def test_train_keeps_its_own_check_with_the_contracts_family(tmp_path, tiny_qwen3, capsys):
    """drafter.type unset: the contract decides the family, and `train` still refuses (defence in depth)."""
    rd = make_run(tmp_path / "run", tiny_qwen3, **LILI)
    before = _snapshot(rd)
    for dry in (["--dry-run"], []):
        _refused(["train", *dry, *overrides(rd, tiny_qwen3), "train.labels=target", "train.on_path=rollout"],
                 capsys, "train.on_path", "drafter.type=lilicorr", "LiLiCorr loss term 'lattice'")
    assert _snapshot(rd) == before


# -- nit a: a knob of another family is refused, a knob a family reads is documented as its ----------------------
@pytest.mark.parametrize("kind,key", [
    ("dflash", "drafter.lilicorr_candidate_topk=4"),
    ("dflash", "drafter.selector_top_k=8"),
    ("dflash2", "drafter.lilicorr_num_layers=3"),
    ("lilicorr", "drafter.conv_group_size=8"),
    ("lilicorr", "drafter.final_logit_softcapping=30"),
    ("dflash", "train.selector_loss_weight=0.5"),
    ("dflash2", "train.lilicorr_penalty_weight=0"),
])
def test_another_familys_knob_is_refused_naming_the_key_and_the_family(tmp_path, capsys, kind, key):
    name = key.split("=")[0]
    owner = next(f for f in family.FAMILIES.values()
                 if name.split(".")[1] in (f.knob_names if name.startswith("drafter.") else f.weight_names))
    res = _refused(["train", "--dry-run", f"run.run_dir={tmp_path / 'run'}", f"drafter.type={kind}", key], capsys,
                   f"{name}: ", f"drafter.type={kind} does not read", owner.title)
    assert name in res["error"]
    assert not (tmp_path / "run").exists()


def _other(value):
    """A value other than a knob's default (its own checks are not what this is about)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, str):  # a Literal knob (drafter.attention_type): another of its choices
        return {"gqa": "mla", "mla": "gqa"}.get(value, value + "x")
    return 1.5 if value is None else value + 1


def _load_problems(data: dict) -> list[str]:
    try:
        cfg = config_from_dict(data, checks=family.checks)
    except ConfigError as e:
        return list(e.problems)
    assert type(cfg.drafter.knobs) is family.get(cfg.drafter.type).knobs  # resolved by drafter.type at load
    assert type(cfg.train.weights) is family.get(cfg.drafter.type).weights
    return []


def test_every_knob_set_for_a_family_that_does_not_read_it_is_a_problem():
    knobs, weights = flat_settings("knobs", None), flat_settings("weights", None)  # every key at its default
    for fam in family.FAMILIES.values():
        assert family.checks(RunConfig(drafter=DrafterSection(type=fam.name))) == []  # the defaults: nothing
        assert _load_problems({"drafter": {"type": fam.name, **knobs}, "train": weights}) == []  # a dump's keys
        for key in family.knob_keys():
            found = [p for p in _load_problems({"drafter": {"type": fam.name, key: _other(knobs[key])}})
                     if p.startswith(f"drafter.{key}: ") and "not read" in p]
            assert bool(found) == (key not in fam.knob_names), (fam.name, key, found)
        for key in weights:
            found = [p for p in _load_problems({"drafter": {"type": fam.name}, "train": {key: weights[key] + 0.5}})
                     if p.startswith(f"train.{key}: ") and "not read" in p]
            assert bool(found) == (key not in fam.weight_names), (fam.name, key, found)


def test_a_lattice_width_the_config_gives_is_checked_against_the_heads_when_it_loads():
    """train (probe, through the contract) refuses heads that do not divide the lattice width; when the config
    gives that width the dry run refuses it too."""
    from dflashkit.family.lilicorr import LiLiCorrKnobs

    bad = DrafterSection(type="lilicorr", knobs=LiLiCorrKnobs(lilicorr_hidden_size=36, lilicorr_num_heads=8))
    assert any(p.startswith("drafter.lilicorr_num_heads: 8 must divide the lattice width 36")
               for p in family.config_problems(bad))
    good = DrafterSection(type="lilicorr", knobs=LiLiCorrKnobs(lilicorr_hidden_size=32, lilicorr_num_heads=8))
    assert family.config_problems(good) == []


def test_the_docs_name_every_family_that_reads_a_knob():
    """docs/config.md (the schema's help) opens each family knob with the families that read it: LiLiCorr's
    network is DFlash's, so `drafter.causal` is LiLiCorr's too, and it is exported as such."""
    helps = {key: text for key, _, _, text in iter_fields()}
    for key in family.knob_keys():
        readers = ", ".join(f.name for f in family.FAMILIES.values() if key in f.knob_names)
        # a knob read only by one kind of layer names it after the families: "dflash, … (attention_type mla)"
        assert helps[f"drafter.{key}"].split(":")[0].split(" (")[0] == readers, (key, helps[f"drafter.{key}"][:60])
    for fam in family.FAMILIES.values():
        for key in fam.weight_names:
            assert helps[f"train.{key}"].startswith(f"drafter.type={fam.name}:"), key


# -- nit c: a knob in a drafter's config.json is a JSON number, as its block size is -----------------------------
def _drafter_dir(tmp_path: Path, tiny_qwen3: Path, knobs: dict, quoted: str | None = None
                 ) -> tuple[Path, DrafterContract]:
    """A saved random drafter (its config.json's `dflash_config.<quoted>` as a string), and its contract."""
    target = load_target(TargetSection(path=str(tiny_qwen3), device="cpu", dtype="float32"))
    d = tmp_path / "user" / "drafter"
    model = random_drafter(target, block_size=4, layers=2, **knobs)
    save_drafter(model, d, dtype="float32")
    if quoted is not None:  # "4": quoted by hand, or by a converter
        cfg = json.loads((d / "config.json").read_text())
        cfg["dflash_config"][quoted] = str(cfg["dflash_config"][quoted])
        (d / "config.json").write_text(json.dumps(cfg, indent=2))
    return d, model.contract


STRING_KNOBS = [
    ({}, "block_size"),                                      # the rule this follows
    (LILI, "lilicorr_candidate_topk"),
    (LILI, "lilicorr_logit_scale"),
    (dict(drafter_type="dflash2", conv_group_size=16, selector_rank=8, selector_top_k=6), "selector_top_k"),
]


@pytest.mark.parametrize("knobs,key", STRING_KNOBS, ids=[k for _, k in STRING_KNOBS])
def test_a_quoted_number_in_a_drafter_config_json_is_refused_on_import(tmp_path, tiny_qwen3, capsys, knobs, key):
    src, _ = _drafter_dir(tmp_path, tiny_qwen3, knobs, key)
    before = _snapshot(tmp_path / "user")
    _refused(["import", str(src), f"run.run_dir={tmp_path / 'run'}", f"target.path={tiny_qwen3}"], capsys,
             f"{src / 'config.json'}: ", f"{key} must be", "without quotes")
    assert _snapshot(tmp_path / "user") == before
    assert not (tmp_path / "run" / "train").exists() and not (tmp_path / "run" / "contract.json").exists()


def test_a_quoted_knob_is_refused_on_a_warm_start_and_in_the_yaml(tmp_path, tiny_qwen3, capsys):
    src, contract = _drafter_dir(tmp_path, tiny_qwen3, LILI, "lilicorr_candidate_topk")
    rd = make_run(tmp_path / "run", tiny_qwen3, contract=contract)  # the drafter fits it, but for the quotes
    _refused(["train", "--dry-run", *overrides(rd, tiny_qwen3), "drafter.type=lilicorr", f"drafter.init={src}"],
             capsys, "dflash_config.lilicorr_candidate_topk must be an integer")
    yaml = tmp_path / "user" / "run.yaml"
    yaml.write_text('drafter:\n  type: lilicorr\n  lilicorr_candidate_topk: "4"\n')
    _refused(["train", "--dry-run", "-c", str(yaml), f"run.run_dir={rd}"], capsys, "drafter.lilicorr_candidate_topk")


def test_a_quoted_knob_in_contract_json_is_named_not_a_traceback():
    for c in (with_fields(tiny_contract(), **{**LILI, "lilicorr_candidate_topk": "4"}),
              with_fields(tiny_contract(), drafter_type="dflash2", conv_group_size=8, selector_top_k="6")):
        name = next(k for k, v in dataclasses.asdict(c.knobs).items()
                    if isinstance(v, str) and k != "attention_type")  # attention_type is a string knob
        with pytest.raises(UsageError, match=f"{name} must be an integer, got '"):
            DrafterContract.from_dict(c.to_dict()).check()


# -- nit b: a dtype no drafter is stored in never travels into train/final ----------------------------------------
@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])
def test_an_unknown_dtype_in_a_drafter_config_json_is_refused_naming_the_key(tmp_path, tiny_qwen3, capsys, key):
    """Every config key holding a dtype is a choice the loader refuses by name (`drafter.torch_dtype` is no key);
    the one way a free-form dtype reached `train/final` is the config.json `import` copies as it is."""
    src, contract = _drafter_dir(tmp_path, tiny_qwen3, {})
    cfg = json.loads((src / "config.json").read_text())
    cfg[key] = "float77"
    (src / "config.json").write_text(json.dumps(cfg, indent=2))
    before = _snapshot(tmp_path / "user")
    _refused(["import", str(src), f"run.run_dir={tmp_path / 'run'}", f"target.path={tiny_qwen3}"], capsys,
             f"{src / 'config.json'}: {key} 'float77' is not one of ['float32', 'bfloat16'")
    assert _snapshot(tmp_path / "user") == before and not (tmp_path / "run" / "train").exists()
    rd = make_run(tmp_path / "run", tiny_qwen3, contract=contract)
    _refused(["train", "--dry-run", *overrides(rd, tiny_qwen3), f"drafter.init={src}"], capsys, f"{key} 'float77'")
    _refused(["train", "--dry-run", f"run.run_dir={rd}", "export.dtype=float77"], capsys,
             "export.dtype: 'float77' is not one of ['bfloat16', 'float16', 'float32']")


# -- nit d: the online rollout's sliding-window refusal comes before the target loads -----------------------------
def test_online_rollout_over_a_sliding_window_target_is_refused_before_it_loads(tmp_path, tiny_qwen3, capsys,
                                                                               monkeypatch):
    target = tmp_path / "user" / "target"
    shutil.copytree(tiny_qwen3, target)
    cfg = json.loads((target / "config.json").read_text())
    cfg.update(layer_types=["sliding_attention"] * cfg["num_hidden_layers"], sliding_window=4,
               use_sliding_window=True)
    (target / "config.json").write_text(json.dumps(cfg))
    rd = make_run(tmp_path / "run", target)
    before = _snapshot(tmp_path)

    def loaded(*_a, **_k):
        raise AssertionError("the target was loaded before the refusal")

    monkeypatch.setattr("dflashkit.target.load.load_target", loaded)
    for dry in (["--dry-run"], []):
        _refused(["train", *dry, *overrides(rd, target), "train.labels=target", "train.on_path=rollout"], capsys,
                 "train.on_path=rollout: the target has sliding_attention layers (window 4 <", "train.on_path=mask")
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("key,needle", [("learn.max_epochs=0", "learn.max_epochs: must be > 0"),
                                        ("learn.score_anchors=0", "learn.score_anchors: must be >= 1")])
def test_a_learn_cap_that_would_train_or_score_one_step_is_refused(tmp_path, capsys, key, needle):
    _refused(["learn", "--dry-run", f"run.run_dir={tmp_path / 'run'}", "--records", str(tmp_path / "rec"), key],
             capsys, needle)
    assert not (tmp_path / "run").exists()


def _declared_ranges(cls: type = RunConfig, prefix: str = ""):
    """(dotted key, the field, its declared range) of every schema field with one, sections walked (a family's
    flat settings are the family's: tests/family)."""
    import typing

    hints = typing.get_type_hints(cls)
    for fl in dataclasses.fields(cls):
        key, tp = f"{prefix}{fl.name}", hints[fl.name]
        if fl.metadata.get("flat"):
            continue
        if dataclasses.is_dataclass(tp):
            yield from _declared_ranges(tp, key + ".")
        elif fl.metadata.get("range"):
            yield key, fl, fl.metadata["range"]


def _outside(r: dict, integer: bool) -> list[float]:
    """One value just outside each side of the range `r`."""
    step = 1 if integer else 0.5
    out = [r["ge"] - step] if "ge" in r else [r["gt"]] if "gt" in r else []
    return out + ([r["le"] + step] if "le" in r else [r["lt"]] if "lt" in r else [])


def test_every_declared_range_is_refused_naming_the_key():
    """Each schema field's declared range (`schema.f(..., ge=, gt=, le=, lt=)`) is enforced by the one walk of
    config/validate.py: a value just outside either side is refused naming the key (a list's item by its
    index), and the default lies inside it."""
    cases = list(_declared_ranges())
    assert len(cases) > 60 and {"train.lr", "serve.port", "eval.block_sizes", "learn.max_epochs"} <= {
        k for k, _, _ in cases}
    config_from_dict({})  # every default is inside its range
    for key, fl, r in cases:
        integer = "int" in str(fl.type) and "float" not in str(fl.type)
        listed = str(fl.type).startswith("list")
        for bad in _outside(r, integer):
            value = int(bad) if integer else bad
            text = f"[{value}]" if listed else str(value)
            with pytest.raises(ConfigError) as e:
                config_from_dict({}, [f"{key}={text}"])
            needle = f"{key}[0]: must be " if listed else f"{key}: must be "
            assert needle in str(e.value), (key, value, str(e.value))
    with pytest.raises(ConfigError, match=r"data\.sources\[1\]\.weight: must be > 0, got 0"):
        config_from_dict({"data": {"sources": [{"path": "a", "weight": 1}, {"path": "b", "weight": 0}]}})


def test_a_family_weight_that_is_not_finite_is_named_by_the_key_users_write():
    """A family's `train.*` weight lives in `cfg.train.weights`, but the refusal names the flat key of the YAML and
    the command line, as its range refusal does."""
    with pytest.raises(ConfigError) as e:
        config_from_dict({}, ["drafter.type=dspark", "train.dspark_markov_loss_weight=.nan"])
    assert "train.dspark_markov_loss_weight: must be a finite number, got nan" in str(e.value), str(e.value)
    assert "train.weights." not in str(e.value)
