"""The drafter families: THE registry that the contract, the trainer, the decoder, the formats and the engines ask.

Usage:
    from dflashkit import family
    fam = family.get("dflash2")                       # UsageError naming drafter.type and the families
    fam = contract.family                             # the same lookup, by contract.drafter_type
    fam = family.by_architecture(cfg["architectures"])   # the family a drafter config.json declares
    family.names()                                    # ["dflash", "dflash2", "lilicorr", "dspark"]
    drafter = family.new_drafter(contract)            # a random drafter network of the contract's family
    family.load_plugins()                             # the plugin families, once (the CLI's first act)
    family.config_problems(cfg.drafter)               # the drafter.* checks the families own
    family.objective_problems(cfg.train, fam)         # train.* the family's loss terms cannot go with
    family.foreign_setting(fam, "drafter", "selector_rank", 8)   # another family's key set: the refusal
    cfg = load_config(path, overrides, checks=family.checks)   # all of them, listed with the config's own (the CLI)
    family.check_tensors(fam, set(state), set(want), weights=w, config=c)   # UsageError naming tensors
    family.reads_target_law(cfg.train, contract.family)   # does the loss read the target's logits?
    family.register(fam); family.extra_params(contract)   # a plugin family; parameters beyond DFlash's (`plan`)
    resolve_recipe(cfg.train, contract)               # the run's recipe facts, once (`family/recipe.py`)

A new head is `family/x.py` (its `Family`: `base.py`, `knobs.py`) + `model/x.py` + one entry in BUILTIN (+ its
class in the shipped `export/dflash_modeling.py`); the config schema, its checks and docs/config.md come from
the registry. Plugin families (entry-point group `dflashkit.families`, env DFLASHKIT_FAMILIES="module:ATTR,...")
are registered by one explicit call, `load_plugins()`, which the CLI makes first (a test registers its own with
`register`); their classes reach exports through `Formats.modeling_source`. The config loader asks the registry
at load time, so a family registered later is still read. No family module imports dflashkit.config, not even
for its types (`base.DrafterKeys` / `TrainKeys` declare what the checks read). Nothing
outside this package and the family's own network tests a drafter's type (tests/family/test_seam.py).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import os
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, Callable, cast

from dflashkit.errors import UsageError
from dflashkit.family.base import DrafterKeys, Family, RunKeys, TrainKeys, draft_vocab_problem, refuse_draft_vocab
from dflashkit.family.dflash import DFLASH
from dflashkit.family.dflash2 import DFLASH2
from dflashkit.family.dspark import DSPARK
from dflashkit.family.knobs import range_problems
from dflashkit.family.lilicorr import LILICORR

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from dflashkit.family.base import ContractSpec

__all__ = ["DEFAULT", "ENV", "ENTRY_POINTS", "FAMILIES", "Family", "by_architecture", "check_tensors", "checks",
           "config_problems", "draft_vocab_problem", "extra_params", "foreign_setting", "get", "knob_keys",
           "load_plugins", "names", "new_drafter", "objective_problems", "reads_target_law", "refuse_draft_vocab",
           "register", "reserve", "setting_fields", "weight_keys"]

BUILTIN = (DFLASH, DFLASH2, LILICORR, DSPARK)
FAMILIES: dict[str, Family] = {}
DEFAULT = DFLASH  # a z-lab config.json that names none of the architectures below is DFlash's (the format's base)
ENV = "DFLASHKIT_FAMILIES"           # "module:ATTR,...": families to register (plugins)
ENTRY_POINTS = "dflashkit.families"  # the entry-point group of installed plugin families


SECTIONS = {"knobs": "drafter", "weights": "train"}  # a family's part → the config section its fields join
RESERVED: dict[str, tuple[str, ...]] = {"knobs": (), "weights": ()}  # the common sections' keys (`reserve`)
PLUGINS: dict[str, str] = {}  # a plugin family's name → where it came from (its entry point or ENV entry)


def register(fam: Family) -> Family:
    """Add `fam` to the registry; UsageError (exit 2) when its name or architecture is taken, or when one of its
    knobs or weights would take over a key it does not share: a common `drafter.*` / `train.*` key (`reserve`)
    or another family's field of the same name. Families share a field only by extending the class that
    declares it (DFlash2's `causal` is DFlash's)."""
    for other in FAMILIES.values():
        if fam.name == other.name or fam.architecture == other.architecture:
            raise UsageError(f"drafter family {fam.name!r} ({fam.architecture}) clashes with the registered "
                             f"{other.name!r} ({other.architecture})",
                             hint="give the family its own name and architecture")
    clash = _collision(fam)
    if clash:
        raise clash
    FAMILIES[fam.name] = fam
    return fam


def _collision(fam: Family) -> UsageError | None:
    """The first knob or weight of `fam` whose key is a common section key or another registered family's
    field that `fam` does not inherit, as the UsageError naming the family, the key and what it collides with."""
    for part, section in SECTIONS.items():
        mine = {f.name: f for f in dataclasses.fields(getattr(fam, part))}
        for key, fl in mine.items():
            if key in RESERVED[part]:
                what = f"the built-in {section}.{key} that every family reads"
            else:
                owner = next((o for o in FAMILIES.values() if o is not fam and any(
                    g.name == key and g is not fl for g in dataclasses.fields(getattr(o, part)))), None)
                if owner is None:
                    continue
                what = f"the {owner.name!r} family's {part[:-1]} {section}.{key}"
            source = f" (from {PLUGINS[fam.name]})" if fam.name in PLUGINS else ""
            return UsageError(f"drafter family {fam.name!r}{source}: its {part[:-1]} {section}.{key} "
                              f"({getattr(fam, part).__name__}) collides with {what}; the family is not registered",
                              hint=f"rename the {part[:-1]} (e.g. {fam.name}_{key}), or extend the class that "
                              "declares the shared one")
    return None


def reserve(part: str, common: type) -> None:
    """Record the common section's keys (`config/schema.py`, when it is imported): a family registered before
    whose `part` reuses one is dropped from the registry and its UsageError kept as PLUGIN_ERROR (the config
    checks raise it, exit 2); `register` refuses such a family from then on."""
    global PLUGIN_ERROR
    RESERVED[part] = tuple(f.name for f in dataclasses.fields(common))
    for fam in list(FAMILIES.values()):
        clash = _collision(fam)
        if clash:
            del FAMILIES[fam.name]
            PLUGIN_ERROR = PLUGIN_ERROR or clash


def _load(spec: str, where: str) -> Any:
    """The object `module:ATTR` names; UsageError naming `where` when it cannot be imported."""
    module, _, attr = spec.strip().partition(":")
    try:
        obj: Any = importlib.import_module(module)
        for part in attr.split(".") if attr else ():
            obj = getattr(obj, part)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - any failure of a plugin's import is the user's to fix
        # sys.exit() at import too: it would end every command with no word (Ctrl-C still propagates)
        why = f"it called sys.exit({e.code!r})" if isinstance(e, SystemExit) else f"{type(e).__name__}: {e}"
        raise UsageError(f"{where}: cannot load the drafter family {spec!r}: {why}",
                         hint=f"fix or remove it ({where}); each entry is module:ATTR naming a Family") from None
    if not isinstance(obj, Family):
        raise UsageError(f"{where}: {spec!r} is a {type(obj).__name__}, not a dflashkit.family.Family",
                         hint=f"point {where} at the module-level Family object (module:ATTR)")
    return obj


def _plugins() -> UsageError | None:
    """Register the families of the entry-point group and of the environment variable, in that order; the first
    that fails is returned."""
    specs = [(ep.value, f"entry point {ep.name!r} of group {ENTRY_POINTS}") for ep in entry_points(group=ENTRY_POINTS)]
    specs += [(x.strip(), f"{ENV}={os.environ[ENV]}") for x in os.environ.get(ENV, "").split(",") if x.strip()]
    for spec, where in specs:
        try:
            fam = _load(spec, where)
            if FAMILIES.get(fam.name) is not fam:
                if fam.name not in FAMILIES:
                    PLUGINS[fam.name] = f"{spec!r} of {where}"
                register(fam)
        except UsageError as e:
            return e
    return None


for _fam in BUILTIN:
    register(_fam)
PLUGIN_ERROR: UsageError | None = None  # a plugin family that did not load: every config check raises it (exit 2)


def load_plugins() -> None:
    """Register the plugin families (entry-point group ENTRY_POINTS, then env ENV), once per process and
    again after the environment changed; the first that does not load is kept as PLUGIN_ERROR, which the
    config loader and `checks` raise (exit 2, naming the entry), so `--help` still answers. The CLI calls this
    before it reads a config."""
    global PLUGIN_ERROR
    PLUGIN_ERROR = _plugins() or PLUGIN_ERROR


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


def new_drafter(contract: ContractSpec, draft_vocab: torch.Tensor | None = None,
                feature_scale: torch.Tensor | None = None):
    """A new random drafter of the contract's family (checks the contract; a family without a reduced
    vocab refuses `draft_vocab`)."""
    return contract.family.network.build(contract, draft_vocab, feature_scale)


def extra_params(contract: ContractSpec) -> int:
    """The parameters of the contract's drafter beyond a DFlash drafter's of the same contract, counted on
    networks built on the meta device (no memory, no init)."""
    import torch

    def count(c: ContractSpec) -> int:
        with torch.device("meta"):
            return sum(p.numel() for p in c.family.network.build(c, None, None).parameters())

    if contract.family is DEFAULT:
        return 0
    kept = {f.name: getattr(contract.knobs, f.name) for f in dataclasses.fields(DEFAULT.knobs)
            if hasattr(contract.knobs, f.name)}  # DFlash's knobs as the family sets them: the same attention (MLA)
    # the same contract as DFlash's: a DrafterContract is a dataclass, which its Protocol cannot say
    base: ContractSpec = dataclasses.replace(cast(Any, contract), drafter_type=DEFAULT.name,
                                             knobs=DEFAULT.knobs(**kept), causal_layers=None)
    return count(contract) - count(base)


def by_architecture(architectures: object) -> Family:
    """The family a drafter `config.json` declares by its `architectures` (DEFAULT when none is known)."""
    archs = architectures if isinstance(architectures, list) else []
    return next((f for f in FAMILIES.values() if f.architecture in archs), DEFAULT)


def knob_keys() -> tuple[str, ...]:
    """Every family's knob names (the `drafter.*` keys that give a drafter its own contract), each once: a
    family whose knobs extend another's shares those (DFlash2's `causal` is DFlash's)."""
    return tuple(dict.fromkeys(k for f in FAMILIES.values() for k in f.knob_names))


def weight_keys() -> tuple[str, ...]:
    """Every family's `train.*` weight names, each once."""
    return tuple(dict.fromkeys(k for f in FAMILIES.values() for k in f.weight_names))


def config_problems(d: DrafterKeys) -> list[str]:
    """The `drafter.*` problems the families own: the family name, its knobs (`d.knobs`), a draft vocab it
    cannot take. Another family's knob set in the YAML is the loader's to refuse (`foreign_setting`)."""
    fam = FAMILIES.get(d.type)
    if fam is None:
        return [_unknown(d.type, "drafter.type")]
    knobs = fam.own_knobs(d.knobs)
    p = range_problems(knobs, prefix="drafter.")
    p += fam.config_problems(d, knobs) if not p else []
    vocab = draft_vocab_problem(fam, d.draft_vocab_size, where="drafter.draft_vocab_size")
    return p + ([vocab] if vocab else [])


def setting_fields(part: str) -> dict[str, tuple[Family, dataclasses.Field]]:
    """Every registered family's `part` ("knobs": the `drafter.*` keys; "weights": the `train.*` ones) by key, in
    registry order, each key once with the first family that declares it (DFlash2's `causal` is DFlash's): the
    flat keys the YAML and the command line write, and the order the config dump lists them in."""
    out: dict[str, tuple[Family, dataclasses.Field]] = {}
    for fam in FAMILIES.values():
        for fl in dataclasses.fields(getattr(fam, part)):
            out.setdefault(fl.name, (fam, fl))
    return out


def foreign_setting(fam: Family, section: str, key: str, value: Any) -> str | None:
    """The problem of `<section>.<key>` (a knob or weight of other families, not of `fam`) set to `value`,
    naming the families that read it; None when `value` is its default (a dump of another run lists every
    family's keys at their defaults) or when `fam` reads the key."""
    part = "knobs" if section == "drafter" else "weights"
    reads: Callable[[Family], tuple[str, ...]] = (lambda f: f.knob_names) if part == "knobs" else (
        lambda f: f.weight_names)
    owners = [f for f in FAMILIES.values() if key in reads(f)]
    if key in reads(fam) or not owners or value == setting_fields(part)[key][1].default:
        return None
    return (f"{section}.{key}: {value!r} is a knob of {' and '.join(f.title for f in owners)}, which "
            f"drafter.type={fam.name} does not read; set drafter.type={owners[0].name} or remove the key")


def objective_problems(train: TrainKeys, fam: Family) -> list[str]:
    """What in `train.*` the family's loss terms cannot go with, each naming its key: a term that reads the
    target's logits (LiLiCorr's penalty) under train.on_path=rollout, whose labels are the target's path while
    those logits follow the raw tokens (the same reason rollout refuses KL). The config checks (`checks`) and
    `train`'s own (`train/guards.py`, with the contract's family) both ask this."""
    terms = [t.name for t in fam.terms(train.weights) if t.needs_target]
    if train.on_path != "rollout" or not terms:
        return []
    return [f"train.on_path: rollout gives labels on the target's path, but with drafter.type={fam.name} the "
            f"{fam.title} loss term {terms[0]!r} reads the target's logits after the raw tokens; use "
            f"train.on_path=mask, or give the {fam.title} term that reads them weight 0 (docs/config.md)"]


def reads_target_law(train: TrainKeys, fam: Family) -> bool:
    """Whether this run's loss reads the target's next-token logits at the block rows: KL (`train.loss` kl |
    ce+kl), or a term of the family's that asks for them (LiLiCorr's penalty). The trainer then supplies
    them: online from the target, cached from the shards' `last_hidden` (capture.last_hidden auto keeps it)."""
    return train.loss != "ce" or any(t.needs_target for t in fam.terms(train.weights))


def checks(cfg: RunKeys) -> list[str]:
    """The family-owned checks of a whole run config (`config_problems`, `train.pack`, `objective_problems`):
    what the CLI hands the config loader (`load_config(checks=…)`), so `--dry-run` and
    the first stage of `dflashkit run` refuse what `train` would. A plugin family that did not load is raised
    here (UsageError naming the entry point or DFLASHKIT_FAMILIES)."""
    if PLUGIN_ERROR is not None:
        raise PLUGIN_ERROR
    fam = FAMILIES.get(cfg.drafter.type)
    p = config_problems(cfg.drafter)
    if fam is None:
        return p
    if cfg.train.pack and not fam.objective.packs:
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
            keys = ", ".join(other.formats.speculators_keys or other.knob_names)
            raise UsageError(f"{weights} holds {other.title} tensors ({', '.join(extra[:4])}"
                             f"{' …' if len(extra) > 4 else ''}) but {config} declares a {fam.title} drafter",
                             hint=f"set architectures [\"{other.architecture}\"]"
                             + (f" and the dflash_config keys {keys}" if keys else "") + " (or re-export)")
