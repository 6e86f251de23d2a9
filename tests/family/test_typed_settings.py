"""The run config is a static tree for the type checker: a misspelt `cfg.train.*`, `cfg.drafter.*` or family
setting is a mypy error (issue #51), and the spellings that exist pass.

One mypy run (the project's config, pyproject.toml) over a snippet written into tmp_path, with its cache there
too; MYPYPATH points at this checkout's src/ so the snippet reads the code under test. Each line that reads a
misspelt name must be reported, by its line number, and no line that reads a real one.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SNIPPET = """\
from dflashkit.config import RunConfig
from dflashkit.family import get
from dflashkit.family.dspark import DSparkKnobs, DSparkWeights
from dflashkit.family.knobs import settings


def good(cfg: RunConfig) -> None:
    print(cfg.train.lr, cfg.drafter.block_size, cfg.train.parallel.backend)
    print(settings(DSparkKnobs, cfg.drafter.knobs).dspark_markov_rank)
    print(settings(DSparkWeights, cfg.train.weights).dspark_markov_loss_weight)
    knobs: DSparkKnobs = get("dspark").own_knobs(cfg.drafter.knobs)
    print(knobs.causal)


def hook(w: DSparkWeights) -> float:
    return w.dspark_confidence_loss_weight


def bad(cfg: RunConfig, w: DSparkWeights) -> None:
    print(cfg.train.lrr)  # BAD
    print(cfg.drafter.blok_size)  # BAD
    print(cfg.train.parallel.backnd)  # BAD
    print(settings(DSparkKnobs, cfg.drafter.knobs).dspark_markov_rnk)  # BAD
    print(w.dspark_confidence_los_weight)  # BAD
    print(cfg.drafter.dspark_markov_rank)  # BAD: a family's knob is the family's settings, not a section field
    print(cfg.train.selector_loss_weight)  # BAD
"""


def test_mypy_reports_every_misspelt_setting_and_no_real_one(tmp_path):
    snippet = tmp_path / "snippet.py"
    snippet.write_text(SNIPPET)
    bad = {i for i, line in enumerate(SNIPPET.splitlines(), 1) if "# BAD" in line}
    env = {**os.environ, "MYPYPATH": str(ROOT / "src")}
    got = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                          "--cache-dir", str(tmp_path / "cache"), "--no-error-summary", str(snippet)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    errors = [m for m in (re.match(r".*snippet\.py:(\d+): error: (.*)", line) for line in got.stdout.splitlines()) if m]
    lines = {int(m.group(1)) for m in errors}
    assert lines == bad, (sorted(lines), sorted(bad), got.stdout, got.stderr)
    assert all("has no attribute" in m.group(2) for m in errors), got.stdout
    assert got.returncode == 1
