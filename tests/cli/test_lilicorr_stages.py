"""LiLiCorr drafters through the CLI: `train` (walk and unary τ logged, online ≡ cached with the penalty read from
the shards' last_hidden), `export` (reload ≡ the same logits and walk; the shipped dflash.py too), `import` (round
trip, refusals by key), speculators refused, warm starts from DFlash / DFlash2 dirs, `eval`, and
`dflashkit run --to export` with drafter.type=lilicorr on the tiny target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflashkit.cli import main
from dflashkit.config import TargetSection
from dflashkit.export.hf import load_drafter, save_drafter
from dflashkit.model.lilicorr import LiLiCorrDraftModel
from dflashkit.target.load import load_target
from dflashkit.testing import random_drafter
from tests.helpers import make_run, overrides, run_dir_with_drafter

LILI = dict(drafter_type="lilicorr", lilicorr_candidate_topk=4, lilicorr_num_heads=4, lilicorr_factor_dim=16)
FLAGS = ["drafter.type=lilicorr"]
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture(scope="module")
def target(tiny_qwen3):
    return load_target(TargetSection(path=str(tiny_qwen3), device="cpu", dtype="float32"))


def _drafter(target, seed: int = 0, **knobs):
    d = random_drafter(target, block_size=4, layers=2, **{**LILI, **knobs})
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in d.lilicorr.named_parameters():
            if not name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return d.eval()


def _walk(model, head, embed, seed: int = 3):
    c = model.contract
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(2, c.block_size, c.hidden_size, generator=g)
    ctx = torch.randn(2, 5, c.num_features * c.hidden_size, generator=g)
    pos = torch.arange(5 + c.block_size)[None].expand(2, -1)
    with torch.inference_mode():
        h = model(noise, ctx, pos)[:, 1:]
        logits = h @ head.T
        tokens, ids, rows = model.draft(h, logits, embed, model.anchor_hidden(ctx[:, -1]))
    return logits, tokens, rows


def _rows(rd):
    return [json.loads(x) for x in (rd / "train" / "metrics.jsonl").read_text().splitlines()]


def test_lilicorr_trains_logs_the_walk_and_online_equals_cached(tmp_path, tiny_qwen3, capsys):
    rd_on = make_run(tmp_path / "on", tiny_qwen3, **LILI)
    rd_ca = make_run(tmp_path / "ca", tiny_qwen3, **LILI)
    # capture.last_hidden auto: the penalty reads the target's logits, so the shards keep its last hidden state
    assert main(["capture", "--json", *overrides(rd_ca, tiny_qwen3), "capture.dtype=float32", *FLAGS]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["last_hidden"] is True
    assert main(["train", "--json", *overrides(rd_on, tiny_qwen3, train__max_steps=3, train__eval_every=3), *FLAGS]) == 0
    assert main(["train", "--json", *overrides(rd_ca, tiny_qwen3, train__max_steps=3, train__eval_every=3,
                                               train__features="cached"), *FLAGS]) == 0
    on, ca = _rows(rd_on), _rows(rd_ca)
    assert len(on) == len(ca) == 4
    for key in ("loss", "tau", "unary_tau", "lattice_ce", "lattice_penalty"):
        assert torch.allclose(torch.tensor([r[key] for r in on]), torch.tensor([r[key] for r in ca]), atol=1e-4), key
    evals = [r for r in on if r.get("split") == "heldout"]
    assert evals and all(1 <= r["tau"] <= 4 and 1 <= r["unary_tau"] <= 4 and 0 <= r["topk_coverage"] <= 1
                         for r in evals)
    assert any(r["lattice_penalty"] > 0 for r in on if "split" not in r)
    cfg = json.loads((rd_on / "train" / "final" / "config.json").read_text())
    assert cfg["architectures"] == ["LiLiCorrDraftModel"] and cfg["dflash_config"]["lilicorr_enabled"] is True
    back = load_drafter(rd_on / "train" / "final", dtype=torch.float32)
    assert isinstance(back, LiLiCorrDraftModel) and back.top_k == 4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_reloads_to_the_same_logits_and_walk_and_imports_back(tmp_path, target, tiny_qwen3, dtype, capsys):
    d = _drafter(target, lilicorr_conv_kernel_size=2, lilicorr_conv_group_size=16)
    rd = run_dir_with_drafter(tmp_path, target, block_size=4, prompts=1, **LILI)
    save_drafter(d, rd / "train" / "final", dtype="float32")
    assert main(["export", f"target.path={tiny_qwen3}", f"export.dtype={dtype}", "--run-dir", str(rd), "--json"]) == 0
    out = rd / "export"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LiLiCorrDraftModel"] and cfg["auto_map"]["AutoModel"] == "dflash.LiLiCorrDraftModel"
    dc = cfg["dflash_config"]
    assert {k: dc[k] for k in ("lilicorr_candidate_topk", "lilicorr_hidden_size", "lilicorr_num_layers",
                               "lilicorr_num_heads", "lilicorr_factor_dim", "conv_kernel_size", "conv_group_size")} \
        == {"lilicorr_candidate_topk": 4, "lilicorr_hidden_size": 0, "lilicorr_num_layers": 2, "lilicorr_num_heads": 4,
            "lilicorr_factor_dim": 16, "conv_kernel_size": 2, "conv_group_size": 16}
    assert isinstance(dc["lilicorr_mlp_ratio"], float) and "has_own_lm_head" not in cfg
    check = json.loads((out / "manifest.json").read_text())["reload_check"]
    assert check["walk_tokens"] == 3 * 3 and "V2 model runner" in (out / "README.md").read_text()
    if dtype != "float32":  # a bf16 export need not walk the source's path (the reader upcasts it): reported
        assert 0.0 <= check["walk_agreement"] <= 1.0
        return
    assert check["walk_agreement"] == 1.0 and check["max_diff_vs_source"] < 1e-5
    back = load_drafter(out)
    head, embed = target.lm_head.weight.detach(), target.embed
    (la, ta, ra), (lb, tb, rb) = _walk(d, head, embed), _walk(back, head, embed)
    torch.testing.assert_close(lb, la, atol=1e-5, rtol=1e-5)
    assert torch.equal(ta, tb) and torch.allclose(ra, rb, atol=1e-5)
    # the shipped dflash.py through transformers' remote-code path: the same hidden states and lattice scores
    from transformers import AutoModel

    remote = AutoModel.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32).eval()
    assert type(remote).__name__ == "LiLiCorrDraftModel"
    c = back.contract
    g = torch.Generator().manual_seed(5)
    noise, ctx = torch.randn(2, 4, c.hidden_size, generator=g), torch.randn(2, 3, 2 * c.hidden_size, generator=g)
    pos = torch.arange(7)[None].expand(2, -1)
    with torch.inference_mode():
        torch.testing.assert_close(remote(noise_embedding=noise, target_hidden=ctx, position_ids=pos),
                                   back(noise, ctx, pos), atol=1e-5, rtol=1e-5)
        ids = torch.randint(0, c.vocab_size, (2, 3, 4), generator=g)
        args = (embed(ids), torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, c.hidden_size, generator=g),
                torch.randn(2, c.hidden_size, generator=g), torch.tensor([True, False]))
        torch.testing.assert_close(remote.lilicorr(*args), back.lilicorr(*args), atol=1e-5, rtol=1e-5)
    # import round trip: the same contract, knobs and weights
    fresh = tmp_path / "fresh"
    capsys.readouterr()
    assert main(["import", str(out), "ok", f"target.path={tiny_qwen3}", "--run-dir", str(fresh), "--json"]) == 0
    again = load_drafter(fresh / "ok")
    assert again.contract.knobs == d.contract.knobs and again.contract.drafter_type == "lilicorr"
    assert all(torch.equal(again.state_dict()[k], v) for k, v in back.state_dict().items())


def test_speculators_is_refused_and_import_refuses_broken_dirs_by_key(tmp_path, target, tiny_qwen3, capsys):
    rd = run_dir_with_drafter(tmp_path, target, block_size=4, prompts=1, **LILI)
    capsys.readouterr()
    assert main(["export", f"target.path={tiny_qwen3}", "export.format=speculators", "--run-dir", str(rd), "--json"]) == 2
    err = capsys.readouterr().err
    assert "export.format=speculators" in err and "no LiLiCorr algorithm" in err and "export.format=zlab" in err
    assert not (rd / "export").exists()
    src = rd / "train" / "final"
    cfg = json.loads((src / "config.json").read_text())

    def refused(change, what: str) -> None:
        bad = tmp_path / "bad"
        bad.mkdir(exist_ok=True)
        (bad / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
        c = json.loads(json.dumps(cfg))
        change(c)
        (bad / "config.json").write_text(json.dumps(c))
        assert main(["import", str(bad), "x", f"target.path={tiny_qwen3}", "--run-dir", str(tmp_path / "r"),
                     "--json"]) == 2
        err = capsys.readouterr().err
        assert what in err, err[-2000:]

    refused(lambda c: c["dflash_config"].pop("lilicorr_factor_dim"), "without ['dflash_config.lilicorr_factor_dim']")
    refused(lambda c: c.update(has_own_lm_head=True), "has_own_lm_head is true")
    refused(lambda c: c["dflash_config"].update(lilicorr_enabled=False), "lilicorr_enabled is False")
    refused(lambda c: c["dflash_config"].update(conv_kernel_size=2), "sets only one of conv_kernel_size")
    refused(lambda c: c.update(architectures=["DFlashDraftModel"]), "holds LiLiCorr tensors")


def test_warm_starts_from_dflash_and_dflash2_dirs(tmp_path, tiny_qwen3, capsys):
    from dflashkit.family import new_drafter
    from dflashkit.family.contract import DrafterContract
    from tests.helpers import with_fields

    rd = make_run(tmp_path / "run", tiny_qwen3, **LILI)
    run = DrafterContract.load(rd / "contract.json")
    plain, d2 = tmp_path / "dflash", tmp_path / "dflash2"
    save_drafter(new_drafter(with_fields(run, drafter_type="dflash")), plain, dtype="float32")
    save_drafter(new_drafter(with_fields(run, drafter_type="dflash2", conv_group_size=16)), d2, dtype="float32")
    assert main(["train", "--json", *overrides(rd, tiny_qwen3, train__max_steps=1), *FLAGS,
                 f"drafter.init={plain}"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["warm_start"]["converted"] == {"from": "dflash", "to": "lilicorr", "skipped": 0}, out
    # a DFlash2's layers carry convolutions this LiLiCorr has not: refused, naming the keys to set
    assert main(["train", "--json", *overrides(rd, tiny_qwen3, train__max_steps=1), *FLAGS,
                 f"drafter.init={d2}"]) == 2
    assert "lilicorr_conv_kernel_size" in capsys.readouterr().err
    conv = make_run(tmp_path / "conv", tiny_qwen3, **LILI, lilicorr_conv_kernel_size=2, lilicorr_conv_group_size=16)
    assert main(["train", "--json", *overrides(conv, tiny_qwen3, train__max_steps=1), *FLAGS,
                 f"drafter.init={d2}"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["warm_start"]["converted"]["from"] == "dflash2" and out["warm_start"]["converted"]["skipped"] == 3


def test_config_checks_name_the_key(tmp_path, capsys):
    assert main(["train", "--dry-run", f"run.run_dir={tmp_path}", *FLAGS, "drafter.lilicorr_candidate_topk=12",
                 "drafter.draft_vocab_size=24", "train.lilicorr_margin=0"]) == 2
    err = capsys.readouterr().err
    assert "drafter.lilicorr_candidate_topk: must be a power of 2 <= 16" in err
    assert "drafter.draft_vocab_size: 24 with drafter.type=lilicorr" in err and "train.lilicorr_margin: must be > 0" in err


def test_rollout_labels_and_the_penalty_are_refused_together(tmp_path, tiny_qwen3, capsys):
    rd = make_run(tmp_path / "run", tiny_qwen3, **LILI)
    for dry in (["--dry-run"], []):
        assert main(["train", "--json", *dry, *overrides(rd, tiny_qwen3), *FLAGS, "train.labels=target",
                     "train.on_path=rollout"]) == 2
        assert "the LiLiCorr loss term 'lattice' reads the target's logits" in capsys.readouterr().err
    assert main(["train", "--json", "--dry-run", *overrides(rd, tiny_qwen3), *FLAGS, "train.labels=target",
                 "train.on_path=rollout", "train.lilicorr_penalty_weight=0"]) == 0


def test_eval_takes_a_lilicorr_drafter(tmp_path, target, tiny_qwen3):
    rd = run_dir_with_drafter(tmp_path, target, block_size=4, prompts=2, **LILI)
    common = [f"target.path={tiny_qwen3}", "eval.max_new_tokens=12", "eval.warmup=0", "--run-dir", str(rd), "--json"]
    assert main(["eval", *common, "eval.block_sizes=[2,4]"]) == 0
    res = json.loads((rd / "eval" / "results.json").read_text())
    assert res["lossless"]["verdict"] == "exact"
    assert all(1 <= r["tau"] <= int(bs) for bs, r in res["speculative"].items())


@pytest.mark.slow
def test_run_to_export_with_a_lilicorr_drafter(tmp_path, capsys):
    rd = tmp_path / "run"
    code = main(["run", "-c", str(CONFIGS / "tiny.yaml"), f"run.run_dir={rd}", "--to", "export", *FLAGS,
                 "drafter.lilicorr_candidate_topk=4", "drafter.lilicorr_num_heads=4", "drafter.lilicorr_factor_dim=16",
                 "train.max_steps=4", "train.save_every=0"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0, out
    assert json.loads((rd / "contract.json").read_text())["drafter_type"] == "lilicorr"
    cfg = json.loads((rd / "export" / "config.json").read_text())
    assert cfg["architectures"] == ["LiLiCorrDraftModel"] and cfg["dflash_config"]["lilicorr_candidate_topk"] == 4
    check = json.loads((rd / "export" / "manifest.json").read_text())["reload_check"]
    assert check["walk_agreement"] == 1.0
    assert isinstance(load_drafter(rd / "export"), LiLiCorrDraftModel)


def test_recipe_lilicorr_variants_train_from_their_own_contracts(tmp_path, tiny_qwen3, capsys):
    """The lead's recipe rows: `bench recipe` with a LiLiCorr variant and one with DFlash2's convolutions."""
    rd = make_run(tmp_path / "r", tiny_qwen3)  # a DFlash contract with a reduced draft vocab in the run config
    common = "drafter.type=lilicorr, drafter.draft_vocab_size=null, drafter.lilicorr_num_heads=4"
    variants = (f"{{lilicorr: [{common}], lilicorr+conv: [{common}, drafter.lilicorr_conv_kernel_size=2, "
                "drafter.lilicorr_conv_group_size=16]}")
    rc = main(["bench", "recipe", "--json", *overrides(rd, tiny_qwen3), "drafter.draft_vocab_size=40",
               "bench.recipe_steps=2", f"bench.recipe_variants={variants}"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0, out
    rows = {r["variant"]: r for r in out["variants"]}
    assert {rows[v]["drafter_type"] for v in ("lilicorr", "lilicorr+conv")} == {"lilicorr"}
    assert all(1.0 <= rows[v]["heldout_unary_tau"] <= 4.0 and 1.0 <= rows[v]["heldout_tau"] <= 4.0 for v in rows)
    own = json.loads((rd / "bench" / "recipe" / "lilicorr+conv" / "contract.json").read_text())
    assert (own["lilicorr_conv_kernel_size"], own["lilicorr_conv_group_size"]) == (2, 16)
