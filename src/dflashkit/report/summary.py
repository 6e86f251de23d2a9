"""`dflashkit run`'s closing summary: the numbers a user wants at the end (τ, speedup, lossless, the
data-budget forecast) and where the report, export and drafter are.

Usage:
    s = run_summary(rd, target_tau=2.0)     # {"eval": results.json's summary, "forecast", "budget", "report", ...}
    log.info("\n".join(summary_lines(s)))
"""

from __future__ import annotations

import json
from typing import Any

from dflashkit.decode.evaluation import flag_phrase, paired_text, read_eval_results, verdict_of
from dflashkit.rundir import RunDir
from dflashkit.sizing.plan import plan_lines
from dflashkit.train.checkpoint import trained_drafter_dir
from dflashkit.sizing.forecast import read_curve_forecast


def run_summary(rd: RunDir, target_tau: float = 2.0) -> dict[str, Any]:
    """The numbers a user wants at the end: τ, speedup, lossless yes/no, where things are."""
    out: dict[str, Any] = {}

    res = read_eval_results(rd)
    if res is not None:
        out["eval"] = res.get("summary", res)

    fc = read_curve_forecast(rd, target_tau)
    if fc is not None:
        out["forecast"] = fc.text()

    budget = run_budget(rd)
    if budget is not None:
        out["budget"] = budget
    drafter = trained_drafter_dir(rd)[0].relative_to(rd.root)  # train/best if kept, else final
    for name, rel in (("report", "report/index.html"), ("checkpoint", "export"), ("drafter", drafter)):
        p = rd.root / rel
        if p.exists():
            out[name] = str(p)
    return out


def run_budget(rd: RunDir) -> dict[str, Any] | None:
    """`pipeline.json`'s "budget" record (`sizing/session.py`: plan, re-plans, actuals), or None without one."""
    try:
        rec = json.loads((rd.root / "pipeline.json").read_text()).get("budget")
    except (OSError, ValueError, AttributeError):
        return None
    return rec if isinstance(rec, dict) and rec.get("plan") else None


def hybrid_summary_lines(hy: dict[str, Any] | None) -> list[str]:
    """The hybrid row beside the drafter and prompt lookup: τ, speedup, the decoder each source chose and the
    paired intervals (`summary.hybrid` of eval/results.json)."""
    if not hy:
        return []
    lines = [f"  {'hybrid':17s} tau {hy['tau']} speedup {hy['speedup']} (decoder per source, chosen on its other "
             "prompts)" + (f"; {flag_phrase(hy['unreliable'])}" if hy.get("unreliable") else "")]
    for src, g in (hy.get("gates_by_source") or {}).items():
        lines.append(f"  {'':17s} {src}: {g['decoder']} ({g['tokens_per_s']} tok/s)")
    for key, other in (("versus_drafter", "drafter"), ("versus_prompt_lookup", "lookup")):
        if hy.get(key):
            lines.append(f"  {'':17s} hybrid over {other}, paired: {hy[key]['phrase']}")
    return lines


def summary_lines(s: dict[str, Any]) -> list[str]:
    ev = s.get("eval") or {}
    lines = ["", "== dflashkit run summary =="]
    for key in ("tau", "speedup", "bound", "greedy_identical", "block_size", "lossless", "dtype"):
        if key in ev:
            lines.append(f"  {key:17s} {ev[key]}")
    if ev.get("unreliable"):
        lines.append(f"  {'':17s} {flag_phrase(ev['unreliable'])}")
    if ev.get("unreliable_entries"):  # any entry eval flagged: no verdict is drawn from it
        lines.append(f"  {'unreliable':17s} {'; '.join(ev['unreliable_entries'])}")
    lk = ev.get("prompt_lookup")
    if lk:
        verdict = ev.get("verdict_prompt_lookup") or verdict_of(bool(ev.get("beats_prompt_lookup")), ev, lk)
        lines.append(f"  {'prompt lookup':17s} tau {lk['tau']} speedup {lk['speedup']} at B={lk['block_size']} "
                     + ("(unreliable measurement: no verdict)" if verdict == "unreliable measurement" else
                        f"(the drafter {verdict} it)"))
        if ev.get("versus_prompt_lookup"):
            lines.append(f"  {'':17s} drafter over lookup, paired: {paired_text(ev['versus_prompt_lookup'], ev, lk)}")
    lines += hybrid_summary_lines(ev.get("hybrid"))
    if s.get("forecast"):
        lines.append(f"  {'forecast':17s} {s['forecast']}")
    if s.get("budget"):
        lines += ["  budget, planned vs actual:", *(f"    {ln}" for ln in plan_lines(s["budget"]))]
    for key in ("report", "checkpoint", "drafter"):
        if key in s:
            lines.append(f"  {key:17s} {s[key]}")
    return lines
