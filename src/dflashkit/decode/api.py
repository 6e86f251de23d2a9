"""The decoder interface shared by `eval`, `serve` and `bench` (autoregressive or speculative).

Usage:
    params = SamplingParams(temperature=0.0, max_new_tokens=64, stop_token_ids=default_stop_ids(target))
    result = decoder.generate(prompt_ids, params)
    result.token_ids, result.finish_reason, result.acceptance_lengths

The same two types carry a `serve` request (`stop` strings, the engine's stop ids when
`stop_token_ids` is empty) and its answer (`text`, `prompt_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol


@dataclass
class SamplingParams:
    """What one generation asks for (a decoder call or a `serve` request)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()  # the serve engines use their default stop ids when empty
    stop: list[str] = field(default_factory=list)  # stop strings (serve: the text is cut before one)
    tenant: str | None = None  # whose suffix pool a hybrid / suffix proposer reads and feeds (None: the default one)


@dataclass
class GenerationResult:
    token_ids: list[int]                      # new tokens only (stop token included if emitted)
    finish_reason: Literal["stop", "length"]
    text: str = ""                            # serve engines: the detokenised answer (cut at a stop string)
    prompt_tokens: int = 0                    # serve engines: the prompt's length in tokens
    acceptance_lengths: list[int] = field(default_factory=list)  # τ per verify step (speculative only)
    # per verify step: True when its length is no free outcome of B − 1 drafts (fewer drafts near
    # max_new_tokens, or its tokens cut at a stop token or max_new_tokens): `export/profile.py`
    acceptance_cut: list[bool] = field(default_factory=list)
    prefill_s: float = 0.0                    # time to first token
    decode_s: float = 0.0                     # time after the first token
    step_s: list[float] = field(default_factory=list)    # wall time of each decode step
    verify_s: list[float] = field(default_factory=list)  # target forward (+ logits) of each step
    draft_s: list[float] = field(default_factory=list)   # drafter pass of each step (speculative only)
    verified_drafts: int = 0                  # drafts sent to the verify, summed over steps (B − 1 each at fixed B)
    # greedy decoders built with record_top=k: per emitted token, the target's k best (token id, logit)
    # at the row that emitted it, best first (the lossless check's tie test, `decode/lossless.py`)
    top_logits: list[list[tuple[int, float]]] = field(default_factory=list)
    # hybrid decoders (`decode/hybrid.py`) only, else empty: per verify step the branch that drafted it ("suffix",
    # "drafter", "graft", "plain" where the online drafter gate had the drafter off and the suffix gate did not
    # open, or "none" when nothing else was verified), and per verified draft token its origin
    # ("drafter", "suffix", or "both" where the other branch proposed the same token there)
    branch: list[str] = field(default_factory=list)
    draft_origin: list[list[str]] = field(default_factory=list)
    drafter_off: int = 0                      # steps the online drafter gate (`decode/online_gate.py`) made plain


def default_stop_ids(target: Any) -> tuple[int, ...]:
    """The tokenizer's eos plus the model's generation_config eos id(s), sorted."""
    ids: set[int] = set()
    tok = target.tokenizer
    if tok is not None and tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    gen_eos = getattr(getattr(target.model, "generation_config", None), "eos_token_id", None)
    ids |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    return tuple(sorted(int(i) for i in ids))


class Decoder(Protocol):
    def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult: ...
