"""`dflashkit bench generate|serve` produce their measurements (speed itself is not asserted here)."""

from __future__ import annotations

import json

import pytest

from dflashkit.cli import main
from dflashkit.testing.faults import FaultServer, Faults


def _last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_bench_generate_small(tmp_path, capsys):
    rc = main(["bench", "generate", f"run.run_dir={tmp_path}", "bench.generate_requests=200",
               "bench.generate_concurrency=16", "--json"])
    out = _last_json(capsys)
    assert rc == 0, out
    for path in ("client", "stage"):
        assert out[path]["requests"] == 200 and out[path]["requests_per_s"] > 0
        assert out[path]["client_cpu_us_per_request"] > 0
    assert json.loads((tmp_path / "bench" / "generate.json").read_text())["client"]["requests"] == 200


def test_bench_serve_two_endpoints_speedup(tmp_path, capsys):
    # 100 ms per request against none: the fast endpoint wins unless the client itself needs > 60 ms a request
    # (a timing margin that survives a loaded machine; the exact ratio is checked against the rows below)
    slow, fast = Faults(latency_s=(0.1, 0.1)), Faults(latency_s=(0.0, 0.0))
    with FaultServer(slow) as a, FaultServer(fast) as b:
        rc = main(["bench", "serve", f"run.run_dir={tmp_path}", f"bench.urls=[{a.url},{b.url}]",
                   "bench.concurrency=[1,4]", "bench.requests=12", "bench.warmup=2", "bench.max_tokens=8"])
        out = _last_json(capsys)
    assert rc == 0, out
    assert [len(e["sweep"]) for e in out["endpoints"]] == [2, 2]
    for ep in out["endpoints"]:
        for row in ep["sweep"]:
            assert row["errors"] == 0 and row["completion_tokens"] > 0
            assert row["latency_p50_s"] <= row["latency_p90_s"] <= row["latency_p99_s"]
    assert all(row["latency_p50_s"] >= 0.1 for row in out["endpoints"][0]["sweep"])  # the injected latency
    for sp, first, second in zip(out["speedup"], *(ep["sweep"] for ep in out["endpoints"])):
        assert sp["concurrency"] == first["concurrency"] == second["concurrency"]
        ratio = second["output_tokens_per_s"] / first["output_tokens_per_s"]
        assert sp["output_tokens_per_s"] == pytest.approx(ratio, abs=1e-3)
        assert sp["output_tokens_per_s"] > 1.5  # the endpoint without latency wins
    assert a.stats["requests"] == b.stats["requests"] == 2 * (12 + 2)


def test_bench_serve_whose_requests_fail_is_exit_4_not_a_silent_zero(tmp_path, capsys):
    """Every request failing (a server that answers 500 to all of them) is a partial failure (exit 4): the
    rows are written, and the message says how many failed."""
    with FaultServer(Faults(always_fail=1.0)) as a:
        rc = main(["bench", "serve", f"run.run_dir={tmp_path}", f"bench.urls=[{a.url}]", "bench.concurrency=[2]",
                   "bench.requests=4", "bench.warmup=0", "bench.max_tokens=4", "--json"])
        out = _last_json(capsys)
    assert rc == 4, out
    assert "4 of 4 timed requests failed" in out["error"]
    saved = json.loads((tmp_path / "bench" / "serve.json").read_text())
    assert saved["endpoints"][0]["sweep"][0]["errors"] == 4
