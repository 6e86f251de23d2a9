"""DFlash2 drafters through the z-lab format: save/load, `dflashkit export` (reload ≡ the same logits and walk),
and `dflashkit import` refusing DFlash2 dirs without their selector/convolution keys or tensors (exit 2)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from dflashkit.cli import main
from dflashkit.config import TargetSection
from dflashkit.errors import UsageError
from dflashkit.export.hf import load_drafter, save_drafter
from dflashkit.model.dflash2 import DFlash2DraftModel
from dflashkit.target.load import load_target
from tests.helpers import dflash2_drafter


@pytest.fixture(scope="module")
def target(tiny_qwen3):
    return load_target(TargetSection(path=str(tiny_qwen3), device="cpu", dtype="float32"))


def _walk(model, head, seed: int = 3):
    c = model.contract
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(2, c.block_size, c.hidden_size, generator=g)
    ctx = torch.randn(2, 5, c.num_features * c.hidden_size, generator=g)
    pos = torch.arange(5 + c.block_size)[None].expand(2, -1)
    with torch.inference_mode():
        h = model(noise, ctx, pos)[:, 1:]
        logits = h @ head.T
        tokens, _, _ = model.draft(h, logits, torch.tensor([1, 2]))
    return logits, tokens


def _run_dir(tmp_path: Path, model) -> Path:
    rd = tmp_path / "run"
    save_drafter(model, rd / "train" / "final", dtype="float32")
    return rd


def test_save_load_roundtrip_keeps_the_dflash2_drafter(tmp_path, target):
    d = dflash2_drafter(target)
    save_drafter(d, tmp_path / "x", dtype="float32")
    cfg = json.loads((tmp_path / "x" / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"]
    assert {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 6,
            "output_multiplier": 1.25}.items() <= cfg["dflash_config"].items()
    back = load_drafter(tmp_path / "x")
    assert isinstance(back, DFlash2DraftModel) and back.contract.knobs.selector_top_k == 6
    assert set(back.state_dict()) == set(d.state_dict())
    for k, v in d.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k
    head = target.lm_head.weight.detach()
    (la, ta), (lb, tb) = _walk(d, head), _walk(back, head)
    assert torch.equal(la, lb) and torch.equal(ta, tb)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_of_a_dflash2_drafter_reloads_to_the_same_logits_and_walk(tmp_path, target, tiny_qwen3, dtype):
    d = dflash2_drafter(target)
    rd = _run_dir(tmp_path, d)
    assert main(["export", f"target.path={tiny_qwen3}", f"export.dtype={dtype}", "--run-dir", str(rd), "--json"]) == 0
    out = rd / "export"
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "dflash.py", "manifest.json",
                                                     "model.safetensors"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["auto_map"]["AutoModel"] == "dflash.DFlash2DraftModel"
    for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "mask_token_id",
              "target_layer_ids", "block_size"):
        assert k in cfg["dflash_config"], k
    check = json.loads((out / "manifest.json").read_text())["reload_check"]
    assert check["compared"] == "logits" and check["walk_tokens"] == 3 * (d.contract.block_size - 1)
    if dtype == "float32":
        assert check["walk_agreement"] == 1.0 and check["max_diff_vs_source"] < 1e-5
        back = load_drafter(out)
        head = target.lm_head.weight.detach()
        (la, ta), (lb, tb) = _walk(d, head), _walk(back, head)
        torch.testing.assert_close(lb, la, atol=1e-5, rtol=1e-5)
        assert torch.equal(ta, tb)
        assert check["max_diff_shipped_vs_ours"] < 1e-5
        # the shipped dflash.py through transformers' remote-code path: the same hidden states, the selector loaded
        from transformers import AutoModel

        remote = AutoModel.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32).eval()
        assert type(remote).__name__ == "DFlash2DraftModel"
        c = back.contract
        g = torch.Generator().manual_seed(5)
        noise = torch.randn(2, c.block_size, c.hidden_size, generator=g)
        ctx = torch.randn(2, 4, c.num_features * c.hidden_size, generator=g)
        pos = torch.arange(4 + c.block_size)[None].expand(2, -1)
        with torch.inference_mode():
            torch.testing.assert_close(remote(noise_embedding=noise, target_hidden=ctx, position_ids=pos),
                                       back(noise, ctx, pos), atol=1e-5, rtol=1e-5)
            ids = torch.randint(0, c.vocab_size, (2, 3, 4), generator=g)
            prev = torch.randint(0, c.vocab_size, (2, 3, 4), generator=g)
            unary, hid = torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, c.hidden_size, generator=g)
            torch.testing.assert_close(remote.candidate_selector(prev, ids, unary, hid),
                                       back.candidate_selector.pair_scores(prev, ids, unary, hid), atol=1e-5, rtol=1e-5)
    assert "V2 model runner" in (out / "README.md").read_text()


def test_import_refuses_dflash2_dirs_missing_selector_or_conv_keys_by_name(tmp_path, target, tiny_qwen3, capsys):
    from safetensors.torch import load_file, save_file

    src = tmp_path / "ckpt"
    save_drafter(dflash2_drafter(target), src, dtype="float32")
    rd = tmp_path / "fresh"
    assert main(["import", str(src), "ok", f"target.path={tiny_qwen3}", "--run-dir", str(rd), "--json"]) == 0
    assert isinstance(load_drafter(rd / "ok"), DFlash2DraftModel)
    capsys.readouterr()

    def refused(name: str, what: str) -> None:
        assert main(["import", str(bad), name, f"target.path={tiny_qwen3}", "--run-dir", str(rd), "--json"]) == 2
        err = capsys.readouterr().err
        assert what in err, err[-2000:]
        assert not (rd / name).exists()

    for key in ("selector_rank", "conv_group_size"):  # a config key missing
        bad = tmp_path / f"no-{key}"
        save_drafter(dflash2_drafter(target), bad, dtype="float32")
        cfg = json.loads((bad / "config.json").read_text())
        del cfg["dflash_config"][key]
        (bad / "config.json").write_text(json.dumps(cfg))
        refused(f"x-{key}", f"dflash_config.{key}")
    for tensor in ("candidate_selector.successor_codebook", "layers.1.mlp_conv.kernel_projection.weight"):
        bad = tmp_path / f"no-{tensor}"
        save_drafter(dflash2_drafter(target), bad, dtype="float32")
        state = load_file(str(bad / "model.safetensors"))
        del state[tensor]
        save_file(state, str(bad / "model.safetensors"))
        refused(f"y-{tensor}", tensor)
    # a DFlash config over DFlash2 weights: named too, not a bare "unexpected tensors"
    bad = tmp_path / "relabelled"
    save_drafter(dflash2_drafter(target), bad, dtype="float32")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["DFlashDraftModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    refused("z", "holds DFlash2 tensors")


def test_a_dflash2_checkpoint_with_a_reduced_vocab_is_refused(tmp_path, target):
    src = tmp_path / "ckpt"
    save_drafter(dflash2_drafter(target), src, dtype="float32")
    cfg = json.loads((src / "config.json").read_text())
    cfg["draft_vocab_size"] = 16
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UsageError, match="draft_vocab_size|d2t"):
        load_drafter(src)


def test_speculators_format_carries_a_dflash2_drafter_as_update_dflash2_reads_it(tmp_path, target, tiny_qwen3, capsys):
    d = dflash2_drafter(target)
    d.contract.knobs = dataclasses.replace(d.contract.knobs, output_multiplier=None)  # vLLM 0.32's update_dflash2
    d.output_multiplier = None                                                       # would drop it (refused below)
    rd = _run_dir(tmp_path, d)
    spec = tmp_path / "spec"
    args = ["export", "--format", "speculators", f"target.path={tiny_qwen3}", "export.dtype=float32",
            f"export.out_dir={spec}", "--run-dir", str(rd), "--json"]
    assert main(args) == 0
    cfg = json.loads((spec / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash2" and cfg["architectures"] == ["DFlash2DraftModel"]
    assert cfg["speculators_config"]["algorithm"] == "dflash2"
    assert {k: cfg[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")} == \
        {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 6}
    check = json.loads((spec / "manifest.json").read_text())["reload_check"]
    assert check["walk_agreement"] == 1.0 and check["max_diff_vs_source"] < 1e-5
    # import converts it back to the z-lab format: the same tensors, the same walk
    dest = tmp_path / "imported"
    assert main(["import", str(spec), f"target.path={tiny_qwen3}", "--run-dir", str(dest), "--json"]) == 0
    back = load_drafter(dest / "train" / "final")
    assert isinstance(back, DFlash2DraftModel)
    for k, v in d.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k
    head = target.lm_head.weight.detach()
    assert torch.equal(_walk(d, head)[1], _walk(back, head)[1])
    # a speculators dflash2 dir without a selector key: refused by name
    cfg.pop("selector_top_k")
    (spec / "config.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    assert main(["import", str(spec), "x", f"target.path={tiny_qwen3}", "--run-dir", str(dest), "--json"]) == 2
    assert "selector_top_k" in capsys.readouterr().err
    # output_multiplier set: vLLM's speculators reader would drop it, so that format is refused (exit 2)
    rd2 = _run_dir(tmp_path / "b", dflash2_drafter(target))
    args2 = ["export", "--format", "speculators", f"target.path={tiny_qwen3}", f"export.out_dir={tmp_path / 'spec2'}",
             "--run-dir", str(rd2), "--json"]
    assert main(args2) == 2
    assert "output_multiplier" in capsys.readouterr().err and not (tmp_path / "spec2").exists()
