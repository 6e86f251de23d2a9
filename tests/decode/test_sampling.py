"""Lossless sampling: speculative sampling reproduces the target's own law (exact law vs fixed-seed samples)."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch

from dflashkit.decode import spec_decode
from dflashkit.decode.api import SamplingParams
from dflashkit.decode.sampling import sampling_probs, verify_greedy, verify_sampled
from dflashkit.decode.spec_decode import SpecDecoder
from dflashkit.model.drafter import DFlashDraftModel
from dflashkit.family.contract import DrafterContract
from tests.helpers import pinned_cost

V = 8  # tiny vocab so the exact law of 3-token continuations (512 cells) can be enumerated


def test_sampling_probs_top_k_top_p():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    p = sampling_probs(logits, 1.0, top_k=2)
    assert (p > 0).sum() == 2 and torch.isclose(p.sum(), torch.tensor(1.0))
    full = torch.softmax(logits, -1)
    p = sampling_probs(logits, 1.0, top_p=0.8)  # top two carry 0.665+0.245 ≥ 0.8 → keep exactly two
    assert (p > 0).tolist() == [True, True, False, False, False]
    assert torch.allclose(p[:2], full[:2] / full[:2].sum())
    assert verify_greedy([5, 6, 7], [5, 6, 1, 9]) == (2, 1)
    assert verify_greedy([5, 6], [5, 6, 4]) == (2, 4)


@pytest.mark.parametrize("point_mass", [True, False])
def test_verify_rule_emits_the_target_law_at_one_position(point_mass):
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.2] * 5])
    q = torch.tensor([[0.05, 0.05, 0.1, 0.2, 0.6]])
    n, counts = 8000, torch.zeros(5)
    for _ in range(n):
        d = 4 if point_mass else int(torch.multinomial(q[0], 1, generator=g))
        a, tok = verify_sampled([d], p, None if point_mass else q, g)
        counts[d if a == 1 else tok] += 1
    tv = 0.5 * (counts / n - p[0]).abs().sum().item()
    assert tv < 0.03, f"total variation {tv:.4f} (tolerance 0.03 for n={n}; expected ≈ 0.008)"


def _tiny_small_vocab_target():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(3)
    cfg = Qwen3Config(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, intermediate_size=64, max_position_embeddings=64,
                      tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg).eval().requires_grad_(False)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # peaky laws: a wrong rule shows up clearly
    model.config._attn_implementation = "sdpa"
    target = SimpleNamespace(model=model, config=model.config, device=torch.device("cpu"), dtype=torch.float32,
                             num_layers=2, hidden_size=32, vocab_size=V, lm_head=model.lm_head,
                             embed=model.get_input_embeddings())
    from dflashkit.target.load import Target

    target.features = lambda ids, **kw: Target.features(target, ids, **kw)
    target._taps = lambda *a, **kw: Target._taps(target, *a, **kw)
    target.decoder_layers = model.model.layers
    contract = DrafterContract(block_size=4, num_draft_layers=1, target_layer_ids=[0, 1], mask_token_id=V - 1,
                               num_target_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                               head_dim=16, intermediate_size=64, vocab_size=V)
    drafter = DFlashDraftModel(contract).eval()
    with torch.no_grad():
        drafter.fc.weight.mul_(20.0)
    return target, drafter


def _exact_law(model, prompt: list[int], temperature: float) -> dict[tuple, float]:
    """P(x1, x2, x3 | prompt) by enumeration (512 cells)."""
    with torch.no_grad():
        law = {}
        p1 = sampling_probs(model(torch.tensor([prompt])).logits[0, -1], temperature)
        pairs = torch.tensor([prompt + [a] for a in range(V)])
        p2 = sampling_probs(model(pairs).logits[:, -1], temperature)
        triples = torch.tensor([prompt + [a, b] for a, b in itertools.product(range(V), repeat=2)])
        p3 = sampling_probs(model(triples).logits[:, -1], temperature).view(V, V, V)
        for a, b, c in itertools.product(range(V), repeat=3):
            law[(a, b, c)] = (p1[a] * p2[a, b] * p3[a, b, c]).item()
    return law


def _chi2_z(samples: list[tuple], law: dict[tuple, float]) -> float:
    """Pearson χ² against the exact law (cells with expected < 5 pooled), as a z-score (df large)."""
    n = len(samples)
    counts = {k: 0 for k in law}
    for s in samples:
        counts[s] += 1
    stat, df, pool_o, pool_e = 0.0, -1, 0, 0.0
    for k, p in law.items():
        if n * p >= 5:
            stat += (counts[k] - n * p) ** 2 / (n * p)
            df += 1
        else:
            pool_o, pool_e = pool_o + counts[k], pool_e + n * p
    if pool_e > 0:
        stat += (pool_o - pool_e) ** 2 / pool_e
        df += 1
    return (stat - df) / math.sqrt(2 * df)


def _samples(decoder, prompt, n, temperature):
    out = []
    for i in range(n):
        r = decoder.generate(prompt, SamplingParams(temperature=temperature, max_new_tokens=3, seed=i))
        out.append(tuple(r.token_ids))
    return out


@pytest.fixture(scope="module")
def small():
    target, drafter = _tiny_small_vocab_target()
    prompt = [1, 2, 3, 4]
    return target, drafter, prompt, _exact_law(target.model, prompt, 1.0)


# Tolerance: under the null the χ² z-score is ≈ N(0, 1); |z| < 4 with fixed seeds. The broken rule
# below (accept every draft) must exceed it, showing the test can fail.
N_SAMPLES = 500


def with_draft_vocab(drafter, vocab):
    """The same drafter weights over a reduced draft vocabulary (None: unchanged)."""
    if vocab is None:
        return drafter
    d = DFlashDraftModel(drafter.contract, draft_vocab=torch.tensor(vocab)).eval()
    d.load_state_dict({**drafter.state_dict(), "d2t": d.d2t})
    return d


@pytest.mark.parametrize("vocab", [None, [1, 2, 4, 6]], ids=["full-vocab", "draft-vocab"])
@pytest.mark.parametrize("draft_sampling", ["greedy", "sample"])
def test_speculative_sampling_matches_the_target_law(small, draft_sampling, vocab):
    """Also with a reduced draft vocab: q is zero on 0, 3, 5, 7, which the target still samples."""
    target, drafter, prompt, law = small
    dec = SpecDecoder(target, with_draft_vocab(drafter, vocab), block_size=4, draft_sampling=draft_sampling)
    z = _chi2_z(_samples(dec, prompt, N_SAMPLES, 1.0), law)
    print(f"chi2 z={z:.3f}")
    assert abs(z) < 4.0, f"chi-square z = {z:.2f} (|z| < 4 expected for the target's law)"


def test_causal_speculative_sampling_matches_the_target_law(small):
    """A causal (JetSpec) drafter's draft law is its head's law too: sampling from it stays lossless."""
    from dataclasses import replace

    target, drafter, prompt, law = small
    causal = DFlashDraftModel(replace(drafter.contract, knobs=replace(drafter.contract.knobs, causal=True))).eval()
    causal.load_state_dict(drafter.state_dict())
    assert causal.causal
    dec = SpecDecoder(target, causal, block_size=4, draft_sampling="sample")
    z = _chi2_z(_samples(dec, prompt, N_SAMPLES, 1.0), law)
    assert abs(z) < 4.0, f"chi-square z = {z:.2f} (|z| < 4 expected for the target's law)"


def test_the_law_test_detects_a_lossy_rule(small, monkeypatch):
    target, drafter, prompt, law = small

    def accept_all(drafts, target_probs, draft_probs, generator=None):
        return len(drafts), int(torch.multinomial(target_probs[len(drafts)], 1, generator=generator))

    monkeypatch.setattr(spec_decode, "verify_sampled", accept_all)
    dec = SpecDecoder(target, drafter, block_size=4, draft_sampling="sample")
    z = _chi2_z(_samples(dec, prompt, 100, 1.0), law)
    print(f"lossy chi2 z={z:.3f}")
    assert z > 4.0, f"the lossy rule went undetected (z = {z:.2f})"


def dflash2_like(drafter, top_k: int = 3):
    """A DFlash2 drafter sharing `drafter`'s DFlash weights, with a strong random selector over top_k < V."""
    from dflashkit.model.dflash2 import DFlash2DraftModel, init_from_dflash

    c = DrafterContract.from_dict({**drafter.contract.to_dict(), "drafter_type": "dflash2", "conv_group_size": 8,
                                   "selector_rank": 4, "selector_top_k": top_k})
    torch.manual_seed(5)
    d2 = DFlash2DraftModel(c).eval()
    init_from_dflash(d2, drafter.state_dict())
    with torch.no_grad():
        d2.candidate_selector.predecessor_codebook.normal_(std=3.0)
        d2.candidate_selector.successor_codebook.normal_(std=3.0)
        d2.candidate_selector.hidden_projection.weight.normal_(std=1.0)
    return d2


@pytest.mark.parametrize("draft_sampling", [pytest.param("greedy", marks=pytest.mark.slow), "sample"])
def test_dflash2_walk_sampling_matches_the_target_law(small, draft_sampling):
    """The Gumbel walk proposes from q_t over 3 of 8 tokens, conditioned on the previous draw; the rule stays
    lossless (greedy: the walk's point mass)."""
    target, drafter, prompt, law = small
    dec = SpecDecoder(target, dflash2_like(drafter), block_size=4, draft_sampling=draft_sampling)
    z = _chi2_z(_samples(dec, prompt, N_SAMPLES, 1.0), law)
    print(f"chi2 z={z:.3f}")
    assert abs(z) < 4.0, f"chi-square z = {z:.2f} (|z| < 4 expected for the target's law)"


def test_the_law_test_detects_a_wrong_dflash2_draft_law(small, monkeypatch):
    """Handing the rule the unary softmax instead of the walk's q (the selector's reranking ignored) is lossy."""
    target, drafter, prompt, law = small
    d2 = dflash2_like(drafter)
    real = SpecDecoder._propose

    def wrong_q(self, h, logits, anchor, params, gen, block=None):
        tokens, q = real(self, h, logits, anchor, params, gen, block)
        return tokens, torch.softmax(logits.float() / params.temperature, -1)

    monkeypatch.setattr(SpecDecoder, "_propose", wrong_q)
    dec = SpecDecoder(target, d2, block_size=4, draft_sampling="sample")
    z = _chi2_z(_samples(dec, prompt, 200, 1.0), law)
    print(f"lossy chi2 z={z:.3f}")
    assert z > 4.0, f"the wrong draft law went undetected (z = {z:.2f})"


def lilicorr_like(drafter, top_k: int = 4):
    """A LiLiCorr drafter sharing `drafter`'s DFlash weights, with a strong random lattice head over top_k < V."""
    from dflashkit.model.lilicorr import LiLiCorrDraftModel, init_from_backbone

    c = DrafterContract.from_dict({**drafter.contract.to_dict(), "drafter_type": "lilicorr",
                                   "lilicorr_candidate_topk": top_k, "lilicorr_num_heads": 4,
                                   "lilicorr_factor_dim": 8, "lilicorr_logit_scale": 4.0})
    torch.manual_seed(6)
    lc = LiLiCorrDraftModel(c).eval()
    init_from_backbone(lc, drafter.state_dict(), source="DFlash")
    with torch.no_grad():
        for name, p in lc.lilicorr.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(std=0.5)
    return lc


@pytest.mark.parametrize("draft_sampling", [pytest.param("greedy", marks=pytest.mark.slow), "sample"])
def test_lilicorr_walk_sampling_matches_the_target_law(small, draft_sampling):
    """The Gumbel walk over the lattice proposes from q_t over 4 of 8 tokens, conditioned on the previous draw;
    the rule stays lossless (greedy: the walk's point mass)."""
    target, drafter, prompt, law = small
    dec = SpecDecoder(target, lilicorr_like(drafter), block_size=4, draft_sampling=draft_sampling)
    z = _chi2_z(_samples(dec, prompt, N_SAMPLES, 1.0), law)
    print(f"chi2 z={z:.3f}")
    assert abs(z) < 4.0, f"chi-square z = {z:.2f} (|z| < 4 expected for the target's law)"


def test_the_law_test_detects_a_wrong_lilicorr_draft_law(small, monkeypatch):
    """Handing the rule the head's softmax instead of the lattice walk's q is lossy, and detected."""
    target, drafter, prompt, law = small
    lc = lilicorr_like(drafter)
    real = SpecDecoder._propose

    def wrong_q(self, h, logits, anchor, params, gen, block=None):
        tokens, q = real(self, h, logits, anchor, params, gen, block)
        return tokens, torch.softmax(logits.float() / params.temperature, -1)

    monkeypatch.setattr(SpecDecoder, "_propose", wrong_q)
    dec = SpecDecoder(target, lc, block_size=4, draft_sampling="sample")
    z = _chi2_z(_samples(dec, prompt, 200, 1.0), law)
    print(f"lossy chi2 z={z:.3f}")
    assert z > 4.0, f"the wrong draft law went undetected (z = {z:.2f})"


def test_adaptive_length_with_sampled_drafts_matches_the_target_law(small):
    """The adaptive draft length (decode/draft_length.py) chooses how many sampled drafts to verify from the head's
    peak probabilities, never from what was drawn (a length that follows the draw keeps likely draws more often
    than the rule assumes, and the output law drifts from the target's)."""
    target, drafter, prompt, law = small
    # t(n) pinned (tests/helpers.py): the lengths follow the confidences, not this machine's timings (a loaded
    # machine's t(n) could cut every step to no drafts and leave the law test nothing to check)
    dec = pinned_cost(SpecDecoder(target, drafter, block_size=4, draft_sampling="sample", adaptive=True),
                      {1: 1.0, 4: 2.0})
    assert dec.policy is not None
    chosen, choose = [], dec.policy.choose
    dec.policy.choose = lambda conf: chosen.append(choose(conf)) or chosen[-1]  # type: ignore[method-assign]
    z = _chi2_z(_samples(dec, prompt, N_SAMPLES, 1.0), law)
    assert set(chosen) == {0, 1, 2}, sorted(set(chosen))  # 3 new tokens: at most 2 drafts after the first
    assert abs(z) < 4.0, f"chi-square z = {z:.2f} (|z| < 4 expected for the target's law)"


def test_adaptive_length_of_sampled_drafts_does_not_depend_on_the_draw(small):
    """The same step drafted with two generators: other draws, the same confidences (so the same length)."""
    target, drafter, prompt, _ = small
    dec = SpecDecoder(target, drafter, block_size=4, draft_sampling="sample", adaptive=True)
    params = SamplingParams(temperature=1.0, max_new_tokens=3)
    with torch.inference_mode():
        feats, _ = dec._forward(torch.tensor([prompt]), spec_decode_cache(target))
        pos = torch.arange(16)[None]
        out = []
        for seed in range(12):
            g = torch.Generator().manual_seed(seed)
            dstate = dec._fast.new_state(16) if dec._fast is not None else spec_decode.DraftKVCache()
            tokens, q, conf = dec._draft(list(prompt), len(prompt) - 1, 3, feats[:, :-1], dstate, pos, params, g)
            out.append((tuple(tokens), tuple(conf)))
    assert len({t for t, _ in out}) > 1, "the draws never differed: the check would be vacuous"
    assert len({c for _, c in out}) == 1, out


def spec_decode_cache(target):
    from transformers import DynamicCache

    return DynamicCache(config=target.config)
