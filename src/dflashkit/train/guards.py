"""Pre-flight checks of `train`: refuse, before a weight is touched, what would be silently ignored or lost.

Usage (`train/loop.py` `preflight` makes these checks in order, once, and returns a `TrainInputs`;
`t`: cfg.train, `seed`: cfg.run.seed):
    check_outputs_ours(rd, cfg.drafter.init)            # train/final, train/best: ours, not imported
    check_drafter_overrides(cfg.drafter, given_keys(cfg), contract, rd.contract_path)  # drafter.* vs contract.json
    check_family_objective(t, contract)                 # the contract's family's terms go with train.*
    check_cached_features(rd, contract, shards, recipe)   # recipe: resolve_recipe(t, contract), once
    state["objective"] = objective(t)                   # recorded in every checkpoint
    check_objective(checkpoint_dir, state, t)           # a resume under another loss/labels: exit 2
    state["trajectory"] = trajectory(t, seed, rd)       # the data and the other train.* a step depends on
    check_trajectory(checkpoint_dir, state, t, seed, rd)  # a resume on other data / lr / seed …: exit 2
    resume_changes(state, t, seed, rd)                  # why `dflashkit run` starts train over

Each check takes the settings it reads (a section, run.seed, the keys the user gave), never the whole config.
The contract (`contract.json`, written by `probe` or `import`) decides the drafter's shape; a
`drafter.*` value given in the config that differs from it is an error naming each key, never
silently dropped. A `train/final/` written by `dflashkit import` carries `imported.json`; training
would replace it with a drafter trained from other weights, so `train` refuses unless
`drafter.init` names that directory (a warm start from it).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflashkit import family
from dflashkit.config import DrafterSection, config_to_dict
from dflashkit.errors import ConfigError, UsageError
from dflashkit.family import objective_problems
from dflashkit.family.contract import DrafterContract, sliding_fields
from dflashkit.family.recipe import Recipe
from dflashkit.rundir import check_replaceable
from dflashkit.train.data import cached_store
from dflashkit.train.warm_start import WarmSource

if TYPE_CHECKING:
    from dflashkit.config import TrainSection
    from dflashkit.family.contract import DrafterContract
    from dflashkit.rundir import RunDir

IMPORTED = "imported.json"  # written by `dflashkit import` into the drafter dir it creates
_COMMON = frozenset(f.name for f in dataclasses.fields(DrafterSection))  # the drafter.* keys every family shares

# drafter.* key -> (contract field, how the contract's value reads for that key)
_SHAPE_KEYS = ("block_size", "num_draft_layers", "target_layer_ids", "mask_token_id", "hidden_size",
               "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "rms_norm_eps")
# the train.* keys of the loss a checkpoint records: the shared ones, then every family's weights (`objective_keys`)
OBJECTIVE_KEYS = ("loss", "labels", "position_weighting", "ablate_features", "kl_temperature", "suffix_complement")


def objective_keys() -> tuple[str, ...]:
    """`OBJECTIVE_KEYS` and every registered family's `train.*` weights (plugins included)."""
    return (*OBJECTIVE_KEYS, *family.weight_keys())


def _given(given: frozenset[str] | None, key: str, value: Any, default: Any = None) -> bool:
    """Whether the user gave `drafter.<key>`: named in the YAML/overrides (`given`: `config.given_keys`), or
    (configs built in code: `given` None) a value other than the schema default (`default` for a family's knob;
    null is never given)."""
    if value is None:
        return False
    if given is not None and f"drafter.{key}" in given:
        return True
    return value != (default if key not in _COMMON else getattr(DrafterSection(), key))


def check_drafter_overrides(d: DrafterSection, given: frozenset[str] | None, contract: DrafterContract,
                            where: str | Path) -> None:
    """Exit 2 naming every `drafter.*` value (`d`) given in the config (`given`: `config.given_keys` of it)
    that the contract does not have."""
    problems = []
    for key in _SHAPE_KEYS:
        mine, theirs = getattr(d, key), getattr(contract, key)
        if _given(given, key, mine) and (float(mine) != float(theirs) if key == "rms_norm_eps" else mine != theirs):
            problems.append(f"drafter.{key}: {mine!r} in the config, {theirs!r} in {where}")
    if _given(given, "layer_types", d.layer_types) or _given(given, "sliding_window", d.sliding_window):
        mine_sw, theirs_sw = sliding_fields(d.layer_types, d.sliding_window, contract.num_draft_layers), \
            {"layer_types": contract.layer_types, "sliding_window": contract.sliding_window}
        if mine_sw != theirs_sw:
            problems.append(f"drafter.layer_types / drafter.sliding_window: {mine_sw} in the config, {theirs_sw} in "
                            f"{where}")
    if _given(given, "type", d.type) and d.type != contract.drafter_type:
        problems.append(f"drafter.type: {d.type!r} in the config, {contract.drafter_type!r} in {where}")
    fam = contract.family
    knobs, defaults = fam.own_knobs(d.knobs), fam.knobs()
    for key in fam.knob_names:  # the contract's family's knobs (another family's mean nothing here)
        mine, theirs = getattr(knobs, key), getattr(contract.knobs, key)
        if _given(given, key, mine, getattr(defaults, key)) and mine != theirs:
            problems.append(f"drafter.{key}: {mine!r} in the config, {theirs!r} in {where}")
    n = d.num_target_features
    if n is not None and n != len(contract.target_layer_ids):
        problems.append(f"drafter.num_target_features: {n} in the config, {len(contract.target_layer_ids)} "
                        f"(target_layer_ids {contract.target_layer_ids}) in {where}")
    if problems:
        raise ConfigError(problems, hint="the contract decides the drafter's shape and these values would be "
                          "ignored: re-run `dflashkit probe -c run.yaml` so the contract takes them (then train from "
                          "scratch: move train/ away), or drop these drafter.* keys to train the contract's drafter")


def imported_record(drafter_dir: Path) -> dict | None:
    """The `imported.json` of a drafter dir `dflashkit import` wrote, or None."""
    try:
        rec = json.loads((Path(drafter_dir) / IMPORTED).read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else {}


def init_dir(init: str) -> Path | None:
    """The drafter dir `drafter.init` (`init`) names, or None for random / target."""
    if not isinstance(init, str) or init in ("random", "target", ""):
        return None
    return Path(init).expanduser()


@dataclass(frozen=True)
class TrainInputs:
    """What `train.loop.preflight` read and checked, and `train.loop.setup` builds from (nothing read or
    checked twice): the contract, the run's recipe (`resolve_recipe`, resolved once), the warm start of a
    drafter.init dir (None for random / target), the tokenized shards and the latest checkpoint of this run
    (None: from scratch) with its state.json, already checked to belong to this run (objective, trajectory,
    contract)."""
    contract: DrafterContract
    recipe: Recipe
    warm: WarmSource | None
    shards: tuple[Path, ...]
    resume: Path | None = None
    resume_state: dict | None = None


def check_family_objective(train: TrainSection, contract: DrafterContract) -> None:
    """Exit 2 when the contract's family's loss terms cannot go with `train.*` (`family.objective_problems`,
    which the config checks ask of `drafter.type`'s family when the config loads; here the contract decides
    the family, as it does when the config leaves drafter.type unset)."""
    problems = objective_problems(train, contract.family)
    if problems:
        raise ConfigError(problems)  # each problem says what to do


def check_cached_features(rd: RunDir, contract: DrafterContract, shards: list[Path], recipe: Recipe) -> None:
    """train.features=cached: the feature shards of `rd` exist and hold the contract's layers (and next_ids for
    train.labels=target, every sample's greedy path for train.on_path=rollout), as training opens them
    (`FeatureStore`; exit 3 / exit 2 naming the shard). `recipe`: `resolve_recipe(cfg.train, contract)`."""
    if recipe.cached:
        cached_store(rd.capture_dir, shards, contract.target_layer_ids, recipe)


def check_outputs_ours(rd: RunDir, init: str) -> None:
    """Before training: `train/final` and `train/best` are absent or train's own (else exit 2 naming them);
    an imported `train/final` is only replaced when `drafter.init` (`init`) starts from it."""
    final = rd.final_dir
    rec = imported_record(final) if final.is_dir() else None
    if rec is not None:
        start = init_dir(init)
        if start is None or not start.exists() or start.resolve() != final.resolve():
            src = rec.get("source", "a drafter dir")
            raise UsageError(f"{final} holds the drafter `dflashkit import` adopted from {src}; `train` would "
                             f"start from {init} weights and replace it",
                             hint=f"to fine-tune the imported drafter set `drafter.init: {final.resolve()}` (train "
                             f"then starts from it); to train a new drafter move {final} away first")
    check_replaceable(final, owner="train", marker="model.safetensors")
    check_replaceable(rd.best_dir, owner="train", marker="model.safetensors")


def objective(train: TrainSection) -> dict[str, Any]:
    """The keys of `train.*` that define what a checkpoint was trained to do."""
    flat = config_to_dict(train)   # a family's weights as the flat keys they are written as
    return {k: flat[k] for k in objective_keys()}


# train.* keys besides the objective that change what a step computes (so a checkpoint trained under other
# values is another run, not this one interrupted). Not here: the step count (max_steps, epochs: resuming with
# more steps continues the run), how often it logs / evaluates / saves, features (online ≡ cached ≡ engine),
# numerics-only knobs (loss_chunk_blocks, compile) and where it logs.
TRAJECTORY_KEYS = ("batch_size", "grad_accum", "lr", "optimizer", "muon_momentum", "min_lr_ratio", "warmup_ratio",
                   "weight_decay", "betas", "grad_clip", "num_anchors", "anchor_coverage", "gamma", "kl_weight",
                   "dpace_alpha", "feature_noise", "dtype", "heldout_samples", "train_samples", "heldout_sources",
                   "on_path", "suffix_complement_weight", "suffix_complement_min_match")


def trajectory(train: TrainSection, seed: int, rd: RunDir) -> dict[str, Any]:
    """What, besides the objective, a checkpoint's steps depended on: the tokenized data (tokenize's
    fingerprint and its inputs' digests, so other prompts, a rescaled demo or a re-prepared source are
    other data), run.seed (`seed`) and the `TRAJECTORY_KEYS` of `train`."""
    tok = rd.manifest("tokenize") or {}
    inputs = {k: v.get("digest") if isinstance(v, dict) else v for k, v in (tok.get("inputs") or {}).items()}
    data = {"tokenize": tok.get("config_hash"), "inputs": inputs} if tok else None
    return {"data": data, "run.seed": seed,
            **{f"train.{k}": _plain(getattr(train, k)) for k in TRAJECTORY_KEYS}}


def _plain(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def trajectory_changes(state: dict, train: TrainSection, seed: int, rd: RunDir) -> list[str]:
    """`key: then → now` for each recorded trajectory value that differs now (none for old checkpoints)."""
    saved = state.get("trajectory")
    if not isinstance(saved, dict):
        return []  # checkpoints written before the trajectory was recorded
    now = json.loads(json.dumps(trajectory(train, seed, rd)))  # as state.json stores it
    return [("the tokenized data (tokenize re-ran on other prompts or settings)" if k == "data" else
             f"{k}: {saved[k]!r} in the checkpoint, now {now.get(k)!r}")
            for k in saved if k in now and saved[k] != now[k]]


def check_trajectory(path: Path, state: dict, train: TrainSection, seed: int, rd: RunDir) -> None:
    """A resume on other data, seed or optimisation settings than the checkpoint's: exit 2."""
    changed = trajectory_changes(state, train, seed, rd)
    if changed:
        ck = Path(path)
        raise UsageError(f"{ck / 'state.json'}: this run is not the one the checkpoint belongs to "
                         f"({'; '.join(changed)}); resuming would continue another run's drafter",
                         hint=f"restore the checkpoint's settings and data to resume, or move {ck.parent.parent} away "
                         "to train from scratch (`dflashkit run` starts train over by itself when they changed)")


def resume_changes(state: dict, train: TrainSection, seed: int, rd: RunDir) -> list[str]:
    """Why a checkpoint (its state.json) is not this run's: its objective and trajectory changes."""
    return objective_changes(state, train) + trajectory_changes(state, train, seed, rd)


def objective_changes(state: dict, train: TrainSection) -> list[str]:
    """`train.key: then → now` for each recorded objective value that differs now (none for old checkpoints)."""
    saved = state.get("objective")
    if not isinstance(saved, dict):
        return []  # checkpoints written before the objective was recorded
    now = objective(train)
    return [f"train.{k}: {saved[k]!r} in the checkpoint, now {now[k]!r}" for k in objective_keys()
            if k in saved and saved[k] != now[k]]


def check_objective(path: Path, state: dict, train: TrainSection) -> None:
    """A resume under another objective (train.loss, train.labels, …) than the checkpoint's: exit 2."""
    changed = objective_changes(state, train)
    if changed:
        ck = Path(path)
        raise UsageError(f"{ck / 'state.json'}: the training objective changed since this checkpoint "
                         f"({'; '.join(changed)}); resuming would mix two objectives and keep train/best/ "
                         "from the old one",
                         hint=f"restore the checkpoint's values to resume, or move {ck.parent.parent} away to "
                         "train from scratch with the new objective")
