"""The target's features of the tokens a speculative decoder committed, kept per request for recording.

Usage:
    dec = TappedSpecDecoder(target, drafter)          # a SpecDecoder (same arguments, same outputs)
    res = dec.generate(req.prompt_ids, params)         # as SerialEngine calls it
    feats = dec.take(req.prompt_ids, n_tokens)         # [n_tokens, len(layer_ids)·H] on the CPU, or None

With a drafter, `SpecDecoder` runs the target through `Target.features` at the drafter's `layer_ids` anyway:
the prefill over the prompt, then one verify forward per step over `[x_start, drafts…]`, of which the first
`acceptance_lengths[i]` rows are the committed tokens. Kept in order they are the target's features of
prompt + completion[:-1] (the last committed token is never fed), what `capture` computes for those tokens
in one forward. Nothing is recomputed; the copies go to the CPU. The forwards `_calibrate` runs before the
prefill (adaptive length) are not kept: a request's forwards are its last len(acceptance_lengths) + 1.
Results are keyed by the prompt list object the engine passed (`Request.prompt_ids`), so the handler that
owns the request takes its own; at most `keep` untaken results are kept (a cancelled request's go).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from dflashkit.decode.api import GenerationResult, SamplingParams
from dflashkit.decode.spec_decode import SpecDecoder


class TappedSpecDecoder(SpecDecoder):
    """A `SpecDecoder` that keeps each request's committed-token features (module docstring)."""

    keep = 64

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._forwards: list[torch.Tensor] | None = None
        self._done: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._guard = threading.Lock()

    def _forward(self, ids, cache, last_only: bool = False, start: int | None = None):
        feats, logits = super()._forward(ids, cache, last_only=last_only, start=start)
        if self._forwards is not None and feats is not None:
            self._forwards.append(feats[0].detach().to("cpu", copy=True))
        return feats, logits

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        runs: list[torch.Tensor] = []
        self._forwards = runs
        try:
            res = super().generate(prompt_ids, params)
        finally:
            self._forwards = None
        steps = len(res.acceptance_lengths)
        if self.layer_ids and len(runs) >= steps + 1:
            runs = runs[len(runs) - steps - 1:]
            parts = [runs[0]] + [r[:n] for r, n in zip(runs[1:], res.acceptance_lengths)]
            with self._guard:
                self._done[id(prompt_ids)] = torch.cat(parts, dim=0)
                while len(self._done) > self.keep:
                    self._done.popitem(last=False)
        return res

    def take(self, prompt_ids: list[int], rows: int) -> torch.Tensor | None:
        """The features of the request whose prompt list this is, cut to `rows` (a stop string may have cut the
        completion), or None when there are none (no drafter layers, or fewer rows than asked)."""
        with self._guard:
            feats = self._done.pop(id(prompt_ids), None)
        if feats is None or feats.shape[0] < rows:
            return None
        return feats[:rows]
