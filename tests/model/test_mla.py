"""MLA draft attention (`drafter.attention_type: mla`): the layer ≡ transformers' DeepseekV3Attention on the same
weights, the training and decoding views agree (alone and mixed with sliding-window layers), it trains, decodes
lossless, exports to both formats and reloads to the same logits, Kimi K3-style MLA releases (scaled down: a K3.1
DFlash2 in the z-lab format, a K3 Block5 DSpark in the speculators format) import, warm-start and fine-tune,
mismatches are refused naming both sides, and `plan` counts its parameters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflashkit.cli import main
from dflashkit.config import TargetSection
from dflashkit.decode.api import SamplingParams
from dflashkit.decode.fast_draft import FastDraft
from dflashkit.decode.spec_decode import SpecDecoder
from dflashkit.errors import UsageError
from dflashkit.export.hf import load_drafter, load_shipped_model, save_drafter
from dflashkit.family import new_drafter
from dflashkit.model.drafter import DFlashDraftModel, DraftKVCache, MLAAttention, hf_config
from dflashkit.model.masks import dense_block_mask, layer_masks
from dflashkit.target.load import load_target
from dflashkit.testing import random_drafter
from dflashkit.train.objective import Anchors, block_position_ids
from tests.helpers import make_run, overrides, random_case, tiny_contract, with_fields

MLA = dict(attention_type="mla", mla_q_lora_rank=24, mla_kv_lora_rank=16, mla_qk_nope_head_dim=8,
           mla_qk_rope_head_dim=4, mla_v_head_dim=12)  # Kimi K3's ranks (1536, 512, 128 + 64, 128), scaled down
MIXED = ["sliding_attention", "full_attention"]


def _model(seed: int = 0, **over) -> DFlashDraftModel:
    torch.manual_seed(seed)
    model = DFlashDraftModel(with_fields(tiny_contract(), **{**MLA, **over})).eval()
    with torch.no_grad():  # norms off 1 so a mixed-up norm shows
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight"):
                p.add_(torch.randn_like(p) * 0.3)
    return model


# -- the layer ≡ transformers' DeepSeek-V3 MLA ----------------------------------------------------------------------
def _hf_attention(mine: MLAAttention, q_lora: int):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    cfg = DeepseekV3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora or None,
                           kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12,
                           rope_interleave=True, attention_bias=False, rms_norm_eps=1e-6, vocab_size=50,
                           max_position_embeddings=4096, rope_theta=10000.0)
    cfg._attn_implementation = "eager"
    theirs = DeepseekV3Attention(cfg, 0).eval()
    theirs.load_state_dict(mine.state_dict(), strict=True)  # the same tensor names, DeepSeek's
    return theirs, DeepseekV3RotaryEmbedding(cfg)


@pytest.mark.parametrize("q_lora", [24, 0])
@pytest.mark.parametrize("window,causal", [(None, False), (None, True), (3, True), (4, False)])
def test_mla_layer_equals_transformers_deepseek_v3_attention(q_lora, window, causal):
    """Block rows after t context rows: ours (context K/V projected by the layer, block queries) ≡ transformers'
    DeepseekV3Attention over the rows [context; block] with the block rows' mask (all context or its window, the
    whole block or offsets j <= i), on the same weights; with and without q-LoRA."""
    model = _model(mla_q_lora_rank=q_lora)
    mine = model.layers[0].self_attn
    assert isinstance(mine, MLAAttention) and hasattr(mine, "q_a_proj") == bool(q_lora)
    theirs, rotary = _hf_attention(mine, q_lora)
    g = torch.Generator().manual_seed(1)
    t, q = 7, 4
    c, x = torch.randn(1, t, 32, generator=g), torch.randn(1, q, 32, generator=g)
    pos = torch.arange(3, 3 + t + q)[None]
    cos, sin = model.rotary_emb(x, pos)
    ctx = torch.ones(q, t, dtype=torch.bool) if window is None else \
        torch.arange(3, 3 + t)[None, :] > pos[0, t:, None] - window
    block = torch.ones(q, q, dtype=torch.bool)
    mask = torch.cat([ctx, block.tril() if causal else block], dim=-1)         # the block rows' [q, t + q]
    with torch.no_grad():
        k, v = mine.context_kv(c, cos[:, :t], sin[:, :t])
        got = mine(x, k, v, cos[:, t:], sin[:, t:], mask[None, None])
        rows = torch.ones(t + q, t + q, dtype=torch.bool).tril()
        rows[t:] = mask
        additive = torch.zeros(t + q, t + q).masked_fill(~rows, torch.finfo(torch.float32).min)
        want, _ = theirs(torch.cat([c, x], dim=1), rotary(x, pos), additive[None, None])
    torch.testing.assert_close(got, want[:, t:], rtol=0, atol=2e-6)
    assert not torch.allclose(got, want[:, t:] * 0.9, atol=1e-4)  # the comparison can fail


# -- training view ≡ decoding views; the lean path declines ------------------------------------------------------------
@pytest.mark.parametrize("types,window", [(None, None), (MIXED, 3)])
def test_mla_decode_views_equal_the_training_view(types, window):
    model = _model(layer_types=types, sliding_window=window, causal=window is not None)
    s = 12
    g = torch.Generator().manual_seed(2)
    feats = torch.randn(1, s, 64, generator=g)
    a = Anchors(torch.tensor([[1, 4, 7, 11]]), torch.ones(1, 4, dtype=torch.bool))
    noise = torch.randn(1, 16, 32, generator=g)
    masks = layer_masks(dense_block_mask, a.anchors, a.keep, torch.tensor([s]), ctx_len=s, block_size=4,
                        causal=model.causal, windows=model.layer_windows, causals=model.layer_causal)
    with torch.no_grad():
        train = model(noise, feats, block_position_ids(a, ctx_len=s, block_size=4), attention_mask=masks)
    cache, done = DraftKVCache(), 0
    for j, anchor in enumerate(a.anchors[0].tolist()):
        blk = noise[:, j * 4:(j + 1) * 4]
        with torch.no_grad():
            whole = model(blk, feats[:, :anchor], torch.arange(anchor + 4)[None])
            cached = model(blk, feats[:, done:anchor], torch.arange(done, anchor + 4)[None], cache=cache)
        done = anchor
        torch.testing.assert_close(whole, train[:, j * 4:(j + 1) * 4], rtol=0, atol=1e-5)
        torch.testing.assert_close(cached, whole, rtol=0, atol=1e-5)
    assert cache.keys[0].shape == (1, 4, 11, 12) and cache.values[0].shape == (1, 4, 11, 12)  # heads × (8+4), × v 12
    assert not FastDraft.supports(model)


def test_mla_flex_forward_equals_dense_on_cpu():
    from dflashkit.model.masks import flex_block_mask

    model = _model(layer_types=MIXED, sliding_window=3, causal=True)
    lm, lens, a = random_case(1, s=16)
    b, s = lm.shape
    g = torch.Generator().manual_seed(6)
    feats = torch.randn(b, s, 64, generator=g)
    noise = torch.randn(b, a.anchors.shape[1] * 4, 32, generator=g)
    pos = block_position_ids(a, ctx_len=s, block_size=4)
    kw = dict(ctx_len=s, block_size=4, causal=True, windows=model.layer_windows, causals=model.layer_causal)
    with torch.no_grad():
        want = model(noise, feats, pos, attention_mask=layer_masks(dense_block_mask, a.anchors, a.keep, lens, **kw))
        got = model(noise, feats, pos, attention_mask=layer_masks(flex_block_mask, a.anchors, a.keep, lens, **kw))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_an_mla_drafter_overfits_one_batch():
    """Gradients reach every MLA tensor and the loss falls on a fixed batch (the dense training mask)."""
    model = _model().train()
    head = torch.randn(50, 32, generator=torch.Generator().manual_seed(3))
    lm, lens, a = random_case(4, s=12)
    s = lm.shape[1]
    g = torch.Generator().manual_seed(4)
    n = a.anchors.shape[1] * 4
    feats, noise = torch.randn(lm.shape[0], s, 64, generator=g), torch.randn(lm.shape[0], n, 32, generator=g)
    labels = torch.randint(0, 50, (lm.shape[0], n), generator=g)
    mask = dense_block_mask(a.anchors, a.keep, lens, ctx_len=s, block_size=4)
    pos = block_position_ids(a, ctx_len=s, block_size=4)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(25):
        loss = torch.nn.functional.cross_entropy((model(noise, feats, pos, attention_mask=mask) @ head.T).flatten(0, 1),
                                                 labels.flatten())
        opt.zero_grad()
        loss.backward()
        if not losses:
            assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters()
                       if ".self_attn." in n), "an MLA tensor gets no gradient"
        opt.step()
        losses.append(loss.item())
    assert all(map(lambda v: v == v and abs(v) < 1e9, losses)) and losses[-1] < 0.5 * losses[0], losses


def test_the_contract_checks_the_mla_knobs():
    with pytest.raises(UsageError, match="mla_qk_rope_head_dim 5 must be even"):
        with_fields(tiny_contract(), **{**MLA, "mla_qk_rope_head_dim": 5}).check()
    with pytest.raises(UsageError, match="attention_type must be one of gqa | mla"):
        with_fields(tiny_contract(), attention_type="sparse").check()
    with pytest.raises(UsageError, match="mla_kv_lora_rank: must be >= 1"):
        with_fields(tiny_contract(), **{**MLA, "mla_kv_lora_rank": 0}).check()


# -- train, decode, export, import, warm start (a tiny Qwen3 target) -----------------------------------------------------
@pytest.fixture(scope="module")
def target(tiny_qwen3):
    return load_target(TargetSection(path=str(tiny_qwen3), device="cpu", dtype="float32"))


@pytest.mark.parametrize("types,window", [(None, None), (MIXED, 3)])
def test_an_mla_drafter_trains_and_decodes_lossless(tmp_path, tiny_qwen3, target, types, window):
    rd = make_run(tmp_path / "run", tiny_qwen3, block_size=4, num_draft_layers=2, layer_types=types,
                  sliding_window=window, **MLA)
    assert main(["train", *overrides(rd, tiny_qwen3, train__max_steps=3)]) == 0
    drafter = load_drafter(rd / "train" / "final", dtype=torch.float32)
    assert isinstance(drafter.layers[0].self_attn, MLAAttention) and drafter.contract.attention["attention_type"] == "mla"
    params = SamplingParams(max_new_tokens=24)
    for prompt in ([1, 60, 61, 62, 63, 64, 10, 65, 66, 67, 68, 2, 10], [1, 5, 9, 14, 3, 77, 120, 4]):
        base = SpecDecoder(target, None, block_size=1).generate(prompt, params)
        for lean in (True, False):  # lean declines MLA: the module path
            r = SpecDecoder(target, drafter, block_size=4, lean=lean).generate(prompt, params)
            assert r.token_ids == base.token_ids, (prompt, lean)
            assert all(1 <= x <= 4 for x in r.acceptance_lengths)


def _logits(model, head: torch.Tensor, t: int = 9) -> torch.Tensor:
    c = model.contract
    g = torch.Generator().manual_seed(7)
    noise = torch.randn(1, c.block_size, c.hidden_size, generator=g)
    ctx = torch.randn(1, t, c.num_features * c.hidden_size, generator=g)
    with torch.inference_mode():
        return model(noise, ctx, torch.arange(t + c.block_size)[None]) @ head.T


@pytest.mark.parametrize("family_kw", [{}, {"drafter_type": "dflash2", "conv_group_size": 8, "selector_top_k": 4}])
def test_both_exports_carry_mla_and_reload_to_the_same_logits(tmp_path, tiny_qwen3, target, family_kw):
    source = random_drafter(target, block_size=4, layers=2, seed=3, layer_types=MIXED, sliding_window=3, causal=True,
                            **MLA, **family_kw)
    rd = tmp_path / "run"
    save_drafter(source, rd / "train" / "final", dtype="float32")
    assert main(["export", f"target.path={tiny_qwen3}", "export.dtype=float32", "--run-dir", str(rd), "--json"]) == 0
    zlab = rd / "export"
    cfg = json.loads((zlab / "config.json").read_text())
    assert cfg["dflash_config"]["attention"] == "mla"
    assert {k: cfg[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")} \
        == {"q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 12}
    manifest = json.loads((zlab / "manifest.json").read_text())["reload_check"]
    assert manifest["max_diff_shipped_vs_ours"] < 1e-5
    head = target.lm_head.weight.detach()
    want = _logits(source, head)
    shipped = load_shipped_model(zlab)  # the remote-code dflash.py builds MLA layers too
    assert type(shipped.layers[0].self_attn).__name__ == "DFlashMLASelfAttention"
    c = source.contract
    g = torch.Generator().manual_seed(7)
    noise, ctx = torch.randn(1, 4, c.hidden_size, generator=g), torch.randn(1, 9, 2 * c.hidden_size, generator=g)
    with torch.inference_mode():
        got = shipped(noise_embedding=noise, target_hidden=ctx, position_ids=torch.arange(13)[None])
    torch.testing.assert_close(got @ head.T, want, rtol=0, atol=1e-5)
    sources = [("from-zlab", zlab)]
    if not family_kw:  # DFlash2 travels in the z-lab format only with its selector keys; DFlash in both
        spec = tmp_path / "spec"
        assert main(["export", "--format", "speculators", f"target.path={tiny_qwen3}", "export.dtype=float32",
                     f"export.out_dir={spec}", "--run-dir", str(rd), "--json"]) == 0
        layer = json.loads((spec / "config.json").read_text())["transformer_layer_config"]
        assert layer["kv_lora_rank"] == 16 and layer["q_lora_rank"] == 24
        sources.append(("from-spec", spec))
    for name, src in sources:
        assert main(["import", str(src), f"target.path={tiny_qwen3}", "--run-dir", str(tmp_path / name), "--json"]) == 0
        back = load_drafter(tmp_path / name / "train" / "final", dtype=torch.float32)
        contract = json.loads((tmp_path / name / "contract.json").read_text())
        assert contract["attention_type"] == "mla" and contract["mla_kv_lora_rank"] == 16, name
        assert back.contract == source.contract, name
        torch.testing.assert_close(_logits(back, head), want, rtol=0, atol=0)


def _k3_style(tmp_path: Path, target, *, q_lora: int | None = 24) -> Path:
    """A drafter dir shaped like RadixArk's K3.1 DFlash2 (MLA layers with q-LoRA 1536 / kv-LoRA 512 / qk 128 + 64 /
    v 128, block-causal sliding window 1024), scaled down: config.json written by hand as a release ships it
    (DeepSeek's MLA keys at the top level, no dflash_config.attention, every layer sliding with no causality key),
    the weights of a random drafter of that shape."""
    d = tmp_path / f"k3-{q_lora}"
    mla = {**MLA, "mla_q_lora_rank": q_lora or 0}
    src = random_drafter(target, block_size=4, layers=2, seed=9, drafter_type="dflash2", conv_group_size=8,
                         selector_top_k=4, layer_types=["sliding_attention"] * 2, sliding_window=6, causal=True, **mla)
    save_drafter(src, d, dtype="float32")
    c = src.contract
    cfg = {"architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "hidden_size": c.hidden_size,
           "num_hidden_layers": 2, "num_attention_heads": c.num_attention_heads,
           "num_key_value_heads": c.num_attention_heads, "head_dim": c.head_dim,
           "intermediate_size": c.intermediate_size, "vocab_size": c.vocab_size, "rms_norm_eps": 1e-6,
           "rope_theta": 10000.0, "max_position_embeddings": 4096, "layer_types": ["sliding_attention"] * 2,
           "sliding_window": 6, "dtype": "float32", "block_size": 4,
           "q_lora_rank": q_lora, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 12,
           "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": c.target_layer_ids,
                             "conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 256, "selector_top_k": 4}}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_a_k3_style_mla_dflash2_imports_warm_starts_and_fine_tunes(tmp_path, tiny_qwen3, target):
    from dflashkit.train.warm_start import check_fits, read_warm_start, warm_start

    released = _k3_style(tmp_path, target)
    rd = tmp_path / "imp"
    assert main(["import", str(released), f"target.path={tiny_qwen3}", "--run-dir", str(rd), "--json"]) == 0
    contract = json.loads((rd / "contract.json").read_text())
    assert {k: contract[k] for k in MLA} == MLA and contract["drafter_type"] == "dflash2"
    back = load_drafter(rd / "train" / "final", dtype=torch.float32)
    assert back.layer_windows == [6, 6] and back.layer_causal == [True, True]  # block-causal sliding, as vLLM reads it
    src = read_warm_start(released)
    fresh = new_drafter(src.contract)
    warm_start(fresh, src, src.contract)
    head = target.lm_head.weight.detach()
    torch.testing.assert_close(_logits(fresh, head), _logits(back, head), rtol=0, atol=0)
    # drafter.init=<the release> in a run of the same shape: fine-tunes
    run = make_run(tmp_path / "ft", tiny_qwen3, contract=src.contract)
    assert main(["train", *overrides(run, tiny_qwen3, train__max_steps=2), f"drafter.init={released}",
                 "drafter.type=dflash2"]) == 0
    # no q-LoRA (a null q_lora_rank, DeepSeek-V2-Lite's way): one q_proj
    plain = read_warm_start(_k3_style(tmp_path, target, q_lora=None))
    assert plain.contract.knobs.mla_q_lora_rank == 0 and "layers.0.self_attn.q_proj.weight" in plain.state
    with pytest.raises(UsageError) as e:  # a GQA run, or other ranks: refused, both sides named
        check_fits(src, with_fields(src.contract, attention_type="gqa"))
    assert "the drafter's {'attention_type': 'mla'" in str(e.value) and "this run's {'attention_type': 'gqa'}" in str(e.value)
    with pytest.raises(UsageError, match="'mla_kv_lora_rank': 16.*'mla_kv_lora_rank': 32"):
        check_fits(src, with_fields(src.contract, mla_kv_lora_rank=32))
    check_fits(src, src.contract)
    check_fits(src, with_fields(src.contract, head_dim=64, num_key_value_heads=1))  # unused by MLA layers


def _k3_block5(tmp_path: Path, target) -> tuple[DFlashDraftModel, Path]:
    """Inferact's K3 DSpark Block5 shape scaled down (3 full-causal MLA layers, block 5, the Markov and confidence
    heads) in the speculators format: (the random drafter written, its dir)."""
    from dflashkit.export.speculators import write_speculators

    src = random_drafter(target, block_size=5, layers=3, seed=4, drafter_type="dspark", dspark_markov_rank=6,
                         causal=True, **MLA)
    out = tmp_path / "k3-block5"
    write_speculators(src, out, verifier="moonshotai/Kimi-K3-scaled", verifier_architectures=["X"], dtype="float32",
                      embed=target.model.get_input_embeddings().weight.detach(), head=target.lm_head.weight.detach())
    return src, out


def test_a_k3_block5_style_mla_dspark_imports_warm_starts_and_fine_tunes(tmp_path, tiny_qwen3, target):
    """Inferact's Kimi-K3 DSpark Block5 shape scaled down: 3 full-causal MLA layers, block 5, the Markov and
    confidence heads, shipped in vLLM's speculators format. `import` adopts it (MLA ranks, causality, heads);
    `drafter.init` warm-starts to the same logits and `dflashkit train` fine-tunes from it; a GQA run is refused
    naming both attentions."""
    from dflashkit.train.warm_start import check_fits, read_warm_start, warm_start

    src, released = _k3_block5(tmp_path, target)
    head = target.lm_head.weight.detach()
    rd = tmp_path / "imp"
    assert main(["import", str(released), f"target.path={tiny_qwen3}", "--run-dir", str(rd), "--json"]) == 0
    contract = json.loads((rd / "contract.json").read_text())
    assert {k: contract[k] for k in MLA} == MLA and contract["drafter_type"] == "dspark"
    assert contract["block_size"] == 5 and contract["dspark_markov_rank"] == 6
    back = load_drafter(rd / "train" / "final", dtype=torch.float32)
    assert back.layer_causal == [True] * 3 and back.layer_windows == [None] * 3
    assert isinstance(back.layers[0].self_attn, MLAAttention) and back.confidence_head is not None
    warm = read_warm_start(released)
    fresh = new_drafter(warm.contract)
    warm_start(fresh, warm, warm.contract)
    want = _logits(src, head)
    torch.testing.assert_close(_logits(fresh, head), want, rtol=0, atol=0)
    torch.testing.assert_close(_logits(back, head), want, rtol=0, atol=0)
    for name, v in src.state_dict().items():
        if "_head." in name:
            assert torch.equal(fresh.state_dict()[name], v), name
    run = make_run(tmp_path / "ft", tiny_qwen3, contract=warm.contract)
    assert main(["train", *overrides(run, tiny_qwen3, train__max_steps=2), f"drafter.init={released}",
                 "drafter.type=dspark"]) == 0
    with pytest.raises(UsageError) as e:
        check_fits(warm, with_fields(warm.contract, attention_type="gqa"))
    msg = str(e.value)
    assert "the drafter's {'attention_type': 'mla'" in msg and "this run's {'attention_type': 'gqa'}" in msg


def test_import_refuses_an_mla_drafter_into_a_gqa_run_naming_both(tmp_path, tiny_qwen3, target, capsys):
    released = _k3_style(tmp_path, target)
    rd = make_run(tmp_path / "gqa", tiny_qwen3, contract=with_fields(read_contract(released), attention_type="gqa"))
    assert main(["import", str(released), f"target.path={tiny_qwen3}", "--run-dir", str(rd)]) == 2
    err = capsys.readouterr().err
    assert "attention_type: 'mla' in" in err and "'gqa' in" in err and str(rd / "contract.json") in err




@pytest.mark.parametrize("kind", ["k3.1-dflash2", "k3-block5-dspark"])
@pytest.mark.parametrize(("field", "value"), [("target_layer_ids", [0]), ("hidden_size", 48), ("num_draft_layers", 1),
                                              ("vocab_size", 384), ("mla_kv_lora_rank", 32),
                                              ("mla_qk_rope_head_dim", 8)])
def test_dflashkit_train_from_an_mla_release_into_a_run_it_does_not_fit_exits_2_naming_both(
        tmp_path, tiny_qwen3, target, capsys, kind, field, value):
    """`dflashkit train drafter.init=<an MLA release>` (the K3.1-style DFlash2 in the z-lab format, the K3
    Block5-style DSpark in the speculators format) where the run differs in taps, hidden size, layer count, target
    vocab or an MLA rank: exit 2 before any step, stderr naming the field with both values, nothing trained."""
    from dflashkit.train.warm_start import read_warm_start

    released = _k3_style(tmp_path, target) if kind == "k3.1-dflash2" else _k3_block5(tmp_path, target)[1]
    src = read_warm_start(released)
    run = with_fields(src.contract, **{field: value})
    rd = make_run(tmp_path / "run", tiny_qwen3, contract=run)
    argv = ["train", *overrides(rd, tiny_qwen3, train__max_steps=1), f"drafter.init={released}",
            f"drafter.type={src.contract.drafter_type}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "does not fit this run's drafter contract" in err and field in err, err[-2000:]
    assert str(getattr(src.contract, field, None) or getattr(src.contract.knobs, field)) in err and str(value) in err
    assert "Traceback" not in err and not (rd / "train" / "final").exists()


def read_contract(d: Path):
    from dflashkit.train.warm_start import read_warm_start

    return read_warm_start(d).contract


def test_malformed_mla_configs_are_refused_naming_the_key(tmp_path, target):
    released = _k3_style(tmp_path, target)
    cfg = json.loads((released / "config.json").read_text())
    for key, value, words in (("qk_rope_head_dim", None, "without ['qk_rope_head_dim']"),
                              ("kv_lora_rank", "16", "kv_lora_rank must be an integer")):
        bad = {**cfg, key: value} if value is not None else {k: v for k, v in cfg.items() if k != key}
        (released / "config.json").write_text(json.dumps(bad))
        with pytest.raises(UsageError, match=words.replace("[", r"\[").replace("]", r"\]")):
            load_drafter(released)
    (released / "config.json").write_text(json.dumps({**cfg, "dflash_config": {**cfg["dflash_config"],
                                                                                "attention": "sparse"}}))
    with pytest.raises(UsageError, match="dflash_config.attention 'sparse' is not gqa or mla"):
        load_drafter(released)


# -- plan ---------------------------------------------------------------------------------------------------------------
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "configs"


@pytest.mark.parametrize("extra", [["drafter.attention_type=mla", "drafter.num_draft_layers=5"],
                                   ["drafter.attention_type=mla", "drafter.mla_q_lora_rank=0"], []])
def test_plan_counts_the_parameters_of_an_mla_drafter(tmp_path, capsys, extra):
    """`plan` on Kimi K2.6's config (MLA drafter, K3-shaped; and the recipe's GQA one): the printed parameter count
    is the meta-device count of the drafter the contract builds."""
    from dflashkit.config import load_config
    from dflashkit.sizing.estimate import contract_and_facts
    from dflashkit.rundir import RunDir

    k = str(FIXTURES / "kimi-k2.6")
    args = [k, "8x141", "data.num_prompts=1000", "data.mean_tokens=2000", "--run-dir", str(tmp_path), *extra]
    assert main(["plan", *args]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("drafter "))
    printed = int(line.split("M params (")[1].split(";")[0])
    cfg = load_config(None, extra)
    contract, _, _ = contract_and_facts(cfg, RunDir(tmp_path), k)
    with torch.device("meta"):
        model = DFlashDraftModel(contract)
    assert printed == sum(p.numel() for p in model.parameters())
    assert ("attention mla 64 heads" in line) == bool(extra)
    assert ("q-LoRA 1536" in line) == (extra[1:] == ["drafter.num_draft_layers=5"])
    assert isinstance(model.layers[0].self_attn, MLAAttention) == bool(extra)
    assert hf_config(contract).head_dim == (64 if extra else contract.head_dim)


# -- an MLA target (DeepSeek-V3 architecture, as Kimi K2): init from its layers, decode lossless --------------------------
def test_an_mla_drafter_starts_from_an_mla_targets_layers_and_decodes_lossless(tiny_targets):
    """`drafter.init: target` copies a DeepSeek-V3 target's MLA tensors (same names, same shapes) into an MLA drafter,
    whose attention then computes the target layer's on the same rows; a GQA drafter takes none of them (skipped by
    shape, never a crash); the MLA drafter decodes the target losslessly."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    from dflashkit.model.init import init_from_target

    target = load_target(TargetSection(path=str(tiny_targets["deepseek_v3"]), device="cpu", dtype="float32"))
    mla = dict(attention_type="mla", mla_q_lora_rank=48, mla_kv_lora_rank=32, mla_qk_nope_head_dim=16,
               mla_qk_rope_head_dim=8, mla_v_head_dim=16)
    drafter = random_drafter(target, block_size=4, layers=2, seed=2, rope_theta=50000.0, **mla)
    report = init_from_target(drafter, target, layer_ids=[1, 2])
    names = ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")
    assert {f"layers.{i}.self_attn.{n}.weight" for i in (0, 1) for n in names} <= set(report["copied"])
    theirs = target.decoder_layers[1].self_attn
    mine = drafter.layers[0].self_attn
    g = torch.Generator().manual_seed(3)
    rows, pos = torch.randn(1, 6, 64, generator=g), torch.arange(6)[None]
    cos, sin = drafter.rotary_emb(rows, pos)
    with torch.no_grad():
        k, v = mine.context_kv(rows[:, :2], cos[:, :2], sin[:, :2])
        got = mine(rows[:, 2:], k, v, cos[:, 2:], sin[:, 2:], None)
        rows_mask = torch.zeros(6, 6).masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
        rows_mask[2:] = 0.0  # the block rows see the context and their whole block
        want, _ = theirs(rows, DeepseekV3RotaryEmbedding(target.config)(rows, pos), rows_mask[None, None])
    torch.testing.assert_close(got, want[:, 2:], rtol=0, atol=1e-5)
    gqa = random_drafter(target, block_size=4, layers=2, seed=2)
    plain = init_from_target(gqa, target, layer_ids=[1, 2])
    assert not any("q_a_proj" in n or "kv_b_proj" in n for n in plain["copied"])
    params = SamplingParams(max_new_tokens=16)
    for prompt in ([1, 60, 61, 62, 63, 64, 10, 65], [1, 5, 9, 14, 3, 77, 120, 4]):
        base = SpecDecoder(target, None, block_size=1).generate(prompt, params)
        r = SpecDecoder(target, drafter, block_size=4).generate(prompt, params)
        assert r.token_ids == base.token_ids, prompt
