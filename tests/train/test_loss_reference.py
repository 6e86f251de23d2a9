"""The loss object (train/loss.py) equals a slow, straightforward computation on a fixed seed: CE, KL and CE+KL
under the fixed decay, uniform weights and D-PACE, the KL at a temperature (T² scaled), causal in-block drafters
(JetSpec's row: forward KL, uniform weights), a reduced draft vocab, DFlash2's selector term, and the on-path
labels (`train.on_path`: rollout = the target's greedy path as the labels and DFlash2's gold predecessors; mask =
only the positions after raw tokens that agree with the target's argmax) — the loss to rtol 1e-6, its gradients,
and the accuracy / τ counts exactly.

The reference runs the drafter once over all blocks, then walks every block position in plain Python: the
head's logits of that one position, its CE / KL / selector CE from their definitions, its weight (the decay,
or the D-PACE recurrence on the block's own CEs), summed in float64 and divided by the step's Σw. The
drafter runs in float64, so both sides see the same float32 logits; what remains is summation order."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dflashkit.family import new_drafter
from dflashkit.model.draft_vocab import restricted_head
from dflashkit.model.masks import loop_block_mask
from dflashkit.train.loss import Heads, LossInputs
from dflashkit.train.objective import block_input_ids, block_position_ids, labels_and_weights, weight_sum
from tests.helpers import random_case, tiny_contract, train_loss, with_fields

V, B = 40, 4


def _dpace(ce: list[float], sup: list[bool], alpha: float) -> list[float]:
    """w_j = Σ_{m≥j} Π_{1≤i≤m} q̃_i, q̃ = (1−α)·exp(−CE) + α on supervised positions, 0 elsewhere."""
    qt = [((1 - alpha) * math.exp(-c) + alpha) if s else 0.0 for c, s in zip(ce, sup)]
    return [0.0] + [sum(math.prod(qt[1:m + 1]) for m in range(j, len(ce))) for j in range(1, len(ce))]


def _reference(model, emb, head, feats, ids, lm, lens, a, *, loss, gamma, kl_weight=1.0, dpace=None,
               selector=None, vocab=None, tl=None, path=None, label_ids=None, uniform=False, temperature=1.0,
               causal=False):
    """(loss, correct [B], total [B], tau_sum) from the definitions, one block position at a time.

    `path` [b, S, B−1] (rollout): position k of anchor a learns path[a, k−1], its gold predecessor is
    path[a, k−2] (k ≥ 2). `label_ids` [b, S] (mask): position k learns label_ids[a+k] and weighs only when
    ids[a+m] == label_ids[a+m] for every 1 ≤ m < k."""
    b, n = a.anchors.shape
    labels, w = labels_and_weights(ids, lm, lens, a, block_size=B, gamma=None if dpace or uniform else gamma)
    labels, w = labels.view(b, n, B), w.view(b, n, B).clone()
    if path is not None or label_ids is not None:
        labels = labels.clone()
        for i in range(b):
            for j in range(n):
                anc = int(a.anchors[i, j])
                for k in range(1, B):
                    if w[i, j, k] == 0:
                        continue
                    if path is not None:
                        labels[i, j, k] = path[i, anc, k - 1]
                    else:
                        labels[i, j, k] = label_ids[i, anc + k]
                        if any(int(ids[i, anc + m]) != int(label_ids[i, anc + m]) for m in range(1, k)):
                            w[i, j, k] = 0.0
    noise = emb(block_input_ids(ids, a, mask_token_id=model.mask_token_id, block_size=B))
    mask = loop_block_mask(a.anchors.tolist(), a.keep.tolist(), lens.tolist(), ctx_len=ids.shape[1], block_size=B,
                           causal=causal)
    hid = model(noise, feats, block_position_ids(a, ctx_len=ids.shape[1], block_size=B), attention_mask=mask)
    hid = hid.view(b, n, B, -1)
    vl = None if vocab is None else vocab.tolist()
    total = torch.zeros((), dtype=torch.float64)
    correct, count, tau_sum, denom = [0] * B, [0] * B, 0.0, 0.0
    for i in range(b):
        for j in range(n):
            ces, sups, terms, lead, leading = [0.0] * B, [False] * B, [None] * B, 0, True
            for k in range(1, B):
                ok = False
                if w[i, j, k] > 0:
                    p, label = int(a.anchors[i, j]) + k, int(labels[i, j, k])
                    scores = head(hid[i, j, k]).float()
                    if selector is not None:
                        scores = model.unary(scores)
                    count[k] += 1
                    ok = (vl[int(scores.argmax())] if vl else int(scores.argmax())) == label
                    correct[k] += ok
                    sups[k] = True
                    if vl is None or label in vl:
                        gold = label if vl is None else vl.index(label)
                        logq = F.log_softmax(scores, -1)
                        ces[k] = -float(logq[gold].detach())
                        part = (-logq[gold]).double() if loss in ("ce", "ce+kl") else torch.zeros((), dtype=torch.float64)
                        if loss in ("kl", "ce+kl"):
                            t = tl[i, p - 1] if vl is None else tl[i, p - 1][vocab]
                            logp = F.log_softmax(t.float() / temperature, -1)      # P_target at T
                            logq_t = F.log_softmax(scores / temperature, -1)       # Q_draft at T
                            kl = (logp.exp() * (logp - logq_t)).sum().double() * temperature ** 2
                            part = part + (kl_weight if loss == "ce+kl" else 1.0) * kl
                        if selector is not None:
                            top = torch.topk(scores.detach(), model.top_k).indices.tolist()
                            cand = top if label in top else top[:-1] + [label]
                            prev = int(ids[i, p - 1])   # the anchor at k = 1, the gold label after it
                            if path is not None and k >= 2:
                                prev = int(path[i, int(a.anchors[i, j]), k - 2])
                            sc = model.candidate_selector.pair_scores(torch.tensor([[prev]]), torch.tensor([cand]),
                                                                      scores[cand][None], hid[i, j, k][None])[0, 0]
                            part = part + selector * F.cross_entropy(sc[None], torch.tensor([cand.index(label)])).double()
                        terms[k] = part
                        denom += 1.0 if dpace or uniform else float(w[i, j, k])
                    else:
                        ces[k] = math.inf
                leading = leading and ok
                lead += leading
            tau_sum += (1 + lead) * bool(a.keep[i, j])
            weights = _dpace(ces, sups, dpace) if dpace else w[i, j].tolist()
            for k in range(1, B):
                if terms[k] is not None:
                    total = total + weights[k] * terms[k]
    return total / denom, correct, count, tau_sum


CASES = {
    "ce-decay": dict(loss="ce"),
    "kl-decay": dict(loss="kl"),
    "ce+kl-decay": dict(loss="ce+kl", kl_weight=0.5),
    "ce-dpace": dict(loss="ce", dpace=0.5),
    "ce+kl-dpace": dict(loss="ce+kl", kl_weight=0.3, dpace=0.2),
    "ce-decay-vocab": dict(loss="ce", vocab=True),
    "kl-dpace-vocab": dict(loss="kl", dpace=0.5, vocab=True),
    "dflash2-ce-decay": dict(loss="ce", selector=0.7),
    "dflash2-ce-dpace": dict(loss="ce", dpace=0.5, selector=1.0),
    "dflash2-ce+kl": dict(loss="ce+kl", kl_weight=0.5, selector=0.4),
    "ce-decay-rollout": dict(loss="ce", on_path="rollout"),
    "ce-dpace-mask": dict(loss="ce", dpace=0.5, on_path="mask"),
    "dflash2-ce-rollout": dict(loss="ce", selector=0.7, on_path="rollout"),
    "ce-uniform": dict(loss="ce", uniform=True),
    "kl-T2-decay": dict(loss="kl", temperature=2.0),
    # JetSpec as NeMo Automodel trains it: forward KL, T² scaled, uniform weights over 1 … B−1, causal blocks
    "jetspec-kl-uniform-causal": dict(loss="kl", uniform=True, causal=True),
    "jetspec-kl-uniform-T0.5-causal": dict(loss="kl", uniform=True, temperature=0.5, causal=True),
    "ce+kl-uniform-T3-causal-vocab": dict(loss="ce+kl", kl_weight=0.5, uniform=True, temperature=3.0, causal=True,
                                          vocab=True),
    "ce-dpace-causal": dict(loss="ce", dpace=0.5, causal=True),
    "dflash2-ce-causal": dict(loss="ce", selector=0.7, causal=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_loss_object_equals_the_slow_reference(case):
    kw = dict(CASES[case])
    seed, gamma = 3, 2.0
    torch.manual_seed(seed)
    c = with_fields(tiny_contract(block_size=B, vocab=V), causal=kw.get("causal", False))
    if kw.get("selector") is not None:
        c = with_fields(c, drafter_type="dflash2", conv_group_size=8, selector_rank=6, selector_top_k=5,
                        output_multiplier=1.5)
    model = new_drafter(c).double()
    with torch.no_grad():
        for name, p in model.named_parameters():  # a selector and convolutions away from their init
            if "_conv." in name or name.startswith("candidate_selector."):
                p.add_(torch.randn_like(p) * 0.5)
    emb = torch.nn.Embedding(V, c.hidden_size).double().requires_grad_(False)
    head = torch.nn.Linear(c.hidden_size, V, bias=False).double().requires_grad_(False)
    lm, lens, a = random_case(seed, b=3, s=14, num_anchors=4)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 12, lm.shape, generator=g)  # few labels, so a draft vocab has them on both sides
    feats = torch.randn(*lm.shape, 2 * c.hidden_size, generator=g).double()
    tl = torch.randn(*lm.shape, V, generator=g).double() * 3
    vocab = torch.tensor([0, 2, 3, 5, 7, 9, 20]) if kw.pop("vocab", False) else None
    loss_head = head if vocab is None else restricted_head(head, vocab)
    on_path = kw.pop("on_path", None)
    path = torch.randint(0, 12, (*lm.shape, B - 1), generator=g) if on_path == "rollout" else None
    # mask: the target's argmax labels agree with the raw text at about half the positions
    label_ids = torch.where(torch.rand(lm.shape, generator=g) < 0.5, ids, torch.randint(0, 12, lm.shape, generator=g)) \
        if on_path == "mask" else None
    kw.update(path=path, label_ids=label_ids)

    ref, correct, count, tau = _reference(model, emb, loss_head, feats, ids, lm, lens, a, gamma=gamma, vocab=vocab,
                                          tl=tl, **kw)
    ref.backward()
    want = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    weighting = "dpace" if kw.get("dpace") else "uniform" if kw.get("uniform") else "decay"
    train = dict(loss=kw["loss"], kl_weight=kw.get("kl_weight", 1.0), loss_chunk_blocks=2,
                 position_weighting=weighting, dpace_alpha=kw.get("dpace") or 0.5,
                 selector_loss_weight=kw.get("selector") or 1.0, kl_temperature=kw.get("temperature", 1.0))
    objective = train_loss(c, gamma=gamma, **train)
    denom = weight_sum(lm, lens, a, input_ids=ids, block_size=B, gamma=objective.weighting.label_gamma, vocab=vocab,
                       label_ids=label_ids, path_ids=path, on_path_only=on_path == "mask")
    x = LossInputs(feats, ids, lm, lens, target_logits=tl, label_ids=label_ids, path_ids=path,
                   on_path_only=on_path == "mask")
    out = objective(model, Heads(emb, loss_head, vocab), x, a, denom=denom)
    out.loss.backward()
    ref_loss = float(ref.detach())
    assert ref_loss > 0 and math.isclose(float(out.loss.detach()), ref_loss, rel_tol=1e-6), (float(out.loss.detach()), ref_loss)
    for k, gr in want.items():  # float32 logits on both sides: near-zero entries differ at ~1e-7 of the largest
        torch.testing.assert_close(model.get_parameter(k).grad, gr, rtol=1e-5, atol=1e-6 * float(gr.abs().max()))
    if kw.get("selector") is None:  # DFlash2 scores the walk (tests/train/test_dflash2_objective.py)
        assert out.correct.tolist()[1:] == correct[1:] and out.tau_sum == tau
    else:
        assert out.extra["unary_correct"].tolist()[1:] == correct[1:] and out.extra["unary_tau_sum"] == tau
    assert out.total.tolist()[1:] == count[1:]
