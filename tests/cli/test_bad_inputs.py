"""Table-driven bad inputs across every command, run in-process through `cli.main`.

Each case builds its bad input in a fresh tmp dir (`user/` = the user's files, `run/` = the run
dir) and asserts: the exit code; that stderr and the JSON error name the file/line/key at fault;
no "Traceback" on stderr; and, unless the case is expected to write, that a snapshot of `user/`
and `run/` (every file's bytes, `.lock` aside; a run dir that did not exist must still not exist)
is unchanged.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from dflashkit.cli import main

CONV = {"id": "0000000000000001", "source": "t",
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
GOOD = json.dumps({"prompt": "What is 2+2?"})


@dataclass
class W:
    """One case's world."""

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

    def run_file(self, rel: str, data: bytes | str) -> Path:
        p = self.run / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data if isinstance(data, bytes) else data.encode())
        return p

    def rd(self) -> str:
        return f"run.run_dir={self.run}"

    def src(self, path: Path, *extra: str) -> list[str]:
        return [f"data.sources=[{{path: '{path}'}}]", self.rd(), *extra]

    def target_copy(self) -> Path:
        dest = self.user / "target"
        shutil.copytree(self.target, dest)
        return dest


@dataclass
class Case:
    id: str
    argv: Callable[[W], list[str]]
    code: int
    needles: Callable[[W], list[str]] | list[str]
    writes: bool = False  # the command may legitimately change run/ (never user/)


def _gz(lines: list[str]) -> bytes:
    return gzip.compress("".join(x + "\n" for x in lines).encode())


def _truncated_gz(w: W) -> Path:
    data = _gz([json.dumps({"prompt": f"question number {i} " * 5}) for i in range(400)])
    return w.file("p.jsonl.gz", data[: len(data) // 2])


def _busy_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    _busy_port.sock = s  # type: ignore[attr-defined]  # kept open for the case
    return s.getsockname()[1]


def _corrupt_weights(w: W) -> Path:
    t = w.target_copy()
    st = t / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 3])
    return t


def _cfg_case(id_: str, cmd: str, override: str, key: str, *extra: str) -> Case:
    return Case(id_, lambda w: [cmd, w.rd(), override, *extra], 2, [key])


CASES: list[Case] = [
    # --- config validation: every problem names its dotted key (exit 2, nothing written) ---
    _cfg_case("block-size-1", "train", "drafter.block_size=1", "drafter.block_size"),
    _cfg_case("block-size-above-context", "train", "drafter.block_size=4096", "tokenize.max_length=2048"),
    _cfg_case("layer-ids-unsorted", "probe", "drafter.target_layer_ids=[3,1]", "drafter.target_layer_ids"),
    _cfg_case("layer-ids-duplicated", "capture", "drafter.target_layer_ids=[1,1]", "duplicated"),
    _cfg_case("layer-ids-vs-features", "train", "drafter.target_layer_ids=[1,2,3]", "num_target_features=2",
              "drafter.num_target_features=2"),
    _cfg_case("layer-ids-negative", "probe", "drafter.target_layer_ids=[-1,2]", "drafter.target_layer_ids"),
    _cfg_case("url-without-scheme", "generate", "server.urls=[localhost:8000]", "http://localhost:8000"),
    _cfg_case("url-ftp", "generate", "server.urls=[ftp://h/v1]", "server.urls[0]"),
    _cfg_case("url-bad-port", "doctor", "server.urls=[http://h:99999/v1]", "server.urls[0]"),
    _cfg_case("url-no-host", "generate", "server.urls=['http://:80/v1']", "has no host"),
    _cfg_case("bench-url-scheme", "bench", "bench.urls=[127.0.0.1:8000/v1]", "bench.urls[0]"),
    _cfg_case("top-p-2", "generate", "generate.top_p=2", "generate.top_p"),
    _cfg_case("top-p-0", "generate", "generate.top_p=0", "generate.top_p"),
    _cfg_case("max-tokens-0", "generate", "generate.max_tokens=0", "generate.max_tokens"),
    _cfg_case("temperature-negative", "generate", "generate.temperature=-1", "generate.temperature"),
    _cfg_case("concurrency-0", "generate", "generate.concurrency=0", "generate.concurrency"),
    _cfg_case("shard-size-0", "generate", "generate.shard_size=0", "generate.shard_size"),
    _cfg_case("timeout-0", "generate", "server.timeout_s=0", "server.timeout_s"),
    _cfg_case("scale-negative", "run", "run.scale=-1", "run.scale"),
    _cfg_case("scale-0", "run", "run.scale=0", "run.scale"),
    _cfg_case("eval-top-p", "eval", "eval.top_p=1.5", "eval.top_p"),
    _cfg_case("eval-top-k", "eval", "eval.top_k=-1", "eval.top_k"),
    _cfg_case("eval-num-prompts-0", "eval", "eval.num_prompts=0", "eval.num_prompts"),
    _cfg_case("eval-max-new-0", "eval", "eval.max_new_tokens=0", "eval.max_new_tokens"),
    _cfg_case("eval-block-size-0", "eval", "eval.block_sizes=[4,0]", "eval.block_sizes[1]"),
    _cfg_case("serve-port-99999", "serve", "serve.port=99999", "serve.port"),
    _cfg_case("serve-port-negative", "serve", "serve.port=-1", "serve.port"),
    _cfg_case("serve-max-batch-0", "serve", "serve.max_batch=0", "serve.max_batch"),
    _cfg_case("bench-concurrency-0", "bench", "bench.concurrency=[1,0]", "bench.concurrency[1]"),
    _cfg_case("bench-requests-0", "bench", "bench.requests=0", "bench.requests"),
    _cfg_case("lr-0", "train", "train.lr=0", "train.lr"),
    _cfg_case("batch-size-0", "train", "train.batch_size=0", "train.batch_size"),
    _cfg_case("warmup-ratio-1", "train", "train.warmup_ratio=1", "train.warmup_ratio"),
    _cfg_case("disk-fraction-2", "capture", "capture.max_disk_fraction=2", "capture.max_disk_fraction"),
    _cfg_case("max-length-4", "tokenize", "tokenize.max_length=4", "tokenize.max_length"),
    _cfg_case("unknown-key", "train", "trian.lr=1", "did you mean train"),
    _cfg_case("unknown-nested-key", "export", "export.outdir=x", "did you mean export.out_dir"),
    _cfg_case("wrong-type", "train", "train.lr=fast", "train.lr"),
    _cfg_case("literal-typo", "prepare", "data.on_malformed=skp", "did you mean 'skip'"),
    _cfg_case("source-weight-0", "prepare", "data.sources=[{path: x, weight: 0}]", "data.sources[0].weight"),
    _cfg_case("source-path-empty", "prepare", "data.sources=[{weight: 1}]", "data.sources[0].path"),
    _cfg_case("dry-run-still-validates", "capture", "drafter.block_size=0", "drafter.block_size", "--dry-run"),
    Case("all-problems-at-once", lambda w: ["generate", w.rd(), "drafter.block_size=1", "generate.top_p=2",
                                            "server.urls=[x:1]"], 2,
         ["3 config errors", "drafter.block_size", "generate.top_p", "server.urls[0]"]),
    # issue #20: checks once made by the stage that read them (train's recipe, tokenize's and prepare's
    # sizes, pipeline's run.scale) are config checks now: one error lists them all, before any stage runs
    Case("every-kind-at-once", lambda w: ["train", w.rd(), "--dry-run", "train.dpace_alpha=0", "tokenize.batch_size=0",
                                          "run.scale=0", "data.num_prompts=0"], 2,
         ["4 config errors", "train.dpace_alpha", "tokenize.batch_size", "run.scale", "data.num_prompts"]),
    Case("chat-template-missing", lambda w: ["tokenize", w.rd(), f"target.chat_template={w.user}/nope.jinja"], 2,
         lambda w: ["target.chat_template", f"{w.user}/nope.jinja"]),
    Case("chat-template-syntax", lambda w: ["tokenize", w.rd(), "target.chat_template=" + str(
        w.file("t.jinja", "{% for m in messages %}\n{{ m.content }\n{% endfor %}"))], 2,
         lambda w: [f"{w.user}/t.jinja:2", "Jinja syntax error"]),
    Case("chat-template-not-utf8", lambda w: ["eval", w.rd(), "target.chat_template=" + str(
        w.file("t.jinja", b"{{ x }}\xff"))], 2, lambda w: [f"{w.user}/t.jinja", "not UTF-8"]),
    Case("yaml-syntax", lambda w: ["train", "-c", str(w.file("run.yaml", "train:\n  lr: [1,\n"))], 2,
         lambda w: [f"{w.user}/run.yaml:3"]),
    Case("yaml-missing", lambda w: ["train", "-c", str(w.user / "none.yaml")], 2,
         lambda w: ["config file not found", f"{w.user}/none.yaml"]),
    Case("yaml-top-level-list", lambda w: ["probe", "-c", str(w.file("run.yaml", "- a\n- b\n"))], 2,
         lambda w: [f"{w.user}/run.yaml", "top level must be a mapping"]),
    Case("yaml-unknown-section", lambda w: ["train", "-c", str(w.file("run.yaml", "trainn:\n  lr: 1\n"))], 2,
         ["trainn: unknown key", "did you mean train"]),
    # --- prepare: every reader names file (and line) and follows data.on_malformed ---
    Case("prompt-not-utf8-fail", lambda w: ["prepare", *w.src(w.file("p.jsonl", GOOD.encode() + b"\n"
                                                                    + b'{"prompt": "caf\xe9"}\n'),
                                                             "data.on_malformed=fail")], 2,
         lambda w: [f"{w.user}/p.jsonl:2", "not UTF-8 (byte 0xe9"]),
    Case("prompt-bad-json-fail", lambda w: ["prepare", *w.src(w.file("p.jsonl", f"{GOOD}\n{GOOD}\n{{oops\n"),
                                                             "data.on_malformed=fail")], 2,
         lambda w: [f"{w.user}/p.jsonl:3", "malformed JSON"]),
    Case("prompt-truncated-gz-fail", lambda w: ["prepare", *w.src(_truncated_gz(w), "data.on_malformed=fail")], 2,
         lambda w: [f"{w.user}/p.jsonl.gz:", "truncated gzip"]),
    Case("prompt-not-gzip", lambda w: ["prepare", *w.src(w.file("p.jsonl.gz", GOOD + "\n"))], 2,
         lambda w: [f"{w.user}/p.jsonl.gz:1", "unreadable"]),
    Case("bad-parquet", lambda w: ["prepare", *w.src(w.file("p.parquet", b"PAR1 this is not parquet at all"))], 2,
         lambda w: [f"{w.user}/p.parquet", "not a readable Parquet file"]),
    Case("json-array-not-utf8-fail", lambda w: ["prepare", *w.src(w.file("p.json", b'[{"prompt": "a"}, '
                                                                        b'{"prompt": "caf\xe9"}]'),
                                                                 "data.on_malformed=fail")], 2,
         lambda w: [f"{w.user}/p.json[1]", "not UTF-8"]),
    Case("json-array-truncated-fail", lambda w: ["prepare", *w.src(w.file("p.json", '[{"prompt": "a"}, {"pro'),
                                                                  "data.on_malformed=fail")], 2,
         lambda w: [f"{w.user}/p.json"]),
    Case("json-array-truncated-gz", lambda w: ["prepare", *w.src(w.file(
        "p.json.gz", gzip.compress(b'[{"prompt": "a"}' * 1 + b", " + b'{"prompt": "bb"}, ' * 300)[:-30]))], 2,
         lambda w: [f"{w.user}/p.json.gz", "gzip"]),
    Case("unsupported-suffix", lambda w: ["prepare", *w.src(w.file("p.txt", "hello"))], 2,
         lambda w: [f"{w.user}/p.txt", "unsupported source file type"]),
    Case("source-missing", lambda w: ["prepare", *w.src(w.user / "nope.jsonl")], 2,
         lambda w: [f"{w.user}/nope.jsonl", "does not exist"]),
    Case("record-bad-role-fail", lambda w: ["prepare", *w.src(w.file("p.jsonl", json.dumps(
        {"messages": [{"role": "wizard", "content": "x"}]}) + "\n"), "data.on_malformed=fail")], 2,
         lambda w: [f"{w.user}/p.jsonl:1", "wizard"]),
    # --- generate ---
    Case("generate-no-prepare", lambda w: ["generate", w.rd(), "server.urls=[http://127.0.0.1:9/v1]"], 3,
         ["missing prepared conversations", "dflashkit prepare"]),
    Case("generate-prepared-not-utf8", lambda w: [
        "generate", w.rd(), "server.urls=[http://127.0.0.1:9/v1]",
        str(w.run_file("prepare/train.jsonl", json.dumps(CONV).encode() + b"\n\xff\xfe\n")) and "--json"], 2,
         lambda w: [f"{w.run}/prepare/train.jsonl:2", "not UTF-8"]),
    Case("generate-prepared-bad-json", lambda w: [
        "generate", w.rd(), "server.urls=[http://127.0.0.1:9/v1]",
        str(w.run_file("prepare/train.jsonl", json.dumps(CONV) + "\n{\n")) and "--json"], 2,
         lambda w: [f"{w.run}/prepare/train.jsonl:2"]),
    Case("generate-all-turns-fail", lambda w: [
        "generate", w.rd(), "server.urls=[http://u:hunter2@127.0.0.1:9/v1]", "server.model=m",
        "generate.max_retries=0", "generate.progress=false",
        str(w.run_file("prepare/train.jsonl", json.dumps(CONV) + "\n")) and "--json"], 4,
         ["1 of 1 turns failed", "re-run to retry"], writes=True),
    # --- tokenize / capture / train / report / plan: missing upstream artifacts name the command ---
    Case("tokenize-no-generate", lambda w: ["tokenize", w.rd(), f"target.path={w.target}"], 3,
         ["dflashkit generate"]),
    Case("tokenize-conversations-not-utf8", lambda w: [
        "tokenize", w.rd(), f"target.path={w.target}",
        str(w.run_file("generate/conversations.jsonl", json.dumps(CONV).encode() + b"\n\xc3\x28\n")) and "--json"],
         2, lambda w: [f"{w.run}/generate/conversations.jsonl:2", "not UTF-8"]),
    Case("capture-dry-run-no-contract", lambda w: ["capture", w.rd(), "--dry-run"], 3, ["dflashkit probe"]),
    Case("train-no-contract", lambda w: ["train", w.rd(), f"target.path={w.target}"], 3, ["dflashkit probe"]),
    Case("report-empty", lambda w: ["report", w.rd()], 3, ["dflashkit train"]),
    Case("plan-no-probe", lambda w: ["plan", "1x80", w.rd()], 3, ["probe"]),
    # --- eval ---
    Case("eval-no-drafter", lambda w: ["eval", w.rd(), f"target.path={w.target}"], 3, ["dflashkit train"]),
    Case("eval-prompts-missing", lambda w: ["eval", str(w.drafter), w.rd(), f"eval.prompts={w.user}/none.jsonl"],
         2, lambda w: ["eval.prompts", f"{w.user}/none.jsonl"]),
    Case("eval-prompts-not-utf8-fail", lambda w: [
        "eval", str(w.drafter), w.rd(), "data.on_malformed=fail",
        "eval.prompts=" + str(w.file("e.jsonl", GOOD.encode() + b"\n" + b'{"prompt": "\xff"}\n'))], 2,
         lambda w: [f"{w.user}/e.jsonl:2", "not UTF-8"]),
    Case("eval-prompts-bad-json-fail", lambda w: [
        "eval", str(w.drafter), w.rd(), "data.on_malformed=fail",
        "eval.prompts=" + str(w.file("e.jsonl", "{nope\n"))], 2, lambda w: [f"{w.user}/e.jsonl:1"]),
    # --- export / import ---
    Case("export-no-drafter", lambda w: ["export", w.rd(), f"target.path={w.target}"], 3, ["dflashkit train"]),
    Case("export-over-user-file", lambda w: [
        "export", w.rd(), f"target.path={w.target}", "export.out_dir=" + str(w.file("notes.txt", "mine")),
        str(shutil.copytree(w.drafter, w.run / "train" / "final")) and "--json"], 2,
         lambda w: [f"{w.user}/notes.txt", "refusing to replace"]),
    Case("export-over-user-dir", lambda w: [
        "export", w.rd(), f"target.path={w.target}", f"export.out_dir={w.user}",
        str(w.file("keep/me.txt", "mine")) and str(shutil.copytree(w.drafter, w.run / "train" / "final"))
        and "--json"], 2, lambda w: [f"{w.user}", "non-empty directory"]),
    Case("import-not-a-dir", lambda w: ["import", str(w.user / "nope"), w.rd()], 2,
         lambda w: [f"{w.user}/nope", "not a directory"]),
    # --- serve: the port is checked before the model loads; corrupt weights name the file ---
    Case("serve-busy-port", lambda w: ["serve", str(w.user / "no-such-model"), f"serve.port={_busy_port()}"], 2,
         ["serve.port", "cannot bind"]),
    Case("serve-corrupt-weights", lambda w: ["serve", str(_corrupt_weights(w)), "serve.port=0"], 2,
         lambda w: [f"{w.user}/target/model.safetensors", "truncated"]),
    Case("serve-corrupt-config-json", lambda w: [
        "serve", str(w.target_copy()), "serve.port=0",
        str(w.file("target/config.json", '{"model_type": "qwen3",\n "hidden_size": }')) and "--json"], 2,
         lambda w: [f"{w.user}/target/config.json:2"]),
    Case("serve-drafter-not-dir", lambda w: ["serve", str(w.target), "serve.port=0",
                                             f"serve.drafter={w.user}/nope"], 2, ["serve.drafter"]),
    # --- probe / doctor / run ---
    Case("probe-missing-model", lambda w: ["probe", str(w.user / "nope"), w.rd()], 2,
         lambda w: [f"{w.user}/nope"]),
    Case("doctor-endpoint-down", lambda w: ["doctor", w.rd(), "server.urls=[http://127.0.0.1:9/v1]"], 1,
         ["endpoint http://127.0.0.1:9/v1"]),
    Case("run-dir-is-a-file", lambda w: ["prepare", f"run.run_dir={w.file('run.txt', 'x')}"], 2,
         lambda w: [f"{w.user}/run.txt", "run.run_dir"]),
    Case("run-from-bogus", lambda w: ["run", w.rd(), "--from", "trian"], 2, ["--from", "trian"]),
    Case("no-command", lambda w: [], 2, ["usage: dflashkit"]),
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


def test_enough_cases():
    assert len(CASES) >= 60 and len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, tmp_path, tiny_qwen3, drafter_dir, capsys):
    w = W(tmp_path, Path(tiny_qwen3), Path(drafter_dir))
    w.user.mkdir()
    argv = case.argv(w)
    capsys.readouterr()
    before = _snapshot(w.user, w.run)
    try:
        rc = main(argv)
    finally:
        sock = getattr(_busy_port, "sock", None)
        if sock is not None:
            sock.close()
            del _busy_port.sock  # type: ignore[attr-defined]
    out, err = capsys.readouterr()
    assert rc == case.code, f"exit {rc}, expected {case.code}\nstderr:\n{err}\nstdout:\n{out}"
    assert "Traceback" not in err, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["ok"] is False and result["exit_code"] == case.code
    for needle in case.needles(w) if callable(case.needles) else case.needles:
        assert needle in err, f"{needle!r} not named\nstderr:\n{err}"
    assert "hunter2" not in out + err
    for p in w.run.rglob("*") if w.run.exists() else []:
        assert not p.is_file() or b"hunter2" not in p.read_bytes(), f"a URL password was written to {p}"
    after = _snapshot(w.user, w.run)
    if case.writes:
        assert {k: v for k, v in after.items() if k.startswith(str(w.user))} == \
            {k: v for k, v in before.items() if k.startswith(str(w.user))}
    else:
        assert after == before, "files changed on a failed command"


def _prepare(w: W, path: Path, *extra: str, capsys) -> tuple[int, dict, str]:
    capsys.readouterr()
    rc = main(["prepare", *w.src(path, "data.heldout=0", *extra), "--json"])
    out, err = capsys.readouterr()
    return rc, json.loads(out.strip().splitlines()[-1]), err


def test_skip_keeps_good_lines_and_names_the_bad_ones(tmp_path, capsys):
    w = W(tmp_path, Path("-"), Path("-"))
    bad = w.file("p.jsonl", b"\n".join([json.dumps({"prompt": f"q{i}"}).encode() for i in range(3)]
                                        + [b'{"prompt": "\xff"}', b"{oops"]) + b"\n")
    rc, res, err = _prepare(w, bad, "data.on_malformed=skip", capsys=capsys)
    assert rc == 0 and "Traceback" not in err
    stats = json.loads((w.run / "prepare" / "stats.json").read_text())
    text = json.dumps(stats)
    assert f"{bad}:4: not UTF-8" in text and f"{bad}:5: malformed JSON" in text
    assert sum(1 for _ in (w.run / "prepare" / "train.jsonl").open()) == 3


def test_truncated_gz_with_skip_keeps_the_complete_lines(tmp_path, capsys):
    w = W(tmp_path, Path("-"), Path("-"))
    path = _truncated_gz(w)
    rc, res, err = _prepare(w, path, "data.on_malformed=skip", "data.dedupe=false", capsys=capsys)
    assert rc == 0, err
    kept = sum(1 for _ in (w.run / "prepare" / "train.jsonl").open())
    assert 0 < kept < 400
    assert "truncated gzip stream" in (w.run / "prepare" / "stats.json").read_text()


def test_log_level_debug_shows_the_traceback(tmp_path, capsys, monkeypatch):
    import dflashkit.stages.plan as plan

    def boom(cfg, rd, ctx):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(plan, "run", boom)
    assert main(["plan", f"run.run_dir={tmp_path}"]) == 1
    err = capsys.readouterr().err
    assert "kaboom" in err and "Traceback" not in err and "--log-level debug" in err
    assert main(["plan", f"run.run_dir={tmp_path}", "--log-level", "debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and 'raise RuntimeError("kaboom")' in err


def test_secrets_in_urls_are_redacted_in_files_and_logs(tmp_path, capsys):
    w = W(tmp_path, Path("-"), Path("-"))
    w.run_file("prepare/train.jsonl", json.dumps(CONV) + "\n")
    from dflashkit.testing.faults import FaultServer, Faults

    with FaultServer(Faults()) as srv:
        url = srv.url.replace("http://", "http://alice:hunter2@")
        rc = main(["generate", w.rd(), f"server.urls=['{url}']", "generate.progress=false",
                   "--log-level", "debug", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    for p in [*w.run.rglob("*")]:
        if p.is_file():
            assert b"hunter2" not in p.read_bytes() and b"sk-123" not in p.read_bytes(), p
    assert "hunter2" not in out + err and "sk-123" not in out + err
    manifest = json.loads((w.run / "generate" / "manifest.json").read_text())
    assert manifest["server_urls"][0].startswith("http://***@127.0.0.1:")
    from dflashkit.config import redact_url

    assert redact_url("https://u:p@h:1/v1?api_key=sk-1&x=2") == "https://***@h:1/v1?api_key=***&x=2"


def test_resume_under_a_changed_contract_is_refused(tmp_path, tiny_qwen3, capsys):
    from tests.helpers import make_run, overrides

    rd = make_run(tmp_path / "run", tiny_qwen3)
    assert main(["train", "--json", *overrides(rd, tiny_qwen3, train__max_steps=1)]) == 0
    state = json.loads(next((rd / "train" / "checkpoints").glob("step-*/state.json")).read_text())
    assert state["contract"]["block_size"] == json.loads((rd / "contract.json").read_text())["block_size"]
    c = json.loads((rd / "contract.json").read_text())
    c["mask_token_id"] = c["mask_token_id"] - 1  # still a valid unused row: only the contract differs
    (rd / "contract.json").write_text(json.dumps(c))
    capsys.readouterr()
    before = _snapshot(rd / "train")
    assert main(["train", "--json", *overrides(rd, tiny_qwen3, train__max_steps=2)]) == 2
    out, err = capsys.readouterr()
    assert "the drafter contract changed" in err and "mask_token_id" in err and "state.json" in err
    assert "Traceback" not in err
    assert _snapshot(rd / "train") == before


def test_run_stops_at_a_stage_that_finished_with_failures(tmp_path, capsys):
    w = W(tmp_path, Path("-"), Path("-"))
    w.run_file("prepare/train.jsonl", json.dumps(CONV) + "\n")
    rc = main(["run", w.rd(), "--from", "generate", "--to", "tokenize", "server.urls=[http://127.0.0.1:9/v1]",
               "server.model=m", "generate.max_retries=0", "generate.progress=false", "--json"])
    out, err = capsys.readouterr()
    assert rc == 4, err
    assert "1 of 1 turns failed" in err and "re-run to retry" in err and "Traceback" not in err
    assert not (w.run / "tokenize").exists()  # the next stage did not run
    state = json.loads((w.run / "pipeline.json").read_text()) if (w.run / "pipeline.json").exists() else {}
    assert "generate" not in state  # so the next `run` retries it


def test_eval_block_sizes_above_the_trained_one_warn_what_it_means(tmp_path, drafter_dir, tiny_qwen3, capsys):
    rc = main(["eval", str(drafter_dir), f"run.run_dir={tmp_path}", "eval.block_sizes=[4,8]", "--dry-run",
               f"target.path={tiny_qwen3}",
               "eval.prompts=" + str(W(tmp_path, Path("-"), Path("-")).file("e.jsonl", GOOD + "\n"))])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "eval.block_sizes: 8 > the drafter's trained block size 4" in err and "never trained" in err
    assert "eval.block_sizes: 4" not in err
    assert not (tmp_path / "eval").exists()  # a dry run writes nothing
