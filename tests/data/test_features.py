"""Feature shards: what `write_shard` writes (rows in any order), `FeatureStore` reads back exactly."""

from __future__ import annotations

import json

import pytest
import torch

from dflashkit.data.features import FeatureStore, shard_matches, shard_path, write_shard


def _rows(lens, width, hidden, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(i, torch.randn(n, width, generator=g), torch.randint(0, 99, (n,), generator=g),
             torch.randn(n, hidden, generator=g)) for i, n in enumerate(lens)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_in_any_order_read_back_exactly(tmp_path, dtype):
    lens, width, hidden = [5, 1, 7, 3], 6, 2
    rows = _rows(lens, width, hidden)
    batches = [[rows[2], rows[0]], [rows[3]], [rows[1]]]  # the order a length-sorted capture produces
    meta = {"target_layer_ids": json.dumps([1, 3]), "source_digest": "abc", "dtype": dtype}
    token_shard = tmp_path / "tokenize" / "shard-00000.parquet"
    path = shard_path(tmp_path / "capture", token_shard)
    assert write_shard(path, lens, batches, dtype=dtype, metadata=meta, width=width, hidden=hidden,
                       last_hidden=True) == sum(lens)
    store = FeatureStore(tmp_path / "capture", [token_shard], [1, 3])
    assert store.has("next_ids") and store.has("last_hidden")
    t = getattr(torch, dtype)
    for i, f, nxt, last in rows:
        assert torch.equal(store.get((0, i), lens[i]), f.to(t))
        assert torch.equal(store.get((0, i), lens[i], "next_ids").long(), nxt)
        assert torch.equal(store.get((0, i), lens[i], "last_hidden"), last.to(t))
    kw = dict(layer_ids=[1, 3], digest="abc", dtype=dtype, last_hidden=True, autocast="none")
    assert shard_matches(path, **kw)
    assert not shard_matches(path, **{**kw, "digest": "other"}) and not shard_matches(path, **{**kw, "layer_ids": [2]})
    with pytest.raises(Exception, match="target_layer_ids"):
        FeatureStore(tmp_path / "capture", [token_shard], [0, 1])
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no scratch or temp file left


def test_a_missing_row_writes_nothing(tmp_path):
    lens = [2, 3]
    rows = _rows(lens, 4, 2)
    path = tmp_path / "shard-00000.safetensors"
    with pytest.raises(RuntimeError, match="1 of 2 rows"):
        write_shard(path, lens, [[rows[0]]], dtype="float32", metadata={}, width=4, hidden=2)
    assert list(tmp_path.iterdir()) == []
