"""Drafter dir format, `dflashkit export` (reload checks, shipped modeling file), `dflashkit import`, `eval` CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflashkit.cli import main
from dflashkit.config import TargetSection
from dflashkit.errors import UsageError
from dflashkit.export.hf import load_drafter, load_shipped_model, save_drafter
from dflashkit.target.load import load_target

from dflashkit.testing import random_drafter
from tests.helpers import run_dir_with_drafter as _run_dir


@pytest.fixture(scope="module")
def target(tiny_qwen3):
    return load_target(TargetSection(path=str(tiny_qwen3), device="cpu", dtype="float32"))


def _inputs(contract, t=6):
    g = torch.Generator().manual_seed(1)
    noise = torch.randn(1, contract.block_size, contract.hidden_size, generator=g)
    ctx = torch.randn(1, t, contract.num_features * contract.hidden_size, generator=g)
    return noise, ctx, torch.arange(t + contract.block_size)[None]


def test_save_load_roundtrip_is_exact_in_float32(tmp_path, target):
    d = random_drafter(target, block_size=4, layers=2)
    save_drafter(d, tmp_path / "x", dtype="float32")
    back = load_drafter(tmp_path / "x")
    assert set(back.state_dict()) == set(d.state_dict())
    for k, v in d.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k
    cfg = json.loads((tmp_path / "x" / "config.json").read_text())
    assert cfg["dflash_config"]["target_layer_ids"] == d.target_layer_ids and cfg["block_size"] == 4


def test_bad_drafter_dirs_are_clear_errors(tmp_path, target):
    d = random_drafter(target)
    save_drafter(d, tmp_path / "ok", dtype="float32")
    # corrupt weights
    bad = tmp_path / "corrupt"
    save_drafter(d, bad, dtype="float32")
    (bad / "model.safetensors").write_bytes((bad / "model.safetensors").read_bytes()[:200])
    with pytest.raises(UsageError, match="corrupt or truncated"):
        load_drafter(bad)
    # missing dflash_config
    nodc = tmp_path / "nodc"
    save_drafter(d, nodc, dtype="float32")
    cfg = json.loads((nodc / "config.json").read_text())
    cfg.pop("dflash_config")
    (nodc / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UsageError, match="dflash_config"):
        load_drafter(nodc)
    # config says 2 layers, weights hold 1
    shape = tmp_path / "shape"
    save_drafter(d, shape, dtype="float32")
    cfg = json.loads((shape / "config.json").read_text())
    cfg["num_hidden_layers"] = 2
    (shape / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UsageError, match="missing tensors"):
        load_drafter(shape)


def test_export_writes_a_checked_serving_dir(tmp_path, target, tiny_qwen3):
    rd = _run_dir(tmp_path, target)
    assert main(["export", f"target.path={tiny_qwen3}", "export.dtype=bfloat16", "--run-dir", str(rd), "--json"]) == 0
    out = rd / "export"
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "dflash.py", "manifest.json",
                                                     "model.safetensors"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["auto_map"]["AutoModel"] == "dflash.DFlashDraftModel"
    assert cfg["dtype"] == "bfloat16" and cfg["block_size"] == 4 and cfg["num_target_layers"] == 6
    assert {"block_size", "target_layer_ids", "mask_token_id"} <= set(cfg["dflash_config"])
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as fh:
        assert all(fh.get_tensor(k).dtype == torch.bfloat16 for k in fh.keys())
        assert "fc.weight" in fh.keys() and len(list(fh.keys())) == 11 + 3
    card = (out / "README.md").read_text()
    assert f"--speculative-draft-model-path {out.resolve()} --speculative-num-draft-tokens 4" in card
    assert '"num_speculative_tokens":3' in card
    check = json.loads((out / "manifest.json").read_text())["reload_check"]
    assert check["compared"] == "logits" and check["max_diff_shipped_vs_ours"] < 1e-5
    # the shipped dflash.py, loaded through transformers' remote-code path, equals our model
    from transformers import AutoModel

    ours = load_drafter(out, dtype=torch.float32)
    remote = AutoModel.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32).eval()
    assert type(remote).__module__.startswith("transformers_modules")
    noise, ctx, pos = _inputs(ours.contract)
    with torch.inference_mode():
        torch.testing.assert_close(remote(noise_embedding=noise, target_hidden=ctx, position_ids=pos),
                                   ours(noise, ctx, pos), atol=1e-5, rtol=1e-5)
    shipped = load_shipped_model(out)
    assert shipped.block_size == 4 and shipped.target_layer_ids == ours.target_layer_ids


def test_export_refuses_a_failing_reload_check_and_keeps_the_old_export(tmp_path, target, tiny_qwen3):
    rd = _run_dir(tmp_path, target)
    assert main(["export", f"target.path={tiny_qwen3}", "--run-dir", str(rd), "--json"]) == 0
    before = (rd / "export" / "model.safetensors").read_bytes()
    # an impossible tolerance makes the bf16 export fail its check; the previous export is untouched
    assert main(["export", f"target.path={tiny_qwen3}", "export.check_atol=1e-12", "--run-dir", str(rd),
                 "--json"]) == 1
    assert (rd / "export" / "model.safetensors").read_bytes() == before
    assert not [p for p in rd.iterdir() if p.name.startswith(".export")]
    assert main(["export", "--run-dir", str(tmp_path / "empty"), "--json"]) == 3


def test_import_validates_and_installs(tmp_path, target, tiny_qwen3, smollm2_dir):
    src = tmp_path / "ckpt"
    save_drafter(random_drafter(target, block_size=8), src, dtype="bfloat16")
    rd = tmp_path / "fresh"
    assert main(["import", str(src), f"target.path={tiny_qwen3}", "--run-dir", str(rd), "--json"]) == 0
    assert (rd / "train" / "final" / "model.safetensors").is_file()
    contract = json.loads((rd / "contract.json").read_text())
    assert contract["block_size"] == 8 and contract["num_target_layers"] == 6
    # never overwrites; another DEST works
    assert main(["import", str(src), f"target.path={tiny_qwen3}", "--run-dir", str(rd), "--json"]) == 2
    assert main(["import", str(src), "other", f"target.path={tiny_qwen3}", "--run-dir", str(rd), "--json"]) == 0
    # a drafter for another target: exit 2 before anything is written
    assert main(["import", str(src), "x", f"target.path={smollm2_dir}", "--run-dir", str(rd), "--json"]) == 2
    assert not (rd / "x").exists()
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("dflash_config")
    (src / "config.json").write_text(json.dumps(cfg))
    assert main(["import", str(src), "y", f"target.path={tiny_qwen3}", "--run-dir", str(rd), "--json"]) == 2


def test_eval_cli_reports_and_checks_identity(tmp_path, target, tiny_qwen3, capsys):
    rd = _run_dir(tmp_path, target)
    args = [f"target.path={tiny_qwen3}", "eval.max_new_tokens=10", "eval.num_prompts=2", "eval.warmup=1",
            "eval.block_sizes=[2,4]", "--run-dir", str(rd)]
    assert main(["eval", *args]) == 0
    out = capsys.readouterr().out
    assert "per-position acceptance" in out  # human table
    res = json.loads((rd / "eval" / "results.json").read_text())
    assert set(res["speculative"]) == {"2", "4"} and res["mismatches"] == []
    best = max(res["speculative"], key=lambda b: res["speculative"][b]["speedup"])  # the best, not the first
    assert res["summary"]["greedy_identical"] is True and res["summary"]["block_size"] == int(best)
    assert res["summary"]["tau"] == res["speculative"][best]["tau"]
    assert res["summary"]["speedup"] == max(r["speedup"] for r in res["speculative"].values())
    for bs, r in res["speculative"].items():
        assert 1 <= r["tau"] <= int(bs) and r["identical_to_baseline"] is True
        assert len(r["tau_histogram"]) == int(bs) and sum(r["tau_histogram"]) == r["steps"]
        assert r["bound"] > 0 and r["speedup"] > 0
    assert (rd / "eval" / "manifest.json").is_file()
    # a prompt longer than the context: exit 2 before decoding; missing prompts: exit 3
    assert main(["eval", *args, "eval.max_context=12", "--json"]) == 2
    assert main(["eval", f"target.path={tiny_qwen3}", "--run-dir", str(tmp_path / "nothing"), "--json"]) == 3
    (rd / "prepare" / "heldout.jsonl").unlink()
    assert main(["eval", *args, "--json"]) == 3


def test_reduced_vocab_export_has_what_vllm_reads_and_stays_lossless(tmp_path, target, tiny_qwen3):
    from safetensors.torch import load_file

    from dflashkit.model.drafter import DFlashDraftModel

    vocab = [10, 32, 97, 101, 258, 300]
    rd = _run_dir(tmp_path, target)
    src = random_drafter(target, block_size=4)
    small = DFlashDraftModel(src.contract, draft_vocab=torch.tensor(vocab))
    small.load_state_dict({**src.state_dict(), "d2t": small.d2t})
    save_drafter(small, rd / "train" / "final", dtype="float32")          # train/final: d2t only
    assert main(["export", "--run-dir", str(rd), "--json"]) == 2          # lm_head rows need the target
    assert main(["export", f"target.path={tiny_qwen3}", "export.dtype=bfloat16", "--run-dir", str(rd), "--json"]) == 0
    out = rd / "export"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 6 and cfg["vocab_size"] == 320 and cfg["dflash_config"]["draft_vocab_size"] == 6
    sd = load_file(out / "model.safetensors")
    assert (torch.arange(6) + sd["d2t"]).tolist() == vocab and sd["t2d"].nonzero().flatten().tolist() == vocab
    assert torch.equal(sd["lm_head.weight"], target.lm_head.weight[vocab].to(torch.bfloat16))
    assert "draft_vocab_size | 6" in (out / "README.md").read_text()
    check = json.loads((out / "manifest.json").read_text())["reload_check"]
    assert check["compared"] == "logits"
    # eval on the export: our decoder drafts over the 6 tokens, output identical to the baseline
    args = [f"target.path={tiny_qwen3}", "eval.max_new_tokens=8", "eval.num_prompts=2", "eval.warmup=0",
            "eval.block_sizes=[4]", "--run-dir", str(rd), "--json"]
    assert main(["eval", str(out), *args]) == 0
    res = json.loads((rd / "eval" / "results.json").read_text())
    assert res["summary"]["greedy_identical"] is True


@pytest.mark.parametrize("kind", ["file", "user_dir", "cwd"])
def test_export_never_replaces_what_it_does_not_own(tmp_path, target, tiny_qwen3, kind, monkeypatch, capsys):
    rd = _run_dir(tmp_path, target)
    user = tmp_path / "mine"
    if kind == "file":
        user.write_text("precious\n")
    else:
        user.mkdir()
        (user / "notes.txt").write_text("precious\n")
        (user / "sub").mkdir()
        (user / "sub" / "x.bin").write_bytes(b"\0\1")
    if kind == "cwd":
        monkeypatch.chdir(user)
        out = "."
    else:
        out = str(user)

    def snapshot():
        if user.is_file():
            return {".": user.read_bytes()}
        return {str(p.relative_to(user)): p.read_bytes() if p.is_file() else None for p in sorted(user.rglob("*"))}

    before = snapshot()
    rc = main(["export", f"target.path={tiny_qwen3}", f"export.out_dir={out}", "--run-dir", str(rd), "--json"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "refusing to replace" in err and str(Path(out)) in err and "Traceback" not in err
    assert snapshot() == before
    assert not [p for p in user.parent.iterdir() if p.name.startswith(".mine")]


def test_export_replaces_its_own_output_with_normal_permissions(tmp_path, target, tiny_qwen3):
    import os
    import stat

    rd = _run_dir(tmp_path, target)
    out = tmp_path / "served" / "drafter"
    args = ["export", f"target.path={tiny_qwen3}", f"export.out_dir={out}", "--run-dir", str(rd), "--json"]
    assert main(args) == 0
    assert main(args) == 0  # its own export (manifest.json, stage export) is replaced
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask
    assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) & 0o044 == 0o644 & ~umask & 0o044


def test_export_and_eval_default_to_train_best_and_say_so(tmp_path, target, tiny_qwen3, capsys):
    rd = _run_dir(tmp_path, target)
    torch.manual_seed(7)
    best = random_drafter(target, block_size=4)
    save_drafter(best, rd / "train" / "best", dtype="float32")
    args = [f"target.path={tiny_qwen3}", "--run-dir", str(rd), "--json"]
    # a best/ without best.json (a torn or foreign dir) is not trusted: train/final is used
    capsys.readouterr()
    assert main(["eval", "--dry-run", *args]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["drafter"] == str(rd / "train" / "final")
    (rd / "train" / "best" / "best.json").write_text(json.dumps({"step": 3, "tau": 1.5, "acc": [0.4]}))
    assert main(["eval", "--dry-run", *args]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["drafter"] == str(rd / "train" / "best")
    assert main(["export", "export.dtype=float32", *args]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["source"] == str(rd / "train" / "best") and out["source_info"] == {"kind": "best", "step": 3,
                                                                                  "tau": 1.5, "acc": [0.4]}
    exported = load_drafter(rd / "export").state_dict()
    assert all(torch.equal(v.float(), exported[k].float()) for k, v in best.state_dict().items())
