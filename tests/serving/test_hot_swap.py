"""Hot swap of the serving drafter (`serve.promoted`, POST /admin/drafter): under 4 concurrent clients over real
HTTP no request fails across the swaps, every output is the target's own greedy output before, during and
after, /v1/models names the drafter only once it serves, and a request in flight across a swap finishes on the
old drafter while the next ones start on the new."""

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
from dflashkit.target.load import load_target
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
    # one row per request sent: (worker, drafter seen before, prompt, token ids / None, time sent, time answered)
    results: list[tuple[int, str | None, int, list[int] | None, float, float]] = []
    errors: list[str] = []  # every failure a worker met, whatever its kind (a 200 without `choices`, not JSON, ...)
    sent = [0] * 4
    stop = threading.Event()
    with serving(cfg) as (app, url):
        client = httpx.Client(timeout=120)

        def drafter() -> str:
            return client.get(url + "/models").json()["data"][0]["drafter"]

        first = drafter()
        assert first.startswith("serve.drafter:d0")

        def worker(w: int) -> None:
            try:
                with httpx.Client(timeout=120) as c:
                    k = w
                    while not stop.is_set():
                        sent[w] += 1
                        seen, ids, t0 = None, None, time.time()
                        try:
                            seen = c.get(url + "/models").json()["data"][0]["drafter"]
                            t0 = time.time()
                            r = c.post(url + "/completions", json={"prompt": prompts[k % len(prompts)],
                                                                    "max_tokens": MAX_NEW})
                            assert r.status_code == 200, r.text
                            ids = r.json()["choices"][0]["token_ids"]
                        except Exception as e:  # noqa: BLE001 - counted, and reported by the main thread
                            errors.append(f"worker {w}: {type(e).__name__}: {e}")
                        finally:
                            results.append((w, seen, k % len(prompts), ids, t0, time.time()))
                        k += 4
            except BaseException as e:  # noqa: BLE001 - a worker never dies unseen
                errors.append(f"worker {w} died: {type(e).__name__}: {e}")

        threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(4)]
        for t in threads:
            t.start()

        def wait_for(pred, what: str) -> None:
            deadline = time.time() + 120
            while not pred():
                assert time.time() < deadline, what
                time.sleep(0.05)

        def seen_after(n: int, drafter_id: str) -> bool:
            return any(seen == drafter_id for _, seen, _, _, _, _ in results[n:])

        old = None
        entered, release = threading.Event(), threading.Event()
        held: dict[str, object] = {}
        on_new = [0]
        try:  # the workers stop whatever fails here
            wait_for(lambda: len(results) >= 4, "requests before the swap")
            p = write_promoted(run_dir, drafter_dir=tmp_path / "d1", round_no=1, drafter_id="r001-test")
            wait_for(lambda: drafter() == "r001-test", "the watched pointer's drafter serving")
            n = len(results)  # a worker may have read /v1/models before the swap: wait for one that read it after
            wait_for(lambda: seen_after(n, "r001-test"), "requests after the watched swap")

            # The admin swap lands while a request is in the old decoder's hands: its next call waits (in the
            # engine thread) until the swap has returned, then decodes on, on the decoder it started with.
            old = app.engine.decoder
            old_generate = old.generate

            def hold_one(prompt_ids, params):
                if not entered.is_set():
                    held["prompt"] = list(prompt_ids)
                    entered.set()
                    release.wait(60)
                    held["swapped_meanwhile"] = app.engine.decoder is not old
                return old_generate(prompt_ids, params)

            old.generate = hold_one  # type: ignore[method-assign]
            wait_for(entered.is_set, "a request on the old drafter")
            t_swap = time.time()
            r = client.post(url.removesuffix("/v1") + "/admin/drafter", json={"drafter": str(tmp_path / "d2"),
                                                                               "id": "manual"})
            t_swapped = time.time()
            new = app.engine.decoder
            new_generate = new.generate

            def count_new(prompt_ids, params):
                on_new[0] += 1
                return new_generate(prompt_ids, params)

            new.generate = count_new  # type: ignore[method-assign]
            release.set()
            assert r.status_code == 200 and r.json()["drafter"] == "manual" == drafter()
            bad = client.post(url.removesuffix("/v1") + "/admin/drafter", json={"drafter": str(tmp_path / "none")})
            assert bad.status_code == 400 and drafter() == "manual"  # never claims a swap that did not happen
            n = len(results)
            wait_for(lambda: seen_after(n, "manual") and {w for w, *_ in results[n:]} == set(range(4)),
                     "every worker's requests after the admin swap")
        finally:
            release.set()
            stop.set()
            for t in threads:
                t.join(120)
        health = client.get(url.removesuffix("/v1") + "/health").json()
        client.close()
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors[:5]  # 0 failed requests across the swaps, whatever the failure
    assert len(results) == sum(sent) and all(ids is not None for _, _, _, ids, _, _ in results)
    assert p["drafter"].endswith("d1") and health["drafter"] == "manual"
    assert all(ids == ref[k] for _, _, k, ids, _, _ in results)  # lossless before, during and after
    assert {seen for _, seen, _, _, _, _ in results} >= {first, "r001-test", "manual"}
    # in flight across the admin swap: sent before it began, answered after it returned, by the old decoder
    across = [k for _, _, k, _, t0, t1 in results if t0 < t_swap and t1 > t_swapped]
    assert held.get("swapped_meanwhile") is True and new is not old
    assert prompts.index(held["prompt"]) in across
    assert on_new[0] > 0  # and the requests after it were decoded by the new one
