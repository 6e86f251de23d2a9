"""`train.features: engine` against the real vLLM CPU build (marker `engine`; `make test-engine`).

One vLLM (started here, `extract_hidden_states` + dflashkit's CPU-safe connector, as the kill test in
test_vllm_capture.py does) serves SmolLM2-135M-Instruct in float32 to two run dirs on the same data:
  - `capture` through it (capture.server_url) and 4 steps of `train.features=cached`;
  - 4 steps of `train.features=engine` (rows requested as training consumes them, bounded queue).
The losses agree step by step to rtol 1e-5 (the rows are the same requests to the same engine; vLLM may
batch the concurrent requests differently the second time, which moves fp32 features by ~1e-6 relative),
the measured queue peak is within prefetch × the largest micro-batch's rows and below the whole cache.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflashkit.cli import main
from tests.helpers import engine_queue_bound, make_run, overrides

pytestmark = pytest.mark.engine

RTOL = 1e-5


def _ok(argv, capsys):
    rc = main(argv)
    out = capsys.readouterr()
    assert rc == 0, f"{argv[0]} exited {rc}\n{out.err[-4000:]}"
    return json.loads(out.out.strip().splitlines()[-1])


def _losses(rd: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (rd / "train" / "metrics.jsonl").read_text().splitlines()]


def test_engine_fed_training_matches_cached_training_with_a_bounded_queue(tmp_path, smollm2_dir, capsys):
    from dflashkit.engines import hidden_states as hs_io
    from dflashkit.engines import vllm

    cached = make_run(tmp_path / "cached", smollm2_dir, n_feat=2)
    fed = make_run(tmp_path / "fed", smollm2_dir, n_feat=2)
    contract = json.loads((cached / "contract.json").read_text())
    aux = hs_io.aux_layer_ids(contract["target_layer_ids"], num_layers=30, with_last=True)
    hs_io.install_connector(vllm.install())
    with vllm.start(smollm2_dir, dtype="float32", served_name="target", log_path=tmp_path / "engine.log",
                    extra_args=hs_io.serve_args(aux, (tmp_path / "engine-files").resolve(), cpu=True)) as eng:
        common = ["target.dtype=float32", "capture.dtype=float32", "train.labels=target", "capture.concurrency=2",
                  "capture.engine=vllm", f"capture.server_url={eng.base_url}", "server.model=target"]
        _ok(["capture", "--json", *overrides(cached, smollm2_dir), *common], capsys)
        _ok(["train", "--json", *overrides(cached, smollm2_dir), *common, "train.features=cached"], capsys)
        res = _ok(["train", "--json", *overrides(fed, smollm2_dir), *common, "train.features=engine",
                   "train.engine_prefetch=2"], capsys)
    la, lb = _losses(cached), _losses(fed)
    assert len(la) == len(lb) == 5, (la, lb)  # 4 steps + the final held-out evaluation
    assert torch.allclose(torch.tensor(lb), torch.tensor(la), rtol=RTOL, atol=0), (la, lb)
    cache_bytes = sum(p.stat().st_size for p in (cached / "capture").glob("shard-*.safetensors"))
    bound = engine_queue_bound(cached, [*overrides(cached, smollm2_dir), *common], prefetch=2)
    peak = res["engine_peak_disk_bytes"]
    print(f"engine-fed training: peak queue {peak} B on disk, bound {bound} B, whole cache {cache_bytes} B")
    assert 0 < peak <= bound < cache_bytes, (peak, bound, cache_bytes)
    assert res["engine_rows_requested"] == 8, res  # 4 steps × batch 2; nothing requested twice
    assert not (fed / "train" / "engine-queue").exists() and not (fed / "capture").exists()
