"""The no-features ablation: the drafter without target context, not the drafter fed zeros.

Zeroed features fuse into a context of zero keys/values that still takes softmax mass, so a long
context drowns each block's own attention (the "τ 1.00, accuracy 0.000 everywhere" reading);
`DraftLoss(context=False)` drops the context instead, which is what "no features" means.
"""

from __future__ import annotations

import pytest
import torch

from dflashkit.config import TargetSection
from dflashkit.decode.diagnostics import simulated_acceptance
from dflashkit.target.load import load_target
from dflashkit.testing import random_drafter
from dflashkit.train.loss import DraftLoss, Heads, LossInputs
from dflashkit.train.objective import Anchors, block_input_ids

B = 4


def _mask_hidden(drafter, target, block: list[int], ctx_len: int, *, context: bool, zeros: bool) -> torch.Tensor:
    """Drafter hidden states of one block anchored after `ctx_len` context tokens ([B, H])."""
    torch.manual_seed(ctx_len)
    prefix = torch.randint(3, 200, (ctx_len,)).tolist()
    ids = torch.tensor([prefix + block])
    feats = target.features(ids, layer_ids=list(drafter.target_layer_ids))
    if zeros:
        feats = torch.zeros_like(feats)
    a = Anchors(torch.tensor([[ctx_len]]), torch.tensor([[True]]))
    noise = target.embed(block_input_ids(ids, a, mask_token_id=drafter.mask_token_id, block_size=B))
    from dflashkit.model.masks import dense_block_mask
    from dflashkit.train.objective import block_position_ids

    s = ids.shape[1] if context else 0
    pos = block_position_ids(a, ctx_len=s, block_size=B)
    mask = dense_block_mask(a.anchors, a.keep, torch.tensor([ids.shape[1]]), ctx_len=s, block_size=B)
    return drafter(noise, feats[:, :s], pos, attention_mask=mask)[0]


def test_zeroed_features_are_not_an_ablation_their_output_depends_on_the_context_length(tiny_qwen3):
    target = load_target(TargetSection(path=str(tiny_qwen3), device="cpu", dtype="float32"))
    drafter = random_drafter(target, B)
    block = [17, 0, 0, 0]
    with torch.no_grad():
        short = _mask_hidden(drafter, target, block, 2, context=True, zeros=True)
        long = _mask_hidden(drafter, target, block, 300, context=True, zeros=True)
        free_short = _mask_hidden(drafter, target, block, 2, context=False, zeros=False)
        free_long = _mask_hidden(drafter, target, block, 300, context=False, zeros=False)
    # zeros carry no information, yet 300 zero keys change the block's hidden states: the defect
    assert (short - long).abs().max() > 1e-3, (short - long).abs().max()
    # without context the block's output is a function of the block alone (and so of no target state)
    torch.testing.assert_close(free_short, free_long, rtol=0, atol=1e-5)


def test_the_ablation_in_the_loss_equals_the_drafter_on_an_empty_context(tiny_qwen3):
    target = load_target(TargetSection(path=str(tiny_qwen3), device="cpu", dtype="float32"))
    drafter = random_drafter(target, B)
    torch.manual_seed(0)
    ids = torch.randint(3, 200, (2, 40))
    mask = torch.zeros_like(ids)
    mask[:, 10:] = 1
    lens = torch.tensor([40, 40])
    feats = target.features(ids, layer_ids=list(drafter.target_layer_ids))
    anchors = torch.arange(10, 38)[None].expand(2, -1)
    a = Anchors(anchors.contiguous(), torch.ones_like(anchors, dtype=torch.bool))
    head = target.lm_head

    def run(f, context, ids=ids, mask=mask, lens=lens, a=a):
        return DraftLoss.scoring(drafter.contract, context=context)(drafter, Heads(target.embed, head),
                                                                     LossInputs(f, ids, mask, lens), a)

    with torch.no_grad():
        free = run(feats, False)
        free_other = run(torch.randn_like(feats) * 50, False)  # any features: unused without context
        full = run(feats, True)
    assert free.correct.tolist() == free_other.correct.tolist() and free.tau_sum == free_other.tau_sum
    assert torch.isclose(free.loss, free_other.loss)
    assert not torch.isclose(free.loss, full.loss)  # the context does reach the real drafter
    # the same per-block predictions as the drafter run on each block with no context at all
    with torch.no_grad():
        for p in (10, 17, 33):
            one = Anchors(torch.tensor([[p]]), torch.tensor([[True]]))
            res = run(feats[:1], False, ids[:1], mask[:1], lens[:1], one)
            h = _mask_hidden(drafter, target, ids[0, p: p + B].tolist(), 0, context=False, zeros=False)
            ce = torch.nn.functional.cross_entropy(head(h)[1:], ids[0, p + 1: p + B])  # uniform weights (γ none)
            assert float(res.loss) == pytest.approx(float(ce), rel=1e-4), (p, float(res.loss), float(ce))
    # ...and in the diagnostic: the ablated drafter is scored without its context
    out = ids[0, 10:].tolist()
    diag = simulated_acceptance(target, drafter, [ids[0, :10].tolist()], [out], no_features=True)
    zeros = simulated_acceptance(target, drafter, [ids[0, :10].tolist()], [out], no_features=True, ablation="zeros")
    assert diag["ablation"] == "context" and zeros["ablation"] == "zeros"
    assert diag["blocks"] == zeros["blocks"] == len(out) - 1


def test_another_prompts_context_is_the_next_sequences_features_and_equals_the_own_when_they_are_the_same(
        tiny_qwen3, monkeypatch):
    """ablation="other": each sequence gets the real features of the others (the next ones, cyclically, cut to
    its length). With identical sequences that is its own context, so every number equals the plain run."""
    from dflashkit.train import loss as loss_module

    target = load_target(TargetSection(path=str(tiny_qwen3), device="cpu", dtype="float32"))
    drafter = random_drafter(target, B)
    torch.manual_seed(1)
    seqs = [torch.randint(3, 200, (n,)).tolist() for n in (30, 12, 20)]
    prompts, outs = [s[:6] for s in seqs], [s[6:] for s in seqs]
    same = simulated_acceptance(target, drafter, [prompts[0]] * 2, [outs[0]] * 2)
    other_same = simulated_acceptance(target, drafter, [prompts[0]] * 2, [outs[0]] * 2, no_features=True,
                                      ablation="other")
    assert (same["tau"], same["per_position_accuracy"], same["blocks"]) == \
        (other_same["tau"], other_same["per_position_accuracy"], other_same["blocks"])

    seen: list[torch.Tensor] = []
    real = loss_module.DraftLoss.__call__

    def spy(self, drafter_, heads, x, *a, **k):
        seen.append(x.features.clone())
        return real(self, drafter_, heads, x, *a, **k)

    monkeypatch.setattr(loss_module.DraftLoss, "__call__", spy)
    res = simulated_acceptance(target, drafter, prompts, outs, no_features=True, ablation="other")
    own = [target.features(torch.tensor([s]), layer_ids=list(drafter.target_layer_ids)) for s in seqs]
    # sequence 1 (30 tokens) takes sequence 2's 12 and 18 of sequence 3's; 2 takes 3's; 3 takes 1's
    want = [torch.cat([own[1], own[2]], 1)[:, :30], own[2][:, :12], own[0][:, :20]]
    assert [f.shape[1] for f in seen] == [30, 12, 20] and res["blocks"] == sum(len(o) - 1 for o in outs)
    for got, exp in zip(seen, want):
        torch.testing.assert_close(got, exp, rtol=0, atol=0)
    with pytest.raises(ValueError, match="two or more"):
        simulated_acceptance(target, drafter, prompts[:1], outs[:1], no_features=True, ablation="other")
