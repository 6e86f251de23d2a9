"""Sliding-window draft layers (`drafter.layer_types` / `drafter.sliding_window`): a block query at position p sees
the context keys p − W < k < anchor only, in the training masks (dense == flex == a per-query oracle), in the module
forward, its decode cache and the lean decoder (each == the training view), a window covering the sequence is full
attention, a sliding drafter trains and decodes lossless, and both export formats carry it and read back; a released
config.json with mixed layer_types imports and warm-starts, without a causality key as vLLM reads it (causal in the
sliding layers only)."""

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
from dflashkit.export.hf import load_drafter, load_shipped_model, save_drafter
from dflashkit.model.drafter import DFlashDraftModel, DraftKVCache
from dflashkit.model.masks import dense_block_mask, layer_masks, mask_mod_for
from dflashkit.target.load import load_target
from dflashkit.testing import random_drafter
from dflashkit.train.objective import Anchors, block_position_ids
from tests.helpers import make_contract, make_run, overrides, random_case, tiny_contract, with_fields

MIXED = ["sliding_attention", "full_attention"]


def oracle(anchors, keep, lens, *, ctx_len: int, block: int, window: int | None, causal: bool) -> torch.Tensor:
    """The rule per query, as loops: query offset k of block j sits at p = anchor + k; it sees context key i iff
    the block is real, i < anchor, i < len and (no window or p − W < i); block keys: its own block (causal: j <= k)."""
    b, n = len(anchors), len(anchors[0])
    out = torch.zeros(b, 1, n * block, ctx_len + n * block, dtype=torch.bool)
    for bi in range(b):
        for j in range(n):
            a = anchors[bi][j]
            for k in range(block):
                p, q = a + k, j * block + k
                for i in range(ctx_len):
                    out[bi, 0, q, i] = keep[bi][j] and i < a and i < lens[bi] and (window is None or i > p - window)
                for kk in range(block):
                    out[bi, 0, q, ctx_len + j * block + kk] = kk <= k or not causal
    return out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [1, 2, 3, 5, 100])
@pytest.mark.parametrize("seed", range(3))
def test_sliding_masks_equal_the_per_query_oracle(seed, window, causal):
    from torch.nn.attention.flex_attention import create_mask

    lm, lens, a = random_case(seed, s=13, block=4, num_anchors=5)
    want = oracle(a.anchors.tolist(), a.keep.tolist(), lens.tolist(), ctx_len=13, block=4, window=window, causal=causal)
    got = dense_block_mask(a.anchors, a.keep, lens, ctx_len=13, block_size=4, causal=causal, window=window)
    assert torch.equal(got, want)
    mod = mask_mod_for(a.anchors, a.keep, lens, ctx_len=13, block_size=4, causal=causal, window=window)
    n = a.anchors.shape[1]
    assert torch.equal(create_mask(mod, a.anchors.shape[0], None, n * 4, 13 + n * 4, device="cpu"), want)
    full = dense_block_mask(a.anchors, a.keep, lens, ctx_len=13, block_size=4, causal=causal)
    assert not (got & ~full).any()  # a window only ever hides keys
    if window <= 3:
        assert (full & ~got).any()


def test_layer_masks_one_per_distinct_window():
    lm, lens, a = random_case(0)
    kw = dict(ctx_len=13, block_size=4)
    single = layer_masks(dense_block_mask, a.anchors, a.keep, lens, windows=[None, None], **kw)
    assert isinstance(single, torch.Tensor) and torch.equal(single, dense_block_mask(a.anchors, a.keep, lens, **kw))
    both = layer_masks(dense_block_mask, a.anchors, a.keep, lens, windows=[3, None, 3], **kw)
    assert set(both) == {(3, False), (None, False)}
    assert torch.equal(both[3, False], dense_block_mask(a.anchors, a.keep, lens, window=3, **kw))
    per_layer = layer_masks(dense_block_mask, a.anchors, a.keep, lens, windows=[3, None], causals=[True, False], **kw)
    assert set(per_layer) == {(3, True), (None, False)}
    assert torch.equal(per_layer[3, True], dense_block_mask(a.anchors, a.keep, lens, window=3, causal=True, **kw))


def _model(seed: int = 0, **over) -> DFlashDraftModel:
    torch.manual_seed(seed)
    model = DFlashDraftModel(with_fields(tiny_contract(block_size=4), **over)).eval()
    with torch.no_grad():  # sharper attention, so a hidden key moves the output
        for layer in model.layers:
            layer.self_attn.q_proj.weight.mul_(6.0)
    return model


def _train_view(model, feats, a: Anchors, s: int):
    g = torch.Generator().manual_seed(1)
    noise = torch.randn(1, a.anchors.shape[1] * 4, model.contract.hidden_size, generator=g)
    masks = layer_masks(dense_block_mask, a.anchors, a.keep, torch.tensor([s]), ctx_len=s, block_size=4,
                        causal=model.causal, windows=model.layer_windows)
    with torch.no_grad():
        return noise, model(noise, feats, block_position_ids(a, ctx_len=s, block_size=4), attention_mask=masks)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("types,window", [(MIXED, 3), (None, 2), (["full_attention", "sliding_attention"], 5)])
def test_decode_views_equal_the_training_view(types, window, causal):
    """Per block: the module forward with no mask (all context at once, and through a DraftKVCache fed in pieces)
    and the lean FastDraft give the training mask's output."""
    model = _model(layer_types=types, sliding_window=window, causal=causal)
    assert any(w is not None for w in model.layer_windows)
    s = 12
    feats = torch.randn(1, s, 2 * model.contract.hidden_size, generator=torch.Generator().manual_seed(2))
    a = Anchors(torch.tensor([[1, 4, 7, 11]]), torch.ones(1, 4, dtype=torch.bool))
    noise, train = _train_view(model, feats, a, s)
    head = torch.randn(model.contract.vocab_size, model.contract.hidden_size)
    fast = FastDraft(model, head, None, noise[:, 1:2], causal=causal)
    state = fast.new_state(4)
    cache = DraftKVCache()
    done = 0
    for j, anchor in enumerate(a.anchors[0].tolist()):
        blk = noise[:, j * 4:(j + 1) * 4]
        with torch.no_grad():
            whole = model(blk, feats[:, :anchor], torch.arange(anchor + 4)[None])
            cached = model(blk, feats[:, done:anchor], torch.arange(done, anchor + 4)[None], cache=cache)
        done = anchor
        torch.testing.assert_close(whole, train[:, j * 4:(j + 1) * 4], rtol=0, atol=1e-5)
        torch.testing.assert_close(cached, whole, rtol=0, atol=1e-5)
        if all(torch.equal(r, noise[0, j * 4 + 1]) for r in noise[0, j * 4 + 1:(j + 1) * 4]):
            h, _ = fast.forward(state, feats[:, state.length:anchor], blk[:, :1], anchor)
            torch.testing.assert_close(h, whole[0, 1:], rtol=0, atol=1e-5)


def test_fast_draft_equals_the_module_with_a_mask_row_block():
    """FastDraft drafts [anchor, MASK …]: same hidden states as the module, block after block, for a mixed drafter."""
    model = _model(layer_types=MIXED, sliding_window=3)
    assert model.layer_windows == [3, None]
    H = model.contract.hidden_size
    g = torch.Generator().manual_seed(3)
    feats, mask_emb = torch.randn(1, 20, 2 * H, generator=g), torch.randn(1, 1, H, generator=g)
    fast = FastDraft(model, torch.randn(model.contract.vocab_size, H, generator=g), None, mask_emb)
    state = fast.new_state(4)
    for start in (2, 5, 6, 11, 19):
        anchor = torch.randn(1, 1, H, generator=g)
        h, _ = fast.forward(state, feats[:, state.length:start], anchor, start)
        with torch.no_grad():
            want = model(torch.cat([anchor, mask_emb.expand(1, 3, H)], 1), feats[:, :start], torch.arange(start + 4)[None])
        torch.testing.assert_close(h, want[0, 1:], rtol=0, atol=1e-5)


def test_a_window_covering_the_sequence_is_full_attention():
    s = 12
    feats = torch.randn(1, s, 64, generator=torch.Generator().manual_seed(4))
    a = Anchors(torch.tensor([[2, 6, 9]]), torch.ones(1, 3, dtype=torch.bool))
    full = _train_view(_model(), feats, a, s)[1]
    wide = _train_view(_model(layer_types=MIXED, sliding_window=s + 4), feats, a, s)[1]
    narrow = _train_view(_model(layer_types=MIXED, sliding_window=2), feats, a, s)[1]
    torch.testing.assert_close(wide, full, rtol=0, atol=0)
    assert not torch.allclose(narrow, full, atol=1e-3)  # the window matters when it hides keys


def test_a_window_covering_the_sequence_gives_the_full_loss(tiny_qwen3):
    from dflashkit.train.loss import Heads, LossInputs
    from tests.helpers import train_loss

    c = tiny_contract()
    lm, lens, a = random_case(0, s=13)
    g = torch.Generator().manual_seed(5)
    feats, ids = torch.randn(3, 13, 2 * c.hidden_size, generator=g), torch.randint(0, c.vocab_size - 1, (3, 13), generator=g)
    heads = Heads(torch.nn.Embedding(c.vocab_size, c.hidden_size), torch.nn.Linear(c.hidden_size, c.vocab_size))
    losses = {}
    for name, over in (("full", {}), ("wide", {"layer_types": MIXED, "sliding_window": 64}),
                       ("narrow", {"layer_types": MIXED, "sliding_window": 2})):
        contract = with_fields(c, **over)
        torch.manual_seed(0)
        model = DFlashDraftModel(contract)
        losses[name] = float(train_loss(contract)(model, heads, LossInputs(feats, ids, lm, lens), a).loss.detach())
    assert losses["wide"] == losses["full"] and losses["narrow"] != losses["full"], losses


# -- config and contract -----------------------------------------------------------------------------------------
def test_contract_refuses_a_bad_declaration():
    from dflashkit.errors import UsageError

    for over, words in (({"layer_types": ["sliding_attention"]}, "1 entries for 2"),
                        ({"layer_types": MIXED}, "sliding_window is null"),
                        ({"layer_types": ["full_attention", "swa"]}, "'swa'"),
                        ({"sliding_window": 0}, "sliding_window: must be an integer >= 1")):
        with pytest.raises(UsageError, match=words):
            with_fields(tiny_contract(), **over).check()


@pytest.mark.parametrize("over,words", [
    (["drafter.num_draft_layers=2", 'drafter.layer_types=["sliding_attention"]'], "drafter.layer_types: 1 entries"),
    (["drafter.num_draft_layers=2", 'drafter.layer_types=["sliding_attention","full_attention"]'],
     "drafter.sliding_window is null"),
    (["drafter.sliding_window=0"], "drafter.sliding_window: must be an integer >= 1"),
])
def test_config_refusals_name_the_key(tmp_path, capsys, over, words):
    assert main(["train", "--dry-run", "--run-dir", str(tmp_path / "run"), *over]) == 2
    assert words in capsys.readouterr().err


def test_probe_writes_the_layer_types_into_the_contract(tiny_qwen3):
    from dflashkit.config import DrafterSection, RunConfig
    from dflashkit.inspect.contract import derive_contract
    from dflashkit.inspect.target import inspect_target

    facts, tok = inspect_target(RunConfig(), str(tiny_qwen3))[2:]
    d = DrafterSection(num_draft_layers=2, sliding_window=7)
    c = derive_contract(d, facts, tok)
    assert c.layer_types == ["sliding_attention"] * 2 and c.layer_windows == [7, 7]
    c = derive_contract(DrafterSection(num_draft_layers=2, sliding_window=7, layer_types=MIXED[::-1]), facts, tok)
    assert c.layer_windows == [None, 7]
    c = derive_contract(DrafterSection(num_draft_layers=2), facts, tok)
    assert c.layer_types is None and c.sliding_window is None and c.layer_windows == [None, None]


# -- train, decode, export, import, warm start ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def target(tiny_qwen3):
    return load_target(TargetSection(path=str(tiny_qwen3), device="cpu", dtype="float32"))


def test_a_sliding_drafter_trains_and_decodes_lossless(tmp_path, tiny_qwen3, target):
    rd = make_run(tmp_path / "run", tiny_qwen3, block_size=4, num_draft_layers=2, layer_types=MIXED, sliding_window=3)
    assert main(["train", *overrides(rd, tiny_qwen3, train__max_steps=3)]) == 0
    drafter = load_drafter(rd / "train" / "final", dtype=torch.float32)
    assert drafter.layer_windows == [3, None]
    params = SamplingParams(max_new_tokens=24)
    for prompt in ([1, 60, 61, 62, 63, 64, 10, 65, 66, 67, 68, 2, 10], [1, 5, 9, 14, 3, 77, 120, 4]):
        base = SpecDecoder(target, None, block_size=1).generate(prompt, params)
        for lean in (True, False):
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


@pytest.mark.parametrize("causal", [False, True])
def test_both_exports_carry_the_layer_types_and_import_back(tmp_path, tiny_qwen3, target, causal):
    source = random_drafter(target, block_size=4, layers=2, seed=3, layer_types=MIXED, sliding_window=3, causal=causal)
    with torch.no_grad():
        for layer in source.layers:
            layer.self_attn.q_proj.weight.mul_(6.0)
    rd = tmp_path / "run"
    save_drafter(source, rd / "train" / "final", dtype="float32")
    assert main(["export", f"target.path={tiny_qwen3}", "export.dtype=float32", "--run-dir", str(rd), "--json"]) == 0
    spec = tmp_path / "spec"
    assert main(["export", "--format", "speculators", f"target.path={tiny_qwen3}", "export.dtype=float32",
                 f"export.out_dir={spec}", "--run-dir", str(rd), "--json"]) == 0
    zlab = rd / "export"
    cfg = json.loads((zlab / "config.json").read_text())
    assert cfg["layer_types"] == MIXED and cfg["sliding_window"] == 3 and cfg["use_sliding_window"] is True
    assert cfg["is_causal"] is causal and cfg["dflash_config"]["causal"] is causal  # vLLM would guess otherwise
    scfg = json.loads((spec / "config.json").read_text())
    layer = scfg["transformer_layer_config"]
    assert layer["layer_types"] == MIXED and layer["sliding_window"] == 3 and layer["is_causal"] is causal
    assert scfg["sliding_window_non_causal"] is (not causal)

    head = target.lm_head.weight.detach()
    want = _logits(source, head)
    full = random_drafter(target, block_size=4, layers=2, seed=3, causal=causal)
    with torch.no_grad():
        for layer in full.layers:
            layer.self_attn.q_proj.weight.mul_(6.0)
    assert not torch.allclose(_logits(full, head), want, atol=1e-4)  # the window changes these logits
    shipped = load_shipped_model(zlab)
    c = source.contract
    g = torch.Generator().manual_seed(7)
    noise, ctx = torch.randn(1, 4, c.hidden_size, generator=g), torch.randn(1, 9, 2 * c.hidden_size, generator=g)
    with torch.inference_mode():
        got = shipped(noise_embedding=noise, target_hidden=ctx, position_ids=torch.arange(13)[None])
    torch.testing.assert_close(got @ head.T, want, rtol=0, atol=1e-5)
    for name, src in (("from-zlab", zlab), ("from-spec", spec)):
        assert main(["import", str(src), f"target.path={tiny_qwen3}", "--run-dir", str(tmp_path / name), "--json"]) == 0
        back = load_drafter(tmp_path / name / "train" / "final", dtype=torch.float32)
        contract = json.loads((tmp_path / name / "contract.json").read_text())
        assert contract["layer_types"] == MIXED and contract["sliding_window"] == 3, name
        assert back.layer_windows == [3, None] and back.contract == source.contract, name
        torch.testing.assert_close(_logits(back, head), want, rtol=0, atol=0)


def _released_style(tmp_path: Path, target, tiny_qwen3, causal: bool | None = None) -> Path:
    """A drafter dir as a release ships it: z-lab config.json written by hand (mixed layer_types, the window at the
    top level, no dflashkit extras; `dflash_config.causal` when `causal` is not None, else no causality key at all)
    and the weights of a random drafter."""
    d = tmp_path / f"released-{causal}"
    src = random_drafter(target, block_size=4, layers=2, seed=9, layer_types=MIXED, sliding_window=3)
    with torch.no_grad():
        for layer in src.layers:
            layer.self_attn.q_proj.weight.mul_(6.0)
    save_drafter(src, d, dtype="float32")
    c = src.contract
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": c.hidden_size,
           "num_hidden_layers": 2, "num_attention_heads": c.num_attention_heads,
           "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
           "intermediate_size": c.intermediate_size, "vocab_size": c.vocab_size, "rms_norm_eps": 1e-6,
           "rope_theta": 10000.0, "max_position_embeddings": 4096, "layer_types": MIXED, "sliding_window": 3,
           "dtype": "float32", "block_size": 4,
           "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": c.target_layer_ids}}
    if causal is not None:
        cfg["dflash_config"]["causal"] = causal
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("causal", [None, False])
def test_a_released_style_mixed_drafter_imports_and_warm_starts(tmp_path, tiny_qwen3, target, causal):
    released = _released_style(tmp_path, target, tiny_qwen3, causal)
    rd = tmp_path / "imp"
    assert main(["import", str(released), f"target.path={tiny_qwen3}", "--run-dir", str(rd), "--json"]) == 0
    assert json.loads((rd / "contract.json").read_text())["layer_types"] == MIXED
    back = load_drafter(rd / "train" / "final", dtype=torch.float32)
    assert back.layer_windows == [3, None]
    # no causality key: causal in the sliding layer only, as vLLM runs it (`_dflash_layer_causal`)
    assert back.layer_causal == ([True, False] if causal is None else [False, False])

    from dflashkit.train.warm_start import check_fits, read_warm_start, warm_start

    src = read_warm_start(released)
    assert src.contract.layer_windows == [3, None]
    run = make_contract(tiny_qwen3, block_size=4, num_draft_layers=2, mask_token_id=src.contract.mask_token_id,
                        layer_types=MIXED, sliding_window=3)
    run = with_fields(run, target_layer_ids=src.contract.target_layer_ids, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=src.contract.head_dim,
                      intermediate_size=src.contract.intermediate_size, causal_layers=src.contract.causal_layers)
    check_fits(src, run)
    fresh = DFlashDraftModel(run)
    warm_start(fresh, src, run)
    head = target.lm_head.weight.detach()
    torch.testing.assert_close(_logits(fresh, head), _logits(back, head), rtol=0, atol=0)


def test_a_released_per_layer_causal_drafter_decodes_lossless_and_reexports_as_it_came(tmp_path, tiny_qwen3, target,
                                                                                       capsys):
    """Mixed layer_types without is_causal: the sliding layer attends causally in its block (vLLM's reading). It
    decodes lossless (lean and module forward agree on the drafts), its z-lab export keeps the config free of
    causality keys and the shipped dflash.py reads it alike; the speculators format, one causality for all layers,
    refuses it (exit 2)."""
    released = _released_style(tmp_path, target, tiny_qwen3)
    rd = tmp_path / "run"
    assert main(["import", str(released), f"target.path={tiny_qwen3}", "--run-dir", str(rd), "--json"]) == 0
    drafter = load_drafter(rd / "train" / "final", dtype=torch.float32)
    assert drafter.layer_causal == [True, False]
    head = target.lm_head.weight.detach()
    bidirectional = load_drafter(_released_style(tmp_path, target, tiny_qwen3, False), dtype=torch.float32)
    assert not torch.allclose(_logits(bidirectional, head), _logits(drafter, head), atol=1e-4)
    params = SamplingParams(max_new_tokens=20)
    prompt = [1, 60, 61, 62, 63, 64, 10, 65, 66, 67, 68, 2, 10]
    base = SpecDecoder(target, None, block_size=1).generate(prompt, params)
    drafts = {}
    for lean in (True, False):
        r = SpecDecoder(target, drafter, block_size=4, lean=lean).generate(prompt, params)
        assert r.token_ids == base.token_ids, lean
        drafts[lean] = r.acceptance_lengths
    assert drafts[True] == drafts[False]

    assert main(["export", f"target.path={tiny_qwen3}", "export.dtype=float32", "--run-dir", str(rd), "--json"]) == 0
    cfg = json.loads((rd / "export" / "config.json").read_text())
    assert cfg["layer_types"] == MIXED and "is_causal" not in cfg and "causal" not in cfg["dflash_config"]
    shipped = load_shipped_model(rd / "export")
    assert [layer.self_attn.causal for layer in shipped.layers] == [True, False]
    g = torch.Generator().manual_seed(7)
    H = drafter.contract.hidden_size
    noise, ctx = torch.randn(1, 4, H, generator=g), torch.randn(1, 9, 2 * H, generator=g)
    with torch.inference_mode():
        got = shipped(noise_embedding=noise, target_hidden=ctx, position_ids=torch.arange(13)[None])
    torch.testing.assert_close(got @ head.T, _logits(drafter, head), rtol=0, atol=1e-5)
    capsys.readouterr()
    assert main(["export", "--format", "speculators", f"target.path={tiny_qwen3}", f"export.out_dir={tmp_path / 's'}",
                 "--run-dir", str(rd), "--json"]) == 2
    assert "causal_layers" in capsys.readouterr().err


def test_train_refuses_a_window_the_contract_does_not_have(tmp_path, tiny_qwen3, capsys):
    """drafter.sliding_window / layer_types given after probe wrote a full-attention contract: exit 2 naming them,
    not a silent full-attention run; the same values as the contract's pass."""
    rd = make_run(tmp_path / "run", tiny_qwen3, block_size=4, num_draft_layers=2)
    assert main(["train", *overrides(rd, tiny_qwen3, train__max_steps=1), "drafter.sliding_window=3"]) == 2
    assert "drafter.layer_types / drafter.sliding_window" in capsys.readouterr().err
    rd2 = make_run(tmp_path / "run2", tiny_qwen3, block_size=4, num_draft_layers=2, sliding_window=3,
                   layer_types=["sliding_attention"] * 2)
    assert main(["train", *overrides(rd2, tiny_qwen3, train__max_steps=1), "drafter.sliding_window=3"]) == 0


def test_flex_forward_equals_dense_for_a_mixed_drafter_on_cpu():
    """The per-layer masks in flex form (what `drafter.attention=flex` trains with on CUDA) give the dense output."""
    from dflashkit.model.masks import flex_block_mask

    model = _model(layer_types=MIXED, sliding_window=3, causal=True)
    lm, lens, a = random_case(1, s=16)
    b, s = lm.shape
    g = torch.Generator().manual_seed(6)
    feats = torch.randn(b, s, 2 * model.contract.hidden_size, generator=g)
    noise = torch.randn(b, a.anchors.shape[1] * 4, model.contract.hidden_size, generator=g)
    pos = block_position_ids(a, ctx_len=s, block_size=4)
    kw = dict(ctx_len=s, block_size=4, causal=True, windows=model.layer_windows, causals=model.layer_causal)
    with torch.no_grad():
        want = model(noise, feats, pos, attention_mask=layer_masks(dense_block_mask, a.anchors, a.keep, lens, **kw))
        got = model(noise, feats, pos, attention_mask=layer_masks(flex_block_mask, a.anchors, a.keep, lens, **kw))
        full = model(noise, feats, pos, attention_mask=dense_block_mask(a.anchors, a.keep, lens, ctx_len=s,
                                                                        block_size=4, causal=True))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert not torch.allclose(full, want, atol=1e-3)


def test_a_window_re_probes_and_re_trains():
    """The keys reach the contract, so `dflashkit run` re-runs probe (and so train) when they change."""
    from dflashkit.config import load_config
    from dflashkit.stage_table import stage_hash

    cfg = load_config(None)
    for over in ("drafter.sliding_window=64", 'drafter.layer_types=["sliding_attention","full_attention",'
                 '"full_attention","full_attention","full_attention"]'):
        other = load_config(None, [over, "drafter.sliding_window=64"])
        assert stage_hash("probe", other) != stage_hash("probe", cfg), over
