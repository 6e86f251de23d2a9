"""Speculative decoding invariants: greedy output == target greedy output, τ bounds, stubs, stops, errors."""

from __future__ import annotations

import pytest
import torch

from dflashkit.config import TargetSection
from dflashkit.decode.api import SamplingParams
from dflashkit.decode.metrics import compare, summarize_acceptance, summarize_timing
from dflashkit.decode.spec_decode import SpecDecoder
from dflashkit.testing.proposers import CopyTargetProposer
from dflashkit.errors import UsageError
from dflashkit.target.load import load_target
from dflashkit.testing import random_drafter
from tests.harness.proposers import AdversarialProposer

BLOCKS = (1, 2, 4, 8, 16)


@pytest.fixture(scope="module")
def targets(tiny_targets):
    return {arch: load_target(TargetSection(path=str(d), device="cpu", dtype="float32"))
            for arch, d in tiny_targets.items()}


PROMPT = [1, 60, 61, 62, 63, 64, 10, 65, 66, 67, 68, 2, 10]


@pytest.mark.parametrize("arch", ["qwen3", "llama", "deepseek_v3"])
def test_greedy_speculative_equals_target_greedy(targets, arch):
    target = targets[arch]
    drafter = random_drafter(target, block_size=8)
    params = SamplingParams(max_new_tokens=23)
    base = SpecDecoder(target, None, block_size=1).generate(PROMPT, params)
    # independent oracle: HF generate, greedy, no cache tricks
    with torch.inference_mode():
        ref = target.model.generate(torch.tensor([PROMPT]), max_new_tokens=23, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert base.token_ids == ref
    assert base.acceptance_lengths == [1] * 22
    for b in BLOCKS:
        r = SpecDecoder(target, drafter, block_size=b).generate(PROMPT, params)
        assert r.token_ids == ref, f"B={b}: first diff at " \
            f"{next(i for i, (x, y) in enumerate(zip(r.token_ids, ref)) if x != y)}"
        assert len(r.token_ids) == 23 and r.finish_reason == "length"
        assert all(1 <= a <= b for a in r.acceptance_lengths)
        assert sum(r.acceptance_lengths) == 22  # every token after the prefill one comes from a step


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_speculative_with_a_reduced_draft_vocab_equals_target_greedy(targets, arch, monkeypatch):
    """Drafts come from the draft vocab only (mapped back to target ids); the output stays the target's."""
    from dflashkit.model.drafter import DFlashDraftModel

    target = targets[arch]
    params = SamplingParams(max_new_tokens=23)
    base = SpecDecoder(target, None, block_size=1).generate(PROMPT, params).token_ids
    # half of the target's own greedy tokens are in the vocab (accepted drafts happen), half are not
    vocab = sorted(set(base[::2]) | set(range(100, 140)))
    drafter = random_drafter(target, block_size=8)
    small = DFlashDraftModel(drafter.contract, draft_vocab=torch.tensor(vocab)).eval()
    small.load_state_dict({**drafter.state_dict(), "d2t": small.d2t})
    drafted = []
    real = SpecDecoder._draft

    def spy(self, *args):
        out = real(self, *args)
        drafted.extend(out[0])
        return out

    monkeypatch.setattr(SpecDecoder, "_draft", spy)
    longest = 1
    for b in (2, 4, 8):
        r = SpecDecoder(target, small, block_size=b).generate(PROMPT, params)
        assert r.token_ids == base, f"B={b}"
        assert sum(r.acceptance_lengths) == 22 and all(1 <= a <= b for a in r.acceptance_lengths)
        longest = max(longest, *r.acceptance_lengths)
    assert drafted and set(drafted) <= set(vocab)
    if arch == "qwen3":  # this random drafter agrees with its target on some in-vocab tokens (llama's never)
        assert longest > 1


def test_copy_stub_gives_full_blocks_and_adversarial_gives_one(targets):
    target = targets["qwen3"]
    for b in (2, 4, 8):
        params = SamplingParams(max_new_tokens=1 + 3 * b)
        base = SpecDecoder(target, None, 1).generate(PROMPT, params)
        copy = SpecDecoder(target, None, b, proposer=CopyTargetProposer(target)).generate(PROMPT, params)
        adv = SpecDecoder(target, None, b, proposer=AdversarialProposer(target)).generate(PROMPT, params)
        assert copy.token_ids == base.token_ids == adv.token_ids
        assert copy.acceptance_lengths == [b, b, b]
        assert adv.acceptance_lengths == [1] * (3 * b)
        s = summarize_acceptance([copy], b)
        assert s["tau"] == b and s["per_position_acceptance"] == [1.0] * (b - 1)
        assert summarize_acceptance([adv], b)["per_position_acceptance"] == [0.0] * (b - 1)


def test_stop_inside_accepted_block_truncates(targets):
    target = targets["qwen3"]
    params = SamplingParams(max_new_tokens=30)
    base = SpecDecoder(target, None, 1).generate(PROMPT, params).token_ids
    # a stop token that first appears mid-sequence, so it falls inside an accepted copy block
    idx = next(i for i in range(3, len(base)) if base[i] not in base[:i])
    stop = SamplingParams(max_new_tokens=30, stop_token_ids=(base[idx],))
    for b in (1, 4, 8):
        r = SpecDecoder(target, None, b, proposer=CopyTargetProposer(target)).generate(PROMPT, stop)
        assert r.token_ids == base[: idx + 1] and r.finish_reason == "stop"
    # a stop as the very first token ends the generation after it
    first = SamplingParams(max_new_tokens=30, stop_token_ids=(base[0],))
    r = SpecDecoder(target, None, 4, proposer=CopyTargetProposer(target)).generate(PROMPT, first)
    assert r.token_ids == base[:1] and r.acceptance_lengths == []


@pytest.mark.parametrize("max_new", [0, 1, 2, 5, 9])
def test_max_new_tokens_is_exact(targets, max_new):
    target = targets["llama"]
    r = SpecDecoder(target, None, 4, proposer=CopyTargetProposer(target)).generate(
        PROMPT, SamplingParams(max_new_tokens=max_new))
    assert len(r.token_ids) == max_new


def test_timings_and_bound_are_recorded(targets):
    target = targets["qwen3"]
    drafter = random_drafter(target, block_size=4)
    params = SamplingParams(max_new_tokens=9)
    base = SpecDecoder(target, None, 1).generate(PROMPT, params)
    spec = SpecDecoder(target, drafter, 4).generate(PROMPT, params)
    assert base.prefill_s > 0 and base.decode_s > 0 and len(base.verify_s) == 8
    assert len(spec.draft_s) == len(spec.verify_s) == len(spec.acceptance_lengths)
    tb, ts = summarize_timing([base]), summarize_timing([spec])
    c = compare(tb, ts, summarize_acceptance([spec], 4)["tau"])
    assert c["bound"] > 0 and c["speedup"] > 0 and c["t1_s"] > 0


def test_drafter_that_does_not_fit_the_target_is_refused(targets):
    target = targets["qwen3"]
    with pytest.raises(UsageError, match="target_layer_ids"):
        SpecDecoder(target, random_drafter(target, target_layer_ids=[1, 99]), 4)
    with pytest.raises(UsageError, match="hidden_size"):
        SpecDecoder(target, random_drafter(target, hidden_size=32, head_dim=8), 4)
    with pytest.raises(UsageError, match="vocab"):
        SpecDecoder(target, random_drafter(target, vocab_size=500, mask_token_id=400), 4)
    with pytest.raises(UsageError, match="needs a drafter"):
        SpecDecoder(target, None, 4)


def test_prompt_longer_than_context_is_refused_before_decoding(targets):
    target = targets["qwen3"]
    dec = SpecDecoder(target, None, 1, max_context=16)
    with pytest.raises(UsageError, match="exceeds the context of 16"):
        dec.generate(list(range(10, 30)), SamplingParams(max_new_tokens=4))


def test_smollm2_greedy_speculative_equals_baseline(smollm2_dir):
    target = load_target(TargetSection(path=str(smollm2_dir), device="cpu", dtype="float32"))
    drafter = random_drafter(target, block_size=16, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                             intermediate_size=512)
    tok = target.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Count from 1 to 10."}], tokenize=False,
                                   add_generation_prompt=True)
    prompt = tok.encode(text, add_special_tokens=False)
    params = SamplingParams(max_new_tokens=10)
    base = SpecDecoder(target, None, 1).generate(prompt, params)
    for b in BLOCKS:
        r = SpecDecoder(target, drafter, b).generate(prompt, params)
        assert r.token_ids == base.token_ids, f"B={b}"
        assert all(1 <= a <= b for a in r.acceptance_lengths)
