"""`train.labels=target`: slot k of a block at anchor a learns the target's greedy token at a+k−1."""

from __future__ import annotations

import json

import torch

from dflashkit.cli import main
from dflashkit.config import TargetSection
from dflashkit.target.load import load_target
from dflashkit.train.objective import Anchors, labels_and_weights, target_label_ids

from tests.helpers import make_run, overrides


def _loop_labels(label_ids, loss_mask, seq_lens, anchors, keep, block_size, gamma):
    """The rule, one position at a time: label = label_ids[a+k] where the weight is > 0."""
    b, n = anchors.shape
    labels = torch.zeros(b, n * block_size, dtype=torch.long)
    weights = torch.zeros(b, n * block_size)
    for i in range(b):
        for j in range(n):
            for k in range(1, block_size):
                p = int(anchors[i, j]) + k
                if not keep[i, j] or p >= int(seq_lens[i]) or not loss_mask[i, p]:
                    continue
                weights[i, j * block_size + k] = torch.exp(torch.tensor(-(k - 1) / gamma))
                labels[i, j * block_size + k] = int(label_ids[i, p])
    return labels, weights


def test_label_gather_equals_a_slow_loop_oracle():
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        b, s, B = 3, 40, 1 + int(torch.randint(2, 9, (1,), generator=g))
        ids = torch.randint(0, 500, (b, s), generator=g)
        nxt = torch.randint(0, 500, (b, s), generator=g)
        lm = (torch.rand(b, s, generator=g) > 0.3).long()
        lens = torch.randint(s // 2, s + 1, (b,), generator=g)
        anchors = torch.sort(torch.randint(0, s - 1, (b, 6), generator=g)).values
        keep = torch.rand(b, 6, generator=g) > 0.2
        labels_t = target_label_ids(ids, nxt)
        assert torch.equal(labels_t[:, 1:], nxt[:, :-1]) and torch.equal(labels_t[:, 0], ids[:, 0])
        got_l, got_w = labels_and_weights(ids, lm, lens, Anchors(anchors, keep), block_size=B, gamma=3.0,
                                          label_ids=labels_t)
        want_l, want_w = _loop_labels(labels_t, lm, lens, anchors, keep, B, 3.0)
        assert torch.equal(got_l, want_l), trial
        torch.testing.assert_close(got_w, want_w)


def test_target_labels_equal_data_labels_on_greedy_regenerated_text(tiny_qwen3):
    """On text the target generated greedily in fp32, its argmax labels are the data except near-ties."""
    target = load_target(TargetSection(path=str(tiny_qwen3), device="cpu", dtype="float32"))
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, target.vocab_size, (4, 12), generator=g)
    with torch.no_grad():
        seq = target.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=40,
                                    do_sample=False, min_new_tokens=40, pad_token_id=0)
        _, hidden = target.features(seq, layer_ids=[0, 1], need_last_hidden=True)
        nxt = target.next_token_ids(hidden)
        logits = target.model(seq).logits
    labels = target_label_ids(seq, nxt)
    top2 = logits.topk(2, dim=-1).values
    margin = (top2[..., 0] - top2[..., 1])[:, :-1]                 # margin of the prediction for t = 1..
    sup = torch.zeros_like(seq, dtype=torch.bool)
    sup[:, prompt.shape[1]:] = True
    differ = (labels != seq) & sup
    assert int(sup.sum()) == 4 * 40
    # every disagreement is a numerical near-tie of the target's own prediction
    assert bool((margin[differ[:, 1:]] < 1e-4).all()), margin[differ[:, 1:]]
    assert int(differ.sum()) <= 2, int(differ.sum())
    # and the argmax labels are the logits' argmax (the chunked head equals the full head)
    assert torch.equal(nxt, logits.argmax(-1))


def test_target_labels_change_what_is_learned_on_text_the_target_did_not_write(tmp_path, tiny_qwen3):
    """On human-written text a random tiny target disagrees with the data, so the loss must differ."""
    runs = {}
    for labels in ("data", "target"):
        rd = make_run(tmp_path / labels, tiny_qwen3)
        assert main(["train", "--json", *overrides(rd, tiny_qwen3, train__max_steps=2),
                     f"train.labels={labels}"]) == 0
        runs[labels] = [json.loads(x)["loss"] for x in (rd / "train" / "metrics.jsonl").read_text().splitlines()]
    assert abs(runs["data"][0] - runs["target"][0]) > 1e-3, runs
