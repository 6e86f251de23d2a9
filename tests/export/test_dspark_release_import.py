"""A released-style DSpark checkpoint (vLLM speculators format, `speculators_model_type: dspark`) is read as a
DSpark drafter keeping its vocabulary, taps and block size, warm-starts `drafter.init` (and `dflashkit train`
fine-tunes from it), and refuses (exit 2, naming both sides) a run whose contract or draft vocabulary it does not
fit (its Markov head has a row per draft-vocab entry).

The fixture has the SHAPE of novita's Kimi-K2.6 DSpark scaled down: 3 GQA draft layers, a hidden size the
target's (7168 → 32), block size 8, taps `aux_hidden_state_layer_ids` [1, 29, 57] of a 61-layer target, and a
pruned draft vocabulary (32k of 160k → 24 of 320) shipped as `lm_head.weight` [V', H] with vLLM's `d2t` offsets
and the `t2d` mask, beside the verifier's `embed_tokens.weight` copy; the config is written key by key as
vLLM's `dspark` speculators reader takes it (`transformers_utils/configs/speculators/algos.py`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dflashkit.errors import UsageError
from dflashkit.export.speculators import load_any_drafter
from dflashkit.family import new_drafter
from dflashkit.family.contract import DrafterContract
from dflashkit.model.draft_vocab import t2d_mask, to_offsets
from dflashkit.train.warm_start import WarmSource, check_draft_vocab_fits, check_fits, read_warm_start, warm_start
from tests.helpers import train_loss, with_fields

H, LAYERS, BLOCK, V, R = 32, 3, 8, 320, 6   # V: the tiny targets' vocab (target/tiny.py)
AUX = [1, 29, 57]                     # K2.6's taps: hidden_states indices (target_layer_ids + 1)
VOCAB = torch.tensor(sorted({0, 1, 2, 5, 8, 13, 21, 34, 40, 41, 47, 50, 55, 60, 63, 66, 70, 72, 77, 80, 84, 89, 91, 95}))
MASK = 300


def _layer_config() -> dict:
    return {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": H,
            "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "intermediate_size": 64, "vocab_size": V, "hidden_act": "silu", "rms_norm_eps": 1e-6,
            "max_position_embeddings": 4096, "rope_theta": 50000.0, "attention_bias": False,
            "tie_word_embeddings": False}


def write_k26_like_dspark(out: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """config.json + model.safetensors of a released-style speculators DSpark drafter; returns its tensors."""
    cfg = {"architectures": ["Qwen3DSparkModel"], "speculators_model_type": "dspark",
           "transformer_layer_config": _layer_config(), "draft_vocab_size": int(VOCAB.numel()), "block_size": BLOCK,
           "aux_hidden_state_layer_ids": AUX, "mask_token_id": MASK, "target_hidden_size": H,
           "markov_rank": R, "markov_head_type": "vanilla", "enable_confidence_head": True,
           "confidence_head_with_markov": False, "sample_from_anchor": False, "sliding_window_non_causal": True,
           "dtype": "float32",
           "speculators_config": {"algorithm": "dspark", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": BLOCK - 1,
                                                        "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                                  "verifier": {"name_or_path": "moonshotai/Kimi-K2.6-scaled",
                                               "architectures": ["DeepseekV3ForCausalLM"]}}}
    g = torch.Generator().manual_seed(seed)
    t: dict[str, torch.Tensor] = {"fc.weight": torch.randn(H, len(AUX) * H, generator=g) * 0.1,
                                  "hidden_norm.weight": 1 + 0.1 * torch.randn(H, generator=g),
                                  "norm.weight": 1 + 0.1 * torch.randn(H, generator=g)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        shapes = {"self_attn.q_proj.weight": (32, H), "self_attn.k_proj.weight": (16, H),
                  "self_attn.v_proj.weight": (16, H), "self_attn.o_proj.weight": (H, 32),
                  "self_attn.q_norm.weight": (8,), "self_attn.k_norm.weight": (8,),
                  "mlp.gate_proj.weight": (64, H), "mlp.up_proj.weight": (64, H), "mlp.down_proj.weight": (H, 64),
                  "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,)}
        for k, s in shapes.items():
            t[p + k] = (1 + 0.1 * torch.randn(s, generator=g)) if len(s) == 1 else torch.randn(s, generator=g) * 0.1
    t["markov_head.markov_w1.weight"] = torch.randn(V, R, generator=g)
    t["markov_head.markov_w2.weight"] = torch.randn(int(VOCAB.numel()), R, generator=g)
    t["confidence_head.proj.weight"] = torch.randn(1, H, generator=g)
    t["confidence_head.proj.bias"] = torch.randn(1, generator=g)
    t["lm_head.weight"] = torch.randn(int(VOCAB.numel()), H, generator=g)
    t["embed_tokens.weight"] = torch.randn(V, H, generator=g)
    t["d2t"] = to_offsets(VOCAB)
    t["t2d"] = t2d_mask(VOCAB, V)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() for k, v in t.items()}, str(out / "model.safetensors"))
    return t


def _run_contract(src: DrafterContract, **changes) -> DrafterContract:
    return with_fields(src, **changes) if changes else src


def test_a_released_style_dspark_checkpoint_is_read_with_its_vocab_taps_and_block(tmp_path):
    tensors = write_k26_like_dspark(tmp_path / "k26")
    model, fmt = load_any_drafter(tmp_path / "k26", dtype=torch.float32)
    c = model.contract
    assert fmt == "speculators" and c.drafter_type == "dspark"
    assert c.block_size == BLOCK and list(c.target_layer_ids) == [i - 1 for i in AUX]
    assert (c.hidden_size, c.num_draft_layers, c.vocab_size, c.mask_token_id) == (H, LAYERS, V, MASK)
    k = c.knobs
    assert (k.dspark_markov_rank, k.dspark_confidence_head, k.dspark_confidence_with_markov) == (R, True, False)
    assert model.draft_vocab is not None and torch.equal(model.draft_vocab.cpu(), VOCAB)
    state = model.state_dict()
    for name in ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
                 "layers.2.mlp.down_proj.weight", "fc.weight"):
        assert torch.equal(state[name], tensors[name]), name


def test_drafter_init_warm_starts_from_it_and_fine_tuning_steps_run(tmp_path):
    write_k26_like_dspark(tmp_path / "k26")
    src = read_warm_start(tmp_path / "k26")
    run = src.contract
    drafter = new_drafter(run, draft_vocab=src.vocab)
    report = warm_start(drafter, src, run)
    assert report["format"] == "speculators" and report["draft_vocab"] == "kept"
    assert report["block_size"] == {"source": BLOCK, "run": BLOCK}
    for name, v in src.state.items():
        assert torch.equal(drafter.state_dict()[name], v), name
    # two fine-tuning steps on random features: the loss is finite and the Markov head moves
    from dflashkit.model.draft_vocab import restricted_head
    from dflashkit.train.loss import Heads, LossInputs
    from tests.helpers import random_case

    g = torch.Generator().manual_seed(1)
    embed, head = torch.nn.Embedding(V, H), torch.nn.Linear(H, V, bias=False)
    lm, lens, a = random_case(0, b=2, s=20, block=BLOCK, num_anchors=2)
    x = LossInputs(torch.randn(2, 20, len(AUX) * H, generator=g), VOCAB[torch.randint(0, len(VOCAB), lm.shape, generator=g)],
                   lm, lens)
    loss = train_loss(run, gamma=4.0)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-3)
    w1 = drafter.markov_head.markov_w1.weight.detach().clone()
    for _ in range(2):
        opt.zero_grad()
        out = loss(drafter, Heads(embed, restricted_head(head, VOCAB), VOCAB, head), x, a)
        assert torch.isfinite(out.loss)
        out.loss.backward()
        opt.step()
    assert not torch.equal(drafter.markov_head.markov_w1.weight.detach(), w1)


@pytest.mark.parametrize(("field", "value", "said"), [
    ("target_layer_ids", [0, 29, 56], "target_layer_ids"),
    ("hidden_size", 48, "hidden_size"),
    ("vocab_size", 384, "vocab_size"),
    ("num_draft_layers", 2, "num_draft_layers"),
])
def test_a_run_it_does_not_fit_is_refused_naming_both_sides(tmp_path, field, value, said):
    write_k26_like_dspark(tmp_path / "k26")
    src = read_warm_start(tmp_path / "k26")
    with pytest.raises(UsageError) as e:
        check_fits(src, _run_contract(src.contract, **{field: value}))
    msg = str(e.value)
    assert e.value.exit_code == 2 and said in msg and str(getattr(src.contract, field)) in msg and str(value) in msg


def test_a_block_size_other_than_the_speculative_tokens_is_refused(tmp_path):
    write_k26_like_dspark(tmp_path / "k26")
    cfg = json.loads((tmp_path / "k26" / "config.json").read_text())
    cfg["block_size"] = 16
    (tmp_path / "k26" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UsageError) as e:
        load_any_drafter(tmp_path / "k26")
    assert e.value.exit_code == 2 and "block_size" in str(e.value) and "16" in str(e.value) and "7" in str(e.value)


def test_our_speculators_export_of_a_dspark_drafter_reads_back_with_its_heads(tmp_path):
    """The writer carries the DSpark keys vLLM's `dspark` reader copies (markov_rank, the confidence flags)."""
    from dflashkit.export.speculators import write_speculators

    src, _ = load_any_drafter(_k26(tmp_path), dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    write_speculators(src, tmp_path / "spec", verifier="v", verifier_architectures=["X"], dtype="float32",
                      embed=torch.randn(V, H, generator=g), head=torch.randn(V, H, generator=g))
    cfg = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert (cfg["speculators_model_type"], cfg["markov_rank"], cfg["enable_confidence_head"],
            cfg["confidence_head_with_markov"], cfg["markov_head_type"]) == ("dspark", R, True, False, "vanilla")
    back, fmt = load_any_drafter(tmp_path / "spec", dtype=torch.float32)
    assert fmt == "speculators" and back.contract.knobs == src.contract.knobs
    theirs = back.state_dict()
    for name, v in src.state_dict().items():
        if "_head." in name:
            assert torch.equal(theirs[name], v), name


def _k26(tmp_path: Path) -> Path:
    write_k26_like_dspark(tmp_path / "k26")
    return tmp_path / "k26"


def test_dflashkit_import_adopts_it_keeping_its_vocab_taps_and_block(tmp_path):
    from dflashkit.cli import main
    from dflashkit.export.hf import load_drafter
    from dflashkit.target.tiny import make_tiny_target

    target = make_tiny_target(tmp_path / "target", "qwen3", num_layers=58, hidden=H)  # taps up to layer 56
    rd = tmp_path / "run"
    assert main(["import", str(_k26(tmp_path)), f"target.path={target}", "--run-dir", str(rd), "--json"]) == 0
    got = load_drafter(rd / "train" / "final", dtype=torch.float32)
    c = got.contract
    assert c.drafter_type == "dspark" and c.block_size == BLOCK and list(c.target_layer_ids) == [i - 1 for i in AUX]
    assert got.draft_vocab is not None and torch.equal(got.draft_vocab.cpu(), VOCAB)
    contract = json.loads((rd / "contract.json").read_text())
    assert contract["block_size"] == BLOCK and contract["num_target_layers"] == 58


def test_a_run_with_another_block_size_warm_starts_from_it(tmp_path):
    """The recipe's block size (here 16) may differ from the checkpoint's 8: no draft weight depends on it."""
    src = read_warm_start(_k26(tmp_path))
    run = with_fields(src.contract, block_size=16)
    drafter = new_drafter(run, draft_vocab=src.vocab)
    report = warm_start(drafter, src, run)
    assert report["block_size"] == {"source": BLOCK, "run": 16}
    assert torch.equal(drafter.markov_head.markov_w2.weight, src.state["markov_head.markov_w2.weight"])


@pytest.mark.parametrize("size", [None, 64, 320])
def test_a_run_with_another_draft_vocab_is_refused_naming_both(tmp_path, size):
    """The Markov head's markov_w2 has a row per draft-vocab entry: a run over another V' (or the full vocab) cannot
    take it; before any work, exit 2, naming both vocabularies and the tensor. Its own V' passes."""
    src = read_warm_start(_k26(tmp_path))
    with pytest.raises(UsageError) as e:
        check_draft_vocab_fits(src, src.contract, size)
    msg = str(e.value)
    assert e.value.exit_code == 2 and "draft vocabulary (24 tokens)" in msg, msg
    assert ("(64 tokens)" if size == 64 else "the full vocab") in msg, msg
    assert f"markov_head.markov_w2.weight: the drafter's [24, {R}] != this run's [{size or V}, {R}]" in msg, msg
    assert "drafter.draft_vocab_size=24" in e.value.hint
    check_draft_vocab_fits(src, src.contract, 24)
    full = read_warm_start(_k26(tmp_path))
    full.vocab = None  # a full-vocab source into a reduced-vocab run: refused the same way
    full.state["markov_head.markov_w2.weight"] = torch.zeros(V, R)
    with pytest.raises(UsageError, match=r"\(the full vocab\) != this run's \(64 tokens\)"):
        check_draft_vocab_fits(full, src.contract, 64)
    check_draft_vocab_fits(full, src.contract, None)


def _train_from_release(tmp_path: Path, *extra: str, **run_changes) -> tuple[int, Path, WarmSource]:
    """`dflashkit train drafter.init=<the K2.6-style release> drafter.type=dspark` (+ `extra`) into a run whose
    contract is the release's with `run_changes` → (exit code, the run dir, the release). The run dir holds only
    the contract: it is all the warm-start checks read (they run before the tokenized data is opened)."""
    from dflashkit.cli import main
    from dflashkit.target.tiny import make_tiny_target
    from tests.helpers import overrides

    target = make_tiny_target(tmp_path / "target", "qwen3", num_layers=58, hidden=H)
    src = read_warm_start(_k26(tmp_path))
    rd = tmp_path / "run"
    rd.mkdir()
    run = with_fields(src.contract, num_target_layers=58, **run_changes)
    (rd / "contract.json").write_text(json.dumps(run.to_dict()))
    argv = ["train", *overrides(rd, target, train__max_steps=1), f"drafter.init={tmp_path / 'k26'}",
            "drafter.type=dspark", *extra]
    return main(argv), rd, src


def test_drafter_init_with_another_draft_vocab_exits_2_before_training(tmp_path, capsys):
    """`dflashkit train drafter.init=<the release>` over the full vocab: exit 2 naming both, nothing trained."""
    rc, rd, _ = _train_from_release(tmp_path)
    assert rc == 2
    err = capsys.readouterr().err
    assert "draft vocabulary (24 tokens)" in err and "the full vocab" in err and "markov_w2" in err, err[-2000:]
    assert not (rd / "train" / "final").exists()


def test_dflashkit_train_fine_tunes_it_keeping_its_vocab(tmp_path):
    """`dflashkit train drafter.init=<the release> drafter.draft_vocab_size=24`: the run starts from its weights and
    its d2t (not a vocab chosen from this run's data) and two steps move the Markov head."""
    from safetensors.torch import load_file

    from dflashkit.cli import main
    from dflashkit.target.tiny import make_tiny_target
    from tests.helpers import make_run, overrides

    target = make_tiny_target(tmp_path / "target", "qwen3", num_layers=58, hidden=H)
    tensors = write_k26_like_dspark(tmp_path / "k26")
    src = read_warm_start(tmp_path / "k26")
    rd = make_run(tmp_path / "run", target, contract=with_fields(src.contract, num_target_layers=58))
    argv = ["train", *overrides(rd, target, train__max_steps=2), f"drafter.init={tmp_path / 'k26'}",
            "drafter.type=dspark", "drafter.draft_vocab_size=24"]
    assert main(argv) == 0
    final = load_file(rd / "train" / "final" / "model.safetensors")
    assert torch.equal(final["d2t"].long(), tensors["d2t"].long())
    w2 = final["markov_head.markov_w2.weight"]
    assert w2.shape == tensors["markov_head.markov_w2.weight"].shape
    assert not torch.equal(w2, tensors["markov_head.markov_w2.weight"])
    assert torch.allclose(w2, tensors["markov_head.markov_w2.weight"], atol=0.1)  # two small steps from it


@pytest.mark.parametrize(("field", "value"), [("target_layer_ids", [0, 29, 56]), ("hidden_size", 48),
                                              ("num_draft_layers", 2), ("vocab_size", 384)])
def test_dflashkit_train_from_it_into_a_run_it_does_not_fit_exits_2_naming_both(tmp_path, capsys, field, value):
    """`dflashkit train drafter.init=<the release>` where the run's contract differs in taps, hidden size, layer
    count or target vocab: exit 2 before any step, stderr naming the field with the release's value and the run's,
    nothing trained."""
    rc, rd, src = _train_from_release(tmp_path, "drafter.draft_vocab_size=24", **{field: value})
    assert rc == 2
    err = capsys.readouterr().err
    assert "does not fit this run's drafter contract" in err and field in err, err[-2000:]
    assert str(getattr(src.contract, field)) in err and str(value) in err, err[-2000:]
    assert "Traceback" not in err and not (rd / "train").exists()
