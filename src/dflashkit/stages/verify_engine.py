"""`dflashkit verify-engine [DIR]`: serve the target + an exported drafter in vLLM and check it against ours.

Inputs:  the exported drafter (DIR, else `<run_dir>/export`), the target (`target.*`, run in float32),
         the eval prompts (`eval.prompts`, else prepare's held-out split; `eval.num_prompts`,
         `eval.max_new_tokens`). The drafter's block size B gives vLLM num_speculative_tokens = B − 1.
Outputs: `verify-engine/results.json` (+ manifest), `verify-engine/engine-ar.log`, `engine-dflash.log`;
         the engine's acceptance in the drafter's `speculation_profile.json` (`engines`: in place for an
         export of ours, else `verify-engine/speculation_profile.json`).
Example: dflashkit verify-engine -c run.yaml            # after `dflashkit export`

An export of a V2-only family (DFlash2, LiLiCorr: `vllm_runner` "v2") fails unless vLLM ran it on its V2 model
runner (the only one with the candidate walk; vLLM's CPU build has none: there it always fails, naming the
family and the engine's log line).
Greedy outputs of vLLM (without speculation) must equal our target's, vLLM with DFlash must equal
vLLM without, and the engine's τ and per-position acceptance must match our decoder's on the same
prompts within the tolerances of `dflashkit.engines.verify` (τ within 15 %, each position within
0.1 + prompts / verify steps). A failed check exits 1 and names the likely cause. vLLM is installed into the cache on first
use (`dflashkit engines install vllm`).

A `speculation_profile.json` beside the drafter that describes another drafter (K above its B − 1, another
block size or family: export/profile_ship.py `refuse_other_drafter`) is refused before anything starts (a dry
run too): exit 2 naming the file and both K, as `export` and `import` refuse it, rather than comparing the
engine with it and recording the engine's figures in it. A broken profile fails the profile check (exit 1).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from dflashkit.config import RunConfig
from dflashkit.context import StageContext
from dflashkit.decode.runner import load_prompts
from dflashkit.engines.launch import check_vllm_for_target
from dflashkit.engines.verify import verify_engine, write_engine_results
from dflashkit.errors import MissingArtifactError, StageFailed, UsageError
from dflashkit.export.profile import profile_path, read_profile
from dflashkit.export.profile_ship import drafter_contract, record_engine, refuse_other_drafter
from dflashkit.rundir import RunDir, check_replaceable, write_manifest
from dflashkit.stage_table import stage_hash


def _drafter_dir(rd: RunDir, positionals: list[str]) -> Path:
    if positionals:
        p = Path(positionals[0])
        if not (p / "config.json").is_file():
            raise UsageError(f"{p} is not an exported drafter dir (no config.json)",
                             hint="pass the dir `dflashkit export` wrote")
        return p
    p = rd.export_dir
    if not (p / "config.json").is_file():
        raise MissingArtifactError("exported drafter", p, run="dflashkit export -c run.yaml")
    return p


def _refuse_other_drafters_profile(drafter_dir: Path) -> None:
    """Exit 2 when the drafter's profile describes another drafter; a broken one is left to the profile check."""
    path = profile_path(drafter_dir)
    try:
        profile = read_profile(path)
    except UsageError:
        return
    if profile is not None:
        refuse_other_drafter(profile, path, drafter_contract(drafter_dir), drafter_dir)


def _is_export(d: Path) -> bool:
    try:
        check_replaceable(d, owner="export")
        return True
    except UsageError:
        return False


def _table(res: dict[str, Any]) -> str:
    if "tau" not in res:  # a V2-only family's export on vLLM's V1 runner: nothing was measured
        return "\n".join([f"verify-engine ({res['engine']}, {res['family']}, B={res['block_size']}): FAILED"]
                         + [f"  likely cause: {x}" for x in res["causes"]])
    t, pp, c = res["tau"], res["per_position_acceptance"], res["checks"]
    ok = {True: "ok", False: "FAIL", None: "not checked"}
    lines = [f"verify-engine ({res['engine']}, {res['family']}, B={res['block_size']}, {res['prompts']} prompts, "
             f"{res['dtype']}): "
             f"{'PASSED' if res['passed'] else 'FAILED'}",
             f"  tau            engine {t['engine']:.3f}  ours {t['ours']:.3f}   {ok[c['tau']['ok']]} ({c['tau']['rule']})",
             "  per position   engine " + " ".join(f"{x:.2f}" for x in pp["engine"])
             + "\n                 ours   " + " ".join(f"{x:.2f}" for x in pp["ours"])
             + f"   {ok[c['per_position']['ok']]}",
             f"  greedy         engine = ours: {ok[c['greedy_engine_vs_ours']['ok']]}; "
             f"engine+DFlash = engine: {ok[c['greedy_spec_vs_ar']['ok']]}",
             f"  chat template  {ok[c['template']['ok']]}",
             f"  profile        {ok[c['profile']['ok']]}"
             + (f" ({c['profile']['reason']})" if c["profile"].get("reason") else "")]
    tm = res["timing"]
    lines.append(f"  engine tok/s (1 stream): AR {tm['engine_ar_tokens_per_s']}, DFlash {tm['engine_dflash_tokens_per_s']}")
    lines += [f"  likely cause: {x}" for x in res["causes"]]
    return "\n".join(lines)


def run(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict[str, Any]:
    t0 = time.time()
    drafter_dir = _drafter_dir(rd, ctx.positionals)
    _refuse_other_drafters_profile(drafter_dir)
    prompts = load_prompts(cfg, rd, cfg.eval.num_prompts)

    check_vllm_for_target(cfg, "verify-engine")  # what starting vLLM needs, before any work (a dry run too)
    if ctx.dry_run:
        return {"dry_run": True, "drafter": str(drafter_dir), "prompts": len(prompts)}

    out = rd.stage_dir("verify-engine")
    res = verify_engine(cfg, drafter_dir, prompts, out_dir=out)
    prof = res.get("speculation_profile") or {}
    if prof.get("path"):  # the engine's figures go into the profile: the export's own, else a copy here
        dest = profile_path(drafter_dir) if _is_export(drafter_dir) else rd.verify_engine_profile
        prof["written"] = str(record_engine(read_profile(profile_path(drafter_dir)) or {}, prof["entry"],
                                            prof["check"], dest))
    path = write_engine_results(rd, res)
    write_manifest(out, stage="verify-engine", config_hash=stage_hash("verify-engine", cfg), started=t0,
                   inputs={"drafter": str(drafter_dir)}, counts={"prompts": res["prompts"]},
                   outputs=["results.json", "engine-ar.log", "engine-dflash.log"])
    if not ctx.json:
        print(_table(res), file=sys.stderr, flush=True)
    summary = {"passed": res["passed"], "tau": res.get("tau"), "checks": {k: v["ok"] for k, v in res["checks"].items()},
               "causes": res["causes"], "results": str(path)}
    if not res["passed"]:
        raise StageFailed("verify-engine: the drafter does not behave in vLLM as in dflashkit: "
                          + "; ".join(res["causes"]), result=summary, hint=f"see {path}")
    return summary
