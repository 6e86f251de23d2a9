"""Eval's hybrid row (leave-one-out gate per source), the unreliable-timing flags and the warm-up order."""

from __future__ import annotations

import pytest

from dflashkit.config import RunConfig
from dflashkit.decode.api import GenerationResult, SamplingParams
from dflashkit.decode.evaluation import (composite_candidates, diagnostic_lines, entries, group_key, hybrid_composite,
                                         loo_composite, pick, pooled_tokens_per_s, results_table, timing_flags)
from dflashkit.decode.metrics import summarize_timing
from dflashkit.decode.runner import EvalPrompt, run_interleaved


def _r(seconds: float, tokens: int = 11, tau: int = 2, t_verify: float = 0.01) -> GenerationResult:
    steps = max(1, (tokens - 1) // tau)
    return GenerationResult(token_ids=[0] * tokens, finish_reason="length", decode_s=seconds, prefill_s=0.001,
                            acceptance_lengths=[tau] * steps, acceptance_cut=[False] * steps,
                            verify_s=[t_verify] * steps, step_s=[t_verify] * steps)


def _loo_oracle(runs, candidates, groups):
    """The rule in plain loops: for prompt i, the candidate with the most tokens per second over the other
    prompts of its group (ties: the first candidate), computed without ever reading prompt i's results."""
    n = len(runs[candidates[0]])
    out = [None] * n
    for idx in groups.values():
        for i in idx:
            others = [j for j in idx if j != i] or [j for j in range(n) if j != i]
            best, best_speed = candidates[0], -1.0
            for k in candidates:
                toks = sum(len(runs[k][j].token_ids) - 1 for j in others)
                secs = sum(runs[k][j].decode_s for j in others)
                speed = toks / secs if secs > 0 else 0.0
                if speed > best_speed:
                    best, best_speed = k, speed
            out[i] = best
    return out


def test_leave_one_out_never_uses_a_prompts_own_result():
    # source a: the suffix proposer is by far the fastest on prompt 0 only, the drafter on prompts 1 and 2;
    # in-sample over all of a the suffix proposer wins (prompt 0 dominates), so a choice that saw prompt 0 would
    # score prompt 0 with it. Source b has one prompt: it uses the choice over every other prompt.
    runs = {"4": [_r(1.0), _r(1.0), _r(1.0), _r(1.0)],
            "suffix-4": [_r(0.01), _r(1.2), _r(1.2), _r(3.0)],
            "hybrid-4@2": [_r(2.0), _r(2.0), _r(2.0), _r(0.5)]}
    groups = {"a": [0, 1, 2], "b": [3]}
    cands = composite_candidates(list(runs))
    assert pick(runs, cands, [0, 1, 2]) == "suffix-4"  # in sample: the suffix proposer
    choice, results = loo_composite(runs, cands, groups)
    assert choice == ["4", "suffix-4", "suffix-4", "suffix-4"]
    assert choice == _loo_oracle(runs, cands, groups)
    assert results == [runs[k][i] for i, k in enumerate(choice)]
    # prompt 0's own result decides nothing: change it arbitrarily, its choice stays
    for t in (1e-6, 0.3, 100.0):
        moved = {k: list(v) for k, v in runs.items()}
        moved["hybrid-4@2"][0] = _r(t)
        assert loo_composite(moved, cands, groups)[0][0] == _loo_oracle(moved, cands, groups)[0]
        assert loo_composite(moved, cands, groups)[0][0] == "4"


def test_leave_one_out_matches_the_loop_oracle_on_random_runs():
    import random

    rng = random.Random(0)
    for _ in range(200):
        n = rng.randrange(1, 7)
        keys = ["2", "4", "suffix-4", "hybrid-4@2", "graft-4@4", "lookup-4", "adaptive-4"]
        runs = {k: [_r(rng.choice([0.5, 1.0, 1.0, 2.0]) * rng.random() + 0.01, tokens=rng.randrange(2, 20))
                    for _ in range(n)] for k in keys}
        cands = composite_candidates(keys)
        assert "lookup-4" not in cands and "adaptive-4" not in cands and cands[0] == "2"
        names = [rng.choice("abc") for _ in range(n)]
        groups = {g: [i for i, x in enumerate(names) if x == g] for g in sorted(set(names))}
        assert loo_composite(runs, cands, groups)[0] == _loo_oracle(runs, cands, groups)


def test_group_keys_of_every_decoder():
    assert [group_key(k) for k in ("4", "adaptive-4", "lookup-2", "suffix-8", "hybrid-4@2", "graft-4@4",
                                   "hybrid-4@2/2")] == [
        ("speculative", "4"), ("adaptive", "4"), ("prompt_lookup", "2"), ("suffix", "8"), ("hybrid", "4@2"),
        ("hybrid", "4@4+graft"), ("hybrid", "4@2/2")]


def test_hybrid_keys_and_gates_with_a_short_drafter_block():
    from dflashkit.config import load_config
    from dflashkit.decode.evaluation import block_of, hybrid_gate, hybrid_keys

    cfg = load_config(None, ["eval.hybrid_gates=[2,4]", "eval.hybrid_drafter_blocks=[0,2,8]"])
    keys = hybrid_keys(cfg, 4)  # 8 >= the grid's block: the grid's own (0), listed once
    assert keys == ["suffix-4", "hybrid-4@2", "hybrid-4@4", "graft-4@4", "hybrid-4@2/2", "hybrid-4@4/2",
                    "graft-4@4/2"]
    g = hybrid_gate("graft-4@4/2")
    assert g is not None and (g.min_match, g.graft, g.drafter_block) == (4, True, 2) and block_of("graft-4@4/2") == 4
    g = hybrid_gate("hybrid-4@2")
    assert g is not None and g.drafter_block == 0
    assert hybrid_keys(load_config(None, ["eval.hybrid_drafter_blocks=[2]"]), 4)[1:] == [
        "hybrid-4@2/2", "hybrid-4@4/2", "graft-4@4/2"]


def _prompts(sources):
    return [EvalPrompt(f"p{i}", [{"role": "user", "content": "x"}], None, s) for i, s in enumerate(sources)]


def _composite(runs, base, sources):
    found = entries(runs, summarize_timing(base))
    for v in found.values():
        v["identical_to_baseline"] = True
    res = {"summary": {"block_size": 4, "tau": 2.0, "speedup": 1.0,
                       "prompt_lookup": {"block_size": 4, "tau": 2.0, "speedup": 1.1, "bound": 2.0}},
           "by_source": {s: {"mode": "default"} for s in set(sources)}, "by_mode": {"default": {}}}
    hybrid_composite(RunConfig(), _prompts(sources), runs, base, found, res)
    return res


def test_hybrid_row_reports_the_gate_per_source_and_paired_intervals():
    # source a copies its context (the hybrid at gate 2 is fastest there), source b does not (the drafter is)
    sources = ["a", "a", "a", "b", "b", "b"]
    runs = {"4": [_r(1.0)] * 3 + [_r(0.6)] * 3, "lookup-4": [_r(0.9)] * 6, "suffix-4": [_r(2.0)] * 6,
            "hybrid-4@2": [_r(0.55)] * 3 + [_r(2.0)] * 3}
    base = [_r(1.0, tau=1)] * 6  # every speedup at most tau 2: nothing flagged
    res = _composite(runs, base, sources)
    hy = res["summary"]["hybrid"]
    assert hy["gates_by_source"]["a"]["decoder"] == "hybrid-4@2" and hy["gates_by_source"]["a"]["gate"] == {
        "min_match": 2, "graft": False}
    assert hy["gates_by_source"]["b"]["decoder"] == "4" and hy["gates_by_source"]["b"]["proposer"] == "drafter"
    assert hy["gates_by_source"]["a"]["leave_one_out"] == ["hybrid-4@2"] * 3
    assert set(hy["gates_by_mode"]) == {"default"}
    comp = res["hybrid_composite"]
    assert "unreliable" not in comp and "unreliable" not in hy
    assert [c["decoder"] for c in comp["chosen"]] == ["hybrid-4@2"] * 3 + ["4"] * 3
    assert comp["tokens"] == 6 * 11 and comp["identical_to_baseline"] is True
    # against the drafter's best and lookup's best, overall and per source
    assert hy["versus_drafter"]["ratio"] > 1 and hy["versus_drafter"]["prompts"] == 6
    assert hy["versus_prompt_lookup"]["clear"] == "a" and hy["beats_prompt_lookup"] is True
    a, b = res["by_source"]["a"]["hybrid_composite"], res["by_source"]["b"]["hybrid_composite"]
    assert a["versus_drafter"]["clear"] == "a" and a["decoders"] == ["hybrid-4@2"] * 3
    assert b["versus_drafter"]["ratio"] == pytest.approx(1.0) and b["versus_drafter"]["clear"] is None
    assert res["by_mode"]["default"]["hybrid_composite"]["versus_prompt_lookup"]["prompts"] == 6


# -- timing that cannot be true ----------------------------------------------------------------------------------
def test_a_speedup_above_tau_or_tB_below_t1_is_flagged():
    # issue #47: 2.14x at tau 1.34 with t(B) < t(1) (the baseline timed cold)
    bad = {"speedup": 2.14, "tau": 1.34, "bound": 1.34 * 0.291 / 0.034, "t1_s": 0.291, "tB_s": 0.034}
    flags = timing_flags(bad)
    assert any("above its tau" in f for f in flags) and any("below t(1)" in f for f in flags)
    assert timing_flags({"speedup": 1.3, "tau": 1.6, "bound": 1.5, "t1_s": 0.05, "tB_s": 0.052}) == []
    assert timing_flags({"speedup": 1.3, "tau": 1.6, "bound": 1.1, "t1_s": 0.05, "tB_s": 0.073}) == [
        "speedup 1.30 above its bound 1.10"]
    # noise is not flagged: t(B) a little below t(1), speedup a hair above tau
    assert timing_flags({"speedup": 1.62, "tau": 1.6, "bound": 1.7, "t1_s": 0.05, "tB_s": 0.047}) == []


def _flagged_results():
    """results.json's dict as eval writes it, where the drafter's best is 2.14x at tau 1.34 (cannot be true) and
    beats lookup on both numbers."""
    base = {"decode_tokens_per_s": 10.0, "ttft_s": 0.01}

    def row(tau, sp, **kw):
        r = {"tau": tau, "speedup": sp, "bound": kw.pop("bound", tau), "decode_tokens_per_s": 10 * sp,
             "speedup_e2e": sp, "ttft_s": 0.01, "per_position_acceptance": [0.3], "t1_s": kw.pop("t1", 0.05),
             "tB_s": kw.pop("tB", 0.05)}
        r["unreliable"] = timing_flags(r) or None
        if not r["unreliable"]:
            del r["unreliable"]
        return r

    drafter = row(1.34, 2.14, bound=11.5, t1=0.291, tB=0.034)
    lookup = row(1.37, 1.22)
    assert drafter.get("unreliable") and not lookup.get("unreliable")
    vs = {"ratio": 1.75, "interval90": [1.6, 1.9], "faster_prompts": 10, "prompts": 10, "clear": "a"}
    summary = {"block_size": 4, "tau": 1.34, "speedup": 2.14, "bound": 11.5, "unreliable": drafter["unreliable"],
               "prompt_lookup": {"block_size": 4, "tau": 1.37, "speedup": 1.22, "bound": 1.37},
               "versus_prompt_lookup": vs}
    return {"baseline": base, "speculative": {"4": drafter}, "prompt_lookup": {"4": lookup}, "summary": summary,
            "prompts": 10, "max_new_tokens": 8, "temperature": 0.0}


def test_a_flagged_entry_never_makes_a_win():
    from dflashkit.report.page import eval_diagnostics_html
    from dflashkit.report.summary import summary_lines

    res = _flagged_results()
    s = res["summary"]
    # what evaluate decides (τ and speedup both above lookup's: a win, were the timing true)
    from dflashkit.decode.evaluation import verdict_of

    assert verdict_of(s["tau"] > 1.37 and s["speedup"] > 1.22, s, s["prompt_lookup"]) == "unreliable measurement"
    s["beats_prompt_lookup"], s["verdict_prompt_lookup"] = False, "unreliable measurement"
    text = "\n".join(diagnostic_lines(res)) + "\n" + results_table(res)
    assert "unreliable measurement" in text and "clearly faster" not in text and "drafter beats" not in text
    assert "2.14!" in text  # the table marks the entry
    html_text = eval_diagnostics_html(res)
    assert "unreliable measurement" in html_text and "drafter beats" not in html_text
    assert "clearly faster" not in html_text
    s["unreliable_entries"] = ["drafter B=4: " + "; ".join(res["speculative"]["4"]["unreliable"])]
    lines = "\n".join(summary_lines({"eval": s}))
    assert "drafter B=4: speedup 2.14 above its tau 1.34" in lines
    assert "unreliable measurement" in lines and "(the drafter beats it)" not in lines
    assert "clearly faster" not in lines


def test_a_flagged_hybrid_is_no_win_either():
    res = _composite({"4": [_r(1.0)] * 4, "lookup-4": [_r(1.0)] * 4,
                      "hybrid-4@2": [_r(0.2, t_verify=0.001)] * 4},  # 5x at tau 2, t(B) a tenth of t(1)
                     [_r(1.0, tau=1)] * 4, ["a"] * 4)
    hy = res["summary"]["hybrid"]
    assert hy["unreliable"] and hy["versus_prompt_lookup"]["clear"] == "a"
    assert hy["beats_prompt_lookup"] is False and hy["beats_drafter"] is False
    assert "unreliable measurement" in hy["versus_prompt_lookup"]["phrase"]
    assert "clearly faster" not in hy["versus_prompt_lookup"]["phrase"]


# -- warm-up ----------------------------------------------------------------------------------------------------
class _Recorder:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def generate(self, prompt, params):
        self.log.append((self.name, params.max_new_tokens))
        return GenerationResult(token_ids=[1], finish_reason="length")


def test_run_interleaved_warms_every_decoder_alike_before_timing():
    log: list = []
    decs = {n: _Recorder(n, log) for n in ("1", "4", "lookup-4")}
    run_interleaved(decs, [[1], [2], [3]], SamplingParams(max_new_tokens=64), warmup=2)
    warm, timed = log[:-9], log[-9:]
    # round-robin: every decoder in turn per warm-up prompt, then a short pass, again in turn, right before timing
    assert [n for n, _ in warm] == ["1", "4", "lookup-4"] * 3
    assert [t for _, t in warm[-3:]] == [16] * 3 and all(t == 64 for _, t in warm[:6])
    assert [n for n, _ in timed] == ["1", "4", "lookup-4"] * 3
    assert pooled_tokens_per_s([_r(2.0, tokens=5)], [0]) == 2.0


def test_the_budget_counts_the_hybrid_decoders():
    from dflashkit.config import load_config
    from dflashkit.sizing.plan import Rates, eval_prompt_s

    rates = Rates(capture_tok_s=500, train_step_s=0.5, decode_s={1: 0.05, 4: 0.07})
    base = ["eval.block_sizes=[4]", "eval.adaptive_length=false", "eval.prompt_lookup=false"]
    off = eval_prompt_s(load_config(None, [*base, "eval.hybrid=false"]), rates, 64)
    on = eval_prompt_s(load_config(None, [*base, "eval.hybrid_gates=[2,4]"]), rates, 64)
    one = eval_prompt_s(load_config(None, [*base, "eval.hybrid_gates=[4]", "eval.hybrid_graft=false"]), rates, 64)
    # per block size: the drafter alone, then suffix + 2 gates + graft (4 more passes), or suffix + 1 gate (2 more)
    assert on - off == pytest.approx(2 * (one - off)) and one > off
    two = eval_prompt_s(load_config(None, [*base, "eval.hybrid_gates=[2,4]", "eval.hybrid_drafter_blocks=[0,2]"]),
                        rates, 64)
    assert two - off == pytest.approx(7 * (one - off) / 2)  # suffix + 2 × (2 gates + graft)
    # the grid runs from 2 prompts on (one chooses the gate the other is scored with)
    from dflashkit.sizing.plan import eval_s

    cfg = load_config(None, [*base, "eval.warmup=0"])
    assert eval_s(cfg, rates, 1, 64) - eval_s(cfg, rates, 0, 64) == pytest.approx(off)
    assert eval_s(cfg, rates, 2, 64) - eval_s(cfg, rates, 0, 64) == pytest.approx(2 * on)


def _two_source_results():
    runs = {"4": [_r(1.0)] * 3 + [_r(0.6)] * 3, "lookup-4": [_r(0.9)] * 6, "suffix-4": [_r(2.0)] * 6,
            "hybrid-4@2": [_r(0.55)] * 3 + [_r(2.0)] * 3}
    res = _composite(runs, [_r(1.0, tau=1)] * 6, ["a", "a", "a", "b", "b", "b"])
    found = entries(runs, summarize_timing([_r(1.0, tau=1)] * 6))
    res["suffix"] = {"4": found["suffix-4"]}
    res["hybrid"] = {"4@2": {**found["hybrid-4@2"], "branches": {"drafter": 0.5, "suffix": 0.5}}}
    return res


def test_the_report_and_run_summary_show_the_hybrid_per_source():
    from dflashkit.report.page import breakdown_html, hybrid_html
    from dflashkit.report.summary import summary_lines

    res = _two_source_results()
    page = hybrid_html(res)
    assert "hybrid-4@2" in page and "match ≥ 2" in page and "suffix B=4" in page and "hybrid 4@2" in page
    assert page.count("<tr>") == 1 + 2 + 1 + 2  # header + 2 sources, header + suffix and one hybrid grid point
    table = breakdown_html(res, None)
    assert "decoder chosen" in table and "hybrid-4@2" in table
    lines = summary_lines({"eval": res["summary"]})
    assert any("a: hybrid-4@2" in ln for ln in lines) and any("b: 4 " in ln for ln in lines)
    assert any("hybrid over lookup, paired" in ln for ln in lines)


def test_the_speculation_profile_says_which_proposer_pays_per_source(tmp_path):
    from dflashkit.errors import UsageError
    from dflashkit.export.profile import Measurement, build_profile, proposers_block, read_profile, write_profile

    hy = _two_source_results()["summary"]["hybrid"]
    block = proposers_block(hy)
    assert block["by_source"]["a"] == {"proposer": "hybrid", "block_size": 4, "gate": {"min_match": 2, "graft": False},
                                       "tokens_per_s": hy["gates_by_source"]["a"]["tokens_per_s"]}
    assert block["by_source"]["b"]["proposer"] == "drafter" and block["by_source"]["b"]["gate"] is None
    p = build_profile([Measurement(4, [[4, 2, 1]], [[False, False, False]])], headline=4, method="dflash",
                      draft_checkpoint={}, target_model={}, block_size=4, max_supported_k=3, conditions={},
                      proposers=block)
    write_profile(tmp_path / "p.json", p)
    back = read_profile(tmp_path / "p.json")
    assert back["proposers"] == block and back["mean_accept_length"] == pytest.approx(7 / 3, abs=1e-5)
    (tmp_path / "bad.json").write_text(__import__("json").dumps({**p, "proposers": ["hybrid"]}))
    with pytest.raises(UsageError, match="proposers"):
        read_profile(tmp_path / "bad.json")


def test_the_hybrid_grid_runs_at_the_largest_block_size_and_needs_two_prompts(tiny_qwen3, monkeypatch):
    import dflashkit.decode.evaluation as ev
    from dflashkit.config import TargetSection
    from dflashkit.target.load import load_target
    from dflashkit.testing import random_drafter

    target = load_target(TargetSection(path=str(tiny_qwen3), device="cpu", dtype="float32"))
    drafter = random_drafter(target, block_size=4)
    monkeypatch.setattr(ev, "run_interleaved", lambda decoders, *a, **k: sorted(decoders))
    cfg = RunConfig()
    two = ev.decode_all(cfg, target, drafter, [[1, 2], [3, 4]], [2, 4], lookup=True, warmup=0)
    assert two == sorted(["1", "2", "4", "adaptive-2", "adaptive-4", "lookup-2", "lookup-4", "suffix-4", "hybrid-4@2",
                          "hybrid-4@4", "graft-4@4"])
    one = ev.decode_all(cfg, target, drafter, [[1, 2]], [2, 4], lookup=True, warmup=0)
    assert not [k for k in one if ev.group_of(k) in ("suffix", "hybrid")] and "lookup-4" in one
