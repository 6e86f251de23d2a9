"""Issue #21's bad-input and kill sweep: nothing lost, nothing silently ignored.

Table-driven like `test_bad_inputs.py`: each case builds its input in a fresh tmp dir (`user/` = the
user's files, `run/` = a run dir holding a contract and tokenized shards for the tiny target) and
asserts the exit code, that stderr names the key/file at fault, no traceback, and that `user/` and
`run/` are byte-for-byte unchanged. The cases that need more than one command (train then resume,
import then train, disk full, SIGTERM) are functions below the table.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from dflashkit.cli import main
from dflashkit.rundir import RunDir
from tests.helpers import make_run, overrides

CONV = {"id": "0000000000000001", "source": "t",
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


@dataclass
class W:
    root: Path
    target: Path
    drafter: Path

    @property
    def user(self) -> Path:
        return self.root / "user"

    @property
    def run(self) -> Path:
        return self.root / "run"

    def file(self, name: str, data: bytes | str) -> Path:
        p = self.user / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data if isinstance(data, bytes) else data.encode())
        return p

    def train(self, *extra: str) -> list[str]:
        return ["train", *overrides(self.run, self.target, train__max_steps=1), *extra]

    def generated(self, failed: bool = False) -> list[str]:
        """generate's outputs in run/ (one conversation, or none with a manifest counting 1 failed turn)."""
        g = self.run / "generate"
        g.mkdir(parents=True, exist_ok=True)
        (g / "conversations.jsonl").write_text("" if failed else json.dumps(CONV) + "\n")
        if failed:
            (g / "manifest.json").write_text(json.dumps({"stage": "generate", "counts": {
                "turns_total": 1, "turns_failed": 1}}))
        return [f"run.run_dir={self.run}", f"target.path={self.target}", "tokenize.agreement_samples=0"]

    def target_with(self, **config) -> Path:
        """A copy of the tiny target whose config.json has `config` merged in (None deletes a key)."""
        dest = self.user / "target"
        shutil.copytree(self.target, dest)
        cfg = json.loads((dest / "config.json").read_text())
        for k, v in config.items():
            if v is None:
                cfg.pop(k, None)
            else:
                cfg[k] = v
        (dest / "config.json").write_text(json.dumps(cfg))
        return dest

    def drafter_with(self, **dflash_config) -> Path:
        """A copy of the drafter whose config.json `dflash_config` has these keys merged in."""
        dest = self.user / "drafter"
        shutil.copytree(self.drafter, dest)
        cfg = json.loads((dest / "config.json").read_text())
        cfg["dflash_config"].update(dflash_config)
        (dest / "config.json").write_text(json.dumps(cfg))
        return dest

    def int8_drafter(self) -> Path:
        """A copy of the drafter whose weight tensors are stored as int8 (as a quantized checkpoint)."""
        import torch
        from safetensors.torch import load_file, save_file

        dest = self.user / "drafter8"
        shutil.copytree(self.drafter, dest)
        state = load_file(str(dest / "model.safetensors"))
        save_file({k: (v * 64).round().clamp(-128, 127).to(torch.int8) if v.is_floating_point() else v
                   for k, v in state.items()}, str(dest / "model.safetensors"))
        return dest


@dataclass
class Case:
    id: str
    argv: Callable[[W], list[str]]
    code: int
    needles: Callable[[W], list[str]] | list[str]
    absent: tuple[str, ...] = ()  # strings that must not appear in stdout/stderr


def _variants(text: str) -> str:
    return f"bench.recipe_variants={text}"


CASES: list[Case] = [
    # finding 2: drafter.* values that differ from the probed contract are named, not ignored
    Case("f2-block-size", lambda w: w.train("drafter.block_size=8"), 2,
         lambda w: ["drafter.block_size: 8 in the config, 4 in", f"{w.run}/contract.json", "dflashkit probe"]),
    Case("f2-num-draft-layers", lambda w: w.train("drafter.num_draft_layers=3"), 2,
         ["drafter.num_draft_layers: 3 in the config, 1 in"]),
    Case("f2-layer-ids", lambda w: w.train("drafter.target_layer_ids=[0,2]"), 2,
         ["drafter.target_layer_ids: [0, 2] in the config, [1, 3] in"]),
    Case("f2-all-at-once", lambda w: w.train("drafter.block_size=8", "drafter.mask_token_id=7"), 2,
         ["2 config errors", "drafter.block_size", "drafter.mask_token_id: 7 in the config, 300 in"]),
    # (a variant that changes the drafter's shape, e.g. drafter.block_size, trains under its own contract:
    # tests/cli/test_ablation.py; a key the contract fixes otherwise is named)
    Case("f2-bench-recipe-variant", lambda w: ["bench", "recipe", *overrides(w.run, w.target),
                                               "bench.recipe_steps=1", _variants("{a: [], b: [drafter.mask_token_id=7]}")],
         2, ["bench.recipe_variants.b: drafter.mask_token_id: 7 in the config"]),
    # finding 5: variant names are folder names under bench/recipe/, never paths
    Case("f5-variant-dotdot", lambda w: ["bench", "recipe", *overrides(w.run, w.target), "bench.recipe_steps=1",
                                         _variants("{'../../victim': []}")], 2,
         ["bench.recipe_variants.../../victim", "plain name"]),
    Case("f5-variant-absolute", lambda w: ["bench", "recipe", *overrides(w.run, w.target), "bench.recipe_steps=1",
                                           _variants(f"{{'{w.user}/other': []}}")], 2, ["plain name"]),
    # finding 12: variants are validated before any trains; a string is not a list of characters
    Case("f12-variant-string", lambda w: ["bench", "recipe", *overrides(w.run, w.target), "bench.recipe_steps=1",
                                          _variants("{lr: 'train.lr=1e-3'}")], 2,
         ["bench.recipe_variants.lr: expected a list", "[train.lr=1e-3]"], absent=("override 't'",)),
    Case("f12-bad-last-variant", lambda w: ["bench", "recipe", *overrides(w.run, w.target), "bench.recipe_steps=1",
                                            _variants("{a: [], b: [train.lrr=1]}")], 2,
         ["bench.recipe_variants.b", "train.lrr: unknown key"]),
    # finding 14: a password in a URL without a scheme is never printed
    Case("f14-schemeless-password", lambda w: ["generate", f"run.run_dir={w.run}",
                                               "server.urls=[alice:hunter2@127.0.0.1:9/v1]"], 2,
         ["server.urls[0]", "has no scheme", "***@127.0.0.1:9/v1"], absent=("hunter2",)),
    # finding 10: config.json counts must be integers >= 1; an imported drafter's too
    Case("f10-string-hidden-size", lambda w: ["probe", str(w.target_with(hidden_size="64")), "--dry-run"], 2,
         lambda w: [f"{w.user}/target/config.json", "hidden size", "must be an integer", "'64'"]),
    Case("f10-negative-layers", lambda w: ["probe", str(w.target_with(num_hidden_layers=-2)), "--dry-run"], 2,
         lambda w: [f"{w.user}/target/config.json", "layer count", "must be >= 1, got -2"]),
    Case("f10-import-string-block-size", lambda w: ["import", str(w.drafter_with(block_size="4")),
                                                    f"run.run_dir={w.user}/fresh", f"target.path={w.target}"], 2,
         lambda w: [f"{w.user}/drafter/config.json", "block_size must be an integer"]),
    # finding 3 (second half): import refuses a drafter that disagrees with the run's contract
    Case("f3-import-contract-mismatch", lambda w: ["import", str(w.drafter), f"{w.user}/dest",
                                                   f"run.run_dir={w.run}", f"target.path={w.target}"], 2,
         lambda w: ["does not fit this run's contract", "mask_token_id", f"{w.run}/contract.json"]),
    # finding 11: a model that needs its own code names target.trust_remote_code
    Case("f11-remote-code", lambda w: ["serve", str(w.target_with(model_type="mystery_lm",
                                                                  auto_map={"AutoConfig": "m.MysteryConfig"})),
                                       "serve.port=0"], 2,
         ["mystery_lm", "target.trust_remote_code", "auto_map"]),
    # finding 7: a Jinja error other than a syntax error names the template file (and no tokenize/ is left)
    Case("f7-unknown-filter", lambda w: ["tokenize", *w.generated(), "target.chat_template=" + str(
        w.file("t.jinja", "{% for m in messages %}\n{{ m.content | frobnicate }}\n{% endfor %}"))], 2,
         lambda w: [f"{w.user}/t.jinja:2", "No filter named 'frobnicate'"]),
    Case("f7-unknown-filter-at-render", lambda w: ["tokenize", *w.generated(), "target.chat_template=" + str(
        w.file("t.jinja", "{% for m in messages %}{% if m.role == 'assistant' %}{{ m.content | frobnicate }}"
               "{% else %}{{ m.content }}{% endif %}{% endfor %}"))], 2,
         lambda w: [f"target.chat_template {w.user}/t.jinja", "frobnicate"]),
    # finding 17: tokenize after an all-failed generate says so (not "the chat template")
    Case("f17-tokenize-after-failed-generate", lambda w: ["tokenize", *w.generated(failed=True)], 2,
         ["`generate` wrote none (1 of 1 turns failed", "dflashkit generate"], absent=("target.chat_template",)),
    # finding 17: hints say the config given; a directory is not "missing"; /proc is not writable
    Case("f17-hint-names-the-config", lambda w: ["tokenize", "-c", str(w.file("my.yaml", f"run:\n  run_dir: {w.user}/r\n"))],
         3, lambda w: [f"dflashkit generate -c {w.user}/my.yaml"], absent=("-c run.yaml",)),
    Case("f17-config-is-a-dir", lambda w: ["train", "-c", str(w.user)], 2, ["is a directory"],
         absent=("not found",)),
    Case("f17-eval-prompts-dir", lambda w: ["eval", str(w.drafter), f"run.run_dir={w.run}",
                                            f"eval.prompts={w.user}"], 2,
         ["eval.prompts", "is a directory"], absent=("does not exist",)),
    Case("f17-run-dir-in-proc", lambda w: ["prepare", "run.run_dir=/proc/self/nope/run",
                                           f"data.sources=[{{path: '{w.file('p.jsonl', json.dumps(CONV))}'}}]"], 2,
         ["run.run_dir /proc/self/nope/run", "cannot write"], absent=("FileNotFoundError",)),
    # issue 38, 4: a drafter whose weights are not floating point is named with its dtype
    Case("i38-import-int8-drafter", lambda w: ["import", str(w.int8_drafter()), f"run.run_dir={w.user}/fresh",
                                               f"target.path={w.target}"], 2,
         lambda w: [f"{w.user}/drafter8/model.safetensors", "not floating point", "(int8)"],
         absent=("StopIteration",)),
    Case("i38-warm-start-int8-drafter", lambda w: w.train(f"drafter.init={w.int8_drafter()}"), 2,
         lambda w: [f"{w.user}/drafter8/model.safetensors", "not floating point", "(int8)"],
         absent=("StopIteration",)),
    # issue 38, 5: a config that is not UTF-8 names the file, line and byte
    Case("i38-latin1-config", lambda w: ["train", "-c", str(w.file("l.yaml", b"run:\n  run_dir: caf\xe9\n"))], 2,
         lambda w: [f"{w.user}/l.yaml:2:15", "not UTF-8", "0xe9 at offset 19", "iconv"],
         absent=("UnicodeDecodeError",)),
    Case("i38-utf16-config", lambda w: ["train", "-c", str(w.file("u.yaml", "run:\n  run_dir: x\n".encode("utf-16")))],
         2, lambda w: [f"{w.user}/u.yaml", "UTF-16", "iconv -f UTF-16"], absent=("UnicodeDecodeError",)),
    Case("i38-latin1-chat-template", lambda w: ["tokenize", *w.generated(), "target.chat_template=" + str(
        w.file("t.jinja", b"{% for m in messages %}\n{{ m.content }} \xbb\n{% endfor %}"))], 2,
         lambda w: ["target.chat_template", f"{w.user}/t.jinja", "not UTF-8"], absent=("UnicodeDecodeError",)),
    Case("i38-control-character", lambda w: ["train", "-c", str(w.file("c.yaml", b"train:\n  lr: \x01\n"))], 2,
         lambda w: [f"{w.user}/c.yaml:2:7", "invalid YAML"]),
    Case("f17-heldout-takes-all", lambda w: ["prepare", f"run.run_dir={w.run}", "data.heldout=32",
                                             f"data.sources=[{{path: '{w.file('p.jsonl', json.dumps(CONV))}'}}]"], 2,
         ["data.heldout: 32", "0 for training"]),
]


def _snapshot(*roots: Path) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for root in roots:
        if not root.exists():
            out[str(root)] = None
            continue
        for p in sorted(root.rglob("*")):
            if p.is_file() and p.name != ".lock":
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
            elif p.is_dir():
                out[str(p)] = "dir"
    return out


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, tiny_qwen3):
    from dflashkit.config import TargetSection
    from dflashkit.export.hf import save_drafter
    from dflashkit.target.load import load_target
    from dflashkit.testing import random_drafter

    target = load_target(TargetSection(path=str(tiny_qwen3), device="cpu", dtype="float32"))
    return save_drafter(random_drafter(target, block_size=4), tmp_path_factory.mktemp("drafter") / "d",
                        dtype="float32")


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, tiny_qwen3):
    return make_run(tmp_path_factory.mktemp("base") / "run", tiny_qwen3)


def _world(tmp_path: Path, tiny_qwen3, drafter_dir, base_run) -> W:
    w = W(tmp_path, Path(tiny_qwen3), Path(drafter_dir))
    w.user.mkdir()
    shutil.copytree(base_run, w.run)
    return w


def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_sweep_input(case: Case, tmp_path, tiny_qwen3, drafter_dir, base_run, capsys):
    w = _world(tmp_path, tiny_qwen3, drafter_dir, base_run)
    argv = case.argv(w)
    capsys.readouterr()
    before = _snapshot(w.user, w.run)
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == case.code, f"exit {rc}, expected {case.code}\nstderr:\n{err}\nstdout:\n{out}"
    assert "Traceback" not in err, err
    result = _last_json(out)
    assert result["ok"] is False and result["exit_code"] == case.code
    for needle in case.needles(w) if callable(case.needles) else case.needles:
        assert needle in err, f"{needle!r} not named\nstderr:\n{err}"
    for bad in case.absent:
        assert bad not in out + err, f"{bad!r} printed\nstderr:\n{err}\nstdout:\n{out}"
    assert _snapshot(w.user, w.run) == before, "files changed on a failed command"


# --- finding 8: a documented value from YAML and from the command line ------------------------------


def test_capture_last_hidden_true_from_yaml_and_command_line(tmp_path):
    from dflashkit.config import load_config

    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("capture:\n  last_hidden: true\n")
    assert load_config(yaml_file).capture.last_hidden == "true"
    for value, want in (("true", "true"), ("false", "false"), ("auto", "auto"), ("'true'", "true")):
        assert load_config(None, [f"capture.last_hidden={value}"]).capture.last_hidden == want
    from dflashkit.errors import ConfigError

    with pytest.raises(ConfigError, match="capture.last_hidden"):
        load_config(None, ["capture.last_hidden=yes please"])


def test_redact_url_without_scheme():
    from dflashkit.config import redact_url

    assert redact_url("u:pw@h:1/v1?api_key=k") == "***@h:1/v1?api_key=***"
    assert redact_url("h:1/v1") == "h:1/v1" and redact_url("http://u:p@h/v1") == "http://***@h/v1"


# --- finding 4: bench --dry-run runs and writes nothing ---------------------------------------------


@pytest.mark.parametrize("subject", ["recipe", "train", "decode"])
def test_bench_dry_run_writes_nothing(subject, tmp_path, tiny_qwen3, drafter_dir, base_run, capsys):
    w = _world(tmp_path, tiny_qwen3, drafter_dir, base_run)
    capsys.readouterr()
    # a dry run checks the drafter and the prompts as the run does
    prompt = json.dumps({"prompt": "What is 2+2?"}) + "\n"
    decode = [str(w.drafter), f"eval.prompts={w.file('e.jsonl', prompt)}"] if subject == "decode" else []
    before = _snapshot(w.run)
    rc = main(["bench", subject, *decode, "--dry-run", "--json", *overrides(w.run, w.target), "bench.recipe_steps=50"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    res = _last_json(out)
    assert res["dry_run"] is True
    if subject == "recipe":
        from dflashkit.bench.recipe import DEFAULT_VARIANTS

        assert set(res["variants"]) == set(DEFAULT_VARIANTS) >= {"base", "labels=data", "no-features", "dflash2"}
    assert _snapshot(w.run) == before
    assert not (w.run / ".lock").exists()


# --- ownership: no command replaces a path it did not create -----------------------------------------


def _user_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "mine.txt").write_text("keep me")


@pytest.mark.parametrize("where", ["train/final", "train/best"])
def test_train_refuses_a_user_dir_in_its_outputs_before_training(where, tmp_path, tiny_qwen3, drafter_dir,
                                                                  base_run, capsys):
    w = _world(tmp_path, tiny_qwen3, drafter_dir, base_run)
    _user_dir(w.run / where)
    capsys.readouterr()
    rc = main(w.train())
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f"refusing to replace {w.run / where}" in err and "Traceback" not in err
    assert (w.run / where / "mine.txt").read_text() == "keep me"
    assert not (w.run / "train" / "checkpoints").exists()  # refused before any step


def test_bench_recipe_refuses_a_user_dir_where_a_variant_goes(tmp_path, tiny_qwen3, drafter_dir, base_run, capsys):
    w = _world(tmp_path, tiny_qwen3, drafter_dir, base_run)
    _user_dir(w.run / "bench" / "recipe" / "b")
    capsys.readouterr()
    rc = main(["bench", "recipe", *overrides(w.run, w.target), "bench.recipe_steps=1", _variants("{a: [], b: []}")])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "refusing to replace" in err and (w.run / "bench" / "recipe" / "b" / "mine.txt").read_text() == "keep me"
    assert not (w.run / "bench" / "recipe" / "a").exists()  # nothing trained before the refusal


def test_import_never_replaces_an_existing_dest(tmp_path, tiny_qwen3, drafter_dir, capsys):
    w = W(tmp_path, Path(tiny_qwen3), Path(drafter_dir))
    _user_dir(w.user / "dest")
    rc = main(["import", str(w.drafter), str(w.user / "dest"), f"run.run_dir={w.run}", f"target.path={w.target}"])
    err = capsys.readouterr().err
    assert rc == 2 and "not overwriting" in err and (w.user / "dest" / "mine.txt").read_text() == "keep me"


# --- finding 3: import then train --------------------------------------------------------------------


def test_train_after_import_refuses_to_discard_the_imported_drafter(tmp_path, tiny_qwen3, drafter_dir, capsys):
    from tests.helpers import tokenize_texts, write_shards

    w = W(tmp_path, Path(tiny_qwen3), Path(drafter_dir))
    rc = main(["import", str(w.drafter), f"run.run_dir={w.run}", f"target.path={w.target}", "--json"])
    assert rc == 0, capsys.readouterr().err
    assert json.loads((w.run / "train" / "final" / "imported.json").read_text())["source"] == str(w.drafter.resolve())
    write_shards(w.run, tokenize_texts(w.target))
    before = _snapshot(w.run / "train")
    capsys.readouterr()
    rc = main(w.train())
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "dflashkit import" in err and f"drafter.init: {(w.run / 'train' / 'final').resolve()}" in err
    assert _snapshot(w.run / "train") == before


# --- finding 9: resuming under another objective -----------------------------------------------------


@pytest.mark.parametrize("change", ["train.loss=kl", "train.labels=target", "train.position_weighting=uniform",
                                    "train.kl_temperature=2"])
def test_resume_under_another_objective_is_refused(change, tmp_path, tiny_qwen3, drafter_dir, base_run, capsys):
    w = _world(tmp_path, tiny_qwen3, drafter_dir, base_run)
    assert main(w.train()) == 0, capsys.readouterr().err
    before = _snapshot(w.run / "train")
    capsys.readouterr()
    rc = main(["train", *overrides(w.run, w.target, train__max_steps=2), change])
    err = capsys.readouterr().err
    assert rc == 2, err
    key = change.split("=")[0]
    assert f"{key}: " in err and "objective changed" in err and "state.json" in err
    assert _snapshot(w.run / "train") == before


# --- finding 16: train outputs are readable by others (umask respected) ------------------------------


def test_train_outputs_follow_the_umask(tmp_path, tiny_qwen3, drafter_dir, base_run, capsys):
    w = _world(tmp_path, tiny_qwen3, drafter_dir, base_run)
    old = os.umask(0o022)
    try:
        assert main([*w.train(), "train.eval_every=1"]) == 0, capsys.readouterr().err
    finally:
        os.umask(old)
    files = [p for d in ("final", "best", "checkpoints") for p in (w.run / "train" / d).rglob("*") if p.is_file()]
    assert any(p.name == "model.safetensors" for p in files) and any(p.name == "optimizer.pt" for p in files)
    for p in files:
        assert p.stat().st_mode & 0o044 == 0o044, f"{p} is {oct(p.stat().st_mode)}"


# --- finding 6: a full disk names the path and keeps what existed ------------------------------------


@pytest.fixture
def small_fs(tmp_path):
    """A 2 MB tmpfs at tmp_path/fs (root only; else skipped: test_disk_full_is_named_without_tmpfs covers
    the same path by failing the write deterministically). `fill(leave)` leaves `leave` bytes free."""
    fs = tmp_path / "fs"
    fs.mkdir()
    rc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(fs)], capture_output=True)
    if rc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {rc.stderr.decode(errors='replace').strip()}")

    def fill(leave: int) -> None:
        free = shutil.disk_usage(fs).free
        (fs / "filler").write_bytes(b"\0" * max(free - leave, 0))

    try:
        yield fs, fill
    finally:
        subprocess.run(["umount", "-l", str(fs)], capture_output=True)


def _disk_full_checks(rc: int, err: str, out: str, under: Path) -> None:
    assert rc == 1, err
    assert "Traceback" not in err and "the disk is full" in err and str(under) in err, err
    assert "inline_container" not in _last_json(out)["error"].split("(")[0]


def test_disk_full_during_a_checkpoint_keeps_the_old_one(small_fs, tiny_qwen3, base_run, capsys):
    fs, fill = small_fs
    run = fs / "run"
    shutil.copytree(base_run, run)
    assert main(["train", *overrides(run, tiny_qwen3, train__max_steps=1), "train.keep_best=false"]) == 0, \
        capsys.readouterr().err
    before = _snapshot(run / "train" / "checkpoints", run / "train" / "final")
    fill(60_000)
    capsys.readouterr()
    rc = main(["train", *overrides(run, tiny_qwen3, train__max_steps=2), "train.keep_best=false"])
    out, err = capsys.readouterr()
    _disk_full_checks(rc, err, out, run / "train")
    assert _snapshot(run / "train" / "checkpoints", run / "train" / "final") == before
    assert not [p for p in (run / "train").rglob(".*") if p.name != ".lock"], "a temp dir was left behind"


def test_disk_full_during_export_keeps_the_old_export(small_fs, tiny_qwen3, drafter_dir, capsys):
    fs, fill = small_fs
    run = fs.parent / "run"
    shutil.copytree(drafter_dir, run / "train" / "final")
    argv = ["export", f"run.run_dir={run}", f"target.path={tiny_qwen3}", f"export.out_dir={fs / 'export'}"]
    assert main([*argv, "export.dtype=bfloat16"]) == 0, capsys.readouterr().err
    before = _snapshot(fs / "export")
    fill(20_000)
    capsys.readouterr()
    rc = main([*argv, "export.dtype=float32"])
    out, err = capsys.readouterr()
    _disk_full_checks(rc, err, out, fs / "export")
    assert _snapshot(fs / "export") == before


def test_disk_full_during_prepare(small_fs, tmp_path, capsys):
    fs, fill = small_fs
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"question {i} " + "x" * 500}) + "\n" for i in range(400)))
    fill(50_000)
    capsys.readouterr()
    rc = main(["prepare", f"run.run_dir={fs / 'run'}", f"data.sources=[{{path: '{src}'}}]", "data.heldout=2"])
    out, err = capsys.readouterr()
    _disk_full_checks(rc, err, out, fs / "run" / "prepare")
    assert not list((fs / "run" / "prepare").glob("*.jsonl"))


def test_disk_full_is_named_without_tmpfs(tmp_path, monkeypatch):
    """The same mapping with the write failing deterministically: torch's inline_container error (no errno)
    counts as a full disk only when the filesystem is (nearly) full; an OSError ENOSPC always does."""
    import errno

    from dflashkit import rundir
    from dflashkit.errors import DiskFull

    old = tmp_path / "out"
    old.mkdir()
    (old / "manifest.json").write_text(json.dumps({"stage": "export"}))
    with pytest.raises(DiskFull, match="the disk is full: writing .*out"):
        with rundir.atomic_dir(old, owner="export") as tmp:
            (tmp / "x").write_text("partial")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert json.loads((old / "manifest.json").read_text()) == {"stage": "export"}
    torch_error = RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0")
    monkeypatch.setattr(os, "statvfs", lambda p: os.statvfs_result((4096, 4096, 100, 0, 0, 0, 0, 0, 0, 255)))
    assert rundir.is_disk_full(torch_error, tmp_path)
    monkeypatch.undo()
    assert not rundir.is_disk_full(torch_error, tmp_path) or shutil.disk_usage(tmp_path).free < 16 << 20
    assert not rundir.is_disk_full(ValueError("bad value"), tmp_path)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


# --- finding 17: a permanent HTTP 400 is not "re-run to retry"; SIGTERM still prints the JSON line -----


class _Server:
    """A tiny OpenAI-shaped server in a thread: /v1/models answers, every POST gets `status` (or hangs)."""

    def __init__(self, status: int = 400, hang: bool = False):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        outer = self

        class H(BaseHTTPRequestHandler):
            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send(200, {"data": [{"id": "m"}]})

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                outer.posted.set()
                if outer.hang:
                    outer.stop.wait(60)
                self._send(status, {"error": {"message": "context length exceeded"}})

            def log_message(self, *a):
                pass

        self.hang, self.stop, self.posted = hang, threading.Event(), threading.Event()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def test_permanent_http_400_is_not_re_run_to_retry(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "prepare").mkdir(parents=True)
    (run / "prepare" / "train.jsonl").write_text(json.dumps(CONV) + "\n")
    with _Server(400) as srv:
        rc = main(["generate", f"run.run_dir={run}", f"server.urls=[{srv.url}]", "server.model=m",
                   "generate.progress=false", "generate.neutral_sampling=false", "--json"])
    out, err = capsys.readouterr()
    assert rc == 2, err
    assert "re-run to retry" not in err and "http 400" in err and "failures.jsonl" in err
    assert _last_json(out)["generate"]["turns_failed"] == 1


def test_sigterm_of_generate_prints_the_json_line(tmp_path):
    import signal
    import sys
    import time

    import dflashkit

    run = tmp_path / "run"
    (run / "prepare").mkdir(parents=True)
    (run / "prepare" / "train.jsonl").write_text(json.dumps(CONV) + "\n")
    src = str(Path(dflashkit.__file__).resolve().parents[1])
    with _Server(hang=True) as srv:
        proc = subprocess.Popen([sys.executable, "-m", "dflashkit", "generate", f"run.run_dir={run}",
                                 f"server.urls=[{srv.url}]", "server.model=m", "generate.progress=false",
                                 "generate.neutral_sampling=false"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": src})
        # the request is in flight (the server holds it): not a fixed moment, which a loaded machine's slow
        # start could reach before generate has begun
        deadline = time.monotonic() + 120
        while not srv.posted.wait(0.1) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
        assert srv.posted.is_set(), "generate sent no request"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    res = json.loads(out.strip().splitlines()[-1])
    assert res["ok"] is False and res["exit_code"] == 143 and "signal 15" in res["error"], (out, err)
    assert "Traceback" not in err


# --- finding 17: a killed capture's temp shard is removed by the next capture ------------------------


def test_capture_removes_a_stale_temp_shard(tmp_path, tiny_qwen3, base_run, capsys):
    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    stale = run / "capture" / ".shard-00000.safetensors.abc123.tmp"
    stale.parent.mkdir()
    stale.write_bytes(b"\0" * 4096)
    mine = run / "capture" / "notes.tmp"  # not a name atomic_path makes: left alone
    mine.write_text("keep")
    assert main(["capture", f"run.run_dir={run}", f"target.path={tiny_qwen3}", "--dry-run"]) == 0
    assert stale.exists()  # a dry run changes nothing
    assert main(["capture", f"run.run_dir={run}", f"target.path={tiny_qwen3}"]) == 0, capsys.readouterr().err
    assert not stale.exists() and mine.read_text() == "keep"
    assert list((run / "capture").glob("shard-*.safetensors"))


# --- finding 15: eval.prompts reads any prepare format -----------------------------------------------


def test_eval_prompts_read_sharegpt_and_alpaca(tmp_path):

    from dflashkit.config import load_config
    from dflashkit.decode.runner import load_prompt_messages

    p = tmp_path / "e.jsonl"
    rows = [{"id": "s", "conversations": [{"from": "human", "value": "hi there"}, {"from": "gpt", "value": "yo"}]},
            {"instruction": "Add", "input": "2 and 2"}, {"prompt": "plain"},
            {"messages": [{"role": "user", "content": "m"}]}]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(None, [f"eval.prompts={p}", "data.on_malformed=fail"])
    got = load_prompt_messages(cfg, RunDir(tmp_path))
    assert [m for _, m in got] == [[{"role": "user", "content": "hi there"}],
                                   [{"role": "user", "content": "Add\n\n2 and 2"}],
                                   [{"role": "user", "content": "plain"}], [{"role": "user", "content": "m"}]]
