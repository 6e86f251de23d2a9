"""Hot swap of the serving drafter (`serve.promoted`, POST /admin/drafter): under 4 concurrent clients over real
HTTP no request fails across the swaps, every output is the target's own greedy output before, during and
after, and /v1/models names the drafter only once it serves."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from dflashkit.config import TargetSection
from dflashkit.decode.api import SamplingParams, default_stop_ids
from dflashkit.decode.spec_decode import SpecDecoder
from dflashkit.export.hf import save_drafter
from dflashkit.flywheel.pointer import write_promoted
from dflashkit.model.target import load_target
from dflashkit.testing import random_drafter
from tests.harness.servers import serving

pytestmark = pytest.mark.serial  # 4 client threads + the server's engine and watcher threads

MAX_NEW = 8


def test_hot_swap_under_four_clients_loses_no_request_and_stays_lossless(tiny_qwen3, tmp_path):
    target = load_target(TargetSection(path=str(tiny_qwen3)))
    for i in range(3):
        save_drafter(random_drafter(target, block_size=4, seed=i), tmp_path / f"d{i}", dtype="float32")
    prompts = [target.tokenizer.encode(f"request number {k} says", add_special_tokens=False) for k in range(6)]
    base = SpecDecoder(target, None)
    ref = [base.generate(p, SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=default_stop_ids(target))).token_ids
           for p in prompts]
    run_dir = tmp_path / "run"
    cfg = {"target": {"path": str(tiny_qwen3)},
           "serve": {"drafter": str(tmp_path / "d0"), "promoted": str(run_dir), "promoted_poll_s": 0.05}}
    results: list[tuple[str | None, int, list[int] | None]] = []  # (drafter seen before, prompt, token ids / None)
    stop = threading.Event()
    with serving(cfg) as (app, url):
        client = httpx.Client(timeout=120)

        def drafter() -> str:
            return client.get(url + "/models").json()["data"][0]["drafter"]

        first = drafter()
        assert first.startswith("serve.drafter:d0")

        def worker(w: int) -> None:
            with httpx.Client(timeout=120) as c:
                k = w
                while not stop.is_set():
                    seen = None
                    try:
                        seen = c.get(url + "/models").json()["data"][0]["drafter"]
                        r = c.post(url + "/completions", json={"prompt": prompts[k % len(prompts)],
                                                                "max_tokens": MAX_NEW})
                        ids = r.json()["choices"][0]["token_ids"] if r.status_code == 200 else None
                    except httpx.HTTPError:
                        ids = None  # counted as a failed request
                    results.append((seen, k % len(prompts), ids))
                    k += 4

        threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(4)]
        for t in threads:
            t.start()

        def wait_for(pred, what: str) -> None:
            deadline = time.time() + 120
            while not pred():
                assert time.time() < deadline, what
                time.sleep(0.05)

        try:  # the workers stop whatever fails here
            wait_for(lambda: len(results) >= 4, "requests before the swap")
            p = write_promoted(run_dir, drafter_dir=tmp_path / "d1", round_no=1, drafter_id="r001-test")
            wait_for(lambda: drafter() == "r001-test", "the watched pointer's drafter serving")
            n = len(results)  # a worker may have read /v1/models before the swap: wait for one that read it after
            wait_for(lambda: any(seen == "r001-test" for seen, _, _ in results[n:]), "requests after the watched swap")
            r = client.post(url.removesuffix("/v1") + "/admin/drafter", json={"drafter": str(tmp_path / "d2"), "id": "manual"})
            assert r.status_code == 200 and r.json()["drafter"] == "manual" == drafter()
            bad = client.post(url.removesuffix("/v1") + "/admin/drafter", json={"drafter": str(tmp_path / "none")})
            assert bad.status_code == 400 and drafter() == "manual"  # never claims a swap that did not happen
            n = len(results)
            wait_for(lambda: any(seen == "manual" for seen, _, _ in results[n:]), "requests after the admin swap")
        finally:
            stop.set()
            for t in threads:
                t.join(120)
        health = client.get(url.removesuffix("/v1") + "/health").json()
        client.close()
    assert p["drafter"].endswith("d1") and health["drafter"] == "manual"
    assert all(ids is not None for _, _, ids in results), "a request failed across the swaps"
    assert all(ids == ref[k] for _, k, ids in results)  # lossless before, during and after
    assert {seen for seen, _, _ in results} >= {first, "r001-test", "manual"}
