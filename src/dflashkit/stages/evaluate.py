"""`dflashkit eval`: lossless speculative decoding of held-out prompts — τ, acceptance, speedup.

Inputs:  the target (`target.*`), a drafter dir (DIR, `eval.drafter`, `train/best/` — kept by
         `train.keep_best` — else `train/final/`, or `export/`), prompts (`eval.prompts`, else `prepare/heldout.jsonl`).
Outputs: `eval/results.json` (+ manifest): the baseline (block_size 1, same loop) and, per block size,
         τ mean and histogram, per-position acceptance, tokens/s, speedup (decode and end-to-end),
         TTFT, and the bound τ·t(1)/t(B) from the same run's step timings (`decode/metrics.py`).
Example: dflashkit eval -c run.yaml eval.block_sizes=[4,8,16]

Every problem with the inputs (drafter that does not fit the target, prompt longer than the context)
is reported before any decoding (exit 2). At temperature 0 every speculative output must equal the
baseline token for token; a mismatch is written to results.json and fails the command (exit 1).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from dflashkit.config import RunConfig, section_hash
from dflashkit.context import StageContext
from dflashkit.errors import DflashkitError
from dflashkit.rundir import RunDir, atomic_write_json, write_manifest

log = logging.getLogger("dflashkit.eval")


def _table(res: dict[str, Any]) -> str:
    b = res["baseline"]
    rows = [("B", "tau", "tok/s", "speedup", "bound", "e2e", "TTFT ms", "identical"),
            ("1", "1.00", f"{b['decode_tokens_per_s']:.1f}", "1.00", "1.00", "1.00", f"{b['ttft_s'] * 1e3:.1f}", "-")]
    for bs, r in res["speculative"].items():
        rows.append((bs, f"{r['tau']:.2f}", f"{r['decode_tokens_per_s']:.1f}", f"{r['speedup']:.2f}",
                     f"{r['bound']:.2f}", f"{r['speedup_e2e']:.2f}", f"{r['ttft_s'] * 1e3:.1f}",
                     str(r.get("identical_to_baseline", "-"))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    for bs, r in res["speculative"].items():
        lines.append(f"B={bs} per-position acceptance: " + " ".join(f"{x:.2f}" for x in r["per_position_acceptance"]))
    return "\n".join(lines)


def _drafter_source(drafter_dir: Path, rd: Any) -> dict[str, Any]:
    """Which drafter eval used: train/best (with its best.json: step, held-out τ), train/final, or other."""
    from dflashkit.train.checkpoint import read_best

    d = Path(drafter_dir).resolve()
    if d == (rd.root / "train" / "best").resolve():
        return {"kind": "best", **(read_best(d) or {})}
    if d == (rd.root / "train" / "final").resolve():
        return {"kind": "final"}
    return {"kind": "export" if d == (rd.root / "export").resolve() else "dir"}


def run(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict[str, Any]:
    import torch

    from dflashkit.decode.metrics import compare, summarize_acceptance, summarize_timing
    from dflashkit.decode.runner import (draft_dtype_for, first_difference, load_prompt_messages, params_for,
                                         render_prompts, resolve_drafter_dir, run_interleaved)
    from dflashkit.decode.spec_decode import SpecDecoder
    from dflashkit.export.hf import check_fits, load_drafter, read_contract
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
        return {"dry_run": True, "drafter": str(drafter_dir), "prompts": len(prompts), "block_sizes": block_sizes}
    target = load_target(cfg.target)
    check_fits(contract, num_layers=target.num_layers, hidden_size=target.hidden_size,
               vocab_size=target.vocab_size, where=f"drafter {drafter_dir}")
    ids = render_prompts(target.tokenizer, prompts, cfg.tokenize.chat_template_kwargs)
    params = params_for(cfg, target)
    baseline = SpecDecoder(target, None, 1, max_context=e.max_context)
    for i, p in enumerate(ids):  # every prompt must fit before anything is decoded
        baseline.check_prompt(len(p), e.max_new_tokens, what=f"prompt {i} ({prompts[i][0]})")
    drafter = load_drafter(drafter_dir, dtype=target.dtype, device=target.device)

    source = _drafter_source(drafter_dir, rd)
    log.info("eval: %d prompts, block sizes %s, drafter %s (%s)", len(ids), block_sizes, drafter_dir,
             source["kind"])
    ddt = draft_dtype_for(cfg, target)
    decoders = {"1": baseline} | {str(bs): SpecDecoder(target, drafter, bs, max_context=e.max_context,
                                                         draft_sampling=e.draft_sampling, draft_dtype=ddt)
                                  for bs in block_sizes}
    runs = run_interleaved(decoders, ids, params, warmup=e.warmup, base_seed=cfg.run.seed)
    base_results = runs.pop("1")
    base_t = summarize_timing(base_results)
    res: dict[str, Any] = {"drafter": str(drafter_dir), "drafter_source": source, "target": str(cfg.target.path), "prompts": len(ids),
                           "max_new_tokens": e.max_new_tokens, "temperature": e.temperature,
                           "threads": torch.get_num_threads(), "device": str(target.device),
                           "draft_dtype": str(ddt or target.dtype).removeprefix("torch."),
                           "baseline": base_t, "speculative": {}, "mismatches": []}
    for key, results in runs.items():
        bs = int(key)
        acc = summarize_acceptance(results, bs)
        tim = summarize_timing(results)
        entry = {**acc, **tim, **compare(base_t, tim, acc["tau"])}
        if e.temperature <= 0:
            diffs = [(i, first_difference(r.token_ids, b.token_ids)) for i, (r, b) in
                     enumerate(zip(results, base_results))]
            bad = [(i, pos) for i, pos in diffs if pos is not None]
            entry["identical_to_baseline"] = not bad
            res["mismatches"] += [{"block_size": bs, "prompt": i, "id": prompts[i][0], "position": pos}
                                  for i, pos in bad]
        res["speculative"][key] = entry
        log.info("B=%d: tau %.2f, speedup %.2f (bound %.2f), %.1f tok/s", bs, acc["tau"], entry["speedup"],
                 entry["bound"], tim["decode_tokens_per_s"])

    first = res["speculative"].get(str(block_sizes[0])) if block_sizes else None
    res["summary"] = {
        "block_size": block_sizes[0] if block_sizes else 1, "tau": first["tau"] if first else 1.0,
        "speedup": first["speedup"] if first else 1.0, "bound": first["bound"] if first else 1.0,
        "greedy_identical": (not res["mismatches"]) if e.temperature <= 0 else None}
    out = rd.stage_dir("eval")
    atomic_write_json(out / "results.json", res)
    write_manifest(out, stage="eval", config_hash=section_hash(cfg.eval, cfg.target), started=t0,
                   inputs={"drafter": str(drafter_dir)}, counts={"prompts": len(ids), "block_sizes": len(block_sizes)},
                   outputs=["results.json"])
    if not ctx.json:
        print(_table(res), flush=True)
    if res["mismatches"]:
        m = res["mismatches"][0]
        raise DflashkitError(
            f"greedy speculative output differs from the baseline: block size {m['block_size']}, prompt "
            f"{m['prompt']} ({m['id']}), first differing token at position {m['position']} "
            f"({len(res['mismatches'])} mismatches; see {out / 'results.json'})",
            hint="this is a bug (lossless decoding is violated); re-run with --log-level debug and report it")
    summary = {bs: {k: r[k] for k in ("tau", "speedup", "bound", "decode_tokens_per_s")}
               for bs, r in res["speculative"].items()}
    return {"results": str(out / "results.json"), "drafter": str(drafter_dir), "drafter_source": source,
            "prompts": len(ids), "summary": res["summary"],
            "baseline_tokens_per_s": base_t["decode_tokens_per_s"], "block_sizes": summary}
