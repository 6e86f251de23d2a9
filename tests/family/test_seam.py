"""No drafter type test outside the family modules: the consumers ask the family (`contract.family`), never
compare a drafter's type, name an architecture or reach for a family's own modules.

The scan reads every module of src/dflashkit with `ast` and names file:line for each of:
  * an attribute or name `is_<family>` (`contract.is_dflash2`), or `getattr(x, "is_<family>", …)`;
  * a comparison (==, !=, in, not in) of a string that names a family with anything called `*type*`
    (`drafter_type == "dflash"`, `d.type != "dflash2"`, `kind in ("dflash", …)`);
  * a string constant equal to the name of a family other than the default one, or to any family's
    architecture (`"dflash2"`, `"DFlash2DraftModel"`): the family's facts, spelt out of place;
  * `candidate_selector` (attribute or string): DFlash2's selector, reached around its family;
  * `isinstance(x, <a family's network class>)`.
Allowed: the modules that define the registered families, the files that define their networks (the class
named its architecture; the default family's network is the base the others extend and stays scanned), and
files that are other programs' code: the remote-code `dflash.py` dflashkit ships (its text is part of the
checkpoint format). Both lists are read from the registry (`dflashkit.family.FAMILIES`): a new family
needs no entry here.
"""

from __future__ import annotations

import ast
from pathlib import Path

from dflashkit import family

SRC = Path(__file__).resolve().parents[2] / "src" / "dflashkit"
SHARED = {
    "family/__init__.py", "family/base.py",   # the registry and the records
    "export/dflash_modeling.py",              # the shipped remote-code file (`dflash.py` in every export)
}


def networks() -> set[str]:
    """The registered families' network classes (each named its architecture)."""
    return {f.architecture for f in family.FAMILIES.values()}


def _registered(path: Path, name: str) -> bool:
    """`name` in the module at `path` is a registered family."""
    import importlib

    rel = path.relative_to(SRC.parent).with_suffix("")
    module = importlib.import_module(".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts))
    fam = getattr(module, name, None)
    return isinstance(fam, family.Family) and family.FAMILIES.get(fam.name) is fam


def allowed() -> set[str]:
    """`SHARED`, the modules of src/dflashkit that define a registered family (`NAME = Family(...)`), and those
    that define a non-default family's network class."""
    out = set(SHARED)
    own = networks() - {family.DEFAULT.architecture}
    for path in SRC.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and node.name in own or (
                    isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                    and ast.unparse(node.value.func) == "Family" and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name) and _registered(path, node.targets[0].id)):
                out.add(path.relative_to(SRC).as_posix())
    return out


def _names() -> tuple[set[str], set[str]]:
    names = set(family.names())
    quoted = (names - {family.DEFAULT.name}) | {f.architecture for f in family.FAMILIES.values()}
    return names, quoted


def _typeish(node: ast.AST) -> bool:
    text = ast.unparse(node)
    return "type" in text.lower()


def type_tests(source: str, where: str) -> list[str]:
    """Each type test in `source` as `where:line: what`."""
    names, quoted = _names()
    out = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Attribute) and (node.attr.startswith("is_") and node.attr[3:] in names
                                                or node.attr == "candidate_selector"):
            out.append(f"{where}:{line}: .{node.attr}")
        elif isinstance(node, ast.Name) and node.id.startswith("is_") and node.id[3:] in names:
            out.append(f"{where}:{line}: {node.id}")
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            strings = [c for s in sides for c in ast.walk(s) if isinstance(c, ast.Constant) and c.value in names]
            if strings and any(_typeish(s) for s in sides if not isinstance(s, ast.Constant)):
                out.append(f"{where}:{line}: {ast.unparse(node)}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in quoted or node.value.startswith("is_") and node.value[3:] in names \
                    or "candidate_selector" in node.value and not node.value.strip().count(" "):
                out.append(f"{where}:{line}: {node.value!r}")
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "isinstance" and len(node.args) == 2:
            classes = {c.id if isinstance(c, ast.Name) else getattr(c, "attr", "") for c in ast.walk(node.args[1])}
            if classes & networks():
                out.append(f"{where}:{line}: {ast.unparse(node)}")
    return out


def test_no_drafter_type_test_outside_the_family_modules():
    found = []
    ok = allowed()
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel not in ok:
            found += type_tests(path.read_text(), f"src/dflashkit/{rel}")
    assert not found, "ask the drafter family (contract.family, dflashkit.family) instead:\n  " + "\n  ".join(found)


def test_every_allowed_file_exists():
    assert all((SRC / rel).is_file() for rel in SHARED), sorted(r for r in SHARED if not (SRC / r).is_file())


def test_the_allowed_files_and_networks_come_from_the_registry(monkeypatch):
    """Every built-in family's module and (but the default's) network file is allowed, and nothing else of
    theirs; a family registered later brings its network into the scan without an edit here."""
    from dataclasses import replace

    ok = allowed()
    for fam in family.BUILTIN:
        assert fam.architecture in networks()
        assert f"family/{fam.name}.py" in ok, fam.name
        assert (f"model/{fam.name}.py" in ok) == (fam is not family.DEFAULT), fam.name
    assert "model/drafter.py" not in ok and "decode/spec_decode.py" not in ok
    late = replace(family.DEFAULT, name="late", formats=replace(family.DEFAULT.formats, architecture="LateDraftModel"))
    monkeypatch.setitem(family.FAMILIES, "late", late)
    assert [x.split(": ", 1)[1] for x in type_tests("ok = isinstance(m, LateDraftModel)", "x.py")] == \
        ["isinstance(m, LateDraftModel)"]


def test_the_scan_finds_each_kind_of_type_test():
    planted = '''
if contract.is_dflash2: pass
flag = getattr(c, "is_dflash2", False)
if contract.drafter_type == "dflash": pass
if d.type != "dflash2": pass
if kind_type in ("dflash", "dflash2"): pass
arch = "DFlash2DraftModel"
sel = getattr(drafter, "candidate_selector", None)
scores = model.candidate_selector.pair_scores(a, b, c, d)
ok = isinstance(m, DFlash2DraftModel)
name = "dflash"                       # the default family's name alone: also vLLM's method name
msg = "a DFlash2DraftModel config"    # prose naming it is not a test
'''
    got = sorted(x.split(": ", 1)[1] for x in type_tests(planted, "x.py"))
    assert got == sorted([".is_dflash2", "'is_dflash2'", "contract.drafter_type == 'dflash'", "d.type != 'dflash2'",
                          "'dflash2'", "kind_type in ('dflash', 'dflash2')", "'dflash2'", "'DFlash2DraftModel'",
                          "'candidate_selector'", ".candidate_selector", "isinstance(m, DFlash2DraftModel)"]), got
    assert all(x.startswith("x.py:") for x in type_tests(planted, "x.py"))
