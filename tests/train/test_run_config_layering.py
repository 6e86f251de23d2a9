"""Below `train/loop.py` functions take the values they read: no module of `train/` but loop.py imports
`RunConfig` or names it in a parameter, return or field annotation (string annotations included)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import dflashkit.train

TRAIN = Path(dflashkit.train.__file__).parent
BELOW_LOOP = sorted(p for p in TRAIN.glob("*.py") if p.name != "loop.py")


def run_config_uses(source: str) -> list[str]:
    """`line: what` for each import of RunConfig and each annotation that mentions it in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and any(a.name == "RunConfig" for a in node.names):
            found.append(f"{node.lineno}: imports RunConfig")
        elif isinstance(node, ast.Import) and any(a.name.endswith("RunConfig") for a in node.names):
            found.append(f"{node.lineno}: imports RunConfig")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
                if arg is not None and arg.annotation is not None and "RunConfig" in ast.unparse(arg.annotation):
                    found.append(f"{node.lineno}: {node.name}({arg.arg}: {ast.unparse(arg.annotation)})")
            if node.returns is not None and "RunConfig" in ast.unparse(node.returns):
                found.append(f"{node.lineno}: {node.name} returns {ast.unparse(node.returns)}")
        elif isinstance(node, ast.AnnAssign) and "RunConfig" in ast.unparse(node.annotation):
            found.append(f"{node.lineno}: {ast.unparse(node.target)}: {ast.unparse(node.annotation)}")
    return found


def test_the_check_finds_each_way_of_taking_run_config():
    src = ("from dflashkit.config import RunConfig, TrainSection\n"
           "def f(cfg: RunConfig, *, other: 'RunConfig | None' = None) -> 'RunConfig': ...\n"
           "class T:\n    cfg: 'RunConfig'\n    train: TrainSection\n"
           "def g(train: TrainSection, seed: int) -> int: ...\n")
    assert [x.split(":")[0] for x in run_config_uses(src)] == ["1", "2", "2", "2", "4"]


@pytest.mark.parametrize("path", BELOW_LOOP, ids=lambda p: p.name)
def test_no_train_module_below_the_loop_takes_run_config(path):
    assert run_config_uses(path.read_text()) == []


def test_the_loop_is_where_run_config_is_taken():
    assert run_config_uses((TRAIN / "loop.py").read_text())  # the check reads the real modules
