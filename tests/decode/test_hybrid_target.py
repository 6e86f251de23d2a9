"""Hybrid targets (linear-attention / state-space layers beside full attention): speculative decoding stays
lossless, because the target's cache rolls back exactly (decode/rollback.py).

Tiny targets are built in code from transformers' own configs (tests/harness/hybrid.py): Qwen3-Next and
Qwen3.5 (Gated DeltaNet), Bamba and Nemotron-H (Mamba-2 layers beside attention layers) and Falcon-H1 (Mamba-2
and attention inside every layer).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflashkit.config import TargetSection
from dflashkit.decode.api import SamplingParams
from dflashkit.decode.rollback import arm, recording, recurrent_layers, rollback
from dflashkit.decode.spec_decode import SpecDecoder
from dflashkit.target.hybrid import layer_types, recurrent_summary
from dflashkit.target.load import Target, cache_kwarg, load_target
from dflashkit.testing import random_drafter
from dflashkit.testing.proposers import CopyTargetProposer
from tests.harness.hybrid import HYBRID_ARCHS, hybrid_config, make_tiny_hybrid_target

PROMPT = [1, 60, 61, 62, 63, 64, 10, 65, 66, 67, 68, 2, 10]
N = 23


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory):
    base = tmp_path_factory.mktemp("hybrid_targets")
    return {a: load_target(TargetSection(path=str(make_tiny_hybrid_target(base / a, a)), device="cpu",
                                         dtype="float32")) for a in HYBRID_ARCHS}


class PartlyRightProposer(CopyTargetProposer):
    """Proposes the target's greedy continuation with its k-th token wrong, k cycling 0, 1, 2, …: every step
    keeps a different number of drafts, so rollbacks of every depth happen."""

    def __init__(self, target):
        super().__init__(target)
        self.calls = 0

    def propose(self, sequence: list[int], num_tokens: int) -> list[int]:
        out = super().propose(sequence, num_tokens)
        k = self.calls % (num_tokens + 1)
        self.calls += 1
        if k < num_tokens:
            out[k] = (out[k] + 1) % self.target.vocab_size
        return out


def _greedy_reference(target: Target) -> list[int]:
    with torch.inference_mode():
        out = target.model.generate(torch.tensor([PROMPT]), max_new_tokens=N, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


def test_the_tiny_hybrids_are_hybrid(hybrids):
    for arch, target in hybrids.items():
        types = layer_types(target.config)
        assert recurrent_summary(types) is not None, (arch, types)
        cache = _cache(target)
        assert recurrent_layers(cache), arch


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_greedy_speculative_equals_target_greedy(hybrids, arch):
    target = hybrids[arch]
    ref = _greedy_reference(target)
    params = SamplingParams(max_new_tokens=N)
    base = SpecDecoder(target, None, block_size=1).generate(PROMPT, params)
    assert base.token_ids == ref
    for b in (2, 4, 8):
        runs = {"random drafter": SpecDecoder(target, random_drafter(target, block_size=b), block_size=b),
                "copy": SpecDecoder(target, None, b, proposer=CopyTargetProposer(target)),
                "partly right": SpecDecoder(target, None, b, proposer=PartlyRightProposer(target))}
        for name, dec in runs.items():
            r = dec.generate(PROMPT, params)
            assert r.token_ids == ref, f"B={b} {name}"
            assert all(1 <= a <= b for a in r.acceptance_lengths) and sum(r.acceptance_lengths) == N - 1
            if name == "copy":
                assert max(r.acceptance_lengths) == b  # whole blocks kept: rollback(0)
            if name == "partly right" and b > 2:
                assert len(set(r.acceptance_lengths)) >= 3  # rollbacks of several depths


def test_adaptive_length_calibrates_on_a_hybrid(hybrids):
    """`adaptive` times target steps over n tokens on a throwaway cache, rolled back after each."""
    target = hybrids["qwen3_next"]
    dec = SpecDecoder(target, random_drafter(target, block_size=4), block_size=4, adaptive=True)
    assert dec.generate(PROMPT, SamplingParams(max_new_tokens=N)).token_ids == _greedy_reference(target)
    assert dec.policy is not None and sorted(dec.policy.cost) == [1, 2, 3, 4]


def _cache(target: Target):
    from transformers import DynamicCache

    return DynamicCache(config=target.config)


def _fwd(target: Target, ids: list[int], cache, start: int) -> torch.Tensor:
    """Last-position logits of a cached forward over `ids` at positions start … (explicit: Bamba needs them)."""
    pos = torch.arange(start, start + len(ids))[None]
    return target.model(input_ids=torch.tensor([ids]), position_ids=pos, use_cache=True,
                        **{cache_kwarg(target.model): cache}).logits[0, -1]


def _state(cache) -> list[torch.Tensor]:
    """Every tensor the cache holds: recurrent and convolution states, keys and values."""
    out = []
    for layer in cache.layers:
        for states in (getattr(layer, "recurrent_states", {}), getattr(layer, "conv_states", {})):
            out += [t for t in states.values() if t is not None]
        if getattr(layer, "keys", None) is not None:
            out += [layer.keys, layer.values]
    return out


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
@pytest.mark.parametrize("drop", [0, 1, 3, 5])
def test_rollback_leaves_the_cache_of_the_kept_tokens(hybrids, arch, drop):
    """After a block of 6 and rollback(drop), the cache holds what a cache fed the kept tokens one at a time
    holds, its length is theirs, and the next step's logits are the same."""
    target = hybrids[arch]
    block, nxt = [70, 71, 72, 73, 74, 75], 80
    with torch.inference_mode():
        p = len(PROMPT)
        cache = _cache(target)
        _fwd(target, PROMPT, cache, 0)
        arm(cache, 6)
        _fwd(target, block, cache, p)
        rollback(cache, drop)
        kept = block[: len(block) - drop]
        ref = _cache(target)
        _fwd(target, PROMPT, ref, 0)
        for i, tok in enumerate(kept):
            _fwd(target, [tok], ref, p + i)
        assert cache.get_seq_length() == ref.get_seq_length() == p + len(kept)
        mine, theirs = _state(cache), _state(ref)
        assert len(mine) == len(theirs) > 0
        for a, b in zip(mine, theirs):
            assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5), (arch, drop)
        end = p + len(kept)
        assert torch.allclose(_fwd(target, [nxt], cache, end), _fwd(target, [nxt], ref, end), atol=1e-5)


def test_a_full_attention_cache_is_cropped_as_before(tiny_qwen3):
    """Full attention: `arm` records nothing, rollback(0) touches nothing, rollback(k) is `crop(-k)`."""
    target = load_target(TargetSection(path=str(tiny_qwen3), device="cpu", dtype="float32"))
    with torch.inference_mode():
        cache = _cache(target)
        _fwd(target, PROMPT, cache, 0)
        arm(cache, 4)
        assert not recording(cache) and not recurrent_layers(cache)
        _fwd(target, [70, 71, 72, 73], cache, len(PROMPT))
        keys = [layer.keys for layer in cache.layers]
        rollback(cache, 0)
        assert all(layer.keys is k for layer, k in zip(cache.layers, keys))
        rollback(cache, 3)
        assert cache.get_seq_length() == len(PROMPT) + 1


def test_rollback_without_arm_is_refused_on_a_hybrid(hybrids):
    target = hybrids["bamba"]
    with torch.inference_mode():
        cache = _cache(target)
        _fwd(target, PROMPT, cache, 0)
        _fwd(target, [70, 71], cache, len(PROMPT))
        with pytest.raises(RuntimeError, match="arm"):
            rollback(cache, 1)


def test_step_times_on_a_hybrid(hybrids):
    from dflashkit.sizing.step_cost import step_times

    t = step_times(hybrids["nemotron_h"], [1, 3], context=16, reps=1)
    assert sorted(t) == [1, 3] and all(v > 0 for v in t.values())


# -- the sampling law ---------------------------------------------------------------------------------------
V = 8


def _small_vocab_hybrid(arch: str) -> tuple[Target, object]:
    """A V=8 hybrid with a sharpened head (a wrong rule shows up clearly; the law of 3 tokens still spreads over
    15-25 cells of 500 samples' χ²) and louder recurrent layers (their outputs ×8, so a wrong recurrent state
    moves the next token's law by a total variation of 0.3 or more), and a random drafter for it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(hybrid_config(arch, vocab=V, hidden=32)).eval().requires_grad_(False)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
        for name, p in model.named_parameters():
            if name.endswith(("linear_attn.out_proj.weight", "mamba.out_proj.weight")):
                p.mul_(8.0)
    target = Target(model=model, tokenizer=None, model_dir=Path("."), device=torch.device("cpu"),
                    dtype=torch.float32)
    drafter = random_drafter(target, block_size=4)
    with torch.no_grad():
        drafter.fc.weight.mul_(20.0)
    return target, drafter


@pytest.mark.parametrize("arch", ["qwen3_next", "bamba"])
def test_speculative_sampling_matches_the_target_law_on_a_hybrid(arch):
    """χ² of 3-token continuations sampled speculatively (drafts sampled from the draft law) against the exact
    law, enumerated by cache-free forwards: |z| < 4, as tests/decode/test_sampling.py. B = 2: the first step
    verifies one draft, and when it is rejected the second step decodes from the rolled-back cache (with B ≥ 3
    the first step alone ends a 3-token generation)."""
    from tests.decode.test_sampling import _chi2_z, _exact_law, _samples

    target, drafter = _small_vocab_hybrid(arch)
    prompt = [1, 2, 3, 4]
    law = _exact_law(target.model, prompt, 1.0)
    dec = SpecDecoder(target, drafter, block_size=2, draft_sampling="sample")
    z = _chi2_z(_samples(dec, prompt, 500, 1.0), law)
    print(f"{arch} chi2 z={z:.3f}")
    assert abs(z) < 4.0, f"chi-square z = {z:.2f} (|z| < 4 expected for the target's law)"


def test_the_law_test_detects_a_rollback_that_keeps_the_rejected_state(monkeypatch):
    """The naive rollback (crop the attention layers, leave the linear-attention layers' recurrent and
    convolution states as they are after the whole block) is lossy, and the law test sees it."""
    from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin

    from dflashkit.decode import spec_decode
    from tests.decode.test_sampling import _chi2_z, _exact_law, _samples

    def naive(cache, drop: int) -> None:
        for layer in cache.layers:
            recurrent = isinstance(layer, LinearAttentionCacheLayerMixin) and not isinstance(layer, CacheLayerMixin)
            layer.crop(0 if recurrent else -drop)  # crop(0): trims the windows, keeps the rejected tokens in them

    target, drafter = _small_vocab_hybrid("qwen3_next")
    prompt = [1, 2, 3, 4]
    law = _exact_law(target.model, prompt, 1.0)
    monkeypatch.setattr(spec_decode, "rollback", naive)
    dec = SpecDecoder(target, drafter, block_size=2, draft_sampling="sample")
    z = _chi2_z(_samples(dec, prompt, 400, 1.0), law)
    print(f"lossy chi2 z={z:.3f}")
    assert z > 4.0, f"the lossy rollback went undetected (z = {z:.2f})"


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5", "bamba", "nemotron_h"])
def test_head_parts_read_by_name_give_the_hybrids_last_hidden_state(hybrids, arch):
    """Engine-fed and cached training read the embedding, final norm and head by name (`target/head.py`): the
    final norm's names (Bamba's final_layernorm, Nemotron-H's backbone.norm_f) and its (1 + w) form (Qwen3-Next,
    Qwen3.5) must give the full target's last hidden state and greedy tokens."""
    from dflashkit.target.head import load_head_parts

    target = hybrids[arch]
    parts = load_head_parts(target.model_dir)
    ids = torch.randint(0, 259, (1, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        pre_norm, last = target.features(ids, layer_ids=[target.num_layers - 1], need_last_hidden=True)
        assert torch.allclose(parts.final_norm(pre_norm), last, atol=1e-5)
        assert torch.equal(parts.next_token_ids(last), target.next_token_ids(last))
        assert torch.equal(parts.embed(ids), target.embed(ids))


def test_a_sliding_window_target_rolls_back_past_its_window():
    """Sliding-window layers record too (`arm`): a block verified after the window is full rolls back exactly."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=320, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=2048,
                      use_sliding_window=True, sliding_window=8, max_window_layers=0,
                      layer_types=["sliding_attention", "full_attention"] * 2)
    model = AutoModelForCausalLM.from_config(cfg).eval().requires_grad_(False)
    target = Target(model=model, tokenizer=None, model_dir=Path("."), device=torch.device("cpu"),
                    dtype=torch.float32)
    ref = _greedy_reference(target)  # the prompt (13 tokens) already outgrows the window of 8
    for b in (2, 4, 8):
        r = SpecDecoder(target, None, b, proposer=PartlyRightProposer(target)).generate(PROMPT, SamplingParams(
            max_new_tokens=N))
        assert r.token_ids == ref, f"B={b}"
