"""A plugin family that misbehaves is refused by name (exit 2), never obeyed silently.

A plugin calling `sys.exit` at import would end every command with its code and no word; a plugin whose knob or
weight reuses a common key (`drafter.block_size`, `train.lr`) or another family's field would take that key
over. The CLI cases run in subprocesses: the CLI loads the plugins (`family.load_plugins`) before it reads a config.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dflashkit import config, family  # the schema built: the common keys are reserved
from dflashkit.errors import UsageError
from dflashkit.family.dflash import DFLASH, DFlashKnobs
from dflashkit.family.knobs import knob

PLUGIN = '''
import dataclasses
from dataclasses import dataclass
from dflashkit.family.dflash import DFLASH, DFlashKnobs
from dflashkit.family.knobs import knob

@dataclass(frozen=True)
class BadKnobs(DFlashKnobs):
    {knob}

@dataclass(frozen=True)
class BadWeights:
    {weight}

BAD = dataclasses.replace(DFLASH, name="bad", title="Bad", knobs=BadKnobs, weights=BadWeights,
                          formats=dataclasses.replace(DFLASH.formats, architecture="BadDraftModel"))
'''


def _dry_run(tmp_path: Path, module: str, source: str) -> subprocess.CompletedProcess:
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
    env = {**os.environ, "DFLASHKIT_FAMILIES": f"{module}:BAD",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "dflashkit", "train", "--dry-run", f"run.run_dir={tmp_path / 'run'}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_plugin_calling_sys_exit_at_import_is_refused_by_name(tmp_path):
    got = _dry_run(tmp_path, "exiting_plugin", "import sys\nsys.exit(0)\n")
    assert got.returncode == 2, (got.returncode, got.stderr)
    assert "DFLASHKIT_FAMILIES=exiting_plugin:BAD" in got.stderr and "sys.exit(0)" in got.stderr, got.stderr
    assert "Traceback" not in got.stderr


def test_the_loader_turns_system_exit_into_a_usage_error_but_lets_ctrl_c_through(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "exit_three.py").write_text("raise SystemExit('bye')\n")
    (tmp_path / "ctrl_c.py").write_text("raise KeyboardInterrupt\n")
    with pytest.raises(UsageError, match=r"entry point 'x'.*'exit_three:BAD'.*sys.exit\('bye'\)"):
        family._load("exit_three:BAD", "entry point 'x'")
    with pytest.raises(KeyboardInterrupt):
        family._load("ctrl_c:BAD", "entry point 'x'")


@pytest.mark.parametrize(("knob_line", "weight_line", "key", "with_what"), [
    ("block_size: int = knob(4, 'mine')", "bad_weight: float = knob(0.1, 'mine')", "drafter.block_size",
     "built-in drafter.block_size"),
    ("bad_knob: int = knob(1, 'mine')", "lr: float = knob(0.1, 'mine')", "train.lr", "built-in train.lr"),
])
def test_a_plugin_reusing_a_common_key_is_refused_at_registration(tmp_path, knob_line, weight_line, key, with_what):
    got = _dry_run(tmp_path, "colliding_plugin", PLUGIN.format(knob=knob_line, weight=weight_line))
    assert got.returncode == 2, (got.returncode, got.stderr)
    assert "drafter family 'bad' (from 'colliding_plugin:BAD' of DFLASHKIT_FAMILIES" in got.stderr, got.stderr
    assert f"{key} (Bad" in got.stderr
    assert with_what in got.stderr and "is a knob of" not in got.stderr  # the collision, not the false complaint
    assert "Traceback" not in got.stderr


def test_register_refuses_another_familys_field_and_keeps_shared_ones():
    @dataclasses.dataclass(frozen=True)
    class Clash(DFlashKnobs):
        selector_rank: int = knob(8, "a field of DFlash2's under the same name")

    @dataclasses.dataclass(frozen=True)
    class Redeclared(DFlashKnobs):
        causal: bool = knob(True, "DFlash's knob declared again, with another default")

    @dataclasses.dataclass(frozen=True)
    class Shares(DFlashKnobs):
        own_knob: int = knob(1, "a field of its own; causal is inherited from DFlash's class")

    def fam(knobs: type):
        return dataclasses.replace(DFLASH, name="plug", knobs=knobs,
                                   formats=dataclasses.replace(DFLASH.formats, architecture="PlugDraftModel"))

    with pytest.raises(UsageError, match=r"'plug': its knob drafter.selector_rank .*'dflash2' family's"):
        family.register(fam(Clash))
    with pytest.raises(UsageError, match=r"'plug': its knob drafter.causal .*'dflash' family's"):
        family.register(fam(Redeclared))
    with pytest.raises(UsageError, match="built-in train.lr"):
        @dataclasses.dataclass(frozen=True)
        class LrWeights:
            lr: float = knob(0.1, "the optimizer's key")
        family.register(dataclasses.replace(fam(Shares), weights=LrWeights))
    assert "plug" not in family.FAMILIES
    try:
        assert family.register(fam(Shares)) is family.FAMILIES["plug"]
    finally:
        family.FAMILIES.pop("plug", None)


def test_plugins_load_by_one_explicit_call_not_as_a_side_effect_of_an_import(tmp_path):
    """Importing the registry (and the config) registers no plugin; `family.load_plugins()` does, and the
    config loader then reads the plugin's flat keys into its own settings class."""
    (tmp_path / "quiet_plugin.py").write_text(textwrap.dedent(PLUGIN.format(
        knob="own_knob: int = knob(1, 'mine', ge=1)", weight="own_weight: float = knob(0.1, 'mine')")))
    code = textwrap.dedent("""
        from dflashkit import config, family
        assert "bad" not in family.FAMILIES
        family.load_plugins()
        assert "bad" in family.FAMILIES and family.PLUGIN_ERROR is None
        cfg = config.config_from_dict({"drafter": {"type": "bad", "own_knob": 3}, "train": {"own_weight": 0.5}})
        print(type(cfg.drafter.knobs).__name__, cfg.drafter.knobs.own_knob, cfg.train.weights.own_weight)
    """)
    env = {**os.environ, "DFLASHKIT_FAMILIES": "quiet_plugin:BAD",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    got = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert got.returncode == 0 and got.stdout.split() == ["BadKnobs", "3", "0.5"], (got.stdout, got.stderr)


def test_the_builtin_families_register_without_a_collision():
    assert family.names()[:3] == ["dflash", "dflash2", "lilicorr"] and family.PLUGIN_ERROR is None
    assert config.DrafterSection is not None and "block_size" in family.RESERVED["knobs"] and "lr" in family.RESERVED["weights"]
    assert all(family._collision(f) is None for f in family.FAMILIES.values())
