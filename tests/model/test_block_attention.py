"""The drafter's masked attention repeats grouped K/V per query head on CUDA (so a fused kernel takes the mask):
the result equals grouped-query SDPA, values and gradients, under the block mask and a random one."""

from __future__ import annotations

import pytest
import torch

from dflashkit.model.drafter import block_attention
from dflashkit.model.masks import dense_block_mask


@pytest.mark.parametrize("heads,kv", [(8, 2), (4, 4), (6, 1)])
def test_repeated_kv_equals_grouped_query_attention(heads, kv):
    g = torch.Generator().manual_seed(heads * 10 + kv)
    anchors, keep = torch.tensor([[2, 7], [1, 0]]), torch.tensor([[True, True], [True, False]])
    mask = dense_block_mask(anchors, keep, torch.tensor([11, 5]), ctx_len=11, block_size=4)   # [2, 1, 8, 19]
    q = torch.randn(2, heads, 8, 16, generator=g, requires_grad=True)
    k = torch.randn(2, kv, 19, 16, generator=g, requires_grad=True)
    v = torch.randn(2, kv, 19, 16, generator=g, requires_grad=True)
    grouped = block_attention(q, k, v, mask, repeat_kv=False)
    repeated = block_attention(q, k, v, mask, repeat_kv=True)
    assert torch.allclose(grouped, repeated, atol=1e-6), (grouped - repeated).abs().max()
    ga = torch.autograd.grad(grouped.square().sum(), (q, k, v))
    gb = torch.autograd.grad(repeated.square().sum(), (q, k, v))
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(ga, gb))
    # the default repeats only for a mask on CUDA: here (CPU) it is the grouped call itself
    assert torch.equal(block_attention(q, k, v, mask), grouped)
    # a head reads its own group's K/V: mixing the groups up would change the output
    if 1 < kv < heads:
        wrong = torch.nn.functional.scaled_dot_product_attention(q, k.repeat(1, heads // kv, 1, 1),
                                                                 v.repeat(1, heads // kv, 1, 1), attn_mask=mask)
        assert not torch.allclose(wrong, grouped, atol=1e-3)
