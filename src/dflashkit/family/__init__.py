"""The drafter families: THE registry that the contract, the trainer, the decoder, the formats and the engines ask.

Usage:
    from dflashkit import family
    fam = family.get("dflash2")                       # UsageError naming drafter.type and the families
    fam = contract.family                             # the same lookup, by contract.drafter_type
    fam = family.by_architecture(cfg["architectures"])   # the family a drafter config.json declares
    family.names()                                    # ["dflash", "dflash2", "lilicorr"]
    drafter = family.new_drafter(contract)            # a random drafter network of the contract's family
    family.config_problems(cfg.drafter)               # the drafter.* checks the families own
    family.objective_problems(cfg.train, fam)         # train.* the family's loss terms cannot go with
    cfg = load_config(path, overrides, checks=family.checks)   # all of them, listed with the config's own (the CLI)
    family.check_tensors(fam, set(state), set(want), weights=w, config=c)   # UsageError naming tensors
    family.reads_target_law(cfg.train, contract.family)   # does the loss read the target's logits?

Adding a head is one module in this package (its `Family`: facts and hooks, `base.py` says which)
plus its tests, and its entry in FAMILIES; its `drafter.*` knobs are also fields of
`config/schema.py`'s DrafterSection (the schema is what users read; tests/family check that the two
agree). Nothing outside this package and the family's own network tests a drafter's type
(tests/family/test_seam.py scans for it).
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Callable

from dflashkit.errors import UsageError
from dflashkit.family.base import Family, draft_vocab_problem, refuse_draft_vocab
from dflashkit.family.dflash import DFLASH
from dflashkit.family.dflash2 import DFLASH2
from dflashkit.family.lilicorr import LILICORR

if TYPE_CHECKING:
    from dflashkit.family.contract import DrafterContract
    from pathlib import Path

    import torch

    from dflashkit.config import DrafterSection, RunConfig, TrainSection

__all__ = ["DEFAULT", "FAMILIES", "Family", "by_architecture", "check_tensors", "checks", "config_problems",
           "draft_vocab_problem", "get", "knob_keys", "names", "new_drafter", "objective_problems", "reads_target_law",
           "refuse_draft_vocab"]

FAMILIES: dict[str, Family] = {f.name: f for f in (DFLASH, DFLASH2, LILICORR)}
DEFAULT = DFLASH  # a z-lab config.json that names none of the architectures below is DFlash's (the format's base)


def names() -> list[str]:
    return list(FAMILIES)


def _unknown(name: object, key: str) -> str:
    close = difflib.get_close_matches(str(name), names(), n=1)
    return f"{key}: {name!r} is not a drafter family, one of {names()}" + (f" (did you mean {close[0]!r}?)"
                                                                             if close else "")


def get(name: str, *, key: str = "drafter.type") -> Family:
    """The family called `name`; UsageError (exit 2) naming `key` and the known families otherwise."""
    fam = FAMILIES.get(name)
    if fam is None:
        raise UsageError(_unknown(name, key), hint=f"set {key} to one of {names()}")
    return fam


def new_drafter(contract: DrafterContract, draft_vocab: torch.Tensor | None = None,
                feature_scale: torch.Tensor | None = None):
    """A new random drafter of the contract's family (checks the contract; a family without a reduced
    vocab refuses `draft_vocab`)."""
    return contract.family.build(contract, draft_vocab, feature_scale)


def by_architecture(architectures: object) -> Family:
    """The family a drafter `config.json` declares by its `architectures` (DEFAULT when none is known)."""
    archs = architectures if isinstance(architectures, list) else []
    return next((f for f in FAMILIES.values() if f.architecture in archs), DEFAULT)


def knob_keys() -> tuple[str, ...]:
    """Every family's knob names (the `drafter.*` keys that give a drafter its own contract), each once: a
    family whose knobs extend another's shares those (DFlash2's `causal` is DFlash's)."""
    return tuple(dict.fromkeys(k for f in FAMILIES.values() for k in f.knob_names))


def config_problems(d: DrafterSection) -> list[str]:
    """The `drafter.*` problems the families own: the family name, its knobs, another family's knobs it would
    not read, a draft vocab it cannot take."""
    from dflashkit.config import DrafterSection

    fam = FAMILIES.get(d.type)
    if fam is None:
        return [_unknown(d.type, "drafter.type")]
    p = fam.config_problems(d)
    p += _unread(fam, "drafter", d, DrafterSection(), knob_keys(), lambda f: f.knob_names)
    vocab = draft_vocab_problem(fam, d.draft_vocab_size, where="drafter.draft_vocab_size")
    return p + ([vocab] if vocab else [])


def _unread(fam: Family, section: str, values: object, defaults: object, keys: tuple[str, ...],
            reads: Callable[[Family], tuple[str, ...]]) -> list[str]:
    """A problem for each `<section>.<key>` of `keys` that the family `fam` does not read (`reads`) but the config
    sets, naming the families that do. "Sets" is a value other than the schema's default: the loader records
    which keys were written only after its checks have run."""
    out = []
    for key in keys:
        value = getattr(values, key)
        if key in reads(fam) or value == getattr(defaults, key):
            continue
        owners = [f for f in FAMILIES.values() if key in reads(f)]
        out.append(f"{section}.{key}: {value!r} is a knob of {' and '.join(f.title for f in owners)}, which "
                   f"drafter.type={fam.name} does not read; set drafter.type={owners[0].name} or remove the key")
    return out


def objective_problems(train: TrainSection, fam: Family) -> list[str]:
    """What in `train.*` the family's loss terms cannot go with, each naming its key: a term that reads the
    target's logits (LiLiCorr's penalty) under train.on_path=rollout, whose labels are the target's path while
    those logits follow the raw tokens (the same reason rollout refuses KL). The config checks (`checks`) and
    `train`'s own (`train/guards.py`, with the contract's family) both ask this."""
    terms = [t.name for t in fam.loss_terms(train) if t.needs_target]
    if train.on_path != "rollout" or not terms:
        return []
    return [f"train.on_path: rollout gives labels on the target's path, but with drafter.type={fam.name} the "
            f"{fam.title} loss term {terms[0]!r} reads the target's logits after the raw tokens; use "
            f"train.on_path=mask, or give the {fam.title} term that reads them weight 0 (docs/config.md)"]


def reads_target_law(train: TrainSection, fam: Family) -> bool:
    """Whether this run's loss reads the target's next-token logits at the block rows: KL (`train.loss` kl |
    ce+kl), or a term of the family's that asks for them (LiLiCorr's penalty). The trainer then supplies
    them: online from the target, cached from the shards' `last_hidden` (capture.last_hidden auto keeps it)."""
    return train.loss != "ce" or any(t.needs_target for t in fam.loss_terms(train))


def checks(cfg: RunConfig) -> list[str]:
    """The family-owned checks of a whole run config (`config_problems`, another family's `train.*` knobs,
    `objective_problems`): what the CLI hands the config loader (`load_config(checks=…)`), so `--dry-run` and
    the first stage of `dflashkit run` refuse what `train` would."""
    from dflashkit.config import TrainSection

    fam = FAMILIES.get(cfg.drafter.type)
    p = config_problems(cfg.drafter)
    if fam is None:
        return p
    train_keys = tuple(dict.fromkeys(k for f in FAMILIES.values() for k in f.train_knobs))
    p += _unread(fam, "train", cfg.train, TrainSection(), train_keys, lambda f: f.train_knobs)
    if cfg.train.pack and not fam.packs:
        p.append(f"train.pack: the {fam.title} loss does not take packed rows (drafter.type={fam.name}); drop "
                 "train.pack")
    return p + objective_problems(cfg.train, fam)


def check_tensors(fam: Family, have: set[str], want: set[str], *, weights: Path, config: Path) -> None:
    """UsageError naming the family's own tensors a checkpoint lacks, or another family's tensors it holds."""
    missing = sorted(k for k in want - have if fam.owns_tensor(k))
    if missing:
        shown = ", ".join(missing[:12]) + (f" … ({len(missing)} in all)" if len(missing) > 12 else "")
        raise UsageError(f"{weights}: {config} declares a {fam.architecture} but the weights lack its "
                         f"{fam.title} tensors: {shown}",
                         hint=f"a checkpoint of another family labelled {fam.architecture}? re-export the "
                         f"{fam.title} drafter, or set architectures to the family its weights are")
    for other in FAMILIES.values():
        extra = sorted(k for k in have - want if other is not fam and other.owns_tensor(k))
        if extra:
            keys = ", ".join(other.speculators_keys or other.knob_names)
            raise UsageError(f"{weights} holds {other.title} tensors ({', '.join(extra[:4])}"
                             f"{' …' if len(extra) > 4 else ''}) but {config} declares a {fam.title} drafter",
                             hint=f"set architectures [\"{other.architecture}\"]"
                             + (f" and the dflash_config keys {keys}" if keys else "") + " (or re-export)")
