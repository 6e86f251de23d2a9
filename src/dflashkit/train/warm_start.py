"""Warm start (`drafter.init: <dir>`): initialise the drafter from a drafter you already have.

Usage:
    src = read_warm_start("runs/old/export")                  # z-lab, speculators or dflashkit dir
    problems = contract_mismatch(src.contract, contract)      # [] when the weights fit this run
    check_fits(src, contract)                                 # UsageError (exit 2) naming each mismatch
    check_draft_vocab_fits(src, contract, 64)                 # ... or a V' its weights cannot change to
    report = warm_start(drafter, src, contract)               # copies every tensor (checks again)

The drafter family must be the run's, or one the run's family documents a conversion from
(`Network.init_from`: DFlash2 starts from a DFlash checkpoint's shared tensors, its convolutions the
identity and its selector random); any other pair is exit 2 naming both families — a DFlash2 dir in
a DFlash run would otherwise lose its convolutions and selector without a word.

The source dir is read by the export readers (`export.speculators.load_any_drafter`: z-lab
`config.json` + `dflash_config`, or vLLM's speculators format; `train/final`, `train/best`, an
`export/` or an `import`ed dir are all z-lab). What must match the run's contract, each named when
it does not: the target's hidden size and vocab, the target layer ids (the features the weights
were trained on), the mask token id, and the draft architecture (layers, heads, KV heads, head
dim, intermediate size) so that every tensor has its shape. The block size may differ: the draft
weights do not depend on it (the block only sets how many masked positions follow the anchor).

A reduced draft vocabulary (`d2t`): kept when `drafter.draft_vocab_size` equals the source's V'
(the trainer then skips choosing one from the data), else rebuilt from this run's data (or the
full vocab) — the vocab is a buffer over the target head's rows, not a learned weight. A family with
weights of a row per draft-vocab entry (DSpark's `markov_head.markov_w2` [V', r]) cannot change V':
`check_draft_vocab_fits` refuses that before any work, exit 2, naming both vocabularies.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from dflashkit.errors import UsageError
from dflashkit.export.speculators import load_any_drafter
from dflashkit.family.contract import DrafterContract

log = logging.getLogger("dflashkit.train")

# contract fields the weights depend on, with what each means for the user
MUST_MATCH = (("hidden_size", "target hidden size"), ("vocab_size", "target vocab"),
              ("target_layer_ids", "target layer ids"), ("mask_token_id", "mask token id"),
              ("num_draft_layers", "draft layers"), ("num_attention_heads", "attention heads"),
              ("num_key_value_heads", "KV heads"), ("head_dim", "head dim"),
              ("intermediate_size", "intermediate size"))


@dataclass
class WarmSource:
    """A drafter read from a dir: its weights (float32), its contract, its format, its draft vocab."""

    path: Path
    state: dict[str, torch.Tensor]
    contract: DrafterContract
    format: str                      # "zlab" | "speculators"
    vocab: torch.Tensor | None       # sorted target ids of a reduced draft vocab, or None


def read_warm_start(path: str | Path) -> WarmSource:
    """Read a drafter dir of either format (checked by the export readers; UsageError naming the file)."""
    d = Path(path).expanduser()
    if not d.is_dir():
        raise UsageError(f"drafter.init: {d} is not a directory (nor `random` / `target`)",
                         hint="point drafter.init at a drafter dir (config.json + model.safetensors: train/final, "
                         "an export, an imported or a published DFlash drafter), or use random | target")
    model, fmt = load_any_drafter(d, dtype=torch.float32)
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if k != "d2t"}
    return WarmSource(d, state, model.contract, fmt, model.draft_vocab)


def contract_mismatch(src: DrafterContract, run: DrafterContract) -> list[str]:
    """Every field of MUST_MATCH that differs, as `name: source X != this run's Y` (empty: it fits)."""
    out = []
    mla = src.attention["attention_type"] == run.attention["attention_type"] == "mla"
    for name, what in MUST_MATCH:
        a, b = getattr(src, name), getattr(run, name)
        if name == "vocab_size" and not a:  # a z-lab config may omit it: the tensors' shapes still decide
            continue
        if mla and name in ("num_key_value_heads", "head_dim"):  # no MLA tensor has these shapes (its ranks do)
            continue
        if (list(a) if isinstance(a, (list, tuple)) else a) != (list(b) if isinstance(b, (list, tuple)) else b):
            out.append(f"{name} ({what}): the drafter's {a} != this run's {b}")
    mine, theirs = src.attention, run.attention  # MLA vs GQA and MLA's ranks shape the tensors
    if mine != theirs:
        out.append(f"drafter attention: the drafter's {mine} != this run's {theirs}")
    return out


def keep_source_vocab(src: WarmSource, draft_vocab_size: int | None) -> torch.Tensor | None:
    """The source's draft vocab when `drafter.draft_vocab_size` asks for exactly its size, else None."""
    if src.vocab is not None and draft_vocab_size and int(draft_vocab_size) == int(src.vocab.numel()):
        return src.vocab
    return None


def run_draft_vocab(run: DrafterContract, draft_vocab_size: int | None) -> int | None:
    """The size of the reduced draft vocab this run builds (`drafter.draft_vocab_size` below the target vocab, for a
    family that drafts over one), else None (the full vocab)."""
    n = int(draft_vocab_size or 0)
    return n if 0 < n < run.vocab_size and run.family.network.reduced_vocab else None


def check_draft_vocab_fits(src: WarmSource, run: DrafterContract, draft_vocab_size: int | None) -> None:
    """UsageError (exit 2) when this run's draft vocabulary would change the shape of a tensor the source holds:
    a weight with a row per draft-vocab entry (DSpark's `markov_head.markov_w2` [V', r]) cannot be carried to
    another V'. Both sizes and each such tensor are named. A source whose weights do not depend on V' (DFlash: the
    vocab is a buffer over the target head's rows) passes, its vocab rebuilt. The shapes are those of a drafter of
    the run's contract built on the meta device, so no family is named here."""
    if keep_source_vocab(src, draft_vocab_size) is not None:
        return
    from dflashkit.family import new_drafter

    n = run_draft_vocab(run, draft_vocab_size)
    with torch.device("meta"):
        net = new_drafter(run, None if n is None else torch.arange(n, device="cpu"))
    wrong = _shapes_differ(src.state, net.state_dict())
    if not wrong:
        return
    theirs = "the full vocab" if src.vocab is None else f"{int(src.vocab.numel())} tokens"
    size = draft_vocab_size or "null"
    mine = f"{n} tokens" if n is not None else f"the full vocab (drafter.draft_vocab_size {size})"
    keep = int(src.vocab.numel()) if src.vocab is not None else "null"
    raise UsageError(f"drafter.init {src.path}: the drafter's draft vocabulary ({theirs}) != this run's ({mine}), "
                     f"and its weights have a row per draft-vocab entry: " + "; ".join(wrong),
                     hint=f"set drafter.draft_vocab_size={keep} to keep the drafter's vocabulary")


def _shapes_differ(source: dict[str, torch.Tensor], own: dict[str, torch.Tensor]) -> list[str]:
    """`name: the drafter's [shape] != this run's [shape]` for each tensor of both with another shape."""
    return [f"{k}: the drafter's {list(v.shape)} != this run's {list(own[k].shape)}" for k, v in source.items()
            if k in own and tuple(own[k].shape) != tuple(v.shape)]


def family_mismatch(src: DrafterContract, run: DrafterContract) -> str | None:
    """Why a drafter of `src`'s family cannot start this run's (None: the same family, or a conversion the
    run's family allows)."""
    if src.drafter_type == run.drafter_type or src.drafter_type in run.family.network.init_from:
        return None
    allowed = sorted(run.family.network.init_from)
    return (f"a {src.family.title} drafter (drafter_type {src.drafter_type}) cannot start this run's "
            f"{run.family.title} drafter (drafter_type {run.drafter_type}): a {run.family.title} drafter starts from "
            f"{' or '.join([run.drafter_type, *allowed])} checkpoints only")


def check_fits(src: WarmSource, run: DrafterContract) -> None:
    """UsageError (exit 2) naming the two drafter families, or every contract field where `src` does not fit."""
    wrong = family_mismatch(src.contract, run)
    if wrong:
        raise UsageError(f"drafter.init {src.path}: {wrong}",
                         hint=f"set drafter.type={src.contract.drafter_type} (and re-run `dflashkit probe`) to train "
                         f"that family, or point drafter.init at a {run.family.title} drafter")
    problems = contract_mismatch(src.contract, run)
    if problems:
        raise UsageError(f"drafter.init {src.path} does not fit this run's drafter contract: " + "; ".join(problems),
                         hint="warm-start from a drafter trained for this target and these drafter.* settings "
                         "(the block size may differ), or set the drafter.* keys to the drafter's (its config.json)")


@torch.no_grad()
def warm_start(drafter: torch.nn.Module, src: WarmSource, run: DrafterContract) -> dict:
    """Copy `src`'s tensors into `drafter` (every draft tensor; the d2t buffer stays the drafter's own).

    Raises:
        UsageError: the source does not fit this run's contract (every mismatch named), exit 2.
    """
    check_fits(src, run)
    if src.contract.drafter_type != run.drafter_type:  # a conversion the run's family documents
        return _converted(drafter, src, run)
    own = drafter.state_dict()
    missing = sorted(k for k in own if k != "d2t" and k not in src.state)
    if missing:
        raise UsageError(f"drafter.init {src.path}: no tensors {missing[:5]} for this drafter",
                         hint="the dir is not a DFlash drafter of this architecture")
    wrong = _shapes_differ(src.state, own)
    if wrong:  # `check_draft_vocab_fits` refuses these before any work; a caller that skipped it gets exit 2 here
        raise UsageError(f"drafter.init {src.path}: tensors of another shape than this run's drafter: "
                         + "; ".join(wrong), hint="set drafter.draft_vocab_size to the drafter's V' (its d2t), or "
                                                  "warm-start from a drafter of this run's shape")
    for k, v in src.state.items():
        if k in own:
            own[k].copy_(v.to(own[k].dtype))
    same_vocab = (src.vocab is None and getattr(drafter, "draft_vocab", None) is None) or (
        src.vocab is not None and getattr(drafter, "draft_vocab", None) is not None
        and torch.equal(src.vocab.cpu(), drafter.draft_vocab.cpu()))
    vocab = "kept" if same_vocab else "rebuilt"
    log.info("warm start from %s (%s format, block size %d → %d): %d tensors copied, draft vocab %s",
             src.path, src.format, src.contract.block_size, run.block_size, len(src.state), vocab)
    return {"dir": str(src.path), "format": src.format, "tensors": len(src.state),
            "block_size": {"source": src.contract.block_size, "run": run.block_size}, "draft_vocab": vocab}


def _converted(drafter: torch.nn.Module, src: WarmSource, run: DrafterContract) -> dict:
    """`drafter.init` from another family's checkpoint, by the run's family's conversion."""
    report = run.family.network.init_from[src.contract.drafter_type](getattr(drafter, "module", drafter), src.state)
    log.info("warm start from %s (%s format, a %s drafter converted to %s, block size %d → %d): %d tensors copied, "
             "%d skipped", src.path, src.format, src.contract.family.title, run.family.title, src.contract.block_size,
             run.block_size, len(report["copied"]), len(report["skipped"]))
    return {"dir": str(src.path), "format": src.format, "tensors": len(report["copied"]),
            "block_size": {"source": src.contract.block_size, "run": run.block_size},
            "converted": {"from": src.contract.drafter_type, "to": run.drafter_type,
                          "skipped": len(report["skipped"])}, "draft_vocab": "full"}
