"""A causal (JetSpec) drafter through both formats: export writes where vLLM and SGLang read causality, the
shipped dflash.py attends causally, and `dflashkit import` of each gives back the same contract (causal
included) and the same logits; a bidirectional export stays as it was (no causality keys at all)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflashkit.cli import main
from dflashkit.config import TargetSection
from dflashkit.export.hf import load_drafter, load_shipped_model, save_drafter
from dflashkit.target.load import load_target
from dflashkit.testing import random_drafter

DFLASH2 = {"drafter_type": "dflash2", "conv_group_size": 8, "selector_rank": 4, "selector_top_k": 3}


@pytest.fixture(scope="module")
def target(tiny_qwen3):
    return load_target(TargetSection(path=str(tiny_qwen3), device="cpu", dtype="float32"))


def _logits(model, head: torch.Tensor) -> torch.Tensor:
    c = model.contract
    g = torch.Generator().manual_seed(7)
    noise = torch.randn(1, c.block_size, c.hidden_size, generator=g)
    ctx = torch.randn(1, 9, c.num_features * c.hidden_size, generator=g)
    with torch.inference_mode():
        return model(noise, ctx, torch.arange(9 + c.block_size)[None]) @ head.T


def _export_both(tmp_path: Path, model, tiny_qwen3) -> tuple[Path, Path, Path]:
    rd = tmp_path / "run"
    save_drafter(model, rd / "train" / "final", dtype="float32")
    assert main(["export", f"target.path={tiny_qwen3}", "export.dtype=float32", "--run-dir", str(rd), "--json"]) == 0
    spec = tmp_path / "spec"
    assert main(["export", "--format", "speculators", f"target.path={tiny_qwen3}", "export.dtype=float32",
                 f"export.out_dir={spec}", "--run-dir", str(rd), "--json"]) == 0
    return rd, rd / "export", spec


def _imported(src: Path, rd: Path, tiny_qwen3):
    assert main(["import", str(src), f"target.path={tiny_qwen3}", "--run-dir", str(rd), "--json"]) == 0
    return load_drafter(rd / "train" / "final", dtype=torch.float32), json.loads((rd / "contract.json").read_text())


@pytest.mark.parametrize("extra", [{}, DFLASH2], ids=["dflash", "dflash2"])
def test_a_causal_export_says_so_where_the_engines_read_it_and_imports_back(tmp_path, target, tiny_qwen3, extra):
    source = random_drafter(target, block_size=5, layers=2, seed=3, causal=True, **extra)
    rd, zlab, spec = _export_both(tmp_path, source, tiny_qwen3)
    cfg = json.loads((zlab / "config.json").read_text())
    assert cfg["is_causal"] is True and cfg["dflash_config"]["causal"] is True   # vLLM reads both, SGLang the first
    scfg = json.loads((spec / "config.json").read_text())
    assert scfg["sliding_window_non_causal"] is False                     # vLLM's update_dflash: causal = not this
    assert scfg["transformer_layer_config"]["is_causal"] is True          # vLLM's top-level is_causal after it
    assert "causal" in (zlab / "README.md").read_text().lower()

    head = target.lm_head.weight.detach()
    want = _logits(source, head)
    bidirectional = random_drafter(target, block_size=5, layers=2, seed=3, causal=False, **extra)
    assert not torch.allclose(_logits(bidirectional, head), want, atol=1e-4)  # causality changes these logits
    shipped = load_shipped_model(zlab)                                     # trust_remote_code's view of the export
    c = source.contract
    g = torch.Generator().manual_seed(7)
    noise, ctx = torch.randn(1, c.block_size, c.hidden_size, generator=g), torch.randn(1, 9, 2 * c.hidden_size, generator=g)
    with torch.inference_mode():
        got = shipped(noise_embedding=noise, target_hidden=ctx, position_ids=torch.arange(9 + c.block_size)[None])
    torch.testing.assert_close(got @ head.T, want, rtol=0, atol=1e-5)

    for name, src in (("from-zlab", zlab), ("from-spec", spec)):
        back, contract = _imported(src, tmp_path / name, tiny_qwen3)
        assert contract["causal"] is True and back.causal and back.contract == source.contract, name
        torch.testing.assert_close(_logits(back, head), want, rtol=0, atol=0)


def test_a_bidirectional_export_has_no_causality_keys_and_reads_back_bidirectional(tmp_path, target, tiny_qwen3):
    source = random_drafter(target, block_size=5, layers=2, seed=3)
    rd, zlab, spec = _export_both(tmp_path, source, tiny_qwen3)
    cfg = json.loads((zlab / "config.json").read_text())
    assert "is_causal" not in cfg and "causal" not in cfg["dflash_config"]   # vLLM's default for full attention
    assert set(cfg["layer_types"]) == {"full_attention"}
    scfg = json.loads((spec / "config.json").read_text())
    assert scfg["sliding_window_non_causal"] is True and "is_causal" not in scfg["transformer_layer_config"]
    for name, src in (("from-zlab", zlab), ("from-spec", spec)):
        back, contract = _imported(src, tmp_path / name, tiny_qwen3)
        assert contract["causal"] is False and not back.causal, name


def test_importing_a_causal_drafter_into_a_bidirectional_run_names_the_knob(tmp_path, target, tiny_qwen3, capsys):
    _, zlab, _ = _export_both(tmp_path, random_drafter(target, block_size=5, layers=2, seed=3, causal=True), tiny_qwen3)
    other = tmp_path / "other"
    other.mkdir()
    plain = random_drafter(target, block_size=5, layers=2, seed=3).contract
    (other / "contract.json").write_text(json.dumps(plain.to_dict()))
    assert main(["import", str(zlab), f"target.path={tiny_qwen3}", "--run-dir", str(other), "--json"]) == 2
    err = capsys.readouterr().err
    assert "causal: True in" in err and "False in" in err and str(other / "contract.json") in err
    assert not (other / "train").exists()
