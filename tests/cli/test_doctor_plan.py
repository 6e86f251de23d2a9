"""doctor (packages, tools, a real HTTP endpoint) and plan (memory/disk/mode estimates)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from dflashkit.cli import main
from dflashkit.config import config_from_dict

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "configs"


def last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.fixture
def models_server():
    """A real OpenAI-style /v1/models endpoint on 127.0.0.1 that records the auth header."""
    seen: list[str | None] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server API
            seen.append(self.headers.get("Authorization"))
            body = json.dumps({"object": "list", "data": [{"id": "tiny-qwen3", "object": "model"}]}).encode()
            self.send_response(200 if self.path == "/v1/models" else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/v1", seen
    srv.shutdown()
    srv.server_close()


def test_doctor_packages_tools_and_endpoints(models_server, tmp_path, capsys, monkeypatch):
    url, seen = models_server
    monkeypatch.setenv("DFK_TEST_KEY", "sk-secret-123")
    dead = "http://127.0.0.1:1/v1"
    assert main(["doctor", f"server.urls=[{url},{dead}]", "server.api_key_env=DFK_TEST_KEY",
                 "--run-dir", str(tmp_path), "--json"]) == 1  # unhealthy: the dead endpoint
    out = capsys.readouterr().out
    assert "sk-secret-123" not in out
    res = json.loads(out.strip().splitlines()[-1])
    checks = {c["name"]: c for c in res["checks"]}
    for name in ("python", "torch", "transformers", "tokenizers", "safetensors", "pyarrow"):
        assert checks[name]["status"] == "ok", checks[name]
    assert checks["tiktoken"]["status"] == "absent" and checks["tiktoken"]["fix"] == "pip install tiktoken"
    assert checks["torchrun"]["status"] == "ok" and "asset cache" in checks and "disk" in checks
    assert checks[f"endpoint {url}"]["status"] == "ok" and "tiny-qwen3" in checks[f"endpoint {url}"]["detail"]
    assert seen == ["Bearer sk-secret-123"]
    assert checks[f"endpoint {dead}"]["status"] == "error" and checks[f"endpoint {dead}"]["fix"]
    assert res["healthy"] is False and res["problems"] == [f"endpoint {dead}"]
    assert main(["doctor", "--run-dir", str(tmp_path), "target.path=/nonexistent/model"]) == 1
    res = last_json(capsys)
    assert res["problems"] == ["target.path"]


def test_drafter_params_formula_is_exact(tiny_qwen3):
    from dflashkit.sizing.budget import drafter_params
    from dflashkit.inspect.config_facts import read_model_facts
    from dflashkit.inspect.contract import derive_contract
    from dflashkit.inspect.tokenizer_facts import read_tokenizer_facts
    from dflashkit.model.drafter import DFlashDraftModel

    d = config_from_dict({"drafter": {"num_draft_layers": 2, "num_target_features": 3}}).drafter
    c = derive_contract(d, read_model_facts(tiny_qwen3), read_tokenizer_facts(tiny_qwen3))
    model = DFlashDraftModel(c)
    assert drafter_params(c) == sum(p.numel() for p in model.parameters())


def test_dflash2_params_formula_is_exact_and_plan_shows_the_looked_up_params(tiny_qwen3, tmp_path, capsys):
    from dflashkit.sizing.budget import drafter_params, lookup_params
    from dflashkit.inspect.config_facts import read_model_facts
    from dflashkit.inspect.contract import derive_contract
    from dflashkit.inspect.tokenizer_facts import read_tokenizer_facts
    from dflashkit.model.dflash2 import DFlash2DraftModel

    d = config_from_dict({"drafter": {"type": "dflash2", "num_draft_layers": 2, "conv_kernel_size": 3,
                                      "selector_rank": 24}}).drafter
    c = derive_contract(d, read_model_facts(tiny_qwen3), read_tokenizer_facts(tiny_qwen3))
    model = DFlash2DraftModel(c)
    assert drafter_params(c) == sum(p.numel() for p in model.parameters())
    assert lookup_params(c) == model.candidate_selector.predecessor_codebook.numel() * 2
    args = ["8x141", "data.num_prompts=1000", "data.mean_tokens=2000", "--run-dir", str(tmp_path)]
    assert main(["plan", str(FIXTURES / "kimi-k2.6"), *args, "--json"]) == 0
    dflash = last_json(capsys)["plan"]["drafter"]
    assert main(["plan", str(FIXTURES / "kimi-k2.6"), *args, "--json", "drafter.type=dflash2"]) == 0
    d2 = last_json(capsys)["plan"]["drafter"]
    assert d2["lookup_params"] == 2 * 163_840 * 256 and dflash["lookup_params"] == 0
    assert d2["params"] - dflash["params"] > 2 * 163_840 * 256
    assert main(["plan", str(FIXTURES / "kimi-k2.6"), *args, "drafter.type=dflash2"]) == 0
    assert "(of which 83.9M looked up, not multiplied)" in capsys.readouterr().out


def test_plan_modes_qwen3_and_kimi(tmp_path, capsys):
    q = str(FIXTURES / "qwen3-8b")
    args = ["data.num_prompts=1000", "data.mean_tokens=2000", "--run-dir", str(tmp_path), "--json"]
    assert main(["plan", q, "8x80", *args]) == 0
    r = last_json(capsys)
    p = r["plan"]
    assert (r["gpus"], r["gpu_mem_gib"], r["tokens"], r["sequences"]) == (8, 80.0, 2_000_000, 1000)
    assert p["features"]["bytes_per_token"] == 5 * 4096 * 2  # n_feat · H · bf16
    assert p["features"]["total_gib"] == round(5 * 4096 * 2 * 2_000_000 / 2**30, 2)
    assert p["recommended"] == "online-replicate" and abs(p["target"]["weights_gib"] - 8.19e9 * 2 / 2**30) < 0.05
    assert not (tmp_path / "contract.json").exists()  # plan writes nothing
    assert main(["plan", q, "8x80", *args, "capture.extra_layer_ids=[0, 2, 3]"]) == 0  # + the layers not already there
    wide = last_json(capsys)["plan"]
    from dflashkit.family.contract import build_target_layer_ids

    ids = build_target_layer_ids(36, 5)  # Qwen3-8B: 36 layers, 5 features
    assert wide["features"]["bytes_per_token"] == (5 + len({0, 2, 3} - set(ids))) * 4096 * 2 > 5 * 4096 * 2
    assert {m["mode"]: m for m in wide["modes"]}["cached"]["disk_bytes"] == wide["features"]["bytes_per_token"] * 2_000_000
    k = str(FIXTURES / "kimi-k2.6")
    assert main(["plan", k, "8x141", *args]) == 0
    modes = {m["mode"]: m for m in last_json(capsys)["plan"]["modes"]}
    # a local capture loads the INT4 target dequantized (bf16, ~1.9 TiB); vLLM serves the 4-bit weights
    assert not modes["online-replicate"]["fits"] and not modes["cached"]["capture_fits"]
    assert main(["plan", k, "8x141", *args, "capture.engine=vllm"]) == 0
    assert {m["mode"]: m for m in last_json(capsys)["plan"]["modes"]}["cached"]["capture_fits"]
    assert modes["online-replicate"]["per_gpu_gib"] > modes["online-shard"]["per_gpu_gib"] > \
        modes["cached"]["per_gpu_gib"]
    assert main(["plan", k, "1x80", *args]) == 0
    assert last_json(capsys)["plan"]["recommended"] is None  # a 1T target on one GPU: nothing fits


def test_plan_loss_chunk_bound_is_tight(tmp_path, capsys):
    """Using exactly the reported max chunk fits; one block more does not."""
    s = str(FIXTURES / "smollm2-135m")
    base = [s, "1x4", "data.num_prompts=100", "data.mean_tokens=4096", "train.batch_size=2"]
    flags = ["--run-dir", str(tmp_path), "--json"]
    assert main(["plan", *base, *flags]) == 0
    replicate = next(m for m in last_json(capsys)["plan"]["modes"] if m["mode"] == "online-replicate")
    best = replicate["max_loss_chunk_blocks"]
    assert 0 < best < 1024
    assert main(["plan", *base, f"train.loss_chunk_blocks={best}", *flags]) == 0
    assert next(m for m in last_json(capsys)["plan"]["modes"] if m["mode"] == "online-replicate")["fits"]
    assert main(["plan", *base, f"train.loss_chunk_blocks={best + 1}", *flags]) == 0
    assert not next(m for m in last_json(capsys)["plan"]["modes"] if m["mode"] == "online-replicate")["fits"]


def test_plan_reads_run_dir_contract_else_exit_3(tmp_path, capsys, tiny_qwen3):
    run = tmp_path / "run"
    assert main(["plan", "2x24", "--run-dir", str(run)]) == 3
    assert "dflashkit probe" in last_json(capsys)["hint"]
    assert main(["probe", str(tiny_qwen3), "--run-dir", str(run), "--json"]) == 0
    capsys.readouterr()
    (run / "prepare").mkdir()
    (run / "prepare" / "train.jsonl").write_text('{"id": "a"}\n{"id": "b"}\n{"id": "c"}\n')
    assert main(["plan", "2x24", "data.mean_tokens=100", "--run-dir", str(run), "--json"]) == 0
    r = last_json(capsys)
    assert r["source"] == str(run / "contract.json") and (r["sequences"], r["tokens"]) == (3, 300)
    assert r["plan"]["drafter"]["params"] > 0 and r["plan"]["target"]["params_total"] > 0
    assert main(["plan", "0x80", "--run-dir", str(run)]) == 2


def test_run_dry_run_reports_the_plan_estimates(tmp_path, capsys):
    """`run --dry-run`'s plan_estimates is what `plan` prints for the same config (it was always null)."""
    args = ["target.path=" + str(FIXTURES / "qwen3-8b"), "data.num_prompts=1000", "data.mean_tokens=2000",
            "--run-dir", str(tmp_path / "run"), "--json"]
    assert main(["plan", *args]) == 0
    plan = last_json(capsys)
    assert main(["run", "--dry-run", *args]) == 0
    est = last_json(capsys)["plan_estimates"]
    assert est is not None and est["plan"] == plan["plan"] and est["gpus"] == plan["gpus"]
    assert (est["tokens"], est["sequences"]) == (2_000_000, 1000) and not (tmp_path / "run").exists()
