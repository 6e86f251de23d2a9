"""torchrun plumbing: process group, drafter DDP / FSDP2, target sharding, re-exec under torchrun.

Usage:
    dist = init_distributed(cfg.train.parallel, device="auto")      # DistInfo (world 1 without torchrun)
    drafter = wrap_drafter(drafter, cfg.train.parallel.mode, dist)   # DDP / fully_shard / as is
    parts = shard_target(target, dist)                               # train.parallel.target=shard
    total = all_reduce_sum(torch.tensor([w_sum]), dist)
    rc = relaunch_under_torchrun(4, ["train", "-c", "run.yaml"])     # `dflashkit train --nproc-per-node 4`
    leave_distributed(ok=True)                                       # at the end of a rank's work
    exit_rank(rc)                                                    # `python -m dflashkit`'s last act

Invariant: the loss of every micro-batch is divided by the Σ w of the whole global step (all ranks)
and DDP / FSDP average gradients, so the loop multiplies the loss by the world size: the update is
identical to one process holding the whole global batch.

Each rank takes the GPU of its local rank; with gloo, ranks may share GPUs round robin, while NCCL
with two ranks on one GPU is a usage error before the rendezvous (`cuda_index`). Target sharding
applies FSDP2 `fully_shard` to every target decoder layer and the root, so each rank stores 1/world
of the frozen weights; the embedding and LM head the drafter reuses stay replicated frozen copies.

A rank finishes with `leave_distributed` (barrier unless `ok=False`, destroy the group, collect
garbage) and then `exit_rank(rc)`: flush, then `os._exit(rc)` without interpreter finalization,
which would abort on the gloo threads torch keeps alive (docs/reliability.md).
Leaving is bounded: a barrier or `destroy_process_group` that has not returned after `TEARDOWN_S`
seconds (gloo has been seen to stall there once every few hundred runs, after every rank's work was
done and saved) is abandoned with a warning and the Python stacks of every thread, and the rank goes
on to report and exit. If the stalled call holds the interpreter, a C-level timer dumps the stacks
and ends the process with status 1 instead: a failure that names where, never a hang.
"""

from __future__ import annotations

import faulthandler
import gc
import logging
import os
import subprocess
import sys
import threading
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from dflashkit.errors import DflashkitError, UsageError

log = logging.getLogger("dflashkit.train")
_joined = False  # this process joined a torch process group (init_distributed): end it with exit_rank
_left = False  # leave_distributed ran (it runs once)
TEARDOWN_S = 60.0  # the longest a rank waits to leave its process group (see the module doc)


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


def cuda_index(local_rank: int, devices: int, backend: str) -> int:
    """The GPU of a rank: its own (`cuda:<local rank>`), or, when a node has fewer GPUs than ranks, a shared one
    (round robin) under gloo, which moves CUDA tensors through host memory. NCCL refuses two ranks on one GPU
    ("Duplicate GPU detected"), so that case is a usage error naming the fix, before any rank blocks in a
    rendezvous that cannot complete."""
    if local_rank < devices or devices < 1:
        return local_rank
    if backend == "gloo":
        return local_rank % devices
    raise UsageError(f"local rank {local_rank} has no GPU of its own: {devices} visible, and {backend} refuses two "
                     "ranks on one GPU", hint=f"run at most {devices} process(es) per node (--nproc-per-node), or "
                     "set train.parallel.backend=gloo to share the GPUs (slow: for checks, not for training)")


def init_distributed(parallel, device: str = "auto") -> DistInfo:
    """Join the torchrun process group when WORLD_SIZE > 1; pick this rank's device (`cuda_index`)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available() and device in ("auto", "cuda") or device.startswith("cuda")
    backend = parallel.backend if parallel.backend != "auto" else ("nccl" if cuda else "gloo")
    index = cuda_index(local, torch.cuda.device_count(), backend) if cuda and world > 1 else local
    dev = torch.device(f"cuda:{index}") if cuda else torch.device("cpu")
    if world > 1 and not torch.distributed.is_initialized():
        if cuda:
            torch.cuda.set_device(dev)
        global _joined, _left
        torch.distributed.init_process_group(backend=backend)
        _joined, _left = True, False
        log.info("rank %d/%d on %s (%s)", rank, world, dev, backend)
    return DistInfo(rank=rank, world=world, local_rank=local, device=dev)


def _mesh(dist: DistInfo):
    return init_device_mesh(dist.device.type, (dist.world,))


def wrap_drafter(model: torch.nn.Module, mode: str, dist: DistInfo) -> torch.nn.Module:
    """DDP (`ddp`, the `auto` choice under torchrun), FSDP2 `fully_shard` (`fsdp`) or none."""
    if not dist.distributed or mode == "none":
        return model
    if mode in ("auto", "ddp"):
        return DistributedDataParallel(model, device_ids=[dist.device.index] if dist.device.type == "cuda" else None)

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


def leave_distributed(*, ok: bool = True) -> None:
    """Leave this process's process group, if any (see the module doc, "How a rank finishes").

    ok=True (the rank's work succeeded): a barrier first, so every rank's collectives have completed
    before any rank tears down. ok=False (an error path): no barrier, the group is still destroyed."""
    global _left
    if _left or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    _left = True  # once: a group abandoned below still reads as initialized
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    failed: list[BaseException] = []

    def leave() -> None:
        if device is not None:
            torch.cuda.set_device(device)  # the CUDA device is per thread: NCCL's barrier must use this rank's
        try:
            if ok:
                torch.distributed.barrier()
        except BaseException as e:  # raised in the caller's thread below
            failed.append(e)
        finally:
            torch.distributed.destroy_process_group()

    faulthandler.dump_traceback_later(2 * TEARDOWN_S + 10, exit=True)  # the last resort, needs no interpreter
    try:
        worker = threading.Thread(target=leave, name="dflashkit-leave-group", daemon=True)
        worker.start()
        worker.join(TEARDOWN_S)
    finally:
        faulthandler.cancel_dump_traceback_later()
    if worker.is_alive():
        log.warning("rank %s: leaving the process group did not finish in %.0f s; going on without it (this rank's "
                    "work is done and saved). Where it stalled:", os.environ.get("RANK", "0"), TEARDOWN_S)
        faulthandler.dump_traceback(all_threads=True)
        return
    gc.collect()
    if failed:
        raise failed[0]


def exit_rank(rc: int) -> None:
    """End a process that joined a process group: flush stdout, stderr and logging, then `os._exit(rc)`
    (no interpreter finalization while torch's native threads live). Returns when it never joined."""
    if not _joined:
        return
    leave_distributed(ok=rc == 0)  # a no-op when the stage already left
    for handler in logging.getLogger().handlers + logging.getLogger("dflashkit").handlers:
        try:  # the stream itself, without the handler's lock (logging.shutdown takes every handler's)
            getattr(handler, "stream", handler).flush()
        except (OSError, ValueError, AttributeError):
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(rc)


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
    proc = subprocess.Popen(cmd)
    try:
        rc = proc.wait()
    except BaseException:  # SIGTERM (SystemExit 143) or Ctrl-C here: the workers checkpoint, then stop
        import signal

        proc.send_signal(signal.SIGTERM)  # torchrun forwards it to every rank (`train/stopping.py`)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
    if rc != 0:
        raise DflashkitError(f"torchrun exited with status {rc}", hint="see the ranks' logs above")
    return rc
