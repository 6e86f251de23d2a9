"""Prompt lookup, the tie-aware lossless check and the drafter diagnostics (bigram, no-feature ablation)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from dflashkit.config import TargetSection
from dflashkit.decode.api import GenerationResult, SamplingParams
from dflashkit.decode.diagnostics import BigramTable, simulated_acceptance
from dflashkit.decode.lossless import Divergence, TieRule, first_divergence, lossless_verdict, tie_rule
from dflashkit.decode.metrics import summarize_acceptance
from dflashkit.decode.ngram import PromptLookupProposer
from dflashkit.decode.spec_decode import SpecDecoder
from dflashkit.target.load import load_target
from dflashkit.testing import random_drafter

PROMPT = [1, 60, 61, 62, 63, 64, 10, 65, 66, 67, 68, 2, 10]


def lookup_oracle(sequence: list[int], num_tokens: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """The prompt-lookup rule as a plain loop: latest earlier occurrence of the last n tokens, n = max..min."""
    n_seq = len(sequence)
    for n in range(max_ngram, min_ngram - 1, -1):
        if n >= n_seq:
            continue
        suffix = sequence[n_seq - n:]
        for j in range(n_seq - n - 1, -1, -1):  # j = n_seq - n is the suffix itself
            if sequence[j: j + n] == suffix:
                return sequence[j + n: j + n + num_tokens]
    return []


@pytest.fixture(scope="module")
def target(tiny_qwen3):
    return load_target(TargetSection(path=str(tiny_qwen3), device="cpu", dtype="float32"))


def test_prompt_lookup_matches_the_loop_oracle_on_random_sequences():
    rng = random.Random(0)
    found = 0
    for trial in range(3000):
        vocab = rng.choice([2, 3, 5, 20])  # small vocabularies: many (overlapping) matches
        seq = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        k, mx = rng.randrange(0, 9), rng.randrange(1, 5)
        mn = rng.randrange(1, mx + 1)
        got = PromptLookupProposer(mx, mn).propose(seq, k)
        assert got == lookup_oracle(seq, k, mx, mn), (seq, k, mx, mn)
        assert len(got) <= k
        found += bool(got)
    assert found > 1000  # the comparison exercised real matches, not only empty proposals


def test_prompt_lookup_prefers_the_longest_and_latest_match():
    p = PromptLookupProposer(3, 1)
    # "1 2 3" occurs at 0 and 5: the latest (5) wins; its continuation is 9 9
    assert p.propose([1, 2, 3, 7, 7, 1, 2, 3, 9, 9, 4, 1, 2, 3], 4) == [9, 9, 4, 1]
    # the 3-gram "5 1 2" has no earlier match, the 2-gram "1 2" does (latest at 5 → 8)
    assert p.propose([1, 2, 4, 0, 0, 1, 2, 8, 5, 1, 2], 2) == [8, 5]
    assert p.propose([1, 2, 3], 5) == [] and p.propose([4], 3) == [] and p.propose([4, 4], 0) == []
    assert p.propose([4, 4], 3) == [4]  # the continuation stops at the end of the sequence
    with pytest.raises(ValueError):
        PromptLookupProposer(1, 2)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_prompt_lookup_decoding_is_lossless_and_tau_is_bounded(target, temperature):
    params = SamplingParams(max_new_tokens=40, temperature=temperature, seed=3)
    base = SpecDecoder(target, None, 1).generate(PROMPT, params)
    with torch.inference_mode():
        ref = target.model.generate(torch.tensor([PROMPT]), max_new_tokens=40, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    if temperature == 0:
        assert base.token_ids == ref
    for b in (2, 4, 8) if temperature == 0 else (4,):
        r = SpecDecoder(target, None, b, proposer=PromptLookupProposer()).generate(PROMPT, params)
        assert all(1 <= a <= b for a in r.acceptance_lengths) and sum(r.acceptance_lengths) == 39
        assert len(r.token_ids) == 40
        if temperature == 0:
            assert r.token_ids == ref, f"B={b}"
            tau = summarize_acceptance([r], b)["tau"]
            assert 1.0 <= tau <= b


def test_repetitive_output_is_accepted_from_the_lookup(target):
    """On a target that repeats itself, prompt lookup must reach τ > 1 (its proposals are used)."""
    params = SamplingParams(max_new_tokens=60)
    base = SpecDecoder(target, None, 1).generate(PROMPT, params).token_ids
    r = SpecDecoder(target, None, 4, proposer=PromptLookupProposer()).generate(PROMPT, params)
    assert r.token_ids == base
    # the tiny random target falls into a loop; every repeat after the first is predictable
    assert len(set(base[20:])) < 20 and max(r.acceptance_lengths) > 1


def test_top_logits_are_recorded_per_emitted_token(target):
    params = SamplingParams(max_new_tokens=12)
    for b, prop in ((1, None), (4, PromptLookupProposer())):
        r = SpecDecoder(target, None, b, proposer=prop, record_top=3).generate(PROMPT, params)
        assert len(r.top_logits) == len(r.token_ids) == 12 and all(len(t) == 3 for t in r.top_logits)
    # oracle: a full forward over prompt + output gives the same top logits (fp32)
    with torch.inference_mode():
        logits = target.model(torch.tensor([PROMPT + r.token_ids])).logits[0, len(PROMPT) - 1:-1]
    top = torch.topk(logits, 3, dim=-1)
    assert top.indices[:, 0].tolist() == r.token_ids
    assert [[i for i, _ in t] for t in r.top_logits] == top.indices.tolist()
    assert np.allclose([[v for _, v in t] for t in r.top_logits], top.values.tolist(), atol=1e-4)
    assert SpecDecoder(target, None, 1).generate(PROMPT, params).top_logits == []  # off by default


def _res(tokens, top=None):
    return GenerationResult(token_ids=tokens, finish_reason="length", top_logits=top or [])


def test_first_divergence_and_verdict():
    top = [[(5, 9.0), (9, 6.0), (1, 5.0)], [(6, 4.0), (4, 4.0), (3, 3.9)], [(7, 8.0), (1, 6.0), (3, 2.0)],
           [(8, 1.0), (1, 0.5), (2, 0.1)]]
    base = _res([5, 6, 7, 8], top)
    assert first_divergence(_res([5, 6, 7, 8]), base) is None
    tie = first_divergence(_res([5, 4, 0, 0]), base)        # an exact tie with the runner-up
    assert tie == Divergence(1, 0.0, 0.0, 4.0, 6, 4)
    third = first_divergence(_res([5, 3, 0, 0]), base)      # the third token, 0.1 behind: still a tie
    assert third.gap == pytest.approx(0.1) and third.margin == 0.0
    wrong = first_divergence(_res([5, 6, 3, 0]), base)      # 6 logits behind
    assert wrong.position == 2 and wrong.gap == 6.0
    outside = first_divergence(_res([5, 6, 7, 99]), base)   # not among the recorded top-k
    assert outside.gap is None and outside.margin == 0.5
    fixed = TieRule(0.0, 0.25)
    assert lossless_verdict([None, None], fixed)["verdict"] == "exact"
    v = lossless_verdict([None, tie, third], fixed)
    assert v["verdict"] == "ties-only" and v["ties"] == 2 and v["max_tie_gap"] == pytest.approx(0.1)
    v = lossless_verdict([tie, wrong], fixed)
    assert v["verdict"] == "not lossless" and v["min_non_tie_gap"] == 6.0
    assert lossless_verdict([outside], fixed)["verdict"] == "not lossless"
    assert lossless_verdict([third], TieRule(0.0, 0.05))["verdict"] == "not lossless"  # the tolerance is the line
    # relative: a share of the largest |logit| among the top-k there (4.0 at position 1, 8.0 at position 2)
    assert lossless_verdict([third], TieRule(0.03))["verdict"] == "ties-only"      # 0.1 <= 0.12
    assert lossless_verdict([third], TieRule(0.02))["verdict"] == "not lossless"   # 0.1 > 0.08
    assert lossless_verdict([wrong], TieRule(0.5))["verdict"] == "not lossless"    # 6 > 4
    bf, fp16, fp32 = (tie_rule(d) for d in (torch.bfloat16, torch.float16, torch.float32))
    assert bf.relative > fp16.relative > fp32.relative and bf.absolute is None
    assert tie_rule("bfloat16", 0.5).limit(tie) == 0.5


def test_verdict_of_ties_whose_margin_was_not_recorded():
    """A tie's margin may be unknown (Divergence.margin None: no runner-up recorded); the verdict
    still judges it, and max_tie_margin is the largest recorded one (mypy found the crash: round(None))."""
    rule = TieRule(0.0, 0.25)
    unknown = Divergence(1, None, 0.1, 4.0, 6, 4)
    known = Divergence(2, 0.2, 0.2, 8.0, 7, 1)
    v = lossless_verdict([unknown], rule)
    assert v["verdict"] == "ties-only" and v["ties"] == 1
    assert v["max_tie_gap"] == pytest.approx(0.1) and v["max_tie_margin"] is None
    v = lossless_verdict([unknown, known, None], rule)
    assert v["verdict"] == "ties-only" and v["ties"] == 2
    assert v["max_tie_gap"] == pytest.approx(0.2) and v["max_tie_margin"] == pytest.approx(0.2)

def _bigram_oracle(samples, outputs):
    counts: dict[int, dict[int, int]] = {}
    uni: dict[int, int] = {}
    for ids, mask in samples:
        for t in range(1, len(ids)):
            if mask[t]:
                counts.setdefault(ids[t - 1], {}).setdefault(ids[t], 0)
                counts[ids[t - 1]][ids[t]] += 1
                uni[ids[t]] = uni.get(ids[t], 0) + 1
    best = {p: min(c, key=lambda n: (-c[n], n)) for p, c in counts.items()}
    backoff = min(uni, key=lambda n: (-uni[n], n))
    pairs = [(p, n) for out in outputs for p, n in zip(out[:-1], out[1:])]
    return sum(best.get(p, backoff) == n for p, n in pairs) / len(pairs)


def test_bigram_table_matches_a_counting_oracle():
    rng = np.random.default_rng(0)
    samples = [(rng.integers(0, 12, n).tolist(), (rng.random(n) < 0.6).astype(int).tolist())
               for n in rng.integers(2, 40, 30)]
    outputs = [rng.integers(0, 14, n).tolist() for n in (5, 30, 17)]
    table = BigramTable.fit([np.array(s[0]) for s in samples], [np.array(s[1]) for s in samples])
    got = table.accuracy(outputs)
    assert got["accuracy"] == round(_bigram_oracle(samples, outputs), 4)
    assert got["positions"] == 4 + 29 + 16 and got["unseen_previous"] > 0  # ids 12, 13 never seen
    # a table fit on the outputs themselves predicts a deterministic sequence perfectly
    seq = list(range(20))
    assert BigramTable.fit([np.array(seq)], [np.ones(20)]).accuracy([seq])["accuracy"] == 1.0


def test_simulated_acceptance_oracle_and_zeroed_features(target):
    """Teacher-forced τ equals a per-anchor loop over the real decoder's draft step; zeroing features changes drafts."""
    drafter = random_drafter(target, block_size=4)
    params = SamplingParams(max_new_tokens=16)
    out = SpecDecoder(target, None, 1).generate(PROMPT, params).token_ids
    sim = simulated_acceptance(target, drafter, [PROMPT], [out])
    assert sim["blocks"] == 15 and 1.0 <= sim["tau"] <= 4
    # oracle: for each anchor, the decoder's own draft path (fresh draft cache, features of the prefix)
    seq = PROMPT + out
    dec = SpecDecoder(target, drafter, 4)
    lead_sum, first_ok = 0, 0
    with torch.inference_mode():
        for p in range(len(PROMPT), len(seq) - 1):
            from dflashkit.model.drafter import DraftKVCache

            feats = target.features(torch.tensor([seq[:p]]), layer_ids=list(drafter.target_layer_ids))
            positions = torch.arange(len(seq) + 4)[None]
            k = min(3, len(seq) - 1 - p)
            drafts, _, _ = dec._draft(seq, p, 3, feats, DraftKVCache(), positions, params, None)
            ok = [d == t for d, t in zip(drafts[:k], seq[p + 1: p + 1 + k])]
            lead = next((i for i, x in enumerate(ok) if not x), len(ok))
            lead_sum += 1 + lead
            first_ok += ok[0]
    assert sim["tau"] == pytest.approx(lead_sum / 15, abs=1e-4)
    assert sim["per_position_accuracy"][0] == pytest.approx(first_ok / 15, abs=1e-4)
    zero = simulated_acceptance(target, drafter, [PROMPT], [out], no_features=True)
    assert zero["no_features"] and zero["ablation"] == "context" and zero["blocks"] == 15 and 1.0 <= zero["tau"] <= 4


# -- `dflashkit eval` end to end (tiny target, random drafter) ---------------------------------------------------
def _eval_run_dir(tmp_path, target):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.helpers import run_dir_with_drafter as _run_dir

    rd = _run_dir(tmp_path, target, block_size=4, prompts=2)
    (rd / "tokenize").mkdir()
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, 259, 30).tolist() for _ in range(4)]
    pq.write_table(pa.table({"id": [f"s{i}" for i in range(4)], "input_ids": ids,
                             "loss_mask": [[0] * 10 + [1] * 20 for _ in ids]}), rd / "tokenize" / "shard-00000.parquet")
    return rd


def _eval(rd, tiny_qwen3, *extra):
    from dflashkit.cli import main

    return main(["eval", f"target.path={tiny_qwen3}", "eval.max_new_tokens=12", "eval.warmup=0",
                 "eval.block_sizes=[2,4]", "--run-dir", str(rd), "--json", *extra])


def test_eval_reports_prompt_lookup_diagnostics_and_the_best_block_size(tmp_path, target, tiny_qwen3):
    import json

    rd = _eval_run_dir(tmp_path, target)
    assert _eval(rd, tiny_qwen3) == 0
    res = json.loads((rd / "eval" / "results.json").read_text())
    assert res["dtype"] == "float32" and res["lossless"]["verdict"] == "exact"
    # 2 prompts × (2 block sizes × (drafter, adaptive, lookup) + at the largest: suffix, hybrid@2, hybrid@4, graft@4)
    assert res["lossless"]["compared"] == 2 * 10
    assert set(res["adaptive"]) == {"2", "4"} and 0 <= res["summary"]["adaptive"]["drafts_per_step"] <= 3
    assert set(res["prompt_lookup"]) == {"2", "4"} and res["prompt_lookup_ngram"] == 3
    for bs, r in res["prompt_lookup"].items():
        assert 1 <= r["tau"] <= int(bs) and r["identical_to_baseline"] is True and r["speedup"] > 0
    s = res["summary"]
    assert s["speedup"] == max(r["speedup"] for r in res["speculative"].values())
    assert s["prompt_lookup"]["speedup"] == max(r["speedup"] for r in res["prompt_lookup"].values())
    assert s["lossless"] == "exact" and s["greedy_identical"] is True
    d = res["diagnostics"]
    assert 0 <= d["bigram"]["accuracy"] <= 1 and d["bigram"]["positions"] == 2 * 11
    assert d["bigram"]["training_pairs"] == 4 * 20
    assert d["simulated"]["blocks"] == d["no_features"]["blocks"] == 2 * 11 and d["no_features"]["no_features"]
    assert d["other_context"]["blocks"] == 2 * 11 and d["other_context"]["ablation"] == "other"
    assert 0 <= d["drafter_position1"] <= 1 and 0 <= d["prompt_lookup_position1"] <= 1
    # the two best decoders compared prompt by prompt, from their own results
    from dflashkit.decode.api import GenerationResult
    from dflashkit.decode.metrics import paired_speed

    vs = s["versus_prompt_lookup"]
    assert vs["prompts"] == 2 and vs["interval90"][0] <= vs["ratio"] <= vs["interval90"][1]
    drafter = [GenerationResult(token_ids=[0] * p["tokens"], finish_reason="length", decode_s=p["decode_s"])
               for p in res["speculative"][str(s["block_size"])]["per_prompt"]]
    lookup = [GenerationResult(token_ids=[0] * p["tokens"], finish_reason="length", decode_s=p["decode_s"])
              for p in res["prompt_lookup"][str(s["prompt_lookup"]["block_size"])]["per_prompt"]]
    assert paired_speed(drafter, lookup) == vs
    # the suffix proposer alone and the hybrid grid (eval.hybrid_gates [2, 4], the graft at 4), lossless
    assert set(res["suffix"]) == {"4"} and set(res["hybrid"]) == {"4@2", "4@4", "4@4+graft"}
    for key, r in [*res["suffix"].items(), *res["hybrid"].items()]:
        assert 1 <= r["tau"] <= int(key.partition("@")[0]) and r["identical_to_baseline"] is True
    assert res["hybrid"]["4@4+graft"]["gate"] == {"min_match": 4, "graft": True}
    assert abs(sum(res["hybrid"]["4@2"]["branches"].values()) - 1) < 1e-3
    comp, hy = res["hybrid_composite"], s["hybrid"]
    assert len(comp["chosen"]) == 2 and {c["decoder"] for c in comp["chosen"]} <= set(comp["candidates"])
    assert comp["identical_to_baseline"] is True and hy["tau"] == comp["tau"]
    assert set(hy["gates_by_source"]) == set(res["by_source"]) and set(hy["gates_by_mode"]) == set(res["by_mode"])
    assert hy["versus_drafter"]["prompts"] == hy["versus_prompt_lookup"]["prompts"] == 2
    src = next(iter(res["by_source"].values()))
    assert set(src["hybrid"]) == set(res["hybrid"]) and "hybrid_composite" in src and "suffix" in src
    assert all(r.get("unreliable") is None or r["unreliable"] for r in res["speculative"].values())
    profile = json.loads((rd / "eval" / "speculation_profile.json").read_text())
    assert set(profile["proposers"]["by_source"]) == set(res["by_source"])
    assert profile["proposers"]["by_source"]["t"]["proposer"] in ("drafter", "suffix", "hybrid", "graft")


def test_eval_in_bfloat16_is_exact_or_ties_only(tmp_path, target, tiny_qwen3):
    import json

    rd = _eval_run_dir(tmp_path, target)
    assert _eval(rd, tiny_qwen3, "eval.dtype=bfloat16", "eval.diagnostics=false", "eval.max_new_tokens=24") == 0
    res = json.loads((rd / "eval" / "results.json").read_text())
    ll = res["lossless"]
    assert res["dtype"] == "bfloat16" and ll["dtype"] == "bfloat16" and ll["tolerance"] == tie_rule("bfloat16").describe()
    assert ll["verdict"] in ("exact", "ties-only") and ll["divergences"] == ll["ties"]
    assert all(r["tie"] and r["margin"] <= r["gap"] <= r["tolerance"] for r in ll["first_divergences"])
    assert "diagnostics" not in res


def test_a_planted_verify_bug_is_not_lossless(tmp_path, target, tiny_qwen3, monkeypatch):
    """A verify rule that always keeps the first draft diverges where the target clearly disagreed."""
    import json

    import dflashkit.decode.spec_decode as sd

    real = sd.verify_greedy

    def accepts_a_wrong_token(drafts, posterior):
        a, nxt = real(drafts, posterior)
        return (1, posterior[1]) if drafts and a == 0 else (a, nxt)

    monkeypatch.setattr(sd, "verify_greedy", accepts_a_wrong_token)
    rd = _eval_run_dir(tmp_path, target)
    assert _eval(rd, tiny_qwen3, "eval.dtype=bfloat16", "eval.diagnostics=false", "eval.prompt_lookup=false") == 1
    ll = json.loads((rd / "eval" / "results.json").read_text())["lossless"]
    assert ll["verdict"] == "not lossless" and ll["divergences"] > ll["ties"]
    wrong = [r for r in ll["first_divergences"] if not r["tie"]]
    assert all(r["gap"] is None or r["gap"] > r["tolerance"] for r in wrong)
    assert wrong and all(r["proposer"] in ("drafter", "drafter-adaptive", "suffix", "hybrid", "graft") for r in wrong)
    # the lossless check covers the suffix proposer and the hybrid too
    assert {"hybrid", "graft"} <= {r["proposer"] for r in wrong}
    # honest: the same run in fp32 without the bug is exact
    monkeypatch.setattr(sd, "verify_greedy", real)
    assert _eval(rd, tiny_qwen3, "eval.diagnostics=false", "eval.prompt_lookup=false") == 0


def test_eval_dtype_auto_measures_both_and_says_which(tmp_path, target, tiny_qwen3):
    import json

    rd = _eval_run_dir(tmp_path, target)
    assert _eval(rd, tiny_qwen3, "eval.dtype=auto", "eval.diagnostics=false", "eval.prompt_lookup=false") == 0
    res = json.loads((rd / "eval" / "results.json").read_text())
    choice = res["dtype_choice"]
    assert set(choice["calibration"]) == {"float32", "bfloat16"} and choice["chosen"] == res["dtype"]
    cal = choice["calibration"]
    assert cal[choice["chosen"]]["speedup"] == max(c["speedup"] for c in cal.values())
    assert all(c["baseline_tokens_per_s"] > 0 and c["best_block_size"] in (2, 4) for c in cal.values())


def _results(times_tokens):
    from dflashkit.decode.api import GenerationResult

    return [GenerationResult(token_ids=[0] * n, finish_reason="length", decode_s=t) for t, n in times_tokens]


def test_paired_speed_matches_a_loop_oracle_and_tells_noise_from_a_difference():
    import random

    from dflashkit.decode.metrics import paired_speed

    rng = random.Random(0)
    a = _results([(rng.uniform(1, 3), rng.randint(20, 40)) for _ in range(8)])
    b = _results([(rng.uniform(1, 3), rng.randint(20, 40)) for _ in range(8)])
    p = paired_speed(a, b)
    # the point ratio by a loop: B's decode seconds per token over A's (first token excluded, as summarize_timing)
    ta, na = sum(r.decode_s for r in a), sum(len(r.token_ids) - 1 for r in a)
    tb, nb = sum(r.decode_s for r in b), sum(len(r.token_ids) - 1 for r in b)
    assert p["ratio"] == pytest.approx((tb / nb) / (ta / na), abs=1e-4)
    assert p["faster_prompts"] == sum((x.decode_s / (len(x.token_ids) - 1)) < (y.decode_s / (len(y.token_ids) - 1))
                                      for x, y in zip(a, b))
    assert p["interval90"][0] <= p["ratio"] <= p["interval90"][1] and p["prompts"] == 8
    # swapping the decoders inverts the ratio and the verdict
    q = paired_speed(b, a)
    assert q["ratio"] == pytest.approx(1 / p["ratio"], rel=1e-3)
    assert q["clear"] == {"a": "b", "b": "a", None: None}[p["clear"]]
    # the same decodes: ratio 1, an interval of width 0 that contains 1, not told apart
    same = paired_speed(a, a)
    assert same["ratio"] == 1.0 and same["interval90"] == [1.0, 1.0] and same["clear"] is None
    # twice as fast on every prompt: told apart, whatever the prompts' spread
    fast = _results([(r.decode_s / 2, len(r.token_ids)) for r in a])
    twice = paired_speed(fast, a)
    assert twice["ratio"] == pytest.approx(2.0) and twice["clear"] == "a" and twice["faster_prompts"] == 8
    # a noisy 1.0 (each prompt ±20% either way) is not told apart
    noisy = _results([(r.decode_s * (1.2 if i % 2 else 1 / 1.2), len(r.token_ids)) for i, r in enumerate(a)])
    assert paired_speed(noisy, a)["clear"] is None
    # one prompt, however much faster: its interval has no width, nothing is told apart
    one = paired_speed(fast[:1], a[:1])
    assert one["ratio"] == pytest.approx(2.0) and one["interval90"][0] == one["interval90"][1] and one["clear"] is None
    assert paired_speed(fast[:2], a[:2])["clear"] == "a"
    with pytest.raises(ValueError, match="same prompts"):
        paired_speed(a, a[:3])
