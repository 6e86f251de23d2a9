"""Native dtypes only (issue #42): bf16 where the device computes it natively, float32 where it is emulated.

The CPU's flags are what `target.load.cpu_facts` reads from /proc/cpuinfo; every test here replaces them
(an AVX2-only CPU, one with AVX512-BF16, one with AMX), so the results do not depend on the machine.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

import dflashkit.target.load as target_mod
from dflashkit.cli import main
from dflashkit.config import TargetSection
from dflashkit.config.loader import load_config
from dflashkit.decode.evaluation import verify_dtype, verify_target_config
from dflashkit.target.load import announce, compute_dtype, load_target
from tests.helpers import run_dir_with_drafter

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
DEMO = CONFIGS / "smollm2-135m.yaml"
CPU = torch.device("cpu")

AVX2 = {"cpu": "AMD EPYC 7B12 (AVX2 only)", "bf16": [], "fp16": []}
AVX512 = {"cpu": "AMD EPYC 9B14 (Zen 4)", "bf16": ["avx512_bf16"], "fp16": []}
AMX = {"cpu": "Intel Xeon (Sapphire Rapids)", "bf16": ["amx_bf16"], "fp16": ["avx512_fp16"]}
EMULATED = "no avx512_bf16 / amx_bf16"

# Configs that run on CUDA (their targets do not fit a CPU run): they may pin bf16 compute dtypes.
GPU_CONFIGS = {
    "qwen3-8b.yaml": "an 8B target trained on CUDA (docs/gpu.md)",
    "kimi-k2.6.yaml": "a 1T-parameter MoE target on GPUs (docs/kimi-k2.6.md)",
}
COMPUTE_KEYS = ("target.dtype", "train.dtype", "train.target_dtype", "eval.dtype", "eval.draft_dtype")


@pytest.fixture(autouse=True)
def _fresh_announcements(monkeypatch):
    """Each test sees every choice announced afresh (they are logged once per process), and dflashkit's log
    records reach caplog even after `cli.main` stopped them propagating."""
    monkeypatch.setattr(target_mod, "_ANNOUNCED", set())
    monkeypatch.setattr(logging.getLogger("dflashkit"), "propagate", True)


def _flags(monkeypatch, facts: dict) -> None:
    monkeypatch.setattr(target_mod, "cpu_facts", lambda: dict(facts))


@pytest.mark.parametrize("facts, dtype, reason", [
    (AVX2, torch.float32, f"float32: bf16 is emulated on this CPU ({EMULATED})"),
    (AVX512, torch.bfloat16, "bfloat16: native on this CPU (avx512_bf16)"),
    (AMX, torch.bfloat16, "bfloat16: native on this CPU (amx_bf16)"),
], ids=["avx2", "avx512_bf16", "amx"])
def test_native_is_bf16_only_where_the_cpu_computes_it(monkeypatch, facts, dtype, reason):
    _flags(monkeypatch, facts)
    for key in ("eval.dtype", "target.dtype", "train.dtype"):
        c = compute_dtype("native", CPU, key=key)
        assert (c.dtype, c.reason, c.warning) == (dtype, reason, None)
    # train.target_dtype's auto is the same rule (the capture forward's autocast)
    assert target_mod.target_autocast("auto", CPU, torch.float32) == (None if dtype == torch.float32 else dtype)
    c = compute_dtype("native", torch.device("cuda"), key="eval.dtype")  # a device object only: no GPU needed
    assert (c.dtype, c.reason) == (torch.bfloat16, "bfloat16: CUDA")


def test_native_choice_is_logged_once_with_its_reason(monkeypatch, caplog):
    _flags(monkeypatch, AVX2)
    caplog.set_level(logging.INFO, logger="dflashkit.target")
    for _ in range(3):
        announce(compute_dtype("native", CPU, key="eval.dtype"))
    lines = [r.getMessage() for r in caplog.records if r.name == "dflashkit.target"]
    assert lines == [f"eval.dtype=native → float32: bf16 is emulated on this CPU ({EMULATED})"]


@pytest.mark.parametrize("facts, verify", [(AVX2, "float32"), (AVX512, "bfloat16"), (AMX, "bfloat16")],
                         ids=["avx2", "avx512_bf16", "amx"])
def test_the_demo_config_verifies_in_float32_where_bf16_is_emulated(monkeypatch, facts, verify):
    _flags(monkeypatch, facts)
    cfg = load_config(DEMO, ["target.device=cpu"])
    assert cfg.eval.dtype == "native"
    c = verify_dtype(cfg)
    assert c.key == "eval.dtype" and c.name == verify and c.warning is None
    assert verify_target_config(cfg).dtype == verify
    # the target it loads for capture, training and serving stays float32 either way
    assert compute_dtype(cfg.target.dtype, CPU, key="target.dtype").dtype == torch.float32


def test_an_explicit_bf16_on_an_emulating_cpu_is_kept_with_a_warning_naming_the_key(monkeypatch, caplog,
                                                                                    tiny_qwen3):
    _flags(monkeypatch, AVX2)
    caplog.set_level(logging.INFO, logger="dflashkit")
    c = announce(compute_dtype("bfloat16", CPU, key="eval.dtype"))
    assert c.dtype == torch.bfloat16  # explicit settings win
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "eval.dtype: bfloat16 is emulated on this CPU" in warnings[0] and AVX2["cpu"] in warnings[0]
    assert EMULATED in warnings[0] and "eval.dtype: native" in warnings[0] and "float32" in warnings[0]
    # serve's key: the target loaded in bf16 says so under target.dtype
    caplog.clear()
    t = load_target(TargetSection(path=str(tiny_qwen3), device="cpu", dtype="bfloat16"), with_tokenizer=False)
    assert t.dtype == torch.bfloat16
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(w.startswith("target.dtype: bfloat16 is emulated") and EMULATED in w for w in warnings), warnings
    # the same on a CPU with AVX512-BF16: no warning
    _flags(monkeypatch, AVX512)
    assert compute_dtype("bfloat16", CPU, key="eval.dtype").warning is None
    # float16 is judged by the fp16 flags
    assert compute_dtype("float16", CPU, key="target.dtype").warning is not None
    _flags(monkeypatch, AMX)
    assert compute_dtype("float16", CPU, key="target.dtype").warning is None


def test_train_dtype_native_autocasts_only_where_bf16_is_native(monkeypatch):
    from dflashkit.train.trainer import autocast_dtype

    _flags(monkeypatch, AVX2)
    assert autocast_dtype("native", CPU) is None and autocast_dtype("auto", CPU) is None
    _flags(monkeypatch, AMX)
    assert autocast_dtype("native", CPU) is torch.bfloat16 and autocast_dtype("auto", CPU) is None
    assert autocast_dtype("native", torch.device("cuda")) is torch.bfloat16


def test_no_shipped_cpu_config_pins_a_16_bit_compute_dtype():
    paths = sorted(CONFIGS.glob("*.yaml"))
    assert DEMO in paths and set(GPU_CONFIGS) <= {p.name for p in paths}
    pinned = {}
    for p in paths:
        if p.name in GPU_CONFIGS:
            continue
        cfg = load_config(p)
        for key in COMPUTE_KEYS:
            section, field = key.split(".")
            value = getattr(getattr(cfg, section), field)
            if value in ("bfloat16", "float16"):
                pinned[f"{p.name}: {key}"] = value
    assert not pinned, f"CPU configs pin a 16-bit compute dtype (use native): {pinned}"


# -- eval and bench decode, end to end on the tiny target --------------------------------------------------------

@pytest.fixture(scope="module")
def target(tiny_qwen3):
    return load_target(TargetSection(path=str(tiny_qwen3), device="cpu", dtype="float32"))


def _common(rd: Path, tiny_qwen3: Path) -> list[str]:
    return [f"target.path={tiny_qwen3}", "target.device=cpu", "eval.max_new_tokens=8", "eval.warmup=0",
            "eval.block_sizes=[2]", "eval.diagnostics=false", "eval.prompt_lookup=false",
            "eval.adaptive_length=false", "--run-dir", str(rd), "--json"]


@pytest.mark.parametrize("facts, verify, reason", [
    (AVX2, "float32", f"float32: bf16 is emulated on this CPU ({EMULATED})"),
    (AVX512, "bfloat16", "bfloat16: native on this CPU (avx512_bf16)"),
], ids=["avx2", "avx512_bf16"])
def test_eval_and_bench_decode_record_the_native_choice_and_why(tmp_path, target, tiny_qwen3, monkeypatch, capsys,
                                                                facts, verify, reason):
    _flags(monkeypatch, facts)
    rd = run_dir_with_drafter(tmp_path, target, block_size=4, prompts=1)
    assert main(["eval", *_common(rd, tiny_qwen3), "eval.dtype=native"]) == 0
    res = json.loads((rd / "eval" / "results.json").read_text())
    assert res["dtype"] == verify and res["dtype_reason"] == reason
    assert f"eval.dtype=native → {reason}" in capsys.readouterr().err
    assert main(["bench", "decode", *_common(rd, tiny_qwen3), "eval.dtype=native", "eval.num_prompts=1"]) == 0
    bench = json.loads((rd / "bench" / "decode.json").read_text())
    assert bench["dtype"] == verify and bench["dtype_reason"] == reason


def test_eval_keeps_an_explicit_bf16_on_an_emulating_cpu_and_warns(tmp_path, target, tiny_qwen3, monkeypatch,
                                                                   capsys):
    _flags(monkeypatch, AVX2)
    rd = run_dir_with_drafter(tmp_path, target, block_size=4, prompts=1)
    assert main(["eval", *_common(rd, tiny_qwen3), "eval.dtype=bfloat16"]) == 0
    err = capsys.readouterr().err
    assert "WARNING eval.dtype: bfloat16 is emulated on this CPU" in err and EMULATED in err, err
    res = json.loads((rd / "eval" / "results.json").read_text())
    assert res["dtype"] == "bfloat16" and "emulated" in res["dtype_reason"]


@pytest.mark.parametrize("key, value", [("eval.dtype", "bf16"), ("target.dtype", "fp8"), ("train.dtype", "float16")])
def test_an_unknown_dtype_is_refused_naming_the_key(tmp_path, capsys, key, value):
    rd = tmp_path / "run"
    rc = main(["eval", "--json", "--run-dir", str(rd), f"{key}={value}"])
    out, err = capsys.readouterr()
    assert rc == 2 and "Traceback" not in err
    assert f"{key}: {value!r} is not one of" in err and "'native'" in err, err
    assert json.loads(out.strip().splitlines()[-1])["exit_code"] == 2
    assert not rd.exists()
