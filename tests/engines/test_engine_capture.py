"""`capture.engine: vllm` against a fake engine (a tiny HF target behind /v1/completions writing vLLM's
hidden-states files): the same shards as local capture, ids checked, resume requests each sample once.

The real vLLM runs the same checks in tests/engines/test_vllm_capture.py (`make test-engine`).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from dflashkit.cli import main
from dflashkit.engines.capture import spool_root
from tests.harness.fake_engine import FakeHiddenStatesEngine
from tests.helpers import make_run, overrides


def _aux(rd, target):
    from dflashkit.target.load import text_config_dict

    n = text_config_dict(target)["num_hidden_layers"]
    return [i + 1 for i in json.loads((rd / "contract.json").read_text())["target_layer_ids"]] + [n]


def _tensors(rd):
    out = {}
    for p in sorted((rd / "capture").glob("shard-*.safetensors")):
        with safe_open(str(p), "pt") as fh:
            out[p.name] = {k: fh.get_tensor(k) for k in fh.keys()}
    return out


def _ok(argv, capsys):
    rc = main(argv)
    out = capsys.readouterr()
    assert rc == 0, f"{argv[0]} exited {rc}\n{out.err[-3000:]}"
    return json.loads(out.out.strip().splitlines()[-1])


@pytest.mark.parametrize("extra", [["train.labels=target"], ["train.labels=target", "train.loss=ce+kl"]],
                         ids=["labels", "labels+kl"])
def test_engine_capture_equals_local_capture_and_trains_the_same(tmp_path, tiny_qwen3, capsys, extra):
    loc, eng = make_run(tmp_path / "local", tiny_qwen3), make_run(tmp_path / "engine", tiny_qwen3)
    common = ["capture.dtype=float32", *extra]
    _ok(["capture", "--json", *overrides(loc, tiny_qwen3), *common], capsys)
    with FakeHiddenStatesEngine(tiny_qwen3, aux=_aux(eng, tiny_qwen3), storage=tmp_path / "hs") as fake:
        res = _ok(["capture", "--json", *overrides(eng, tiny_qwen3), *common, "capture.engine=vllm",
                   f"capture.server_url={fake.url}", "capture.concurrency=2"], capsys)
        assert fake.requests == 8 and res["written"] == 2  # one request per sample
    assert not list((tmp_path / "hs").glob("*.safetensors")), "engine files are removed once ingested"
    assert not spool_root(eng / "capture").exists()
    a, b = _tensors(loc), _tensors(eng)
    # the local capture also holds the held-out samples' greedy paths (an engine gives none)
    assert a.keys() == b.keys() and all(a[s].keys() - {"path_ids"} == b[s].keys() for s in a)
    for s in a:
        assert torch.equal(a[s]["offsets"], b[s]["offsets"])
        assert torch.equal(a[s]["next_ids"], b[s]["next_ids"]), s  # labels from the head-only load
        for k in ("features", "last_hidden"):
            if k in a[s]:
                d = (a[s][k] - b[s][k]).abs().max().item()
                assert d <= 1e-4 * a[s][k].abs().max().item(), (s, k, d)
    # a short training run on engine features matches the same run on local features step by step
    for rd in (loc, eng):
        _ok(["train", "--json", *overrides(rd, tiny_qwen3, train__max_steps=3, train__features="cached"), *extra],
            capsys)
    # training steps, and the held-out blocks scored the same way (tau_raw: the training labels; the local run
    # scores τ on the target's path, the engine run on the positions still on it)
    def losses(rd):
        rows = [json.loads(x) for x in (rd / "train" / "metrics.jsonl").read_text().splitlines()]
        return [r["tau_raw"] if r.get("split") == "heldout" else r["loss"] for r in rows]

    la, lb = losses(loc), losses(eng)
    assert torch.allclose(torch.tensor(la), torch.tensor(lb), atol=1e-4), (la, lb)


def test_engine_that_computes_other_token_ids_is_refused(tmp_path, tiny_qwen3, capsys):
    rd = make_run(tmp_path / "r", tiny_qwen3)
    with FakeHiddenStatesEngine(tiny_qwen3, aux=_aux(rd, tiny_qwen3), storage=tmp_path / "hs", token_offset=1) as fake:
        rc = main(["capture", "--json", *overrides(rd, tiny_qwen3), "capture.engine=vllm",
                   f"capture.server_url={fake.url}"])
    err = capsys.readouterr().err
    assert rc == 1 and "differ from the" in err and "position 0" in err, err[-2000:]
    assert not list((rd / "capture").glob("shard-*.safetensors"))


def test_engine_capture_resumes_each_sample_exactly_once(tmp_path, tiny_qwen3, capsys, monkeypatch):
    from dflashkit.engines import capture as ec

    rd = make_run(tmp_path / "r", tiny_qwen3)
    ov = [*overrides(rd, tiny_qwen3), "capture.dtype=float32", "capture.engine=vllm", "capture.concurrency=1"]
    real = ec.Spool.write
    calls = {"n": 0}

    def dying(self, i, row, n):
        calls["n"] += 1
        if calls["n"] == 6:  # killed after five samples: shard 0 complete, part of shard 1 spooled
            raise KeyboardInterrupt
        real(self, i, row, n)

    with FakeHiddenStatesEngine(tiny_qwen3, aux=_aux(rd, tiny_qwen3), storage=tmp_path / "hs") as fake:
        monkeypatch.setattr(ec.Spool, "write", dying)
        assert main(["capture", "--json", *ov, f"capture.server_url={fake.url}"]) == 130
        assert (rd / "capture" / "shard-00000.safetensors").is_file()
        assert not (rd / "capture" / "shard-00001.safetensors").exists()
        spooled = len(list((spool_root(rd / "capture") / "shard-00001").glob("0*.safetensors")))
        assert 1 <= spooled <= 3  # rows already in flight may finish after the failing one
        monkeypatch.setattr(ec.Spool, "write", real)
        before = fake.requests
        res = _ok(["capture", "--json", *ov, f"capture.server_url={fake.url}"], capsys)
        assert fake.requests - before == 4 - spooled and res["written"] == 1 and res["skipped"] == 1
    clean = make_run(tmp_path / "clean", tiny_qwen3)
    with FakeHiddenStatesEngine(tiny_qwen3, aux=_aux(clean, tiny_qwen3), storage=tmp_path / "hs2") as fake:
        _ok(["capture", "--json", *overrides(clean, tiny_qwen3), "capture.dtype=float32", "capture.engine=vllm",
             f"capture.server_url={fake.url}"], capsys)
    a, b = _tensors(rd), _tensors(clean)
    for s in a:
        assert all(torch.equal(a[s][k], b[s][k]) for k in a[s]), s


@pytest.mark.parametrize("dies_at", [1, 2], ids=["first-shard", "last-shard"])
def test_kill_between_a_shard_write_and_its_spool_drop_leaves_no_spool(tmp_path, tiny_qwen3, capsys, monkeypatch,
                                                                       dies_at):
    """The window the kill -9 test in test_vllm_capture.py once hit: the shard is written (atomically), its
    spool is not yet dropped; the re-run skips that shard and must still drop its spool (also when the
    killed shard was the last one and the re-run has nothing left to capture)."""
    from dflashkit.engines import capture as ec

    rd = make_run(tmp_path / "r", tiny_qwen3)
    ov = [*overrides(rd, tiny_qwen3), "capture.dtype=float32", "capture.engine=vllm", "capture.concurrency=1"]
    real = ec.Spool.remove
    calls = {"n": 0}

    def dying(self):
        calls["n"] += 1
        if calls["n"] == dies_at:
            raise KeyboardInterrupt
        real(self)

    with FakeHiddenStatesEngine(tiny_qwen3, aux=_aux(rd, tiny_qwen3), storage=tmp_path / "hs") as fake:
        monkeypatch.setattr(ec.Spool, "remove", dying)
        assert main(["capture", "--json", *ov, f"capture.server_url={fake.url}"]) == 130
        shards = sorted(p.name for p in (rd / "capture").glob("shard-*.safetensors"))
        assert len(shards) == dies_at and (spool_root(rd / "capture") / f"shard-{dies_at - 1:05d}").is_dir()
        monkeypatch.setattr(ec.Spool, "remove", real)
        before = fake.requests
        res = _ok(["capture", "--json", *ov, f"capture.server_url={fake.url}"], capsys)
        assert res["skipped"] == dies_at and res["written"] == 2 - dies_at, res
        assert fake.requests - before == 4 * (2 - dies_at)  # the written shard's rows are not asked for again
    assert not spool_root(rd / "capture").exists(), list((rd / "capture").rglob("*"))


def test_dry_run_prints_the_vllm_serve_flags(tmp_path, tiny_qwen3, capsys):
    rd = make_run(tmp_path / "r", tiny_qwen3)
    aux = _aux(rd, tiny_qwen3)
    with FakeHiddenStatesEngine(tiny_qwen3, aux=aux, storage=tmp_path / "hs") as fake:
        assert main(["capture", "--dry-run", *overrides(rd, tiny_qwen3), "capture.engine=vllm",
                     f"capture.server_url={fake.url}"]) == 0
    out = capsys.readouterr().out
    line = next(x.strip() for x in out.splitlines() if x.strip().startswith("vllm serve"))
    assert '"method": "extract_hidden_states"' in line and "ExampleHiddenStatesConnector" in line
    assert f'"eagle_aux_hidden_state_layer_ids": {json.dumps(aux)}' in line, line
    assert not (rd / "capture").exists()  # a dry run creates nothing
    # nothing answering at the URL: the dry run refuses as the run would (exit 3) and names the same flags
    assert main(["capture", "--dry-run", *overrides(rd, tiny_qwen3), "capture.engine=vllm",
                 "capture.server_url=http://127.0.0.1:9/v1"]) == 3
    err = capsys.readouterr().err
    assert "capture.server_url: nothing answers at http://127.0.0.1:9/v1" in err and line in err, err
    assert not (rd / "capture").exists()
