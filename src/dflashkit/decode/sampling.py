"""Sampling and the lossless verification rules of speculative decoding.

Usage:
    probs = sampling_probs(logits, params)                      # [..., V] the target's sampling law
    token = sample(probs, generator)                            # one draw per row
    n, nxt = verify_greedy(drafts, posterior)                   # exact-match prefix + bonus token
    n, nxt = verify_sampled(drafts, target_probs, draft_probs, generator)   # rejection rule

Verification rule (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding", and Chen et al. 2023): at block position k the target's law is p_k (temperature,
top-k, top-p applied), the draft proposed d_k from q_k. Accept d_k with probability
min(1, p_k(d_k) / q_k(d_k)); at the first rejection emit a token from the residual
r_k ∝ max(0, p_k − q_k); if every draft is accepted emit a bonus token from p_B.

Why the output law is the target's: for one position,
    P(emit x) = q(x)·min(1, p(x)/q(x)) + (1 − Σ_y min(q(y), p(y))) · max(0, p(x) − q(x)) / Z
where Z = Σ_y max(0, p(y) − q(y)) = 1 − Σ_y min(p(y), q(y)). The first term is min(p(x), q(x)),
the second max(0, p(x) − q(x)); their sum is p(x). By induction over positions (each accepted
token is then the prefix of the next verified position) the whole sequence has the target's law.
Greedy drafts are the special case q = δ_d: accept with probability p(d), otherwise draw from p
with d removed and renormalised. With temperature 0 the rule degenerates to "accept while d_k
equals the target's argmax; emit the argmax at the first mismatch" (`verify_greedy`).
"""

from __future__ import annotations

import torch


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """The sampling law of `logits` [..., V] after temperature, top-k and top-p (float32)."""
    if temperature <= 0:
        raise ValueError("sampling_probs needs temperature > 0 (temperature 0 is argmax)")
    scores = logits.float() / temperature
    vocab = scores.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the top token is always kept)
        drop = (sorted_p.cumsum(dim=-1) - sorted_p) >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of `probs` [..., V] → [...] (long)."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def verify_greedy(drafts: list[int], posterior: list[int]) -> tuple[int, int]:
    """Greedy rule: `posterior[k]` is the target argmax after block position k (len = len(drafts)+1).

    Returns (number of accepted drafts a, the token to emit after them = posterior[a]).
    """
    a = 0
    for d, p in zip(drafts, posterior):
        if d != p:
            break
        a += 1
    return a, posterior[a]


def verify_sampled(drafts: list[int], target_probs: torch.Tensor, draft_probs: torch.Tensor | None,
                   generator: torch.Generator | None = None) -> tuple[int, int]:
    """Rejection rule (module docstring) for one block.

    Args:
        drafts: the k proposed tokens d_1..d_k.
        target_probs: [k+1, V] target law at each block position (row k is the bonus law).
        draft_probs: [k, V] the draft law each d_i was sampled from, or None for greedy/point-mass
            proposals (q = δ_d).
        generator: RNG for the accept coins and the emitted token.
    Returns:
        (accepted count a, emitted token: residual sample at a < k, bonus sample at a == k).
    """
    k = len(drafts)
    if k:
        idx = torch.tensor(drafts, dtype=torch.long, device=target_probs.device)
        p = target_probs[:k].gather(-1, idx[:, None])[:, 0]
        q = torch.ones_like(p) if draft_probs is None else draft_probs.gather(-1, idx[:, None])[:, 0].float()
        coins = torch.rand(k, generator=generator, device=target_probs.device)
        # accept while u·q < p  ⇔  u < min(1, p/q)
        ok = (coins * q < p).tolist()
        a = next((i for i, good in enumerate(ok) if not good), k)
    else:
        a = 0
    if a == k:
        return a, int(sample(target_probs[k], generator))
    row = target_probs[a].clone()
    if draft_probs is None:
        row[drafts[a]] = 0.0
    else:
        row = (row - draft_probs[a].float()).clamp_min_(0.0)
    total = row.sum()
    if total <= 0:  # p == q exactly: rejection has probability 0; fall back to p
        row = target_probs[a]
    return a, int(sample(row, generator))
