"""`dflashkit eval`: lossless speculative decoding of held-out prompts — τ, acceptance, speedup, diagnostics.

Inputs:  the target (`target.*`), a drafter dir (DIR, `eval.drafter`, `train/best/` — kept by
         `train.keep_best` — else `train/final/`, or `export/`), prompts (`eval.prompts`, else
         `prepare/heldout.jsonl`), the tokenized shards (optional, for the bigram baseline).
Outputs: `eval/results.json` (+ manifest): the baseline (block_size 1, same loop) and, per block size,
         τ mean and histogram, per-position acceptance, tokens/s, speedup (decode and end-to-end),
         TTFT, and the bound τ·t(1)/t(B) from the same run's step timings (`decode/metrics.py`);
         the same for the training-free prompt-lookup proposer (`prompt_lookup`); the lossless
         verdict (`lossless`); `diagnostics` (bigram baseline, no-feature ablation); `summary` = the
         best block size by measured speedup.
Example: dflashkit eval -c run.yaml eval.block_sizes=[4,8,16] eval.dtype=bfloat16

Every problem with the inputs (drafter that does not fit the target, prompt longer than the context)
is reported before any decoding (exit 2). At temperature 0 every speculative output must equal the
baseline token for token, up to numerical ties in bf16 (`decode/lossless.py`); a divergence that is
not a tie is written to results.json and fails the command (exit 1).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

from dflashkit.config import RunConfig, section_hash
from dflashkit.context import StageContext
from dflashkit.errors import DflashkitError
from dflashkit.rundir import RunDir, atomic_write_json, write_manifest

log = logging.getLogger("dflashkit.eval")
CALIBRATION_PROMPTS = 2  # eval.dtype=auto: prompts decoded in both dtypes before choosing


def _table(res: dict[str, Any]) -> str:
    b = res["baseline"]
    rows = [("B", "proposer", "tau", "tok/s", "speedup", "bound", "e2e", "TTFT ms", "identical"),
            ("1", "-", "1.00", f"{b['decode_tokens_per_s']:.1f}", "1.00", "1.00", "1.00", f"{b['ttft_s'] * 1e3:.1f}", "-")]
    for name, group in (("drafter", res["speculative"]), ("lookup", res.get("prompt_lookup", {}))):
        for bs, r in group.items():
            rows.append((bs, name, f"{r['tau']:.2f}", f"{r['decode_tokens_per_s']:.1f}", f"{r['speedup']:.2f}",
                         f"{r['bound']:.2f}", f"{r['speedup_e2e']:.2f}", f"{r['ttft_s'] * 1e3:.1f}",
                         str(r.get("identical_to_baseline", "-"))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    for bs, r in res["speculative"].items():
        lines.append(f"B={bs} per-position acceptance: " + " ".join(f"{x:.2f}" for x in r["per_position_acceptance"]))
    lines += _diagnostic_lines(res)
    return "\n".join(lines)


def _drafter_source(drafter_dir: Path, rd: Any) -> dict[str, Any]:
    """Which drafter eval used: train/best (with its best.json: step, held-out τ), train/final, or other."""
    from dflashkit.train.checkpoint import read_best

    d = Path(drafter_dir).resolve()
    if d == (rd.best_dir).resolve():
        return {"kind": "best", **(read_best(d) or {})}
    if d == (rd.final_dir).resolve():
        return {"kind": "final"}
    return {"kind": "export" if d == (rd.export_dir).resolve() else "dir"}


def _diagnostic_lines(res: dict[str, Any]) -> list[str]:
    out, s = [], res["summary"]
    lk = s.get("prompt_lookup")
    if lk:
        verdict = "beats" if s.get("beats_prompt_lookup") else "does NOT beat"
        out.append(f"best: drafter B={s['block_size']} tau {s['tau']:.2f} speedup {s['speedup']:.2f}x; prompt lookup "
                   f"B={lk['block_size']} tau {lk['tau']:.2f} speedup {lk['speedup']:.2f}x: the drafter {verdict} it")
    d = res.get("diagnostics") or {}
    if d.get("bigram"):
        out.append(f"position-1: drafter {d['drafter_position1']:.2f} (simulated {d['simulated']['per_position_accuracy'][0]:.2f}), "
                   f"bigram baseline {d['bigram']['accuracy']:.2f}, prompt lookup {d.get('prompt_lookup_position1', 0):.2f}")
    if d.get("no_features"):
        sim, zero = d["simulated"], d["no_features"]
        out.append(f"no-feature ablation (teacher-forced, B={d['block_size']}): tau {sim['tau']:.2f} -> {zero['tau']:.2f}, "
                   f"position-1 {sim['per_position_accuracy'][0]:.2f} -> {zero['per_position_accuracy'][0]:.2f}")
    ll = res.get("lossless")
    if ll:
        extra = f", {ll['ties']} ties, largest gap {ll['max_tie_gap']}" if ll["ties"] else ""
        out.append(f"lossless ({res['dtype']}, tie tolerance {ll['tolerance']}): {ll['verdict']} "
                   f"({ll['divergences']} of {ll['compared']} outputs diverge{extra})")
    return out


def _decode(cfg: Any, target: Any, drafter: Any, ids: list[list[int]], block_sizes: list[int], *,
            lookup: bool, warmup: int) -> dict[str, Any]:
    """Baseline + drafter (+ prompt lookup) at every block size, interleaved; results by decoder name."""
    from dflashkit.decode.lossless import TOP_K
    from dflashkit.decode.ngram import PromptLookupProposer
    from dflashkit.decode.runner import draft_dtype_for, params_for, run_interleaved
    from dflashkit.decode.spec_decode import SpecDecoder

    e = cfg.eval
    ddt = draft_dtype_for(cfg, target)
    decoders = {"1": SpecDecoder(target, None, 1, max_context=e.max_context, record_top=TOP_K)}
    for bs in block_sizes:
        decoders[str(bs)] = SpecDecoder(target, drafter, bs, max_context=e.max_context, record_top=TOP_K,
                                        draft_sampling=e.draft_sampling, draft_dtype=ddt)
    if lookup:
        for bs in block_sizes:
            decoders[f"lookup-{bs}"] = SpecDecoder(target, None, bs, max_context=e.max_context, record_top=TOP_K,
                                                   proposer=PromptLookupProposer(e.prompt_lookup_ngram, 1))
    return run_interleaved(decoders, ids, params_for(cfg, target), warmup=warmup, base_seed=cfg.run.seed,
                           desc=f"eval ({str(target.dtype).removeprefix('torch.')})")


def _entries(runs: dict[str, Any], base_t: dict) -> dict[str, dict]:
    from dflashkit.decode.metrics import compare, summarize_acceptance, summarize_timing

    out = {}
    for key, results in runs.items():
        bs = int(key.removeprefix("lookup-"))
        acc, tim = summarize_acceptance(results, bs), summarize_timing(results)
        out[key] = {**acc, **tim, **compare(base_t, tim, acc["tau"])}
    return out


def _best(group: dict[str, dict]) -> dict | None:
    """The entry with the highest measured speedup (its key as block_size)."""
    if not group:
        return None
    bs, r = max(group.items(), key=lambda kv: kv[1]["speedup"])
    return {"block_size": int(bs), "tau": r["tau"], "speedup": r["speedup"], "bound": r["bound"]}


def _choose_dtype(cfg: Any, drafter_dir: Any, ids: list[list[int]], block_sizes: list[int]) -> tuple[Any, dict]:
    """eval.dtype=auto: decode the first prompts in float32 and bfloat16; keep the better honest speedup."""
    from dflashkit.decode.metrics import summarize_timing
    from dflashkit.export.hf import load_drafter
    from dflashkit.model.target import load_target

    calib, targets = {}, {}
    for name in ("float32", "bfloat16"):
        target = load_target(dataclasses.replace(cfg.target, dtype=name))
        drafter = load_drafter(drafter_dir, dtype=target.dtype, device=target.device)
        runs = _decode(cfg, target, drafter, ids[:CALIBRATION_PROMPTS], block_sizes, lookup=False,
                       warmup=cfg.eval.warmup)
        base_t = summarize_timing(runs.pop("1"))
        best = _best(_entries(runs, base_t)) or {"block_size": 1, "speedup": 1.0}
        calib[name] = {"baseline_tokens_per_s": base_t["decode_tokens_per_s"], "t1_s": round(base_t["verify_s_mean"], 6),
                       "best_block_size": best["block_size"], "speedup": best["speedup"],
                       "tokens_per_s": round(base_t["decode_tokens_per_s"] * best["speedup"], 3)}
        targets[name] = target
        log.info("eval.dtype=auto: %s baseline %.1f tok/s, best B=%d speedup %.2f", name,
                 base_t["decode_tokens_per_s"], best["block_size"], best["speedup"])
    chosen = max(calib, key=lambda n: calib[n]["speedup"])
    return targets[chosen], {"mode": "auto", "chosen": chosen, "prompts": min(len(ids), CALIBRATION_PROMPTS),
                             "rule": "higher best speedup over the same dtype's block_size=1 baseline",
                             "calibration": calib}


def _lossless(cfg: Any, target: Any, runs: dict[str, Any], base_results: list, prompts: list) -> dict:
    from dflashkit.decode.lossless import divergence_record, first_divergence, lossless_verdict, tie_rule

    rule = tie_rule(target.dtype, cfg.eval.tie_tolerance)
    firsts, rows = [], []
    for key, results in runs.items():
        for i, (r, b) in enumerate(zip(results, base_results)):
            d = first_divergence(r, b)
            firsts.append(d)
            if d is not None:
                rows.append(divergence_record(d, rule, decoder=key, block_size=int(key.removeprefix("lookup-")),
                                              proposer="prompt_lookup" if key.startswith("lookup-") else "drafter",
                                              prompt=i, id=prompts[i][0]))
    v = lossless_verdict(firsts, rule)
    return {**v, "dtype": str(target.dtype).removeprefix("torch."), "first_divergences": rows}


def _diagnostics(cfg: Any, rd: Any, target: Any, drafter: Any, ids: list, base_results: list, res: dict) -> dict:
    from dflashkit.decode.diagnostics import BigramTable, simulated_acceptance
    from dflashkit.train.data import load_tokenized, tokenized_shards

    outputs = [r.token_ids for r in base_results]
    d: dict[str, Any] = {"outputs": "the baseline's outputs on the eval prompts", "block_size": drafter.block_size}
    best = res["summary"]
    if str(best["block_size"]) in res["speculative"]:
        d["drafter_position1"] = res["speculative"][str(best["block_size"])]["per_position_acceptance"][0]
    lk = best.get("prompt_lookup")
    if lk:
        d["prompt_lookup_position1"] = res["prompt_lookup"][str(lk["block_size"])]["per_position_acceptance"][0]
    if tokenized_shards(rd):
        data = load_tokenized(rd)
        d["bigram"] = BigramTable.fit(data.input_ids, data.loss_mask).accuracy(outputs)
    else:
        log.info("no tokenized shards in %s: bigram baseline skipped", rd.tokenize_dir)
    d["simulated"] = simulated_acceptance(target, drafter, ids, outputs)
    d["no_features"] = simulated_acceptance(target, drafter, ids, outputs, no_features=True)
    return d


def run(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict[str, Any]:
    import torch

    from dflashkit.decode.lossless import TOP_K
    from dflashkit.decode.metrics import summarize_timing
    from dflashkit.decode.runner import (draft_dtype_for, load_prompt_messages, render_prompts,
                                         resolve_drafter_dir)
    from dflashkit.decode.spec_decode import SpecDecoder
    from dflashkit.export.hf import load_drafter, read_contract
    from dflashkit.model.target import load_target

    t0 = time.time()
    e = cfg.eval
    drafter_dir = resolve_drafter_dir(cfg, rd, ctx.positionals)
    contract = read_contract(drafter_dir)
    prompts = load_prompt_messages(cfg, rd)[: e.num_prompts]
    block_sizes = [b for b in dict.fromkeys(e.block_sizes or [contract.block_size]) if b != 1]  # 1 = baseline
    for bs in (b for b in block_sizes if b > contract.block_size):
        log.warning("eval.block_sizes: %d > the drafter's trained block size %d: positions past %d were never "
                    "trained, so they are drafted from noise (lossless, but tau will not improve)",
                    bs, contract.block_size, contract.block_size - 1)
    if ctx.dry_run:
        return {"dry_run": True, "drafter": str(drafter_dir), "prompts": len(prompts), "block_sizes": block_sizes,
                "dtype": e.dtype, "prompt_lookup": e.prompt_lookup}
    tcfg = cfg.target if e.dtype in ("target", "auto") else dataclasses.replace(cfg.target, dtype=e.dtype)
    target = load_target(tcfg)
    contract.check(target, where=f"drafter {drafter_dir}")
    ids = render_prompts(target.tokenizer, prompts, cfg.tokenize.chat_template_kwargs)
    check = SpecDecoder(target, None, 1, max_context=e.max_context)
    for i, p in enumerate(ids):  # every prompt must fit before anything is decoded
        check.check_prompt(len(p), e.max_new_tokens, what=f"prompt {i} ({prompts[i][0]})")
    choice = None
    if e.dtype == "auto":
        del target
        target, choice = _choose_dtype(cfg, drafter_dir, ids, block_sizes)
    drafter = load_drafter(drafter_dir, dtype=target.dtype, device=target.device)

    source = _drafter_source(drafter_dir, rd)
    log.info("eval: %d prompts, block sizes %s, drafter %s (%s), verify dtype %s", len(ids), block_sizes,
             drafter_dir, source["kind"], target.dtype)
    runs = _decode(cfg, target, drafter, ids, block_sizes, lookup=e.prompt_lookup, warmup=e.warmup)
    base_results = runs.pop("1")
    base_t = summarize_timing(base_results)
    entries = _entries(runs, base_t)
    ddt = draft_dtype_for(cfg, target)
    res: dict[str, Any] = {"drafter": str(drafter_dir), "drafter_source": source, "target": str(cfg.target.path),
                           "prompts": len(ids),
                           "max_new_tokens": e.max_new_tokens, "temperature": e.temperature,
                           "threads": torch.get_num_threads(), "device": str(target.device),
                           "dtype": str(target.dtype).removeprefix("torch."),
                           "draft_dtype": str(ddt or target.dtype).removeprefix("torch."),
                           "baseline": base_t, "speculative": {}, "mismatches": []}
    if choice:
        res["dtype_choice"] = choice
    res["speculative"] = {k: v for k, v in entries.items() if not k.startswith("lookup-")}
    if e.prompt_lookup:
        res["prompt_lookup"] = {k.removeprefix("lookup-"): v for k, v in entries.items() if k.startswith("lookup-")}
        res["prompt_lookup_ngram"] = e.prompt_lookup_ngram
    if e.temperature <= 0:
        res["lossless"] = _lossless(cfg, target, runs, base_results, prompts)
        diverged = {(row["decoder"], row["prompt"]) for row in res["lossless"]["first_divergences"]}
        for key, entry in entries.items():
            entry["identical_to_baseline"] = not any(k == key for k, _ in diverged)
        res["mismatches"] = [row for row in res["lossless"]["first_divergences"]
                             if res["lossless"]["verdict"] == "not lossless"]
    for bs, r in res["speculative"].items():
        log.info("B=%s: tau %.2f, speedup %.2f (bound %.2f), %.1f tok/s", bs, r["tau"], r["speedup"], r["bound"],
                 r["decode_tokens_per_s"])
    best = _best(res["speculative"]) or {"block_size": 1, "tau": 1.0, "speedup": 1.0, "bound": 1.0}
    lookup_best = _best(res.get("prompt_lookup", {}))
    ll = res.get("lossless")
    res["summary"] = {**best, "rule": "block size with the highest measured speedup",
                      "greedy_identical": (ll["verdict"] == "exact") if ll else None,
                      "lossless": ll["verdict"] if ll else None, "dtype": res["dtype"]}
    if lookup_best:
        res["summary"]["prompt_lookup"] = lookup_best
        res["summary"]["beats_prompt_lookup"] = (best["tau"] > lookup_best["tau"]
                                                 and best["speedup"] > lookup_best["speedup"])
    if e.diagnostics:
        res["diagnostics"] = _diagnostics(cfg, rd, target, drafter, ids, base_results, res)
    out = rd.stage_dir("eval")
    atomic_write_json(out / "results.json", res)
    write_manifest(out, stage="eval", config_hash=section_hash(cfg.eval, cfg.target), started=t0,
                   inputs={"drafter": str(drafter_dir)}, counts={"prompts": len(ids), "block_sizes": len(block_sizes)},
                   outputs=["results.json"])
    if not ctx.json:
        print(_table(res), flush=True)
    if res["mismatches"]:
        m = next(r for r in res["mismatches"] if not r["tie"])
        gap = f"{m['gap']}" if m["gap"] is not None else f"more than its top {TOP_K} (margin {m['margin']})"
        raise DflashkitError(
            f"greedy speculative output differs from the baseline beyond a numerical tie: {m['proposer']} block "
            f"size {m['block_size']}, prompt {m['prompt']} ({m['id']}), first differing token at position "
            f"{m['position']}, where the baseline preferred its token by {gap} logits (tie tolerance "
            f"{m['tolerance']}: {res['lossless']['tolerance']}, {res['dtype']}; see {out / 'results.json'})",
            hint="this is a bug (lossless decoding is violated); re-run with --log-level debug and report it")
    summary = {bs: {k: r[k] for k in ("tau", "speedup", "bound", "decode_tokens_per_s")}
               for bs, r in res["speculative"].items()}
    return {"results": str(out / "results.json"), "drafter": str(drafter_dir), "drafter_source": source,
            "prompts": len(ids), "summary": res["summary"],
            "baseline_tokens_per_s": base_t["decode_tokens_per_s"], "block_sizes": summary}
