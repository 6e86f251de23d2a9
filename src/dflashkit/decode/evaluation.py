"""What `eval` (and the decoder part of `bench decode`) computes: decode held-out prompts with the
baseline, the drafter and the prompt-lookup proposer, and summarise τ, speedup, the lossless verdict
and the diagnostics into `eval/results.json`'s dict. This module owns that file: `write_eval_results`
(the eval stage) and `read_eval_results` (report, the run summary, the model card) are its only writer and
reader; its path is `RunDir.eval_results`.

Usage:
    inputs = decode_inputs(cfg, rd, ctx.positionals, num_prompts=cfg.eval.num_prompts)
    target, ids = load_checked_target(cfg, inputs, cfg.target)   # every prompt checked to fit
    res = evaluate(cfg, rd, inputs, target, ids, block_sizes=[4, 8])
    res["by_source"], res["by_mode"]                             # τ and acceptance per data source / thinking mode
    print(results_table(res))
    res["speculation_profile"]                                   # its speculation_profile.json (export/profile.py)
    path = write_eval_results(rd, res)                           # eval/results.json, atomic
    err = mismatch_error(res, path)                             # a DflashkitError to raise, or None
    read_eval_results(rd)                                       # (report, run summary) that dict, or None
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dflashkit.data.chat import load_chat, source_modes
from dflashkit.decode.api import Decoder
from dflashkit.decode.diagnostics import BigramTable, simulated_acceptance
from dflashkit.decode.lossless import TOP_K, divergence_record, first_divergence, lossless_verdict, tie_rule
from dflashkit.decode.metrics import compare, paired_phrase, paired_speed, summarize_acceptance, summarize_timing
from dflashkit.decode.ngram import PromptLookupProposer
from dflashkit.decode.runner import (draft_dtype_for, load_prompts, params_for, prompt_sources, refuse_unrendered_tools,
                                     render_eval_prompts, resolve_drafter_dir, run_interleaved)
from dflashkit.decode.spec_decode import SpecDecoder
from dflashkit.errors import DflashkitError
from dflashkit.export.hf import load_drafter, read_contract
from dflashkit.export.profile import (Measurement, build_profile, checkpoint_id, dflashkit_source, method_for,
                                      prompts_digest, weights_digest)
from dflashkit.inspect.target import resolve_target_path
from dflashkit.model.packed import prepare_for_decode
from dflashkit.model.target import compute_dtype, resolve_device, text_config_dict
from dflashkit.rundir import atomic_write_json, read_json_or_none
from dflashkit.train.checkpoint import read_best
from dflashkit.train.data import load_tokenized, tokenized_shards

if TYPE_CHECKING:
    from dflashkit.decode.runner import EvalPrompt

log = logging.getLogger("dflashkit.eval")
CALIBRATION_PROMPTS = 2  # eval.dtype=auto: prompts decoded in both dtypes before choosing


def write_eval_results(rd: Any, res: dict[str, Any]) -> Path:
    """Write `eval/results.json` atomically; returns its path."""
    atomic_write_json(rd.eval_results, res)
    return rd.eval_results


def read_eval_results(rd: Any) -> dict[str, Any] | None:
    """`eval/results.json`, or None when it is absent or not valid JSON (logged, then skipped)."""
    return read_json_or_none(rd.eval_results, log)


@dataclass
class DecodeInputs:
    """The drafter dir, its contract and the prompts (`decode.runner.EvalPrompt`: id, messages, tools, source)
    that eval and bench decode read."""

    drafter_dir: Path
    contract: Any
    prompts: list[EvalPrompt]


def decode_inputs(cfg: Any, rd: Any, positionals: list[str], *, num_prompts: int) -> DecodeInputs:
    """The drafter (DIR, eval.drafter, train/best|final, export), its contract and the first prompts."""
    drafter_dir = resolve_drafter_dir(cfg, rd, positionals)
    return DecodeInputs(drafter_dir, read_contract(drafter_dir), load_prompts(cfg, rd, num_prompts))


def check_prompts_render(cfg: Any, inputs: DecodeInputs) -> None:
    """Agent prompts need a chat template that renders tools: checked with the target's tokenizer alone
    (`data.chat.load_chat`), before the target loads (exit 2 naming the prompt's file and line)."""
    if any(p.agentic for p in inputs.prompts):
        refuse_unrendered_tools(load_chat(cfg), inputs.prompts)


def check_target_fits(inputs: DecodeInputs, target_cfg: Any) -> None:
    """The drafter against the target's config.json, before the target loads (exit 2 naming both; a GGUF
    target is checked once loaded): what `load_checked_target` checks first, and a dry run with it."""
    model_dir, gguf = resolve_target_path(target_cfg.path, target_cfg.gguf_file)
    if gguf or not (model_dir / "config.json").is_file():
        return  # load_target converts or refuses it
    tc = text_config_dict(model_dir)
    facts = {"num_layers": int(tc["num_hidden_layers"]), "hidden_size": int(tc["hidden_size"]),
             "vocab_size": int(tc["vocab_size"])}
    inputs.contract.check(facts, where=f"drafter {inputs.drafter_dir}")


def load_checked_target(cfg: Any, inputs: DecodeInputs, target_cfg: Any) -> tuple[Any, list[list[int]]]:
    """Load the target, check the drafter fits it and that every rendered prompt fits the context
    (exit 2 before anything is decoded); the target and the prompts' ids, each rendered as tokenize renders
    its source (`decode.runner.render_eval_prompts`: tools, per-source template variables). `target_cfg` is
    `verify_target_config`'s: the caller announces its dtype (`verify_dtype`)."""
    from dflashkit.model.target import load_target

    check_target_fits(inputs, target_cfg)
    check_prompts_render(cfg, inputs)
    target = load_target(target_cfg, announce_dtype=False)
    prepare_for_decode(target, cfg.eval.packed_weights)
    inputs.contract.check(target, where=f"drafter {inputs.drafter_dir}")
    ids = render_eval_prompts(cfg, target.tokenizer, inputs.prompts)
    check = SpecDecoder(target, None, 1, max_context=cfg.eval.max_context)
    for i, p in enumerate(ids):  # every prompt must fit before anything is decoded
        check.check_prompt(len(p), cfg.eval.max_new_tokens, what=f"prompt {i} ({inputs.prompts[i][0]})")
    return target, ids


def verify_dtype(cfg: Any) -> Any:
    """The verify dtype and why (a `model.target.DtypeChoice`, not yet announced): `eval.dtype` target/auto
    → `target.dtype`'s choice (auto then measures both dtypes: `choose_dtype` below), native → bfloat16 where
    the device computes it natively, else float32; float32 / bfloat16 as set (warned where emulated)."""
    dev = resolve_device(cfg.target.device)
    if cfg.eval.dtype in ("target", "auto"):
        return compute_dtype(cfg.target.dtype, dev, key="target.dtype")
    return compute_dtype(cfg.eval.dtype, dev, key="eval.dtype")


def verify_target_config(cfg: Any, choice: Any = None) -> Any:
    """The target section eval verifies with: `target.dtype` replaced by the verify dtype's name (`choice`,
    else `verify_dtype(cfg)`)."""
    return dataclasses.replace(cfg.target, dtype=(choice or verify_dtype(cfg)).name)


def block_sizes_for(requested: list[int] | None, contract: Any) -> list[int]:
    """`eval.block_sizes` (else the drafter's), without 1 (the baseline); warns past the trained size."""
    block_sizes = [b for b in dict.fromkeys(requested or [contract.block_size]) if b != 1]
    for bs in (b for b in block_sizes if b > contract.block_size):
        log.warning("eval.block_sizes: %d > the drafter's trained block size %d: positions past %d were never "
                    "trained, so they are drafted from noise (lossless, but tau will not improve)",
                    bs, contract.block_size, contract.block_size - 1)
    return block_sizes


def block_of(key: str) -> int:
    """The block size of a decoder key: "4", "lookup-4", "adaptive-4"."""
    return int(key.rpartition("-")[2])


GROUPS = (("drafter", "speculative"), ("adaptive", "adaptive"), ("lookup", "prompt_lookup"))


def results_table(res: dict[str, Any]) -> str:
    b = res["baseline"]
    rows = [("B", "proposer", "tau", "tok/s", "speedup", "bound", "e2e", "TTFT ms", "identical"),
            ("1", "-", "1.00", f"{b['decode_tokens_per_s']:.1f}", "1.00", "1.00", "1.00", f"{b['ttft_s'] * 1e3:.1f}", "-")]
    for name, key in GROUPS:
        for bs, r in res.get(key, {}).items():
            rows.append((bs, name, f"{r['tau']:.2f}", f"{r['decode_tokens_per_s']:.1f}", f"{r['speedup']:.2f}",
                         f"{r['bound']:.2f}", f"{r['speedup_e2e']:.2f}", f"{r['ttft_s'] * 1e3:.1f}",
                         str(r.get("identical_to_baseline", "-"))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    for bs, r in res["speculative"].items():
        lines.append(f"B={bs} per-position acceptance: " + " ".join(f"{x:.2f}" for x in r["per_position_acceptance"]))
    lines += breakdown_lines(res)
    lines += diagnostic_lines(res)
    return "\n".join(lines)


def breakdown_lines(res: dict[str, Any]) -> list[str]:
    """τ at the best block size per data source and per thinking mode (drafter, and prompt lookup at its best
    block size), when there are several."""
    bs, lk = str(res["summary"]["block_size"]), str((res["summary"].get("prompt_lookup") or {}).get("block_size", "-"))
    out = []
    for key, what in (("by_source", "source"), ("by_mode", "mode")):
        groups = res.get(key) or {}
        if len(groups) < 2:
            continue
        parts = []
        for name, g in groups.items():
            d, p = g.get("speculative", {}).get(bs), g.get("prompt_lookup", {}).get(lk)
            label = f"{name} ({g['mode']})" if "mode" in g else name
            parts.append(f"{label}: {g['prompts']} prompts" + (f", tau {d['tau']:.2f}" if d else "")
                         + (f", lookup {p['tau']:.2f}" if p else ""))
        out.append(f"by {what} (drafter B={bs}, lookup B={lk}): " + "; ".join(parts))
    return out


def drafter_source(drafter_dir: Path, rd: Any) -> dict[str, Any]:
    """Which drafter eval used: train/best (with its best.json: step, held-out τ), train/final, or other."""
    d = Path(drafter_dir).resolve()
    if d == (rd.best_dir).resolve():
        return {"kind": "best", **(read_best(d) or {})}
    if d == (rd.final_dir).resolve():
        return {"kind": "final"}
    return {"kind": "export" if d == (rd.export_dir).resolve() else "dir"}


def diagnostic_lines(res: dict[str, Any]) -> list[str]:
    out, s = [], res["summary"]
    lk = s.get("prompt_lookup")
    if lk:
        verdict = "beats" if s.get("beats_prompt_lookup") else "does NOT beat"
        vs = s.get("versus_prompt_lookup")
        out.append(f"best: drafter B={s['block_size']} tau {s['tau']:.2f} speedup {s['speedup']:.2f}x; prompt lookup "
                   f"B={lk['block_size']} tau {lk['tau']:.2f} speedup {lk['speedup']:.2f}x: the drafter {verdict} it"
                   + (f" (drafter over lookup, paired: {paired_phrase(vs)})" if vs else ""))
    ad = s.get("adaptive")
    if ad:
        out.append(f"adaptive draft length (dflashkit's decoder; engines run fixed B): best B={ad['block_size']} tau "
                   f"{ad['tau']:.2f} speedup {ad['speedup']:.2f}x, {ad['drafts_per_step']:.2f} drafts verified per step")
    d = res.get("diagnostics") or {}
    if d.get("bigram"):
        out.append(f"position-1: drafter {d['drafter_position1']:.2f} (simulated {d['simulated']['per_position_accuracy'][0]:.2f}), "
                   f"bigram baseline {d['bigram']['accuracy']:.2f}, prompt lookup {d.get('prompt_lookup_position1', 0):.2f}")
    if d.get("no_features"):
        sim, zero, other = d["simulated"], d["no_features"], d.get("other_context")
        what = [f"none {zero['tau']:.2f}"] + ([f"another prompt's {other['tau']:.2f}"] if other else [])
        acc1 = [f"{zero['per_position_accuracy'][0]:.2f}"] + ([f"{other['per_position_accuracy'][0]:.2f}"] if other else [])
        out.append(f"target context (teacher-forced, B={d['block_size']}): tau {sim['tau']:.2f} with its own, "
                   f"{' / '.join(what)}; position-1 {sim['per_position_accuracy'][0]:.2f} -> {' / '.join(acc1)} "
                   "(a drafter trained with context drafts from it; what the context is worth: "
                   "`bench recipe` no-features)")
    ll = res.get("lossless")
    if ll:
        extra = f", {ll['ties']} ties, largest gap {ll['max_tie_gap']}" if ll["ties"] else ""
        out.append(f"lossless ({res['dtype']}, tie tolerance {ll['tolerance']}): {ll['verdict']} "
                   f"({ll['divergences']} of {ll['compared']} outputs diverge{extra})")
    return out


def decode_all(cfg: Any, target: Any, drafter: Any, ids: list[list[int]], block_sizes: list[int], *,
               lookup: bool, warmup: int, adaptive: bool | None = None) -> dict[str, Any]:
    """Baseline + drafter (+ prompt lookup) at every block size, interleaved; results by decoder name."""
    e = cfg.eval
    ddt = draft_dtype_for(cfg, target)
    decoders: dict[str, Decoder] = {"1": SpecDecoder(target, None, 1, max_context=e.max_context, record_top=TOP_K)}
    for bs in block_sizes:
        decoders[str(bs)] = SpecDecoder(target, drafter, bs, max_context=e.max_context, record_top=TOP_K,
                                        draft_sampling=e.draft_sampling, draft_dtype=ddt)
    if e.adaptive_length if adaptive is None else adaptive:
        for bs in block_sizes:
            decoders[f"adaptive-{bs}"] = SpecDecoder(target, drafter, bs, max_context=e.max_context, record_top=TOP_K,
                                                     draft_sampling=e.draft_sampling, draft_dtype=ddt, adaptive=True)
    if lookup:
        for bs in block_sizes:
            decoders[f"lookup-{bs}"] = SpecDecoder(target, None, bs, max_context=e.max_context, record_top=TOP_K,
                                                   proposer=PromptLookupProposer(e.prompt_lookup_ngram, 1))
    return run_interleaved(decoders, ids, params_for(cfg, target), warmup=warmup, base_seed=cfg.run.seed,
                           desc=f"eval ({str(target.dtype).removeprefix('torch.')})")


def entries(runs: dict[str, Any], base_t: dict) -> dict[str, dict]:
    out = {}
    for key, results in runs.items():
        bs = block_of(key)
        acc, tim = summarize_acceptance(results, bs), summarize_timing(results)
        out[key] = {**acc, **tim, **compare(base_t, tim, acc["tau"]),
                    # prompt by prompt (the paired comparison's inputs): tokens emitted, decode seconds
                    "per_prompt": [{"tokens": len(r.token_ids), "decode_s": r.decode_s} for r in results]}
        if key.startswith("adaptive-"):  # what the policy verified: drafts per step (fixed B: B − 1)
            steps = sum(len(r.acceptance_lengths) for r in results)
            out[key]["drafts_per_step"] = round(sum(r.verified_drafts for r in results) / max(1, steps), 4)
    return out


def group_of(key: str) -> str:
    """The results.json group of a decoder key: "4" speculative, "adaptive-4" adaptive, "lookup-4" prompt_lookup."""
    return "prompt_lookup" if key.startswith("lookup-") else "adaptive" if key.startswith("adaptive-") else "speculative"


def breakdown(cfg: Any, prompts: list[EvalPrompt], runs: dict[str, Any]) -> tuple[dict[str, dict], dict[str, dict]]:
    """(`by_source`, `by_mode`): every decoder's τ, steps, τ histogram and per-position acceptance
    (`decode/metrics.summarize_acceptance`) over the prompts of each data source and of each thinking mode
    (`data.chat.mode_of` of the source's template variables), under the groups of results.json
    (speculative, adaptive, prompt_lookup; block size → numbers), with `prompts` (their count); a source row
    names its `mode`, a mode row its `sources`. The prompt counts add up to the eval's."""
    by_src: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        by_src.setdefault(p.source, []).append(i)
    modes = source_modes(cfg, by_src)
    by_mode: dict[str, list[int]] = {}
    for name in sorted(by_src):
        by_mode.setdefault(modes[name], []).extend(by_src[name])

    def numbers(idx: list[int]) -> dict[str, Any]:
        out: dict[str, Any] = {"prompts": len(idx)}
        for key, results in runs.items():
            acc = summarize_acceptance([results[i] for i in sorted(idx)], block_of(key))
            out.setdefault(group_of(key), {})[str(block_of(key))] = acc
        return out

    return ({name: {"mode": modes[name], **numbers(idx)} for name, idx in sorted(by_src.items())},
            {mode: {"sources": sorted(n for n in by_src if modes[n] == mode), **numbers(idx)}
             for mode, idx in sorted(by_mode.items())})


def best_entry(group: dict[str, dict]) -> dict | None:
    """The entry with the highest measured speedup (its key as block_size)."""
    if not group:
        return None
    bs, r = max(group.items(), key=lambda kv: kv[1]["speedup"])
    return {"block_size": int(bs), "tau": r["tau"], "speedup": r["speedup"], "bound": r["bound"],
            **({"drafts_per_step": r["drafts_per_step"]} if "drafts_per_step" in r else {})}


def choose_dtype(cfg: Any, drafter_dir: Any, ids: list[list[int]], block_sizes: list[int]) -> tuple[Any, dict]:
    """eval.dtype=auto: decode the first prompts in float32 and bfloat16; keep the better honest speedup."""
    from dflashkit.model.target import load_target

    calib, targets = {}, {}
    for name in ("float32", "bfloat16"):
        target = load_target(dataclasses.replace(cfg.target, dtype=name), announce_dtype=False)
        prepare_for_decode(target, cfg.eval.packed_weights)
        drafter = load_drafter(drafter_dir, dtype=target.dtype, device=target.device)
        runs = decode_all(cfg, target, drafter, ids[:CALIBRATION_PROMPTS], block_sizes, lookup=False,
                          warmup=cfg.eval.warmup, adaptive=False)
        base_t = summarize_timing(runs.pop("1"))
        best = best_entry(entries(runs, base_t)) or {"block_size": 1, "speedup": 1.0}
        calib[name] = {"baseline_tokens_per_s": base_t["decode_tokens_per_s"], "t1_s": round(base_t["verify_s_mean"], 6),
                       "best_block_size": best["block_size"], "speedup": best["speedup"],
                       "tokens_per_s": round(base_t["decode_tokens_per_s"] * best["speedup"], 3)}
        targets[name] = target
        log.info("eval.dtype=auto: %s baseline %.1f tok/s, best B=%d speedup %.2f", name,
                 base_t["decode_tokens_per_s"], best["block_size"], best["speedup"])
    chosen = max(calib, key=lambda n: calib[n]["speedup"])
    other = next(n for n in calib if n != chosen)
    reason = (f"{chosen}: eval.dtype=auto measured the higher best speedup ({calib[chosen]['speedup']:.2f} vs "
              f"{other}'s {calib[other]['speedup']:.2f})")
    log.info("eval.dtype=auto → %s", reason)
    return targets[chosen], {"mode": "auto", "chosen": chosen, "prompts": min(len(ids), CALIBRATION_PROMPTS),
                             "rule": "higher best speedup over the same dtype's block_size=1 baseline",
                             "reason": reason, "calibration": calib}


def lossless_check(cfg: Any, target: Any, runs: dict[str, Any], base_results: list, prompts: list) -> dict:
    rule = tie_rule(target.dtype, cfg.eval.tie_tolerance)
    firsts, rows = [], []
    for key, results in runs.items():
        for i, (r, b) in enumerate(zip(results, base_results)):
            d = first_divergence(r, b)
            firsts.append(d)
            if d is not None:
                rows.append(divergence_record(d, rule, decoder=key, block_size=block_of(key),
                                              proposer=("prompt_lookup" if key.startswith("lookup-") else
                                                        "drafter-adaptive" if key.startswith("adaptive-") else "drafter"),
                                              prompt=i, id=prompts[i][0]))
    v = lossless_verdict(firsts, rule)
    return {**v, "dtype": str(target.dtype).removeprefix("torch."), "first_divergences": rows}


def diagnostics(cfg: Any, rd: Any, target: Any, drafter: Any, ids: list, base_results: list, res: dict) -> dict:
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
    if len(ids) > 1:
        d["other_context"] = simulated_acceptance(target, drafter, ids, outputs, no_features=True, ablation="other")
    return d


def evaluate(cfg: Any, rd: Any, inputs: DecodeInputs, target: Any, ids: list[list[int]], block_sizes: list[int],
             choice: dict[str, Any] | None = None, *, dtype_reason: str = "") -> dict[str, Any]:
    """Decode every prompt with the baseline and each decoder; `eval/results.json`'s dict. `dtype_reason`:
    why the target runs in its dtype (`verify_dtype`'s reason; eval.dtype=auto's is in `choice`)."""
    e = cfg.eval
    drafter_dir, prompts = inputs.drafter_dir, inputs.prompts
    drafter = load_drafter(drafter_dir, dtype=target.dtype, device=target.device)
    source = drafter_source(drafter_dir, rd)
    log.info("eval: %d prompts, block sizes %s, drafter %s (%s), verify dtype %s", len(ids), block_sizes,
             drafter_dir, source["kind"], target.dtype)
    runs = decode_all(cfg, target, drafter, ids, block_sizes, lookup=e.prompt_lookup, warmup=e.warmup)
    base_results = runs.pop("1")
    base_t = summarize_timing(base_results)
    found = entries(runs, base_t)
    ddt = draft_dtype_for(cfg, target)
    res: dict[str, Any] = {"drafter": str(drafter_dir), "drafter_source": source, "target": str(cfg.target.path),
                           "prompts": len(ids),
                           "max_new_tokens": e.max_new_tokens, "temperature": e.temperature,
                           "threads": torch.get_num_threads(), "device": str(target.device),
                           "dtype": str(target.dtype).removeprefix("torch."),
                           "dtype_reason": (choice or {}).get("reason") or dtype_reason,
                           "draft_dtype": str(ddt or target.dtype).removeprefix("torch."),
                           "baseline": base_t, "speculative": {}, "mismatches": []}
    if choice:
        res["dtype_choice"] = choice
    res["speculative"] = {k: v for k, v in found.items() if k.isdigit()}
    if e.adaptive_length:
        res["adaptive"] = {k.removeprefix("adaptive-"): v for k, v in found.items() if k.startswith("adaptive-")}
    if e.prompt_lookup:
        res["prompt_lookup"] = {k.removeprefix("lookup-"): v for k, v in found.items() if k.startswith("lookup-")}
        res["prompt_lookup_ngram"] = e.prompt_lookup_ngram
    if e.temperature <= 0:
        res["lossless"] = lossless_check(cfg, target, runs, base_results, prompts)
        diverged = {(row["decoder"], row["prompt"]) for row in res["lossless"]["first_divergences"]}
        for key, entry in found.items():
            entry["identical_to_baseline"] = not any(k == key for k, _ in diverged)
        res["mismatches"] = [row for row in res["lossless"]["first_divergences"]
                             if res["lossless"]["verdict"] == "not lossless"]
    for bs, r in res["speculative"].items():
        log.info("B=%s: tau %.2f, speedup %.2f (bound %.2f), %.1f tok/s", bs, r["tau"], r["speedup"], r["bound"],
                 r["decode_tokens_per_s"])
    best = best_entry(res["speculative"]) or {"block_size": 1, "tau": 1.0, "speedup": 1.0, "bound": 1.0}
    lookup_best = best_entry(res.get("prompt_lookup", {}))
    ll = res.get("lossless")
    res["summary"] = {**best, "rule": "block size with the highest measured speedup",
                      "greedy_identical": (ll["verdict"] == "exact") if ll else None,
                      "lossless": ll["verdict"] if ll else None, "dtype": res["dtype"]}
    adaptive_best = best_entry(res.get("adaptive", {}))
    if adaptive_best:  # reported beside fixed B; the fixed-B figure is the one an engine's predicts
        res["summary"]["adaptive"] = adaptive_best
    if lookup_best:
        res["summary"]["prompt_lookup"] = lookup_best
        res["summary"]["beats_prompt_lookup"] = (best["tau"] > lookup_best["tau"]
                                                 and best["speedup"] > lookup_best["speedup"])
        if str(best["block_size"]) in runs:  # the two best decoders, prompt by prompt (timing noise included)
            res["summary"]["versus_prompt_lookup"] = paired_speed(runs[str(best["block_size"])],
                                                                  runs[f"lookup-{lookup_best['block_size']}"])
    res["by_source"], res["by_mode"] = breakdown(cfg, prompts, runs)
    if e.diagnostics:
        res["diagnostics"] = diagnostics(cfg, rd, target, drafter, ids, base_results, res)
    res["speculation_profile"] = eval_profile(cfg, rd, inputs, target, ids, runs, block_sizes, res)
    return res


def eval_profile(cfg: Any, rd: Any, inputs: DecodeInputs, target: Any, ids: list[list[int]], runs: dict[str, Any],
                 block_sizes: list[int], res: dict[str, Any]) -> dict[str, Any] | None:
    """`speculation_profile.json` (export/profile.py) from the drafter's fixed-B decodes: one entry of
    `accept_length_by_k` per block size up to the drafter's own B, the vectors of B (else eval's first
    below it). Block sizes past B describe no drafter that can be served (K ≤ B − 1) and are left out; None when
    every block size is past B."""
    from dflashkit.model.target import cpu_facts

    e, c = cfg.eval, inputs.contract
    past = [b for b in block_sizes if b > c.block_size]
    block_sizes = [b for b in block_sizes if b <= c.block_size]
    if past:
        log.warning("speculation profile: eval.block_sizes %s exceed the drafter's block size %d (K ≤ %d): %s",
                    past, c.block_size, c.block_size - 1,
                    "left out of it" if block_sizes else "no profile written (add the drafter's own block size)")
    if not block_sizes:
        return None
    known = prompt_sources(cfg, rd)
    sources = [known.get(p[0]) for p in inputs.prompts]
    ms = [Measurement(b, [r.acceptance_lengths for r in runs[str(b)]], [r.acceptance_cut for r in runs[str(b)]],
                      sources) for b in block_sizes]
    src = res["drafter_source"]
    device = target.device
    conditions = {
        "measured_by": "dflashkit eval",
        "prompts": {"count": len(ids), "source": checkpoint_id(e.prompts) or "prepare's held-out split",
                    "sources": sorted({x for x in sources if x}) or None, "sha256": prompts_digest(ids)},
        "max_new_tokens": e.max_new_tokens, "temperature": e.temperature, "top_p": e.top_p, "top_k": e.top_k,
        "draft_sampling": e.draft_sampling, "target_dtype": res["dtype"], "draft_dtype": res["draft_dtype"],
        "device": str(device),
        "device_name": cpu_facts().get("cpu") if device.type == "cpu" else torch.cuda.get_device_name(device),
        "threads": res["threads"], "dflashkit": dflashkit_source()}
    archs = getattr(target.config, "architectures", None) or [type(target.model).__name__]
    profile = build_profile(
        ms, headline=c.block_size if c.block_size in block_sizes else block_sizes[0], method=method_for(c),
        draft_checkpoint={"name": cfg.run.name, "kind": src["kind"], **({"step": src["step"]} if "step" in src else {}),
                          "weights_sha256": weights_digest(inputs.drafter_dir)},
        target_model={"id": checkpoint_id(cfg.target.path), "architecture": archs[0]},
        block_size=c.block_size, max_supported_k=c.block_size - 1, conditions=conditions)
    if not profile["measured"]:
        log.warning("speculation profile: no verify step at B=%d was a full uncut block, so it holds no rates "
                    "(raise eval.max_new_tokens)", profile["num_speculative_tokens"] + 1)
    return profile


def mismatch_error(res: dict[str, Any], results_path: Path) -> DflashkitError | None:
    """The error for a greedy divergence beyond a numerical tie (a bug: lossless is violated), or None."""
    if not res["mismatches"]:
        return None
    m = next(r for r in res["mismatches"] if not r["tie"])
    gap = f"{m['gap']}" if m["gap"] is not None else f"more than its top {TOP_K} (margin {m['margin']})"
    return DflashkitError(
        f"greedy speculative output differs from the baseline beyond a numerical tie: {m['proposer']} block "
        f"size {m['block_size']}, prompt {m['prompt']} ({m['id']}), first differing token at position "
        f"{m['position']}, where the baseline preferred its token by {gap} logits (tie tolerance "
        f"{m['tolerance']}: {res['lossless']['tolerance']}, {res['dtype']}; see {results_path})",
        hint="this is a bug (lossless decoding is violated); re-run with --log-level debug and report it")
