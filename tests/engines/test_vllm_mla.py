"""Our MLA draft layer ≡ vLLM 0.32's own MLA attention module on the same exported weights (marker `engine`).

vLLM 0.32 has no MLA DFlash draft model (its `qwen3_dflash*` / `qwen3_dspark` layers are GQA); the MLA code it
would run for a Kimi-style drafter layer is DeepSeek's, `deepseek_v2.DeepseekV2MLAAttention` through
`MultiHeadLatentAttentionWrapper`. `tests/harness/vllm_mla_reference.py` builds it in the engine venv for each draft
layer of a z-lab export, loads the layer's tensors through vLLM's own weight loaders (q_a_proj and
kv_a_proj_with_mqa into the fused projection) and runs it over the rows [context; block]. Its attention kernel needs
vLLM's paged KV cache and forward context, so the softmax is the non-absorbed prefill form (`forward_mha`: k_nope,
v from kv_b_proj, SDPA at vLLM's scale) under each layer's mask: a block row sees the context (its window in a
sliding layer) and its block (offsets j <= i when causal). Every projection, norm, the interleaved RoPE and the
scale are vLLM's. Compared: each layer's block-row output, queries after RoPE, shared k_rope and normed latent;
with q-LoRA and without, alone and mixed with a sliding-window layer; vLLM must consume every attention tensor.
"""

from __future__ import annotations

import pytest
import torch

from dflashkit.export.hf import save_drafter
from dflashkit.model.drafter import DFlashDraftModel
from tests.harness.vllm_pieces import vllm_mla_reference
from tests.helpers import tiny_contract, with_fields

pytestmark = pytest.mark.engine

MLA = dict(attention_type="mla", mla_kv_lora_rank=16, mla_qk_nope_head_dim=8, mla_qk_rope_head_dim=4,
           mla_v_head_dim=12)
T, Q = 9, 4  # context rows, block rows


def _drafter(seed: int, **over) -> DFlashDraftModel:
    torch.manual_seed(seed)
    model = DFlashDraftModel(with_fields(tiny_contract(), **{**MLA, **over})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            elif ".self_attn.q" in name:
                p.mul_(8.0)  # sharp attention: a wrong mask or key shows
    return model


def _block_mask(model, i: int, pos: torch.Tensor) -> torch.Tensor:
    """[T + Q, T + Q]: context rows causal; block rows see the context (within layer i's window) and their block."""
    n = T + Q
    m = torch.ones(n, n, dtype=torch.bool).tril()
    w = model.layer_windows[i]
    ctx = torch.ones(Q, T, dtype=torch.bool) if w is None else pos[None, :T] > pos[T:, None] - w
    block = torch.ones(Q, Q, dtype=torch.bool)
    m[T:] = torch.cat([ctx, block.tril() if model.layer_causal[i] else block], dim=-1)
    return m


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def test_our_mla_layers_equal_vllms_mla_attention(tmp_path):
    models = [_drafter(0, mla_q_lora_rank=24),
              _drafter(1, mla_q_lora_rank=0, layer_types=["sliding_attention", "full_attention"], sliding_window=3,
                       causal=True)]
    dirs = []
    for n, m in enumerate(models):
        save_drafter(m, tmp_path / f"e{n}", dtype="float32")
        dirs.append(tmp_path / f"e{n}")
    g = torch.Generator().manual_seed(5)
    rows, pos = torch.randn(T + Q, 32, generator=g), torch.arange(4, 4 + T + Q)
    inputs = {"rows": rows, "positions": pos, "mask": _block_mask(models[0], 0, pos)}
    inputs.update({f"mask.{i}": _block_mask(models[1], i, pos) for i in range(2)})
    # one engine-venv process per mask set: export 0 reads `mask`, export 1 its per-layer masks
    (a, ra), = vllm_mla_reference([dirs[0]], {k: v for k, v in inputs.items() if "." not in k}, work_dir=tmp_path / "v0")
    (b, rb), = vllm_mla_reference([dirs[1]], inputs, work_dir=tmp_path / "v1")
    for model, theirs, report in ((models[0], a, ra), (models[1], b, rb)):
        want = {k for k in model.state_dict() if ".self_attn." in k}
        assert set(report["consumed"]) == want, sorted(want ^ set(report["consumed"]))
        assert report["scales"] == pytest.approx([12 ** -0.5] * 2, rel=1e-12)  # 1/sqrt(qk_nope + qk_rope)
        cos, sin = model.rotary_emb(rows[None], pos[None])
        for i, layer in enumerate(model.layers):
            attn = layer.self_attn
            mask = _block_mask(model, i, pos)[T:][None, None]
            with torch.no_grad():
                k, v = attn.context_kv(rows[None, :T], cos[:, :T], sin[:, :T])
                got = attn(rows[None, T:], k, v, cos[:, T:], sin[:, T:], mask)[0]
                q = attn.queries(rows[None], cos, sin)[0].transpose(0, 1)           # [T+Q, heads, qk]
                all_k, _ = attn.context_kv(rows[None], cos, sin)
            scale = max(1.0, theirs[f"layers.{i}.out"].abs().max().item())
            torch.testing.assert_close(got, theirs[f"layers.{i}.out"][T:], rtol=0, atol=1e-5 * scale)
            vq = theirs[f"layers.{i}.q"]
            torch.testing.assert_close(q[..., :8], vq[..., :8], rtol=0, atol=1e-5)
            torch.testing.assert_close(q[..., 8:], _deinterleave(vq[..., 8:]), rtol=0, atol=1e-5)  # RoPE'd pairs
            torch.testing.assert_close(all_k[0, 0, :, 8:], _deinterleave(theirs[f"layers.{i}.k_pe"]), rtol=0, atol=1e-5)
    # the check can fail: the sliding layer's output under the full layer's mask is not vLLM's
    model = models[1]
    cos, sin = model.rotary_emb(rows[None], pos[None])
    with torch.no_grad():
        attn = model.layers[0].self_attn
        k, v = attn.context_kv(rows[None, :T], cos[:, :T], sin[:, :T])
        wrong = attn(rows[None, T:], k, v, cos[:, T:], sin[:, T:], _block_mask(model, 1, pos)[T:][None, None])[0]
    assert not torch.allclose(wrong, b["layers.0.out"][T:], atol=1e-4)
