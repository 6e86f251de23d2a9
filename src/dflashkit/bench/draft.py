"""`dflashkit bench draft [DIR]`: one draft step through the drafter module's forward vs the lean forward.

Usage:
    dflashkit bench draft -c run.yaml                   # drafter: DIR, eval.drafter, train/best|final, export
    dflashkit bench draft runs/x/export target.path=smollm2-135m-instruct

The step eval's decoder drafts (`decode/spec_decode.py`): the target features of `new` tokens committed
since the last step join a `context`-token draft context, then the block [anchor, MASK × (B−1)] runs through
the drafter and the target head's rows (B: eval.block_sizes[0], else the drafter's; the head, the mask
embedding and a reduced draft vocab as the decoder builds them). Timed two ways on the same weights and
inputs: the module forward (`DFlashDraftModel.forward` with its DraftKVCache, then F.linear over the head)
and `decode/fast_draft.py`'s `FastDraft`, each in float32 and bfloat16 — in one process, warm-up excluded,
each number the fastest of `reps`, the draft rolled back to the same context before every call. Per dtype:
both times, module / lean, and the largest logit difference between the two paths. The CPU, its bf16
flags and threads are printed. A drafter the lean forward does not take (`FastDraft.supports`) is refused
(exit 2).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from dflashkit.decode.runner import resolve_drafter_dir
from dflashkit.decode.spec_decode import SpecDecoder
from dflashkit.errors import UsageError
from dflashkit.export.hf import load_drafter, read_contract
from dflashkit.sizing.draft_cost import time_draft_step

if TYPE_CHECKING:
    from dflashkit.config import RunConfig
    from dflashkit.context import StageContext
    from dflashkit.rundir import RunDir

def bench_draft(cfg: RunConfig, rd: RunDir, ctx: StageContext, *, context: int = 256, new: int = 2,
                reps: int = 20) -> dict[str, Any]:
    """`dflashkit bench draft`: the run's drafter on the target's head and mask embedding (module docstring)."""
    from dflashkit.target.load import cpu_facts, load_target

    drafter_dir = resolve_drafter_dir(cfg, rd, ctx.positionals[1:])
    contract = read_contract(drafter_dir)
    bs = (cfg.eval.block_sizes or [contract.block_size])[0]
    if bs < 2:
        raise UsageError(f"bench draft: block size {bs} drafts nothing", hint="set eval.block_sizes to B >= 2")
    target = load_target(dataclasses.replace(cfg.target, dtype="float32"), with_tokenizer=False)
    drafter = load_drafter(drafter_dir, dtype=torch.float32, device=target.device)
    dec = SpecDecoder(target, drafter, bs, max_context=cfg.eval.max_context)  # the head and mask row eval drafts over
    res = time_draft_step(drafter, dec._head_w, dec._head_b, dec._mask_emb, block_size=bs, context=context,
                          new=new, reps=reps)
    result = {"target": str(cfg.target.path), "drafter": str(drafter_dir), "drafter_type": contract.drafter_type,
              "head_rows": int(dec._head_w.shape[0]), "device": str(target.device),
              "threads": torch.get_num_threads(), "cpu": cpu_facts(), **res}
    if not ctx.json:
        facts = result["cpu"]
        print(f"draft step B={bs}, {context}-token context + {new} new, {result['head_rows']} head rows, "
              f"{result['device']} ({facts.get('cpu') or '?'}; bf16: {' '.join(facts.get('bf16') or []) or 'none'}), "
              f"{result['threads']} threads, fastest of {reps}:", flush=True)
        print(f"{'dtype':<10} {'module ms':>10} {'lean ms':>9} {'module/lean':>12} {'max |Δlogit|':>13}", flush=True)
        for name, r in result["dtypes"].items():
            print(f"{name:<10} {r['module_ms']:>10.3f} {r['lean_ms']:>9.3f} {r['module_over_lean'] or 0:>12.2f} "
                  f"{r['max_abs_logit_diff']:>13.2e}", flush=True)
    return result
