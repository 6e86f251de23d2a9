"""Document-aware sequence packing (`train.pack`): samples packed into one row train exactly as they do unpacked.

* the same samples with the same anchors give the same loss and the same drafter gradients packed into one
  row as padded into a batch (full, sliding-window and causal layers);
* the packed mask equals a slow per-query oracle written from the documents (no query sees a key of
  another document), dense and as the flex `mask_mod`;
* anchors are drawn per document (each as it would be alone) and a block's supervised positions never
  leave the anchor's document;
* `collate(pack=...)` places every sample's tokens and cached features at its offset.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflashkit.config import RunConfig
from dflashkit.config.validate import problems
from dflashkit.family import new_drafter
from dflashkit.model.masks import dense_block_mask, mask_mod_for
from dflashkit.train.data import collate, pack_rows, repacked, unpacked
from dflashkit.train.loss import Heads, LossInputs
from dflashkit.train.objective import labels_and_weights, sample_anchors
from tests.helpers import tiny_contract, train_loss, with_fields

V, B = 50, 4


def _docs(seed: int, lens: list[int]):
    """Per document: ids, loss mask, features [n, 2H] (random), and its anchor seed."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k, n in enumerate(lens):
        ids = torch.randint(0, V - 1, (n,), generator=g)
        lm = (torch.rand(n, generator=g) < 0.8).long()
        feats = torch.randn(n, 64, generator=g).double()
        out.append((ids, lm, feats, 1000 * seed + k))
    return out


def _unpacked(docs):
    b, s = len(docs), max(d[0].numel() for d in docs)
    ids = torch.zeros(b, s, dtype=torch.long)
    lm = torch.zeros(b, s, dtype=torch.long)
    feats = torch.zeros(b, s, 64, dtype=torch.float64)
    for i, (d_ids, d_lm, d_f, _) in enumerate(docs):
        n = d_ids.numel()
        ids[i, :n], lm[i, :n], feats[i, :n] = d_ids, d_lm, d_f
    lens = torch.tensor([d[0].numel() for d in docs])
    return ids, lm, feats, lens


def _packed(docs):
    ids = torch.cat([d[0] for d in docs])[None]
    lm = torch.cat([d[1] for d in docs])[None]
    feats = torch.cat([d[2] for d in docs])[None]
    return ids, lm, feats, torch.tensor([ids.shape[1]]), [[(d[0].numel(), d[3]) for d in docs]]


def _model(**over):
    torch.manual_seed(0)
    c = with_fields(tiny_contract(block_size=B, vocab=V), **over)
    model = new_drafter(c).double()
    with torch.no_grad():  # sharper attention, so a key of another document would move the output
        for layer in model.layers:
            layer.self_attn.q_proj.weight.mul_(6.0)
    torch.manual_seed(1)
    emb = torch.nn.Embedding(V, c.hidden_size).double().requires_grad_(False)
    head = torch.nn.Linear(c.hidden_size, V, bias=False).double().requires_grad_(False)
    return c, model, Heads(emb, head)


def _loss_and_grads(c, model, heads, x: LossInputs, a, **train):
    model.zero_grad()
    out = train_loss(c, gamma=4.0, **train)(model, heads, x, a)
    out.loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return out, grads


@pytest.mark.parametrize("over", [{}, {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5},
                                  {"causal": True}], ids=["full", "sliding", "causal"])
def test_packed_equals_unpacked_loss_and_gradients(over):
    docs = _docs(3, [11, 7, 14])
    c, model, heads = _model(**over)
    ids, lm, feats, lens = _unpacked(docs)
    seeds = [d[3] for d in docs]
    a_u = sample_anchors(lm, lens, num_anchors=4, block_size=B, seeds=seeds)
    p_ids, p_lm, p_feats, p_lens, p_docs = _packed(docs)
    a_p = sample_anchors(p_lm, p_lens, num_anchors=4, block_size=B, seeds=[0], docs=p_docs)
    # the same anchors: each document's, shifted by its offset in the row
    offs = [0, 11, 18]
    want = torch.cat([a_u.anchors[i][a_u.keep[i]] + offs[i] for i in range(3)])
    assert torch.equal(a_p.anchors[0][a_p.keep[0]], want)
    out_u, g_u = _loss_and_grads(c, model, heads, LossInputs(feats, ids, lm, lens), a_u)
    out_p, g_p = _loss_and_grads(c, model, heads, LossInputs(p_feats, p_ids, p_lm, p_lens), a_p)
    assert out_p.weight_sum == pytest.approx(out_u.weight_sum, rel=1e-12)
    torch.testing.assert_close(out_p.loss, out_u.loss, rtol=1e-9, atol=1e-12)
    assert torch.equal(out_p.correct, out_u.correct) and torch.equal(out_p.total, out_u.total)
    assert out_p.tau_sum == out_u.tau_sum and out_p.blocks == out_u.blocks
    assert g_u.keys() == g_p.keys() and g_u
    for k in g_u:
        torch.testing.assert_close(g_p[k], g_u[k], rtol=1e-7, atol=1e-10, msg=k)


def _oracle(anchors, keep, doc_of, seq_len, *, block_size, causal, window):
    """A query of block j (offset k) sees context key i iff keep, i < anchor, i < L, i in the anchor's
    document (and p − W < i for a sliding layer); its own block as usual."""
    n, s = len(anchors), len(doc_of)
    out = torch.zeros(n * block_size, s + n * block_size, dtype=torch.bool)
    for j, anc in enumerate(anchors):
        for k in range(block_size):
            q = j * block_size + k
            for i in range(s):
                out[q, i] = (keep[j] and i < anc and i < seq_len and doc_of[i] == doc_of[anc]
                             and (window is None or i > anc + k - window))
            for kk in range(block_size):
                out[q, s + j * block_size + kk] = kk <= k or not causal
    return out


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, 4)])
def test_packed_mask_matches_oracle(causal, window):
    docs = _docs(5, [9, 3, 12, 6])
    _, p_lm, _, p_lens, p_docs = _packed(docs)
    s = int(p_lens[0]) + 2                                   # two padding columns
    lm = torch.nn.functional.pad(p_lm, (0, 2))
    a = sample_anchors(lm, p_lens, num_anchors=3, block_size=B, seeds=[0], docs=p_docs)
    doc_of = sum(([d] * n for d, (n, _) in enumerate(p_docs[0])), []) + [-1, -1]
    assert a.starts is not None
    got = dense_block_mask(a.anchors, a.keep, p_lens, ctx_len=s, block_size=B, causal=causal, window=window,
                           starts=a.starts)[0, 0]
    want = _oracle(a.anchors[0].tolist(), a.keep[0].tolist(), doc_of, int(p_lens[0]), block_size=B,
                   causal=causal, window=window)
    assert torch.equal(got, want)
    mod = mask_mod_for(a.anchors, a.keep, p_lens, ctx_len=s, block_size=B, causal=causal, window=window,
                       starts=a.starts)
    q = torch.arange(want.shape[0])[:, None]
    kv = torch.arange(want.shape[1])[None, :]
    assert torch.equal(mod(torch.tensor(0), torch.tensor(0), q, kv), want)


def test_anchors_never_straddle_a_document_boundary():
    lens = [2, 5, 1, 9, 4, 16]
    docs = _docs(7, lens)
    for d in docs:
        d[1].fill_(1)                                        # every token supervised: boundaries are the only limit
    _, p_lm, _, p_lens, p_docs = _packed(docs)
    a = sample_anchors(p_lm, p_lens, num_anchors=100, block_size=B, seeds=[0], docs=p_docs)
    assert a.starts is not None and a.ends is not None and a.positions is not None
    bounds = np.cumsum([0, *lens])
    _, w = labels_and_weights(torch.zeros_like(p_lm), p_lm, p_lens, a, block_size=B, gamma=None)
    w = w.view(1, -1, B)
    for j, anc in enumerate(a.anchors[0].tolist()):
        d = int(np.searchsorted(bounds, anc, side="right")) - 1
        assert (int(a.starts[0, j]), int(a.ends[0, j])) == (bounds[d], bounds[d + 1])
        assert anc + 1 < bounds[d + 1]                        # the anchor's first prediction is in its document
        for k in range(B):
            if w[0, j, k] > 0:
                assert anc + k < bounds[d + 1]
    # every candidate of every document is drawn (cap 100), none of a 1-token document
    assert int(a.keep.sum()) == sum(n - 1 for n in lens if n >= 2)
    assert a.positions[0].tolist() == [p for n in lens for p in range(n)]


class _Store:
    def __init__(self, feats):
        self.feats = feats

    def get(self, where, n, name):
        return self.feats[where[0]][:n]


def test_collate_packs_tokens_and_cached_features():
    from dflashkit.data.shards import TokenData

    docs = _docs(9, [5, 8, 3, 6])
    data = TokenData(ids=[str(i) for i in range(4)], input_ids=[d[0].numpy() for d in docs],
                     loss_mask=[d[1].numpy() for d in docs], shards=[], where=[(i, 0) for i in range(4)],
                     features=_Store([d[2].float() for d in docs]))  # type: ignore[arg-type]
    items = [(0, 0), (1, 0), (2, 0), (3, 0)]
    assert pack_rows([5, 8, 3, 6], 12) == [[0, 2], [1], [3]]
    b = collate(data, items, run_seed=1, with_features=True, pack=12)
    u = collate(data, items, run_seed=1, with_features=True)
    assert b.docs is not None and [[n for n, _ in r] for r in b.docs] == [[5, 3], [8], [6]]
    assert b.seq_lens.tolist() == [8, 8, 6] and b.features is not None and u.features is not None
    for (row, off), k in zip([(0, 0), (1, 0), (0, 5), (2, 0)], range(4)):
        n = len(docs[k][0])
        assert torch.equal(b.input_ids[row, off:off + n], u.input_ids[k, :n])
        assert torch.equal(b.features[row, off:off + n], u.features[k, :n])
        assert b.docs[row][[0, 5].index(off) if row == 0 else 0][1] == u.seeds[k]
    back = unpacked(b)                                         # what an online target runs on: one document a row
    order = [0, 2, 1, 3]                                       # rows in order, documents in order
    assert back.seq_lens.tolist() == [lens for lens in (5, 3, 8, 6)] and back.seeds == [u.seeds[k] for k in order]
    assert torch.equal(back.input_ids[:, :8], u.input_ids[order]) and back.features is not None
    assert torch.equal(repacked(back.features, b), b.features)


def test_pack_config_checks():
    cfg = RunConfig()
    assert not any("pack" in p for p in problems(cfg))
    cfg.train.pack = True
    assert not any("pack" in p for p in problems(cfg))                  # online: the target runs per document
    cfg.train.features = "engine"
    assert any("train.pack supports train.features=cached or online" in p for p in problems(cfg))
    cfg.train.features = "cached"
    from dflashkit.family import FAMILIES, checks

    assert not any("train.pack" in p for p in checks(cfg))
    for name, fam in FAMILIES.items():  # the family says whether its loss takes packed rows
        cfg.drafter.type = name
        assert any(f"drafter.type={name}" in p for p in checks(cfg) if p.startswith("train.pack")) != fam.objective.packs
    assert FAMILIES["dflash"].objective.packs
    cfg.drafter.type = "dflash"
    cfg.train.pack_length = 1
    assert any("train.pack_length" in p for p in problems(cfg))


@pytest.mark.parametrize("features", ["cached", "online"])
def test_packed_training_equals_unpacked_end_to_end(tmp_path, tiny_qwen3, capsys, features):
    """`dflashkit train`: packed rows train the same steps as unpacked batches (cached features: each sample's
    own, concatenated; online: the target runs per document)."""
    import json
    import shutil

    from dflashkit.cli import main
    from tests.helpers import make_run, overrides

    rd = make_run(tmp_path / "plain", tiny_qwen3)
    if features == "cached":
        assert main(["capture", "--json", *overrides(rd, tiny_qwen3), "capture.dtype=float32"]) == 0
    packed = tmp_path / "packed"
    shutil.copytree(rd, packed)
    common = {"train__max_steps": 3, "train__features": features, "train__batch_size": 4, "train__feature_noise": 0}
    assert main(["train", "--json", *overrides(rd, tiny_qwen3, **common)]) == 0
    assert main(["train", "--json", *overrides(packed, tiny_qwen3, **common, train__pack="true",
                                               train__pack_length=4096)]) == 0

    def losses(run):
        return [json.loads(x)["loss"] for x in (run / "train" / "metrics.jsonl").read_text().splitlines()]

    plain, pk = losses(rd), losses(packed)
    assert len(plain) == len(pk) == 4 and torch.allclose(torch.tensor(plain), torch.tensor(pk), atol=1e-5), (plain, pk)
