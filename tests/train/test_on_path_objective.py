"""`labels_and_weights` with on-path labels (`path_ids`) and the on-path mask (`on_path_only`), and DFlash2's
gold predecessors on the path."""

from __future__ import annotations

import pytest
import torch

from dflashkit.model.path_labels import on_path_weights
from dflashkit.train.blocks import predecessors
from dflashkit.train.objective import labels_and_weights, target_label_ids
from tests.helpers import random_case


@pytest.mark.parametrize("seed", range(4))
def test_path_labels_replace_the_labels_and_keep_the_weights(seed):
    lm, lens, a = random_case(seed, b=3, s=15, num_anchors=5)
    B = 4
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 40, lm.shape, generator=g)
    nxt = torch.randint(0, 40, lm.shape, generator=g)
    path = torch.randint(0, 40, (*lm.shape, B - 1), generator=g)
    tl = target_label_ids(ids, nxt)
    plain_l, plain_w = labels_and_weights(ids, lm, lens, a, block_size=B, gamma=2.0, label_ids=tl)
    got_l, got_w = labels_and_weights(ids, lm, lens, a, block_size=B, gamma=2.0, label_ids=tl, path_ids=path)
    assert torch.equal(got_w, plain_w)
    n = a.anchors.shape[1]
    for i in range(3):
        for j in range(n):
            for k in range(1, B):
                q = j * B + k
                if got_w[i, q] > 0:
                    assert int(got_l[i, q]) == int(path[i, a.anchors[i, j], k - 1])
    masked_l, masked_w = labels_and_weights(ids, lm, lens, a, block_size=B, gamma=2.0, label_ids=tl,
                                            on_path_only=True)
    keep = on_path_weights(ids, tl, lens, a.anchors, block_size=B).view(3, -1)
    assert torch.equal(masked_w, plain_w * keep) and torch.equal(masked_l, torch.where(masked_w > 0, plain_l, 0))


def test_a_supervised_position_without_its_path_is_an_error_not_a_label():
    lm, lens, a = random_case(0, b=2, s=12, num_anchors=4)
    ids = torch.randint(0, 40, lm.shape)
    path = torch.full((*lm.shape, 3), -1)
    with pytest.raises(ValueError, match="greedy path"):
        labels_and_weights(ids, lm, lens, a, block_size=4, gamma=2.0, path_ids=path)
    with pytest.raises(ValueError, match="label_ids"):
        labels_and_weights(ids, lm, lens, a, block_size=4, gamma=2.0, on_path_only=True)


def test_dflash2_gold_predecessor_follows_the_path():
    lm, lens, a = random_case(1, b=2, s=14, num_anchors=4)
    B = 5
    ids = torch.randint(0, 40, lm.shape)
    path = torch.randint(0, 40, (*lm.shape, B - 1))
    prev = predecessors(ids, target_label_ids(ids, ids), a, block_size=B, path_ids=path)
    for i in range(2):
        for j in range(a.anchors.shape[1]):
            anc = int(a.anchors[i, j])
            assert int(prev[i, j, 1]) == int(ids[i, anc])                     # the anchor itself
            assert prev[i, j, 2:].tolist() == path[i, anc, :B - 2].tolist()    # the path label before k


def test_a_batch_of_samples_whose_shards_hold_paths_of_different_depths_collates():
    """Shards captured at block size 16 (depth 15) beside shards captured later at block size 4 (depth 3): the
    batch keeps the depth every shard holds, the rows' own levels unchanged."""
    import numpy as np

    from dflashkit.data.shards import TokenData
    from dflashkit.train.data import collate

    deep = torch.arange(5 * 15).view(5, 15)
    shallow = -torch.arange(7 * 3).view(7, 3) - 1

    class Store:
        def get(self, where, n, name):
            assert name == "path_ids"
            return (deep if where[0] == 0 else shallow)[:n]

    data = TokenData(ids=["a", "b"], input_ids=[np.arange(5), np.arange(7)], loss_mask=[np.ones(5), np.ones(7)],
                     shards=[], where=[(0, 0), (1, 0)], features=Store())  # type: ignore[arg-type]
    b = collate(data, [(0, 0), (1, 0)], run_seed=0, with_path_ids=True)
    assert b.path_ids is not None and tuple(b.path_ids.shape) == (2, 7, 3)
    assert torch.equal(b.path_ids[0, :5], deep[:, :3]) and torch.equal(b.path_ids[1], shallow)
