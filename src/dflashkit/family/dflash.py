"""DFlash (z-lab, arXiv 2602.06036): every block position predicted on its own by the target's head.

Usage:
    from dflashkit.family.dflash import DFLASH
    drafter = DFLASH.build(contract, None, None)          # model/drafter.py's DFlashDraftModel
    tokens, law = DFLASH.propose(drafter, h, logits, anchor, DraftSampling(), vocab, vocab_size)

The base family: no contract fields of its own, a reduced draft vocabulary allowed (`d2t`), the
loss is train/objective.py's CE / KL alone, vLLM runs it on either model runner, and the z-lab
PyPI loop decodes it. Its proposal step is the head's argmax, or a draw from the head's sampling
law (then that law, 0 outside a reduced vocab, goes to the rejection rule).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dflashkit.family.base import Contract, DraftBlock, DraftSampling, Family

if TYPE_CHECKING:
    import torch


def build(contract: Contract, draft_vocab: torch.Tensor | None = None, feature_scale: torch.Tensor | None = None):
    """A new random DFlash drafter (`model.drafter.DFlashDraftModel`)."""
    from dflashkit.model.drafter import DFlashDraftModel

    return DFlashDraftModel(contract, draft_vocab=draft_vocab, feature_scale=feature_scale)


def propose(drafter: Any, h: torch.Tensor, logits: torch.Tensor, anchor: int, sampling: DraftSampling,
            vocab: torch.Tensor | None, vocab_size: int, block: DraftBlock | None = None
            ) -> tuple[list[int], torch.Tensor | None]:
    """One DFlash draft step: the argmax of each position's head logits, or a draw from their sampling law.

    Args:
        drafter: unused (the logits are the draft); h: [1, k, H] unused.
        logits: [k, V'] head logits of block positions 1 … k (V' = the draft vocab, if reduced).
        anchor: unused; sampling: temperature 0 = argmax, else `sampling.law` / `sampling.draw`.
        vocab: sorted target ids [V'] of a reduced draft vocab (None: the full one); vocab_size: V.
        block: unused (what the decoder knows of the block: `DraftBlock`).
    Returns:
        k target ids, and their draft law [k, V] (None for point masses).
    """
    del drafter, h, anchor, block
    if sampling.temperature <= 0:
        idx = logits.argmax(-1)
        return (idx if vocab is None else vocab[idx]).tolist(), None
    assert sampling.law is not None and sampling.draw is not None  # the decoder hands both at T > 0
    q = sampling.law(logits)
    tokens = sampling.draw(q, sampling.generator)
    if vocab is None:
        return tokens.tolist(), q
    full = q.new_zeros(q.shape[0], vocab_size).index_copy_(1, vocab, q)  # q = 0 outside the vocab
    return vocab[tokens].tolist(), full


DFLASH = Family(
    name="dflash",
    title="DFlash",
    architecture="DFlashDraftModel",
    reduced_vocab=True,
    reference_loop=True,
    build=build,
    propose=propose,
)
