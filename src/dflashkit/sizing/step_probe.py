"""One drafter optimizer step on a given batch, built as training builds it: what `bench train` times and what a
budget's calibration measures.

Usage:
    step = drafter_step(cfg.train, contract, target, ids, loss_mask, seq_lens, feats,
                        draft_vocab_size=cfg.drafter.draft_vocab_size, seed=cfg.run.seed)
    step()                     # forward, chunked loss, backward, optimizer step (train.dtype's autocast)
    step.run(torch.bfloat16)   # the same step under another autocast (None: none)
    step.anchors, step.head    # the anchors drawn (seeds 0 … b−1) and the head projected over (reduced vocab)

The drafter is new (seeded by `seed`: run.seed), the loss is the CE at the reference decay plus the family's own terms,
and a reduced draft vocabulary (`drafter.draft_vocab_size`) is chosen from this batch's supervised tokens, as
training would choose it from the whole data.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dflashkit.family import new_drafter
from dflashkit.model.draft_vocab import choose_draft_vocab, restricted_head
from dflashkit.train.loss import CE, Decay, DraftLoss, Heads, LossInputs
from dflashkit.train.objective import Anchors, gamma_for, sample_anchors
from dflashkit.train.optim import build_optimizer
from dflashkit.train.trainer import autocast_dtype

if TYPE_CHECKING:
    from dflashkit.config import TrainSection
    from dflashkit.family.contract import DrafterContract


@dataclass
class DrafterStep:
    """A callable drafter step (see the module doc)."""

    drafter: torch.nn.Module
    optimizer: Any
    loss: DraftLoss
    heads: Heads
    head: torch.nn.Module
    inputs: LossInputs
    anchors: Anchors
    amp: torch.dtype | None

    def __call__(self) -> None:
        """One step under train.dtype's autocast (`amp`)."""
        self.run(self.amp)

    def run(self, amp: torch.dtype | None) -> None:
        """One step under autocast to `amp` (None: none)."""
        out = dataclasses.replace(self.loss, amp=amp)(self.drafter, self.heads, self.inputs, self.anchors)
        out.loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def drafter_step(train: TrainSection, contract: DrafterContract, target: Any, ids: torch.Tensor,
                 loss_mask: torch.Tensor, seq_lens: torch.Tensor, feats: torch.Tensor, *,
                 draft_vocab_size: int | None, seed: int) -> DrafterStep:
    """Build the step for this batch (all tensors on the target's device) under `train` (the run's train.*),
    with drafter.draft_vocab_size and run.seed."""
    dev = target.device
    a = sample_anchors(loss_mask, seq_lens, num_anchors=train.num_anchors, block_size=contract.block_size,
                       seeds=list(range(ids.shape[0])))
    vocab, head = None, target.lm_head
    if draft_vocab_size and draft_vocab_size < target.vocab_size:
        vocab = choose_draft_vocab(list(ids.cpu().numpy()), list(loss_mask.cpu().numpy()),
                                   draft_vocab_size, target.vocab_size).to(dev)
        head = restricted_head(target.lm_head, vocab)
    torch.manual_seed(seed)
    drafter = new_drafter(contract, draft_vocab=vocab).to(dev)
    fam = contract.family  # the CE loss at the reference decay, and the family's own terms
    loss = DraftLoss(fam, contract.mask_token_id, (CE(), *fam.terms(train.weights)),
                     Decay(gamma_for(train.gamma, contract.block_size)), chunk_blocks=train.loss_chunk_blocks)
    return DrafterStep(drafter, build_optimizer(drafter, train), loss,
                       Heads(target.model.get_input_embeddings(), head, vocab), head,
                       LossInputs(feats, ids, loss_mask, seq_lens), a, autocast_dtype(train.dtype, dev))
