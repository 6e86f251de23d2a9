"""A proposer stub for `decode.spec_decode.SpecDecoder`: the best possible drafter (`gpu-check` and tests).

Usage:
    SpecDecoder(target, None, 4, proposer=CopyTargetProposer(target))    # greedy τ = B
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dflashkit.target.load import Target


class CopyTargetProposer:
    """Proposes the target's own greedy continuation, so greedy τ = B on every full step."""

    def __init__(self, target: Target):
        self.target = target

    def propose(self, sequence: list[int], num_tokens: int) -> list[int]:
        import torch
        from transformers import DynamicCache

        from dflashkit.target.load import cache_kwarg

        kw = cache_kwarg(self.target.model)
        cache, ids, out = DynamicCache(config=self.target.config), list(sequence), []
        with torch.inference_mode():
            step = torch.tensor([ids], device=self.target.device)
            for _ in range(num_tokens):
                logits = self.target.model(input_ids=step, use_cache=True, **{kw: cache}).logits
                tok = int(logits[0, -1].argmax())
                out.append(tok)
                step = torch.tensor([[tok]], device=self.target.device)
        return out

