"""The DSpark drafter: the DFlash network plus a sequential low-rank Markov head and an acceptance-confidence head.

Usage:
    d = Qwen3DSparkModel(contract)                      # contract.drafter_type "dspark" (family/dspark.py's knobs)
    h = d(noise, ctx, pos)[:, 1:]                       # [b, k, H] block positions 1 … k, as DFlash's
    logits, conf = d.heads(h, base_logits, prev)        # base [b, k, V'] + Markov bias of prev [b, k] (target ids)
    p = d.confidence(h, prev)                           # [b, k] acceptance probabilities (confidence head)
    p = d.proposal_confidence(h, anchor, tokens)        # [k] the same for a proposed block (propose's h)
    tokens, rows = d.draft(base_logits[0], anchor)      # the sequential walk of one block (greedy)

The block is DFlash's (`[anchor, MASK, ...]`, block position j predicts the token at j), so the body runs once
per block; what DSpark adds reads the token before each position (the anchor for position 1, then the drafted
token, or the gold label in training):
  * `markov_head.markov_w1`: Embedding(V, r) of that token (target vocabulary), `markov_head.markov_w2`:
    Linear(r → V', no bias) onto the draft vocabulary; its output is added to the position's head logits.
  * `confidence_head.proj`: Linear(H [+ r] → 1, bias) of the position's final hidden state (with the Markov
    embedding when `dspark_confidence_with_markov`), whose sigmoid estimates P(the draft is accepted).
These are vLLM 0.32's `Qwen3DSparkModel` tensor names and shapes (`qwen3_dspark.py`: read, not copied); the
speculator there walks the positions left to right the same way (`DSparkSpeculator._sample_sequential`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from dflashkit.errors import UsageError
from dflashkit.model.drafter import DFlashDraftModel

if TYPE_CHECKING:
    from dflashkit.model.spec import DraftSpec


class MarkovHead(nn.Module):
    """Transition bias of rank r: token id (target vocab) → r-dim embedding → draft-vocab bias."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)

    def embed(self, prev: torch.Tensor) -> torch.Tensor:
        """[...] token ids → [..., r]."""
        return self.markov_w1(prev)

    def forward(self, prev: torch.Tensor) -> torch.Tensor:
        """[...] token ids → [..., V'] bias."""
        return self.markov_w2(self.markov_w1(prev))


class ConfidenceHead(nn.Module):
    """Logit of the acceptance probability of a drafted position: Linear(H [+ r] → 1) with bias."""

    def __init__(self, hidden_size: int, rank: int, with_markov: bool):
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(hidden_size + (rank if with_markov else 0), 1, bias=True)

    def forward(self, hidden: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        """[..., H], [..., r] → [..., ] logits (float32, as vLLM computes them)."""
        x = torch.cat([hidden, markov_embed.to(hidden.dtype)], dim=-1) if self.with_markov else hidden
        return torch.nn.functional.linear(x.float(), self.proj.weight.float(),
                                          None if self.proj.bias is None else self.proj.bias.float()).squeeze(-1)


class Qwen3DSparkModel(DFlashDraftModel):
    """DSpark drafter: `forward` is DFlash's (the block's hidden states); `heads` / `draft` / `confidence` add
    the Markov bias and the confidence estimate. State-dict names are vLLM's `Qwen3DSparkModel`'s."""

    def __init__(self, contract: DraftSpec, draft_vocab: torch.Tensor | None = None,
                 feature_scale: torch.Tensor | None = None):
        super().__init__(contract, draft_vocab=draft_vocab, feature_scale=feature_scale)
        k = contract.knobs
        self.markov_rank = int(k.dspark_markov_rank)
        vd = self.draft_vocab_size or contract.vocab_size
        self.markov_head = MarkovHead(contract.vocab_size, vd, self.markov_rank)
        self.confidence_head = (ConfidenceHead(contract.hidden_size, self.markov_rank,
                                               bool(k.dspark_confidence_with_markov))
                                if k.dspark_confidence_head else None)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        super().reset_parameters(std)
        head = getattr(self, "markov_head", None)
        if head is not None:
            nn.init.normal_(head.markov_w1.weight, std=std)

    # -- the heads -------------------------------------------------------------------------------------------
    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor:
        """[...] previous token ids (target vocabulary) → [..., V'] the bias added to the head's logits."""
        return self.markov_head(prev)

    def heads(self, hidden: torch.Tensor, base_logits: torch.Tensor, prev: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-position logits and confidences given the token before each position.

        Args:
            hidden: [..., k, H] final drafter hidden states of block positions 1 … k.
            base_logits: [..., k, V'] their head logits (the target's lm_head, or the draft vocab's rows).
            prev: [..., k] the token before each position (target ids): the anchor, then the drafted (decode)
                or gold (training) tokens.
        Returns:
            logits [..., k, V'] (base + Markov bias, in base's dtype) and the acceptance probabilities [..., k]
            (float32; None without a confidence head).
        """
        emb = self.markov_head.embed(prev)
        logits = base_logits + self.markov_head.markov_w2(emb).to(base_logits.dtype)
        conf = None if self.confidence_head is None else torch.sigmoid(self.confidence_head(hidden, emb))
        return logits, conf

    def confidence_logits(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """[..., k, H], [..., k] → [..., k] the confidence head's logits (float32); UsageError without one."""
        if self.confidence_head is None:
            raise UsageError("this DSpark drafter has no confidence head (drafter.dspark_confidence_head false)",
                             hint="train one with drafter.dspark_confidence_head true, or do not ask for confidences")
        return self.confidence_head(hidden, self.markov_head.embed(prev))

    def confidence(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Acceptance probabilities [..., k] of a proposed block: `hidden` [..., k, H] the drafter's final hidden
        states of block positions 1 … k, `prev` [..., k] the token before each (anchor, then the proposed
        tokens 1 … k−1; target ids). UsageError without a confidence head."""
        return torch.sigmoid(self.confidence_logits(hidden, prev))

    def proposal_confidence(self, hidden: torch.Tensor, anchor: int, tokens: list[int]) -> torch.Tensor:
        """[k] acceptance probabilities of a proposed block: `hidden` [1, k, H] or [k, H] (the `h` a family's
        `propose` gets), `anchor` the target id before position 1, `tokens` the k proposed target ids."""
        h = hidden.reshape(-1, hidden.shape[-1])[:len(tokens)]
        prev = torch.tensor([anchor, *tokens[:-1]], dtype=torch.long, device=h.device)
        return self.confidence(h, prev)

    def draft(self, base_logits: torch.Tensor, anchor: int, *, vocab: torch.Tensor | None = None,
              law: Callable[[torch.Tensor], torch.Tensor] | None = None,
              draw: Callable[[torch.Tensor, Any], torch.Tensor] | None = None, generator: Any = None
              ) -> tuple[list[int], torch.Tensor]:
        """The sequential walk of one block: position t's logits are base_t + bias(token at t − 1).

        Args:
            base_logits: [k, V'] head logits of block positions 1 … k; anchor: the target id before position 1.
            vocab: sorted target ids [V'] of a reduced draft vocab (None: the full one).
            law / draw: None = argmax; else position t draws `draw(law(row_t)[None], generator)`.
        Returns:
            the k target ids and the rows [k, V'] (biased logits; with `law`, the laws drawn from).
        """
        prev = torch.tensor([anchor], dtype=torch.long, device=base_logits.device)
        tokens: list[int] = []
        rows = []
        for t in range(base_logits.shape[0]):
            row = base_logits[t:t + 1] + self.markov_bias(prev).to(base_logits.dtype)      # [1, V']
            if law is None or draw is None:
                idx = row.argmax(-1)
                rows.append(row)
            else:
                q = law(row)
                idx = draw(q, generator).to(torch.long).view(1)
                rows.append(q)
            prev = idx if vocab is None else vocab[idx]
            tokens.append(int(prev.item()))
        return tokens, torch.cat(rows) if rows else base_logits[:0]


def init_from_dflash(model: Qwen3DSparkModel, state: dict) -> dict:
    """`drafter.init` from a DFlash checkpoint: its tensors, and the DSpark heads kept as initialised (the
    missing ones come from `model`). UsageError naming a tensor whose shape differs."""
    own = model.state_dict()
    out = dict(own)
    for name, value in state.items():
        if name in own:
            if tuple(own[name].shape) != tuple(value.shape):
                raise UsageError(f"drafter.init: the DFlash tensor {name} has shape {tuple(value.shape)}, the DSpark "
                                 f"drafter's {tuple(own[name].shape)}",
                                 hint="start from a DFlash checkpoint of the same contract")
            out[name] = value
    return out
