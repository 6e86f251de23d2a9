"""`probe` and `plan` on the seed's two real-shaped targets (config.json only) state which paths work:
Qwen3.6-27B-style (hybrid: Gated DeltaNet linear attention, 3 of every 4 layers) and Kimi K2.6 (INT4
compressed-tensors), with DeepSeek-V3 (FP8 block-wise, MLA) and a plain Qwen3-8B beside them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflashkit.cli import main

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "configs"
MASK = {"kimi-k2.6": 163838, "qwen3.6-27b": 248000, "deepseek-v3": 128000, "qwen3-8b": 151000}


def _probe_paths(name: str, tmp_path: Path, capsys) -> tuple[dict[str, str], str]:
    argv = ["probe", str(FIXTURES / name), "--dry-run", "--run-dir", str(tmp_path), f"drafter.mask_token_id={MASK[name]}"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert main([*argv, "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    return {r["path"].split(":")[0]: r["verdict"] for r in res["paths"]}, text


def test_kimi_int4_local_paths_dequantize_and_the_engine_serves_the_bits(tmp_path, capsys):
    p, text = _probe_paths("kimi-k2.6", tmp_path, capsys)
    assert p["local"].startswith("yes") and "compressed-tensors pack-quantized int4" in p["local"]
    assert "dequantized" in p["local"] and "dflashkit[quantized]" in p["local"]
    assert p["engine"].startswith("yes") and "served numerics" in p["engine"]
    assert p["train.on_path=rollout"] == "yes"
    assert "paths" in text and "local: capture.engine=local" in text


def test_qwen36_hybrid_rollout_and_cpu_vllm_refused(tmp_path, capsys):
    p, _ = _probe_paths("qwen3.6-27b", tmp_path, capsys)
    assert p["local"].startswith("yes") and "48 linear_attention layers" in p["local"]
    assert p["engine"].startswith("GPU vLLM only") and "refused (exit 2) on vLLM's CPU build" in p["engine"]
    assert p["train.on_path=rollout"].startswith("refused") and "train.on_path=mask" in p["train.on_path=rollout"]


def test_deepseek_fp8_mla_partial_blocks_refused_locally(tmp_path, capsys):
    p, _ = _probe_paths("deepseek-v3", tmp_path, capsys)
    assert p["local"].startswith("refused") and "kv_a_proj_with_mqa (576 rows in 128-row blocks)" in p["local"]
    assert p["engine"].startswith("yes")


def test_a_plain_target_works_everywhere(tmp_path, capsys):
    p, _ = _probe_paths("qwen3-8b", tmp_path, capsys)
    assert all(v.startswith("yes") for v in p.values()), p


@pytest.mark.parametrize("name", ["kimi-k2.6", "qwen3.6-27b"])
def test_plan_states_the_paths_and_the_local_weights(name, tmp_path, capsys):
    args = [str(FIXTURES / name), "8x141", "data.num_prompts=1000", "data.mean_tokens=2000", "--run-dir",
            str(tmp_path), f"drafter.mask_token_id={MASK[name]}"]
    assert main(["plan", *args, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["plan"]
    assert [r["path"].split(":")[0] for r in plan["paths"]][:2] == ["local", "engine"]
    t = plan["target"]
    if name == "kimi-k2.6":  # INT4 served, bf16 once dequantized by a local load: 4× the bytes
        assert t["bytes_per_param"] == 0.5 and t["local_bytes_per_param"] == 2.0
        assert t["local_weights_bytes"] == 4 * t["weights_bytes"]
    else:
        assert t["local_weights_bytes"] == t["weights_bytes"]
    assert main(["plan", *args]) == 0
    out = capsys.readouterr().out
    assert "\npaths " in out and ("loaded locally" in out) == (name == "kimi-k2.6")
