"""The GPU check's checks, run with device=cpu: the same functions the GPU machine runs, on `fixtures.SMALL`
and the tiny target (flex: losses only, torch has no flex backward on the CPU; CPU ≡ GPU: two CPU runs)."""

from __future__ import annotations

import math
import os
import time

import pytest

from dflashkit.gpucheck.decode_check import decoder_equals_baseline
from dflashkit.gpucheck.dist_check import distributed_plan, one_equals_two_processes
from dflashkit.gpucheck.runner import CheckContext
from dflashkit.gpucheck.train_checks import bf16_steps, cpu_equals_gpu, flex_vs_sdpa


@pytest.fixture
def ctx(tmp_path, tiny_qwen3):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.symlink(tiny_qwen3, shared / "tiny-target")  # the same target/tiny.py target the check would build
    return CheckContext(device="cpu", work_dir=tmp_path / "work", deadline=time.monotonic() + 600, shared_dir=shared)


def _parts(result: dict) -> dict[str, dict]:
    return {p["name"]: p for p in result["parts"]}


def test_flex_equals_sdpa_in_the_trainers_loss(ctx):
    r = flex_vs_sdpa(ctx)
    parts = _parts(r)
    assert r["status"] == "passed", r
    assert set(parts) == {"tiny, float32", "tiny, bf16 autocast", "medium (small-shape), float32",
                          "medium (small-shape), bf16 autocast"}
    for name, p in parts.items():
        assert p["loss_rel"] <= p["loss_rtol"] and math.isfinite(p["loss_flex"]), (name, p)
        assert "no backward on the CPU" in p["grads"]
    assert parts["tiny, float32"]["loss_rel"] < 1e-5


def test_bf16_steps_on_a_bf16_target(ctx):
    r = bf16_steps(ctx)
    assert r["status"] == "passed", r
    one, five = _parts(r)["1-layer drafter"], _parts(r)["5-layer drafter"]
    assert len(one["target_layer_ids"]) == 1 and len(five["target_layer_ids"]) == 5
    assert five["drafter_params_m"] > one["drafter_params_m"] > 0
    for p in (one, five):
        assert p["tokens_per_s"] > 0 and p["step_s"] > 0 and all(math.isfinite(x) for x in p["losses"])
        assert len(p["step_s_each"]) == p["timed_steps"] and p["peak_memory_gib"] is None  # no CUDA here


def test_cpu_equals_gpu_compares_two_fits(ctx):
    r = cpu_equals_gpu(ctx)
    assert r["status"] == "passed", r
    losses = _parts(r)["losses, step by step (train rows, then the held-out row)"]
    assert len(losses["got"]) == 3  # 2 steps + the final held-out row
    assert losses["max_rel"] <= 1e-6 and _parts(r)["final drafter weights"]["max_abs"] <= 1e-6  # one device, twice


def test_the_decoder_equals_the_baseline(ctx):
    r = decoder_equals_baseline(ctx)
    assert r["status"] == "passed", r
    parts = _parts(r)
    assert len(parts) == 9  # 3 targets × (baseline, random drafter, copy-target proposer)
    for name, p in parts.items():
        if "baseline" not in name:
            assert p["verdict"] in ("exact", "ties-only") and 1 <= p["tau"] <= 4, (name, p)
    assert parts["tiny float32: copy-target proposer, B=4"]["verdict"] == "exact"
    assert parts["tiny float32: copy-target proposer, B=4"]["tau"] > 2  # every full step accepts its drafts


def test_distributed_plan_says_what_one_machine_allows(ctx):
    runs, skipped = distributed_plan("cuda", 1)
    assert [(r.backend, r.mode) for r in runs] == [("gloo", "ddp"), ("gloo", "fsdp")]
    assert skipped and "one GPU" in skipped[0][1] and "NCCL" in skipped[0][1]
    runs, skipped = distributed_plan("cuda", 8)
    assert {r.backend for r in runs} == {"nccl"} and not skipped
    assert distributed_plan("cpu", 0)[0] == []
    r = one_equals_two_processes(ctx)
    assert r["status"] == "skipped" and "no CUDA device" in r["reason"]


def test_only_gloos_own_refusal_turns_a_failed_run_into_a_skip():
    from dflashkit.gpucheck.dist_check import gloo_refusal

    err = "Traceback ...\nRuntimeError: ProcessGroupGloo does not support reduce_scatter_tensor on CUDA tensors\n"
    assert gloo_refusal(err) == "ProcessGroupGloo does not support reduce_scatter_tensor on CUDA tensors"
    assert gloo_refusal("torch.OutOfMemoryError: CUDA out of memory") is None
    assert gloo_refusal("AssertionError: losses differ") is None


CRASH = """Fatal Python error: Segmentation fault

Thread 0x00007f319da846c0 (most recent call first):
  <no Python frame>

Thread 0x00007f35142b6140 (most recent call first):
  File "/venv/site-packages/torch/_ops.py", line 872 in redispatch
  File "/venv/site-packages/torch/distributed/_functional_collectives.py", line 138 in wait_tensor
  File "/venv/site-packages/torch/distributed/tensor/_redistribute.py", line 1658 in redistribute_local_tensor
  File "/venv/site-packages/torch/distributed/checkpoint/state_dict.py", line 1191 in get_model_state_dict
  File "/work/main/src/dflashkit/train/checkpoint.py", line 62 in full_model_state
  File "/work/main/src/dflashkit/train/loop.py", line 353 in _fit

Extension modules: numpy._core._multiarray_umath, torch._C (total: 181)
E1204 17:54:35.222000 871 torch/distributed/elastic/multiprocessing/api.py:986] failed (exitcode: -11)
"""


def test_a_gloo_crash_in_torchs_collectives_is_named_and_other_crashes_stay_failures():
    from dflashkit.gpucheck.dist_check import crash_tail, gloo_crash

    said = gloo_crash(CRASH)
    assert said is not None and "functional collectives" in said
    assert "dflashkit/train/checkpoint.py:62 (full_model_state)" in said
    ours = CRASH.replace("torch/distributed/_functional_collectives.py", "dflashkit/train/loss.py")
    assert gloo_crash(ours) is None  # a crash in our own frames is a failure, not the backend's limit
    assert gloo_crash("RuntimeError: losses differ\n" + CRASH.split("\n", 1)[1]) is None  # no signal
    tail = crash_tail(CRASH + "x" * 5000)
    assert tail.startswith("Fatal Python error") and "full_model_state" in tail and "Extension modules" not in tail
