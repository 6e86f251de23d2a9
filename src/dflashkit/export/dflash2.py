"""DFlash2 checkpoints in both formats: the tensors a reader must find, and the reload check of the walk.

Usage:
    check_dflash2_tensors(contract, set(state), set(model.state_dict()), weights=w, config=c)  # UsageError
    info = walk_check(source, reloaded, head, exact=True)   # same logits and the same greedy walk, or raise

A DFlash2 checkpoint (`architectures: ["DFlash2DraftModel"]`; `dflash_config` with
`conv_kernel_size`, `conv_group_size`, `selector_rank`, `selector_top_k` — the contract reader
names any missing key) holds, beside DFlash's tensors, per layer i
`layers.{i}.attention_conv.{base_kernel, kernel_projection.weight}` and the same for `mlp_conv`, and
`candidate_selector.{predecessor_codebook, successor_codebook, hidden_projection.weight}`: vLLM
0.32's `DFlash2Qwen3ForCausalLM.load_weights` names (it prefixes `model.`), which our
`DFlash2DraftModel.state_dict()` mirrors. A reader refuses (exit 2) a DFlash2 config whose weights
lack any of them, naming them, and a DFlash config whose weights carry them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dflashkit.errors import DflashkitError, UsageError

MARKERS = ("attention_conv.", "mlp_conv.", "candidate_selector.")


def is_dflash2_tensor(name: str) -> bool:
    return any(m in name for m in MARKERS)


def check_dflash2_tensors(contract: Any, have: set[str], want: set[str], *, weights: Path, config: Path) -> None:
    """UsageError naming the DFlash2 tensors a DFlash2 checkpoint lacks (or a DFlash one carries)."""
    if contract.is_dflash2:
        missing = sorted(k for k in want - have if is_dflash2_tensor(k))
        if missing:
            shown = ", ".join(missing[:12]) + (f" … ({len(missing)} in all)" if len(missing) > 12 else "")
            raise UsageError(f"{weights}: {config} declares a DFlash2DraftModel but the weights lack its "
                             f"selector/convolution tensors: {shown}",
                             hint="a DFlash checkpoint labelled DFlash2? re-export the DFlash2 drafter, or set "
                             "architectures to DFlashDraftModel if it is a DFlash one")
        return
    extra = sorted(k for k in have if is_dflash2_tensor(k))
    if extra:
        raise UsageError(f"{weights} holds DFlash2 tensors ({', '.join(extra[:4])}{' …' if len(extra) > 4 else ''}) "
                         f"but {config} declares a DFlash drafter",
                         hint="set architectures [\"DFlash2DraftModel\"] and the dflash_config keys conv_kernel_size, "
                         "conv_group_size, selector_rank, selector_top_k (or re-export)")


def reload_walk_check(source: Any, reloaded: Any, head: torch.Tensor | None) -> dict[str, Any]:
    """The export reload check's selector part: `walk_check` for a DFlash2 drafter (exact when the export is
    float32), nothing for DFlash. One place for both export formats."""
    if not source.contract.is_dflash2:
        return {}
    exact = next(v.dtype for v in reloaded.state_dict().values() if v.is_floating_point()) == torch.float32
    return walk_check(source, reloaded, head, exact=exact)


def walk_check(source: Any, reloaded: Any, head: torch.Tensor | None, *, exact: bool,
               blocks: int = 3, context: int = 6) -> dict[str, Any]:
    """Source vs reloaded DFlash2 drafter on a fixed input: unary logits and the greedy walk.

    `head` [V, H] is the target head (None: a fixed random one, so the selector is still exercised).
    With `exact` (a float32 export) the walks must be identical; otherwise their agreement is reported.
    """
    c = source.contract
    g = torch.Generator().manual_seed(0)
    q = c.block_size
    noise = torch.randn(blocks, q, c.hidden_size, generator=g)
    ctx = torch.randn(blocks, context, c.num_features * c.hidden_size, generator=g)
    pos = torch.arange(context + q)[None].expand(blocks, -1)
    anchors = torch.randint(0, c.vocab_size, (blocks,), generator=g)
    proj = (head if head is not None else torch.randn(c.vocab_size, c.hidden_size, generator=g)).float()
    with torch.inference_mode():
        paths = []
        for model in (source.float(), reloaded.float()):
            h = model(noise, ctx, pos)[:, 1:]                                  # [blocks, B-1, H]
            tokens, _, _ = model.draft(h, h @ proj.T, anchors)
            paths.append(tokens)
    same = (paths[0] == paths[1]).float().mean().item()
    if exact and same < 1.0:
        raise DflashkitError(f"export reload check failed: the reloaded DFlash2 drafter walks another path "
                             f"({same:.0%} of the drafted tokens agree) on the same input",
                             hint="nothing was replaced; this is a bug, please report it")
    return {"walk_agreement": same, "walk_tokens": int(paths[0].numel())}
