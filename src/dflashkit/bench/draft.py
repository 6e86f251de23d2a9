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

import copy
import dataclasses
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from dflashkit.decode.fast_draft import FastDraft
from dflashkit.decode.runner import resolve_drafter_dir
from dflashkit.decode.spec_decode import SpecDecoder
from dflashkit.errors import UsageError
from dflashkit.export.hf import load_drafter, read_contract
from dflashkit.model.drafter import DraftKVCache
from dflashkit.timing import fastest

if TYPE_CHECKING:
    from dflashkit.config import RunConfig
    from dflashkit.context import StageContext
    from dflashkit.rundir import RunDir

DTYPES = (torch.float32, torch.bfloat16)


@torch.inference_mode()
def time_draft_step(drafter: Any, head_w: torch.Tensor, head_b: torch.Tensor | None, mask_emb: torch.Tensor, *,
                    block_size: int | None = None, context: int = 256, new: int = 2, reps: int = 20,
                    warmup: int = 3, dtypes: tuple[torch.dtype, ...] = DTYPES, seed: int = 0) -> dict[str, Any]:
    """Milliseconds of one draft step (module docstring) through the module forward and through `FastDraft`.

    `drafter` (a `DFlashDraftModel` that `FastDraft.supports`) is copied into each dtype; `head_w` / `head_b`
    [V or V', H] and `mask_emb` [1, 1, H] likewise. → {"block_size", "context", "new", "reps", "dtypes":
    {name: {"module_ms", "lean_ms", "module_over_lean", "max_abs_logit_diff"}}}."""
    if not FastDraft.supports(drafter):
        raise UsageError("bench draft: the lean draft forward does not take this drafter (its layers are not plain "
                         "DFlash layers, or its RoPE depends on the length): there is nothing to compare",
                         hint="bench a DFlash drafter; `dflashkit bench decode` times any drafter end to end")
    bs = block_size or drafter.block_size
    k = bs - 1
    device = head_w.device
    start = context + new                                   # the anchor's position in the timed step
    g = torch.Generator(device="cpu").manual_seed(seed)
    feats32 = torch.randn(1, start, drafter.fc.weight.shape[1], generator=g).to(device)
    anchor32 = torch.randn(1, 1, head_w.shape[1], generator=g).to(device)
    positions = torch.arange(start + bs, device=device)[None]
    out: dict[str, Any] = {"block_size": bs, "context": context, "new": new, "reps": reps, "dtypes": {}}
    for dtype in dtypes:
        model = copy.deepcopy(drafter).to(dtype=dtype).eval()
        hw, hb = head_w.to(dtype), None if head_b is None else head_b.to(dtype)
        mask, feats, anchor = mask_emb.to(dtype), feats32.to(dtype), anchor32.to(dtype)
        block = torch.cat([anchor, mask.expand(1, k, -1)], dim=1)
        new_feats = feats[:, context:]

        cache = DraftKVCache()
        model(block, feats[:, :context], positions[:, :context + bs], cache=cache)  # the context, as a decode leaves it

        def module_step() -> torch.Tensor:
            h = model(block, new_feats, positions[:, context:start + bs], cache=cache)
            return F.linear(h[0, 1:], hw, hb)

        fast = FastDraft(model, hw, hb, mask, max_len=start + bs, causal=model.causal)
        state = fast.new_state(start + bs)
        fast.forward(state, feats[:, :context], anchor, context, k)

        def lean_step() -> torch.Tensor:
            return fast.forward(state, new_feats, anchor, start, k)[1]

        def rollback_module() -> None:
            cache.crop(context)

        def rollback_lean() -> None:
            state.length = context

        diff = (module_step().float() - lean_step().float()).abs().max().item()
        rollback_module()
        rollback_lean()
        module_s = fastest(module_step, device, reps, warmup=warmup, after=rollback_module)
        lean_s = fastest(lean_step, device, reps, warmup=warmup, after=rollback_lean)
        out["dtypes"][str(dtype).removeprefix("torch.")] = {
            "module_ms": round(module_s * 1e3, 4), "lean_ms": round(lean_s * 1e3, 4),
            "module_over_lean": round(module_s / lean_s, 3) if lean_s > 0 else None,
            "max_abs_logit_diff": round(diff, 6)}
    return out


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
