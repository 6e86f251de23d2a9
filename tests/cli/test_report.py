"""`dflashkit report`: a self-contained page with the run's numbers, rendered in a real headless browser."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch

from dflashkit.cli import main
from dflashkit.config import TargetSection
from dflashkit.target.load import load_target

from tests.helpers import run_dir_with_drafter as _run_dir


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_qwen3):
    """A run dir with a real eval (tiny target, random drafter) and a training metrics log."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("report")
    target = load_target(TargetSection(path=str(tiny_qwen3), device="cpu", dtype="float32"))
    rd = _run_dir(tmp, target, block_size=4, prompts=2)
    assert main(["eval", f"target.path={tiny_qwen3}", "eval.max_new_tokens=8", "eval.warmup=0",
                 "eval.block_sizes=[2,4]", "--run-dir", str(rd), "--json"]) == 0
    torch.set_num_threads(n)
    lines = [{"step": s, "loss": 5.0 / (1 + s), "tau": 1 + s / 40, "lr": 1e-3} for s in range(0, 60, 5)]
    lines += [{"step": s, "split": "heldout", "loss": 6.0 / (1 + s), "tau": 1 + s / 50} for s in (20, 40, 60)]
    (rd / "train" / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (rd / "bench").mkdir()
    (rd / "bench" / "serve.json").write_text(json.dumps({"endpoints": [], "speedup": [
        {"concurrency": c, "output_tokens_per_s": v} for c, v in ((1, 2.1), (2, 1.8), (4, 1.4))]}))
    return rd


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def test_report_html_holds_the_numbers_and_plots(run_dir):
    assert main(["report", "--run-dir", str(run_dir), "--json"]) == 0
    page = (run_dir / "report" / "index.html").read_text()
    res = json.loads((run_dir / "eval" / "results.json").read_text())
    for b, r in res["speculative"].items():
        assert f"τ at B={b}<b>{r['tau']:.2f}</b>" in page
        assert f"{r['bound']:.2f}" in page and f"{r['decode_tokens_per_s']:.1f}" in page
    last = [json.loads(x) for x in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()
            if "split" not in json.loads(x)][-1]
    assert f"final loss<b>{last['loss']:.3f}</b>step {last['step']}" in page
    pngs = sorted(p.name for p in (run_dir / "report").glob("*.png"))
    assert pngs == ["acceptance.png", "serve_speedup.png", "tau_histogram.png", "train_loss.png", "train_tau.png"]
    assert page.count("data:image/png;base64,") == 5 and "<link" not in page and "<script" not in page


def test_report_without_inputs_is_exit_3(tmp_path):
    assert main(["report", "--run-dir", str(tmp_path / "empty"), "--json"]) == 3


@pytest.mark.serial  # chromium: several multi-threaded processes
def test_report_renders_in_a_headless_browser(run_dir, tmp_path):
    chromium = _chromium()
    if chromium is None:
        pytest.skip("no chromium: apt-get install -y chromium (could not find chromium/chromium-browser)")
    assert main(["report", "--run-dir", str(run_dir), "--json"]) == 0
    shot = tmp_path / "shot.png"
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1200,1600",
           f"--screenshot={shot}", (run_dir / "report" / "index.html").resolve().as_uri()]
    r = subprocess.run(cmd, timeout=120, capture_output=True, text=True,
                       env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-3000:]
    from PIL import Image

    img = Image.open(shot).convert("L")
    pixels = list(img.getdata())
    mean = sum(pixels) / len(pixels)
    var = sum((p - mean) ** 2 for p in pixels) / len(pixels)
    dark = sum(p < 128 for p in pixels) / len(pixels)
    assert img.size == (1200, 1600)
    assert var > 100 and 0.001 < dark < 0.5, f"blank-looking screenshot (variance {var:.1f}, dark share {dark:.4f})"


def test_report_plots_the_learning_curve_per_source_with_the_gap(tmp_path):
    rd = tmp_path / "run"
    (rd / "train" / "best").mkdir(parents=True)

    def point(step, tokens, tau, train_tau):
        return {"step": step, "tokens": tokens, "heldout": {"tau": tau, "acc1": tau - 1, "loss": 3 / step},
                "train": {"tau": train_tau, "acc1": train_tau - 1},
                "by_source": {"sharegpt": {"tokens": tokens // 4 * 3, "tau": tau + 0.05, "acc1": 0.2, "loss": 1.0},
                              "humaneval": {"tokens": tokens // 4, "tau": tau - 0.05, "acc1": 0.1, "loss": 2.0}}}

    pts = [point(10, 4000, 1.25, 1.30), point(20, 8000, 1.375, 1.5)]
    (rd / "train" / "curve.json").write_text(json.dumps({"sources": ["humaneval", "sharegpt"], "points": pts}))
    (rd / "train" / "best" / "best.json").write_text(json.dumps({"step": 20, "tau": 1.375}))
    assert main(["report", "--run-dir", str(rd), "--json"]) == 0
    page = (rd / "report" / "index.html").read_text()
    assert sorted(p.name for p in (rd / "report").glob("*.png")) == ["learning_curve.png", "learning_curve_acc1.png"]
    assert "Learning curve" in page and "8000" in page and "0.125" in page  # the gap 1.5 − 1.375 at step 20
    assert "step 20, held-out τ 1.375" in page and "1.425 (6000)" in page  # per source τ (tokens)
    # two points: the forecast says why it gives no number
    assert "Data-budget forecast" in page and "no number" in page and "at least 4" in page
    from dflashkit.report.page import curve_section

    specs, _ = curve_section(json.loads((rd / "train" / "curve.json").read_text()), None)
    labels = [lbl for lbl, _, _ in specs[0][5]]
    assert labels == ["held-out", "held-out humaneval", "held-out sharegpt", "train (same steps)"]
    assert specs[0][5][0][1] == [4000, 8000] and specs[0][5][3][2] == [1.30, 1.5]
    assert page.count("data:image/png;base64,") == 2


def test_report_shows_prompt_lookup_diagnostics_and_the_lossless_verdict(run_dir):
    res = json.loads((run_dir / "eval" / "results.json").read_text())
    assert main(["report", "--run-dir", str(run_dir), "--json"]) == 0
    page = (run_dir / "report" / "index.html").read_text()
    assert "<h2>Drafter vs prompt lookup</h2>" in page and "<h2>Why is the drafter weak?</h2>" in page
    lk = res["summary"]["prompt_lookup"]
    assert f"best prompt lookup: B={lk['block_size']} τ {lk['tau']:.2f}" in page
    for r in res["prompt_lookup"].values():
        assert f"<td>{r['tau']:.2f}</td>" in page
    assert f"<td>{res['diagnostics']['no_features']['tau']:.2f}</td>" in page
    assert "<h2>Lossless check (float32)</h2><p><b>exact</b>" in page
    assert res["dtype_reason"] and f"Verify dtype: {res['dtype_reason']}." in page
    # a bf16 run with ties only, and a broken one, read as such
    from dflashkit.report.page import eval_diagnostics_html

    tie = {"proposer": "drafter", "block_size": 4, "id": "p0", "position": 7, "margin": 0.0, "gap": 0.125}
    ll = {"verdict": "ties-only", "compared": 4, "divergences": 1, "ties": 1, "max_tie_gap": 0.125,
          "max_tie_margin": 0.0, "min_non_tie_gap": None, "tolerance": "4.00% of the baseline's largest |logit|", "dtype": "bfloat16",
          "first_divergences": [tie]}
    text = eval_diagnostics_html({**res, "lossless": ll})
    assert "lossless, ties only</b>: 1 of 4 outputs diverge" in text and "largest 0.125" in text
    assert "<td>0.1250</td>" in text
    bad = {**ll, "verdict": "not lossless", "ties": 0, "max_tie_gap": None, "min_non_tie_gap": 3.5}
    assert "NOT lossless</b>: 1 divergences beyond a tie (smallest gap 3.5" in eval_diagnostics_html(
        {**res, "lossless": bad})
