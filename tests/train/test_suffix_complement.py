"""`train.suffix_complement`: positions the suffix proposer already gets right in context weigh less or nothing.

* the factors equal a slow oracle (per anchor: a fresh in-context proposal from the document's tokens up to the
  anchor, then its leading run of correct supervised labels, counted in plain Python), on random and repetitive
  samples, with data and target labels;
* packed rows give each document the factors it has alone (no match across a document boundary);
* a batch the proposer never covers trains bit-identically under every mode, and `off` builds no factors;
* drop and downweight change exactly the covered rows' loss weights (the loss is Σ factor·w·CE over the
  rows), while the rows, the denominator and the metrics stay the labels' own;
* the option is part of the resume fingerprint and of the config check;
* `dflashkit train` with the option on completes and records `suffix_covered`.
"""

from __future__ import annotations

import json

import pytest
import torch

from dflashkit.config import RunConfig, TrainSection
from dflashkit.config.validate import problems
from dflashkit.decode.suffix import SuffixProposer
from dflashkit.family import new_drafter
from dflashkit.train import guards
from dflashkit.train.blocks import Heads, LossInputs, build_blocks
from dflashkit.train.objective import sample_anchors
from dflashkit.train.suffix_complement import SuffixComplement
from tests.helpers import tiny_contract, train_loss

V, B = 50, 4
DEPTH = 32  # the proposer's default max_depth


def _followers(seq: list[int], ctx: list[int]) -> list[tuple[int, int]]:
    """(following token, start) of every occurrence of `ctx` in `seq` with a token after it."""
    m = len(ctx)
    return [(seq[i + m], i) for i in range(len(seq) - m) if seq[i:i + m] == ctx]


def _brute_proposal(seq: list[int], k: int) -> tuple[list[int], int]:
    """(proposal, match length), by brute force: the longest suffix (≤ DEPTH) of `seq` followed by a token
    somewhere in it, then the most frequent follower of the last ≤ DEPTH tokens, token by token (ties: the
    most recent occurrence), while that context is followed at all."""
    match = next((m for m in range(min(DEPTH, len(seq) - 1), 0, -1) if _followers(seq, seq[len(seq) - m:])), 0)
    out: list[int] = []
    ctx = seq[len(seq) - match:] if match else []
    while match and len(out) < k:
        foll = _followers(seq, ctx)
        if not foll:
            break
        counts: dict[int, int] = {}
        for t, _ in foll:
            counts[t] = counts.get(t, 0) + 1
        best = max(counts.values())
        tok = max((i, t) for t, i in foll if counts[t] == best)[1]
        out.append(tok)
        ctx = (ctx + [tok])[-DEPTH:]
    return out, match


def _sample(g: torch.Generator, n: int, repetitive: bool) -> torch.Tensor:
    """Random ids, or a few phrases repeated with a mutation now and then (long in-context matches)."""
    if not repetitive:
        return torch.randint(0, 12, (n,), generator=g)  # a small alphabet: short matches are common
    phrases = [torch.randint(0, V - 1, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g)
               for _ in range(3)]
    out: list[int] = []
    while len(out) < n:
        p = phrases[int(torch.randint(0, 3, (1,), generator=g))].tolist()
        if float(torch.rand(1, generator=g)) < 0.3:
            p[int(torch.randint(0, len(p), (1,), generator=g))] = int(torch.randint(0, V - 1, (1,), generator=g))
        out += p
    return torch.tensor(out[:n])


def _batch(seed: int, repetitive: bool, b: int = 3, s: int = 40):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(8, s + 1, (b,), generator=g)
    lens[0] = s
    ids = torch.zeros(b, s, dtype=torch.long)
    lm = torch.zeros(b, s, dtype=torch.long)
    for i in range(b):
        n = int(lens[i])
        ids[i, :n] = _sample(g, n, repetitive)
        lm[i, :n] = (torch.rand(n, generator=g) < 0.85).long()
    return ids, lm, lens


def _model():
    torch.manual_seed(0)
    c = tiny_contract(block_size=B, vocab=V)
    model = new_drafter(c).double()
    torch.manual_seed(1)
    emb = torch.nn.Embedding(V, c.hidden_size).double().requires_grad_(False)
    head = torch.nn.Linear(c.hidden_size, V, bias=False).double().requires_grad_(False)
    return c, model, Heads(emb, head)


def _blocks(model, heads, ids, lm, lens, a, comp, label_ids=None):
    feats = torch.randn(*ids.shape, 64, generator=torch.Generator().manual_seed(5)).double()  # 2 layers · H
    x = LossInputs(feats, ids, lm, lens, label_ids=label_ids, complement=comp)
    return build_blocks(x, a, heads, model=model, mask_token_id=V - 1, gamma=4.0), x


def _oracle(ids, lm, lens, a, label_ids, weight: float, min_match: int, starts=None, ends=None) -> torch.Tensor:
    """[b, N, B] expected factors, plain Python: each anchor's own document context, a brute-force proposal."""
    b, n = a.anchors.shape
    out = torch.ones(b, n, B)
    for i in range(b):
        row, lab, mask = ids[i].tolist(), label_ids[i].tolist(), lm[i].tolist()
        for j in range(n):
            if not bool(a.keep[i, j]):
                continue
            p = int(a.anchors[i, j])
            s = 0 if starts is None else int(starts[i, j])
            e = int(lens[i]) if ends is None else int(ends[i, j])
            tokens, match = _brute_proposal(row[s:p + 1], B - 1)
            if match < min_match:
                continue
            for k in range(1, B):
                if k > len(tokens) or p + k >= e or not mask[p + k] or tokens[k - 1] != lab[p + k]:
                    break
                out[i, j, k] = weight
    return out


@pytest.mark.parametrize("repetitive", [False, True])
@pytest.mark.parametrize("labels", ["data", "target"])
@pytest.mark.parametrize("min_match", [1, 3])
def test_factors_equal_a_slow_oracle(repetitive, labels, min_match):
    c, model, heads = _model()
    covered = 0
    for seed in range(4):
        ids, lm, lens = _batch(seed, repetitive)
        label_ids = ids.clone() if labels == "data" else torch.where(
            torch.rand(ids.shape, generator=torch.Generator().manual_seed(seed)) < 0.2, (ids + 1) % (V - 1), ids)
        a = sample_anchors(lm, lens, num_anchors=30, block_size=B, seeds=[seed * 10 + i for i in range(3)])
        comp = SuffixComplement(SuffixProposer, 0.25, min_match)
        blk, _ = _blocks(model, heads, ids, lm, lens, a, comp, label_ids=label_ids)
        want = _oracle(ids, lm, lens, a, label_ids, 0.25, min_match)
        assert blk.complement is not None
        assert torch.equal(blk.complement.view(want.shape), want), seed
        assert blk.covered == int((want < 1).sum())
        covered += blk.covered
    if repetitive or min_match == 1:
        assert covered > 0  # the oracle had something to agree with


def test_packed_rows_never_match_across_a_document_boundary():
    """The same documents packed into one row get the factors they get alone, although the second document
    repeats the first (a leak across the boundary would cover its first blocks)."""
    g = torch.Generator().manual_seed(3)
    first = _sample(g, 30, True)
    docs = [first, first.clone(), _sample(g, 25, True)]
    lms = [(torch.rand(d.numel(), generator=g) < 0.9).long() for d in docs]
    seeds = [101, 102, 103]
    comp = SuffixComplement(SuffixProposer, 0.0, 2)
    c, model, heads = _model()

    s = max(d.numel() for d in docs)
    ids = torch.zeros(3, s, dtype=torch.long)
    lm = torch.zeros(3, s, dtype=torch.long)
    for i, (d, m) in enumerate(zip(docs, lms)):
        ids[i, :d.numel()], lm[i, :d.numel()] = d, m
    lens = torch.tensor([d.numel() for d in docs])
    a = sample_anchors(lm, lens, num_anchors=40, block_size=B, seeds=seeds)
    alone, _ = _blocks(model, heads, ids, lm, lens, a, comp)

    pid, plm = torch.cat(docs)[None], torch.cat(lms)[None]
    plen = torch.tensor([pid.shape[1]])
    pa = sample_anchors(plm, plen, num_anchors=40, block_size=B, seeds=[0],
                        docs=[[(d.numel(), sd) for d, sd in zip(docs, seeds)]])
    packed, _ = _blocks(model, heads, pid, plm, plen, pa, comp)

    assert alone.complement is not None and packed.complement is not None
    per_doc = alone.complement.view(3, -1, B)
    want = torch.cat([per_doc[i, :int(a.keep[i].sum())] for i in range(3)])
    got = packed.complement.view(1, -1, B)[0, :int(pa.keep.sum())]
    assert torch.equal(got, want)
    assert packed.covered == alone.covered > 0
    # the second document alone: its blocks before its own repeat cannot be covered
    pw = _oracle(pid, plm, plen, pa, pid, 0.0, 2, starts=pa.starts, ends=pa.ends)
    assert torch.equal(packed.complement.view(pw.shape), pw)


def _loss_parts(train: dict, ids, lm, lens, a):
    c, model, heads = _model()
    loss = train_loss(c, gamma=4.0, **train)
    comp = SuffixComplement.from_train(TrainSection(**train), SuffixProposer)
    feats = torch.randn(*ids.shape, 64, generator=torch.Generator().manual_seed(7)).double()
    x = LossInputs(feats, ids, lm, lens, complement=comp)
    model.zero_grad()
    out = loss(model, heads, x, a, denom=17.0)
    out.loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    blk = build_blocks(x, a, heads, model=model, mask_token_id=V - 1, gamma=loss.weighting.label_gamma)
    return out, grads, blk, (loss, model, heads, x)


@pytest.mark.parametrize("weighting", ["decay", "dpace"])
def test_a_batch_the_proposer_never_covers_trains_bit_identically(weighting):
    ids = torch.arange(40).view(2, 20) % (V - 1)  # every token distinct within its sample: no match at all
    lm, lens = torch.ones_like(ids), torch.tensor([20, 20])
    a = sample_anchors(lm, lens, num_anchors=12, block_size=B, seeds=[1, 2])
    off, g_off, blk_off, _ = _loss_parts({"position_weighting": weighting}, ids, lm, lens, a)
    assert blk_off.complement is None and off.covered is None
    for mode in ("drop", "downweight"):
        on, g_on, blk_on, _ = _loss_parts({"position_weighting": weighting, "suffix_complement": mode,
                                           "suffix_complement_min_match": 1}, ids, lm, lens, a)
        assert on.covered == 0 and torch.equal(on.loss, off.loss)
        assert all(torch.equal(g_on[k], g_off[k]) for k in g_off)
        assert torch.equal(blk_on.weights, blk_off.weights) and torch.equal(blk_on.rows, blk_off.rows)


@pytest.mark.parametrize("weighting", ["decay", "dpace"])
@pytest.mark.parametrize("mode", ["drop", "downweight"])
def test_drop_and_downweight_change_exactly_the_covered_rows(mode, weighting):
    ids, lm, lens = _batch(11, True)
    a = sample_anchors(lm, lens, num_anchors=30, block_size=B, seeds=[7, 8, 9])
    train = {"position_weighting": weighting, "suffix_complement": mode, "suffix_complement_min_match": 2,
             "suffix_complement_weight": 0.25}
    off, _, blk_off, _ = _loss_parts({"position_weighting": weighting}, ids, lm, lens, a)
    on, _, blk, (loss, model, heads, x) = _loss_parts(train, ids, lm, lens, a)
    factor = blk.complement
    assert factor is not None
    want = _oracle(ids, lm, lens, a, ids, 0.0 if mode == "drop" else 0.25, 2).flatten()
    assert torch.equal(factor, want) and (want < 1).any()
    # the labels' weights, rows, denominator and scoring are the ones of off
    assert torch.equal(blk.weights, blk_off.weights) and torch.equal(blk.rows, blk_off.rows)
    assert blk.weight_sum == blk_off.weight_sum
    assert torch.equal(on.correct, off.correct) and torch.equal(on.total, off.total) and on.tau_sum == off.tau_sum
    # the loss is Σ over the rows of factor · (the weighting's weight) · CE, over the same denominator
    with torch.no_grad():
        hidden = loss.forward(model, heads, blk)
        parts, _ = loss.row_values(model, heads, x, a, blk, hidden)
        ce = torch.cat(parts[0])
        row_w = loss.weighting.row_weights(blk.weights, blk.rows, blk.sup, parts[-1])
        kept = factor[blk.rows]
        expect = (row_w * kept * ce).sum() / 17.0
        full = (row_w * ce).sum() / 17.0
    assert torch.allclose(on.loss.detach(), expect, rtol=1e-10, atol=1e-12)
    assert torch.allclose(off.loss.detach(), full, rtol=1e-10, atol=1e-12) and not torch.allclose(expect, full)
    if mode == "drop":  # the dropped rows give the loss nothing
        assert int((kept == 0).sum()) == on.covered > 0


def test_the_option_is_part_of_the_resume_fingerprint_and_checked():
    t = TrainSection()
    state = {"objective": json.loads(json.dumps(guards.objective(t)))}
    assert guards.objective_changes(state, t) == []
    changed = guards.objective_changes(state, TrainSection(suffix_complement="drop"))
    assert changed and "train.suffix_complement" in changed[0]
    assert "suffix_complement_weight" in guards.TRAJECTORY_KEYS
    assert SuffixComplement.from_train(t, None) is None  # off needs no proposer
    with pytest.raises(ValueError, match="suffix proposer"):
        SuffixComplement.from_train(TrainSection(suffix_complement="drop"), None)
    cfg = RunConfig()
    cfg.train.suffix_complement_weight = 1.0
    assert any("train.suffix_complement_weight" in p for p in problems(cfg))
    cfg.train.suffix_complement_weight, cfg.train.suffix_complement_min_match = 0.5, 0
    assert any("train.suffix_complement_min_match" in p for p in problems(cfg))


def test_train_with_the_option_completes_and_records_the_covered_share(tmp_path, tiny_qwen3):
    from dflashkit.cli import main
    from tests.helpers import make_run, overrides

    rd = make_run(tmp_path / "run", tiny_qwen3)
    assert main(["train", "--json", *overrides(rd, tiny_qwen3, train__max_steps=2, train__suffix_complement="drop",
                                               train__suffix_complement_min_match=1)]) == 0
    rows = [json.loads(x) for x in (rd / "train" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "suffix_covered" in r]
    assert len(steps) == 2 and all(0 <= r["suffix_covered"] <= 1 for r in steps)
    assert any(r["suffix_covered"] > 0 for r in steps)
    assert all(r.get("split") != "heldout" for r in steps)  # held-out scoring has no complement
