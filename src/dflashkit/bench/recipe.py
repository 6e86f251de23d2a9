"""`dflashkit bench recipe`: short training runs that decide a recipe, on this run's data.

Usage:
    dflashkit bench recipe -c run.yaml                        # the default variants, bench.recipe_steps each
    dflashkit bench recipe -c run.yaml bench.cpu_minutes=10   # equal CPU-minutes per variant (steps = a cap)
    dflashkit bench recipe -c run.yaml bench.recipe_variants='{base: [], wide: [train.lr=1e-3]}'
    dflashkit bench recipe -c run.yaml bench.recipe_grid='{drafter.block_size: [4, 8, 16]}'

Each variant is the run config plus dotted overrides (`bench.recipe_variants`, or one lever at a
time from `bench.recipe_grid`), trained from scratch in `<run_dir>/bench/recipe/<name>/` and scored
on the same held-out samples. A variant links the run's contract.json, tokenize/ and capture/ (data
and cached features are shared, never copied) unless it changes the contract (block size, layers,
feature layers, drafter type), then it gets its own contract.json. Every variant's config is built
and validated before the first one trains.

With `bench.cpu_minutes` each variant trains until its optimizer steps have used that much process
CPU time (`train/optim.py` CpuBudget, lr schedule stretched to fit, capped at `bench.recipe_steps`).
Each row records held-out τ, accuracies, loss, the train-vs-held-out gap, τ per source, CPU-minutes,
steps, tokens, its learning curve and the load average around the variant (a busy machine makes
CPU-minutes incomparable).

Default variants: base; labels=data; no-features (no target context: does the drafter use the target
at all?); suffix_complement (the drafter trained to complement the hybrid's suffix proposer:
train.suffix_complement=downweight); one per drafter family beside DFlash (dflashkit/family/); and
bigram, not a drafter but the share of held-out labels the most frequent successor predicts. Method:
docs/recipe.md.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dflashkit import family
from dflashkit.config import (BenchSection, RunConfig, config_from_dict, config_to_dict, flat_settings,
                              given_keys, parse_override, recipe_variant_problems, set_given_keys)
from dflashkit.data.shards import tokenized_shards
from dflashkit.decode.diagnostics import BigramTable
from dflashkit.decode.suffix import SuffixProposer
from dflashkit.errors import ConfigError, DflashkitError, MissingArtifactError, UsageError
from dflashkit.family import get
from dflashkit.family.contract import DrafterContract, build_target_layer_ids, sliding_fields
from dflashkit.family.recipe import config_recipe, resolve_recipe
from dflashkit.rundir import RunDir, atomic_write_json, check_replaceable
from dflashkit.train.data import load_tokenized, split_heldout
from dflashkit.train.guards import check_cached_features, check_drafter_overrides
from dflashkit.train.logging import read_curve
from dflashkit.train.loop import fit

if TYPE_CHECKING:
    from dflashkit.context import StageContext

log = logging.getLogger("dflashkit.bench")

def _family_variants() -> dict[str, list[str]]:
    """One variant per drafter family beside the default one: the same data and steps with that family's
    drafter (full vocab when the family has no reduced vocab), the other families' knobs back at their
    defaults (a base config of one family may set knobs the variant's family does not read)."""
    def resets(f: family.Family) -> list[str]:
        knobs, weights = flat_settings("knobs", None), flat_settings("weights", None)   # every key's default
        drafter = [f"drafter.{k}={json.dumps(v)}" for k, v in knobs.items() if k not in f.knob_names]
        return drafter + [f"train.{k}={json.dumps(v)}" for k, v in weights.items() if k not in f.weight_names]

    return {f.name: [f"drafter.type={f.name}", *([] if f.network.reduced_vocab else ["drafter.draft_vocab_size=null"]),
                     *resets(f)]
            for f in family.FAMILIES.values() if f is not family.DEFAULT}


DEFAULT_VARIANTS: dict[str, list[str]] = {
    "base": [],
    "labels=data": ["train.labels=data"],
    "no-features": ["train.ablate_features=true"],
    "suffix_complement": ["train.suffix_complement=downweight"],
    **_family_variants(),
}


def own_contract_keys() -> set[str]:
    """drafter.* keys a variant may change although the contract holds them (they get a contract of their own):
    the drafter family and every family's knobs."""
    return {"drafter.type", *(f"drafter.{k}" for k in family.knob_keys())}


def _link(src: Path, dst: Path) -> None:
    if dst.is_symlink() or dst.exists():
        return
    if src.exists():
        os.symlink(src.resolve(), dst)


def grid_name(key: str, value: str) -> str:
    """The variant name of a grid value: `key=value` with anything outside the folder-name charset replaced."""
    return re.sub(r"[^A-Za-z0-9._=+,-]", "_", f"{key}={value}")[:64]


def variants_of(bench: BenchSection) -> dict[str, list[str]]:
    """name → overrides from `bench.recipe_variants` and `bench.recipe_grid` (defaults when both are empty)."""
    problems = recipe_variant_problems(bench.recipe_variants or {})
    if problems:
        raise ConfigError(problems)
    out: dict[str, list[str]] = {str(k): list(v) for k, v in (bench.recipe_variants or {}).items()}
    for key, values in (bench.recipe_grid or {}).items():
        if not isinstance(values, list) or not values:
            raise UsageError(f"bench.recipe_grid.{key}: expected a non-empty list of values, got {values!r}",
                             hint="e.g. bench.recipe_grid='{drafter.block_size: [4, 8, 16]}'")
        for v in values:
            text = _yaml_scalar(v)
            out[grid_name(key, text)] = [f"{key}={text}"]
    return out or dict(DEFAULT_VARIANTS)


def _yaml_scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    return v if isinstance(v, str) else json.dumps(v)


def variant_config(cfg: RunConfig, name: str, overrides: list[str], root: Path, steps: int) -> RunConfig:
    """The config of one variant: `cfg` + overrides, its own run dir, `steps` steps, one final eval."""
    data = config_to_dict(cfg)
    data["run"]["run_dir"] = str(root)
    data["train"].update(max_steps=steps, eval_every=cfg.bench.recipe_eval_every, save_every=0)

    vcfg = config_from_dict(data, overrides, source=f"bench.recipe_variants.{name}", checks=family.checks)
    set_given_keys(vcfg, set(given_keys(cfg) or ()) | {parse_override(o)[0] for o in overrides})
    return vcfg


MARKER = ".bench-recipe"  # in each variant dir this bench made: only those are ever cleared for a re-run


def _made_before_markers(vroot: Path) -> bool:
    """A variant dir an earlier dflashkit made: tokenize/ linked to the run's, train/ written by train."""
    return (vroot.is_dir() and not vroot.is_symlink() and (vroot / "tokenize").is_symlink()
            and (vroot / "train" / "manifest.json").is_file() and not (vroot / MARKER).exists())


def plan_variants(cfg: RunConfig, rd: RunDir
                  ) -> dict[str, tuple[list[str], RunConfig, DrafterContract | None]]:
    """name → (overrides, config, contract or None) of every variant, built and checked before any trains:
    names, override keys and values, the drafter.* keys against the contract the variant will train
    (its own, `variant_contract`, when it changes the drafter's shape), and with train.features=cached
    that this run's capture/ holds the variant's feature layers: a bad last variant fails before the first
    one costs minutes, and a user's directory where a variant would go is refused."""
    steps = int(cfg.bench.recipe_steps)
    root = rd.bench_dir / "recipe"
    base = None
    if rd.contract_path.is_file():
        base = DrafterContract.load(rd.contract_path)
        check_drafter_overrides(cfg.drafter, given_keys(cfg), base, rd.contract_path)
    out: dict[str, tuple[list[str], RunConfig, DrafterContract | None]] = {}
    for name, over in variants_of(cfg.bench).items():
        try:
            vcfg = variant_config(cfg, name, over, root / name, steps)
            own = variant_contract(over, vcfg, base) if base is not None else None
            if base is not None:
                check_drafter_overrides(vcfg.drafter, given_keys(vcfg), own or base,
                                        rd.contract_path if own is None else "its own contract")
                # the variant trains on this run's capture/ (linked): its feature layers must be in it
                check_cached_features(rd, own or base, tokenized_shards(rd), resolve_recipe(vcfg.train, own or base))
        except ConfigError as e:
            raise ConfigError([f"bench.recipe_variants.{name}: {p}" for p in e.problems], hint=e.hint) from None
        except MissingArtifactError:  # exit 3: the stage that makes it is named
            raise
        except DflashkitError as e:
            raise ConfigError([f"bench.recipe_variants.{name}: {e.message}"], hint=e.hint) from None
        if not _made_before_markers(root / name):  # a variant dir from before MARKER existed is ours too
            check_replaceable(root / name, owner="bench recipe", marker=MARKER)
        out[name] = (over, vcfg, own)
    return out


_CONTRACT_KEYS = ("block_size", "num_draft_layers", "num_target_features", "target_layer_ids", "sliding_window",
                  "layer_types")


def variant_contract(over: list[str], vcfg: RunConfig, contract: DrafterContract) -> DrafterContract | None:
    """The contract of a variant whose overrides change the drafter's shape (block size, draft layers,
    target feature layers, sliding-window layers) or family (drafter.type, a family's knobs): the run's contract with those
    fields redone as `probe` would (layer ids by the reference formula unless given). None when the
    result is the run's contract (it is linked)."""
    keys = {parse_override(o)[0] for o in over}
    given = {k for k in _CONTRACT_KEYS if f"drafter.{k}" in keys}
    refamily = bool(keys & own_contract_keys())
    if not given and not refamily:
        return None
    d = vcfg.drafter
    layers = d.num_draft_layers if "num_draft_layers" in given else contract.num_draft_layers
    ids = list(contract.target_layer_ids)
    if "target_layer_ids" in given and d.target_layer_ids is not None:
        ids = list(d.target_layer_ids)
    elif "num_target_features" in given or ("num_draft_layers" in given and d.num_target_features is None):
        ids = build_target_layer_ids(contract.num_target_layers, d.num_target_features or layers)
    own = dataclasses.replace(contract, block_size=d.block_size if "block_size" in given else contract.block_size,
                              num_draft_layers=layers, target_layer_ids=ids)
    if given & {"sliding_window", "layer_types"}:  # per-layer attention (full / sliding), as probe writes it
        own = dataclasses.replace(own, **sliding_fields(d.layer_types, d.sliding_window, layers))
    if refamily:
        own = dataclasses.replace(own, **get(d.type).contract_fields(d))
    if own == contract:
        return None
    own.check()
    return own


def bigram_accuracy(rd: RunDir, heldout_samples: int, seed: int) -> float | None:
    """Held-out share of supervised labels equal to the most frequent successor of the previous token in
    the training samples' supervised tokens (`decode.diagnostics.BigramTable`; an unseen previous token
    counts as a miss): the baseline any drafter should beat."""
    data = load_tokenized(rd)
    train_idx, held = split_heldout(len(data), heldout_samples, seed=seed)
    table = BigramTable.fit([data.input_ids[i] for i in train_idx], [data.loss_mask[i] for i in train_idx])
    hit = tot = 0
    for i in held:
        ids, m = data.input_ids[i], data.loss_mask[i]
        sup = np.flatnonzero(m[1:] > 0) + 1
        tot += sup.size
        hit += sum(table.best.get(int(ids[t - 1]), -1) == int(ids[t]) for t in sup)
    return round(hit / tot, 4) if tot else None


def curve_of(vdir: RunDir) -> list[list[Any]]:
    """A variant's learning curve (its train/curve.json) as rows [step, supervised tokens, optimizer seconds,
    held-out τ, position-1 accuracy]: one per `bench.recipe_eval_every` and the final one."""
    points = (read_curve(vdir) or {}).get("points") or []
    return [[p["step"], p["tokens"], p["train_s"], p["heldout"]["tau"], p["heldout"]["acc1"]] for p in points]


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def second_source(cfg: RunConfig, by_source: dict[str, Any]) -> str | None:
    """The source reported as "second held-out source" (module docstring), or None."""
    if cfg.train.heldout_sources:
        return cfg.train.heldout_sources[0]
    names = sorted(by_source)
    return names[1] if len(names) > 1 else None


def row_of(name: str, over: list[str], vcfg: RunConfig, res: dict, *, wall_s: float, load: tuple,
           curve: list[list[Any]] | None = None) -> dict[str, Any]:
    held, train = res.get("heldout") or {}, res.get("train") or {}
    acc = held.get("acc") or []
    by = res.get("heldout_by_source") or {}
    second = second_source(vcfg, by)
    # the gap compares train τ with the held-out τ under the labels training scored itself with
    held_train = held.get("tau") if config_recipe(vcfg).rollout else held.get("tau_raw", held.get("tau"))
    return {"variant": name, "overrides": list(over), "steps": res.get("steps"), "drafter_type": vcfg.drafter.type,
            "cpu_minutes": round(res["cpu_s"] / 60, 3) if res.get("cpu_s") is not None else None,
            "supervised_tokens": res.get("supervised_tokens"),
            "heldout_tau": held.get("tau"), "heldout_acc1": acc[0] if acc else None, "heldout_acc": acc,
            "heldout_unary_tau": held.get("unary_tau", held.get("tau")),
            "heldout_loss": held.get("loss"), "train_tau": train.get("tau"),
            "heldout_labels": held.get("heldout_labels"), "heldout_tau_raw": held.get("tau_raw"),
            "gap_tau": (None if held_train is None or train.get("tau") is None
                        else round(train["tau"] - held_train, 4)),
            "second_source": second, "second_source_tau": (by.get(second) or {}).get("tau") if second else None,
            "heldout_by_source": {k: v.get("tau") for k, v in by.items()},
            "load_before": load[0], "load_after": load[1], "wall_s": round(wall_s, 1), "curve": curve}


def bench_recipe(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict[str, Any]:
    steps = int(cfg.bench.recipe_steps)
    budget_s = cfg.bench.cpu_minutes * 60 if cfg.bench.cpu_minutes else None
    plan = plan_variants(cfg, rd)
    if ctx.dry_run:
        return {"dry_run": True, "steps": steps, "cpu_minutes": cfg.bench.cpu_minutes,
                "variants": {n: {"run_dir": c.run.run_dir, "overrides": o, "own_contract": own is not None}
                             for n, (o, c, own) in plan.items()}}
    rows: list[dict[str, Any]] = []
    for name, (over, vcfg, own) in plan.items():
        vdir = RunDir(vcfg.run.run_dir)
        if (vdir.root / MARKER).is_file() or _made_before_markers(vdir.root):  # ours: trained from scratch again
            shutil.rmtree(vdir.root)
        vdir.root.mkdir(parents=True, exist_ok=True)
        (vdir.root / MARKER).write_text("made by `dflashkit bench recipe`; cleared when the bench re-runs\n")
        if own is not None:
            atomic_write_json(vdir.contract_path, own.to_dict())
        for part in ("tokenize", "capture") if own is not None else ("contract.json", "tokenize", "capture"):
            _link(rd.root / part, vdir.root / part)
        load0, t0 = _load(), time.perf_counter()
        res = fit(vcfg, vdir, show_bar=False, cpu_budget_s=budget_s, suffix_proposer=SuffixProposer)
        rows.append(row_of(name, over, vcfg, res, wall_s=time.perf_counter() - t0, load=(load0, _load()),
                           curve=curve_of(vdir)))
        r = rows[-1]
        log.info("recipe %-24s held-out τ %.3f acc1 %s, %s steps, %s CPU-min, load %s → %s", name,
                 r["heldout_tau"] or 0, r["heldout_acc1"], r["steps"], r["cpu_minutes"], r["load_before"],
                 r["load_after"])
    bigram = bigram_accuracy(rd, cfg.train.heldout_samples, cfg.run.seed)
    if not ctx.json:
        print(table(rows, bigram))
    return {"steps": steps, "cpu_minutes": cfg.bench.cpu_minutes, "cpu_count": os.cpu_count(),
            "variants": rows, "bigram_acc1": bigram,
            "config": {k: v for k, v in config_to_dict(cfg.train).items() if k != "parallel"}}


def table(rows: list[dict[str, Any]], bigram: float | None) -> str:
    def f(x: Any, nd: int = 3) -> str:
        return f"{x:.{nd}f}" if isinstance(x, (int, float)) else "-"

    head = (f"{'variant':28s} {'held-out τ':>10s} {'acc@1':>6s} {'gap':>6s} {'2nd src τ':>9s} {'steps':>6s} "
            f"{'CPU-min':>7s} {'tokens':>9s} {'load':>11s}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['variant'][:28]:28s} {f(r['heldout_tau']):>10s} {f(r['heldout_acc1']):>6s} "
                     f"{f(r['gap_tau']):>6s} {f(r['second_source_tau']):>9s} {r['steps'] or 0:6d} "
                     f"{f(r['cpu_minutes'], 2):>7s} {r['supervised_tokens'] or 0:9d} "
                     f"{f(r['load_before'], 1):>5s}→{f(r['load_after'], 1):<5s}")
        lines.append(f"{'':28s} per-position acc {' '.join(f(a, 2) for a in r['heldout_acc'] or [])}")
    lines.append(f"{'bigram (acc@1)':28s} {'':>10s} {f(bigram):>6s}")
    return "\n".join(lines)
