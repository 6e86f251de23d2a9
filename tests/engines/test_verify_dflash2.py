"""verify-engine never passes a DFlash2 or LiLiCorr export on a vLLM runner without the candidate walk (no engine
needed: the engine start is replaced by one that writes vLLM 0.32's own log lines), and names the family."""

from __future__ import annotations

import json
from contextlib import contextmanager

import pytest

from dflashkit.cli import main
from dflashkit.config import TargetSection
from dflashkit.engines import vllm
from dflashkit.engines.verify import v2_runner
from dflashkit.errors import ServerError
from dflashkit.export.hf import save_drafter
from dflashkit.target.load import load_target
from dflashkit.testing import random_drafter
from tests.helpers import dflash2_drafter

# what vLLM 0.32's CPU build logs (config/vllm.py), and its V2 worker line
REFUSED = ("  Value error, Model Runner V1 does not support: DFlash candidate-head drafts [type=value_error, "
           "input_value=ArgsKwargs((), {'model_co... 'shutdown_timeout': 0}), input_type=ArgsKwargs]")
FALLBACK = "WARNING 12-01 10:38:49 [vllm.py:726] Model Runner V2 requires Triton; using the V1 model runner instead."
V2 = "INFO 12-01 10:38:49 [gpu_worker.py:518] Using V2 Model Runner"


@pytest.mark.parametrize("log,ok,runner,evidence", [
    (f"start\n{REFUSED}\n", False, "v1", "DFlash candidate-head drafts"),
    (f"{FALLBACK}\nserving\n", False, "v1", "using the V1 model runner"),
    ("INFO started\nINFO serving\n", False, "unknown", None),
    (f"{V2}\nserving\n", True, "v2", "Using V2 Model Runner"),
    (f"{V2}\n{FALLBACK}\n", False, "v1", "using the V1 model runner"),
])
def test_v2_runner_reads_the_engine_log(log, ok, runner, evidence):
    got = v2_runner(log)
    assert got["ok"] is ok and got["runner"] == runner
    assert (got["evidence"] is None) if evidence is None else (evidence in got["evidence"])


LILICORR = dict(drafter_type="lilicorr", lilicorr_candidate_topk=4, lilicorr_num_heads=4, lilicorr_factor_dim=8)


@pytest.mark.parametrize("drafter_type,title", [("dflash2", "DFlash2"), ("lilicorr", "LiLiCorr")])
def test_verify_engine_fails_a_v2_only_export_on_the_v1_runner_naming_its_family(
        tmp_path, tiny_qwen3, monkeypatch, capsys, drafter_type, title):
    """One engine start (the draft's, first), nothing measured, a failure that names the export's family: in the
    results, the likely cause and the table the stage prints."""
    from dflashkit.engines import launch

    target = load_target(TargetSection(path=str(tiny_qwen3), device="cpu", dtype="float32"))
    export = tmp_path / "export"
    drafter = (dflash2_drafter(target) if drafter_type == "dflash2"
               else random_drafter(target, block_size=4, layers=2, **LILICORR))
    save_drafter(drafter, export, dtype="float32")
    starts = []

    @contextmanager
    def refusing_vllm(cfg, *, log_path, speculative=None, served_name=None, what=None):
        starts.append(speculative)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text(f"{FALLBACK}\nTraceback (most recent call last):\n{REFUSED}\n")
        raise ServerError("vLLM exited with code 1 before it was ready")
        yield  # pragma: no cover

    monkeypatch.setattr(launch, "start_vllm_for_target", refusing_vllm)
    monkeypatch.setenv(vllm.AUTO_INSTALL_ENV, "1")  # the stage's check passes without an install: none starts
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello"}) + "\n")
    rd = tmp_path / "run"
    code = main(["verify-engine", str(export), f"target.path={tiny_qwen3}", f"eval.prompts={prompts}",
                 "--run-dir", str(rd)])
    err = capsys.readouterr().err
    assert code == 1, err[-3000:]
    res = json.loads((rd / "verify-engine" / "results.json").read_text())
    assert res["passed"] is False and res["drafter_type"] == drafter_type and res["family"] == title
    check = res["checks"]["v2_runner"]
    assert check["ok"] is False and check["runner"] == "v1" and check["engine_started"] is False
    assert "V2 model runner" in res["causes"][0] and "does not support" in res["causes"][0]
    assert f"a {title} drafter" in res["causes"][0]
    table = next(x for x in err.splitlines() if x.startswith("verify-engine ("))
    assert f", {title}, B=4): FAILED" in table, err[-3000:]
    other = {"DFlash2", "LiLiCorr"} - {title}
    assert not any(o in err for o in other), err[-3000:]  # no other family's name anywhere
    # one engine start only (the draft's, first): no non-speculative run, nothing measured
    assert len(starts) == 1 and starts[0]["method"] == "dflash" and starts[0]["num_speculative_tokens"] == 3
    assert "tau" not in res and not (rd / "verify-engine" / "engine-ar.json").exists()
