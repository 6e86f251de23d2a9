"""Serve gate: a drafter overfit on one conversation, exported and reloaded, drafts whole blocks on it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflashkit.cli import main
from dflashkit.config import TargetSection
from dflashkit.decode.api import SamplingParams
from dflashkit.decode.spec_decode import SpecDecoder
from dflashkit.export.hf import load_drafter, save_drafter
from dflashkit.target.load import load_target

from dflashkit.testing import random_drafter

B = 4


def overfit(target, drafter, seq: list[int], start: int, steps: int = 400, lr: float = 1e-2) -> float:
    """Train the drafter on every block of `seq` from `start` (one batch: one row per anchor).

    Stops once every label is the drafter's argmax; returns that accuracy.
    Row a: block [seq[a], MASK×(B−1)] at positions a..a+B−1, context = features of positions < a
    (dense bool mask), labels seq[a+1..a+B−1] at block positions 1..B−1 (same-position prediction).
    """
    ids = torch.tensor([seq])
    with torch.no_grad():
        feats = target.features(ids, layer_ids=drafter.target_layer_ids)  # [1, L, nF·H]
    L = len(seq)
    anchors = list(range(start, L - B + 1))
    n = len(anchors)
    a = torch.tensor(anchors)
    block_ids = torch.full((n, B), drafter.mask_token_id)
    block_ids[:, 0] = ids[0, a]
    labels = torch.stack([ids[0, i + 1: i + B] for i in anchors])  # [n, B-1]
    with torch.no_grad():
        noise = target.embed(block_ids)
    pos = torch.cat([torch.arange(L).expand(n, L), a[:, None] + torch.arange(B)], dim=1)
    mask = torch.cat([torch.arange(L)[None] < a[:, None], torch.ones(n, B, dtype=torch.bool)], dim=1)
    mask = mask[:, None, None, :].expand(n, 1, B, L + B)
    drafter.train().requires_grad_(True)
    opt = torch.optim.AdamW(drafter.parameters(), lr=lr)
    acc = 0.0
    for _ in range(steps):
        h = drafter(noise, feats.expand(n, -1, -1), pos, attention_mask=mask)
        logits = target.lm_head(h[:, 1:]).flatten(0, 1)
        acc = (logits.argmax(-1) == labels.flatten()).float().mean().item()
        if acc == 1.0:
            break
        loss = F.cross_entropy(logits, labels.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    drafter.eval().requires_grad_(False)
    return acc


def test_overfit_export_reload_gives_full_blocks(tmp_path, tiny_qwen3):
    target = load_target(TargetSection(path=str(tiny_qwen3), device="cpu", dtype="float32"))
    tok = target.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Say something nice."}], tokenize=False,
                                   add_generation_prompt=True)
    prompt = tok.encode(text, add_special_tokens=False)
    params = SamplingParams(max_new_tokens=33)
    answer = SpecDecoder(target, None, 1).generate(prompt, params).token_ids  # the target's own reply
    drafter = random_drafter(target, block_size=B, layers=1)
    before = SpecDecoder(target, drafter, B).generate(prompt, params)
    acc = overfit(target, drafter, prompt + answer, start=len(prompt))
    assert acc == 1.0, f"overfitting failed (train accuracy {acc:.3f})"

    rd = tmp_path / "run"
    save_drafter(drafter, rd / "train" / "final", dtype="float32")
    assert main(["export", f"target.path={tiny_qwen3}", "--run-dir", str(rd), "--json"]) == 0  # bf16 export
    served = load_drafter(rd / "export", dtype=torch.float32)
    after = SpecDecoder(target, served, B).generate(prompt, params)
    assert after.token_ids == answer  # still lossless
    tau = sum(after.acceptance_lengths) / len(after.acceptance_lengths)
    tau_before = sum(before.acceptance_lengths) / len(before.acceptance_lengths)
    assert tau >= 0.85 * B, f"τ {tau:.2f} after overfitting (before {tau_before:.2f}); lengths {after.acceptance_lengths}"
    assert tau > tau_before
