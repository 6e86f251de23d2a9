"""The export's reload check and the target head it compares logits through.

Usage:
    head = target_head(cfg)                                   # [V, H] read from the files, or None
    head = loaded_target_head(cfg, hidden_size)               # through the full loader (GGUF too)
    check = reload_check(source_model, export_dir, head, atol)  # raises DflashkitError on a mismatch
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from dflashkit.errors import DflashkitError, UsageError
from dflashkit.export.hf import load_drafter, load_shipped_model, read_target_head
from dflashkit.inspect.target import resolve_target_path

log = logging.getLogger("dflashkit.export")


def reload_check(source: Any, export_dir: Path, head: Any, atol: float) -> dict[str, float]:
    """Compare source vs reloaded (ours) vs shipped dflash.py on a fixed input; raise on mismatch.

    `head` [V, H] (or None: hidden states are compared); a reduced-vocab drafter is compared through
    its V' rows, and the reloaded draft vocab must equal the source's.
    """
    c = source.contract
    g = torch.Generator().manual_seed(0)
    t, q = 8, c.block_size
    noise = torch.randn(1, q, c.hidden_size, generator=g)
    ctx = torch.randn(1, t, c.num_features * c.hidden_size, generator=g)
    pos = torch.arange(t + q)[None]
    ours = load_drafter(export_dir, dtype=torch.float32)
    shipped = load_shipped_model(export_dir)
    vocab = source.draft_vocab
    if (vocab is None) != (ours.draft_vocab is None) or (vocab is not None and not torch.equal(vocab, ours.draft_vocab)):
        raise DflashkitError(f"export reload check failed in {export_dir}: the reloaded draft vocabulary differs "
                             "from the source's", hint="nothing was replaced; this is a bug, please report it")
    if head is not None and vocab is not None:
        head = head.index_select(0, vocab)
    with torch.inference_mode():
        ref = source.float()(noise, ctx, pos)
        a = ours(noise, ctx, pos)
        b = shipped(noise_embedding=noise, target_hidden=ctx, position_ids=pos)
        proj = head.float() if head is not None else torch.eye(c.hidden_size)
        lr, la, lb = ref @ proj.T, a @ proj.T, b @ proj.T
    scale = max(1.0, lr.abs().max().item())
    diff_export = (la - lr).abs().max().item()
    diff_shipped = (lb - la).abs().max().item()
    if diff_export > atol * scale or diff_shipped > 1e-4 * scale:
        raise DflashkitError(
            f"export reload check failed in {export_dir}: max |logits diff| exported vs source {diff_export:.3g}, "
            f"shipped dflash.py vs our loader {diff_shipped:.3g} (allowed {atol * scale:.3g} / {1e-4 * scale:.3g})",
            hint="nothing was replaced; try export.dtype=float32 or raise export.check_atol")
    top1 = (la.argmax(-1) == lr.argmax(-1)).float().mean().item()
    walk = c.family.formats.reload_check(source, ours, head)  # the family's own part (DFlash2: the selector's walk)
    return {"max_diff_vs_source": diff_export, "max_diff_shipped_vs_ours": diff_shipped, "logit_scale": scale,
            "top1_agreement": top1, "compared": "logits" if head is not None else "hidden states", **walk}


def target_head(cfg: Any):
    if not cfg.target.path:
        return None
    try:
        model_dir, gguf = resolve_target_path(cfg.target.path, cfg.target.gguf_file)
        return None if gguf else read_target_head(model_dir)
    except (DflashkitError, OSError) as e:
        log.warning("target head not readable (%s): comparing hidden states instead of logits", e)
        return None


def loaded_target_head(cfg: Any, hidden_size: int):
    """The target head through the full loader (GGUF targets too); a reduced-vocab export needs its rows."""
    from dflashkit.target.load import load_target

    if not cfg.target.path:
        raise UsageError("this drafter has a reduced draft vocabulary: its export holds lm_head.weight = the "
                         "target head's rows d2t (vLLM needs them), so `dflashkit export` needs the target",
                         hint="set target.path (in -c run.yaml or target.path=...)")
    head = load_target(cfg.target, device="cpu", with_tokenizer=False).lm_head.weight.detach()
    if head.shape[-1] != hidden_size:
        raise UsageError(f"target head {tuple(head.shape)} does not match the drafter's hidden size {hidden_size}",
                         hint="set target.path to the target this drafter was trained for")
    return head
