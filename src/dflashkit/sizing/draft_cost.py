"""What one draft step costs on this machine: the drafter's module forward against the lean forward
(`decode/fast_draft.py`) on the same weights, in each dtype, with the largest logit difference between them.

Usage:
    r = time_draft_step(drafter, head_w, head_b, mask_emb, context=256, new=2, reps=20)
    r["dtypes"]["bfloat16"]["module_over_lean"]        # > 1: the lean forward is that much faster

A draft step is what decoding runs once per block: `new` tokens of new context plus the block of B positions,
after `context` tokens already cached, then the head over the B − 1 draft positions. Both paths are warmed up,
then the fastest of `reps` is kept (`dflashkit.timing`), each rolled back to the same context before every call.
`dflashkit bench draft` prints it for a run's drafter; a drafter the lean forward does not take is refused.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F

from dflashkit.decode.fast_draft import FastDraft
from dflashkit.errors import UsageError
from dflashkit.model.drafter import DraftKVCache
from dflashkit.timing import fastest

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
