"""The report's plots: specs from the run's numbers, drawn to PNG by matplotlib (Agg).

Usage:
    specs = plot_specs(metrics, results, serve)       # [(name, title, xlabel, ylabel, kind, [(label, xs, ys)])]
    png = draw_png(specs[0])                            # bytes
"""

from __future__ import annotations

import io

COLORS = ["#1f5fbf", "#d9480f", "#2b8a3e", "#862e9c", "#e67700", "#0b7285"]


# -- plots: (name, title, xlabel, ylabel, kind, [(label, xs, ys)]) --------------------------------
def draw_png(spec: tuple) -> bytes:
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
