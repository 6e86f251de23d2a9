"""torchrun plumbing: process group, drafter DDP / FSDP2, target sharding, re-exec under torchrun.

Usage:
    dist = init_distributed(cfg.train.parallel, device="auto")      # DistInfo (world 1 without torchrun)
    drafter = wrap_drafter(drafter, cfg.train.parallel.mode, dist)   # DDP / fully_shard / as is
    parts = shard_target(target, dist)                               # train.parallel.target=shard
    total = all_reduce_sum(torch.tensor([w_sum]), dist)
    rc = relaunch_under_torchrun(4, ["train", "-c", "run.yaml"])     # `dflashkit train --nproc-per-node 4`
    leave_distributed()                                              # at the end of a rank's process

The loss of every micro-batch is divided by the Σ w of the whole global step (all ranks), and DDP /
FSDP average gradients over ranks, so the loop multiplies the loss by the world size: the update
is then identical to one process holding the whole global batch.

Target sharding (train.parallel.target=shard) applies FSDP2 `fully_shard` to every target decoder
layer and the root over all ranks, so each rank stores 1/world of the frozen weights; the target
forward all-gathers one layer at a time. The embedding and LM head the drafter reuses are kept as
separate replicated frozen copies (they are called outside the target's forward).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from dataclasses import dataclass

import torch

from dflashkit.errors import DflashkitError, UsageError

log = logging.getLogger("dflashkit.train")


@dataclass
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1


def init_distributed(parallel, device: str = "auto") -> DistInfo:
    """Join the torchrun process group when WORLD_SIZE > 1; pick this rank's device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available() and device in ("auto", "cuda") or device.startswith("cuda")
    dev = torch.device(f"cuda:{local}") if cuda else torch.device("cpu")
    if world > 1 and not torch.distributed.is_initialized():
        backend = parallel.backend if parallel.backend != "auto" else ("nccl" if cuda else "gloo")
        if cuda:
            torch.cuda.set_device(dev)
        torch.distributed.init_process_group(backend=backend)
        log.info("rank %d/%d on %s (%s)", rank, world, dev, backend)
    return DistInfo(rank=rank, world=world, local_rank=local, device=dev)


def _mesh(dist: DistInfo):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(dist.device.type, (dist.world,))


def wrap_drafter(model: torch.nn.Module, mode: str, dist: DistInfo) -> torch.nn.Module:
    """DDP (`ddp`, the `auto` choice under torchrun), FSDP2 `fully_shard` (`fsdp`) or none."""
    if not dist.distributed or mode == "none":
        return model
    if mode in ("auto", "ddp"):
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[dist.device.index] if dist.device.type == "cuda" else None)
    from torch.distributed.fsdp import fully_shard

    # One FSDP unit for the whole drafter: its forward computes every layer's context K/V from the
    # root (outside the layers' own forward), so per-layer units would not be gathered in time.
    # Parameters, gradients and AdamW state stay sharded between steps (the memory that matters).
    fully_shard(model, mesh=_mesh(dist))
    return model


@dataclass
class TargetParts:
    """What the objective needs from the target: features fn, embedding and head (frozen)."""

    embed: torch.nn.Module
    lm_head: torch.nn.Module
    sharded: bool = False


def shard_target(target, dist: DistInfo) -> TargetParts:
    """FSDP2-shard the frozen target over all ranks; keep replicated frozen embedding/head copies."""
    emb_w = target.model.get_input_embeddings().weight.detach().clone()
    head = target.lm_head
    head_w = head.weight.detach().clone() if head is not None else emb_w
    embed = torch.nn.Embedding.from_pretrained(emb_w, freeze=True)
    lm_head = torch.nn.Linear(head_w.shape[1], head_w.shape[0], bias=False, device=head_w.device, dtype=head_w.dtype)
    lm_head.weight = torch.nn.Parameter(head_w, requires_grad=False)
    if not dist.distributed:
        return TargetParts(embed, lm_head, sharded=False)
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh(dist)
    for layer in target.decoder_layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(target.model, mesh=mesh, reshard_after_forward=True)
    return TargetParts(embed, lm_head, sharded=True)


def all_reduce_sum(t: torch.Tensor, dist: DistInfo) -> torch.Tensor:
    """Sum over ranks (returns `t` unchanged in one process)."""
    if dist.distributed:
        t = t.to(dist.device, copy=True)
        torch.distributed.all_reduce(t)
        t = t.cpu()
    return t


def barrier(dist: DistInfo) -> None:
    if dist.distributed:
        torch.distributed.barrier()


def leave_distributed() -> None:
    """Destroy this process's process group, if any: ranks leave gloo/NCCL explicitly rather than in
    interpreter teardown, where a rank whose peer has already exited can abort."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def relaunch_under_torchrun(nproc: int, argv: list[str]) -> int:
    """Run `torchrun --nproc-per-node N -m dflashkit ARGV` (without --nproc-per-node) and wait."""
    if nproc < 1:
        raise UsageError(f"--nproc-per-node must be >= 1, got {nproc}")
    cleaned, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--nproc-per-node":
            skip = True
            continue
        if a.startswith("--nproc-per-node="):
            continue
        cleaned.append(a)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "dflashkit", *cleaned]
    log.info("re-launching: %s", " ".join(cmd))
    rc = subprocess.call(cmd)
    if rc != 0:
        raise DflashkitError(f"torchrun exited with status {rc}", hint="see the ranks' logs above")
    return rc
