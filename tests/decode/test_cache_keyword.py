"""The decoder hands the target its KV cache by the name the installed transformers takes (`cache` in 5.2x,
`past_key_values` before, e.g. the 5.17 of the lent GPU machines): an unknown keyword vanishes into the model's
`**kwargs`, and the decode would silently run without its cache."""

from __future__ import annotations

import pytest
import torch

from dflashkit.config import load_config
from dflashkit.decode.api import SamplingParams
from dflashkit.decode.spec_decode import SpecDecoder
from dflashkit.target.load import cache_kwarg, load_target
from dflashkit.testing import CopyTargetProposer, random_drafter


def test_cache_kwarg_reads_the_forward_signature():
    class New(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, **kw): ...

    class Old(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, **kw): ...

    assert cache_kwarg(New()) == "cache" and cache_kwarg(Old()) == "past_key_values"


def _with_old_cache_name(model) -> None:
    """Make `model` take its cache as `past_key_values` and drop an unknown `cache`, as transformers < 5.2x."""
    base = type(model)

    class PastKeyValuesNamed(base):  # type: ignore[misc, valid-type]
        def forward(self, input_ids=None, past_key_values=None, **kw):
            kw.pop("cache", None)  # swallowed by **kwargs there, without an error
            return base.forward(self, input_ids=input_ids, cache=past_key_values, **kw)

    model.__class__ = PastKeyValuesNamed


def _recomputed_greedy(target, prompt: list[int], n: int) -> list[int]:
    """The slow oracle: every token from a forward over the whole sequence, no cache at all."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(target.model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("proposer", ["baseline", "drafter", "copy-target"])
def test_decoders_keep_their_cache_under_the_older_name(tiny_qwen3, proposer):
    target = load_target(load_config(None, [f"target.path={tiny_qwen3}", "target.device=cpu",
                                            "target.dtype=float32"]).target)
    _with_old_cache_name(target.model)
    assert cache_kwarg(target.model) == "past_key_values"
    dec = {"baseline": lambda: SpecDecoder(target, None, 1),
           "drafter": lambda: SpecDecoder(target, random_drafter(target, block_size=4), 4),
           "copy-target": lambda: SpecDecoder(target, None, 4, proposer=CopyTargetProposer(target))}[proposer]()
    prompt = [40, 41, 42, 43, 44, 45, 46, 47, 10]
    got = dec.generate(prompt, SamplingParams(max_new_tokens=10, stop_token_ids=())).token_ids
    assert got == _recomputed_greedy(target, prompt, 10)
