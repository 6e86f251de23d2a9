"""`dflashkit eval`: lossless speculative decoding of held-out prompts — τ, acceptance, speedup, diagnostics.

Inputs:  the target (`target.*`), a drafter dir (DIR, `eval.drafter`, `train/best/` — kept by
         `train.keep_best` — else `train/final/`, or `export/`), prompts (`eval.prompts`, else
         `prepare/heldout.jsonl`), the tokenized shards (optional, for the bigram baseline).
Outputs: `eval/results.json` (+ manifest): the baseline (block_size 1, same loop) and, per block size,
         τ mean and histogram, per-position acceptance, tokens/s, speedup (decode and end-to-end),
         TTFT, and the bound τ·t(1)/t(B) from the same run's step timings (`decode/metrics.py`);
         the same for the training-free prompt-lookup proposer (`prompt_lookup`), the suffix proposer alone
         (`suffix`) and the hybrid of the drafter and the suffix proposer at each gate of `eval.hybrid_gates`
         (`hybrid`), whose `hybrid` row (`hybrid_composite`, `summary.hybrid`) decodes each prompt with the
         decoder fastest on the other prompts of its data source, with paired intervals against the drafter's
         and prompt lookup's best; every entry whose timing cannot be true carries `unreliable` (then no
         "faster" verdict is drawn from it); the verify dtype and
         why (`dtype`, `dtype_reason`: `eval.dtype`, see target/load.py `compute_dtype`); the lossless
         verdict (`lossless`); `diagnostics` (bigram baseline, no-feature ablation); `summary` = the
         best block size by measured speedup. `eval/speculation_profile.json` (export/profile.py):
         the drafter's acceptance rates in ModelOpt's schema, which `export` ships beside the weights.
Example: dflashkit eval -c run.yaml eval.block_sizes=[4,8,16] eval.dtype=bfloat16

Every problem with the inputs (drafter that does not fit the target, prompt longer than the context)
is reported before any decoding (exit 2). At temperature 0 every speculative output must equal the
baseline token for token, up to numerical ties in bf16 (`decode/lossless.py`); a divergence that is
not a tie is written to results.json and fails the command (exit 1). The decoding and the numbers live in
`dflashkit.decode.evaluation` (shared with `bench decode`: drafter, prompts, target, prompt checks).
"""

from __future__ import annotations

import time
from typing import Any

from dflashkit.config import RunConfig
from dflashkit.context import StageContext
from dflashkit.decode.evaluation import (block_sizes_for, check_prompts_render, check_target_fits, choose_dtype, decode_inputs, evaluate,
                                         load_checked_target, mismatch_error, results_table, verify_dtype,
                                         verify_target_config, write_eval_results)
from dflashkit.sizing.step_cost import decode_step_report
from dflashkit.export.profile import headline, write_profile
from dflashkit.target.load import announce
from dflashkit.rundir import RunDir, write_manifest
from dflashkit.stage_table import stage_hash


def run(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict[str, Any]:
    t0 = time.time()
    e = cfg.eval
    inputs = decode_inputs(cfg, rd, ctx.positionals, num_prompts=e.num_prompts)
    drafter_dir = inputs.drafter_dir
    block_sizes = block_sizes_for(e.block_sizes, inputs.contract)
    verify = verify_dtype(cfg)
    target_cfg = verify_target_config(cfg, verify)
    check_target_fits(inputs, target_cfg)  # what load_checked_target checks first: a dry run too
    check_prompts_render(cfg, inputs)
    if e.dtype != "auto":  # auto says what it measured once it has
        announce(verify)
    if ctx.dry_run:
        return {"dry_run": True, "drafter": str(drafter_dir), "prompts": len(inputs.prompts),
                "block_sizes": block_sizes, "dtype": e.dtype, "prompt_lookup": e.prompt_lookup,
                "hybrid": {"gates": e.hybrid_gates, "graft": e.hybrid_graft,
                           "online_gate": e.hybrid_online_gate} if e.hybrid else None}
    target, ids = load_checked_target(cfg, inputs, target_cfg)
    choice = None
    if e.dtype == "auto":
        del target
        target, choice = choose_dtype(cfg, drafter_dir, ids, block_sizes)
    step = decode_step_report(target, block_sizes)  # t(1), t(B) against this machine's memory floor
    res = evaluate(cfg, rd, inputs, target, ids, block_sizes, choice, dtype_reason=verify.reason)
    res["decode_step"] = step
    out = rd.stage_dir("eval")
    profile = res.pop("speculation_profile", None)  # the owner writes it; results.json keeps its headline
    if profile is not None:
        res["speculation_profile"] = {"path": str(write_profile(rd.eval_profile, profile)), **headline(profile)}
    path = write_eval_results(rd, res)
    write_manifest(out, stage="eval", config_hash=stage_hash("eval", cfg), started=t0,
                   inputs={"drafter": str(drafter_dir)}, counts={"prompts": len(ids), "block_sizes": len(block_sizes)},
                   outputs=["results.json", *(["speculation_profile.json"] if profile is not None else [])],
                   extra={"speculation_profile": res.get("speculation_profile")})
    if not ctx.json:
        print(results_table(res), flush=True)
    err = mismatch_error(res, path)
    if err is not None:
        raise err
    summary = {bs: {k: r[k] for k in ("tau", "speedup", "bound", "decode_tokens_per_s")}
               for bs, r in res["speculative"].items()}
    return {"results": str(path), "drafter": str(drafter_dir), "drafter_source": res["drafter_source"],
            "speculation_profile": res.get("speculation_profile"),
            "prompts": len(ids), "summary": res["summary"],
            "baseline_tokens_per_s": res["baseline"]["decode_tokens_per_s"], "block_sizes": summary}


def outputs_present(rd: RunDir) -> bool:
    """`dflashkit run`: an eval from before the speculation profile runs again (once)."""
    return "speculation_profile" in (rd.manifest("eval") or {})
