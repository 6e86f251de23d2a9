"""`dflashkit bench step`: one target decode step over n tokens, as transformers loads it and packed for oneDNN.

Usage:
    dflashkit bench step -c run.yaml                     # eval's verify dtype, n = 1, 2, 4, 8
    dflashkit bench step -c run.yaml eval.dtype=float32

Needs only the target (no drafter, no run dir). In one process, every n warmed up and then timed in turns (the
first n is not timed cold), each number the fastest of a few: t(n) for each n after a 300-token context, with
transformers' layers and DynamicCache ("as loaded"), then
with the decoder's own path (weights pre-packed for oneDNN where `eval.packed_weights` allows, the in-place
KV cache) — each against this machine's memory floor (weights' bytes over the measured read bandwidth:
`sizing/step_cost.py`, `sizing/roofline.py`). The CPU, its bf16 flags, threads and any ISA cap are printed.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from dflashkit.decode.evaluation import verify_dtype, verify_target_config
from dflashkit.sizing.step_cost import roofline, step_times, step_times_as_loaded
from dflashkit.target.packed import prepare_for_decode

if TYPE_CHECKING:
    from dflashkit.config import RunConfig
    from dflashkit.context import StageContext
    from dflashkit.rundir import RunDir

log = logging.getLogger("dflashkit.bench")
NS = (1, 2, 4, 8)


def bench_step(cfg: RunConfig, rd: RunDir, ctx: StageContext, *, context: int = 300, reps: int = 5) -> dict[str, Any]:
    from dflashkit.target.load import announce, cpu_facts, load_target

    verify = announce(verify_dtype(cfg))
    target = load_target(verify_target_config(cfg, verify), announce_dtype=False, with_tokenizer=False)
    loaded = roofline(target, step_times_as_loaded(target, NS, context, reps))
    packed_info = prepare_for_decode(target, cfg.eval.packed_weights)
    ours = roofline(target, step_times(target, list(NS), context=context, reps=reps))
    rows = [("as loaded", loaded), ("decoder" + (" (packed)" if packed_info["packed"] else ""), ours)]
    if not ctx.json:
        print(f"{'path':<18} {'t(1) ms':>8} " + " ".join(f"{f't({n})/t(1)':>10}" for n in NS[1:]) +
              f" {'floor ms':>9} {'share':>6}", flush=True)
        for name, r in rows:
            print(f"{name:<18} {r['t_s'][1] * 1e3:>8.1f} " +
                  " ".join(f"{r['t_ratio'][n]:>10.2f}" for n in NS[1:]) +
                  f" {r['t1_roofline_s'] * 1e3:>9.1f} {r['t1_share']:>6.2f}", flush=True)
    return {"target": str(cfg.target.path), "dtype": str(target.dtype).removeprefix("torch."),
            "dtype_reason": verify.reason, "device": str(target.device), "threads": torch.get_num_threads(),
            "cpu": cpu_facts(), "context": context, "as_loaded": loaded, "decoder": ours, "packed": packed_info,
            "t1_speedup": round(loaded["t_s"][1] / ours["t_s"][1], 3)}
