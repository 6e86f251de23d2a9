"""The DFlash draft forward for decoding, lean: the same numbers as `DFlashDraftModel.forward`, fewer ops.

Usage:
    fast = FastDraft.supports(drafter) and FastDraft(drafter, head_w, head_b, mask_emb, max_len=4096)
    state = fast.new_state()                                   # one per generation (batch size 1)
    logits = fast.propose(state, feats, anchor_emb, start)     # [B−1, V or V'] draft logits
    h, logits = fast.forward(state, feats, anchor_emb, start)  # and the final hidden states [B−1, H] before them

One propose step of a decode (batch size 1): the target features committed since the last step become
context keys/values in the state's preallocated per-layer buffers, then the block `[anchor, MASK × (B−1)]`
runs through the draft layers and the target head's rows. Against the module forward it saves per-step
recomputation and allocation: RoPE tables computed once, context K/V written in place, q/k/v and gate/up as
one matmul over concatenated weights, bf16 weights prepacked for oneDNN (`target/packed.py`, used only where
bit-identical to F.linear), fused RMSNorm. The arithmetic is the module's (tests/decode/test_fast_draft.py
compares logits and proposals step by step); `dflashkit bench draft` times one step of each. Causal in-block
attention, sliding-window layers (the module's rule p − W < k, at O(W) cost per step) and per-layer causality
are supported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dflashkit.model.drafter import block_attention
from dflashkit.model.masks import window_mask
from dflashkit.target.packed import PackedLinear

# RoPE types whose frequencies depend on the sequence length (HF `dynamic_rope_update`): no fixed table.
DYNAMIC_ROPE = ("dynamic", "longrope")


@dataclass
class DraftState:
    """Per-generation context K/V: `keys` / `values` [layers, kv_heads, capacity, head_dim], `length` used."""

    keys: torch.Tensor
    values: torch.Tensor
    length: int = 0


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Qwen3RMSNorm: float32 statistics (one fused `F.rms_norm` instead of five ops), the weight applied in
    the input dtype. `weight` may be [heads, d] over x [t, heads, d] (each head its own norm weight)."""
    return weight * F.rms_norm(x.to(torch.float32), (x.shape[-1],), eps=eps).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [t, heads, d]; cos [t, d] and sin_signed [t, d] = sin with its first half negated (neox layout, as
    `model.drafter.apply_rope`: rotate_half(x)·sin = roll(x, d/2)·sin_signed, the same products)."""
    return x * cos[:, None] + x.roll(x.shape[-1] // 2, -1) * sin_signed[:, None]


class _PackedLinear:
    """`F.linear(x, w, b)`, through `target.packed.PackedLinear` where that gives the same result bit for bit.

    CPU bf16 only (`torch.ops.mkldnn`; where it is missing, or differs from F.linear for any row count up to
    `rows` on random inputs, every call takes F.linear). Inputs with more than `rows` rows take F.linear."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None, rows: int):
        self.w, self.b, self.rows = w, b, rows
        self.packed: PackedLinear | None = None
        if w.device.type != "cpu" or w.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
            return
        try:
            packed = PackedLinear(w, b, rows=rows)
            g = torch.Generator().manual_seed(0)
            for m in range(1, rows + 1):
                x = torch.randn(m, w.shape[1], generator=g).to(w.dtype)
                if not torch.equal(packed(x), F.linear(x, w, b)):
                    return
        except (RuntimeError, AttributeError):  # an mkldnn build without these ops
            return
        self.packed = packed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.shape[0] <= self.rows:
            return self.packed(x)
        return F.linear(x, self.w, self.b)


class _Layer:
    """One DFlash decoder layer's weights, laid out for the lean forward."""

    def __init__(self, layer: nn.Module, rows: int):
        a = layer.self_attn
        self.n_heads, self.n_kv, self.d = a.n_heads, a.n_kv, a.head_dim
        biases = [p.bias for p in (a.q_proj, a.k_proj, a.v_proj)]
        self.qkv = _PackedLinear(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach().contiguous(),
                                 None if biases[0] is None else torch.cat([b.detach() for b in biases]), rows)
        self.kv = _PackedLinear(torch.cat([a.k_proj.weight, a.v_proj.weight]).detach().contiguous(),
                                None if biases[1] is None else torch.cat([biases[1].detach(), biases[2].detach()]),
                                rows)
        self.o = _PackedLinear(a.o_proj.weight.detach(), None if a.o_proj.bias is None else a.o_proj.bias.detach(),
                               rows)
        self.q_norm, self.k_norm = a.q_norm.weight.detach(), a.k_norm.weight.detach()
        self.q_eps, self.k_eps = a.q_norm.variance_epsilon, a.k_norm.variance_epsilon
        # the block's queries and keys normed and rotated as one [q, heads + kv_heads, d] tensor (same eps)
        self.qk_norm = (torch.cat([self.q_norm.expand(self.n_heads, -1), self.k_norm.expand(self.n_kv, -1)])
                        if self.q_eps == self.k_eps else None)
        self.in_norm = layer.input_layernorm.weight.detach()
        self.in_eps = layer.input_layernorm.variance_epsilon
        self.post_norm = layer.post_attention_layernorm.weight.detach()
        self.post_eps = layer.post_attention_layernorm.variance_epsilon
        m = layer.mlp
        self.inter = m.gate_proj.weight.shape[0]
        self.gate_up = _PackedLinear(torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach().contiguous(), None,
                                     rows)
        self.down = _PackedLinear(m.down_proj.weight.detach(), None, rows)


class FastDraft:
    """The lean DFlash draft forward over a drafter's weights (see the module docstring).

    Args:
        drafter: a `DFlashDraftModel` (plain DFlash layers; `supports` says whether it qualifies), already in
            the draft dtype and on the decode device.
        head_w, head_b: the rows of the target head the drafter drafts over ([V or V', H]), draft dtype.
        mask_emb: [1, 1, H] the mask token's target embedding, draft dtype.
        max_len: positions the RoPE table covers (prompt + max new tokens + B); grown on demand.
        causal: causal in-block attention (query offset i sees the context and offsets j ≤ i).
    """

    def __init__(self, drafter: nn.Module, head_w: torch.Tensor, head_b: torch.Tensor | None,
                 mask_emb: torch.Tensor, *, max_len: int = 4096, causal: bool = False):
        self.drafter = drafter
        rows = drafter.block_size
        self.layers = [_Layer(layer, rows) for layer in drafter.layers]
        self.fc = _PackedLinear(drafter.fc.weight.detach(), None, rows)
        scale = getattr(drafter, "feature_scale", None)
        self.feature_scale = None if scale is None else scale.detach()
        self.hidden_norm, self.hidden_eps = drafter.hidden_norm.weight.detach(), drafter.hidden_norm.variance_epsilon
        self.norm, self.norm_eps = drafter.norm.weight.detach(), drafter.norm.variance_epsilon
        self.head = _PackedLinear(head_w, head_b, rows)
        self.dtype, self.device = head_w.dtype, head_w.device
        self.block = drafter.block_size
        self.mask_row = mask_emb.reshape(-1)
        self.causal = causal
        n = len(self.layers)
        windows = list(getattr(drafter, "layer_windows", None) or [None] * n)
        causals = [c or causal for c in getattr(drafter, "layer_causal", None) or [causal] * n]
        self.kinds: list[tuple[int | None, bool]] = list(zip(windows, causals))  # per layer (window, causal)
        self._cos = self._sin = torch.empty(0)
        self._table(max_len)

    @staticmethod
    def supports(drafter: nn.Module) -> bool:
        """Whether this forward computes the drafter's module forward: its family says so of its contract
        (`Decoding.fast_path`: plain DFlash layers, nothing added around them) and its RoPE is length-free."""
        rope = getattr(drafter.rotary_emb, "rope_type", "default")
        c = drafter.contract
        return bool(c.family.decoding.fast_path(c)) and rope not in DYNAMIC_ROPE

    def _table(self, n: int) -> None:
        """cos/sin [n, d] for positions 0 … n−1, computed by the drafter's own rotary module."""
        probe = self.mask_row.view(1, 1, -1)
        pos = torch.arange(n, device=self.device)[None]
        cos, sin = self.drafter.rotary_emb(probe, pos)
        sin = sin[0].to(self.dtype)
        half = sin.shape[-1] // 2
        self._cos, self._sin = cos[0].to(self.dtype), torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)

    def new_state(self, capacity: int = 1024) -> DraftState:
        first = self.layers[0]
        shape = (len(self.layers), first.n_kv, capacity, first.d)
        z = torch.empty(shape, dtype=self.dtype, device=self.device)
        return DraftState(z, torch.empty_like(z))

    def _reserve(self, state: DraftState, need: int) -> None:
        cap = state.keys.shape[2]
        if need <= cap:
            return
        new = max(need, 2 * cap)
        for name in ("keys", "values"):
            old = getattr(state, name)
            buf = old.new_empty(old.shape[0], old.shape[1], new, old.shape[3])
            buf[:, :, :state.length] = old[:, :, :state.length]
            setattr(state, name, buf)

    def propose(self, state: DraftState, feats: torch.Tensor, anchor_emb: torch.Tensor, start: int,
                num_drafts: int | None = None) -> torch.Tensor:
        """Draft logits [k, V or V'] for block positions 1 … k (k = `num_drafts`, default B − 1); see `forward`."""
        return self.forward(state, feats, anchor_emb, start, num_drafts)[1]

    @torch.inference_mode()
    def forward(self, state: DraftState, feats: torch.Tensor, anchor_emb: torch.Tensor, start: int,
                num_drafts: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(h [k, H], logits [k, V or V']) of block positions 1 … k (k = `num_drafts`, default B − 1): the
        drafter's final-norm output (what `DFlashDraftModel.forward` returns there) and the head's logits.

        Args:
            state: this generation's context K/V (`state.length` = positions already in it).
            feats: [1, t, n_feat·H] target features of positions start − t … start − 1 (t ≥ 0).
            anchor_emb: [1, 1, H] target embedding of the token at `start` (the block's slot 0).
            start: the anchor's position; start − t must equal `state.length`.
        """
        k = self.block - 1 if num_drafts is None else num_drafts
        t = feats.shape[1]
        assert state.length + t == start, f"context holds {state.length} positions, {t} new, anchor at {start}"
        end = start + k + 1
        if end > self._cos.shape[0]:
            self._table(max(end, 2 * self._cos.shape[0]))
        self._reserve(state, end)
        if t:
            self._context(state, feats[0], start)
        h = self._block(state, anchor_emb, start, k)
        return h, self.head(h)

    def _context(self, state: DraftState, f: torch.Tensor, start: int) -> None:
        """The new context tokens' keys/values ([t, n_feat·H] features of positions state.length … start − 1)."""
        ctx0, t = state.length, f.shape[0]
        if self.feature_scale is not None:
            f = f * self.feature_scale.to(f.dtype)
        c = _rms(self.fc(f), self.hidden_norm, self.hidden_eps)      # [t, H]
        cos, sin = self._cos[ctx0:start], self._sin[ctx0:start]
        for i, L in enumerate(self.layers):
            kv = L.kv(c)                                      # [t, 2·kv·d]
            kk = _rms(kv[:, :L.n_kv * L.d].view(t, L.n_kv, L.d), L.k_norm, L.k_eps)
            state.keys[i, :, ctx0:start] = _rope(kk, cos, sin).transpose(0, 1)
            state.values[i, :, ctx0:start] = kv[:, L.n_kv * L.d:].view(t, L.n_kv, L.d).transpose(0, 1)
        state.length = start

    def _block(self, state: DraftState, anchor_emb: torch.Tensor, start: int, k: int) -> torch.Tensor:
        """The block [anchor, MASK × k] through the layers and the final norm → h [k, H] of positions 1 … k."""
        q_len = k + 1
        end = start + q_len
        x = torch.cat((anchor_emb.reshape(1, -1), self.mask_row.expand(k, -1)))        # [q, H]
        cos, sin = self._cos[start:end], self._sin[start:end]
        masks = {kind: self._mask(start, q_len, *kind) for kind in dict.fromkeys(self.kinds)}
        for i, L in enumerate(self.layers):
            u = _rms(x, L.in_norm, L.in_eps)
            qkv = L.qkv(u)                                       # [q, (nh + 2·kv)·d]
            nq, nk = L.n_heads * L.d, L.n_kv * L.d
            if L.qk_norm is not None:
                qk = _rope(_rms(qkv[:, :nq + nk].view(q_len, L.n_heads + L.n_kv, L.d), L.qk_norm, L.q_eps), cos, sin)
                q, bk = qk[:, :L.n_heads], qk[:, L.n_heads:]
            else:
                q = _rope(_rms(qkv[:, :nq].view(q_len, L.n_heads, L.d), L.q_norm, L.q_eps), cos, sin)
                bk = _rope(_rms(qkv[:, nq:nq + nk].view(q_len, L.n_kv, L.d), L.k_norm, L.k_eps), cos, sin)
            state.keys[i, :, start:end] = bk.transpose(0, 1)                        # scratch past the context
            state.values[i, :, start:end] = qkv[:, nq + nk:].view(q_len, L.n_kv, L.d).transpose(0, 1)
            lo, mask = masks[self.kinds[i]]
            attn = block_attention(q.transpose(0, 1)[None], state.keys[i, :, lo:end][None],
                                   state.values[i, :, lo:end][None], mask)  # [1, nh, q, d]
            x = x + L.o(attn[0].transpose(0, 1).reshape(q_len, nq))
            gu = L.gate_up(_rms(x, L.post_norm, L.post_eps))
            x = x + L.down(F.silu(gu[:, :L.inter]) * gu[:, L.inter:])
        return _rms(x[1:], self.norm, self.norm_eps)

    def _mask(self, start: int, q_len: int, window: int | None, causal: bool) -> tuple[int, torch.Tensor | None]:
        """(lo, mask) of a block at positions start … start+q−1 in a layer with `window` (None: full) and in-block
        `causal`ity: it attends over buffer positions lo … start+q−1 under the bool mask [q, start + q − lo]
        (None: all of them)."""
        lo = 0 if window is None else max(0, start - window + 1)
        ctx = window_mask(torch.arange(start, start + q_len, device=self.device),
                          torch.arange(lo, start, device=self.device), window)
        if ctx is not None and bool(ctx.all()):
            ctx = None
        if ctx is None and not causal:
            return lo, None
        block = torch.ones(q_len, q_len, dtype=torch.bool, device=self.device)
        if causal:
            block = block.tril()
        if ctx is None:
            ctx = torch.ones(q_len, start - lo, dtype=torch.bool, device=self.device)
        return lo, torch.cat([ctx, block], dim=-1)

    @torch.inference_mode()
    def profile(self, *, context: int = 256, new: int = 2, reps: int = 50) -> dict[str, float]:
        """Median milliseconds of each part of one propose step at a `context`-token context with `new` newly
        committed tokens: the context K/V of the new tokens, the block's layers, the head (`bench decode`)."""
        import statistics
        import time

        nf = self.fc.w.shape[1]
        g = torch.Generator(device="cpu").manual_seed(0)
        feats = torch.randn(context + new * (reps + 8), nf, generator=g).to(self.dtype).to(self.device)
        state = self.new_state(context + new * (reps + 8) + self.block)
        self._reserve(state, feats.shape[0] + self.block)
        if feats.shape[0] + self.block > self._cos.shape[0]:
            self._table(feats.shape[0] + self.block)
        self._context(state, feats[:context], context)
        anchor = self.mask_row.view(1, 1, -1)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        parts: dict[str, list[float]] = {"context_kv": [], "block": [], "head": []}
        for i in range(reps + 8):
            start = state.length + new
            sync()
            t0 = time.perf_counter()
            self._context(state, feats[state.length:start], start)
            sync()
            t1 = time.perf_counter()
            h = self._block(state, anchor, start, self.block - 1)
            sync()
            t2 = time.perf_counter()
            self.head(h).argmax(-1).tolist()
            t3 = time.perf_counter()
            if i >= 8:  # warm-up excluded
                for name, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2)):
                    parts[name].append(dt * 1e3)
        out = {k: round(statistics.median(v), 4) for k, v in parts.items()}
        out["total"] = round(sum(out.values()), 4)
        return out
