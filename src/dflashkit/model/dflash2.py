"""The DFlash2 draft network: DFlash + block-local grouped dynamic convolutions + a candidate selector.

Usage:
    model = DFlash2DraftModel(contract)                      # family/dflash2.py builds it (contract.knobs)
    h = model(noise_embedding, target_hidden, position_ids)   # [b, q, H], exactly as DFlash
    ids, unary = model.candidates(lm_head(h[:, 1:]))          # top-K of the unary logits: [b, L, K] each
    scores = model.candidate_selector(ids, unary, h[:, 1:], anchor_ids)   # [b, L, K(prev), K(next)]
    tokens, rows = walk(scores, ids)                          # greedy path from the anchor: [b, L]
    tokens, rows = walk(scores, ids, temperature=0.7, generator=g)   # Gumbel-noised walk
    tokens, rows = walk_path(model.candidate_selector, ids, unary, h[:, 1:], anchor_ids)  # the same, lazily
    report = init_from_dflash(model, dflash_state_dict)       # shared parts from a DFlash checkpoint

What differs from DFlash (`model/drafter.py`; names mirror vLLM's `qwen3_dflash2.py`):
  * `layers.{i}.attention_conv` / `mlp_conv` (`GroupedDynamicConv`): a per-token, per-group kernel
    base + δ_t (δ projected from the sublayer's normed input) convolves the sublayer's input (side 0)
    and output (side 1) over earlier positions of the same block only, never across a block boundary
    or into the context. At init it is the identity, so a DFlash2 initialised from a DFlash
    checkpoint computes exactly the DFlash hidden states.
  * `candidate_selector`: the edge score of candidate b after token a at draft position t is
    U_t(b) + ⟨P[a] ⊙ W·h_t, S[b]⟩ over the top-K of the unary logits U_t. `walk` goes left to right
    taking the best edge (ties: the lower index), or at T > 0 samples q_t = softmax(row/T) by Gumbel
    noise: the draft law handed to the rejection rule.
  * `input_embedding_scale` multiplies the block's input embeddings. Full target vocabulary only
    (the codebooks are indexed by target id). Knobs: `family.dflash2.DFlash2Knobs`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
import logging

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm

from dflashkit.errors import UsageError
from dflashkit.model.drafter import DFlashDraftModel, draft_attention

if TYPE_CHECKING:
    from dflashkit.model.spec import DraftSpec

log = logging.getLogger("dflashkit.model")


def grouped_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_len: int) -> torch.Tensor:
    """The block-local grouped dynamic convolution of one side (the module docstring's formula).

    Args:
        x: [b, T, H] block tokens, blocks of `block_len` consecutive tokens (T a multiple of it).
        delta: [b, T, taps, G] per-token, per-group kernel deltas.
        base: [taps, H] the base kernel of this side.
    Returns:
        [b, T, H].
    """
    b, t, h = x.shape
    taps, groups = base.shape[0], delta.shape[-1]
    win = F.pad(x, (0, 0, taps - 1, 0)).unfold(1, taps, 1).flip(-1)            # [b, T, H, taps]: x_{t−j}
    pos = torch.arange(t, device=x.device) % block_len
    valid = pos[:, None] >= torch.arange(taps, device=x.device)[None]          # [T, taps]: j ≤ pos(t)
    kernel = base.view(1, 1, taps, groups, h // groups) + delta.unsqueeze(-1)  # [b, T, taps, G, gs]
    kernel = kernel.reshape(b, t, taps, h) * valid[None, :, :, None].to(x.dtype)
    return torch.einsum("btjh,bthj->bth", kernel, win)


class GroupedDynamicConv(nn.Module):
    """`attention_conv` / `mlp_conv` of a DFlash2 layer: `base_kernel` [2, taps, H], `kernel_projection`."""

    def __init__(self, hidden_size: int, taps: int, group_size: int):
        super().__init__()
        if hidden_size % group_size:
            raise UsageError(f"conv_group_size {group_size} does not divide hidden_size {hidden_size}",
                             hint="set drafter.conv_group_size to a divisor of the target's hidden size")
        self.taps, self.groups = taps, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)

    def reset_identity(self) -> None:
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def deltas(self, u: torch.Tensor) -> torch.Tensor:
        """[b, T, H] normed sublayer input → [b, T, 2, taps, G] (side, tap, group)."""
        return self.kernel_projection(u).unflatten(-1, (2, self.taps, self.groups))

    def side(self, x: torch.Tensor, delta: torch.Tensor, side: int, block_len: int) -> torch.Tensor:
        return grouped_conv(x, delta[:, :, side], self.base_kernel[side].to(x.dtype), block_len)


class DFlash2DecoderLayer(nn.Module):
    """A DFlash layer whose attention and MLP are each wrapped: conv side 0 → sublayer → conv side 1."""

    def __init__(self, config: Qwen3Config, taps: int, group_size: int):
        super().__init__()
        self.self_attn = draft_attention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attention_conv = GroupedDynamicConv(config.hidden_size, taps, group_size)
        self.mlp_conv = GroupedDynamicConv(config.hidden_size, taps, group_size)

    def forward(self, x, ctx_k, ctx_v, cos, sin, attention_mask, block_len: int = 0) -> torch.Tensor:
        n = block_len or x.shape[1]
        u = self.input_layernorm(x)                                                # [b, q, H]
        d = self.attention_conv.deltas(u)                                          # [b, q, 2, taps, G]
        a = self.self_attn(self.attention_conv.side(u, d, 0, n), ctx_k, ctx_v, cos, sin, attention_mask)
        x = x + self.attention_conv.side(a, d, 1, n)
        u = self.post_attention_layernorm(x)
        d = self.mlp_conv.deltas(u)
        return x + self.mlp_conv.side(self.mlp(self.mlp_conv.side(u, d, 0, n)), d, 1, n)


class CandidateSelector(nn.Module):
    """`candidate_selector`: low-rank edge scores between adjacent positions' candidates."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int):
        super().__init__()
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def reset_parameters(self, std: float = 0.02) -> None:
        rank = self.predecessor_codebook.shape[1]
        nn.init.normal_(self.predecessor_codebook, std=rank ** -0.5)
        nn.init.normal_(self.successor_codebook, std=rank ** -0.5)
        nn.init.normal_(self.hidden_projection.weight, std=std)

    def pair_scores(self, prev_ids: torch.Tensor, cand_ids: torch.Tensor, unary: torch.Tensor,
                    hidden: torch.Tensor) -> torch.Tensor:
        """Edge scores U(c) + ⟨P[p] ⊙ W·h, S[c]⟩ for every (p, c) pair.

        Args:
            prev_ids: [..., P] predecessor tokens; cand_ids: [..., C] candidates; unary: [..., C];
            hidden: [..., H] the drafter's output at the candidates' position.
        Returns:
            [..., P, C] (float32).
        """
        w = self.hidden_projection(hidden.to(self.hidden_projection.weight.dtype)).float()   # [..., r]
        pred = self.predecessor_codebook[prev_ids].float() * w.unsqueeze(-2)       # [..., P, r]
        succ = self.successor_codebook[cand_ids].float()                           # [..., C, r]
        return unary.float().unsqueeze(-2) + pred @ succ.transpose(-1, -2)

    def forward(self, cand_ids: torch.Tensor, unary: torch.Tensor, hidden: torch.Tensor,
                anchor_ids: torch.Tensor) -> torch.Tensor:
        """vLLM's layout: cand_ids, unary [b, L, K]; hidden [b, L, H]; anchor_ids [b] → scores [b, L, K, K].

        Row p of position t scores the candidates after candidate p of position t−1; at t = 0 every
        row is after the anchor token (the walk reads row 0)."""
        b, _, k = cand_ids.shape
        prev = torch.cat([anchor_ids.view(b, 1, 1).expand(b, 1, k), cand_ids[:, :-1]], dim=1)
        return self.pair_scores(prev, cand_ids, unary, hidden)


def _choose(row: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """[b, K] scores → [b] index: argmax (first max), or argmax of row/T + Gumbel noise at T > 0."""
    if temperature <= 0:
        return row.argmax(-1)
    u = torch.rand(row.shape, generator=generator, device=row.device, dtype=torch.float64)
    return (row.double() / temperature - torch.log(-torch.log(u.clamp_min(1e-300)))).argmax(-1)


def walk(scores: torch.Tensor, cand_ids: torch.Tensor, *, temperature: float = 0.0,
         generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The path through the candidates, left to right from the anchor.

    Args:
        scores: [b, L, K, K] from `CandidateSelector.forward`; cand_ids: [b, L, K].
        temperature: 0 = greedy (ties: the lower index); > 0 = argmax of row/T + Gumbel noise.
    Returns:
        tokens [b, L] and the realized score rows [b, L, K] (row t = the scores after the token
        chosen at t−1; the draft law at T > 0 is softmax(row / T) over cand_ids).
    """
    b, n, k = cand_ids.shape
    rows = scores.new_empty(b, n, k)
    chosen = torch.zeros(b, n, dtype=torch.long, device=scores.device)
    prev = torch.zeros(b, dtype=torch.long, device=scores.device)
    batch = torch.arange(b, device=scores.device)
    for t in range(n):  # a sequential choice: position t depends on the candidate chosen at t − 1
        rows[:, t] = scores[batch, t, prev]                                        # [b, K]
        prev = _choose(rows[:, t], temperature, generator)
        chosen[:, t] = prev
    return cand_ids.gather(-1, chosen.unsqueeze(-1)).squeeze(-1), rows


def walk_path(selector: CandidateSelector, cand_ids: torch.Tensor, unary: torch.Tensor, hidden: torch.Tensor,
              anchor_ids: torch.Tensor, *, temperature: float = 0.0,
              generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`walk(selector(cand_ids, unary, hidden, anchor_ids), cand_ids, …)` without the [b, L, K, K] scores:
    each step scores only the K candidates after the token chosen one step earlier (same draws)."""
    tokens, rows = [], []
    prev = anchor_ids
    for t in range(cand_ids.shape[1]):
        row = selector.pair_scores(prev[:, None], cand_ids[:, t], unary[:, t], hidden[:, t])[:, 0]   # [b, K]
        prev = cand_ids[:, t].gather(-1, _choose(row, temperature, generator)[:, None])[:, 0]
        tokens.append(prev)
        rows.append(row)
    return torch.stack(tokens, 1), torch.stack(rows, 1)


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash2 drafter; `state_dict()` keys are vLLM's DFlash2 checkpoint names (module docstring)."""

    def __init__(self, contract: DraftSpec, feature_scale: torch.Tensor | None = None):
        super().__init__(contract, feature_scale=feature_scale)
        k = contract.knobs
        self.top_k = k.selector_top_k
        self.input_embedding_scale = k.input_embedding_scale
        self.output_multiplier = k.output_multiplier
        self.final_logit_softcapping = k.final_logit_softcapping
        self.candidate_selector = CandidateSelector(contract.hidden_size, contract.vocab_size, k.selector_rank)
        self.candidate_selector.reset_parameters()

    def make_layer(self) -> nn.Module:
        k = self.contract.knobs
        return DFlash2DecoderLayer(self.config, k.conv_kernel_size, k.conv_group_size)

    def reset_parameters(self, std: float = 0.02) -> None:
        super().reset_parameters(std)
        for layer in self.layers:
            layer.attention_conv.reset_identity()
            layer.mlp_conv.reset_identity()
        if hasattr(self, "candidate_selector"):
            self.candidate_selector.reset_parameters(std)

    def forward(self, noise_embedding: torch.Tensor, target_hidden: torch.Tensor, position_ids: torch.Tensor,
                attention_mask=None, cache=None, block_len: int = 0) -> torch.Tensor:
        """As `DFlashDraftModel.forward` (shapes there); the block embeddings are scaled first."""
        if self.input_embedding_scale is not None:
            noise_embedding = noise_embedding * self.input_embedding_scale
        return super().forward(noise_embedding, target_hidden, position_ids, attention_mask=attention_mask,
                               cache=cache, block_len=block_len)

    def unary(self, logits: torch.Tensor) -> torch.Tensor:
        """The unary scores U from the target head's logits [..., V] (float32; order-preserving)."""
        u = logits.float()
        if self.output_multiplier is not None:
            u = u * self.output_multiplier
        if self.final_logit_softcapping is not None:
            cap = self.final_logit_softcapping
            u = torch.tanh(u / cap) * cap
        return u

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-K of the unary scores: (ids [..., K] int64, U values [..., K] float32), best first."""
        values, ids = torch.topk(self.unary(logits), self.top_k, dim=-1)
        return ids, values

    @torch.no_grad()
    def draft(self, h: torch.Tensor, logits: torch.Tensor, anchor_ids: torch.Tensor, *, temperature: float = 0.0,
              generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draft tokens through the walk.

        Args:
            h: [b, L, H] drafter outputs at block positions 1 … L; logits: [b, L, V] their target-head logits.
            anchor_ids: [b] the block's first token.
        Returns:
            tokens [b, L], cand_ids [b, L, K], realized rows [b, L, K] (see `walk`).
        """
        ids, unary = self.candidates(logits)
        tokens, rows = walk_path(self.candidate_selector, ids, unary, h, anchor_ids, temperature=temperature,
                                 generator=generator)
        return tokens, ids, rows


@torch.no_grad()
def init_from_dflash(model: DFlash2DraftModel, state: dict[str, torch.Tensor]) -> dict:
    """Initialise DFlash2's shared parts (fc, hidden_norm, every layer's attention/MLP/norms, norm) from a
    DFlash state dict (z-lab names); the convolutions stay the identity and the selector stays random.

    With the identity convolutions the result computes the DFlash drafter's hidden states exactly.
    Returns {"copied": [...], "skipped": [...] (name: reason)}. Raises UsageError when nothing fits.
    """
    own = model.state_dict()
    copied, skipped = [], []
    for name, t in state.items():
        if name not in own or "_conv." in name or name.startswith("candidate_selector."):
            skipped.append(f"{name}: not a shared DFlash tensor of this drafter")
        elif tuple(t.shape) != tuple(own[name].shape):
            skipped.append(f"{name}: shape {tuple(t.shape)} != {tuple(own[name].shape)}")
        else:
            own[name].copy_(t.to(own[name].dtype))
            copied.append(name)
    if not copied:
        raise UsageError("the DFlash checkpoint shares no tensor with this DFlash2 drafter",
                         hint="use a DFlash drafter trained for the same target and drafter.* geometry")
    log.info("init from a DFlash checkpoint: %d tensors copied, %d skipped", len(copied), len(skipped))
    return {"copied": copied, "skipped": skipped}
