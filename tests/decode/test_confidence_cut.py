"""Verification truncated by the drafter's confidence (decode/draft_length.ConfidenceCut, SpecDecoder(confidence_cut=…))
and eval's three draft-length rows on a DSpark drafter: fixed B, the adaptive length and the confidence truncation,
each lossless, with paired speed ratios per source."""

from __future__ import annotations

import pytest
import torch

from dflashkit.config import RunConfig, TargetSection
from dflashkit.decode.api import SamplingParams
from dflashkit.decode.draft_length import ConfidenceCut, DraftLength
from dflashkit.decode.evaluation import (confident, decode_all, entries, group_key, length_policies,
                                         length_policy_lines, lossless_check, proposer_of)
from dflashkit.decode.metrics import summarize_timing
from dflashkit.decode.runner import EvalPrompt
from dflashkit.decode.spec_decode import SpecDecoder
from dflashkit.errors import UsageError
from dflashkit.target.load import load_target
from dflashkit.testing import random_drafter

CONF_STD = 0.1  # the confidence head's weights: estimates spread over (0, 1) on the tiny target's hidden states
PROMPT = [1, 60, 61, 62, 63, 64, 10, 65, 66, 67, 68, 2, 10]


def test_the_cut_keeps_the_drafts_whose_running_product_clears_the_threshold():
    cut = ConfidenceCut(max_drafts=4, threshold=0.5)
    assert cut.choose([0.9, 0.8, 0.6, 0.99]) == 2        # products 0.9, 0.72, 0.432 < 0.5: two drafts
    # the rule in plain arithmetic: the longest prefix whose product is ≥ the threshold
    for conf in ([0.9, 0.8, 0.9, 0.99], [0.4, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0, 1.0], [0.6, 0.9, 0.2], []):
        want, run = 0, 1.0
        for c in conf[:4]:
            run *= c
            if run < 0.5:
                break
            want += 1
        assert cut.choose(conf) == want
    assert ConfidenceCut(max_drafts=3, threshold=0.0).choose([0.01, 0.0, 0.3]) == 3   # 0: every draft (fixed B)
    assert ConfidenceCut(max_drafts=3, threshold=1.0).choose([1.0, 0.999, 1.0]) == 1
    assert not ConfidenceCut(max_drafts=3).needs_cost and DraftLength(max_drafts=3).needs_cost
    with pytest.raises(ValueError, match="threshold"):
        ConfidenceCut(max_drafts=3, threshold=1.5)


def test_the_cut_rule_differs_from_the_adaptive_rule():
    """At equal confidences the adaptive rule (no cost table yet) verifies every draft; the cut does not."""
    conf = [0.9, 0.5, 0.4]
    assert DraftLength(max_drafts=3).choose(conf) == 3 and ConfidenceCut(max_drafts=3, threshold=0.5).choose(conf) == 1


@pytest.fixture(scope="module")
def target(tiny_targets):
    return load_target(TargetSection(path=str(tiny_targets["qwen3"]), device="cpu", dtype="float32"))


def dspark(target, block_size: int = 4):
    """A DSpark drafter whose confidence head and Markov head are strong enough to change lengths and drafts."""
    d = random_drafter(target, block_size=block_size, drafter_type="dspark", dspark_markov_rank=8)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in d.markov_head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 2.0)
        d.confidence_head.proj.weight.copy_(torch.randn(d.confidence_head.proj.weight.shape, generator=g) * CONF_STD)
    return d


def record_cuts(monkeypatch) -> list[tuple[list[float], int]]:
    """Every `ConfidenceCut.choose` call from now on, as (the confidences it read, the drafts it kept)."""
    seen: list[tuple[list[float], int]] = []
    real = ConfidenceCut.choose

    def choose(self, conf):
        k = real(self, conf)
        seen.append((list(conf), k))
        return k

    monkeypatch.setattr(ConfidenceCut, "choose", choose)
    return seen


def test_truncated_decoding_is_the_targets_greedy_and_reads_the_confidence_head(target, monkeypatch):
    drafter = dspark(target)
    params = SamplingParams(max_new_tokens=31)
    base = SpecDecoder(target, None, block_size=1).generate(PROMPT, params).token_ids
    seen = record_cuts(monkeypatch)
    dec = SpecDecoder(target, drafter, block_size=4, confidence_cut=0.5)
    r = dec.generate(PROMPT, params)
    assert r.token_ids == base
    assert isinstance(dec.policy, ConfidenceCut) and dec.policy.cost == {}  # no t(n) measured
    assert seen and any(k < len(conf) for conf, k in seen)                 # some steps were cut short
    assert r.verified_drafts == sum(k for _, k in seen) < 3 * len(seen)
    assert all(a <= k + 1 for a, (_, k) in zip(r.acceptance_lengths, seen))
    with pytest.raises(UsageError, match="one"):
        SpecDecoder(target, drafter, block_size=4, adaptive=True, confidence_cut=0.5)


def test_eval_decodes_fixed_adaptive_and_truncated_rows_all_lossless(target):
    cfg = RunConfig()
    cfg.eval.max_new_tokens = 12
    cfg.eval.hybrid = False
    drafter = dspark(target)
    assert confident(cfg, drafter) and not confident(cfg, random_drafter(target))  # DFlash: no confidence rows
    ids = [PROMPT, PROMPT[:8] + [70, 71], [1, 80, 81, 82, 10], PROMPT[3:]]
    prompts = [EvalPrompt(id=f"p{i}", messages=[], source="ab"[i % 2]) for i in range(len(ids))]
    runs = decode_all(cfg, target, drafter, ids, [4], lookup=False, warmup=0)
    assert {"1", "4", "adaptive-4", "confident-4"} <= set(runs)
    assert group_key("confident-4") == ("confident", "4") and proposer_of("confident-4") == "drafter-confident"
    base = runs.pop("1")
    found = entries(runs, summarize_timing(base))
    assert lossless_check(cfg, target, runs, base, [(p.id, None) for p in prompts])["verdict"] == "exact"
    for key in ("4", "adaptive-4", "confident-4"):
        assert [r.token_ids for r in runs[key]] == [r.token_ids for r in base], key
    assert found["confident-4"]["drafts_per_step"] < 3 and found["adaptive-4"]["drafts_per_step"] <= 3
    rows = length_policies(cfg, prompts, runs, found)
    row = rows["4"]
    assert row["decoders"] == {"fixed": "4", "adaptive": "adaptive-4", "confident": "confident-4"}
    assert set(row["policies"]) == {"fixed", "adaptive", "confident"}
    pol = row["policies"]
    assert pol["confident"]["drafts_per_step"] < pol["fixed"]["drafts_per_step"] <= 3  # the last step may be short
    for pair in ("adaptive_vs_fixed", "confident_vs_fixed", "confident_vs_adaptive"):
        assert row[pair]["prompts"] == 4 and row[pair]["ratio"] > 0
        assert {src: g[pair]["prompts"] for src, g in row["by_source"].items()} == {"a": 2, "b": 2}
    lines = length_policy_lines({"draft_length": rows})
    assert len(lines) == 3 and lines[1].startswith("draft length B=4 a: fixed tau")
    assert "confident over fixed" in lines[0]
    cfg.eval.confidence_truncation = False
    assert not confident(cfg, drafter)


@pytest.mark.slow  # one `dflashkit eval` of a tiny target, in-process
def test_dflashkit_eval_reports_the_three_rows_per_source_on_a_dspark_drafter(tmp_path, tiny_qwen3, target, capsys):
    import json

    from dflashkit.cli import main
    from dflashkit.export.hf import save_drafter

    rd = tmp_path / "run"
    save_drafter(dspark(target), rd / "train" / "final", dtype="float32")
    rows = [{"id": f"p{i}", "source": "ab"[i % 2], "messages": [{"role": "user", "content": f"count to {i + 3}"},
                                                                 {"role": "assistant", "content": "ok"}]}
            for i in range(4)]
    (rd / "prepare").mkdir()
    (rd / "prepare" / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["eval", f"target.path={tiny_qwen3}", "target.dtype=float32", "eval.num_prompts=4",
            "eval.max_new_tokens=10", "eval.warmup=0", "eval.block_sizes=[4]", "eval.diagnostics=false",
            "eval.prompt_lookup=false", "eval.hybrid=false", "--run-dir", str(rd)]
    assert main(args) == 0
    assert "draft length B=4 a: fixed tau" in capsys.readouterr().out
    res = json.loads((rd / "eval" / "results.json").read_text())
    assert res["lossless"]["verdict"] == "exact"
    for group in ("speculative", "adaptive", "confident"):
        assert res[group]["4"]["identical_to_baseline"] is True, group
    assert res["summary"]["confident"]["block_size"] == 4 and res["confidence_threshold"] == 0.5
    row = res["draft_length"]["4"]
    assert set(row["by_source"]) == {"a", "b"}
    for g in (row, *row["by_source"].values()):
        assert set(g["policies"]) == {"fixed", "adaptive", "confident"}
        assert {"adaptive_vs_fixed", "confident_vs_fixed", "confident_vs_adaptive"} <= set(g)
    for src in ("a", "b"):
        assert set(res["by_source"][src]["confident"]) == {"4"}
    profile = rd / "eval" / "speculation_profile.json"
    shipped = json.loads(profile.read_text())["draft_length"]  # the rule that pays, per source, beside the rates
    assert shipped["block_size"] == 4 and shipped["confidence_threshold"] == 0.5
    assert set(shipped["by_source"]) == {"a", "b"}
    for g in (shipped, *shipped["by_source"].values()):
        assert set(g["versus_fixed"]) == {"adaptive", "confident"} and g["policy"] in ("fixed", "adaptive", "confident")
    assert shipped["versus_fixed"]["confident"]["ratio"] == row["confident_vs_fixed"]["ratio"]
    assert main([*args, "eval.confidence_truncation=false"]) == 0
    res = json.loads((rd / "eval" / "results.json").read_text())
    assert "confident" not in res and set(res["draft_length"]["4"]["policies"]) == {"fixed", "adaptive"}
    assert set(json.loads(profile.read_text())["draft_length"]["versus_fixed"]) == {"adaptive"}
