"""One owner per on-disk artifact (issue #20), read from the source with `ast` (nothing is imported):

- run-dir paths are named through `RunDir`'s typed properties: no module but `rundir.py` joins
  `<rd>.root / "<stage>"` or `stage_dir("<stage>") / "<file>"` by hand;
- each format's writer and reader are defined once, in its owner module, and only the owners import
  the format's library (pyarrow for Parquet shards, safetensors for tensor files);
- the feature shards' metadata keys are spelled only in their owner;
- every stage's manifest `config_hash` is the stage table's `stage_hash` (report's is empty: it reads no config);
- each format's `RunDir` property and file name are spelled only in `rundir.py`, its owner and the stages, and a
  stage never hands them to a generic reader or writer (`read_json`, `atomic_write_json`, `open`, `.read_text`, ...):
  it passes the path to the owner, or prints it. Docstrings do not count.
"""

from __future__ import annotations

import ast
import functools
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
    "prepared conversations": ("dflashkit.data.records", {"write_prepared", "read_prepared", "prepared_file",
                                                          "iter_conversations", "prepared_lines",
                                                          "heldout_user_prompts"}),
    "generate journal": ("dflashkit.generate.journal", {"Journal", "read_records"}),
    "regenerated conversations": ("dflashkit.generate.conversations", {"write_conversations", "write_failures",
                                                                       "write_settings", "read_settings",
                                                                       "regenerated_file"}),
    "checkpoints, train/final, train/best": ("dflashkit.train.checkpoint", {"save_checkpoint", "load_checkpoint",
                                                                             "save_final", "read_best",
                                                                             "trained_drafter_dir"}),
    "eval results": ("dflashkit.decode.evaluation", {"write_eval_results", "read_eval_results"}),
    "engine results": ("dflashkit.engines.verify", {"write_engine_results", "read_engine_results"}),
    "training metrics and curve": ("dflashkit.train.logging", {"MetricSink", "LearningCurve", "read_metrics",
                                                               "read_curve"}),
    "bench results": ("dflashkit.bench.results", {"write_bench_result", "read_bench_result"}),
    "speculation profile": ("dflashkit.export.profile", {"write_profile", "read_profile"}),
    "recorded traffic": ("dflashkit.serving.record", {"Recorder", "read_recorded", "read_features", "segments",
                                                      "complete_lines"}),
}
# format → (its owner module, its `RunDir` properties, its file names); only rundir.py, the owner and the stages
# may name them, and a stage only to pass them to the owner or print them. (train/final and train/best are
# drafter dirs every loader may name; their record file best.json is the checkpoint module's.)
FORMAT_PATHS = {
    "prepared conversations": ("dflashkit.data.records", {"prepared_train", "prepared_heldout"},
                               {"train.jsonl", "heldout.jsonl"}),
    "regenerated conversations": ("dflashkit.generate.conversations", {"conversations_path", "generate_failures"},
                                  {"conversations.jsonl", "failures.jsonl", "settings.json"}),
    "checkpoints, train/best": ("dflashkit.train.checkpoint", {"checkpoints_dir", "checkpoint_dir"}, {"best.json"}),
    "eval results": ("dflashkit.decode.evaluation", {"eval_results"}, {"results.json"}),
    "engine results": ("dflashkit.engines.verify", {"verify_engine_results"}, {"results.json"}),
    "training metrics and curve": ("dflashkit.train.logging", {"train_metrics", "train_curve"},
                                   {"metrics.jsonl", "curve.json"}),
    "bench results": ("dflashkit.bench.results", {"bench_result"}, set()),
    "speculation profile": ("dflashkit.export.profile", {"eval_profile", "verify_engine_profile"},
                            {"speculation_profile.json"}),
}
# what reads or writes any file: a stage never hands one of these a format's path
GENERIC_IO = {"read_json", "read_json_or_none", "read_jsonl", "read_jsonl_rows", "atomic_write_json",
              "atomic_write_text", "atomic_write_bytes", "atomic_path", "write_jsonl", "open", "open_text",
              "read_text", "write_text", "read_bytes", "write_bytes", "load", "loads"}
# a format library → the modules that may import it (each owns the files it reads/writes with it)
LIBRARY_USERS = {
    "pyarrow": {"dflashkit.data.shards",            # tokenized shards
                "dflashkit.data.sources"},          # the user's Parquet data sources (input only)
    "safetensors": {"dflashkit.data.features",      # feature shards
                    "dflashkit.train.checkpoint",   # checkpoints, train/final, train/best
                    "dflashkit.export.hf",          # export/ (z-lab)
                    "dflashkit.export.speculators",  # export/ (vLLM speculators)
                    "dflashkit.engines.capture",        # capture/engine-spool/<row>.safetensors (writer + reader)
                    "dflashkit.engines.hidden_states",  # vLLM's extract_hidden_states files (connector + reader)
                    "dflashkit.target.head",             # reads the target's own weights by name (not a run-dir file)
                    "dflashkit.serving.record"},        # recorded traffic's features (writer + reader)
}
FEATURE_META_KEYS = {"source_digest"}  # the key that says which tokenized shard a feature shard was made from


@functools.cache  # parsed once per test process; the checks only read the trees
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


def _docstrings(tree: ast.Module) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body and \
                isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            out.add(id(body[0].value))
    return out


def format_path_misuse(trees: dict[str, ast.Module]) -> list[str]:
    """Where a format's `RunDir` property or file name is named outside rundir.py, its owner and the stages,
    or in a stage as (part of) the argument or receiver of a generic reader/writer."""
    allowed: dict[str, set[str]] = {}  # property or file name → the owners that may name it
    for owner, props, names in FORMAT_PATHS.values():
        for key in props | names:
            allowed.setdefault(key, set()).add(owner)

    def key_of(node: ast.AST, docs: set[int]) -> str | None:
        if isinstance(node, ast.Attribute) and node.attr in allowed and \
                any(node.attr in props for _, props, _ in FORMAT_PATHS.values()):
            return node.attr
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in allowed \
                and id(node) not in docs:
            return node.value
        return None

    bad = []
    for mod, tree in trees.items():
        if mod == "dflashkit.rundir":
            continue
        docs = _docstrings(tree)
        if not mod.startswith("dflashkit.stages."):
            bad += [f"{mod}:{n.lineno}: {k}" for n in ast.walk(tree)
                    if (k := key_of(n, docs)) is not None and mod not in allowed[k]]
            continue
        for call in ast.walk(tree):
            if not isinstance(call, ast.Call):
                continue
            f = call.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name not in GENERIC_IO:
                continue
            parts = [*call.args, *(kw.value for kw in call.keywords)] + ([f.value] if isinstance(f, ast.Attribute)
                                                                         else [])
            bad += [f"{mod}:{n.lineno}: {k} given to {name}" for p in parts for n in ast.walk(p)
                    if (k := key_of(n, docs)) is not None]
    return sorted(set(bad))


def test_run_dir_paths_are_typed():
    bad = hand_spelled_paths(_modules())
    assert not bad, "run-dir paths spelled by hand (use a RunDir property):\n  " + "\n  ".join(bad)


def test_each_format_has_one_writer_and_one_reader_in_its_owner():
    trees = _modules()
    for fmt, (owner, names) in OWNERS.items():
        for name, mods in definitions(trees, names).items():
            assert mods == [owner], f"{fmt}: {name} is defined in {mods}, expected only in {owner}"


def test_format_paths_are_named_by_their_owners_and_passed_on_by_the_stages():
    trees = _modules()
    bad = format_path_misuse(trees)
    assert not bad, "a format's path named outside its owner (read/write it through the owner):\n  " + \
        "\n  ".join(bad)
    for fmt, (owner, props, names) in FORMAT_PATHS.items():  # the scan sees each owner's own uses
        tree = trees[owner]
        docs = _docstrings(tree)
        assert any(isinstance(n, ast.Attribute) and n.attr in props or isinstance(n, ast.Constant)
                   and n.value in names and id(n) not in docs for n in ast.walk(tree)), f"{fmt}: {owner}"


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
    misused = {
        "dflashkit.report.z": ast.parse('"""curve.json"""\ndef f(rd):\n    "results.json"\n    return rd.eval_results\n'
                                        'x = {"curve.json": 1}\n'),
        "dflashkit.stages.w": ast.parse('atomic_write_json(out / "results.json", res)\nread_json_or_none(rd.train_curve)\n'
                                        'rd.eval_results.read_text()\nprint(rd.eval_results)\n'
                                        'write_manifest(out, outputs=["results.json"])\n'
                                        'write_eval_results(rd, res)\nopen(rd.bench_result("serve"))\n'),
        "dflashkit.decode.evaluation": ast.parse('p = rd.eval_results\nq = "results.json"\n'),  # the owner
    }
    assert format_path_misuse(misused) == [
        "dflashkit.report.z:4: eval_results", "dflashkit.report.z:5: curve.json",
        "dflashkit.stages.w:1: results.json given to atomic_write_json",
        "dflashkit.stages.w:2: train_curve given to read_json_or_none",
        "dflashkit.stages.w:3: eval_results given to read_text",
        "dflashkit.stages.w:7: bench_result given to open"]
