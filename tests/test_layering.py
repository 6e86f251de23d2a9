"""The library sits strictly below the stages and the CLI, and no two dflashkit modules import each other in a
circle (issue #12), not even for the type checker (issue #51). Imports are read with `ast` (function-level ones
included; type-only ones under `if TYPE_CHECKING:` where a check says so), so nothing is imported here.

Rooms and the rule (docs/architecture.md "Import map"):
    cli.py, __main__.py           may import anything
    stages/*                      may import the library, never cli.py; only the stages that compose
                                  others (pipeline: `run`, bench: `bench`) import another stage
    everything else (library)     never imports dflashkit.stages or dflashkit.cli
and the module-level graph (an edge A → B when A imports B anywhere in its file, type-only imports included)
has no cycle.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "dflashkit"

# Edges still to re-house (issue #12 remaining work); each one is named, so a new one fails.
ALLOWED_UPWARD: set[tuple[str, str]] = set()
ALLOWED_CYCLE_EDGES: set[tuple[str, str]] = set()


def _module_name(path: Path, src: Path = SRC) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(pkg: Path = PKG) -> dict[str, Path]:
    return {_module_name(p, pkg.parent): p for p in sorted(pkg.rglob("*.py"))}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The dflashkit module `name` refers to (a package's names resolve to its __init__)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _runtime_nodes(tree: ast.AST):
    """Every node of `tree` except the bodies of `if TYPE_CHECKING:` (type-only imports never run: a module may
    name a higher room's type in an annotation without depending on it)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING":
                stack.extend(child.orelse)
                continue
            stack.append(child)


def imports_of(mod: str, path: Path, modules: dict[str, Path], *, types: bool = False) -> set[str]:
    """Every dflashkit module `mod` imports, at any depth in the file (functions included; `types`: the
    type-only imports under `if TYPE_CHECKING:` too)."""
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in (ast.walk(tree) if types else _runtime_nodes(tree)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            # `from pkg import sub` imports the submodule pkg.sub when there is one, else pkg itself
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for n in names:
            if n == "dflashkit" or n.startswith("dflashkit."):
                target = _resolve(n, modules)
                if target and target != mod and target != "dflashkit":
                    out.add(target)
    return out


def module_graph(pkg: Path, types: bool = False) -> dict[str, set[str]]:
    """Module → the modules of the package at `pkg` it imports (`imports_of`)."""
    modules = _modules(pkg)
    return {m: imports_of(m, p, modules, types=types) for m, p in modules.items()}


@functools.cache  # parsed once per test process; the checks only read the graph
def import_graph(types: bool = False) -> dict[str, set[str]]:
    return module_graph(PKG, types)


def _is_upper(mod: str) -> bool:
    return mod in ("dflashkit.cli", "dflashkit.__main__") or mod.startswith("dflashkit.stages")


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    bad = []
    for src, targets in graph.items():
        for dst in targets:
            if src in ("dflashkit.cli", "dflashkit.__main__"):
                continue
            if dst == "dflashkit.cli" or (dst.startswith("dflashkit.stages") and not _is_upper(src)):
                bad.append((src, dst))
    return sorted(e for e in bad if e not in ALLOWED_UPWARD)


COMPOSERS = frozenset({"dflashkit.stages.pipeline", "dflashkit.stages.bench"})


def stage_to_stage_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """A stage that imports another (share the code through the library instead), composers aside."""
    return sorted((a, b) for a, targets in graph.items() for b in targets
                  if a.startswith("dflashkit.stages.") and b.startswith("dflashkit.stages.") and a not in COMPOSERS)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path [a, b, ..., a], or None (iterative DFS, edges in ALLOWED_CYCLE_EDGES skipped)."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = dict.fromkeys(graph, WHITE)
    for root in sorted(graph):
        if color[root] != WHITE:
            continue
        stack = [(root, iter(sorted(graph[root])))]
        path = [root]
        color[root] = GREY
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                color[node] = BLACK
                stack.pop()
                path.pop()
                continue
            if (node, nxt) in ALLOWED_CYCLE_EDGES or nxt not in graph:
                continue
            if color[nxt] == GREY:
                return path[path.index(nxt):] + [nxt]
            if color[nxt] == WHITE:
                color[nxt] = GREY
                stack.append((nxt, iter(sorted(graph[nxt]))))
                path.append(nxt)
    return None


def test_library_never_imports_stages_or_cli():
    bad = upward_imports(import_graph())
    assert not bad, "library → stages/cli imports (move the shared code down into the library):\n" + "\n".join(
        f"  {a} → {b}" for a, b in bad)


def test_stages_share_code_through_the_library():
    bad = stage_to_stage_imports(import_graph())
    assert not bad, "stage → stage imports:\n" + "\n".join(f"  {a} → {b}" for a, b in bad)


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " → ".join(cycle or [])


TOP_ROOMS = ("dflashkit.bench", "dflashkit.testing", "dflashkit.gpucheck")  # only stages, tests, each other
APART = (("dflashkit.generate", "dflashkit.serving"), ("dflashkit.serving", "dflashkit.generate"))


def _in(mod: str, room: str) -> bool:
    return mod == room or mod.startswith(room + ".")


def room_violations(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Library → bench/testing imports, and generate (the client) ↔ serving (the server) imports."""
    bad = []
    for src, targets in graph.items():
        if _is_upper(src):
            continue
        for dst in targets:
            top = any(_in(dst, r) for r in TOP_ROOMS) and not any(_in(src, r) for r in TOP_ROOMS)
            if top or any(_in(src, a) and _in(dst, b) for a, b in APART):
                bad.append((src, dst))
    return sorted(bad)


def test_library_rooms_point_one_way():
    bad = room_violations(import_graph())
    assert not bad, "imports against the room order (docs/architecture.md):\n" + "\n".join(
        f"  {a} → {b}" for a, b in bad)
    planted = {"dflashkit.data.x": {"dflashkit.testing.faults"}, "dflashkit.generate.y": {"dflashkit.serving.z"},
               "dflashkit.bench.w": {"dflashkit.testing"}, "dflashkit.stages.v": {"dflashkit.bench.w"}}
    assert room_violations(planted) == [("dflashkit.data.x", "dflashkit.testing.faults"),
                                        ("dflashkit.generate.y", "dflashkit.serving.z")]


# The library's rooms, lowest first: a module imports only its own room or rooms ranked at or below
# its own (issue #20: target/load.py → inspect/ and assets.py → target/tiny ran up). Rooms of one
# rank may import each other (the cycle test still holds), top-level modules are their own room.
# The config holds the drafter families' settings (their knobs and weights dataclasses, mapped from flat keys by
# the registry), so it ranks above them; the families rank above the networks they build.
RANKS: dict[str, float] = {
    "dflashkit": 0, "dflashkit.errors": 0, "dflashkit.http1": 0,
    "dflashkit.rundir": 0, "dflashkit.context": 0, "dflashkit.progress": 0, "dflashkit.redact": 0,
    "dflashkit.textfile": 0, "dflashkit.config_hash": 0, "dflashkit.timing": 0,
    "dflashkit.assets": 1,
    "dflashkit.target": 2,
    "dflashkit.model": 2.2,  # the drafter networks: their target-path labels read the target's cache keyword
    "dflashkit.family": 2.5,
    "dflashkit.config": 2.7,
    "dflashkit.stage_table": 2.8,  # its section readers read the config (the run dir does not read the table)
    "dflashkit.inspect": 3,
    "dflashkit.data": 4,
    "dflashkit.train": 5, "dflashkit.export": 5, "dflashkit.generate": 5,
    "dflashkit.decode": 6, "dflashkit.report": 6, "dflashkit.sizing": 6,
    "dflashkit.serving": 7, "dflashkit.flywheel": 7,
    "dflashkit.engines": 8, "dflashkit.serve_app": 8, "dflashkit.doctor": 8,
    "dflashkit.bench": 9, "dflashkit.testing": 9, "dflashkit.gpucheck": 9,
}


def room_of(mod: str) -> str:
    parts = mod.split(".")
    return ".".join(parts[:2])


def rank_violations(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports from a library room to a room ranked above it (modules of no ranked room: not checked)."""
    bad = []
    for src, targets in graph.items():
        if _is_upper(src) or room_of(src) not in RANKS:
            continue
        for dst in targets:
            if room_of(dst) in RANKS and RANKS[room_of(dst)] > RANKS[room_of(src)]:
                bad.append((src, dst))
    return sorted(bad)


def test_every_library_room_has_a_rank():
    rooms = {room_of(m) for m in import_graph() if not _is_upper(m)}
    assert rooms <= set(RANKS), f"rank these rooms in RANKS: {sorted(rooms - set(RANKS))}"


def test_no_import_runs_up_the_room_ranks():
    bad = rank_violations(import_graph())
    assert not bad, "imports up the room ranks (move the shared code down, or pass it in):\n" + "\n".join(
        f"  {a} → {b}" for a, b in bad)
    planted = {"dflashkit.target.load": {"dflashkit.inspect.target", "dflashkit.errors"},
               "dflashkit.assets": {"dflashkit.target.tiny"}, "dflashkit.inspect.contract": {"dflashkit.model.x"}}
    assert rank_violations(planted) == [("dflashkit.assets", "dflashkit.target.tiny"),
                                        ("dflashkit.target.load", "dflashkit.inspect.target")]


def test_checker_catches_a_cycle_and_an_upward_import(tmp_path):
    """The checks can fail: a planted cycle and a planted upward import are reported."""
    graph = {"dflashkit.a": {"dflashkit.b"}, "dflashkit.b": {"dflashkit.c"}, "dflashkit.c": {"dflashkit.a"},
             "dflashkit.stages.x": {"dflashkit.cli"}, "dflashkit.data.y": {"dflashkit.stages.x"}}
    assert find_cycle(graph) == ["dflashkit.a", "dflashkit.b", "dflashkit.c", "dflashkit.a"]
    assert upward_imports(graph) == [("dflashkit.data.y", "dflashkit.stages.x"), ("dflashkit.stages.x", "dflashkit.cli")]
    graph["dflashkit.stages.plan"] = {"dflashkit.stages.probe"}
    graph["dflashkit.stages.pipeline"] = {"dflashkit.stages.probe"}
    assert stage_to_stage_imports(graph) == [("dflashkit.stages.plan", "dflashkit.stages.probe")]


@pytest.mark.parametrize("source,expected", [
    ("def f():\n    from dflashkit.stages import probe\n", {"dflashkit.stages.probe"}),
    ("from .config_facts import x\n", {"dflashkit.inspect.config_facts"}),
    ("import dflashkit.cli as c\n", {"dflashkit.cli"}),
])
def test_imports_are_read_at_any_depth(tmp_path, source, expected):
    p = tmp_path / "m.py"
    p.write_text(source)
    modules = {"dflashkit.stages.probe": p, "dflashkit.inspect.config_facts": p, "dflashkit.cli": p,
               "dflashkit.inspect.m": p}
    assert imports_of("dflashkit.inspect.m", p, modules) == expected


STAGE_MAX_LINES = 150  # issue #20: a stage is glue (parse config → call the library → write → summary)


def long_stages(limit: int = STAGE_MAX_LINES, folder: Path = PKG / "stages") -> list[tuple[str, int]]:
    """The stage modules longer than `limit` lines, with their line counts."""
    counts = ((p.name, len(p.read_text().splitlines())) for p in sorted(folder.glob("*.py")))
    return [(name, n) for name, n in counts if n > limit]


def test_stages_are_glue_of_at_most_150_lines(tmp_path):
    bad = long_stages()
    assert not bad, (f"stages over {STAGE_MAX_LINES} lines (move the logic into the library):\n"
                     + "\n".join(f"  stages/{name}: {n} lines" for name, n in bad))
    (tmp_path / "long.py").write_text("x = 1\n" * (STAGE_MAX_LINES + 1))
    (tmp_path / "short.py").write_text("x = 1\n" * STAGE_MAX_LINES)
    assert long_stages(folder=tmp_path) == [("long.py", STAGE_MAX_LINES + 1)]


def room_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The package-level graph of `graph`: an edge between two rooms (`room_of`) when a module of one imports a
    module of the other."""
    out: dict[str, set[str]] = {}
    for src, targets in graph.items():
        out.setdefault(room_of(src), set()).update(room_of(t) for t in targets if room_of(t) != room_of(src))
    return out


# Type-only imports up the room ranks still to re-house, each named so that a new one fails.
TYPE_ONLY_UPWARD: set[tuple[str, str]] = set()


def test_no_room_cycle_even_through_type_only_imports():
    """Issue #51: the rooms form no circle for the type checker either. A type named under `if TYPE_CHECKING:`
    is still a dependency of the code that reads it: the config, the drafter families and the networks were a
    13-file circle that way (hooks typed by config sections, the networks by the families' contract)."""
    graph = import_graph(types=True)
    bad = [e for e in rank_violations(graph) if e not in TYPE_ONLY_UPWARD]
    assert not bad, "type-only imports up the room ranks (declare a Protocol in the lower room instead):\n" + \
        "\n".join(f"  {a} → {b}" for a, b in bad)
    rooms = room_graph({a: {b for b in targets if (a, b) not in TYPE_ONLY_UPWARD} for a, targets in graph.items()})
    cycle = find_cycle(rooms)
    assert cycle is None, "room cycle through type-only imports: " + " → ".join(cycle or [])
    triangle = ("dflashkit.config", "dflashkit.family", "dflashkit.model")
    room = room_graph(graph)  # the three rooms among themselves: no exception at all
    assert find_cycle({r: room.get(r, set()) & set(triangle) for r in triangle}) is None
    assert "dflashkit.family" not in room["dflashkit.model"] and "dflashkit.config" not in room["dflashkit.family"]
    planted = {"dflashkit.config.schema": {"dflashkit.family.base"}, "dflashkit.family.base": {"dflashkit.model.x"},
               "dflashkit.model.x": {"dflashkit.config.schema"}}
    assert find_cycle(room_graph(planted)) == ["dflashkit.config", "dflashkit.family", "dflashkit.model",
                                               "dflashkit.config"]


def test_no_module_cycle_even_through_type_only_imports():
    """Issue #51: no circle among the modules either, counting every import the type checker follows (module
    level, inside functions, under `if TYPE_CHECKING:`). The families' hooks once named the contract's class
    while the contract asked the registry, which imports the families: a family names what it reads of a
    contract as a Protocol (`family/base.py` ContractSpec) instead."""
    cycle = find_cycle(import_graph(types=True))
    assert cycle is None, ("module import cycle, type-only imports included (declare a Protocol in the lower "
                           "module, or hand the value in):\n  " + " → ".join(cycle or []))


def test_module_cycle_check_reads_a_package_as_python_does(tmp_path):
    """The check above can fail: a circle closed by a type-only import, through a function-level import and a
    `from . import x` of a submodule, is found in a package written here (and only with the type-only imports)."""
    pkg = tmp_path / "dflashkit"
    (pkg / "fam").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "fam" / "__init__.py").write_text("from . import one\n")
    (pkg / "fam" / "one.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                                        "    from dflashkit.fam.contract import C\n")
    (pkg / "fam" / "contract.py").write_text("class C:\n    def family(self):\n"
                                             "        from dflashkit import fam\n        return fam\n")
    assert find_cycle(module_graph(pkg, types=True)) == ["dflashkit.fam", "dflashkit.fam.one",
                                                         "dflashkit.fam.contract", "dflashkit.fam"]
    assert find_cycle(module_graph(pkg)) is None


def test_type_only_imports_are_read_when_asked(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dflashkit.config import X\n")
    modules = {"dflashkit.config": p, "dflashkit.model.m": p}
    assert imports_of("dflashkit.model.m", p, modules) == set()
    assert imports_of("dflashkit.model.m", p, modules, types=True) == {"dflashkit.config"}


# Measurement in one room (issue #51): the step timer is read by `sizing/` (calibration, the roofline, step
# costs), the benchmarks that call it, and the decoder's own t(n) for the adaptive draft length — nothing else.
TIMER_READERS = ("dflashkit.sizing", "dflashkit.bench", "dflashkit.decode.spec_decode")


def timer_outsiders(graph: dict[str, set[str]]) -> list[str]:
    return sorted(m for m, targets in graph.items() if "dflashkit.timing" in targets
                  and not any(_in(m, r) for r in TIMER_READERS))


def test_measurement_lives_in_sizing():
    assert timer_outsiders(import_graph()) == []
    assert any(_in(m, "dflashkit.sizing") for m, t in import_graph().items() if "dflashkit.timing" in t)
    assert timer_outsiders({"dflashkit.train.x": {"dflashkit.timing"}}) == ["dflashkit.train.x"]
