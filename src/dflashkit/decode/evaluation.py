"""What `eval` (and the decoder part of `bench decode`) computes: decode held-out prompts with the
baseline, the drafter, the prompt-lookup proposer, the suffix proposer and the hybrid of the drafter and the
suffix proposer, and summarise τ, speedup, the lossless verdict and the diagnostics into `eval/results.json`'s
dict. This module owns that file: `write_eval_results`
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

Decoder keys (`decode_all`) and their results.json groups: "1" the baseline; "4" the drafter at B=4
(`speculative`); "adaptive-4" (`adaptive`); "confident-4" the drafter with verification truncated by its confidence
(`confident`, with a drafter whose family has `Decoding.confidence`: DSpark); "lookup-4" (`prompt_lookup`); "suffix-4" the suffix proposer alone
(`suffix`); "hybrid-4@2" the hybrid at B=4 whose suffix branch drafts when its match is ≥ 2 tokens and "graft-4@4"
the same at gate 4 with grafting (`hybrid`, keyed "4@2", "4@4+graft"); a trailing "+online" ("hybrid-4@2+online",
keyed "4@2+online") runs the same grid point with the online drafter gate (`decode/online_gate.py`,
eval.hybrid_online_gate).

The `hybrid` row (`hybrid_composite`, `summary.hybrid`) is measured, not chosen after the fact: each prompt is
scored with the decoder (drafter alone, suffix alone, or a hybrid grid point, at any block size) that had the
highest tokens/s over the *other* prompts of its data source (`loo_composite`), so no prompt picks its own gate.
The draft-length policies (`draft_length`, `length_policies`): per block size, the adaptive length and the
confidence truncation against fixed B (and the truncation against the adaptive length), paired prompt by prompt,
over all prompts and per data source.
An entry whose timing cannot be true (`timing_flags`: speedup above its τ, or t(B) below t(1) beyond noise)
carries `unreliable` and never makes a "faster" verdict.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dflashkit.data.chat import load_chat, source_modes
from dflashkit.decode.api import Decoder, GenerationResult
from dflashkit.decode.diagnostics import BigramTable, simulated_acceptance
from dflashkit.decode.hybrid import NEVER, HybridGate, HybridProposer
from dflashkit.decode.lossless import TOP_K, divergence_record, first_divergence, lossless_verdict, tie_rule
from dflashkit.decode.metrics import (compare, compare_flags, paired_phrase, paired_speed, summarize_acceptance,
                                     summarize_timing)
from dflashkit.decode.ngram import PromptLookupProposer
from dflashkit.decode.runner import (draft_dtype_for, load_prompts, params_for, prompt_sources, refuse_unrendered_tools,
                                     render_eval_prompts, resolve_drafter_dir, run_interleaved)
from dflashkit.decode.spec_decode import SpecDecoder, estimates_acceptance
from dflashkit.decode.suffix import SuffixProposer
from dflashkit.errors import DflashkitError
from dflashkit.export.hf import load_drafter, read_contract
from dflashkit.export.profile import (Measurement, build_profile, checkpoint_id, dflashkit_source, draft_length_block,
                                      method_for, prompts_digest, proposers_block, weights_digest)
from dflashkit.inspect.target import resolve_target_path
from dflashkit.target.packed import prepare_for_decode
from dflashkit.target.load import compute_dtype, resolve_device, text_config_dict
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
    from dflashkit.target.load import load_target

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
    """The verify dtype and why (a `target.load.DtypeChoice`, not yet announced): `eval.dtype` target/auto
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
    """The block size of a decoder key: "4", "lookup-4", "adaptive-4", "suffix-4", "hybrid-4@2", "graft-4@4"."""
    return int(key.rpartition("-")[2].partition("@")[0])


GROUPS = (("drafter", "speculative"), ("adaptive", "adaptive"), ("confident", "confident"), ("lookup", "prompt_lookup"),
          ("suffix", "suffix"), ("hybrid", "hybrid"))
# the lossless check's proposer name of a decoder key's prefix (no prefix: the drafter)
PROPOSERS = {"lookup": "prompt_lookup", "adaptive": "drafter-adaptive", "confident": "drafter-confident",
             "suffix": "suffix", "hybrid": "hybrid", "graft": "graft"}
MIN_HYBRID_PROMPTS = 2  # the hybrid row chooses each prompt's decoder on the other prompts (sizing/plan.py knows)


def proposer_of(key: str) -> str:
    """The proposer of a decoder key: drafter, drafter-adaptive, drafter-confident, prompt_lookup, suffix, hybrid or
    graft."""
    prefix, dash, _ = key.rpartition("-")
    return PROPOSERS.get(prefix, "drafter") if dash else "drafter"


def group_key(key: str) -> tuple[str, str]:
    """(results.json group, key in it) of a decoder key: "4" → (speculative, "4"), "lookup-4" → (prompt_lookup,
    "4"), "suffix-4" → (suffix, "4"), "hybrid-4@2" → (hybrid, "4@2"), "graft-4@4" → (hybrid, "4@4+graft")."""
    prefix, _, rest = key.rpartition("-")
    group = {"lookup": "prompt_lookup", "adaptive": "adaptive", "confident": "confident", "suffix": "suffix",
             "hybrid": "hybrid", "graft": "hybrid"}.get(prefix, "speculative")
    return group, (f"{rest}+graft" if prefix == "graft" else rest)


def timing_flags(entry: dict[str, Any]) -> list[str]:
    """Why an entry's timing cannot be true (`decode.metrics.compare_flags` of its speedup, bound, t(1), t(B) at its
    τ; empty: nothing found): such a figure is flagged `unreliable` and never makes a "faster" verdict."""
    return compare_flags(entry, entry.get("tau", 0.0))


def flag_phrase(reasons: list[str]) -> str:
    return "unreliable measurement (" + "; ".join(reasons) + ")"


def verdict_of(wins: bool, *entries: dict[str, Any] | None) -> str:
    """"beats" / "does not beat", or "unreliable measurement" when an entry compared is flagged."""
    if any(e and e.get("unreliable") for e in entries):
        return "unreliable measurement"
    return "beats" if wins else "does not beat"


def paired_text(p: dict[str, Any], *entries: dict[str, Any] | None) -> str:
    """`paired_phrase`, with its verdict replaced when an entry it compares is flagged."""
    text = paired_phrase(p)
    if any(e and e.get("unreliable") for e in entries):
        text = text.rpartition(":")[0] + ": unreliable measurement, not a verdict"
    return text


def results_table(res: dict[str, Any]) -> str:
    b = res["baseline"]
    rows = [("B", "proposer", "tau", "tok/s", "speedup", "bound", "e2e", "TTFT ms", "identical"),
            ("1", "-", "1.00", f"{b['decode_tokens_per_s']:.1f}", "1.00", "1.00", "1.00", f"{b['ttft_s'] * 1e3:.1f}", "-")]
    named = [(name, bs, r) for name, key in GROUPS for bs, r in res.get(key, {}).items()]
    if res.get("hybrid_composite"):
        named.append(("hybrid (per-source gate)", "-", res["hybrid_composite"]))
    for name, bs, r in named:
        rows.append((bs, name, f"{r['tau']:.2f}", f"{r['decode_tokens_per_s']:.1f}",
                     f"{r['speedup']:.2f}" + ("!" if r.get("unreliable") else ""), f"{r['bound']:.2f}",
                     f"{r['speedup_e2e']:.2f}", f"{r['ttft_s'] * 1e3:.1f}", str(r.get("identical_to_baseline", "-"))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    if any(r.get("unreliable") for _, _, r in named):
        lines.append("! unreliable measurement: the timing cannot be true (see `unreliable` in results.json); "
                     "no verdict is drawn from it")
    for bs, r in res["speculative"].items():
        lines.append(f"B={bs} per-position acceptance: " + " ".join(f"{x:.2f}" for x in r["per_position_acceptance"]))
    lines += breakdown_lines(res)
    lines += length_policy_lines(res)
    lines += diagnostic_lines(res)
    return "\n".join(lines)


def breakdown_lines(res: dict[str, Any]) -> list[str]:
    """τ at the best block size per data source and per thinking mode (drafter, prompt lookup at its best block
    size, the hybrid composite with the decoder each source chose), when there are several."""
    bs, lk = str(res["summary"]["block_size"]), str((res["summary"].get("prompt_lookup") or {}).get("block_size", "-"))
    hy = res["summary"].get("hybrid") or {}
    out = []
    for key, what in (("by_source", "source"), ("by_mode", "mode")):
        groups = res.get(key) or {}
        if len(groups) < 2:
            continue
        parts = []
        gates = hy.get("gates_by_source" if key == "by_source" else "gates_by_mode") or {}
        for name, g in groups.items():
            d, p = g.get("speculative", {}).get(bs), g.get("prompt_lookup", {}).get(lk)
            h, gate = g.get("hybrid_composite"), gates.get(name)
            label = f"{name} ({g['mode']})" if "mode" in g else name
            parts.append(f"{label}: {g['prompts']} prompts" + (f", tau {d['tau']:.2f}" if d else "")
                         + (f", lookup {p['tau']:.2f}" if p else "")
                         + (f", hybrid {h['tau']:.2f}" if h else "") + (f" (gate {gate['decoder']})" if gate else ""))
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
        verdict = s.get("verdict_prompt_lookup") or verdict_of(bool(s.get("beats_prompt_lookup")), s, lk)
        verdict = "does NOT beat" if verdict == "does not beat" else verdict
        vs = s.get("versus_prompt_lookup")
        out.append(f"best: drafter B={s['block_size']} tau {s['tau']:.2f} speedup {s['speedup']:.2f}x; prompt lookup "
                   f"B={lk['block_size']} tau {lk['tau']:.2f} speedup {lk['speedup']:.2f}x: "
                   + ("unreliable measurement, no verdict" if verdict == "unreliable measurement" else
                      f"the drafter {verdict} it")
                   + (f" (drafter over lookup, paired: {paired_text(vs, s, lk)})" if vs else ""))
    out += hybrid_lines(s)
    for where, reasons in unreliable_entries(res):
        out.append(f"{where}: {flag_phrase(reasons)}")
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


def hybrid_lines(s: dict[str, Any]) -> list[str]:
    """The hybrid composite against the drafter's best and prompt lookup's best (`summary.hybrid`), with the
    decoder each source chose."""
    hy = s.get("hybrid")
    if not hy:
        return []
    gates = ", ".join(f"{src}: {g['decoder']}" for src, g in (hy.get("gates_by_source") or {}).items())
    out = [f"hybrid (decoder chosen per source by leave-one-out; {gates}): tau {hy['tau']:.2f} speedup "
           f"{hy['speedup']:.2f}x" + (f"; {flag_phrase(hy['unreliable'])}" if hy.get("unreliable") else "")]
    for key, other in (("versus_drafter", "drafter"), ("versus_prompt_lookup", "prompt lookup")):
        if hy.get(key):
            out.append(f"  hybrid over {other}'s best, paired: {hy[key]['phrase']}")
    return out


def unreliable_entries(res: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """(where, reasons) of every flagged entry of results.json's groups."""
    out = []
    for name, key in GROUPS:
        for bs, r in (res.get(key) or {}).items():
            if r.get("unreliable"):
                out.append((f"{name} B={bs}", r["unreliable"]))
    if (res.get("hybrid_composite") or {}).get("unreliable"):
        out.append(("hybrid (per-source gate)", res["hybrid_composite"]["unreliable"]))
    return out


def confident(cfg: Any, drafter: Any) -> bool:
    """Whether eval decodes the confidence-truncated rows: eval.confidence_truncation and a drafter whose family
    estimates each draft's acceptance (`Decoding.confidence`)."""
    return bool(cfg.eval.confidence_truncation) and estimates_acceptance(drafter)


def decode_all(cfg: Any, target: Any, drafter: Any, ids: list[list[int]], block_sizes: list[int], *,
               lookup: bool, warmup: int, adaptive: bool | None = None, hybrid: bool | None = None,
               truncated: bool | None = None) -> dict[str, Any]:
    """Baseline + drafter (+ adaptive, confidence-truncated (`confident`), prompt lookup) at every block size, the
    suffix proposer alone and the hybrid grid (`hybrid_decoders`) at the largest, interleaved; results by decoder
    key (module docstring)."""
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
    if confident(cfg, drafter) if truncated is None else truncated:
        for bs in block_sizes:
            decoders[f"confident-{bs}"] = SpecDecoder(target, drafter, bs, max_context=e.max_context,
                                                      record_top=TOP_K, draft_sampling=e.draft_sampling,
                                                      draft_dtype=ddt, confidence_cut=e.confidence_threshold)
    if lookup:
        for bs in block_sizes:
            decoders[f"lookup-{bs}"] = SpecDecoder(target, None, bs, max_context=e.max_context, record_top=TOP_K,
                                                   proposer=PromptLookupProposer(e.prompt_lookup_ngram, 1))
    if (e.hybrid if hybrid is None else hybrid) and block_sizes:
        if len(ids) >= MIN_HYBRID_PROMPTS:
            decoders.update(hybrid_decoders(cfg, target, drafter, hybrid_block_size(block_sizes), ddt))
        else:
            log.info("eval.hybrid: %d prompt(s), the hybrid row needs %d (a gate is chosen on other prompts than "
                     "the one it is scored on): suffix and hybrid decoders skipped", len(ids), MIN_HYBRID_PROMPTS)
    return run_interleaved(decoders, ids, params_for(cfg, target), warmup=warmup, base_seed=cfg.run.seed,
                           desc=f"eval ({str(target.dtype).removeprefix('torch.')})")


ONLINE = "+online"  # the tail of a hybrid decoder key whose drafter runs under the online gate


def hybrid_gate(key: str) -> HybridGate | None:
    """The gate of a hybrid decoder key ("hybrid-4@2": suffix branch at matches of ≥ 2 tokens; "graft-4@4": the
    same, grafting; "hybrid-4@2/2": the drafter branch at block size 2 beside suffix drafts up to 4;
    "hybrid-4@2+online": with the online drafter gate), None for any other key."""
    prefix, _, rest = key.rpartition("-")
    if prefix not in ("hybrid", "graft"):
        return None
    online = rest.endswith(ONLINE)
    gate, _, block = rest.removesuffix(ONLINE).partition("@")[2].partition("/")
    return HybridGate(min_match=int(gate), graft=prefix == "graft", drafter_block=int(block or 0),
                      online_gate=online)


def gate_dict(gate: HybridGate) -> dict[str, Any]:
    """A hybrid gate as results.json (and the speculation profile) records it."""
    return {"min_match": gate.min_match, "graft": gate.graft,
            **({"drafter_block": gate.drafter_block} if gate.drafter_block else {}),
            **({"online_gate": True} if gate.online_gate else {})}


def hybrid_block_size(block_sizes: list[int]) -> int:
    """The block size the suffix proposer and the hybrid grid are measured at: eval's largest (a suffix match pays
    in long copies; every grid point at every block size would double eval's time)."""
    return max(block_sizes)


def hybrid_keys(cfg: Any, bs: int) -> list[str]:
    """The decoder keys of the suffix proposer and the hybrid grid at block size `bs` (eval.hybrid_gates, and the
    graft at the largest gate with eval.hybrid_graft; no gate: never the suffix branch alone), each grid point
    without the online drafter gate, with it ("+online"), or both, by eval.hybrid_online_gate."""
    e = cfg.eval
    gates = list(dict.fromkeys(e.hybrid_gates))
    tails = {"off": [""], "on": [ONLINE], "both": ["", ONLINE]}[e.hybrid_online_gate]
    keys = [f"suffix-{bs}"]
    for d in hybrid_drafter_blocks(cfg, bs):
        tail = f"/{d}" if d else ""
        grid = [f"hybrid-{bs}@{g}{tail}" for g in gates]
        if e.hybrid_graft:
            grid.append(f"graft-{bs}@{max(gates) if gates else NEVER}{tail}")
        keys += [k + t for t in tails for k in grid]
    return keys


def hybrid_drafter_blocks(cfg: Any, bs: int) -> list[int]:
    """eval.hybrid_drafter_blocks at grid block size `bs`: 0 (the grid's own) for entries of 0 or ≥ `bs`."""
    return list(dict.fromkeys(0 if d == 0 or d >= bs else d for d in cfg.eval.hybrid_drafter_blocks)) or [0]


def hybrid_decoders(cfg: Any, target: Any, drafter: Any, bs: int, ddt: Any = None) -> dict[str, Decoder]:
    """`hybrid_keys`' decoders: each its own suffix proposer (no pool: eval prompts are separate requests, and a
    pool would make a prompt's result depend on the order they are decoded in)."""
    e = cfg.eval
    out: dict[str, Decoder] = {}
    for key in hybrid_keys(cfg, bs):
        gate = hybrid_gate(key)
        if gate is None:
            out[key] = SpecDecoder(target, None, bs, max_context=e.max_context, record_top=TOP_K,
                                   proposer=SuffixProposer())
        else:
            out[key] = SpecDecoder(target, drafter, bs, max_context=e.max_context, record_top=TOP_K,
                                   draft_sampling=e.draft_sampling, draft_dtype=ddt,
                                   hybrid=HybridProposer(SuffixProposer(), gate))
    return out


def branch_shares(results: list[GenerationResult]) -> dict[str, float]:
    """Share of a hybrid decoder's verify steps each branch drafted (suffix, drafter, graft, none)."""
    steps = [b for r in results for b in getattr(r, "branch", [])]
    return {b: round(steps.count(b) / len(steps), 4) for b in sorted(set(steps))} if steps else {}


def entries(runs: dict[str, Any], base_t: dict) -> dict[str, dict]:
    """Per decoder key: τ and acceptance, timing, speedup and bound over the baseline's timing `base_t`,
    per-prompt tokens and seconds, and `unreliable` (`timing_flags`) where the timing cannot be true."""
    out = {}
    for key, results in runs.items():
        out[key] = entry_of(results, block_of(key), base_t)
        if key.startswith(("adaptive-", "confident-")):  # what the policy verified: drafts per step (fixed B: B − 1)
            steps = sum(len(r.acceptance_lengths) for r in results)
            out[key]["drafts_per_step"] = round(sum(r.verified_drafts for r in results) / max(1, steps), 4)
        gate = hybrid_gate(key)
        if gate is not None:
            out[key]["gate"] = gate_dict(gate)
            out[key]["branches"] = branch_shares(results)
    return out


def entry_of(results: list[GenerationResult], bs: int, base_t: dict) -> dict[str, Any]:
    """One decoder's numbers over `results` (block size `bs`) against the baseline's timing `base_t`."""
    acc, tim = summarize_acceptance(results, bs), summarize_timing(results)
    e = {**acc, **tim, **compare(base_t, tim, acc["tau"]),
         # prompt by prompt (the paired comparison's inputs): tokens emitted, decode seconds
         "per_prompt": [{"tokens": len(r.token_ids), "decode_s": r.decode_s} for r in results]}
    flags = timing_flags(e)
    if flags:
        e["unreliable"] = flags
    return e


def group_of(key: str) -> str:
    """The results.json group of a decoder key (`group_key`)."""
    return group_key(key)[0]


def prompt_groups(cfg: Any, prompts: list[EvalPrompt]) -> tuple[dict[str, list[int]], dict[str, str],
                                                                  dict[str, list[int]]]:
    """(prompt indices per data source, each source's thinking mode, prompt indices per mode)."""
    by_src: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        by_src.setdefault(p.source, []).append(i)
    modes = source_modes(cfg, by_src)
    by_mode: dict[str, list[int]] = {}
    for name in sorted(by_src):
        by_mode.setdefault(modes[name], []).extend(by_src[name])
    return by_src, modes, by_mode


# -- the hybrid row: a decoder per source, chosen on the other prompts --------------------------------------------
def composite_candidates(keys: list[str]) -> list[str]:
    """What the hybrid row chooses among, in order (ties go to the first): the drafter alone at fixed B, the
    suffix proposer alone and every hybrid grid point, at every block size."""
    return [k for k in keys if group_of(k) in ("speculative", "suffix", "hybrid")]


def pooled_tokens_per_s(results: list[GenerationResult], idx: list[int]) -> float:
    """Decode tokens per second over the prompts `idx` (tokens after the first, summed, over decode seconds)."""
    n = sum(max(0, len(results[i].token_ids) - 1) for i in idx)
    t = sum(results[i].decode_s for i in idx)
    return n / t if t > 0 else 0.0


def pick(runs: dict[str, list[GenerationResult]], candidates: list[str], idx: list[int]) -> str:
    """The candidate with the highest pooled tokens/s over the prompts `idx` (the first on a tie)."""
    return max(candidates, key=lambda k: pooled_tokens_per_s(runs[k], idx))


def loo_composite(runs: dict[str, list[GenerationResult]], candidates: list[str],
                  groups: dict[str, list[int]]) -> tuple[list[str], list[GenerationResult]]:
    """Leave-one-out choice per prompt: prompt i of group g is scored with the candidate that is fastest over the
    *other* prompts of g (a group of one prompt: over every other prompt; a single prompt in all: the first
    candidate, the drafter alone). Returns (the decoder key chosen for each prompt, its result there): no
    prompt's own result takes part in choosing what it is scored with."""
    n = len(runs[candidates[0]])
    choice = [candidates[0]] * n
    for idx in groups.values():
        for i in idx:
            others = [j for j in idx if j != i] or [j for j in range(n) if j != i]
            choice[i] = pick(runs, candidates, others) if others else candidates[0]
    return choice, [runs[k][i] for i, k in enumerate(choice)]


def gate_record(key: str, runs: dict[str, list[GenerationResult]], idx: list[int]) -> dict[str, Any]:
    """What a choice of decoder means: its proposer, block size and gate, and its tokens/s over `idx`."""
    gate = hybrid_gate(key)
    return {"decoder": key, "proposer": proposer_of(key), "block_size": block_of(key),
            "gate": gate_dict(gate) if gate else None,
            "tokens_per_s": round(pooled_tokens_per_s(runs[key], idx), 3)}


def versus(a: list[GenerationResult], b: list[GenerationResult], ea: dict | None, eb: dict | None,
           idx: list[int] | None = None) -> dict[str, Any]:
    """`paired_speed` of A over B (over the prompts `idx`, else all), with its phrase (`paired_text`: no verdict
    where an entry compared is flagged) and `faster` (the interval above 1, neither entry flagged)."""
    if idx is not None:
        a, b = [a[i] for i in idx], [b[i] for i in idx]
    p = paired_speed(a, b)
    flagged = any(e and e.get("unreliable") for e in (ea, eb))
    return {**p, "faster": p["clear"] == "a" and not flagged, "phrase": paired_text(p, ea, eb)}


def hybrid_composite(cfg: Any, prompts: list[EvalPrompt], runs: dict[str, list[GenerationResult]], base: list,
                     found: dict[str, dict], res: dict[str, Any]) -> None:
    """The hybrid row (module docstring): `res["hybrid_composite"]` (its numbers over every prompt, the decoder
    each prompt was scored with), `hybrid_composite` in each `by_source` / `by_mode` row, and `summary.hybrid`:
    τ, speedup, paired intervals against the drafter's best and prompt lookup's best (overall, and per source
    in `by_source`), the decoder each source would run (chosen on all its prompts: `gates_by_source`, with the
    leave-one-out choices) and each mode (`gates_by_mode`)."""
    candidates = composite_candidates(list(runs))
    by_src, modes, by_mode = prompt_groups(cfg, prompts)
    choice, results = loo_composite(runs, candidates, by_src)
    base_t = summarize_timing(base)
    comp = entry_of(results, max(block_of(k) for k in choice), base_t)
    comp["identical_to_baseline"] = all(found[k].get("identical_to_baseline", True) for k in set(choice))
    comp["chosen"] = [{"prompt": i, "id": prompts[i].id, "source": prompts[i].source, "decoder": k}
                      for i, k in enumerate(choice)]
    comp["candidates"] = candidates
    comp["rule"] = ("each prompt decoded by the candidate with the highest tokens/s over the other prompts of its "
                    "data source (leave-one-out; a source of one prompt: over all other prompts)")
    res["hybrid_composite"] = comp
    s = res["summary"]
    drafter_key = str(s["block_size"]) if str(s["block_size"]) in runs else None
    lk = s.get("prompt_lookup")
    lookup_key = f"lookup-{lk['block_size']}" if lk and f"lookup-{lk['block_size']}" in runs else None
    others = [(name, k) for name, k in (("drafter", drafter_key), ("prompt_lookup", lookup_key)) if k]

    def compared(idx: list[int] | None) -> dict[str, Any]:
        return {f"versus_{name}": versus(results, runs[k], comp, found[k], idx) for name, k in others}

    hy: dict[str, Any] = {k: comp[k] for k in ("tau", "speedup", "bound", "decode_tokens_per_s")}
    if comp.get("unreliable"):
        hy["unreliable"] = comp["unreliable"]
    hy.update(compared(None))
    for name, _ in others:
        hy[f"beats_{name}"] = hy[f"versus_{name}"]["faster"]
    hy["gates_by_source"] = {name: {**gate_record(pick(runs, candidates, idx), runs, idx),
                                    "leave_one_out": [choice[i] for i in idx]} for name, idx in by_src.items()}
    hy["gates_by_mode"] = {mode: gate_record(pick(runs, candidates, idx), runs, idx) for mode, idx in by_mode.items()}
    hy["rule"] = comp["rule"]
    s["hybrid"] = hy
    for key, groups in (("by_source", by_src), ("by_mode", by_mode)):
        for name, idx in groups.items():
            row = res.get(key, {}).get(name)
            if row is None:
                continue
            sub = entry_of([results[i] for i in idx], max(block_of(choice[i]) for i in idx),
                           summarize_timing([base[i] for i in idx]))
            row["hybrid_composite"] = {
                **{k: sub[k] for k in ("tau", "decode_tokens_per_s", "speedup", "bound")},
                **({"unreliable": sub["unreliable"]} if sub.get("unreliable") else {}),
                "decoders": [choice[i] for i in idx], **compared(idx)}


def breakdown(cfg: Any, prompts: list[EvalPrompt], runs: dict[str, Any]) -> tuple[dict[str, dict], dict[str, dict]]:
    """(`by_source`, `by_mode`): every decoder's τ, steps, τ histogram and per-position acceptance
    (`decode/metrics.summarize_acceptance`) over the prompts of each data source and of each thinking mode
    (`data.chat.mode_of` of the source's template variables), under the groups of results.json
    (speculative, adaptive, prompt_lookup, suffix: block size → numbers; hybrid: grid key → numbers), with
    `prompts` (their count); a source row names its `mode`, a mode row its `sources`. The prompt counts add up
    to the eval's. Each entry also holds the decoder's tokens/s over those prompts; `evaluate` adds
    `hybrid_composite`."""
    by_src, modes, by_mode = prompt_groups(cfg, prompts)

    def numbers(idx: list[int]) -> dict[str, Any]:
        out: dict[str, Any] = {"prompts": len(idx)}
        for key, results in runs.items():
            sub = [results[i] for i in sorted(idx)]
            acc = summarize_acceptance(sub, block_of(key))
            group, k = group_key(key)
            out.setdefault(group, {})[k] = {**acc, "decode_tokens_per_s": summarize_timing(sub)["decode_tokens_per_s"]}
        return out

    return ({name: {"mode": modes[name], **numbers(idx)} for name, idx in sorted(by_src.items())},
            {mode: {"sources": sorted(n for n in by_src if modes[n] == mode), **numbers(idx)}
             for mode, idx in sorted(by_mode.items())})


LENGTH_POLICIES = (("adaptive", "fixed"), ("confident", "fixed"), ("confident", "adaptive"))


def length_policies(cfg: Any, prompts: list[EvalPrompt], runs: dict[str, list[GenerationResult]],
                    found: dict[str, dict]) -> dict[str, dict]:
    """The draft-length policies against each other, per block size B ("4" → …): each policy's τ, tokens/s and
    drafts verified per step, overall and per data source, and the paired speed ratio (`versus`) of the adaptive
    length and of the confidence truncation over fixed B, and of the truncation over the adaptive length, each
    overall (`A_vs_B`) and per source (`by_source`). Empty without an adaptive or a confident decoder."""
    by_src, _, _ = prompt_groups(cfg, prompts)
    out: dict[str, dict] = {}
    for bs in sorted({block_of(k) for k in runs if k.startswith(("adaptive-", "confident-"))}):
        keys = {"fixed": str(bs), "adaptive": f"adaptive-{bs}", "confident": f"confident-{bs}"}
        keys = {name: k for name, k in keys.items() if k in runs}
        if "fixed" not in keys:
            continue

        def numbers(name: str, idx: list[int]) -> dict[str, Any]:
            sub = [runs[keys[name]][i] for i in idx]
            steps = sum(len(r.acceptance_lengths) for r in sub)
            return {"tau": summarize_acceptance(sub, bs)["tau"],
                    "decode_tokens_per_s": summarize_timing(sub)["decode_tokens_per_s"],
                    "drafts_per_step": round(sum(r.verified_drafts for r in sub) / max(1, steps), 4)}

        pairs = [(a, b) for a, b in LENGTH_POLICIES if a in keys and b in keys]
        row: dict[str, Any] = {"decoders": keys, "policies": {n: numbers(n, list(range(len(prompts)))) for n in keys}}
        for a, b in pairs:
            row[f"{a}_vs_{b}"] = versus(runs[keys[a]], runs[keys[b]], found.get(keys[a]), found.get(keys[b]))
        row["by_source"] = {src: {"prompts": len(idx), "policies": {n: numbers(n, idx) for n in keys},
                                  **{f"{a}_vs_{b}": versus(runs[keys[a]], runs[keys[b]], found.get(keys[a]),
                                                           found.get(keys[b]), idx) for a, b in pairs}}
                            for src, idx in sorted(by_src.items())}
        out[str(bs)] = row
    return out


def length_policy_lines(res: dict[str, Any]) -> list[str]:
    """`draft_length` as text: per block size and source, each policy's τ and tokens/s and the paired ratios."""
    out = []
    for bs, row in (res.get("draft_length") or {}).items():
        for src, g in [("all", row), *row["by_source"].items()]:
            pol = ", ".join(f"{n} tau {p['tau']:.2f} {p['decode_tokens_per_s']:.1f} tok/s"
                            for n, p in g["policies"].items())
            ratios = "; ".join(f"{k.replace('_vs_', ' over ')} {g[k]['ratio']:.2f}x "
                               f"({g[k]['interval90'][0]:.2f}-{g[k]['interval90'][1]:.2f})"
                               for k in g if "_vs_" in k)
            out.append(f"draft length B={bs} {src}: {pol}" + (f"; {ratios}" if ratios else ""))
    return out


def best_entry(group: dict[str, dict]) -> dict | None:
    """The entry with the highest measured speedup (its key as block_size)."""
    if not group:
        return None
    bs, r = max(group.items(), key=lambda kv: kv[1]["speedup"])
    return {"block_size": int(bs), "tau": r["tau"], "speedup": r["speedup"], "bound": r["bound"],
            **({"drafts_per_step": r["drafts_per_step"]} if "drafts_per_step" in r else {}),
            **({"unreliable": r["unreliable"]} if r.get("unreliable") else {})}


def choose_dtype(cfg: Any, drafter_dir: Any, ids: list[list[int]], block_sizes: list[int]) -> tuple[Any, dict]:
    """eval.dtype=auto: decode the first prompts in float32 and bfloat16; keep the better honest speedup."""
    from dflashkit.target.load import load_target

    calib, targets = {}, {}
    for name in ("float32", "bfloat16"):
        target = load_target(dataclasses.replace(cfg.target, dtype=name), announce_dtype=False)
        prepare_for_decode(target, cfg.eval.packed_weights)
        drafter = load_drafter(drafter_dir, dtype=target.dtype, device=target.device)
        runs = decode_all(cfg, target, drafter, ids[:CALIBRATION_PROMPTS], block_sizes, lookup=False,
                          warmup=cfg.eval.warmup, adaptive=False, hybrid=False, truncated=False)
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
                                              proposer=proposer_of(key), prompt=i, id=prompts[i][0]))
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
    if any(k.startswith("confident-") for k in found):
        res["confident"] = {k.removeprefix("confident-"): v for k, v in found.items() if k.startswith("confident-")}
        res["confidence_threshold"] = e.confidence_threshold
    if e.prompt_lookup:
        res["prompt_lookup"] = {k.removeprefix("lookup-"): v for k, v in found.items() if k.startswith("lookup-")}
        res["prompt_lookup_ngram"] = e.prompt_lookup_ngram
    if e.hybrid:
        for group in ("suffix", "hybrid"):
            res[group] = {group_key(k)[1]: v for k, v in found.items() if group_of(k) == group}
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
    flagged = unreliable_entries(res)
    if flagged:  # no "faster" verdict is drawn from these (`timing_flags`)
        res["summary"]["unreliable_entries"] = [f"{where}: {'; '.join(reasons)}" for where, reasons in flagged]
    adaptive_best = best_entry(res.get("adaptive", {}))
    if adaptive_best:  # reported beside fixed B; the fixed-B figure is the one an engine's predicts
        res["summary"]["adaptive"] = adaptive_best
    confident_best = best_entry(res.get("confident", {}))
    if confident_best:
        res["summary"]["confident"] = confident_best
    if lookup_best:
        res["summary"]["prompt_lookup"] = lookup_best
        verdict = verdict_of(best["tau"] > lookup_best["tau"] and best["speedup"] > lookup_best["speedup"],
                             best, lookup_best)
        res["summary"]["beats_prompt_lookup"] = verdict == "beats"  # never from a flagged entry
        res["summary"]["verdict_prompt_lookup"] = verdict
        if str(best["block_size"]) in runs:  # the two best decoders, prompt by prompt (timing noise included)
            res["summary"]["versus_prompt_lookup"] = paired_speed(runs[str(best["block_size"])],
                                                                  runs[f"lookup-{lookup_best['block_size']}"])
    res["by_source"], res["by_mode"] = breakdown(cfg, prompts, runs)
    if policies := length_policies(cfg, prompts, runs, found):
        res["draft_length"] = policies
    if e.hybrid and composite_candidates(list(runs)):
        hybrid_composite(cfg, prompts, runs, base_results, found, res)
    if e.diagnostics:
        res["diagnostics"] = diagnostics(cfg, rd, target, drafter, ids, base_results, res)
    res["speculation_profile"] = eval_profile(cfg, rd, inputs, target, ids, runs, block_sizes, res)
    return res


def eval_profile(cfg: Any, rd: Any, inputs: DecodeInputs, target: Any, ids: list[list[int]], runs: dict[str, Any],
                 block_sizes: list[int], res: dict[str, Any]) -> dict[str, Any] | None:
    """`speculation_profile.json` (export/profile.py) from the drafter's fixed-B decodes: one entry of
    `accept_length_by_k` per block size up to the drafter's own B, the vectors of B (else eval's first
    below it). Block sizes past B describe no drafter that can be served (K ≤ B − 1) and are left out; None when
    every block size is past B. With the hybrid measured, `proposers` says per source which proposer pays and at
    which gate; with an adaptive or a confident row, `draft_length` which draft-length rule pays
    (`draft_length_block`)."""
    from dflashkit.target.load import cpu_facts

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
    headline = c.block_size if c.block_size in block_sizes else block_sizes[0]
    profile = build_profile(
        ms, headline=headline, method=method_for(c),
        draft_checkpoint={"name": cfg.run.name, "kind": src["kind"], **({"step": src["step"]} if "step" in src else {}),
                          "weights_sha256": weights_digest(inputs.drafter_dir)},
        target_model={"id": checkpoint_id(cfg.target.path), "architecture": archs[0]},
        block_size=c.block_size, max_supported_k=c.block_size - 1, conditions=conditions,
        proposers=proposers_block(res["summary"]["hybrid"]) if res["summary"].get("hybrid") else None,
        draft_length=draft_length_block(res.get("draft_length") or {}, headline, e.confidence_threshold))
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
