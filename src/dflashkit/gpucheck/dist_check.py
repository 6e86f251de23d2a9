"""The GPU check's distributed part: one process ≡ two ranks of `dflashkit train`, on what the machine allows.

Usage:
    one_equals_two_processes(ctx)         # a check of `runner.CHECKS`
    plan = distributed_plan("cuda", 1)    # which 2-rank runs a machine can do, and what it cannot (why)

The same global batch (one process × batch 4 against two ranks × batch 2) must give the same losses and
final weights (`compare.RANKS`, as tests/integration/test_distributed.py on CPU ranks), for DDP and for FSDP2
with the target sharded. The two ranks run through the real launcher, `dflashkit train --nproc-per-node 2`
(torchrun), in a child process; the one-process run is `fit` here.

What one machine allows: with two GPUs or more, NCCL, one GPU per rank. With one GPU, NCCL cannot run two
ranks (it refuses two ranks on one device, and `train.parallel.cuda_index` says so before the rendezvous):
that row is reported as skipped, and the two ranks run with `train.parallel.backend=gloo`, both on the one
GPU (gloo moves CUDA tensors through host memory: the collectives are exercised, not their speed). Without
CUDA there is nothing here to run (the CPU ranks are tests/integration/test_distributed.py's). Where gloo
itself refuses a collective on CUDA tensors (it has CUDA variants of most, not necessarily of every one FSDP2
uses), that run is skipped with gloo's own line as the reason: the backend's limit, not a result about
dflashkit; so is a rank killed by a signal inside torch's functional collectives (the full state dict's
DTensor gather; docs/architecture.md, the GPU check); any other non-zero exit is a failure, reported with the
ranks' Python stacks (faulthandler) when a signal killed them.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from dflashkit.export.hf import load_drafter
from dflashkit.gpucheck.compare import RANKS, close_losses, close_weights
from dflashkit.gpucheck.fixtures import check_overrides, contract_for, tiny_target_dir, train_config, write_run
from dflashkit.gpucheck.runner import CheckContext, child_env, guarded, part, verdict
from dflashkit.target.load import text_config_dict
from dflashkit.rundir import RunDir
from dflashkit.train.logging import read_metrics
from dflashkit.train.loop import fit

log = logging.getLogger("dflashkit.gpucheck")
TINY_TOKENS = 259


@dataclass(frozen=True)
class RankRun:
    """One 2-rank configuration: backend, drafter parallelism, target placement."""

    backend: str
    mode: str
    target: str

    @property
    def name(self) -> str:
        return f"{self.mode} ({self.backend}, target {self.target})"


def distributed_plan(device_type: str, gpus: int) -> tuple[list[RankRun], list[tuple[str, str]]]:
    """The 2-rank runs this machine can do, and the ones it cannot with the reason (skipped rows)."""
    if device_type != "cuda" or gpus < 1:
        return [], [("2 ranks", "skipped: no CUDA device (the CPU ranks are tests/integration/test_distributed.py)")]
    if gpus >= 2:
        return [RankRun("nccl", "ddp", "replicate"), RankRun("nccl", "fsdp", "shard")], []
    return ([RankRun("gloo", "ddp", "replicate"), RankRun("gloo", "fsdp", "shard")],
            [("nccl, 2 ranks", "skipped: one GPU (NCCL refuses two ranks on one GPU); gloo ranks share it instead")])


GLOO_REFUSAL = re.compile(r"(ProcessGroupGloo|gloo)\S*[^\n]*?(does not support|not supported|unsupported)[^\n]*",
                          re.IGNORECASE)


def crash_tail(stderr: str, limit: int = 3000) -> str:
    """The end of a failed 2-rank run's stderr, with faulthandler's stacks kept whole.

    A rank killed by a signal prints "Fatal Python error" and each thread's stack, then one long line
    listing the extension modules: that line is dropped, and the stacks come first, then the tail."""
    lines = [ln for ln in stderr.splitlines() if not ln.startswith("Extension modules:")]
    start = next((i for i, ln in enumerate(lines) if ln.startswith("Fatal Python error")), None)
    stacks = "\n".join(lines[start:start + 60]) if start is not None else ""
    tail = "\n".join(lines)[-limit:]
    return f"{stacks}\n...\n{tail}" if stacks and stacks not in tail else tail


def gloo_refusal(stderr: str) -> str | None:
    """The line where gloo refused an operation (e.g. a collective on CUDA tensors it has no CUDA variant of)."""
    m = GLOO_REFUSAL.search(stderr)
    return m.group(0).strip()[:300] if m else None


def gloo_crash(stderr: str) -> str | None:
    """Where a rank died of a signal inside torch's functional collectives under gloo, or None.

    torch's functional collectives (what DTensor's redistribute, and so FSDP2's full state dict, wait on)
    can crash gloo's CUDA path where the plain c10d collectives of the same data run: faulthandler's stack
    then has `_functional_collectives.py` above dflashkit's frames. → "… called from dflashkit/x.py:N"."""
    if "Fatal Python error: Segmentation fault" not in stderr and "Fatal Python error: Aborted" not in stderr:
        return None
    lines = stderr.splitlines()
    hit = next((i for i, ln in enumerate(lines) if "torch/distributed/_functional_collectives.py" in ln), None)
    if hit is None:
        return None
    ours = next((ln.strip() for ln in lines[hit:] if "/dflashkit/" in ln and ln.strip().startswith("File")), "")
    m = re.search(r"(dflashkit/\S+?)\"?, line (\d+)(?: in (\w+))?", ours)
    where = f", called from {m.group(1)}:{m.group(2)}" + (f" ({m.group(3)})" if m.group(3) else "") if m else ""
    return f"a rank died of a signal in torch.distributed's functional collectives on CUDA tensors{where}"


def _run_dir(ctx: CheckContext, tag: str):
    tiny = tiny_target_dir(ctx.shared)
    contract = contract_for(text_config_dict(tiny), block_size=4, num_draft_layers=1)
    return tiny, write_run(ctx.work_dir / tag, contract, samples=16, seq_len=(48, 96), token_range=TINY_TOKENS)


def _keys(run: RankRun | None, batch: int) -> dict[str, Any]:
    keys: dict[str, Any] = {"train.batch_size": batch, "train.max_steps": 3}
    if run is not None:
        keys.update({"train.parallel.backend": run.backend, "train.parallel.mode": run.mode,
                     "train.parallel.target": run.target})
    return keys


def _result(rd) -> tuple[list[float], dict]:
    run = RunDir(rd)
    return [float(r["loss"]) for r in read_metrics(run) if "loss" in r], load_drafter(run.final_dir).state_dict()


def one_equals_two_processes(ctx: CheckContext) -> dict[str, Any]:
    device_type = "cuda" if ctx.device.startswith("cuda") and torch.cuda.is_available() else "cpu"
    runs, skipped = distributed_plan(device_type, torch.cuda.device_count() if device_type == "cuda" else 0)
    parts = [part(name, None, reason) for name, reason in skipped]
    if not runs:
        return verdict(parts)
    tiny, one = _run_dir(ctx, "one")
    fit(train_config(one, device=ctx.device, target_path=tiny, **_keys(None, 4)), RunDir(one), show_bar=False)
    want = _result(one)
    for run in runs:
        skip = ctx.no_time(30)
        parts += [part(run.name, None, skip)] if skip else guarded(run.name, partial(_two_ranks, ctx, tiny, run, want))
    return verdict(parts)


def _two_ranks(ctx: CheckContext, tiny, run: RankRun, want: tuple[list[float], dict]) -> list[dict[str, Any]]:
    """`dflashkit train --nproc-per-node 2` with `run`'s backend and parallelism ≡ the one-process `want`."""
    _, two = _run_dir(ctx, f"two-{run.mode}")
    argv = check_overrides(two, device=ctx.device, target_path=tiny, **_keys(run, 2))
    cmd = [sys.executable, "-m", "dflashkit", "train", "--json", "--nproc-per-node", "2", *argv]
    env = {**child_env(), "PYTHONFAULTHANDLER": "1"}  # a rank killed by a signal prints its Python stack
    if run.backend == "gloo":  # both ranks on this host: loopback, whatever the host name resolves to
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=max(ctx.remaining(), 1))
    except subprocess.TimeoutExpired:
        return [part(run.name, False, "the 2-rank run outlasted the time box")]
    if r.returncode != 0:
        refused = gloo_refusal(r.stderr) if run.backend == "gloo" else None
        if refused:  # the backend's limit, not dflashkit's: said, not counted as a failure
            return [part(run.name, None, f"skipped: gloo refused a collective on CUDA tensors: {refused}")]
        crashed = gloo_crash(r.stderr) if run.backend == "gloo" else None
        if crashed:  # likewise: gloo sharing one GPU, not a result about dflashkit (NCCL on 2 GPUs runs it)
            return [part(run.name, None, f"skipped: gloo on one GPU: {crashed}; NCCL on 2 GPUs runs this row",
                         stderr_tail=crash_tail(r.stderr))]
        return [part(run.name, False, f"`dflashkit train --nproc-per-node 2` exited {r.returncode}",
                     stderr_tail=crash_tail(r.stderr))]
    last = (r.stdout.strip().splitlines() or ["{}"])[-1]
    world = json.loads(last).get("world_size") if last.startswith("{") else None
    got_losses, got_w = _result(two)
    losses = close_losses(got_losses, want[0], RANKS)
    weights = close_weights(got_w, want[1], atol=RANKS.weight_atol)
    ok = losses["ok"] and weights["ok"] and world == 2
    return [part(run.name, ok, None if world == 2 else f"world_size {world}, not 2", world_size=world,
                 losses=losses, weights=weights)]
