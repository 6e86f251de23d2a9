"""The target's greedy path after every raw prefix (`model/path_labels.py`) ≡ a slow greedy-decode oracle,
and the on-path mask ≡ a loop oracle, on raw text with planted disagreements."""

from __future__ import annotations

import pytest
import torch

from dflashkit.config import TargetSection
from dflashkit.model.path_labels import (greedy_path_ids, label_need, on_path_weights, path_cache,
                                         path_label_ids)
from dflashkit.target.load import load_target
from dflashkit.train.objective import target_label_ids

NEAR_TIE = 1e-4  # a top-2 logit margin under this may flip with the summation order (cache vs none)
D = 3            # path depth of the oracle tests (block size 4)


def _greedy_oracle(model, ids: list[int], depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each t: D greedy tokens after ids[0..t] by full forwards (no cache, no batch, no mask), and
    the top-2 logit margin of each choice."""
    path, margin = [], []
    with torch.no_grad():
        for t in range(len(ids)):
            seq, row, mr = list(ids[:t + 1]), [], []
            for _ in range(depth):
                logits = model(torch.tensor([seq]), logits_to_keep=1).logits[0, -1]
                top = logits.topk(2).values
                row.append(int(logits.argmax()))
                mr.append(float(top[0] - top[1]))
                seq.append(row[-1])
            path.append(row)
            margin.append(mr)
    return torch.tensor(path), torch.tensor(margin)


def _planted_text(model, prompt: list[int], n: int, plant: set[int], g: torch.Generator) -> list[int]:
    """`prompt`, then n tokens: the target's own greedy token, except at `plant` (a token it did not pick)."""
    seq = list(prompt)
    with torch.no_grad():
        for i in range(n):
            best = int(model(torch.tensor([seq]), logits_to_keep=1).logits[0, -1].argmax())
            tok = best
            if i in plant:
                tok = int(torch.randint(0, 256, (1,), generator=g))
                tok = tok if tok != best else (best + 1) % 256
            seq.append(tok)
    return seq


def _batch(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    s = max(map(len, seqs))
    ids = torch.zeros(len(seqs), s, dtype=torch.long)
    att = torch.zeros(len(seqs), s, dtype=torch.long)
    for i, x in enumerate(seqs):
        ids[i, :len(x)], att[i, :len(x)] = torch.tensor(x), 1
    return ids, att, att.sum(1)


@pytest.fixture(scope="module", params=["qwen3", "llama", "deepseek_v3"])
def planted(request, tiny_targets):
    """(target, raw sequences with planted disagreements, their oracle paths + margins), depth D."""
    target = load_target(TargetSection(path=str(tiny_targets[request.param]), device="cpu", dtype="float32"))
    g = torch.Generator().manual_seed(7)
    seqs, plants = [], []
    for length in (19, 12):
        plant = set(torch.randint(0, length - 5, (3,), generator=g).tolist())
        seqs.append(_planted_text(target.model, torch.randint(0, 256, (5,), generator=g).tolist(), length - 5,
                                  plant, g))
        plants.append(plant)
    oracles = [_greedy_oracle(target.model, x, D) for x in seqs]
    return target, seqs, plants, oracles


def _assert_equal_to_oracle(path: torch.Tensor, seqs, oracles, need: torch.Tensor | None = None) -> int:
    """Exact equality wherever the oracle's choices are clear; near-ties (margin < NEAR_TIE) may flip, and only
    from the first near-tie of a row on. Returns the number of rows compared exactly."""
    compared = 0
    for i, (x, (want, margin)) in enumerate(zip(seqs, oracles)):
        got = path[i, :len(x)]
        for t in range(len(x)):
            tie = (margin[t] < NEAR_TIE).nonzero().flatten()
            upto = int(tie[0]) if tie.numel() else want.shape[1]
            cols = need[i, t, :upto] if need is not None else torch.ones(upto, dtype=torch.bool)
            assert torch.equal(got[t, :upto][cols], want[t, :upto][cols]), (i, t, got[t], want[t], margin[t])
            if need is not None:
                assert (got[t, 1:][~need[i, t, 1:]] == -1).all(), (i, t, got[t])
            compared += int(upto == want.shape[1])
    return compared


def test_batched_rollout_equals_a_slow_greedy_decode(planted):
    """Padded batch, KV-cache rollout with a custom 4-D mask, rows in chunks: the same tokens as decoding
    each prefix alone; the cost is (D − 1) per row whose raw next token is not the target's argmax."""
    target, seqs, plants, oracles = planted
    ids, att, lens = _batch(seqs)
    cache = path_cache()
    with torch.no_grad():
        _, last = target.features(ids, layer_ids=[0, 1], need_last_hidden=True, attention_mask=att, cache=cache,
                                  use_cache=True)
        nxt = target.next_token_ids(last)
    got = greedy_path_ids(target, ids, lens, D, next_ids=nxt, cache=cache, chunk_rows=3)
    assert _assert_equal_to_oracle(got.path_ids, seqs, oracles) >= 0.9 * int(lens.sum())
    disagree = sum(int(t + 1 >= len(x) or x[t + 1] != int(want[t, 0]))
                   for x, (want, _) in zip(seqs, oracles) for t in range(len(x)))
    assert got.rollout_rows == disagree and got.rolled == (D - 1) * disagree, (got.rolled, disagree)
    # the planted texts exercise both branches: rows rolled out and rows taken by the shortcut
    assert 6 <= disagree <= int(lens.sum()) - 12, disagree
    for i, (x, plant) in enumerate(zip(seqs, plants)):
        for p in plant:  # the planted token is not the target's argmax there: its row is off the raw text
            assert int(got.path_ids[i, 5 + p - 1, 0]) != x[5 + p]
    # the prefill may also run inside: same result
    again = greedy_path_ids(target, ids, lens, D, attention_mask=att, chunk_rows=64)
    assert torch.equal(again.path_ids, got.path_ids)


def test_rows_not_needed_cost_nothing_and_needed_ones_are_exact(planted):
    target, seqs, _, oracles = planted
    ids, att, lens = _batch(seqs)
    lm = (torch.rand(ids.shape, generator=torch.Generator().manual_seed(1)) < 0.6).long() * att
    need = label_need(lm, lens, D)
    full = greedy_path_ids(target, ids, lens, D, attention_mask=att)
    part = greedy_path_ids(target, ids, lens, D, attention_mask=att, need=need)
    assert part.rolled < full.rolled
    _assert_equal_to_oracle(part.path_ids, seqs, oracles, need=need)
    assert torch.equal(part.path_ids[need], full.path_ids[need])


def test_eager_attention_reads_the_same_mask(planted):
    """The additive float mask eager attention reads gives the oracle's paths too (sdpa reads the bool one)."""
    target, seqs, _, oracles = planted
    ids, att, lens = _batch(seqs)
    target.model.set_attn_implementation("eager")
    try:
        got = greedy_path_ids(target, ids, lens, D, attention_mask=att, chunk_rows=5)
    finally:
        target.model.set_attn_implementation("sdpa")
    assert _assert_equal_to_oracle(got.path_ids, seqs, oracles) >= 0.9 * int(lens.sum())


def test_sliding_window_targets_are_refused_naming_the_fallback(tiny_qwen3):
    from dflashkit.errors import UsageError

    target = load_target(TargetSection(path=str(tiny_qwen3), device="cpu", dtype="float32"))
    target.model.config.layer_types = ["sliding_attention"] * target.num_layers
    target.model.config.sliding_window = 8  # the deepest rollout token (position 8 + 2) would see past it
    with pytest.raises(UsageError, match="on_path=mask"):
        greedy_path_ids(target, torch.randint(0, 256, (1, 9)), torch.tensor([9]), 3)


@pytest.mark.parametrize("config,length,refused", [
    ({}, 10_000, None),                                                               # Llama: full attention
    ({"layer_types": ["full_attention"] * 4, "sliding_window": 64}, 1000, None),      # Qwen3: the types decide
    ({"sliding_window": 4096}, 5000, "sliding_attention"),                           # Mistral v0.1: no types
    ({"sliding_window": 4096}, 512, None),                                            # … a window never reached
    ({"sliding_window": 4096, "use_sliding_window": False}, 9000, None),             # Qwen2: switched off
    ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 512}, 600, "window 512"),  # Gemma 3
    ({"layer_types": ["chunked_attention"], "attention_chunk_size": 8192}, 600, None),  # Llama 4, short samples
    ({"layer_types": ["linear_attention", "full_attention"]}, 16, "linear_attention"),  # no window: never
])
def test_the_rollout_mask_is_the_targets_attention_only_where_no_window_binds(config, length, refused):
    from types import SimpleNamespace

    from dflashkit.model.path_labels import attention_limit

    for cfg in (config, SimpleNamespace(**config)):  # config.json's dict and an HF config object
        why = attention_limit(cfg, length)
        assert (why is None) if refused is None else (why is not None and refused in why), (cfg, why)


def _loop_mask(ids, labels, lens, anchors, B):
    b, n = anchors.shape
    out = torch.zeros(b, n, B)
    for i in range(b):
        for j in range(n):
            a = int(anchors[i, j])
            for k in range(B):
                ok = all(a + m >= int(lens[i]) or int(ids[i, a + m]) == int(labels[i, a + m]) for m in range(1, k))
                out[i, j, k] = float(ok)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_on_path_mask_equals_a_loop_oracle(seed):
    g = torch.Generator().manual_seed(seed)
    b, s, B = 3, 30, 3 + seed % 4
    nxt = torch.randint(0, 9, (b, s), generator=g)
    ids = torch.randint(0, 9, (b, s), generator=g)
    agree = torch.rand(b, s, generator=g) < 0.7                  # plant agreement with the argmax at 70%
    ids[:, 1:] = torch.where(agree[:, 1:], nxt[:, :-1], ids[:, 1:])
    labels = target_label_ids(ids, nxt)
    lens = torch.tensor([s, s - 7, 11])
    anchors = torch.sort(torch.randint(0, s - 1, (b, 7), generator=g)).values
    got = on_path_weights(ids, labels, lens, anchors, block_size=B)
    assert torch.equal(got, _loop_mask(ids, labels, lens, anchors, B))
    assert (got[:, :, :2] == 1).all() and 0 < int((got == 0).sum())


def test_mask_zeroes_exactly_the_positions_after_a_planted_disagreement():
    ids = torch.arange(20)[None].clone()
    nxt = torch.arange(1, 21)[None].clone()             # the argmax after x[..t] is t + 1: the text agrees
    ids[0, 7] = 99                                      # plant: x[7] ≠ next_ids[6]
    labels = target_label_ids(ids, nxt)
    anchors = torch.tensor([[3, 5, 6, 7, 10]])
    w = on_path_weights(ids, labels, torch.tensor([20]), anchors, block_size=4)
    # anchor 3: positions 1..3 read x[4..6] (all agree); anchor 5: k = 3 reads past x[7]; anchor 6: k ≥ 2;
    # anchor 7 (the planted token is the anchor itself) and 10: untouched
    assert w[0].tolist() == [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]


def test_path_labels_gather_position_k_from_level_k_minus_1():
    path = torch.arange(2 * 10 * 3).view(2, 10, 3)
    anchors = torch.tensor([[0, 4], [2, 9]])
    got = path_label_ids(path, anchors, 4)
    for i in range(2):
        for j in range(2):
            a = int(anchors[i, j])
            assert got[i, j, 0] == -1 and got[i, j, 1:].tolist() == path[i, a].tolist()


def test_label_need_marks_the_kept_anchors_and_the_levels_inside_the_sequence():
    lm = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 1, 1, 0]])
    lens = torch.tensor([9])
    cand = label_need(lm, lens, 3)
    assert cand[0, :, 0].nonzero().flatten().tolist() == [1, 2, 5, 6, 7]   # lm[t] and lm[t+1], t + 1 < L
    assert cand[0, 7].tolist() == [True, False, False]                     # level j needs t + j + 1 < L
    # a real anchor at 0 next to padded ones (index 0, keep False): the padding never unmarks it
    anchors, keep = torch.tensor([[0, 5, 0, 0]]), torch.tensor([[True, True, False, False]])
    got = label_need(lm, lens, 3, anchors, keep)
    assert got[0, :, 0].nonzero().flatten().tolist() == [0, 5]
    assert not label_need(lm, lens, 3, anchors, torch.tensor([[False, True, False, False]]))[0, 0].any()


def test_the_rollout_keeps_its_cache_under_the_older_name(planted):
    """transformers before 5.2x names the forward's cache `past_key_values` and swallows an unknown `cache`:
    the prefill and the rollout hand theirs by the installed name (`target.load.cache_kwarg`), same paths."""
    target, seqs, _, _ = planted
    ids, att, lens = _batch(seqs)
    want = greedy_path_ids(target, ids, lens, D, attention_mask=att)
    base = type(target.model)

    class PastKeyValuesNamed(base):  # type: ignore[misc, valid-type]
        def forward(self, input_ids=None, past_key_values=None, **kw):
            kw.pop("cache", None)  # swallowed by **kwargs there, without an error
            return base.forward(self, input_ids=input_ids, cache=past_key_values, **kw)

    target.model.__class__ = PastKeyValuesNamed
    try:
        got = greedy_path_ids(target, ids, lens, D, attention_mask=att)
    finally:
        target.model.__class__ = base
    assert want.rolled > 0 and got.rolled == want.rolled and torch.equal(got.path_ids, want.path_ids)


def test_the_heldout_yardstick_falls_back_to_argmax_labels_where_a_window_binds(tiny_qwen3):
    """No rollout where its mask is not the target's attention: held-out blocks are then scored on the target's
    argmax labels (on the path's positions), not refused — the run may not roll out at all (train.on_path=off)."""
    from types import SimpleNamespace

    import numpy as np

    from dflashkit.train.target_side import heldout_scoring

    target = load_target(TargetSection(path=str(tiny_qwen3), device="cpu", dtype="float32"))
    data = SimpleNamespace(input_ids=[np.zeros(20), np.zeros(30)])
    assert heldout_scoring(None, target, data, [0, 1], 3) == "target_path"
    target.model.config.layer_types = ["sliding_attention"] * target.num_layers
    target.model.config.sliding_window = 40        # 30 + 2 tokens fit the window: still exact
    assert heldout_scoring(None, target, data, [0, 1], 3) == "target_path"
    target.model.config.sliding_window = 16
    assert heldout_scoring(None, target, data, [0, 1], 3) == "on_path_positions"
