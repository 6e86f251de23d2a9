"""LiLiCorr model: vLLM's tensor names, shapes and norm types; the lattice head against torch's own
MultiheadAttention and plain loops; the init (identity convolutions ≡ DFlash); backbone warm starts; refusals."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from dflashkit import family
from dflashkit.errors import UsageError
from dflashkit.family import new_drafter
from dflashkit.model.dflash2 import DFlash2DraftModel
from dflashkit.model.drafter import DFlashDraftModel
from dflashkit.model.lilicorr import LiLiCorrDraftModel, init_from_backbone
from dflashkit.model.masks import dense_block_mask
from dflashkit.train.objective import Anchors
from tests.helpers import tiny_contract, with_fields

H, V, B = 32, 50, 4


def lili_contract(**over):
    return with_fields(tiny_contract(block_size=B, vocab=V, hidden=H),
                       **{"drafter_type": "lilicorr", "lilicorr_candidate_topk": 4, "lilicorr_num_heads": 4,
                          "lilicorr_factor_dim": 12, **over})


def _randomised(model, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.lilicorr.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.5)
                    + (1.0 if name.endswith("norm.weight") else 0.0))
    return model.eval()


# vLLM 0.32 model_executor/models/lilicorr.py: what LiLiCorrHead registers (token_proj only when widths differ)
def vllm_head_shapes(H: int, w: int, F: int, K: int, S: int, heads: int, layers: int, ratio: float) -> dict:
    m = int(w * ratio)
    out = {"pass_hidden_proj.weight": (w, H), "pass_hidden_proj.bias": (w,), "context_proj.weight": (w, H),
           "context_proj.bias": (w,), "feature_norm.weight": (5,), "feature_norm.bias": (5,),
           "feature_mlp.up_proj.weight": (w, 5), "feature_mlp.up_proj.bias": (w,),
           "feature_mlp.down_proj.weight": (w, w), "feature_mlp.down_proj.bias": (w,),
           "slot_embedding": (1, 1, S, 1, w), "rank_embedding": (1, 1, 1, K, w),
           "relative_slot_bias": (heads, 2 * (S + 1) - 1), "same_slot_bias": (heads,),
           "output_norm.weight": (w,), "anchor_norm.weight": (w,), "factor_input_proj.weight": (w, 3 * w),
           "factor_input_proj.bias": (w,)}
    for name in ("out_head", "in_head", "anchor_out_head"):
        out |= {f"{name}.weight": (F, w), f"{name}.bias": (F,)}
    for i in range(layers):
        p = f"layers.{i}."
        out |= {p + "attn_norm.weight": (w,), p + "attn.in_proj_weight": (3 * w, w), p + "attn.in_proj_bias": (3 * w,),
                p + "attn.out_proj.weight": (w, w), p + "attn.out_proj.bias": (w,), p + "mlp_norm.weight": (w,),
                p + "mlp.up_proj.weight": (m, w), p + "mlp.up_proj.bias": (m,), p + "mlp.down_proj.weight": (w, m),
                p + "mlp.down_proj.bias": (w,)}
    if w != H:
        out |= {"token_proj.weight": (w, H), "token_proj.bias": (w,)}
    return out


@pytest.mark.parametrize("width,conv", [(0, False), (24, True)])
def test_state_dict_names_and_shapes_are_vllms(width, conv):
    knobs = {"lilicorr_hidden_size": width, "lilicorr_num_layers": 3, "lilicorr_mlp_ratio": 1.5}
    if conv:
        knobs |= {"lilicorr_conv_kernel_size": 2, "lilicorr_conv_group_size": 8}
    m = LiLiCorrDraftModel(lili_contract(**knobs))
    sd = m.state_dict()
    head = {k.removeprefix("lilicorr."): tuple(v.shape) for k, v in sd.items() if k.startswith("lilicorr.")}
    assert head == vllm_head_shapes(H, width or H, 12, 4, B - 1, 4, 3, 1.5)
    backbone = set(sd) - {f"lilicorr.{k}" for k in head}
    convs = {f"layers.{i}.{c}.{p}" for i in range(2) for c in ("attention_conv", "mlp_conv")
             for p in ("base_kernel", "kernel_projection.weight")}
    assert backbone == set(DFlashDraftModel(tiny_contract()).state_dict()) | (convs if conv else set())
    # vLLM's norms: nn.RMSNorm at the draft's eps (not Qwen3RMSNorm), a LayerNorm(5) over the features
    assert type(m.lilicorr.output_norm) is torch.nn.RMSNorm and m.lilicorr.output_norm.eps == m.contract.rms_norm_eps
    assert type(m.lilicorr.layers[0].attn_norm) is torch.nn.RMSNorm and type(m.lilicorr.feature_norm) is torch.nn.LayerNorm
    assert m.lilicorr.feature_norm.eps == 1e-5
    assert sum(p.numel() for p in m.parameters()) - sum(p.numel() for p in DFlashDraftModel(tiny_contract()).parameters()) \
        == family.extra_params(m.contract)


def test_init_follows_modelopt():
    torch.manual_seed(0)
    m = LiLiCorrDraftModel(lili_contract(lilicorr_hidden_size=64, lilicorr_factor_dim=256))
    head = m.lilicorr
    for lin in (head.pass_hidden_proj, head.context_proj, head.factor_input_proj, head.out_head, head.in_head):
        assert abs(lin.weight.std().item() - 0.02) < 0.004 and not lin.bias.any()
    for p in (head.slot_embedding, head.rank_embedding, head.relative_slot_bias, head.same_slot_bias,
              head.layers[0].attn.in_proj_bias):
        assert not p.any()
    bound = (6 / (64 + 3 * 64)) ** 0.5  # nn.MultiheadAttention's Xavier-uniform in-projection
    w = head.layers[0].attn.in_proj_weight
    assert w.abs().max() <= bound and w.abs().max() > 0.9 * bound
    assert all(bool((n.weight == 1).all()) for n in (head.output_norm, head.anchor_norm, head.feature_norm))


def test_lattice_attention_equals_torchs_multihead_attention_with_the_bias():
    """ModelOpt trains the layer as nn.MultiheadAttention(batch_first) with a float attn_mask: the same names,
    the same function."""
    torch.manual_seed(1)
    m = _randomised(LiLiCorrDraftModel(lili_contract()))
    attn = m.lilicorr.layers[0].attn
    mha = torch.nn.MultiheadAttention(H, 4, batch_first=True)
    mha.load_state_dict(attn.state_dict())
    x = torch.randn(3, (B - 1) * 4, H)
    bias = m.lilicorr.attention_bias(B - 1)
    with torch.no_grad():
        want, _ = mha(x, x, x, attn_mask=bias.repeat(3, 1, 1), need_weights=False)
        torch.testing.assert_close(attn(x, bias[None]), want, atol=1e-5, rtol=1e-5)


def test_attention_bias_equals_the_loop_and_a_shorter_draft_uses_its_corner():
    m = _randomised(LiLiCorrDraftModel(lili_contract()))
    head, k = m.lilicorr, 4
    bias = head.attention_bias(B - 1)
    for hh, q, kk in itertools.product(range(4), range((B - 1) * k), range((B - 1) * k)):
        sq, sk = q // k, kk // k
        want = head.relative_slot_bias[hh, sq - sk + B - 1] + (head.same_slot_bias[hh] if sq == sk else 0.0)
        assert torch.isclose(bias[hh, q, kk], want)
    assert torch.equal(head.attention_bias(2), bias[:, :2 * k, :2 * k])


def loop_lattice(head, emb, logp, hid, anchor, valid):
    """start[b, j], pairs[b, s, i, j] by the formulas of the module docstring, one candidate at a time."""
    b, n, k = logp.shape
    x = torch.zeros(b, n, k, head.width)
    for bi, s, r in itertools.product(range(b), range(n), range(k)):
        lp = logp[bi, s]
        f = torch.stack([lp[r], lp[r].exp(), lp[r] - lp.max(), torch.tensor(r / (k - 1)), torch.tensor(float(r == 0))])
        x[bi, s, r] = (head.token_proj(emb[bi, s, r]) + head.pass_hidden_proj(hid[bi, s])
                       + head.feature_mlp(head.feature_norm(f)) + head.slot_embedding[0, 0, s, 0] + head.rank_embedding[0, 0, 0, r])
    flat = x.view(b, n * k, -1)
    for layer in head.layers:
        flat = layer(flat, head.attention_bias(n)[None])
    x = head.output_norm(flat).view(b, n, k, -1)
    start, pairs = torch.zeros(b, k), torch.zeros(b, n - 1, k, k)
    for bi in range(b):
        a = head.anchor_norm(head.context_proj(anchor[bi]) * float(valid[bi]))
        ao = F.normalize(head.anchor_out_head(a), dim=-1, eps=head.vector_eps)

        def vecs(s, r):
            u = F.silu(head.factor_input_proj(torch.cat([x[bi, s, r], a, x[bi, s, r] * a])))  # noqa: B023
            return (F.normalize(head.out_head(u), dim=-1, eps=head.vector_eps),
                    F.normalize(head.in_head(u), dim=-1, eps=head.vector_eps))

        for j in range(k):
            start[bi, j] = head.logit_scale * (ao @ vecs(0, j)[1])
        for s, i, j in itertools.product(range(n - 1), range(k), range(k)):
            pairs[bi, s, i, j] = head.logit_scale * (vecs(s, i)[0] @ vecs(s + 1, j)[1])
    return start, pairs


@pytest.mark.parametrize("n,width", [(B - 1, 0), (2, 24)])
def test_lattice_scores_equal_the_loop_oracle_in_vllms_layout(n, width):
    torch.manual_seed(2)
    m = _randomised(LiLiCorrDraftModel(lili_contract(lilicorr_hidden_size=width)))
    b, k = 2, 4
    emb, hid, anchor = torch.randn(b, n, k, H), torch.randn(b, n, H), torch.randn(b, H)
    logp = torch.log_softmax(torch.randn(b, n, 10), -1).topk(k, -1).values
    valid = torch.tensor([True, False])
    with torch.no_grad():
        scores = m.lilicorr(emb, logp, hid, anchor, valid)
        start, pairs = loop_lattice(m.lilicorr, emb, logp, hid, anchor, valid)
    assert scores.shape == (b, n, k, k) and scores.dtype == torch.float32
    for p in range(k):  # slot 0: every row is the start scores (the walk starts at index 0)
        torch.testing.assert_close(scores[:, 0, p], start, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(scores[:, 1:], pairs, atol=1e-5, rtol=1e-4)
    assert (scores.abs() <= m.lilicorr.logit_scale + 1e-4).all()  # scaled cosines


def test_candidates_are_the_head_top_k_with_full_vocab_log_probs():
    m = LiLiCorrDraftModel(lili_contract())
    logits = torch.randn(3, 2, V)
    ids, logp = m.candidates(logits)
    full = torch.log_softmax(logits, -1)
    assert torch.equal(ids, full.topk(4, -1).indices) and torch.allclose(logp, full.gather(-1, ids), atol=1e-6)


def _dflash_pair(conv: bool):
    torch.manual_seed(0)
    d1 = DFlashDraftModel(tiny_contract(block_size=B, vocab=V, hidden=H)).eval()
    knobs = {"lilicorr_conv_kernel_size": 2, "lilicorr_conv_group_size": 8} if conv else {}
    return d1, LiLiCorrDraftModel(lili_contract(**knobs)).eval()


@pytest.mark.parametrize("conv", [False, True])
def test_a_lilicorr_from_a_dflash_checkpoint_computes_its_hidden_states(conv):
    d1, lc = _dflash_pair(conv)
    report = init_from_backbone(lc, d1.state_dict(), source="DFlash")
    assert set(report["copied"]) == set(d1.state_dict())
    noise, feats = torch.randn(2, 8, H), torch.randn(2, 5, 2 * H)
    pos = torch.arange(13).expand(2, 13)
    a = Anchors(torch.tensor([[1, 3], [2, 4]]), torch.ones(2, 2, dtype=torch.bool))
    mask = dense_block_mask(a.anchors, a.keep, torch.tensor([5, 5]), ctx_len=5, block_size=B)
    with torch.no_grad():
        torch.testing.assert_close(lc(noise, feats, pos, attention_mask=mask), d1(noise, feats, pos, attention_mask=mask),
                                   atol=1e-6, rtol=1e-6)


def test_a_dflash2_backbone_needs_the_same_convolutions():
    torch.manual_seed(3)
    d2 = DFlash2DraftModel(with_fields(tiny_contract(block_size=B, vocab=V, hidden=H), drafter_type="dflash2",
                                       conv_kernel_size=2, conv_group_size=8, selector_rank=4, selector_top_k=4))
    with torch.no_grad():
        d2.layers[0].mlp_conv.base_kernel.normal_()
    _, plain = _dflash_pair(False)
    with pytest.raises(UsageError, match="convolutions do not fit.*layers.0.attention_conv.base_kernel: not in"):
        init_from_backbone(plain, d2.state_dict(), source="DFlash2")
    _, lc = _dflash_pair(True)
    report = init_from_backbone(lc, d2.state_dict(), source="DFlash2")
    assert not any(k.startswith("candidate_selector.") for k in report["copied"])
    assert torch.equal(lc.layers[0].mlp_conv.base_kernel, d2.layers[0].mlp_conv.base_kernel)
    with pytest.raises(UsageError, match="convolutions do not fit"):
        init_from_backbone(LiLiCorrDraftModel(lili_contract(lilicorr_conv_kernel_size=3, lilicorr_conv_group_size=8)),
                           d2.state_dict(), source="DFlash2")


def test_refusals_name_the_key():
    assert isinstance(new_drafter(lili_contract()), LiLiCorrDraftModel)
    with pytest.raises(UsageError, match="full target vocabulary"):
        new_drafter(lili_contract(), draft_vocab=torch.arange(10))
    for knobs, what in (({"lilicorr_candidate_topk": 12}, "lilicorr_candidate_topk: must be a power of 2 <= 16"),
                        ({"lilicorr_candidate_topk": 32}, "lilicorr_candidate_topk: must be a power of 2 <= 16"),
                        ({"lilicorr_num_heads": 5}, "lilicorr_num_heads 5 must divide the lattice width 32"),
                        ({"lilicorr_conv_kernel_size": 2}, "both 0 (a DFlash backbone) or both >= 1"),
                        ({"lilicorr_vector_eps": 0.0}, "lilicorr_vector_eps: must be in (0, 0.5)")):
        with pytest.raises(UsageError, match=what.replace("(", r"\(").replace(")", r"\)")):
            lili_contract(**knobs).check()


def test_only_a_bit_exact_reload_must_walk_the_same_path():
    from dflashkit.family.base import same_weights

    m = LiLiCorrDraftModel(lili_contract())
    copy = LiLiCorrDraftModel(lili_contract())
    copy.load_state_dict(m.state_dict())
    assert same_weights(m, copy)
    with torch.no_grad():                       # a bf16 export read back as float32
        for p in copy.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    assert not same_weights(m, copy)


@pytest.mark.parametrize("causal", [False, True])
def test_config_json_round_trips_the_knobs_with_dflashs_causal(causal):
    from dflashkit.family.contract import DrafterContract

    c = lili_contract(causal=causal, lilicorr_conv_kernel_size=2, lilicorr_conv_group_size=8, lilicorr_logit_scale=6.0)
    cfg = c.to_hf_config()
    assert cfg["architectures"] == ["LiLiCorrDraftModel"] and cfg["dflash_config"]["lilicorr_logit_scale"] == 6.0
    assert (cfg.get("is_causal"), cfg["dflash_config"].get("causal")) == ((True, True) if causal else (None, None))
    back = DrafterContract.from_hf_config(cfg)
    assert back.knobs == c.knobs and back.drafter_type == "lilicorr"
    assert LiLiCorrDraftModel(c).causal is causal
