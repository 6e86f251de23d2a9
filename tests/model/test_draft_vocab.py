"""Reduced draft vocabulary: choice == counter oracle, loss == restricted-head loop oracle (out-of-vocab
labels: no loss, counted wrong), checkpoint tensors in vLLM's d2t convention, bad d2t → UsageError."""

from __future__ import annotations

import json
import math
from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dflashkit.config import TargetSection
from dflashkit.errors import UsageError
from dflashkit.export.hf import load_drafter, save_drafter
from dflashkit.model.draft_vocab import (check_draft_vocab, choose_draft_vocab, draft_labels, from_offsets,
                                         label_token_counts, restricted_head, t2d_mask, to_offsets)
from dflashkit.model.drafter import DFlashDraftModel
from dflashkit.model.masks import dense_block_mask
from dflashkit.train.loss import Heads, LossInputs
from dflashkit.train.objective import block_input_ids, block_position_ids, weight_sum
from tests.helpers import random_case, tiny_contract, train_loss


def _oracle_vocab(samples, size, vocab_size, always=()):
    """Slow oracle: count supervised tokens, eos first, most frequent then lower id, fill with lowest unused."""
    c = Counter(t for ids, m in samples for t, x in zip(ids, m) if x == 1)
    chosen = sorted({a for a in always if 0 <= a < vocab_size})
    chosen += sorted((t for t in c if t not in chosen), key=lambda t: (-c[t], t))[:size - len(chosen)]
    chosen += [t for t in range(vocab_size) if t not in chosen][:size - len(chosen)]
    return sorted(chosen)


def test_hand_made_vocab_choice():
    # supervised counts: 7 ×3, 3 ×2, 9 ×2, 6 ×1, 2 ×1; unsupervised 5, 1 never count
    samples = [([5, 6, 7, 7, 9, 1], [0, 1, 1, 1, 1, 0]),
               ([7, 3, 3, 9, 2], [1, 1, 1, 1, 1]),
               ([5, 5, 5, 1], [0, 0, 0, 0])]
    ids = [np.array(s[0]) for s in samples]
    masks = [np.array(s[1]) for s in samples]
    assert choose_draft_vocab(ids, masks, 3, 12).tolist() == [3, 7, 9]          # 3 and 9 tie: both fit
    assert choose_draft_vocab(ids, masks, 2, 12).tolist() == [3, 7]             # tie → the lower id
    assert choose_draft_vocab(ids, masks, 3, 12, always=[11]).tolist() == [3, 7, 11]   # eos always
    assert choose_draft_vocab(ids, masks, 7, 12).tolist() == [0, 1, 2, 3, 6, 7, 9]     # filled: 0, 1
    with pytest.raises(UsageError, match="draft_vocab_size 13"):
        choose_draft_vocab(ids, masks, 13, 12)
    with pytest.raises(UsageError, match="eos ids"):
        choose_draft_vocab(ids, masks, 1, 12, always=[10, 11])
    with pytest.raises(UsageError, match="token id 12"):
        choose_draft_vocab([np.array([12])], [np.array([1])], 1, 12)


@pytest.mark.parametrize("seed", range(4))
def test_vocab_choice_matches_counter_oracle(seed):
    rng = np.random.default_rng(seed)
    V = 40
    samples = []
    for _ in range(25):
        n = int(rng.integers(1, 30))
        ids = rng.zipf(1.6, n) % V  # skewed, with ties
        samples.append((ids.tolist(), (rng.random(n) < 0.6).astype(int).tolist()))
    ids = [np.array(s[0]) for s in samples]
    masks = [np.array(s[1]) for s in samples]
    assert np.array_equal(label_token_counts(ids, masks, V, chunk_tokens=3), label_token_counts(ids, masks, V))
    for size in (1, 5, 17, 39, 40):
        for always in ((), (V - 1,), (0, 33)):
            if len(always) > size:
                continue
            got = choose_draft_vocab(ids, masks, size, V, always=always)
            assert got.dtype == torch.int64 and got.tolist() == _oracle_vocab(samples, size, V, always), (size, always)


def test_offsets_masks_and_label_mapping():
    vocab = torch.tensor([2, 3, 10, 11, 40])
    d2t = to_offsets(vocab)
    assert d2t.tolist() == [2, 2, 8, 8, 36] and torch.equal(from_offsets(d2t), vocab)
    assert torch.equal(torch.arange(5) + d2t, vocab)  # vLLM: target id = draft id + d2t[draft id]
    assert t2d_mask(vocab, 50).nonzero().flatten().tolist() == vocab.tolist()
    idx, inside = draft_labels(torch.tensor([[3, 4, 40], [0, 2, 41]]), vocab)
    assert inside.tolist() == [[True, False, True], [False, True, False]]
    assert idx.tolist() == [[1, 0, 4], [0, 0, 0]]
    for bad, msg in ((torch.tensor([3, 2]), "strictly increasing"), (torch.tensor([1, 1]), "strictly increasing"),
                     (torch.tensor([1, 50]), "outside the target vocab"), (torch.tensor([-1, 2]), "outside"),
                     (torch.tensor([1.0, 2.0]), "integer")):
        with pytest.raises(UsageError, match=msg):
            check_draft_vocab(bad, vocab_size=50, source="x")
    with pytest.raises(UsageError, match="has 2 entries but draft_vocab_size is 3"):
        check_draft_vocab(torch.tensor([1, 2]), vocab_size=50, size=3)


def _hidden(model, emb, feats, ids, lens, a, mask_id):
    B = model.block_size
    noise = emb(block_input_ids(ids, a, mask_token_id=mask_id, block_size=B))
    pos = block_position_ids(a, ctx_len=ids.shape[1], block_size=B)
    mask = dense_block_mask(a.anchors, a.keep, lens, ctx_len=ids.shape[1], block_size=B)
    return model(noise, feats, pos, attention_mask=mask)


@pytest.mark.parametrize("kind", ["ce", "ce+kl"])
@pytest.mark.parametrize("seed", range(3))
def test_reduced_vocab_loss_and_metrics_equal_loop_oracle(seed, kind):
    """Oracle: the full head's logits restricted to the vocab columns by hand, position by position."""
    torch.manual_seed(seed)
    V, B, gamma, kl_weight = 50, 4, 2.0, 0.5
    c = tiny_contract(block_size=B, vocab=V)
    model = DFlashDraftModel(c)
    emb = torch.nn.Embedding(V, c.hidden_size).requires_grad_(False)
    head = torch.nn.Linear(c.hidden_size, V, bias=True).requires_grad_(False)
    lm, lens, a = random_case(seed, b=3, s=16, num_anchors=5)
    ids = torch.randint(0, 12, lm.shape)  # few distinct labels so that some are inside the vocab
    feats = torch.randn(*lm.shape, 2 * c.hidden_size)
    tl = torch.randn(*ids.shape, V) * 3
    vocab = torch.tensor(sorted(torch.randperm(12)[:6].tolist() + [20, 30]))
    objective = train_loss(c, gamma=gamma, loss=kind, kl_weight=kl_weight, loss_chunk_blocks=2)
    out = objective(model, Heads(emb, restricted_head(head, vocab), vocab), LossInputs(feats, ids, lm, lens, target_logits=tl),
               a)
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)

    with torch.no_grad():
        hidden = _hidden(model, emb, feats, ids, lens, a, c.mask_token_id)
    vl = vocab.tolist()
    loss = wsum = 0.0
    correct, total, tau_sum, oov = [0] * B, [0] * B, 0.0, 0
    for i in range(3):
        for j in range(a.anchors.shape[1]):
            anc, keep = int(a.anchors[i, j]), bool(a.keep[i, j])
            lead, leading = 0, True
            for k in range(1, B):
                p = anc + k
                w = (keep and p < lens[i] and bool(lm[i, p])) * math.exp(-(k - 1) / gamma)
                ok = False
                if w > 0:
                    total[k] += 1
                    label = int(ids[i, p])
                    logits = head(hidden[i, j * B + k])[vocab]          # the full head, restricted by hand
                    pred = vl[int(logits.argmax())]
                    ok = pred == label
                    correct[k] += ok
                    if label in vl:
                        logp = F.log_softmax(logits, -1)
                        term = -logp[vl.index(label)].item() if kind in ("ce", "ce+kl") else 0.0
                        if kind == "ce+kl":
                            tlogp = F.log_softmax(tl[i, p - 1][vocab], -1)
                            term += kl_weight * (tlogp.exp() * (tlogp - logp)).sum().item()
                        loss += w * term
                        wsum += w
                    else:
                        oov += 1
                leading = leading and ok
                lead += leading
            tau_sum += (1 + lead) * keep
    assert oov > 0 and wsum > 0  # the case has labels on both sides of the vocab
    assert abs(out.weight_sum - wsum) < 1e-5
    assert abs(weight_sum(lm, lens, a, input_ids=ids, block_size=B, gamma=gamma, vocab=vocab) - wsum) < 1e-5
    assert abs(out.loss.item() - loss / wsum) < 1e-4 * max(1.0, loss / wsum), (out.loss.item(), loss / wsum)
    assert out.correct.tolist()[1:] == correct[1:] and out.total.tolist()[1:] == total[1:]
    assert out.tau_sum == tau_sum


def test_restricted_head_requires_matching_rows():
    c = tiny_contract(vocab=50)
    model = DFlashDraftModel(c)
    emb = torch.nn.Embedding(50, c.hidden_size)
    head = torch.nn.Linear(c.hidden_size, 50, bias=False)
    lm, lens, a = random_case(0, b=2, s=10)
    with pytest.raises(ValueError, match="restricted_head"):
        train_loss(c, gamma=2.0)(model, Heads(emb, head, torch.tensor([1, 2, 3])),
                                 LossInputs(torch.randn(2, 10, 64), torch.randint(0, 40, (2, 10)), lm, lens), a)


# -- the checkpoint format -------------------------------------------------------------------


@pytest.fixture(scope="module")
def target(tiny_qwen3):
    from dflashkit.target.load import load_target

    return load_target(TargetSection(path=str(tiny_qwen3), device="cpu", dtype="float32"))


VOCAB = [1, 10, 32, 97, 101, 115, 258, 300]


def _reduced(target, **kw):
    from dflashkit.testing import random_drafter

    torch.manual_seed(0)
    return DFlashDraftModel(random_drafter(target, **kw).contract, draft_vocab=torch.tensor(VOCAB)).eval()


def test_save_load_roundtrip_with_d2t_in_the_vllm_convention(tmp_path, target):
    from safetensors.torch import load_file

    d = _reduced(target, layers=2)
    head = target.lm_head.weight.detach()
    save_drafter(d, tmp_path / "x", dtype="bfloat16", head=head)
    cfg = json.loads((tmp_path / "x" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == cfg["dflash_config"]["draft_vocab_size"] == len(VOCAB)
    assert cfg["vocab_size"] == target.vocab_size
    sd = load_file(tmp_path / "x" / "model.safetensors")
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool and sd["t2d"].shape == (target.vocab_size,)
    assert (torch.arange(len(VOCAB)) + sd["d2t"]).tolist() == VOCAB            # target id = i + d2t[i]
    assert sd["t2d"].nonzero().flatten().tolist() == VOCAB
    assert sd["lm_head.weight"].dtype == torch.bfloat16
    assert torch.equal(sd["lm_head.weight"], head[VOCAB].to(torch.bfloat16))
    # vLLM's compute_logits: its own head's V' logits scattered to arange + d2t, -inf elsewhere
    h = torch.randn(3, target.hidden_size)
    small = h @ sd["lm_head.weight"].float().T
    full = small.new_full((3, cfg["vocab_size"]), float("-inf"))
    full[:, torch.arange(cfg["draft_vocab_size"]) + sd["d2t"]] = small
    want = h @ head.to(torch.bfloat16).float().T
    assert torch.allclose(full[:, VOCAB], want[:, VOCAB]) and torch.isinf(full).sum() == 3 * (cfg["vocab_size"] - 8)

    back = load_drafter(tmp_path / "x", dtype=torch.float32)
    assert back.draft_vocab.tolist() == VOCAB and back.draft_vocab_size == len(VOCAB)
    assert set(back.state_dict()) == set(d.state_dict()) == {"d2t"} | set(_plain(target).state_dict())
    # train/final style (no head): d2t only, still loads
    save_drafter(d, tmp_path / "y", dtype="float32")
    assert set(load_file(tmp_path / "y" / "model.safetensors")) == set(d.state_dict())
    assert load_drafter(tmp_path / "y").draft_vocab.tolist() == VOCAB


def _plain(target):
    from dflashkit.testing import random_drafter

    return random_drafter(target, layers=2)


def test_full_vocab_files_are_unchanged_by_the_feature(tmp_path, target):
    from safetensors.torch import load_file

    d = _plain(target)
    save_drafter(d, tmp_path / "full", dtype="bfloat16", head=target.lm_head.weight)  # head ignored
    cfg = json.loads((tmp_path / "full" / "config.json").read_text())
    assert cfg == d.contract.to_hf_config(dtype="bfloat16") and "draft_vocab_size" not in json.dumps(cfg)
    assert set(load_file(tmp_path / "full" / "model.safetensors")) == set(d.state_dict())
    assert load_drafter(tmp_path / "full").draft_vocab is None


def _edit(tmp_path, target, name, *, config=None, tensors=None, drop=()):
    from safetensors.torch import load_file, save_file

    d = _reduced(target)
    out = tmp_path / name
    save_drafter(d, out, dtype="float32", head=target.lm_head.weight)
    if config:
        cfg = json.loads((out / "config.json").read_text())
        config(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
    sd = load_file(out / "model.safetensors")
    for k in drop:
        sd.pop(k)
    sd.update(tensors or {})
    save_file(sd, str(out / "model.safetensors"))
    return out


def test_bad_reduced_vocab_checkpoints_are_clear_errors(tmp_path, target):
    V = target.vocab_size
    d2t = to_offsets(torch.tensor(VOCAB))

    def no_size(cfg):
        cfg.pop("draft_vocab_size")
        cfg["dflash_config"].pop("draft_vocab_size")

    def disagree(cfg):
        cfg["dflash_config"]["draft_vocab_size"] = 7

    def too_big(cfg):
        cfg["draft_vocab_size"] = cfg["dflash_config"]["draft_vocab_size"] = V + 1

    cases = [
        (dict(config=no_size), "sets no draft_vocab_size"),
        (dict(config=disagree), "dflash_config.draft_vocab_size 7"),
        (dict(config=too_big), f"vocab_size {V}"),
        (dict(drop=["d2t"]), "has no `d2t` tensor"),
        (dict(tensors={"d2t": d2t[:5]}), "has 5 entries but draft_vocab_size is 8"),
        (dict(tensors={"d2t": d2t.flip(0)}), "strictly increasing"),
        (dict(tensors={"d2t": d2t + V}), "outside the target vocab"),
        (dict(tensors={"d2t": d2t.float()}), "1-D integer"),
        (dict(tensors={"lm_head.weight": torch.zeros(7, target.hidden_size)}), "lm_head.weight has shape"),
        (dict(tensors={"t2d": t2d_mask(torch.tensor(VOCAB[:-1] + [299]), V)}), "t2d"),
    ]
    for i, (edit, msg) in enumerate(cases):
        bad = _edit(tmp_path, target, f"bad{i}", **edit)
        with pytest.raises(UsageError, match=msg) as e:
            load_drafter(bad)
        assert str(bad) in str(e.value), (msg, str(e.value))
    # an int32 d2t (other writers) is accepted and normalised
    ok = _edit(tmp_path, target, "int32", tensors={"d2t": d2t.int()})
    assert load_drafter(ok).d2t.dtype == torch.int64
    with pytest.raises(UsageError, match="draft vocabulary"):
        DFlashDraftModel(_plain(target).contract, draft_vocab=torch.tensor([5, 3]))
