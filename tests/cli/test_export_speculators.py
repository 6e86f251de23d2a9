"""The vLLM speculators format: `dflashkit export --format speculators`, `dflashkit import` of both formats."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflashkit.cli import main
from dflashkit.config import TargetSection
from dflashkit.errors import UsageError
from dflashkit.export.hf import load_drafter, save_drafter
from dflashkit.export.speculators import drafter_format, export_speculators, load_speculators
from dflashkit.model.drafter import DFlashDraftModel
from dflashkit.target.load import load_target
from dflashkit.testing import random_drafter

VOCAB = [1, 10, 32, 97, 101, 115, 258, 300]  # a reduced draft vocabulary (sorted target ids)


@pytest.fixture(scope="module")
def target(tiny_qwen3):
    return load_target(TargetSection(path=str(tiny_qwen3), device="cpu", dtype="float32"))


def _drafter(target, reduced: bool) -> DFlashDraftModel:
    d = random_drafter(target, block_size=5, layers=2, seed=3)
    return DFlashDraftModel(d.contract, draft_vocab=torch.tensor(VOCAB)).eval() if reduced else d


def _trained_run(tmp_path: Path, target, reduced: bool) -> Path:
    rd = tmp_path / "run"
    save_drafter(_drafter(target, reduced), rd / "train" / "final", dtype="float32")  # as the trainer writes it
    return rd


def _logits(model: DFlashDraftModel, head: torch.Tensor) -> torch.Tensor:
    c = model.contract
    g = torch.Generator().manual_seed(7)
    noise = torch.randn(1, c.block_size, c.hidden_size, generator=g)
    ctx = torch.randn(1, 9, c.num_features * c.hidden_size, generator=g)
    with torch.inference_mode():
        return model(noise, ctx, torch.arange(9 + c.block_size)[None]) @ head.T


def _contract_facts(model: DFlashDraftModel) -> dict:
    c = model.contract
    return {"ids": c.target_layer_ids, "mask": c.mask_token_id, "block": c.block_size,
            "layers": c.num_draft_layers, "n_target": c.num_target_layers,
            "vocab": None if model.draft_vocab is None else model.draft_vocab.tolist()}


def _import(src: Path, rd: Path, tiny_qwen3) -> DFlashDraftModel:
    assert main(["import", str(src), f"target.path={tiny_qwen3}", "--run-dir", str(rd), "--json"]) == 0
    return load_drafter(rd / "train" / "final", dtype=torch.float32)


@pytest.mark.parametrize("reduced", [False, True], ids=["full-vocab", "draft-vocab"])
def test_both_formats_import_to_the_same_drafter(tmp_path, target, tiny_qwen3, reduced):
    rd = _trained_run(tmp_path, target, reduced)
    source = load_drafter(rd / "train" / "final", dtype=torch.float32)
    assert main(["export", f"target.path={tiny_qwen3}", "export.dtype=float32", "--run-dir", str(rd), "--json"]) == 0
    spec = tmp_path / "spec"
    assert main(["export", "--format", "speculators", f"target.path={tiny_qwen3}", "export.dtype=float32",
                 f"export.out_dir={spec}", "--run-dir", str(rd), "--json"]) == 0
    assert drafter_format(rd / "export") == "zlab" and drafter_format(spec) == "speculators"
    assert sorted(p.name for p in spec.iterdir()) == ["README.md", "config.json", "manifest.json", "model.safetensors"]

    # what vLLM's speculators adapter reads (vllm/transformers_utils/configs/speculators)
    cfg = json.loads((spec / "config.json").read_text())
    c = source.contract
    assert cfg["speculators_model_type"] == "dflash" and cfg["architectures"] == ["DFlashDraftModel"]
    assert [i - 1 for i in cfg["aux_hidden_state_layer_ids"]] == c.target_layer_ids   # vLLM subtracts 1
    assert cfg["mask_token_id"] == c.mask_token_id and cfg["block_size"] == c.block_size
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == c.block_size - 1
    verifier = cfg["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": str(Path(tiny_qwen3).resolve()), "architectures": ["Qwen3ForCausalLM"]}
    assert cfg["sliding_window_non_causal"] is True and cfg["sample_from_anchor"] is False
    layer = cfg["transformer_layer_config"]
    assert "dflash_config" not in layer and layer["num_hidden_layers"] == 2 and layer["model_type"] == "qwen3"
    head = target.lm_head.weight.detach()
    sd = load_file(spec / "model.safetensors")
    assert torch.equal(sd["embed_tokens.weight"], target.model.get_input_embeddings().weight.detach())
    rows = VOCAB if reduced else list(range(target.vocab_size))
    assert cfg["draft_vocab_size"] == len(rows) and torch.equal(sd["lm_head.weight"], head[rows])
    if reduced:
        assert (torch.arange(len(VOCAB)) + sd["d2t"]).tolist() == VOCAB and sd["t2d"].nonzero().flatten().tolist() == VOCAB
    else:
        assert "d2t" not in sd and "t2d" not in sd
    assert json.loads((spec / "manifest.json").read_text())["reload_check"]["max_diff_vs_source"] == 0.0

    a = _import(rd / "export", tmp_path / "from-zlab", tiny_qwen3)
    b = _import(spec, tmp_path / "from-spec", tiny_qwen3)
    assert _contract_facts(a) == _contract_facts(b) == _contract_facts(source)
    assert set(a.state_dict()) == set(b.state_dict())
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
    proj = head[VOCAB] if reduced else head
    torch.testing.assert_close(_logits(a, proj), _logits(source, proj), rtol=0, atol=0)
    torch.testing.assert_close(_logits(b, proj), _logits(source, proj), rtol=0, atol=0)
    for r in ("from-zlab", "from-spec"):
        assert json.loads((tmp_path / r / "contract.json").read_text())["num_target_layers"] == 6


def test_speculators_round_trip_is_byte_stable(tmp_path, target, tiny_qwen3):
    rd = _trained_run(tmp_path, target, reduced=True)
    first = tmp_path / "spec1"
    export_speculators(rd / "train" / "final", first, target=TargetSection(path=str(tiny_qwen3)), dtype="bfloat16")
    rd2 = tmp_path / "run2"
    _import(first, rd2, tiny_qwen3)  # speculators → our z-lab train/final
    second = tmp_path / "spec2"
    assert main(["export", "--format=speculators", f"target.path={tiny_qwen3}", "export.dtype=bfloat16",
                 f"export.out_dir={second}", "--run-dir", str(rd2), "--json"]) == 0
    assert (second / "config.json").read_bytes() == (first / "config.json").read_bytes()
    one, two = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert set(one) == set(two) and all(torch.equal(one[k], two[k]) for k in one)
    # and a speculators dir converts straight back to z-lab with `dflashkit export DIR`
    zl = tmp_path / "zl"
    assert main(["export", str(first), f"target.path={tiny_qwen3}", f"export.out_dir={zl}", "--run-dir",
                 str(tmp_path / "run3"), "--json"]) == 0
    assert drafter_format(zl) == "zlab" and load_drafter(zl).draft_vocab.tolist() == VOCAB


def _broken(spec: Path, tmp_path: Path, name: str, edit) -> Path:
    bad = tmp_path / name
    bad.mkdir()
    (bad / "model.safetensors").write_bytes((spec / "model.safetensors").read_bytes())
    cfg = json.loads((spec / "config.json").read_text())
    edit(cfg)
    (bad / "config.json").write_text(json.dumps(cfg))
    return bad


@pytest.mark.parametrize("name,edit,key", [
    ("no-aux", lambda c: c.pop("aux_hidden_state_layer_ids"), "aux_hidden_state_layer_ids"),
    ("no-mask", lambda c: c.pop("mask_token_id"), "mask_token_id"),
    ("no-verifier", lambda c: c["speculators_config"]["verifier"].pop("name_or_path"),
     "speculators_config.verifier.name_or_path"),
    ("no-layer", lambda c: c["transformer_layer_config"].pop("hidden_size"), "transformer_layer_config.hidden_size"),
    ("eagle", lambda c: c.update(speculators_model_type="eagle3"), "speculators_model_type"),
    ("anchor", lambda c: c.update(sample_from_anchor=True), "sample_from_anchor"),
    ("block", lambda c: c.update(block_size=9), "block_size"),
    ("mask-type", lambda c: c.update(mask_token_id="7"), "mask_token_id"),
    ("unknown", lambda c: [c.pop(k) for k in ("speculators_model_type", "speculators_config")], "dflash_config"),
])
def test_malformed_speculators_configs_exit_2_naming_the_key(tmp_path, target, tiny_qwen3, capsys, name, edit, key):
    spec = tmp_path / "spec"
    export_speculators(_save_plain(tmp_path, target), spec, target=TargetSection(path=str(tiny_qwen3)),
                       dtype="float32")
    bad = _broken(spec, tmp_path, name, edit)
    capsys.readouterr()
    assert main(["import", str(bad), f"target.path={tiny_qwen3}", "--run-dir", str(tmp_path / "r"), "--json"]) == 2
    out = capsys.readouterr().out
    err = json.loads(out.strip().splitlines()[-1])["error"]
    assert str(bad / "config.json") in err and f"`{key}`" in err, err
    assert not (tmp_path / "r" / "train").exists()


def _save_plain(tmp_path: Path, target) -> Path:
    src = tmp_path / "plain"
    save_drafter(random_drafter(target, block_size=4), src, dtype="float32")
    return src


def test_format_errors_are_clear(tmp_path, target, tiny_qwen3, capsys):
    spec = tmp_path / "spec"
    export_speculators(_save_plain(tmp_path, target), spec, target=TargetSection(path=str(tiny_qwen3)))
    with pytest.raises(UsageError, match="(?s)speculators-format checkpoint.*dflashkit import"):
        load_drafter(spec)  # the z-lab loader names the other format instead of "no dflash_config"
    assert load_speculators(spec).contract.block_size == 4
    # tensors that do not fit their config
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((spec / "config.json").read_text())
    sd = load_file(spec / "model.safetensors")
    sd["embed_tokens.weight"] = sd["embed_tokens.weight"][:-1]
    from safetensors.torch import save_file

    save_file(sd, str(bad / "model.safetensors"))
    with pytest.raises(UsageError, match="embed_tokens.weight has shape"):
        load_speculators(bad)
    # an unknown format value, and no target for the speculators export
    rd = _trained_run(tmp_path, target, reduced=False)
    assert main(["export", "--format", "safetensors", "--run-dir", str(rd), "--json"]) == 2
    assert "export.format" in capsys.readouterr().out
    assert main(["export", "--format", "speculators", "--run-dir", str(rd), "--json"]) == 2
    assert "target.path" in capsys.readouterr().out


def test_a_writer_that_drops_the_layer_offset_fails_the_reload_check(tmp_path, target, tiny_qwen3, monkeypatch):
    import dflashkit.export.speculators as spx

    rd = _trained_run(tmp_path, target, reduced=False)
    args = ["export", "--format", "speculators", f"target.path={tiny_qwen3}", "--run-dir", str(rd), "--json"]
    assert main(args) == 0
    before = (rd / "export" / "config.json").read_bytes()
    good = spx.speculators_config

    def no_offset(*a, **k):  # the classic silent bug: z-lab ids written as hidden-state indices
        cfg = good(*a, **k)
        cfg["aux_hidden_state_layer_ids"] = [i - 1 for i in cfg["aux_hidden_state_layer_ids"]]
        return cfg

    monkeypatch.setattr(spx, "speculators_config", no_offset)
    assert main(args) == 1
    assert (rd / "export" / "config.json").read_bytes() == before  # the previous export is untouched


def test_import_warns_when_the_stored_head_is_not_the_targets(tmp_path, target, tiny_qwen3, capsys):
    from safetensors.torch import save_file

    from dflashkit.export.speculators import head_mismatch

    spec = tmp_path / "spec"
    rd = _trained_run(tmp_path, target, reduced=True)
    export_speculators(rd / "train" / "final", spec, target=TargetSection(path=str(tiny_qwen3)), dtype="float32")
    assert head_mismatch(spec, TargetSection(path=str(tiny_qwen3))) == 0.0
    sd = load_file(spec / "model.safetensors")
    sd["lm_head.weight"] = sd["lm_head.weight"] * 1.5
    save_file(sd, str(spec / "model.safetensors"))
    capsys.readouterr()
    assert main(["import", str(spec), f"target.path={tiny_qwen3}", "--run-dir", str(tmp_path / "r"), "--json"]) == 0
    assert "lm_head.weight is not the target's head (max relative diff 0.5)" in capsys.readouterr().err
