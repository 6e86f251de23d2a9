"""The decoder interface shared by `eval`, `serve` and `bench` (autoregressive or speculative).

Usage:
    params = SamplingParams(temperature=0.0, max_new_tokens=64, stop_token_ids=(eos,))
    result = decoder.generate(prompt_ids, params)
    result.token_ids, result.finish_reason, result.acceptance_lengths
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class GenerationResult:
    token_ids: list[int]                      # new tokens only (stop token included if emitted)
    finish_reason: Literal["stop", "length"]
    acceptance_lengths: list[int] = field(default_factory=list)  # τ per verify step (speculative only)
    prefill_s: float = 0.0                    # time to first token
    decode_s: float = 0.0                     # time after the first token
    step_s: list[float] = field(default_factory=list)    # wall time of each decode step
    verify_s: list[float] = field(default_factory=list)  # target forward (+ logits) of each step
    draft_s: list[float] = field(default_factory=list)   # drafter pass of each step (speculative only)
    # greedy decoders built with record_top=k: per emitted token, the target's k best (token id, logit)
    # at the row that emitted it, best first (the lossless check's tie test, `decode/lossless.py`)
    top_logits: list[list[tuple[int, float]]] = field(default_factory=list)


class Decoder(Protocol):
    def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult: ...
