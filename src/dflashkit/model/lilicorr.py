"""The LiLiCorr draft network: a DFlash (or DFlash2-convolution) backbone plus a lattice head over its candidates.

Usage:
    model = LiLiCorrDraftModel(contract)                      # family/lilicorr.py builds it (contract.knobs)
    h = model(noise_embedding, target_hidden, position_ids)    # [b, q, H], exactly as DFlash
    ids, logp = model.candidates(lm_head(h[:, 1:]))            # top-K of the head's log-softmax: [b, L, K] each
    anchor = model.anchor_hidden(target_hidden[:, -1])         # hidden_norm(fc(features of the row before the block))
    scores = model.lilicorr(embed(ids), logp, h[:, 1:], anchor, valid)   # [b, L, K(prev), K(next)], vLLM's layout
    tokens, rows = walk(scores, ids)                           # the DFlash2 walk (model/dflash2.py)
    tokens, ids, rows = model.draft(h[:, 1:], logits, embed, anchor)     # the same, in one call
    report = init_from_backbone(model, state_dict)             # shared parts from a DFlash / DFlash2 checkpoint

Names and arithmetic mirror vLLM's `model_executor/models/lilicorr.py` (read, not copied); the head's
tensors are `lilicorr.*`, so the z-lab export is a plain state-dict write. With S = B − 1 slots and
K candidates per slot: each candidate's vector sums the TARGET's embedding of its token, the slot's
drafter hidden state, an MLP over 5 features of its log-probability and rank, and slot and rank
embeddings; pre-norm transformer layers run over the S·K lattice with an additive per-head bias by
slot distance and same slot (a preference, not a mask). The anchor a = anchor_norm(context_proj(
hidden_norm(fc(f)))) from the last committed row's features (0 when there is none). Normalised
out / in / anchor-out factors give start[k] = scale·⟨anchor_out, in[0, k]⟩ and pair[s, i, j] =
scale·⟨out[s, i], in[s+1, j]⟩; the scores [b, S, K, K] put `start` in every row of slot 0 and
pair[s−1] in slot s ≥ 1, and DFlash2's walk reads them. The unary log-probs enter only as features.
A draft of n < S slots uses the first n slot embeddings and the bias's top-left corner. With both
`lilicorr_conv_*` knobs set every backbone layer is DFlash2's. Full target vocabulary only (docs/architecture.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING
import logging

import torch
import torch.nn.functional as F
from torch import nn

from dflashkit.errors import UsageError
from dflashkit.model.dflash2 import DFlash2DecoderLayer, walk
from dflashkit.model.drafter import DFlashDraftModel

if TYPE_CHECKING:
    from dflashkit.model.spec import DraftSpec

log = logging.getLogger("dflashkit.model")

NUM_FEATURES = 5  # log p, p, log p − max, rank / (K − 1), is top-1


class LatticeMLP(nn.Module):
    """`up_proj` → silu → `down_proj`, both with biases (vLLM's non-gated NemotronHMLP with hidden_act silu)."""

    def __init__(self, width: int, inner: int, out: int):
        super().__init__()
        self.up_proj = nn.Linear(width, inner)
        self.down_proj = nn.Linear(inner, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.up_proj(x)))


class LatticeAttention(nn.Module):
    """Self-attention over the lattice with an additive per-head bias: `in_proj_weight` [3h, h], `in_proj_bias`,
    `out_proj` (nn.MultiheadAttention's names, which vLLM loads)."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        if heads <= 0 or width % heads:
            raise UsageError(f"lilicorr_num_heads {heads} does not divide the lattice head width {width}",
                             hint="set drafter.lilicorr_num_heads to a divisor of drafter.lilicorr_hidden_size "
                             "(0 = the draft width)")
        self.heads = heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * width, width))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * width))
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, n, w = x.shape
        q, k, v = F.linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        q, k, v = (t.view(b, n, self.heads, w // self.heads).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype))
        return self.out_proj(out.transpose(1, 2).reshape(b, n, w))


class LatticeLayer(nn.Module):
    def __init__(self, width: int, heads: int, mlp_ratio: float, eps: float):
        super().__init__()
        self.attn_norm = nn.RMSNorm(width, eps=eps)
        self.attn = LatticeAttention(width, heads)
        self.mlp_norm = nn.RMSNorm(width, eps=eps)
        self.mlp = LatticeMLP(width, int(width * mlp_ratio), width)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), bias)
        return x + self.mlp(self.mlp_norm(x))


class LiLiCorrHead(nn.Module):
    """`lilicorr`: the lattice scorer (module docstring); `forward` returns vLLM's [b, n, K, K] scores."""

    def __init__(self, contract: DraftSpec):
        super().__init__()
        k = contract.knobs
        big = contract.hidden_size
        width = k.lilicorr_hidden_size or big
        self.block_size, self.slots, self.top_k = contract.block_size, contract.block_size - 1, k.lilicorr_candidate_topk
        self.width, self.factor_dim = width, k.lilicorr_factor_dim
        self.vector_eps, self.logit_scale = float(k.lilicorr_vector_eps), float(k.lilicorr_logit_scale)
        eps = contract.rms_norm_eps
        self.token_proj: nn.Module = nn.Identity() if width == big else nn.Linear(big, width)
        self.pass_hidden_proj = nn.Linear(big, width)
        self.feature_norm = nn.LayerNorm(NUM_FEATURES)
        self.feature_mlp = LatticeMLP(NUM_FEATURES, width, width)
        self.slot_embedding = nn.Parameter(torch.zeros(1, 1, self.slots, 1, width))
        self.rank_embedding = nn.Parameter(torch.zeros(1, 1, 1, self.top_k, width))
        self.relative_slot_bias = nn.Parameter(torch.zeros(k.lilicorr_num_heads, 2 * self.block_size - 1))
        self.same_slot_bias = nn.Parameter(torch.zeros(k.lilicorr_num_heads))
        self.context_proj = nn.Linear(big, width)
        self.layers = nn.ModuleList(LatticeLayer(width, k.lilicorr_num_heads, k.lilicorr_mlp_ratio, eps)
                                    for _ in range(k.lilicorr_num_layers))
        self.output_norm = nn.RMSNorm(width, eps=eps)
        self.anchor_norm = nn.RMSNorm(width, eps=eps)
        self.factor_input_proj = nn.Linear(3 * width, width)
        self.out_head = nn.Linear(width, self.factor_dim)
        self.in_head = nn.Linear(width, self.factor_dim)
        self.anchor_out_head = nn.Linear(width, self.factor_dim)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """ModelOpt's init: Linear N(0, std) with zero bias, the attention's in-projection as
        nn.MultiheadAttention's (Xavier, zero bias), norms at 1, embeddings and biases 0; the factor heads
        N(0, 0.02) (zero on both sides of a dot product would be a saddle with no gradient)."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                nn.init.zeros_(m.bias)
            elif isinstance(m, (nn.RMSNorm, nn.LayerNorm)):
                nn.init.ones_(m.weight)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, LatticeAttention):
                nn.init.xavier_uniform_(m.in_proj_weight)
                nn.init.zeros_(m.in_proj_bias)
        for p in (self.slot_embedding, self.rank_embedding, self.relative_slot_bias, self.same_slot_bias):
            p.zero_()
        for head in (self.out_head, self.in_head, self.anchor_out_head):
            nn.init.normal_(head.weight, std=0.02)
            nn.init.zeros_(head.bias)

    def attention_bias(self, n_slots: int) -> torch.Tensor:
        """[heads, n·K, n·K]: relative_slot_bias by slot distance (offset B − 1, also for a shorter draft) plus
        same_slot_bias between the candidates of one slot."""
        slot = torch.arange(n_slots, device=self.same_slot_bias.device).repeat_interleave(self.top_k)
        rel = slot[:, None] - slot[None, :]
        same = (rel == 0).to(self.same_slot_bias.dtype)
        return self.relative_slot_bias[:, rel + self.block_size - 1] + same * self.same_slot_bias[:, None, None]

    def features(self, log_probs: torch.Tensor) -> torch.Tensor:
        """[..., K] candidate log-probs (best first) → the 5 features [..., K, 5] (float32)."""
        lp = log_probs.float()
        k = lp.shape[-1]
        rank = torch.arange(k, device=lp.device, dtype=torch.float32) / max(k - 1, 1)
        top1 = (torch.arange(k, device=lp.device) == 0).float()
        return torch.stack([lp, lp.exp(), lp - lp.max(-1, keepdim=True).values, rank.expand_as(lp),
                            top1.expand_as(lp)], dim=-1)

    def score(self, token_embeddings: torch.Tensor, log_probs: torch.Tensor, pass_hidden: torch.Tensor,
              anchor_hidden: torch.Tensor, anchor_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The lattice's cosines.

        Args:
            token_embeddings: [b, n, K, H] target input embeddings of the candidates; log_probs [b, n, K];
            pass_hidden: [b, n, H] the drafter's output at the n slots; anchor_hidden [b, H]; anchor_valid [b].
        Returns:
            start [b, K] and pairs [b, n − 1, K, K] (cosines in [−1, 1], before `logit_scale`).
        """
        b, n, k = log_probs.shape
        if not 1 <= n <= self.slots or k != self.top_k:
            raise ValueError(f"LiLiCorr scores 1..{self.slots} slots of {self.top_k} candidates, got {n} x {k}")
        dtype = self.slot_embedding.dtype
        x = self.token_proj(token_embeddings.to(dtype)) + self.pass_hidden_proj(pass_hidden.to(dtype)).unsqueeze(-2)
        x = x + self.feature_mlp(self.feature_norm(self.features(log_probs).to(x.dtype)))
        x = x + self.slot_embedding[:, 0, :n] + self.rank_embedding[:, 0]
        x = x.reshape(b, n * k, self.width)
        bias = self.attention_bias(n)[None]
        for layer in self.layers:
            x = layer(x, bias)
        x = self.output_norm(x).view(b, n, k, self.width)
        a = self.context_proj(anchor_hidden.to(dtype)) * anchor_valid[:, None].to(dtype)
        a = self.anchor_norm(a)
        row = a[:, None, None, :].expand_as(x)
        u = F.silu(self.factor_input_proj(torch.cat([x, row, x * row], dim=-1)))
        out_v = F.normalize(self.out_head(u), dim=-1, eps=self.vector_eps)
        in_v = F.normalize(self.in_head(u), dim=-1, eps=self.vector_eps)
        anchor_out = F.normalize(self.anchor_out_head(a), dim=-1, eps=self.vector_eps)
        start = (anchor_out[:, None, :] * in_v[:, 0]).sum(-1)
        pairs = out_v[:, :-1] @ in_v[:, 1:].transpose(-1, -2)
        return start, pairs

    def factors(self, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`score`'s (start, pairs) times `logit_scale`, float32: the chain's log-potentials."""
        start, pairs = self.score(*args)
        return self.logit_scale * start.float(), self.logit_scale * pairs.float()

    def forward(self, token_embeddings: torch.Tensor, log_probs: torch.Tensor, pass_hidden: torch.Tensor,
                anchor_hidden: torch.Tensor, anchor_valid: torch.Tensor) -> torch.Tensor:
        """vLLM's layout [b, n, K, K]: slot 0's rows all hold the start scores, slot s ≥ 1 the pairs s−1 → s."""
        start, pairs = self.factors(token_embeddings, log_probs, pass_hidden, anchor_hidden, anchor_valid)
        first = start[:, None, None, :].expand(-1, 1, self.top_k, -1)
        return torch.cat([first, pairs], dim=1)


class LiLiCorrDraftModel(DFlashDraftModel):
    """LiLiCorr drafter; `state_dict()` keys are vLLM's LiLiCorr checkpoint names (module docstring)."""

    def __init__(self, contract: DraftSpec, feature_scale: torch.Tensor | None = None):
        super().__init__(contract, feature_scale=feature_scale)
        self.top_k = contract.knobs.lilicorr_candidate_topk
        self.lilicorr = LiLiCorrHead(contract)

    @property
    def conv(self) -> bool:
        k = self.contract.knobs
        return bool(k.lilicorr_conv_kernel_size and k.lilicorr_conv_group_size)

    def make_layer(self) -> nn.Module:
        if not self.conv:
            return super().make_layer()
        k = self.contract.knobs
        return DFlash2DecoderLayer(self.config, k.lilicorr_conv_kernel_size, k.lilicorr_conv_group_size)

    def reset_parameters(self, std: float = 0.02) -> None:
        super().reset_parameters(std)
        for layer in self.layers:  # the convolutions start as the identity (ModelOpt: projection 0)
            for conv in (getattr(layer, "attention_conv", None), getattr(layer, "mlp_conv", None)):
                if conv is not None:
                    conv.reset_identity()
        if hasattr(self, "lilicorr"):
            self.lilicorr.reset_parameters(std)

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-K of the head's logits [..., V]: (ids [..., K] int64, full-vocab log-probs [..., K] float32), best
        first (vLLM's `get_top_k_tokens(..., return_log_probs=True)`)."""
        values, ids = torch.topk(logits.float(), self.top_k, dim=-1)
        return ids, values - torch.logsumexp(logits.float(), dim=-1, keepdim=True)

    def anchor_hidden(self, features: torch.Tensor) -> torch.Tensor:
        """[..., n_feat·H] target features of the last committed token → hidden_norm(fc(·)) [..., H] (in the
        drafter's dtype: the loss calls it outside the drafter's autocast, on a bf16 target's features)."""
        return self.fuse(features.to(self.fc.weight.dtype))

    @torch.no_grad()
    def draft(self, h: torch.Tensor, logits: torch.Tensor, embed, anchor_hidden: torch.Tensor,
              anchor_valid: torch.Tensor | None = None, *, temperature: float = 0.0,
              generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draft tokens through the lattice walk.

        Args:
            h: [b, L, H] drafter outputs at block positions 1 … L; logits [b, L, V] their head logits.
            embed: the target's input embedding (ids → [..., H]); anchor_hidden [b, H] (`anchor_hidden`).
        Returns:
            tokens [b, L], cand_ids [b, L, K], realized rows [b, L, K] (`model.dflash2.walk`).
        """
        ids, logp = self.candidates(logits)
        valid = anchor_valid if anchor_valid is not None else torch.ones(h.shape[0], dtype=torch.bool,
                                                                         device=h.device)
        scores = self.lilicorr(embed(ids), logp, h, anchor_hidden, valid)
        tokens, rows = walk(scores, ids, temperature=temperature, generator=generator)
        return tokens, ids, rows


@torch.no_grad()
def init_from_backbone(model: LiLiCorrDraftModel, state: dict[str, torch.Tensor], *, source: str) -> dict:
    """Initialise LiLiCorr's backbone from a DFlash or DFlash2 state dict (z-lab names): every backbone tensor
    the two share; the lattice head stays random (a DFlash2's candidate selector is dropped).

    A DFlash2 source needs the same convolutions (`lilicorr_conv_*` = its conv_kernel_size / conv_group_size):
    its layers were trained with them, so they are copied, never dropped. A DFlash source into a LiLiCorr
    with convolutions keeps them the identity. Either way the result computes the source's hidden states
    (a DFlash2 trained with `input_embedding_scale` set aside). Raises UsageError when the convolutions
    disagree or nothing fits. Returns {"copied": [...], "skipped": [...] (name: reason)}.
    """
    own = model.state_dict()
    conv_src = sorted(k for k in state if "_conv." in k)
    bad = [f"{k}: {tuple(state[k].shape)} != {tuple(own[k].shape)}" if k in own else f"{k}: not in this drafter"
           for k in conv_src if k not in own or tuple(state[k].shape) != tuple(own[k].shape)]
    if bad:
        raise UsageError(f"drafter.init: the {source} checkpoint's convolutions do not fit this LiLiCorr drafter "
                         f"({'; '.join(bad[:3])}{' …' if len(bad) > 3 else ''})",
                         hint="set drafter.lilicorr_conv_kernel_size / lilicorr_conv_group_size to its "
                         "conv_kernel_size / conv_group_size (its config.json dflash_config), re-run probe")
    copied, skipped = [], []
    for name, t in state.items():
        if name not in own or name.startswith(("lilicorr.", "candidate_selector.")):
            skipped.append(f"{name}: not a backbone tensor of this drafter")
        elif tuple(t.shape) != tuple(own[name].shape):
            skipped.append(f"{name}: shape {tuple(t.shape)} != {tuple(own[name].shape)}")
        else:
            own[name].copy_(t.to(own[name].dtype))
            copied.append(name)
    if not copied:
        raise UsageError(f"the {source} checkpoint shares no tensor with this LiLiCorr drafter",
                         hint="use a drafter trained for the same target and drafter.* geometry")
    log.info("init from a %s checkpoint: %d tensors copied, %d skipped (the lattice head stays random)",
             source, len(copied), len(skipped))
    return {"copied": copied, "skipped": skipped}
