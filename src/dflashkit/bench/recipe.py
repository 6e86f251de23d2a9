"""`dflashkit bench recipe`: short training runs that decide a recipe, on this run's data.

Usage:
    dflashkit bench recipe -c run.yaml                        # the default variants, bench.recipe_steps each
    dflashkit bench recipe -c run.yaml bench.recipe_variants='{base: [], wide: [train.lr=1e-3]}'

Each variant is the run config plus dotted overrides, trained from scratch for `bench.recipe_steps`
steps in `<run_dir>/bench/recipe/<name>/` (which links this run's contract.json, tokenize/ and
capture/, so the data and cached features are shared and never copied), then scored on the same
held-out samples: simulated τ, position-1 accuracy, held-out loss and the train-vs-held-out gap.
The default variants answer the questions a weak drafter raises:
  * base             — the config as it is;
  * labels=data      — learn the training text's tokens instead of the target's own predictions;
  * no-features      — target features zeroed in training and scoring: does the drafter use the
                       target at all? (a drafter that matches this one is a language model, not a
                       DFlash drafter);
  * bigram           — not a drafter: the share of held-out supervised positions whose label is the
                       most frequent successor of the previous token in the training labels.
Steps, data and seed are the same for every variant, and all of them run in one process on one
machine, so the table compares like with like (it is not a time measurement).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from dflashkit.config import config_from_dict, config_to_dict
from dflashkit.rundir import RunDir

log = logging.getLogger("dflashkit.bench")

DEFAULT_VARIANTS: dict[str, list[str]] = {
    "base": [],
    "labels=data": ["train.labels=data"],
    "no-features": ["train.ablate_features=true"],
}


def _link(src: Path, dst: Path) -> None:
    if dst.is_symlink() or dst.exists():
        return
    if src.exists():
        os.symlink(src.resolve(), dst)


def variant_config(cfg: Any, name: str, overrides: list[str], root: Path, steps: int) -> Any:
    """The config of one variant: `cfg` + overrides, its own run dir, `steps` steps, one final eval."""
    from dflashkit.config import given_keys, parse_override, set_given_keys

    data = config_to_dict(cfg)
    data["run"]["run_dir"] = str(root / name)
    data["train"].update(max_steps=steps, eval_every=0, save_every=0)
    vcfg = config_from_dict(data, overrides, source=f"bench.recipe_variants.{name}")
    set_given_keys(vcfg, set(given_keys(cfg) or ()) | {parse_override(o)[0] for o in overrides})
    return vcfg


MARKER = ".bench-recipe"  # in each variant dir this bench made: only those are ever cleared for a re-run


def plan_variants(cfg: Any, rd: RunDir) -> dict[str, Any]:
    """Every variant's config, built and checked before any trains (names, override keys and values, the
    drafter.* keys against contract.json): a bad last variant fails before the first one costs minutes."""
    from dflashkit.config import recipe_variant_problems
    from dflashkit.errors import ConfigError, DflashkitError
    from dflashkit.rundir import check_replaceable

    steps = int(cfg.bench.recipe_steps)
    variants = dict(cfg.bench.recipe_variants or DEFAULT_VARIANTS)
    problems = recipe_variant_problems(variants)
    if problems:
        raise ConfigError(problems)
    root = rd.root / "bench" / "recipe"
    out: dict[str, Any] = {}
    for name, over in variants.items():
        try:
            out[name] = variant_config(cfg, name, list(over), root, steps)
        except DflashkitError as e:
            raise ConfigError([f"bench.recipe_variants.{name}: {e.message}"]) from None
        check_replaceable(root / name, owner="bench recipe", marker=MARKER)
    if rd.contract_path.is_file():
        from dflashkit.model.drafter_config import DrafterContract
        from dflashkit.train.guards import check_drafter_overrides

        contract = DrafterContract.load(rd.contract_path)
        check_drafter_overrides(cfg, contract, rd.contract_path)
        for name, vcfg in out.items():
            try:
                check_drafter_overrides(vcfg, contract, rd.contract_path)
            except ConfigError as e:
                raise ConfigError([f"bench.recipe_variants.{name}: {p}" for p in e.problems], hint=e.hint) from None
    return out


def bigram_accuracy(rd: RunDir, heldout_samples: int, seed: int) -> float | None:
    """Held-out share of supervised labels equal to the most frequent successor of the previous token in
    the training samples' supervised tokens (`decode.diagnostics.BigramTable`; an unseen previous token
    counts as a miss): the baseline any drafter should beat."""
    from dflashkit.decode.diagnostics import BigramTable
    from dflashkit.train.data import load_tokenized, split_heldout

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


def bench_recipe(cfg: Any, rd: RunDir, ctx: Any) -> dict[str, Any]:
    from dflashkit.train.loop import fit

    import shutil

    steps = int(cfg.bench.recipe_steps)
    configs = plan_variants(cfg, rd)
    if ctx.dry_run:
        return {"dry_run": True, "steps": steps, "variants": {n: {"run_dir": c.run.run_dir,
                                                                   "overrides": list((cfg.bench.recipe_variants
                                                                                      or DEFAULT_VARIANTS)[n])}
                                                               for n, c in configs.items()}}
    rows: list[dict[str, Any]] = []
    for name, vcfg in configs.items():
        over = list((cfg.bench.recipe_variants or DEFAULT_VARIANTS)[name])
        vdir = RunDir(vcfg.run.run_dir)
        if (vdir.root / MARKER).is_file():  # this bench's own earlier variant: trained from scratch again
            shutil.rmtree(vdir.root)
        vdir.root.mkdir(parents=True, exist_ok=True)
        (vdir.root / MARKER).write_text("made by `dflashkit bench recipe`; cleared when the bench re-runs\n")
        for part in ("contract.json", "tokenize", "capture"):
            _link(rd.root / part, vdir.root / part)
        t0 = time.perf_counter()
        res = fit(vcfg, vdir, show_bar=False)
        held, train = res.get("heldout") or {}, res.get("train") or {}
        acc = held.get("acc") or []
        rows.append({"variant": name, "overrides": list(over), "steps": steps,
                     "heldout_tau": held.get("tau"), "heldout_acc1": acc[0] if acc else None,
                     "heldout_loss": held.get("loss"), "train_tau": train.get("tau"),
                     "gap_tau": (None if held.get("tau") is None or train.get("tau") is None
                                 else round(train["tau"] - held["tau"], 4)),
                     "wall_s": round(time.perf_counter() - t0, 1)})
        log.info("recipe %-14s held-out τ %.3f acc1 %s (%.0f s)", name, held.get("tau") or 0,
                 rows[-1]["heldout_acc1"], rows[-1]["wall_s"])
    bigram = bigram_accuracy(rd, cfg.train.heldout_samples, cfg.run.seed)
    if not ctx.json:
        print(f"{'variant':16s} {'held-out τ':>10s} {'acc@1':>7s} {'loss':>7s} {'train τ':>8s} {'wall s':>7s}")
        for r in rows:
            print(f"{r['variant']:16s} {r['heldout_tau'] or 0:10.3f} {r['heldout_acc1'] or 0:7.3f} "
                  f"{r['heldout_loss'] or 0:7.3f} {r['train_tau'] or 0:8.3f} {r['wall_s']:7.1f}")
        print(f"{'bigram (acc@1)':16s} {'':>10s} {bigram or 0:7.3f}")
    return {"steps": steps, "variants": rows, "bigram_acc1": bigram,
            "config": {k: v for k, v in dataclasses.asdict(cfg.train).items() if k != "parallel"}}
