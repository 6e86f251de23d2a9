"""Recipe levers: each changes what it says it changes (Muon, feature scale, anchor coverage, held-out
sources, the CPU budget)."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch

from dflashkit.model.feature_scale import channel_scale, fold_feature_scale
from dflashkit.train.data import hold_out_sources
from dflashkit.train.objective import sample_anchors
from dflashkit.train.optim import (CpuBudget, Fp32Muon, MuonAdamW, build_optimizer, build_scheduler, lr_factor,
                                  newton_schulz_fp32)


def _train(kind: str, **kw):
    return SimpleNamespace(lr=1e-2, betas=[0.9, 0.95], weight_decay=0.0, optimizer=kind, muon_momentum=0.95, **kw)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8))


def test_muon_orthogonalises_the_2d_updates_and_leaves_the_rest_to_adamw():
    m = _model()
    opt = build_optimizer(m, _train("muon"))
    assert isinstance(opt, MuonAdamW) and isinstance(opt.inner[0], torch.optim.Muon)
    muon_params = {id(p) for g in opt.inner[0].param_groups for p in g["params"]}
    assert muon_params == {id(p) for p in m.parameters() if p.ndim == 2}
    before = [p.detach().clone() for p in m.parameters()]
    m(torch.randn(64, 16)).pow(2).mean().backward()
    opt.step()
    w_delta = m[0].weight.detach() - before[0]
    sv = torch.linalg.svdvals(w_delta)
    # Newton-Schulz leaves every singular value of the update near one value (not exactly: 5 steps)
    assert float(sv.max() / sv.min()) < 3.0, sv
    # AdamW's first step is lr·sign(g) elementwise: its singular values spread far wider
    m2 = _model()
    adam = build_optimizer(m2, _train("adamw"))
    m2(torch.randn(64, 16)).pow(2).mean().backward()
    adam.step()
    sv2 = torch.linalg.svdvals(m2[0].weight.detach() - before[0])
    assert float(sv2.max() / sv2.min()) > float(sv.max() / sv.min())
    # the 1-D parameters moved by AdamW's first step: lr·sign(g) exactly
    b_delta = m[0].bias.detach() - before[1]
    assert torch.allclose(b_delta.abs(), torch.full_like(b_delta, 1e-2), rtol=1e-3)


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
def test_fp32_muon_follows_torch_muon(shape):
    """Fp32Muon (Newton-Schulz in float32, for CPUs without fast bf16) takes torch.optim.Muon's steps: same
    momentum, Nesterov, lr adjustment and weight decay; only the orthogonalisation's rounding differs (bf16 there)."""
    torch.manual_seed(0)
    w0 = torch.randn(*shape)
    grads = [torch.randn(*shape) for _ in range(5)]
    moved = []
    for cls in (torch.optim.Muon, Fp32Muon):
        w = torch.nn.Parameter(w0.clone())
        opt = cls([w], lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw")
        for g in grads:
            w.grad = g.clone()
            opt.step()
        moved.append(w.detach() - w0)
    rel = float((moved[0] - moved[1]).norm() / moved[0].norm())
    assert rel < 0.02, rel  # bf16 rounding of the torch side; a wrong scale, momentum or decay is far off
    # the float32 function is the quintic iteration itself: a float64 loop of it as the oracle
    g = grads[0]
    x = g.double() if g.size(0) <= g.size(1) else g.double().T
    x = x / x.norm()
    for _ in range(5):
        gram = x @ x.T
        x = 3.4445 * x + (-4.7750 * gram + 2.0315 * gram @ gram) @ x
    x = x if g.size(0) <= g.size(1) else x.T
    ours = newton_schulz_fp32(g, (3.4445, -4.7750, 2.0315), 5, 1e-7).double()
    assert float((ours - x).abs().max()) < 1e-4


def test_muon_state_round_trips_through_state_dict():
    x = torch.randn(32, 16)

    def steps(model, opt, sched, n):
        for _ in range(n):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            sched.step()

    a = _model()
    oa = build_optimizer(a, _train("muon"))
    sa = build_scheduler(oa, total_steps=10, warmup_ratio=0.1, min_lr_ratio=0.0)
    steps(a, oa, sa, 3)
    b = _model()
    b.load_state_dict(a.state_dict())
    ob = build_optimizer(b, _train("muon"))
    sb = build_scheduler(ob, total_steps=10, warmup_ratio=0.1, min_lr_ratio=0.0)
    ob.load_state_dict(copy.deepcopy(oa.state_dict()))  # as from disk: no tensors shared with oa
    sb.load_state_dict(sa.state_dict())
    assert [g["lr"] for g in ob.param_groups] == [g["lr"] for g in oa.param_groups]
    steps(a, oa, sa, 2)
    steps(b, ob, sb, 2)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_the_feature_scale_brings_every_channel_to_its_layers_median_and_folds_into_fc():
    torch.manual_seed(0)
    n_feat, h = 2, 16
    rms_true = torch.rand(n_feat * h) * 4 + 1
    rms_true[3] = 1650.0                                     # one massive activation channel
    feats = [torch.randn(50, n_feat * h) * rms_true for _ in range(4)]
    scale = channel_scale(feats, n_feat=n_feat)
    scaled = torch.cat(feats) * scale
    rms = scaled.pow(2).mean(0).sqrt().view(n_feat, h)
    median = torch.cat(feats).pow(2).mean(0).sqrt().view(n_feat, h).median(-1).values
    torch.testing.assert_close(rms, median[:, None].expand(n_feat, h), rtol=1e-4, atol=1e-4)
    # fold: fc(x·s) == fc'(x) with fc'.weight = fc.weight·diag(s); the buffer leaves the state dict
    fc = torch.nn.Linear(n_feat * h, h, bias=False)
    sd = fold_feature_scale({"fc.weight": fc.weight.detach().clone(), "feature_scale": scale})
    assert "feature_scale" not in sd
    x = torch.cat(feats)[:7]
    torch.testing.assert_close(x @ sd["fc.weight"].T, fc(x * scale), rtol=1e-4, atol=1e-3)
    assert fold_feature_scale({"fc.weight": fc.weight}) == {"fc.weight": fc.weight}


def test_anchor_coverage_scales_anchors_with_the_document():
    lens = torch.tensor([100, 400])
    mask = torch.zeros(2, 400, dtype=torch.long)
    mask[0, :100] = 1
    mask[1, :] = 1
    cand = [99, 399]                                          # p + 1 < L, both supervised
    cap = sample_anchors(mask, lens, num_anchors=512, block_size=4, seeds=[1, 2])
    assert cap.keep.sum(1).tolist() == cand
    cov = sample_anchors(mask, lens, num_anchors=512, block_size=4, seeds=[1, 2], coverage=0.25)
    assert cov.keep.sum(1).tolist() == [math.ceil(0.25 * c) for c in cand]
    capped = sample_anchors(mask, lens, num_anchors=50, block_size=4, seeds=[1, 2], coverage=0.25)
    assert capped.keep.sum(1).tolist() == [25, 50]


def test_held_out_sources_never_train_and_join_the_held_out_set():
    sources = ["chat"] * 10 + ["math"] * 6
    train, held = hold_out_sources(list(range(12)), [12, 13, 14, 15], sources, ["math"], per_source=4, seed=0)
    assert all(sources[i] == "chat" for i in train) and train == list(range(10))
    assert sum(sources[i] == "math" for i in held) == 4 and len(set(held)) == len(held)


def test_the_cpu_budget_estimates_the_steps_it_affords_and_the_schedule_follows():
    b = CpuBudget(10.0, max_steps=1000)
    assert b.total_steps() == 1000 and not b.spent()
    for _ in range(4):
        b.charge(0.5)
    assert b.total_steps() == 20 and not b.spent()          # 10 s at 0.5 s/step
    for _ in range(16):
        b.charge(0.5)
    assert b.spent()
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    bud = CpuBudget(10.0, max_steps=1000)
    sched = build_scheduler(opt, total_steps=1000, warmup_ratio=0.1, min_lr_ratio=0.0, budget=bud)
    for s in range(20):
        opt.step()
        bud.charge(0.5)
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(lr_factor(20, 20, 0.1, 0.0))  # the cosine's end
