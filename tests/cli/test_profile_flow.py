"""`speculation_profile.json` through the commands: eval writes it, export ships it beside the weights (both formats)
only when it was measured on them, import reads it (a broken one is exit 2), verify-engine adds the engine's
figures and fails when they disagree (the engine is a stand-in here; `make test-engine` runs vLLM)."""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
from types import SimpleNamespace

import pytest

from dflashkit.cli import main
from dflashkit.config import TargetSection
from dflashkit.export.hf import save_drafter
from dflashkit.export.profile import Measurement, build_profile, read_profile, weights_digest, write_profile
from dflashkit.target.load import load_target
from dflashkit.testing import random_drafter
from tests.helpers import run_dir_with_drafter

PROFILE = "speculation_profile.json"


@pytest.fixture(scope="module")
def target(tiny_qwen3):
    return load_target(TargetSection(path=str(tiny_qwen3), device="cpu", dtype="float32"))


def _json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _eval(rd, tiny_qwen3, *extra):
    assert main(["eval", f"target.path={tiny_qwen3}", "eval.max_new_tokens=10", "eval.num_prompts=3",
                 "eval.warmup=0", "--run-dir", str(rd), "--json", *extra]) == 0


def test_eval_writes_a_profile_that_agrees_with_its_results(tmp_path, target, tiny_qwen3, capsys):
    rd = run_dir_with_drafter(tmp_path, target)  # B = 4, 3 held-out prompts of source "t"
    _eval(rd, tiny_qwen3, "eval.block_sizes=[2,4]")
    out = _json(capsys)
    p = read_profile(rd / "eval" / PROFILE)
    res = json.loads((rd / "eval" / "results.json").read_text())
    assert p["schema_version"] == "1.0" and p["measured"] is True and p["measured_at"].endswith("Z")
    assert p["method"] == "dflash" and p["verification_method"] == "longest_prefix"
    assert p["accept_length_model"] == "measured_per_k"
    assert p["num_speculative_tokens"] == 3 and p["block_size"] == 4 and p["max_supported_k"] == 3  # the drafter's B
    assert set(p["accept_length_by_k"]) == {"1", "3"} and p["validation"]["mean_consistency"]["passed"]
    steps = p["measurement_conditions"]["steps"]
    assert steps["counted"] + steps["cut"] == res["speculative"]["4"]["steps"]
    assert steps["mean_accept_length_all_steps"] == pytest.approx(res["speculative"]["4"]["tau"], abs=1e-4)
    assert p["draft_checkpoint"]["weights_sha256"] == weights_digest(rd / "train" / "final")
    assert p["draft_checkpoint"]["kind"] == "final" and p["target_model"]["id"].endswith("qwen3")
    mc = p["measurement_conditions"]
    assert mc["prompts"]["count"] == 3 and len(mc["prompts"]["sha256"]) == 64 and mc["prompts"]["sources"] == ["t"]
    assert mc["max_new_tokens"] == 10 and mc["temperature"] == 0.0 and mc["target_dtype"] == "float32"
    assert {"draft_dtype", "device", "device_name", "threads"} <= set(mc) and mc["dflashkit"]["version"]
    assert set(p["per_category"]) == {"t"}
    assert res["speculation_profile"]["mean_accept_length"] == p["mean_accept_length"]
    assert out["speculation_profile"]["path"] == str(rd / "eval" / PROFILE)
    assert PROFILE in json.loads((rd / "eval" / "manifest.json").read_text())["outputs"]
    _eval(rd, tiny_qwen3, "eval.block_sizes=[2]")  # the drafter's B not measured: eval's first is the headline
    assert read_profile(rd / "eval" / PROFILE)["num_speculative_tokens"] == 1
    _eval(rd, tiny_qwen3, "eval.block_sizes=[8,2]")  # past the drafter's B: measured, left out of the profile
    p = read_profile(rd / "eval" / PROFILE)
    assert p["num_speculative_tokens"] == 1 and set(p["accept_length_by_k"]) == {"1"}
    assert "8" in json.loads((rd / "eval" / "results.json").read_text())["speculative"]


def test_export_ships_the_profile_of_its_weights_in_both_formats_and_import_reads_it(tmp_path, target, tiny_qwen3,
                                                                                      capsys, caplog):
    rd = run_dir_with_drafter(tmp_path, target)
    assert main(["export", f"target.path={tiny_qwen3}", "--run-dir", str(rd), "--json"]) == 0  # before eval
    assert _json(capsys)["speculation_profile"]["shipped"] is False and not (rd / "export" / PROFILE).exists()
    assert "run `dflashkit eval`" in capsys.readouterr().err + caplog.text
    _eval(rd, tiny_qwen3)
    measured = read_profile(rd / "eval" / PROFILE)
    spec = tmp_path / "spec-export"
    for fmt, out in (("zlab", rd / "export"), ("speculators", spec)):
        assert main(["export", f"target.path={tiny_qwen3}", f"export.format={fmt}", "export.dtype=bfloat16",
                     f"export.out_dir={out}", "--run-dir", str(rd), "--json"]) == 0
        info = _json(capsys)["speculation_profile"]
        assert info["shipped"] is True and info["from"] == str(rd / "eval" / PROFILE)
        shipped = read_profile(out / PROFILE)
        assert shipped["draft_checkpoint"]["export"] == {"format": fmt, "dtype": "bfloat16",
                                                         "weights_sha256": weights_digest(out)}
        assert {k: v for k, v in shipped.items() if k != "draft_checkpoint"} == \
            {k: v for k, v in measured.items() if k != "draft_checkpoint"}
        assert PROFILE in json.loads((out / "manifest.json").read_text())["outputs"]
    # import of either export: validated, headline reported, measured on these weights
    for i, src in enumerate((rd / "export", spec)):
        assert main(["import", str(src), f"target.path={tiny_qwen3}", "--run-dir", str(tmp_path / f"new{i}"),
                     "--json"]) == 0
        got = _json(capsys)["speculation_profile"]
        assert got["matches_weights"] is True and got["mean_accept_length"] == measured["mean_accept_length"]
    # a broken profile beside a drafter: exit 2 naming the file and the field, nothing imported
    broken = json.loads((spec / PROFILE).read_text())
    broken["marginal_accept_rates"][0] = 1.5
    (spec / PROFILE).write_text(json.dumps(broken))
    assert main(["import", str(spec), f"target.path={tiny_qwen3}", "--run-dir", str(tmp_path / "new9"),
                 "--json"]) == 2
    err = _json(capsys)["error"]
    assert str(spec / PROFILE) in err and "`marginal_accept_rates[0]`" in err
    assert not (tmp_path / "new9" / "train" / "final").exists()
    (spec / PROFILE).unlink()  # none is fine
    assert main(["import", str(spec), f"target.path={tiny_qwen3}", "--run-dir", str(tmp_path / "new9"), "--json"]) == 0
    assert _json(capsys)["speculation_profile"] is None


def test_export_never_ships_a_profile_measured_on_another_drafter(tmp_path, target, tiny_qwen3, capsys):
    rd = run_dir_with_drafter(tmp_path, target)
    _eval(rd, tiny_qwen3)
    assert main(["export", f"target.path={tiny_qwen3}", "--run-dir", str(rd), "--json"]) == 0
    assert (rd / "export" / PROFILE).is_file()
    save_drafter(random_drafter(target, block_size=4, seed=1), rd / "train" / "final", dtype="float32")  # retrained
    assert main(["export", f"target.path={tiny_qwen3}", "--run-dir", str(rd), "--json"]) == 0
    info = _json(capsys)["speculation_profile"]
    assert info["shipped"] is False and "measured on other weights" in info["skipped"][0]
    assert not (rd / "export" / PROFILE).exists()  # the old export (and its profile) is replaced


# ---- verify-engine, with a stand-in for vLLM: greedy = our target's, acceptance counters given by the test ----

def _fake_engine(monkeypatch, target, per_position: list[float], drafts: int):
    from dflashkit.decode.spec_decode import SpecDecoder
    from dflashkit.decode.api import SamplingParams
    from dflashkit.engines import launch, verify, vllm

    @contextmanager
    def start(cfg, *, log_path, speculative=None, served_name=None, what=None):
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text("INFO serving\n")
        yield SimpleNamespace(base_url="http://127.0.0.1:1/v1", startup_s=0.0)

    def complete(base_url, prompts, *, max_tokens, stop, model="target"):
        base = SpecDecoder(target, None, 1)
        return [base.generate(p, SamplingParams(max_new_tokens=max_tokens, stop_token_ids=stop)).token_ids
                for p in prompts], 1.0

    calls = iter([vllm.SpecCounters(), vllm.SpecCounters(drafts, drafts * len(per_position),
                                                         sum(per_position) * drafts,
                                                         tuple(x * drafts for x in per_position))])
    monkeypatch.setattr(launch, "start_vllm_for_target", start)
    monkeypatch.setenv(vllm.AUTO_INSTALL_ENV, "1")  # the stage's check passes without an install: none starts
    monkeypatch.setattr(verify, "engine_complete", complete)
    monkeypatch.setattr(verify, "engine_chat_prompt_ids", lambda *a, **k: None)
    monkeypatch.setattr(vllm, "metrics", lambda *a, **k: next(calls))


def _verify(rd, tiny_qwen3, *dir_):
    return main(["verify-engine", *map(str, dir_), f"target.path={tiny_qwen3}", "eval.max_new_tokens=10",
                 "eval.num_prompts=3", "--run-dir", str(rd), "--json"])


def test_verify_engine_adds_the_engines_figures_to_the_profile_and_passes_when_they_agree(tmp_path, target,
                                                                                           tiny_qwen3, monkeypatch,
                                                                                           capsys):
    rd = run_dir_with_drafter(tmp_path, target)
    _eval(rd, tiny_qwen3, "eval.draft_dtype=target")
    assert main(["export", f"target.path={tiny_qwen3}", "export.dtype=float32", "--run-dir", str(rd), "--json"]) == 0
    p = read_profile(rd / "export" / PROFILE)
    steps = p["measurement_conditions"]["steps"]["counted"]
    _fake_engine(monkeypatch, target, p["marginal_accept_rates"], steps)  # the engine accepts what eval measured
    assert _verify(rd, tiny_qwen3) == 0, capsys.readouterr().err[-3000:]
    res = json.loads((rd / "verify-engine" / "results.json").read_text())
    assert res["checks"]["profile"]["ok"] is True and res["checks"]["profile"]["same_prompts"] is True
    (entry,) = read_profile(rd / "export" / PROFILE)["engines"]  # written into the export's own profile
    assert entry["engine"] == "vllm-cpu" and entry["passed"] is True and entry["format"] == "zlab"
    assert entry["marginal_accept_rates"] == pytest.approx(p["marginal_accept_rates"], abs=1e-6)
    assert entry["mean_accept_length"] == pytest.approx(p["mean_accept_length"], abs=1e-6)
    assert entry["tolerance"]["mean"] == "|engine - profile| <= 0.15 * profile"
    assert entry["verify_steps"] == steps


def test_verify_engine_fails_when_the_shipped_profile_overstates_the_engine(tmp_path, target, tiny_qwen3,
                                                                             monkeypatch, capsys):
    rd = run_dir_with_drafter(tmp_path, target)
    _eval(rd, tiny_qwen3, "eval.draft_dtype=target")
    assert main(["export", f"target.path={tiny_qwen3}", "export.dtype=float32", "--run-dir", str(rd), "--json"]) == 0
    user = tmp_path / "mine"  # a copy that is not an export of ours: its file is left alone
    shutil.copytree(rd / "export", user)
    (user / "manifest.json").unlink()
    real = read_profile(user / PROFILE)
    steps = real["measurement_conditions"]["steps"]["counted"]
    rosy = build_profile([Measurement(4, [[4] * steps], [[False] * steps])], headline=4, method="dflash",
                         draft_checkpoint=real["draft_checkpoint"], target_model=real["target_model"], block_size=4,
                         max_supported_k=3, conditions={k: v for k, v in real["measurement_conditions"].items()
                                                        if k != "steps"})
    write_profile(user / PROFILE, rosy)  # self-consistent, but τ 4.0: not what the drafter does
    before = (user / PROFILE).read_bytes()
    _fake_engine(monkeypatch, target, real["marginal_accept_rates"], steps)
    assert _verify(rd, tiny_qwen3, user) == 1
    res = json.loads((rd / "verify-engine" / "results.json").read_text())
    check = res["checks"]["profile"]
    assert check["ok"] is False and check["mean"]["ok"] is False and check["per_position"]["ok"] is False
    assert res["checks"]["tau"]["ok"] is True  # the engine agrees with our decoder; the profile is what is wrong
    assert any(c.startswith("profile: ") and "4.000" in c for c in res["causes"])
    assert (user / PROFILE).read_bytes() == before
    (entry,) = read_profile(rd / "verify-engine" / PROFILE)["engines"]
    assert entry["passed"] is False and entry["comparison"]["mean"]["profile"] == 4.0
