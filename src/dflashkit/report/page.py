"""The report page: one self-contained HTML document (inline CSS; the plots are passed in as <img> tags).

Usage:
    metrics, results = read_metrics(rd), read_eval_results(rd)   # their owners: train/logging, decode/evaluation
    specs, curve_html = curve_section(curve, best, target_tau=2.0)
    page = render_html(rd, name, figures, results, bench, metrics, curve_html, engine=engine_results)
    breakdown_html(results, curve)      # per data source and per thinking mode: held-out τ, eval τ, lookup τ, hybrid
    hybrid_html(results)                # the hybrid row: the decoder each source chose, each grid point, paired

An entry eval flagged (`unreliable`: a timing that cannot be true) is marked and never called faster.
"""

from __future__ import annotations

import base64
import html
import logging
import time
from typing import Any

from dflashkit.decode.evaluation import flag_phrase, paired_text, verdict_of
from dflashkit.report.summary import run_budget
from dflashkit.rundir import RunDir, read_json_or_none
from dflashkit.stage_table import PIPELINE
from dflashkit.sizing.plan import plan_lines
from dflashkit.sizing.forecast import forecast_from_curve
from dflashkit.train.logging import read_curve

log = logging.getLogger("dflashkit.report")

CSS = """body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2rem auto;max-width:1100px;
color:#1d2433;background:#fff}h1{font-size:1.6rem;margin-bottom:.2rem}h2{font-size:1.2rem;margin-top:2rem;
border-bottom:2px solid #e3e7ef;padding-bottom:.3rem}.muted{color:#667}.cards{display:flex;gap:1rem;
flex-wrap:wrap}.card{background:#f3f6fb;border-radius:8px;padding:.8rem 1.1rem;min-width:140px}
.card b{display:block;font-size:1.5rem;color:#1f5fbf}table{border-collapse:collapse;margin:.5rem 0;
font-size:.9rem}td,th{border:1px solid #d8dde8;padding:.3rem .6rem;text-align:right}th{background:#eef2f9}
td:first-child,th:first-child{text-align:left}.plots{display:grid;grid-template-columns:1fr 1fr;gap:1rem}
.plots img{width:100%;border:1px solid #e3e7ef;border-radius:6px}pre{background:#f6f8fa;
padding:.8rem;overflow:auto;font-size:.8rem;max-height:30rem}"""


# -- the learning curve (train/curve.json) and the kept best drafter ---------------------------------
def curve_section(curve: dict | None, best: dict | None, target_tau: float = 2.0) -> tuple[list[tuple], str]:
    """Plot specs and an HTML section for `train/curve.json` (+ `train/best/best.json`).

    Plots: held-out τ vs supervised tokens seen (overall, each source when there are several, and
    train τ over the same windows: the gap), and the same for position-1 accuracy. The table lists
    every point with held-out loss."""
    points = (curve or {}).get("points") or []
    if not points:
        return [], ""
    sources = (curve or {}).get("sources") or []
    specs = []
    for key, name, title, ylabel in (("tau", "learning_curve", "Learning curve: simulated τ", "τ"),
                                     ("acc1", "learning_curve_acc1", "Learning curve: position-1 accuracy",
                                      "accuracy")):
        held = [(p["tokens"], p["heldout"].get(key)) for p in points if p["heldout"].get(key) is not None]
        series = [("held-out", [x for x, _ in held], [y for _, y in held])] if held else []
        if len(sources) > 1:
            for src in sources:
                pts = [(p["tokens"], p["by_source"][src][key]) for p in points
                       if p["by_source"].get(src, {}).get(key) is not None]
                if pts:
                    series.append((f"held-out {src}", [x for x, _ in pts], [y for _, y in pts]))
        train = [(p["tokens"], p["train"][key]) for p in points if p["train"].get(key) is not None]
        if train:
            series.append(("train (same steps)", [x for x, _ in train], [y for _, y in train]))
        if series:
            specs.append((name, title, "supervised tokens seen", ylabel, "line", series))
    header = ["step", "tokens seen", "held-out τ", "train τ", "gap", "held-out pos-1 acc", "held-out loss"]
    if len(sources) > 1:
        header += [f"τ {s} (tokens)" for s in sources]
    rows = []
    for p in points:
        h, t = p["heldout"], p["train"]
        gap = t["tau"] - h["tau"] if t.get("tau") is not None else None
        row = [p["step"], p["tokens"], _fmt(h["tau"], 3), _fmt(t.get("tau"), 3), _fmt(gap, 3), _fmt(h["acc1"], 3),
               _fmt(h["loss"], 3)]
        if len(sources) > 1:
            row += [f"{_fmt(p['by_source'].get(s, {}).get('tau'), 3)} ({p['by_source'].get(s, {}).get('tokens', 0)})"
                    for s in sources]
        rows.append(row)
    text = ("<h2>Learning curve</h2><p>Held-out simulated τ at each held-out evaluation against the supervised "
            "tokens seen so far (train/curve.json); train τ is pooled over the steps since the previous point, "
            "so the gap shows over-fitting. A curve still rising at its end says more data pays.</p>")

    fc = forecast_from_curve(curve or {}, target_tau)
    text += (f"<p><b>Data-budget forecast</b> (τ∞ − a·n<sup>−b</sup> fitted to the held-out curve; "
             f"sizing/forecast.py): {html.escape(fc.text())}</p>")
    if best:
        text += (f"<p>Kept drafter (train/best, used by eval and export): step {best.get('step')}, held-out τ "
                 f"{_fmt(best.get('tau'), 3)}.</p>")
    return specs, text + _table(header, rows)


def _table(header: list[str], rows: list[list[Any]]) -> str:
    th = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


def _fmt(x: Any, nd: int = 2) -> str:
    return f"{x:.{nd}f}" if isinstance(x, (int, float)) else str(x)


def _lookup_verdict(summ: dict[str, Any], lk: dict[str, Any]) -> str:
    """The drafter against prompt lookup in words: no verdict where either best entry was flagged unreliable."""
    verdict = summ.get("verdict_prompt_lookup") or verdict_of(bool(summ.get("beats_prompt_lookup")), summ, lk)
    return {"beats": "The drafter beats it", "does not beat": "The drafter does <b>not</b> beat it"}.get(
        verdict, "<b>Unreliable measurement</b>: no verdict ("
        + html.escape("; ".join(summ.get("unreliable") or lk.get("unreliable") or [])) + ")")


def _speedup(r: dict[str, Any]) -> str:
    """A speedup cell: "unreliable" beside a figure eval flagged (its timing cannot be true)."""
    return _fmt(r.get("speedup", "-")) + (" (unreliable)" if r.get("unreliable") else "")


def render_html(rd: RunDir, name: str, figures: list[str], results: dict | None, bench: dict | None,
                metrics: list[dict], curve_html: str = "", engine: dict | None = None) -> str:
    out = [f"<!doctype html><html><head><meta charset='utf-8'><title>dflashkit report: {html.escape(name)}</title>",
           f"<style>{CSS}</style></head><body><h1>DFlash run: {html.escape(name)}</h1>",
           f"<p class='muted'>{html.escape(str(rd.root.resolve()))} · generated "
           f"{time.strftime('%Y-%m-%d %H:%M:%S')}</p>"]
    spec_res = (results or {}).get("speculative", {})
    cards = []
    for b, r in spec_res.items():
        cards.append(f"<div class='card'>τ at B={b}<b>{r['tau']:.2f}</b></div>")
        cards.append(f"<div class='card'>speedup at B={b}<b>{r['speedup']:.2f}×</b>bound {r['bound']:.2f}×</div>")
    train = [m for m in metrics if m.get("split") != "heldout" and "loss" in m]
    if train:
        cards.append(f"<div class='card'>final loss<b>{train[-1]['loss']:.3f}</b>step {train[-1]['step']}</div>")
    if cards:
        out.append("<div class='cards'>" + "".join(cards) + "</div>")
    if figures:
        out.append("<h2>Plots</h2><div class='plots'>" + "".join(figures) + "</div>")
    out.append(curve_html)
    if results:
        b0 = results["baseline"]
        rows = [["1 (baseline)", "1.00", _fmt(b0["decode_tokens_per_s"], 1), "1.00", "1.00", "1.00",
                 _fmt(b0["ttft_s"] * 1e3, 1), "-"]]
        rows += [[b, _fmt(r["tau"]), _fmt(r["decode_tokens_per_s"], 1), _speedup(r), _fmt(r["bound"]),
                  _fmt(r["speedup_e2e"]), _fmt(r["ttft_s"] * 1e3, 1), r.get("identical_to_baseline", "-")]
                 for b, r in spec_res.items()]
        out.append(f"<h2>Evaluation</h2><p>{results['prompts']} prompts, max_new_tokens {results['max_new_tokens']}, "
                   f"temperature {results['temperature']}, device {html.escape(str(results.get('device')))}. "
                   "Speedup = baseline decode time per token / speculative; bound = τ·t(1)/t(B).</p>")
        out.append(_table(["block size", "τ", "tokens/s", "speedup", "bound", "end-to-end", "TTFT ms",
                           "identical to baseline"], rows))
    if results:
        out.append(eval_diagnostics_html(results))
        out.append(hybrid_html(results))

    out.append(breakdown_html(results, read_curve(rd)))
    if engine:
        out.append(engine_section_html(engine))
    if bench:
        out.append("<h2>Decode bench (ours vs reference dflash_generate)</h2>")
        out.append(_table(["block size", "ours tok/s", "reference tok/s", "ours/reference", "identical", "τ",
                           "t(1) ms", "t(B) ms", "speedup", "bound"],
                          [[bench["block_size"], bench["tokens_per_s_e2e"]["ours"],
                            bench["tokens_per_s_e2e"]["reference"], bench["ours_over_reference"],
                            bench["identical_tokens"], bench["tau"], bench["t1_ms"], bench["tB_ms"],
                            bench["speedup"], bench["bound"]]]))
    contract = read_json_or_none(rd.contract_path, log)
    if contract:
        keys = ("block_size", "num_draft_layers", "target_layer_ids", "mask_token_id", "num_target_layers",
                "hidden_size", "vocab_size", "target_model_type")
        out.append("<h2>Drafter contract</h2>" + _table(["key", "value"], [[k, contract.get(k)] for k in keys]))
    prov = []
    versions: dict[str, Any] = {}
    for stage in (*PIPELINE, "verify-engine", "import", "bench"):
        m = rd.manifest(stage)
        if m:
            versions = m.get("versions") or versions
            prov.append([stage, m.get("finished_at", ""), m.get("wall_time_s", ""),
                         ", ".join(f"{k}={v}" for k, v in (m.get("counts") or {}).items())])

    budget = run_budget(rd)
    if budget:
        out.append("<h2>Budget: plan vs actual</h2><p>run.budget_minutes sized this run (docs/budget.md); the "
                   "report's own time is recorded after this page.</p><pre>"
                   + html.escape("\n".join(plan_lines(budget))) + "</pre>")
    if prov:
        out.append("<h2>Provenance</h2>" + _table(["stage", "finished", "wall s", "counts"], prov))
    if versions:
        out.append("<p class='muted'>" + html.escape(", ".join(f"{k} {v}" for k, v in versions.items())) + "</p>")
    if rd.resolved_config_path.is_file():
        out.append("<h2>Config</h2><pre>" + html.escape(rd.resolved_config_path.read_text()) + "</pre>")
    out.append("</body></html>")
    return "\n".join(out)


def breakdown_html(results: dict | None, curve: dict | None) -> str:
    """Per data source and per thinking mode (when there are several): held-out τ at the curve's last point
    (train/curve.json), the eval prompts, the drafter's τ and position-1 acceptance at the best block size and
    prompt lookup's at its best (eval/results.json `by_source`, `by_mode`)."""
    res, last = results or {}, ((curve or {}).get("points") or [{}])[-1]
    summ = res.get("summary") or {}
    bs, lk = str(summ.get("block_size", "-")), str((summ.get("prompt_lookup") or {}).get("block_size", "-"))
    hy = summ.get("hybrid") or {}
    modes = {**((curve or {}).get("modes") or {}), **{n: g["mode"] for n, g in (res.get("by_source") or {}).items()}}
    out = []
    for key, what in (("by_source", "source"), ("by_mode", "mode")):
        held = {n: v for n, v in (last.get(key) or {}).items() if "tau" in v}
        ev = res.get(key) or {}
        names = sorted({*held, *ev})
        if len(names) < 2:
            continue
        rows = []
        for n in names:
            h, g = held.get(n, {}), ev.get(n, {})
            d, p = g.get("speculative", {}).get(bs, {}), g.get("prompt_lookup", {}).get(lk, {})
            c = g.get("hybrid_composite") or {}
            gate = (hy.get("gates_by_source" if key == "by_source" else "gates_by_mode") or {}).get(n) or {}
            rows.append([n, modes.get(n, "-") if key == "by_source" else ", ".join(g.get("sources") or h.get("sources") or []),
                         _fmt(h.get("tau", "-"), 3), g.get("prompts", "-"), _fmt(d.get("tau", "-")),
                         _fmt((d.get("per_position_acceptance") or ["-"])[0]), _fmt(p.get("tau", "-")),
                         _fmt((p.get("per_position_acceptance") or ["-"])[0])]
                        + ([_fmt(c.get("tau", "-")), _speedup(c) if c else "-", gate.get("decoder", "-")] if hy else []))
        out.append(_table([what, "mode" if key == "by_source" else "sources", "held-out τ", "eval prompts",
                           f"drafter τ (B={bs})", "drafter position-1", f"lookup τ (B={lk})", "lookup position-1"]
                          + (["hybrid τ", "hybrid speedup", "decoder chosen"] if hy else []), rows))
    if not out:
        return ""
    return ("<h2>By data source and thinking mode</h2><p>Held-out simulated τ at the learning curve's last point; "
            "eval τ of the drafter at the best block size and of prompt lookup at its best, over each source's "
            "prompts. A source's mode comes from its chat-template variables (data.sources[].chat_template_kwargs "
            "over tokenize.chat_template_kwargs): thinking, no-thinking or default.</p>" + "\n".join(out))


def hybrid_html(results: dict) -> str:
    """The hybrid row beside the drafter and prompt lookup (`summary.hybrid`, `hybrid_composite`): each source's
    chosen decoder and gate, the paired intervals overall and per source, and τ / speedup of every grid point
    (the suffix proposer alone and the hybrid at each gate)."""
    hy = (results.get("summary") or {}).get("hybrid")
    if not hy:
        return ""
    out = ["<h2>Hybrid: drafter + suffix matching</h2><p>The suffix proposer matches the longest suffix of the "
           "output against the prompt and the output so far; the hybrid verifies its draft where the match is at "
           "least the gate's length and the drafter's block elsewhere (graft: the drafter's confident prefix "
           "continued by the match). Each prompt is decoded by the decoder fastest on the <i>other</i> prompts of "
           f"its source (leave-one-out). Hybrid τ {_fmt(hy['tau'])}, speedup {_fmt(hy['speedup'])}×"
           + (f" — {html.escape(flag_phrase(hy['unreliable']))}" if hy.get("unreliable") else "") + ".</p>"]
    said = [f"over the drafter's best: {html.escape(hy['versus_drafter']['phrase'])}" if hy.get("versus_drafter") else "",
            f"over prompt lookup's best: {html.escape(hy['versus_prompt_lookup']['phrase'])}"
            if hy.get("versus_prompt_lookup") else ""]
    if any(said):
        out.append("<p>Hybrid, paired prompt by prompt " + "; ".join(x for x in said if x) + ".</p>")
    rows = []
    for src, g in (hy.get("gates_by_source") or {}).items():
        c = ((results.get("by_source") or {}).get(src) or {}).get("hybrid_composite") or {}
        rows.append([src, g["decoder"], g["proposer"], _gate(g.get("gate")), _fmt(g.get("tokens_per_s"), 1),
                     ", ".join(g.get("leave_one_out") or []),
                     html.escape((c.get("versus_drafter") or {}).get("phrase", "-")),
                     html.escape((c.get("versus_prompt_lookup") or {}).get("phrase", "-"))])
    if rows:
        out.append(_table(["source", "decoder chosen", "proposer", "gate", "tok/s", "leave-one-out choices",
                           "over drafter", "over lookup"], rows))
    grid = [[f"suffix B={b}", _fmt(r["tau"]), _fmt(r["decode_tokens_per_s"], 1), _speedup(r), "-"]
            for b, r in (results.get("suffix") or {}).items()]
    grid += [[f"hybrid {k}", _fmt(r["tau"]), _fmt(r["decode_tokens_per_s"], 1), _speedup(r),
              ", ".join(f"{b} {_fmt(x)}" for b, x in (r.get("branches") or {}).items())]
             for k, r in (results.get("hybrid") or {}).items()]
    if grid:
        out.append(_table(["grid point (B@gate)", "τ", "tokens/s", "speedup", "share of steps by branch"], grid))
    return "\n".join(out)


def _gate(g: dict | None) -> str:
    if not g:
        return "-"
    return (f"match ≥ {g['min_match']}" + (", graft" if g.get("graft") else "")
            + (f", drafter block {g['drafter_block']}" if g.get("drafter_block") else "")
            + (", online drafter gate" if g.get("online_gate") else ""))


def engine_section_html(res: dict) -> str:
    """`verify-engine/results.json`: the exported drafter in vLLM vs our decoder (τ, per position, greedy)."""
    causes = "".join(f"<p>Likely cause: {html.escape(x)}</p>" for x in res.get("causes", []))
    if "tau" not in res:  # a V2-only family's export on vLLM's V1 runner: nothing was measured
        return (f"<h2>Engine ({html.escape(res['engine'])})</h2><p>The exported {html.escape(res['family'])} drafter "
                f"(B = {res['block_size']}): <b>FAILED</b> before anything was measured.</p>" + causes)
    c, t, pp = res["checks"], res["tau"], res["per_position_acceptance"]
    verdict = {True: "ok", False: "FAILED", None: "not checked"}
    head = (f"<h2>Engine ({html.escape(res['engine'])})</h2><p>The exported drafter served by vLLM with "
            f"num_speculative_tokens = {res['num_speculative_tokens']} (B = {res['block_size']}), {res['prompts']} "
            f"prompts, greedy, {res['dtype']}: <b>{'passed' if res['passed'] else 'FAILED'}</b>. Engine τ = 1 + "
            f"accepted / drafts from its Prometheus counters; {html.escape(c['tau']['rule'])}.</p>")
    rows = [["τ", _fmt(t["engine"]), _fmt(t["ours"]), verdict[c["tau"]["ok"]]]]
    rows += [[f"acceptance, position {k + 1}", _fmt(a), _fmt(b), ""]
             for k, (a, b) in enumerate(zip(pp["engine"], pp["ours"]))]
    rows += [["greedy = ours (no speculation)", "", "", verdict[c["greedy_engine_vs_ours"]["ok"]]],
             ["greedy with DFlash = without", "", "", verdict[c["greedy_spec_vs_ar"]["ok"]]],
             ["chat template = target's", "", "", verdict[c["template"]["ok"]]],
             ["speculation_profile.json = engine", "", "", verdict[(c.get("profile") or {}).get("ok")]]]
    return head + _table(["", "vLLM", "dflashkit", "check"], rows) + causes


def eval_diagnostics_html(results: dict) -> str:
    """Drafter vs prompt lookup, the bigram baseline, the no-feature ablation and the lossless verdict."""
    out = []
    spec, lookup, summ = results.get("speculative", {}), results.get("prompt_lookup") or {}, results.get("summary", {})
    if lookup:
        rows = []
        for b in sorted({*spec, *lookup}, key=int):
            d, p = spec.get(b, {}), lookup.get(b, {})
            rows.append([b, _fmt(d.get("tau", "-")), _speedup(d),
                         _fmt((d.get("per_position_acceptance") or ["-"])[0]), _fmt(p.get("tau", "-")),
                         _speedup(p), _fmt((p.get("per_position_acceptance") or ["-"])[0])])
        lk = summ.get("prompt_lookup") or {}
        beats = _lookup_verdict(summ, lk)
        out.append("<h2>Drafter vs prompt lookup</h2><p>Prompt lookup (n-gram, n = "
                   f"{results.get('prompt_lookup_ngram', 3)}…1) needs no training: it proposes the tokens that "
                   "followed the latest earlier occurrence of the last n tokens, verified by the same lossless "
                   f"decoder on the same prompts. Best drafter: B={summ.get('block_size')} τ {_fmt(summ.get('tau'))}, "
                   f"{_fmt(summ.get('speedup'))}×; best prompt lookup: B={lk.get('block_size')} τ {_fmt(lk.get('tau'))}, "
                   f"{_fmt(lk.get('speedup'))}×. {beats}"
                   + (f" (drafter over lookup, paired prompt by prompt: {html.escape(paired_text(vs, summ, lk))})"
                      if (vs := summ.get("versus_prompt_lookup")) else "") + ".</p>")
        out.append(_table(["block size", "drafter τ", "drafter speedup", "drafter position-1", "lookup τ",
                           "lookup speedup", "lookup position-1"], rows))
    diag = results.get("diagnostics") or {}
    if diag:
        sim, zero, big = diag.get("simulated") or {}, diag.get("no_features") or {}, diag.get("bigram")
        rows = []
        if "drafter_position1" in diag:
            rows.append(["drafter, measured (best block size)", _fmt(diag["drafter_position1"]), "-"])
        if sim:
            rows.append(["drafter, teacher-forced", _fmt(sim["per_position_accuracy"][0]), _fmt(sim["tau"])])
        if zero:
            rows.append(["drafter without target features (no context; teacher-forced)", _fmt(zero["per_position_accuracy"][0]),
                         _fmt(zero["tau"])])
        other = diag.get("other_context")
        if other:
            rows.append(["drafter with another prompt's target features (teacher-forced)",
                         _fmt(other["per_position_accuracy"][0]), _fmt(other["tau"])])
        if big:
            rows.append(["bigram table of the training answers", _fmt(big["accuracy"]), "-"])
        if "prompt_lookup_position1" in diag:
            rows.append(["prompt lookup, measured (best block size)", _fmt(diag["prompt_lookup_position1"]), "-"])
        out.append(f"<h2>Why is the drafter weak?</h2><p>On the baseline's outputs for the eval prompts. "
                   f"Teacher-forced = a block drafted at every output position at once (B={diag.get('block_size')}), "
                   "not a decode. A drafter whose numbers barely drop without the features, or with another "
                   "prompt's, does not use the target; one at or below the bigram table has learned little more "
                   "than token pairs. A drafter trained with the target's context collapses without it (it never "
                   "saw that case); what the context is worth is a drafter trained without it "
                   "(<code>bench recipe</code> variant no-features).</p>")
        out.append(_table(["", "position-1 acceptance", "simulated τ"], rows))
    ll = results.get("lossless")
    if ll:
        if ll["verdict"] == "exact":
            text = f"<b>exact</b>: all {ll['compared']} outputs equal the baseline token for token"
        elif ll["verdict"] == "ties-only":
            text = (f"<b>lossless, ties only</b>: {ll['ties']} of {ll['compared']} outputs diverge, each at a "
                    f"numerical tie (the baseline's top-1 logit exceeds its logit of the speculative token by ≤ "
                    f"{ll['tolerance']}; largest {ll['max_tie_gap']}, largest top-1 − top-2 margin "
                    f"{ll['max_tie_margin']})")
        else:
            text = (f"<b>NOT lossless</b>: {ll['divergences'] - ll['ties']} divergences beyond a tie (smallest "
                    f"gap {ll['min_non_tie_gap']}, tolerance {ll['tolerance']}) — a bug")
        out.append(f"<h2>Lossless check ({html.escape(str(ll.get('dtype')))})</h2><p>{text}.</p>")
        rows = [[r["proposer"], r["block_size"], r["id"], r["position"], _fmt(r["margin"], 4),
                 _fmt(r["gap"], 4) if r["gap"] is not None else "outside top-k"]
                for r in ll.get("first_divergences", [])[:20]]
        if rows:
            out.append(_table(["proposer", "block size", "prompt", "position", "baseline top-1 − top-2",
                               "baseline top-1 − speculative token"], rows))
    if results.get("dtype_reason"):  # why eval verified in this dtype (eval.dtype, the CPU's flags)
        out.append(f"<p>Verify dtype: {html.escape(str(results['dtype_reason']))}.</p>")
    choice = results.get("dtype_choice")
    if choice:
        out.append(f"<p>eval.dtype=auto chose <b>{html.escape(choice['chosen'])}</b> ({html.escape(choice['rule'])}):</p>")
        out.append(_table(["dtype", "baseline tok/s", "best block size", "speedup", "tok/s"],
                          [[k, _fmt(c["baseline_tokens_per_s"], 1), c["best_block_size"], _fmt(c["speedup"]),
                            _fmt(c["tokens_per_s"], 1)] for k, c in choice["calibration"].items()]))
    return "\n".join(out)


def figure_html(title: str, png: bytes) -> str:
    """One plot as an <img> with the PNG inline (a base64 data URI): the page needs no other file."""
    return f"<img alt='{html.escape(title)}' src='data:image/png;base64,{base64.b64encode(png).decode()}'>"
