"""Named refusals instead of raw errors, silent fixes or wrong results (issue #33), through `cli.main`.

Each case asserts the exit code (2 config/usage, 3 missing upstream, per the README), that stderr names the
key, the file:line or the URL and the next step, that no traceback is printed, and that nothing was written
the user did not ask for. The last test runs one bad input per stage both ways: a dry run refuses what the
run refuses, with the same exit code and message (each stage's check function is called by both paths).
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from dflashkit.cli import main
from tests.helpers import make_run, overrides


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(root).rglob("*")) if p.is_file() and p.name != ".lock"}


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _refused(argv: list[str], code: int, capsys, *needles: str) -> tuple[str, dict]:
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == code, f"exit {rc}, expected {code}\n{err[-3000:]}"
    assert "Traceback" not in err, err
    for needle in needles:
        assert needle in err, f"{needle!r} not in stderr:\n{err}"
    res = json.loads(out.strip().splitlines()[-1])
    assert res["ok"] is False and res["exit_code"] == code
    return err, res


# --- capture.server_url that is not a running vLLM ------------------------------------------------------

PAGE = ("<!DOCTYPE html><html><head><title>Welcome to nginx!</title></head><body>" + "<p>filler</p>" * 400
        + "<p>DEEP-IN-THE-PAGE</p></body></html>").encode()


class _WebServer:
    """An HTTP server that is not an OpenAI server: every path answers a 404 web page."""

    def __enter__(self) -> str:
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_a):
                return

            def _page(self):
                self.send_response(404)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(PAGE)))
                self.end_headers()
                self.wfile.write(PAGE)

            do_GET = do_POST = _page  # noqa: N815

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize("stage", [["capture"], ["train", "train.features=engine"]], ids=["capture", "train"])
def test_engine_url_with_nothing_listening_names_the_key_and_what_to_start(stage, tmp_path, tiny_qwen3, capsys):
    rd = make_run(tmp_path / "run", tiny_qwen3)
    before = _snapshot(rd)
    url = f"http://127.0.0.1:{_closed_port()}/v1"
    _refused([*stage, *overrides(rd, tiny_qwen3), "capture.engine=vllm", f"capture.server_url={url}"], 3, capsys,
             f"capture.server_url: nothing answers at {url}", "HttpConnectError", "vllm serve",
             "extract_hidden_states", "capture.server_url=null")
    assert _snapshot(rd) == before and not (rd / "capture").exists() and not (rd / "train").exists()


@pytest.mark.parametrize("stage", [["capture"], ["train", "train.features=engine"]], ids=["capture", "train"])
def test_engine_url_of_a_web_server_says_what_answered_in_one_line(stage, tmp_path, tiny_qwen3, capsys):
    rd = make_run(tmp_path / "run", tiny_qwen3)
    before = _snapshot(rd)
    with _WebServer() as url:
        err, res = _refused([*stage, *overrides(rd, tiny_qwen3), "capture.engine=vllm",
                             f"capture.server_url={url}"], 2, capsys,
                            f"capture.server_url: {url} is not a vLLM server", "HTTP 404",
                            "text/html: 'Welcome to nginx!'", "vllm serve")
    assert "DEEP-IN-THE-PAGE" not in err and "filler" not in err and len(res["error"]) < 400, err
    assert _snapshot(rd) == before and not (rd / "capture").exists()


# --- NUL bytes, values that cannot be right, duplicate YAML keys ---------------------------------------


@pytest.mark.parametrize("where", ["yaml", "override"])
@pytest.mark.parametrize("key", ["run.run_dir", "target.path", "data.sources[0].path", "eval.prompts"])
def test_a_nul_byte_in_a_path_names_the_key(key, where, tmp_path, capsys):
    value = str(tmp_path / "a\0b")
    section, _, name = key.partition(".")
    if where == "yaml":
        if key == "data.sources[0].path":
            body = {"data": {"sources": [{"path": value}]}}
        else:
            body = {section: {name: value}}
        cfg = tmp_path / "run.yaml"
        cfg.write_text(json.dumps(body))  # JSON is YAML: "\u0000" is the NUL byte
        argv = ["plan", "-c", str(cfg)]
    else:
        ov = f"data.sources=[{{path: {json.dumps(value)}}}]" if key.startswith("data") else f"{key}={json.dumps(value)}"
        argv = ["plan", ov]
    before = _snapshot(tmp_path)
    _refused(argv, 2, capsys, f"{key}: contains a NUL byte")
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("override,key", [
    ("train.muon_momentum=1.5", "train.muon_momentum: must be in [0, 1)"),
    ("train.muon_momentum=-0.5", "train.muon_momentum: must be in [0, 1)"),
    ("train.forecast_tau=0.5", "train.forecast_tau: must be > 1"),
    ("train.forecast_tau=-2", "train.forecast_tau: must be > 1"),
    ("train.forecast_tau=nan", "train.forecast_tau: must be a finite number, got nan"),
    ("train.lr=.inf", "train.lr: must be a finite number, got inf"),
    ("train.betas=[0.9, .nan]", "train.betas[1]: must be a finite number"),
    ("train.betas=[0.9, 1.0]", "train.betas[1]: must be in [0, 1), got 1.0"),
    ("train.grad_clip=-1", "train.grad_clip: must be >= 0"),
    ("train.min_lr_ratio=2", "train.min_lr_ratio: must be in [0, 1]"),
    ("data.sources=[{path: x, weight: .nan}]", "data.sources[0].weight: must be a finite number"),
    ("server.timeout_s=.inf", "server.timeout_s: must be a finite number"),
    ("eval.tie_tolerance=.nan", "eval.tie_tolerance: must be a finite number"),
    ("export.check_atol=0", "export.check_atol: must be > 0"),
])
def test_values_that_cannot_be_right_are_refused_naming_the_key(override, key, tmp_path, tiny_qwen3, capsys):
    rd = make_run(tmp_path / "run", tiny_qwen3)
    before = _snapshot(rd)
    _refused(["train", *overrides(rd, tiny_qwen3), override], 2, capsys, key, "config error")
    assert _snapshot(rd) == before


def test_duplicate_yaml_keys_are_refused_with_both_lines(tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("train:\n  lr: 1e-3\n  max_steps: 3\n  lr: 2e-3\n"
                   "drafter:\n  block_size: 4\n"
                   "train:\n  batch_size: 2\n"
                   "data:\n  sources:\n    - {path: a, weight: 1, weight: 2}\n")
    _refused(["plan", "-c", str(cfg)], 2, capsys,
             f"{cfg}:4: `train.lr` is given twice (first at line 2)",
             f"{cfg}:7: `train` is given twice (first at line 1)",
             f"{cfg}:11: `data.sources[0].weight` is given twice (first at line 11)")


# --- bench recipe: every variant's feature layers are checked before the first trains ------------------


def test_bench_recipe_refuses_a_variant_whose_layers_were_not_captured_before_any_trains(tmp_path, tiny_qwen3,
                                                                                         capsys):
    rd = make_run(tmp_path / "run", tiny_qwen3)
    assert main(["capture", *overrides(rd, tiny_qwen3), "capture.dtype=float32"]) == 0, capsys.readouterr().err
    captured = json.loads((rd / "contract.json").read_text())["target_layer_ids"]
    other = [i for i in range(6) if i not in captured][:len(captured)]
    variants = f"bench.recipe_variants={{ok: [], other: ['drafter.target_layer_ids={json.dumps(other)}']}}"
    capsys.readouterr()
    _refused(["bench", "recipe", *overrides(rd, tiny_qwen3), "train.features=cached", variants], 2, capsys,
             "bench.recipe_variants.other", f"captured at target_layer_ids {captured}", "capture.extra_layer_ids")
    assert not (rd / "bench").exists(), "no variant trained, none was even set up"


# --- a dry run makes every check the run it previews makes ----------------------------------------------


def _port_in_use() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    _port_in_use.sock = s  # type: ignore[attr-defined]  # kept open for the case
    return s.getsockname()[1]


def _drafter(tmp_path: Path, target_dir: Path) -> Path:
    from dflashkit.config import TargetSection
    from dflashkit.export.hf import save_drafter
    from dflashkit.target.load import load_target
    from dflashkit.testing import random_drafter

    target = load_target(TargetSection(path=str(target_dir), device="cpu", dtype="float32"))
    return save_drafter(random_drafter(target, block_size=4), tmp_path / "drafter", dtype="float32")


def _world(tmp_path: Path, tiny_qwen3: Path, **contract) -> Path:
    rd = make_run(tmp_path / "run", tiny_qwen3, **contract)
    (rd / "prepare").mkdir()
    conv = {"id": "0000000000000001", "source": "t",
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    for name in ("train.jsonl", "heldout.jsonl"):
        (rd / "prepare" / name).write_text(json.dumps(conv) + "\n")
    return rd


def _other_target(tmp_path: Path) -> Path:
    from dflashkit.target.tiny import make_tiny_target

    return make_tiny_target(tmp_path / "narrow", "qwen3", hidden=48)


def _resume_case(tmp_path, tiny_qwen3, capsys) -> list[str]:
    rd = _world(tmp_path, tiny_qwen3)
    assert main(["train", *overrides(rd, tiny_qwen3, train__max_steps=1)]) == 0, capsys.readouterr().err
    return ["train", *overrides(rd, tiny_qwen3, train__max_steps=2), "train.optimizer=muon"]


def _vllm_missing(monkeypatch, tmp_path):
    from dflashkit.engines import vllm

    monkeypatch.setenv(vllm.DIR_ENV, str(tmp_path / "no-engine"))
    monkeypatch.delenv(vllm.AUTO_INSTALL_ENV, raising=False)


# stage → (argv builder, exit code, a needle of the message); every command of the stage table is here or
# in DRY_RUN_IS_THE_RUN / NOT_PREVIEWED
DRY_RUN_CASES = {
    "probe": (lambda t, q, c, m: ["probe", str(t / "nope")], 2, "nope"),
    "prepare": (lambda t, q, c, m: ["prepare", f"run.run_dir={t / 'run'}"], 2, "data.sources"),
    "generate": (lambda t, q, c, m: _vllm_missing(m, t) or ["generate", f"run.run_dir={_world(t, q)}",
                                                             f"target.path={q}", "server.engine=vllm"],
                 3, "dflashkit engines install vllm"),
    "tokenize": (lambda t, q, c, m: ["tokenize", f"run.run_dir={t / 'run'}", f"target.path={q}"], 3,
                 "dflashkit generate"),
    "capture": (lambda t, q, c, m: ["capture", *overrides(_world(t, q), q), "capture.engine=vllm",
                                    f"capture.server_url=http://127.0.0.1:{_closed_port()}/v1"],
                3, "nothing answers"),
    "train": (lambda t, q, c, m: ["train", *overrides(_world(t, q), q), "drafter.block_size=8"], 2,
              "drafter.block_size: 8 in the config, 4 in"),
    "train-resume": (lambda t, q, c, m: _resume_case(t, q, c), 2, "train.optimizer: 'adamw' in the checkpoint"),
    "eval": (lambda t, q, c, m: ["eval", str(_drafter(t, q)), f"run.run_dir={_world(t, q)}",
                                 f"target.path={_other_target(t)}"], 2, "does not fit the target"),
    "export": (lambda t, q, c, m: (t / "mine").mkdir() or (t / "mine" / "notes.txt").write_text("x") and
               ["export", str(_drafter(t, q)), f"run.run_dir={t / 'run'}", f"export.out_dir={t / 'mine'}"],
               2, "refusing to replace"),
    "import": (lambda t, q, c, m: (t / "taken").mkdir() and None or
               ["import", str(_drafter(t, q)), str(t / "taken"), f"run.run_dir={t / 'run'}", f"target.path={q}"],
               2, "already exists"),
    "verify-engine": (lambda t, q, c, m: _vllm_missing(m, t) or
                      ["verify-engine", str(_drafter(t, q)), f"run.run_dir={_world(t, q)}", f"target.path={q}"],
                      3, "verify-engine needs vLLM"),
    "serve": (lambda t, q, c, m: ["serve", str(q), f"serve.port={_port_in_use()}"], 2, "serve.port: cannot bind"),
    "bench-serve": (lambda t, q, c, m: _vllm_missing(m, t) or
                    ["bench", "serve", f"run.run_dir={_world(t, q)}", f"target.path={q}", "server.engine=vllm"],
                    3, "bench serve with server.engine=vllm"),
    "bench-decode": (lambda t, q, c, m: ["bench", "decode", str(_drafter(t, q)), f"run.run_dir={_world(t, q)}",
                                         f"target.path={_other_target(t)}"], 2, "does not fit the target"),
    "bench-tokenize": (lambda t, q, c, m: ["bench", "tokenize", f"run.run_dir={t / 'run'}", f"target.path={q}"],
                       3, "dflashkit generate"),
    "bench-recipe": (lambda t, q, c, m: ["bench", "recipe", *overrides(_world(t, q), q),
                                         "bench.recipe_variants={x: [drafter.block_size=0]}"], 2,
                     "bench.recipe_variants.x"),
    "report": (lambda t, q, c, m: ["report", f"run.run_dir={t / 'run'}"], 3, "dflashkit train"),
    "gpu-check": (lambda t, q, c, m: ["gpu-check", str(t / "gpu-out"), "flex", "no-such-check"], 2,
                  "unknown GPU check no-such-check"),
    "learn": (lambda t, q, c, m: (t / "records").mkdir() or
              ["learn", "--records", str(t / "records"), f"run.run_dir={t / 'run'}", f"target.path={q}"],
              3, "dflashkit probe"),  # a run dir without contract.json
    "flywheel": (lambda t, q, c, m: ["flywheel", f"run.run_dir={_world(t, q)}", f"target.path={q}"], 2,
                 "learn.traffic"),  # nothing to replay
    "record": (lambda t, q, c, m: ["record", "--upstream", f"http://127.0.0.1:{_closed_port()}/v1",
                                   f"record.dir={t / 'records'}", "--port", str(_port_in_use())],
               2, "record.port: cannot bind"),
}
# read-only commands whose dry run is their run (they change nothing either way)
DRY_RUN_IS_THE_RUN = {"doctor", "plan", "engines"}
# `run --dry-run` lists what each stage would do; a stage's own checks need the outputs of the stages before it
NOT_PREVIEWED = {"run"}


def test_every_command_has_a_dry_run_case():
    from dflashkit.stage_table import TABLE

    covered = {k.split("-")[0] if k.startswith(("train", "bench")) else k for k in DRY_RUN_CASES}
    assert {s.name for s in TABLE} == covered | DRY_RUN_IS_THE_RUN | NOT_PREVIEWED


@pytest.mark.parametrize("case", sorted(DRY_RUN_CASES))
def test_a_dry_run_refuses_what_the_run_refuses(case, tmp_path, tiny_qwen3, capsys, monkeypatch):
    build, code, needle = DRY_RUN_CASES[case]
    argv = build(tmp_path, tiny_qwen3, capsys, monkeypatch)
    capsys.readouterr()
    before = _snapshot(tmp_path)
    _, dry = _refused([*argv, "--dry-run"], code, capsys, needle)
    assert _snapshot(tmp_path) == before, "a dry run writes nothing"
    _, real = _refused(argv, code, capsys, needle)
    assert dry["error"] == real["error"] and dry["hint"] == real["hint"]
