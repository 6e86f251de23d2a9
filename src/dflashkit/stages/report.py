"""`dflashkit report`: one self-contained HTML page (plus the PNGs) summarising a run directory.

Inputs:  whatever exists of `train/metrics.jsonl`, `train/curve.json`, `train/best/best.json`,
         `eval/results.json`, `bench/decode.json`,
         `bench/serve.json`, `config.resolved.yaml`, `contract.json` and the stage manifests.
Outputs: `report/index.html` (inline CSS, plots embedded as base64 PNG data URIs, drawn by
         matplotlib), `report/*.png`, manifest.
Example: dflashkit report -c run.yaml   (then open runs/x/report/index.html)

Plots: training loss and simulated τ per step (train and held-out), per-position acceptance and
the τ histogram from eval, speedup vs concurrency from `bench serve`, and the learning curve
(held-out τ and position-1 accuracy against supervised tokens seen, per data source, beside train τ:
the train-vs-held-out gap; `curve_section`). Tables: eval numbers with the bound τ·t(1)/t(B)
beside the measured speedup; the drafter vs the prompt-lookup proposer (τ, speedup, position-1
acceptance), the bigram baseline and the no-feature ablation, the lossless verdict (exact / ties
only, with the count and the largest tie margin; `eval.dtype=auto`'s choice); the decode bench,
the contract, provenance (per-stage manifests: time, counts, versions) and the resolved config.
"""

from __future__ import annotations

import base64
import html
import io
import json
import logging
import time
from pathlib import Path
from typing import Any

from dflashkit.config import RunConfig
from dflashkit.context import StageContext
from dflashkit.errors import MissingArtifactError
from dflashkit.rundir import RunDir, STAGES, atomic_write_bytes, atomic_write_text, write_manifest

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
COLORS = ["#1f5fbf", "#d9480f", "#2b8a3e", "#862e9c", "#e67700", "#0b7285"]


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except json.JSONDecodeError:
        log.warning("%s is not valid JSON; skipped", path)
        return None


# -- plots: (name, title, xlabel, ylabel, kind, [(label, xs, ys)]) --------------------------------
def _png(spec: tuple) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    name, title, xlabel, ylabel, kind, series = spec
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    width = 0.8 / max(1, len(series))
    for i, (label, xs, ys) in enumerate(series):
        if kind == "bar":
            ax.bar([x + (i - (len(series) - 1) / 2) * width for x in xs], ys, width=width, label=label,
                   color=COLORS[i % len(COLORS)])
        else:
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, ms=3, label=label, color=COLORS[i % len(COLORS)])
    if name == "acceptance":
        ax.set_ylim(0, 1.05)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if len(series) > 1 or series[0][0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def plot_specs(metrics: list[dict], results: dict | None, serve: dict | None) -> list[tuple]:
    specs = []
    train = [m for m in metrics if m.get("split") != "heldout" and "loss" in m]
    held = [m for m in metrics if m.get("split") == "heldout"]
    for key, title, ylabel in (("loss", "Training loss", "loss"), ("tau", "Simulated τ (training)", "τ")):
        series = [(lbl, [m["step"] for m in rows if key in m], [m[key] for m in rows if key in m])
                  for lbl, rows in (("train", train), ("held-out", held)) if any(key in m for m in rows)]
        if series:
            specs.append((f"train_{key}", title, "step", ylabel, "line", series))
    spec_res = (results or {}).get("speculative", {})
    if spec_res:
        specs.append(("acceptance", "Per-position acceptance (eval)", "draft position", "acceptance rate", "bar",
                      [(f"B={b}", list(range(1, len(r["per_position_acceptance"]) + 1)), r["per_position_acceptance"])
                       for b, r in spec_res.items()]))
        specs.append(("tau_histogram", "τ histogram (eval)", "τ (tokens per verify step)", "steps", "bar",
                      [(f"B={b}", list(range(1, len(r["tau_histogram"]) + 1)), r["tau_histogram"])
                       for b, r in spec_res.items()]))
    if serve and serve.get("speedup"):
        pts = [s for s in serve["speedup"] if s.get("output_tokens_per_s") is not None]
        specs.append(("serve_speedup", "Speedup vs concurrency (bench serve)", "concurrency", "speedup", "line",
                      [("tokens/s ratio", [s["concurrency"] for s in pts], [s["output_tokens_per_s"] for s in pts])]))
    elif serve and serve.get("endpoints"):
        specs.append(("serve_throughput", "Throughput vs concurrency (bench serve)", "concurrency", "tokens/s", "line",
                      [(e["url"], [r["concurrency"] for r in e["sweep"]], [r["output_tokens_per_s"] for r in e["sweep"]])
                       for e in serve["endpoints"]]))
    return specs


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
    from dflashkit.train.forecast import forecast_from_curve

    fc = forecast_from_curve(curve or {}, target_tau)
    text += (f"<p><b>Data-budget forecast</b> (τ∞ − a·n<sup>−b</sup> fitted to the held-out curve; "
             f"train/forecast.py): {html.escape(fc.text())}</p>")
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
        rows += [[b, _fmt(r["tau"]), _fmt(r["decode_tokens_per_s"], 1), _fmt(r["speedup"]), _fmt(r["bound"]),
                  _fmt(r["speedup_e2e"]), _fmt(r["ttft_s"] * 1e3, 1), r.get("identical_to_baseline", "-")]
                 for b, r in spec_res.items()]
        out.append(f"<h2>Evaluation</h2><p>{results['prompts']} prompts, max_new_tokens {results['max_new_tokens']}, "
                   f"temperature {results['temperature']}, device {html.escape(str(results.get('device')))}. "
                   "Speedup = baseline decode time per token / speculative; bound = τ·t(1)/t(B).</p>")
        out.append(_table(["block size", "τ", "tokens/s", "speedup", "bound", "end-to-end", "TTFT ms",
                           "identical to baseline"], rows))
    if results:
        out.append(eval_diagnostics_html(results))
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
    contract = _read_json(rd.contract_path)
    if contract:
        keys = ("block_size", "num_draft_layers", "target_layer_ids", "mask_token_id", "num_target_layers",
                "hidden_size", "vocab_size", "target_model_type")
        out.append("<h2>Drafter contract</h2>" + _table(["key", "value"], [[k, contract.get(k)] for k in keys]))
    prov = []
    versions = {}
    for stage in (*STAGES, "verify-engine", "import", "bench"):
        m = rd.manifest(stage)
        if m:
            versions = m.get("versions") or versions
            prov.append([stage, m.get("finished_at", ""), m.get("wall_time_s", ""),
                         ", ".join(f"{k}={v}" for k, v in (m.get("counts") or {}).items())])
    if prov:
        out.append("<h2>Provenance</h2>" + _table(["stage", "finished", "wall s", "counts"], prov))
    if versions:
        out.append("<p class='muted'>" + html.escape(", ".join(f"{k} {v}" for k, v in versions.items())) + "</p>")
    if rd.resolved_config_path.is_file():
        out.append("<h2>Config</h2><pre>" + html.escape(rd.resolved_config_path.read_text()) + "</pre>")
    out.append("</body></html>")
    return "\n".join(out)


def engine_section_html(res: dict) -> str:
    """`verify-engine/results.json`: the exported drafter in vLLM vs our decoder (τ, per position, greedy)."""
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
             ["chat template = target's", "", "", verdict[c["template"]["ok"]]]]
    causes = "".join(f"<p>Likely cause: {html.escape(x)}</p>" for x in res.get("causes", []))
    return head + _table(["", "vLLM", "dflashkit", "check"], rows) + causes


def eval_diagnostics_html(results: dict) -> str:
    """Drafter vs prompt lookup, the bigram baseline, the no-feature ablation and the lossless verdict."""
    out = []
    spec, lookup, summ = results.get("speculative", {}), results.get("prompt_lookup") or {}, results.get("summary", {})
    if lookup:
        rows = []
        for b in sorted({*spec, *lookup}, key=int):
            d, p = spec.get(b, {}), lookup.get(b, {})
            rows.append([b, _fmt(d.get("tau", "-")), _fmt(d.get("speedup", "-")),
                         _fmt((d.get("per_position_acceptance") or ["-"])[0]), _fmt(p.get("tau", "-")),
                         _fmt(p.get("speedup", "-")), _fmt((p.get("per_position_acceptance") or ["-"])[0])])
        lk = summ.get("prompt_lookup") or {}
        beats = "beats" if summ.get("beats_prompt_lookup") else "does <b>not</b> beat"
        out.append("<h2>Drafter vs prompt lookup</h2><p>Prompt lookup (n-gram, n = "
                   f"{results.get('prompt_lookup_ngram', 3)}…1) needs no training: it proposes the tokens that "
                   "followed the latest earlier occurrence of the last n tokens, verified by the same lossless "
                   f"decoder on the same prompts. Best drafter: B={summ.get('block_size')} τ {_fmt(summ.get('tau'))}, "
                   f"{_fmt(summ.get('speedup'))}×; best prompt lookup: B={lk.get('block_size')} τ {_fmt(lk.get('tau'))}, "
                   f"{_fmt(lk.get('speedup'))}×. The drafter {beats} it.</p>")
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
        if big:
            rows.append(["bigram table of the training answers", _fmt(big["accuracy"]), "-"])
        if "prompt_lookup_position1" in diag:
            rows.append(["prompt lookup, measured (best block size)", _fmt(diag["prompt_lookup_position1"]), "-"])
        out.append(f"<h2>Why is the drafter weak?</h2><p>On the baseline's outputs for the eval prompts. "
                   f"Teacher-forced = a block drafted at every output position at once (B={diag.get('block_size')}), "
                   "not a decode. A drafter whose numbers barely drop without the features does not use the "
                   "target; one at or below the bigram table has learned little more than token pairs.</p>")
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
    choice = results.get("dtype_choice")
    if choice:
        out.append(f"<p>eval.dtype=auto chose <b>{html.escape(choice['chosen'])}</b> ({html.escape(choice['rule'])}):</p>")
        out.append(_table(["dtype", "baseline tok/s", "best block size", "speedup", "tok/s"],
                          [[k, _fmt(c["baseline_tokens_per_s"], 1), c["best_block_size"], _fmt(c["speedup"]),
                            _fmt(c["tokens_per_s"], 1)] for k, c in choice["calibration"].items()]))
    return "\n".join(out)


def run(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict[str, Any]:
    t0 = time.time()
    metrics = _read_jsonl(rd.train_metrics)
    results = _read_json(rd.eval_results)
    serve = _read_json(rd.bench_result("serve"))
    bench = _read_json(rd.bench_result("decode"))
    curve = _read_json(rd.train_curve)
    best = _read_json(rd.best_dir / "best.json")
    if not metrics and not results and not serve and not bench and not curve:
        raise MissingArtifactError("training metrics or eval results", rd.train_metrics,
                                   run="dflashkit train -c run.yaml (and dflashkit eval)")
    specs = plot_specs(metrics, results, serve)
    curve_specs, curve_html = curve_section(curve, best, cfg.train.forecast_tau)
    specs += curve_specs
    if ctx.dry_run:
        return {"dry_run": True, "plots": [s[0] for s in specs]}
    out = rd.stage_dir("report")
    figures, files = [], []
    for spec in specs:
        png = _png(spec)
        atomic_write_bytes(out / f"{spec[0]}.png", png)
        files.append(f"{spec[0]}.png")
        figures.append(f"<img alt='{html.escape(spec[1])}' src='data:image/png;base64,"
                       f"{base64.b64encode(png).decode()}'>")
    page = render_html(rd, cfg.run.name, figures, results, bench, metrics, curve_html,
                       engine=_read_json(rd.verify_engine_results))
    atomic_write_text(out / "index.html", page)
    write_manifest(out, stage="report", config_hash="", started=t0, outputs=["index.html", *files],
                   counts={"plots": len(specs)})
    log.info("report: %s (%d plots)", out / "index.html", len(specs))
    return {"html": str(out / "index.html"), "plots": [s[0] for s in specs], "png": files}
