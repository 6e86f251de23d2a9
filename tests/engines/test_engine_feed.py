"""`train.features: engine` against a fake engine (a tiny HF target behind /v1/completions writing vLLM's
hidden-states files): the rows training gets from the engine are the rows cached training reads, so the
losses are equal step by step; the on-disk queue stays within its bound and is emptied; a resumed run
requests only the rows of the steps it still has to train; bad configs exit 2 naming the keys.

The real vLLM runs the same comparison in tests/engines/test_vllm_feed.py (`make test-engine`).
"""

from __future__ import annotations

import json
import shutil
import time
from types import SimpleNamespace

import pytest
import torch

from dflashkit.cli import main
from tests.harness.fake_engine import FakeHiddenStatesEngine
from tests.helpers import engine_queue_bound, make_run, overrides


def _aux(rd, target):
    from dflashkit.target.load import text_config_dict

    n = text_config_dict(target)["num_hidden_layers"]
    return [i + 1 for i in json.loads((rd / "contract.json").read_text())["target_layer_ids"]] + [n]


def _ok(argv, capsys):
    rc = main(argv)
    out = capsys.readouterr()
    assert rc == 0, f"{argv[0]} exited {rc}\n{out.err[-3000:]}"
    return json.loads(out.out.strip().splitlines()[-1])


def _losses(rd):
    return [(json.loads(x).get("step"), json.loads(x)["loss"])
            for x in (rd / "train" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("extra", [["train.labels=target"], ["train.labels=target", "train.loss=ce+kl"]],
                         ids=["labels", "labels+kl"])
def test_engine_fed_training_equals_cached_training_with_a_bounded_queue(tmp_path, tiny_qwen3, capsys, extra):
    cached, fed = make_run(tmp_path / "cached", tiny_qwen3), make_run(tmp_path / "fed", tiny_qwen3)
    common = ["capture.dtype=float32", "capture.concurrency=2", *extra]
    with FakeHiddenStatesEngine(tiny_qwen3, aux=_aux(fed, tiny_qwen3), storage=tmp_path / "hs") as fake:
        url = f"capture.server_url={fake.url}"
        _ok(["capture", "--json", *overrides(cached, tiny_qwen3), *common, "capture.engine=vllm", url], capsys)
        _ok(["train", "--json", *overrides(cached, tiny_qwen3), *common, "train.features=cached"], capsys)
        before = fake.requests
        res = _ok(["train", "--json", *overrides(fed, tiny_qwen3), *common,
                   "train.features=engine", "capture.engine=vllm", url, "train.engine_prefetch=1"], capsys)
        # 4 steps × 2 samples through the queue; the 2 held-out samples of the final evaluation on demand
        assert res["engine_rows_requested"] == 8 and res["engine_rows_on_demand"] == 2, res
        assert fake.requests - before == 10
    assert _losses(fed) == _losses(cached)  # the same rows in the same order: bit-identical losses
    cache_bytes = sum(p.stat().st_size for p in (cached / "capture").glob("shard-*.safetensors"))
    peak = res["engine_peak_disk_bytes"]
    bound = engine_queue_bound(cached, overrides(cached, tiny_qwen3) + common, prefetch=1)
    assert 0 < peak <= bound < cache_bytes, (peak, bound, cache_bytes)
    assert not (fed / "train" / "engine-queue").exists(), "the queue is removed after training"
    assert not list((tmp_path / "hs").glob("*.safetensors")), "engine files are removed once read"
    assert not (fed / "capture").exists(), "engine-fed training writes no feature cache"


def test_resumed_engine_fed_run_requests_only_the_rows_it_still_needs(tmp_path, tiny_qwen3, capsys):
    rd = make_run(tmp_path / "r", tiny_qwen3)
    with FakeHiddenStatesEngine(tiny_qwen3, aux=_aux(rd, tiny_qwen3), storage=tmp_path / "hs") as fake:
        ov = [*overrides(rd, tiny_qwen3, train__save_every=2), "capture.dtype=float32", "train.labels=target",
              "train.features=engine", "capture.engine=vllm", f"capture.server_url={fake.url}"]
        full = _ok(["train", "--json", *ov], capsys)
        whole = _losses(rd)
        shutil.rmtree(rd / "train" / "checkpoints" / "step-0000004")  # as if killed after step 2's checkpoint
        shutil.rmtree(rd / "train" / "final")
        before = fake.requests
        res = _ok(["train", "--json", *ov], capsys)
        assert res["resumed_from"] == 2 and res["engine_rows_requested"] == 4, res  # steps 3 and 4 only
        assert fake.requests - before == 4 + 2  # + the held-out samples of the final evaluation
    assert _losses(rd)[2:] == whole[2:] and res["train"] == full["train"]


def test_engine_feed_config_problems_exit_2_naming_the_keys(tmp_path, tiny_qwen3, capsys):
    rd = make_run(tmp_path / "r", tiny_qwen3)
    assert main(["train", *overrides(rd, tiny_qwen3), "train.features=engine"]) == 2
    err = capsys.readouterr().err
    assert "train.features" in err and "capture.engine=vllm" in err and "capture.server_url" in err, err
    assert main(["train", *overrides(rd, tiny_qwen3), "train.features=engine", "capture.engine=vllm",
                 "train.engine_prefetch=0"]) == 2
    assert "train.engine_prefetch" in capsys.readouterr().err


def test_plan_shows_the_cache_and_the_engine_queue(tmp_path, tiny_qwen3, capsys):
    rd = make_run(tmp_path / "r", tiny_qwen3)
    out = {}
    for prefetch in (1, 4):
        res = _ok(["plan", "--json", *overrides(rd, tiny_qwen3), f"train.engine_prefetch={prefetch}",
                   "data.num_prompts=1000", "data.mean_tokens=500"], capsys)
        out[prefetch] = {m["mode"]: m for m in res["plan"]["modes"]}
    one, four = out[1], out[4]
    assert four["engine"]["disk_bytes"] == 4 * one["engine"]["disk_bytes"] > 0  # the queue: prefetch batches
    assert one["engine"]["disk_bytes"] < one["cached"]["disk_bytes"] == four["cached"]["disk_bytes"]
    assert main(["plan", *overrides(rd, tiny_qwen3)]) == 0
    text = capsys.readouterr().out
    assert "cached" in text and "engine" in text and "bounded queue" in text, text


def test_an_engine_computing_other_ids_fails_training_and_leaves_no_queue(tmp_path, tiny_qwen3, capsys):
    rd = make_run(tmp_path / "r", tiny_qwen3)
    with FakeHiddenStatesEngine(tiny_qwen3, aux=_aux(rd, tiny_qwen3), storage=tmp_path / "hs", token_offset=1) as fake:
        rc = main(["train", *overrides(rd, tiny_qwen3), "train.features=engine", "capture.engine=vllm",
                   f"capture.server_url={fake.url}"])
    err = capsys.readouterr().err
    assert rc == 1 and "differ from the" in err and "position 0" in err, err[-2000:]
    assert not (rd / "train" / "engine-queue").exists() and not (rd / "train" / "final").exists()


class _Source:
    """A stand-in EngineSource: each sample's row is a function of its ids; counts the requests."""

    last_hidden = False

    def __init__(self):
        self.calls = 0

    def sample(self, ids):
        from dflashkit.engines.capture import FeatureRow

        self.calls += 1
        t = torch.tensor(ids, dtype=torch.float32)
        return FeatureRow(torch.stack([t, -t], dim=-1), torch.tensor(ids[1:] + [0]))


def test_a_queue_left_by_a_killed_run_is_reused_only_for_its_own_plan(tmp_path):
    import numpy as np

    from dflashkit.engines.feed import EngineFeed

    data = SimpleNamespace(where=[(0, i) for i in range(8)],
                           input_ids=[np.arange(3 + i, dtype=np.int64) + 10 * i for i in range(8)])
    batches = [[0, 1], [2, 3], [4, 5], [6, 7]]

    def item(first):
        return lambda k: (first + k, 0, batches[first + k])

    src, root, key = _Source(), tmp_path / "queue", {"plan": 1}
    feed = EngineFeed(src, data, root, prefetch=2, concurrency=1, key=key)
    feed.start(item(0), 4)
    feed.stage([0, 1])
    assert torch.equal(feed.get((0, 1), 4), src.sample(list(range(10, 14))).features)
    while 1 not in feed._slots:  # step 1 is prefetched before the "kill" (step 2 may be partly spooled)
        time.sleep(0.01)
    feed._slots[1].ready.wait()
    feed._stop.set()  # killed: the prefetcher stops, its files stay (no close)
    feed._thread.join()
    left = sorted(p.name for p in root.glob("step-*"))
    assert left and left[0] == "step-00000001-m00" and len(left) <= 2, left  # at most `prefetch` batches
    src2 = _Source()
    again = EngineFeed(src2, data, root, prefetch=2, concurrency=1, key=key)
    again.start(item(1), 3)  # resumed at step 1
    for b in batches[1:]:
        again.stage(b)
        assert torch.equal(again.get((0, b[1]), len(data.input_ids[b[1]]), "next_ids"),
                           src.sample([int(x) for x in data.input_ids[b[1]]]).next_ids)
    st = again.stats()
    assert st["engine_rows_reused"] + st["engine_rows_requested"] == 6 == st["engine_rows_reused"] + src2.calls
    assert st["engine_rows_reused"] >= 2  # step 1's rows were on disk: not requested again
    again.close()
    assert not root.exists()
    EngineFeed(_Source(), data, root, prefetch=1, concurrency=1, key=key)
    (root / "step-00000000-m00").mkdir()
    EngineFeed(_Source(), data, root, prefetch=1, concurrency=1, key={"plan": 2})  # another plan: emptied
    assert not (root / "step-00000000-m00").exists()
