"""One owner per on-disk artifact (issue #20), read from the source with `ast` (nothing is imported):

- run-dir paths are named through `RunDir`'s typed properties: no module but `rundir.py` joins
  `<rd>.root / "<stage>"` or `stage_dir("<stage>") / "<file>"` by hand;
- each format's writer and reader are defined once, in its owner module, and only the owners import
  the format's library (pyarrow for Parquet shards, safetensors for tensor files);
- the feature shards' metadata keys are spelled only in their owner;
- every stage's manifest `config_hash` is the stage table's `stage_hash` (report's is empty: it reads no config).
"""

from __future__ import annotations

import ast
from pathlib import Path

from dflashkit.stage_table import TABLE

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "dflashkit"
RUN_DIR_NAMES = {s.name for s in TABLE} | {"capture", "eval", "probe", "prepare", "tokenize", "train", "export",
                                           "bench", "report", "generate", "verify-engine"}

# format → (its owner module, the functions/classes that are its writer and reader there)
OWNERS = {
    "tokenized shards": ("dflashkit.data.shards", {"write_parquet_shard", "load_tokenized"}),
    "feature shards": ("dflashkit.data.features", {"write_shard", "FeatureStore", "shard_matches"}),
}
# a format library → the modules that may import it (each owns the files it reads/writes with it)
LIBRARY_USERS = {
    "pyarrow": {"dflashkit.data.shards",            # tokenized shards
                "dflashkit.data.sources"},          # the user's Parquet data sources (input only)
    "safetensors": {"dflashkit.data.features",      # feature shards
                    "dflashkit.train.checkpoint",   # checkpoints, train/final, train/best
                    "dflashkit.export.hf",          # export/ (z-lab)
                    "dflashkit.export.speculators",  # export/ (vLLM speculators)
                    # a scratch exchange with a script run in the vLLM venv (no run-dir artifact; the
                    # script cannot import dflashkit): inputs.safetensors / outputs.safetensors
                    "dflashkit.engines.vllm_pieces", "dflashkit.engines.vllm_dflash2_reference",
                    "dflashkit.engines.capture",        # capture/engine-spool/<row>.safetensors (writer + reader)
                    "dflashkit.engines.hidden_states",  # vLLM's extract_hidden_states files (connector + reader)
                    "dflashkit.testing.fake_engine",    # test gear standing in for that connector
                    "dflashkit.model.head"},            # reads the target's own weights by name (not a run-dir file)
}
FEATURE_META_KEYS = {"source_digest"}  # the key that says which tokenized shard a feature shard was made from


def _modules() -> dict[str, ast.Module]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = list(p.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = ast.parse(p.read_text(), filename=str(p))
    return out


def hand_spelled_paths(trees: dict[str, ast.Module]) -> list[str]:
    """`x.root / "<stage>"` and `x.stage_dir("<stage>") / "..."` joins outside rundir.py."""
    bad = []
    for mod, tree in trees.items():
        if mod == "dflashkit.rundir":
            continue
        for node in ast.walk(tree):
            if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)):
                continue
            left, right = node.left, node.right
            if isinstance(left, ast.Call):  # Path(rd.root) / "x"
                left = left.args[0] if left.args else left
            root_join = (isinstance(left, ast.Attribute) and left.attr == "root" and isinstance(right, ast.Constant)
                         and right.value in RUN_DIR_NAMES)
            stage_join = (isinstance(node.left, ast.Call) and isinstance(node.left.func, ast.Attribute)
                          and node.left.func.attr == "stage_dir")
            if root_join or stage_join:
                bad.append((mod, node.lineno))
    return [f"{m}:{n}" for m, n in sorted(set(bad))]


def definitions(trees: dict[str, ast.Module], names: set[str]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {n: [] for n in names}
    for mod, tree in trees.items():
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names:
                found[node.name].append(mod)
    return found


def library_importers(trees: dict[str, ast.Module], lib: str) -> set[str]:
    out = set()
    for mod, tree in trees.items():
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n == lib or n.startswith(lib + ".") for n in names):
                out.add(mod)
    return out


def string_users(trees: dict[str, ast.Module], values: set[str]) -> set[str]:
    return {mod for mod, tree in trees.items() for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in values}


def test_run_dir_paths_are_typed():
    bad = hand_spelled_paths(_modules())
    assert not bad, "run-dir paths spelled by hand (use a RunDir property):\n  " + "\n  ".join(bad)


def test_each_format_has_one_writer_and_one_reader_in_its_owner():
    trees = _modules()
    for fmt, (owner, names) in OWNERS.items():
        for name, mods in definitions(trees, names).items():
            assert mods == [owner], f"{fmt}: {name} is defined in {mods}, expected only in {owner}"


def test_only_owners_import_the_format_libraries():
    trees = _modules()
    for lib, allowed in LIBRARY_USERS.items():
        extra = library_importers(trees, lib) - allowed
        assert not extra, f"{lib} is imported by {sorted(extra)}: read/write through the owner module"


def test_feature_shard_metadata_is_spelled_by_its_owner_only():
    assert string_users(_modules(), FEATURE_META_KEYS) == {"dflashkit.data.features"}


def manifest_hashes_not_from_the_table(trees: dict[str, ast.Module]) -> list[str]:
    """`write_manifest(..., config_hash=X)` calls whose X is not `stage_hash(...)` (or ""). A library function
    may pass on a `config_hash` parameter (export/speculators.py: its stage gives it `stage_hash("export", cfg)`)."""
    bad = []
    for mod, tree in trees.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "write_manifest"):
                continue
            for kw in node.keywords:
                v = kw.value
                ok = (isinstance(v, ast.Call) and getattr(v.func, "id", None) == "stage_hash") or \
                    (isinstance(v, ast.Constant) and v.value == "") or \
                    (isinstance(v, ast.Name) and not mod.startswith("dflashkit.stages."))
                if kw.arg == "config_hash" and not ok:
                    bad.append(f"{mod}:{node.lineno}")
    return bad


def test_manifest_hashes_come_from_the_stage_table():
    trees = _modules()
    bad = manifest_hashes_not_from_the_table(trees)
    assert not bad, "manifest config_hash not from stage_table.stage_hash:\n  " + "\n  ".join(bad)
    assert sum(isinstance(n, ast.Call) and getattr(n.func, "id", None) == "write_manifest"
               for t in trees.values() for n in ast.walk(t)) >= 10  # the scan sees the stages' calls


def test_the_checks_can_fail():
    planted = {
        "dflashkit.x": ast.parse('p = rd.root / "train" / "best"\nq = rd.stage_dir("eval") / "results.json"\n'
                                 'r = Path(rd.root) / "export"\nfrom safetensors import safe_open\n'
                                 'def write_shard(): pass\nm = {"source_digest": 1}\n'),
    }
    assert hand_spelled_paths(planted) == ["dflashkit.x:1", "dflashkit.x:2", "dflashkit.x:3"]
    assert library_importers(planted, "safetensors") == {"dflashkit.x"}
    assert definitions(planted, {"write_shard"}) == {"write_shard": ["dflashkit.x"]}
    assert string_users(planted, FEATURE_META_KEYS) == {"dflashkit.x"}
    hashed = {"dflashkit.stages.y": ast.parse('write_manifest(d, stage="eval", config_hash=section_hash(cfg.eval))\n'
                                       'write_manifest(d, stage="eval", config_hash=stage_hash("eval", cfg))\n'
                                       'write_manifest(d, stage="eval", config_hash=h)\n')}
    assert manifest_hashes_not_from_the_table(hashed) == ["dflashkit.stages.y:1", "dflashkit.stages.y:3"]
