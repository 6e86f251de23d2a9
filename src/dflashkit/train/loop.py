"""`fit()`: the drafter training loop, readable top to bottom.

Usage:
    result = fit(cfg, rd)              # one process, or one rank under torchrun

Flow (`preflight` reads and checks the inputs once, `setup` builds one finished `Trainer` from them,
`_Run` drives it): contract and the run's recipe (`family/recipe.py`, resolved once), warm start, resume
point + tokenized data (+ cached features) → target (frozen; online
features, embedding, head) → drafter (random or target init) → DDP/FSDP2 → AdamW + cosine → resume
from the latest complete checkpoint → per step: this rank's micro-batches of the deterministic
global batch, anchors, the step's global Σw (all-reduced), forward/backward per micro-batch, clip,
step → metrics, held-out simulated τ, checkpoints → `train/final/` (z-lab drafter dir).

Every held-out evaluation (each `train.eval_every` steps and the final one) also appends a point
to the learning curve `train/curve.json` (held-out τ, position-1 accuracy and loss against the
supervised tokens seen so far, overall and per data source, beside the train τ of the same
window; `train/logging.py`), and, with `train.keep_best`, replaces `train/best/` when its τ beats
the best so far (`train/checkpoint.py`). Both are restored from the checkpoint on resume, so a
resumed run writes what the uninterrupted run writes.

`drafter.draft_vocab_size` (a reduced draft vocabulary): the vocab is chosen from the training
samples' label tokens (`model/draft_vocab.py`, the same on every rank), stored in the drafter as
its `d2t` buffer (so checkpoints and train/final carry it; a resumed run keeps the checkpoint's),
and the loss projects onto the target head's rows of that vocab only (one frozen copy, built once).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Callable

import torch

from dflashkit.config import given_keys
from dflashkit.data.capturing import rollout_reproduces_attention
from dflashkit.data.chat import source_modes
from dflashkit.data.shards import require_tokenized_shards
from dflashkit.errors import UsageError
from dflashkit.family import new_drafter
from dflashkit.family.contract import REPROBE_HINT, DrafterContract
from dflashkit.family.recipe import Recipe, resolve_recipe
from dflashkit.target.head import load_head_only_target
from dflashkit.model.init import init_from_target
from dflashkit.target.load import load_target
from dflashkit.train import checkpoint as ckpt
from dflashkit.train import guards
from dflashkit.train.guards import TrainInputs
from dflashkit.train.data import BatchPlan, FeatureStore, TokenData, cached_store, first_of, load_tokenized
from dflashkit.train.heldout import BestKeeper, evaluate_heldout, log_eval
from dflashkit.train.levers import feature_scale_of, split_samples
from dflashkit.train.logging import LearningCurve, MetricSink
from dflashkit.train.loss import DraftLoss
from dflashkit.train.objective import gamma_for, weight_sum
from dflashkit.train.optim import CpuBudget, build_optimizer, build_scheduler
from dflashkit.train.parallel import (DistInfo, TargetParts, all_reduce_sum, barrier, init_distributed,
                                      shard_target, wrap_drafter)
from dflashkit.train.stats import StepStats
from dflashkit.train.stopping import StopOnSignal
from dflashkit.train.suffix_complement import SuffixComplement
from dflashkit.train.target_side import heldout_labels, target_side
from dflashkit.train.trainer import Trainer, autocast_dtype, sources_of
from dflashkit.train.vocab import pick_draft_vocab
from dflashkit.train.warm_start import (WarmSource, check_draft_vocab_fits, check_fits, keep_source_vocab,
                                        read_warm_start, warm_start)

if TYPE_CHECKING:
    from dflashkit.config import RunConfig
    from dflashkit.target.head import HeadOnlyTarget
    from dflashkit.target.load import Target
    from dflashkit.rundir import RunDir

log = logging.getLogger("dflashkit.train")


def preflight(cfg: RunConfig, rd: RunDir) -> TrainInputs:
    """Every refusal `train` makes before it loads the target or a weight: `fit` and `train --dry-run` both
    call it, so a dry run refuses what the run would, with the same message. train/final and train/best are
    ours; the contract exists and every drafter.* given agrees with it; a drafter.init dir fits it; the
    tokenized shards exist and, with train.features=cached, the feature shards hold its layers (and next_ids
    for train.labels=target); an online rollout's target attends as the rollout's mask does (read from its
    config.json); the latest checkpoint, if any, is this run's (objective, trajectory, contract).
    The engine of train.features=engine is the stage's to check (`engines/feed.py` check_engine_feed).
    Returns what it read, for `setup` (the checks are `train/guards.py`'s, each given the settings it reads)."""
    guards.check_outputs_ours(rd, cfg.drafter.init)
    contract = DrafterContract.load(rd.contract_path)
    guards.check_drafter_overrides(cfg.drafter, given_keys(cfg), contract, rd.contract_path)
    guards.check_family_objective(cfg.train, contract)
    warm = None
    if guards.init_dir(cfg.drafter.init) is not None:  # a drafter dir: read and checked before any work
        warm = read_warm_start(cfg.drafter.init)
        check_fits(warm, contract)
        check_draft_vocab_fits(warm, contract, cfg.drafter.draft_vocab_size)
    recipe = resolve_recipe(cfg.train, contract)  # the one place the recipe's facts are derived
    shards = require_tokenized_shards(rd)
    guards.check_cached_features(rd, contract, shards, recipe)
    _check_rollout_attention(cfg, rd, recipe)
    found = ckpt.latest_run_checkpoint(rd)
    state = None
    if found is not None:
        state = ckpt.checkpoint_state(found)
        guards.check_objective(found, state, cfg.train)
        guards.check_trajectory(found, state, cfg.train, cfg.run.seed, rd)
        ckpt.check_contract(found, state.get("contract"), contract)
    return TrainInputs(contract, recipe, warm, tuple(shards), found, state)


def _check_rollout_attention(cfg: RunConfig, rd: RunDir, recipe: Recipe) -> None:
    """train.on_path=rollout with train.features=online: training rolls the target's greedy path out over its
    samples, which reproduces full attention only; a target whose attention over the longest training sample
    differs (a sliding window it outgrows: `data.capturing.rollout_reproduces_attention`, read from the
    target's config.json) is exit 2 naming train.on_path, before the target loads. Cached features carry
    their paths (`capture` makes the same check); the held-out yardstick falls back by itself."""
    if not recipe.rollout or not recipe.online or recipe.path_depth <= 1:
        return
    data = load_tokenized(rd)
    train_idx = first_of(_split_samples(cfg, data)[0], cfg.train.train_samples, seed=cfg.run.seed)
    rollout_reproduces_attention(cfg, SimpleNamespace(input_ids=[data.input_ids[i] for i in train_idx]), recipe)


def _split_samples(cfg: RunConfig, data: TokenData) -> tuple[list[int], list[int]]:
    """`levers.split_samples` under train.heldout_samples, train.heldout_sources and run.seed."""
    t = cfg.train
    return split_samples(data, heldout_samples=t.heldout_samples, heldout_sources=t.heldout_sources,
                         seed=cfg.run.seed)


def setup(cfg: RunConfig, rd: RunDir, dist: DistInfo, inputs: TrainInputs | None = None, *,
          open_feed: Callable[..., Any] | None = None, target: Target | None = None,
          suffix_proposer: Callable[[], Any] | None = None,
          split: Callable[[TokenData], tuple[list[int], list[int]]] | None = None) -> Trainer:
    """Everything a step needs, as one finished `Trainer`, built from `inputs` (`preflight`'s: the
    contract, recipe and warm start it read and checked; None: preflight runs here). train.features=engine: `open_feed` (the train stage
    passes `engines.feed.open_engine_feed`) opens the engine and its feed, which run until `Trainer.close`.
    `target`: a target already in memory instead of `cfg.target` (the GPU check's random
    Qwen3-8B-shaped target, whose weights exist nowhere on disk). `suffix_proposer` (train.suffix_complement; the
    train stage and `bench recipe` pass `decode.suffix.SuffixProposer`) makes the in-context suffix proposer.
    `split` (data → (training, held-out) indices) replaces train.heldout_* (`learn`: the newest traffic is held out)."""
    inputs = inputs if inputs is not None else preflight(cfg, rd)
    complement = SuffixComplement.from_train(cfg.train, suffix_proposer)  # before any work
    opened: list[Any] = []
    try:
        tr = _setup(cfg, rd, dist, inputs, opened, open_feed, target, split)
        tr.complement = complement
        return tr
    except BaseException:
        for feed in opened:
            feed.close()
        raise


def engine_feed_key(cfg: RunConfig, rd: RunDir, recipe: Recipe, contract: DrafterContract,
                    dist: DistInfo) -> dict[str, Any]:
    """What an engine queue's rows depend on (a queue left by a killed run is reused only when it matches)."""
    t = cfg.train
    return {"target_layer_ids": list(contract.target_layer_ids), "dtype": cfg.capture.dtype,
            "last_hidden": recipe.needs_target_logits, "seed": cfg.run.seed, "batch_size": t.batch_size,
            "grad_accum": t.grad_accum, "world": dist.world, "rank": dist.rank,
            "heldout": [t.heldout_samples, list(t.heldout_sources)], "train_samples": t.train_samples,
            "tokenize": (rd.manifest("tokenize") or {}).get("config_hash")}


def _setup(cfg: RunConfig, rd: RunDir, dist: DistInfo, inputs: TrainInputs, opened: list[Any],
           open_feed: Callable[..., Any] | None, loaded: Target | None = None,
           split: Callable[[TokenData], tuple[list[int], list[int]]] | None = None) -> Trainer:
    """`setup`'s body; `opened` receives the engine feed it opens (closed by `setup` when this raises)."""
    contract, recipe, warm = inputs.contract, inputs.recipe, inputs.warm
    data = load_tokenized(rd)
    feed = _open_features(cfg, rd, dist, recipe, contract, data, opened, open_feed)
    target, parts = _load_target(cfg, rd, dist, recipe, contract, data.features, loaded)
    train_idx, heldout = split(data) if split is not None else _split(cfg, data)
    vocab = keep_source_vocab(warm, cfg.drafter.draft_vocab_size) if warm is not None else None
    if vocab is None:
        vocab = pick_draft_vocab(cfg.drafter.draft_vocab_size, recipe, contract, target, data, train_idx,
                                 batch_size=cfg.train.batch_size)
    drafter, warm_report = _new_drafter(cfg, dist, contract, target, data, train_idx, vocab, warm)
    attention = cfg.drafter.attention
    if attention == "flex" and dist.device.type != "cuda":
        log.warning("drafter.attention=flex needs CUDA for training (flex backward); using sdpa on %s", dist.device)
        attention = "sdpa"
    drafter = wrap_drafter(drafter, cfg.train.parallel.mode, dist)
    plan = BatchPlan(train_idx, cfg.train.batch_size, cfg.train.grad_accum, dist.world, cfg.run.seed)
    amp = autocast_dtype(cfg.train.dtype, dist.device)
    loss = DraftLoss.from_train(cfg.train, contract, gamma=gamma_for(cfg.train.gamma, contract.block_size),
                                attention=attention, amp=amp)
    side = target_side(recipe, cfg.train, contract, target, parts, device=dist.device, amp=amp, store=data.features)
    how, paths = heldout_labels(recipe, cfg.train, data.features, target, data, heldout)
    t = cfg.train
    return Trainer(t, cfg.run.seed, recipe, contract, dist, drafter, target, parts, data, plan, heldout, loss, side,
                   vocab=vocab, warm_start=warm_report, feed=feed, heldout_labels=how, heldout_paths=paths,
                   pack_length=(t.pack_length or cfg.tokenize.max_length) if t.pack else None,
                   modes=source_modes(cfg, sources_of(data)))


def _open_features(cfg: RunConfig, rd: RunDir, dist: DistInfo, recipe: Recipe, contract: DrafterContract,
                   data: TokenData, opened: list[Any], open_feed: Callable[..., Any] | None) -> Any:
    """`data.features` for the recipe's feature source: the capture shards (cached, checked to hold what the
    recipe reads), the engine's feed (engine; returned, and added to `opened`), or none (online)."""
    if recipe.cached:
        data.features = cached_store(rd.capture_dir, data.shards, contract.target_layer_ids, recipe)
    if not recipe.engine_fed:
        return None
    if open_feed is None:  # rows from the engine as training consumes them (engines/feed.py)
        raise UsageError("train.features=engine is served by `dflashkit train` (and `dflashkit run`) only",
                         hint="train with train.features=cached or online here")
    feed = open_feed(cfg, contract, data, rd.stage_dir("train"), queue_dir=rd.engine_queue_dir,
                     last_hidden=recipe.needs_target_logits, rank=dist.rank, world=dist.world,
                     key=engine_feed_key(cfg, rd, recipe, contract, dist))
    opened.append(feed)
    data.features = feed  # FeatureStore's reading API (has / require / get)
    return feed


def _load_target(cfg: RunConfig, rd: RunDir, dist: DistInfo, recipe: Recipe, contract: DrafterContract,
                 store: FeatureStore | None, loaded: Target | None) -> tuple[Target | HeadOnlyTarget, TargetParts]:
    """The frozen target and the parts the loss uses (embedding, head; sharded with train.parallel.target=shard),
    checked against the contract: its embedding and head only when the feature rows serve the whole recipe."""
    target: Target | HeadOnlyTarget
    if loaded is None and head_only(cfg, recipe, store):
        target = load_head_only_target(cfg.target, device=str(dist.device))
        parts = TargetParts(target.parts.embed, target.lm_head)
    else:
        full = loaded if loaded is not None else load_target(cfg.target, device=str(dist.device))
        target, parts = full, TargetParts(full.model.get_input_embeddings(), full.lm_head)
        if cfg.train.parallel.target == "shard":
            parts = shard_target(full, dist)
    contract.check(target, where=str(rd.contract_path), hint=REPROBE_HINT)
    return target, parts


def _split(cfg: RunConfig, data: TokenData) -> tuple[list[int], list[int]]:
    """(training, held-out) sample indices: `levers.split_samples`, then `train.train_samples` of the rest."""
    train_idx, heldout = _split_samples(cfg, data)
    if cfg.train.train_samples is not None:
        kept = first_of(train_idx, cfg.train.train_samples, seed=cfg.run.seed)
        log.info("train.train_samples: training on %d of %d training samples", len(kept), len(train_idx))
        train_idx = kept
    return train_idx, heldout


def _new_drafter(cfg: RunConfig, dist: DistInfo, contract: DrafterContract, target: Any, data: TokenData,
                 train_idx: list[int], vocab: torch.Tensor | None,
                 warm: WarmSource | None) -> tuple[torch.nn.Module, dict | None]:
    """The drafter on the device (seeded by run.seed; feature scale, target init or warm start, compiled layers),
    not yet wrapped for DDP/FSDP, and the warm start's report (None without one)."""
    torch.manual_seed(cfg.run.seed)
    scale = (feature_scale_of(contract, target, data, train_idx, batch_size=cfg.train.batch_size)
             if cfg.drafter.feature_scale == "rms" else None)
    drafter = new_drafter(contract, draft_vocab=vocab, feature_scale=scale).to(dist.device)
    report = None
    if cfg.drafter.init == "target":
        init_from_target(drafter, target, cfg.drafter.init_layer_ids)
    elif warm is not None:
        report = warm_start(drafter, warm, contract)
    if cfg.train.compile:
        for layer in drafter.layers:
            layer.compile()
    return drafter, report


def head_only(cfg: RunConfig, recipe: Recipe, store: FeatureStore | None) -> bool:
    """Whether training needs only the target's embedding and head (target/head.py), not its layers: the
    features, and the labels / KL target the recipe asks for, all come from the feature rows
    (`Recipe.store_serves`), and the drafter is not initialised from the target's layers (`drafter.init: target`)."""
    return cfg.drafter.init != "target" and recipe.store_serves(store)


def total_steps(cfg: RunConfig, plan: BatchPlan) -> int:
    if cfg.train.max_steps:
        return int(cfg.train.max_steps)
    return epoch_steps(cfg.train.epochs, plan)


def epoch_steps(epochs: float, plan: BatchPlan) -> int:
    """Optimizer steps of `epochs` passes over the plan's training samples (at least 1)."""
    return max(1, math.ceil(epochs * len(plan.train_idx) / plan.global_batch))


def train_step(tr: Trainer, step: int, opt, sched) -> dict:
    """One optimizer step over this rank's micro-batches; returns metrics reduced over ranks."""
    B = tr.contract.block_size
    batches = [tr.batch(items) for items in tr.plan.micro_batches(step, tr.dist.rank)]
    anchors = [tr.anchors(b) for b in batches]
    # The target side first: with train.labels=target the labels (and so Σw over in-vocab labels) come
    # from the target's forward.
    touts = [tr.target_outputs(b, a) for b, a in zip(batches, anchors)]
    local_w = sum(weight_sum(b.loss_mask, b.seq_lens, a, input_ids=b.input_ids, block_size=B,
                             gamma=tr.denom_gamma(), vocab=tr.vocab, label_ids=o.label_ids, path_ids=o.path_ids,
                             on_path_only=o.on_path_only)
                  for b, a, o in zip(batches, anchors, touts))
    denom = float(all_reduce_sum(torch.tensor([local_w], dtype=torch.float64), tr.dist)[0])
    stats = StepStats.zeros(B, tr.contract.family)
    for b, a, o in zip(batches, anchors, touts):
        out = tr.micro_loss(b, a, denom, o, training=True)
        if denom > 0:
            (out.loss * tr.dist.world).backward()
        stats.add_step(out, tokens=float(b.seq_lens.sum()), loss_scale=1 / max(denom, 1e-6))
    grad_norm = 0.0
    if denom > 0:
        params = [p for p in tr.drafter.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, tr.train.grad_clip if tr.train.grad_clip > 0 else
                                              float("inf"))
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        opt.step()
    else:
        log.warning("step %d: no supervised positions in the global batch; skipping the update", step)
    opt.zero_grad(set_to_none=True)
    lr = opt.param_groups[0]["lr"]
    sched.step()
    # the loss terms were divided by the global Σw: the sum over ranks is the step's mean
    stats = StepStats.from_tensor(all_reduce_sum(stats.to_tensor(), tr.dist), B, tr.contract.family)
    return stats.metrics(step + 1, lr=lr, grad_norm=grad_norm)


def fit(cfg: RunConfig, rd: RunDir, *, dist: DistInfo | None = None, show_bar: bool = True,
        cpu_budget_s: float | None = None, open_feed: Callable[..., Any] | None = None,
        suffix_proposer: Callable[[], Any] | None = None) -> dict:
    """Train (or resume) until the configured number of steps; returns the final metrics.

    `cpu_budget_s` (`bench recipe` at equal CPU-minutes): stop once the optimizer steps have used this
    much process CPU time (or at the configured steps, whichever comes first); the lr schedule runs
    over the steps the budget affords (`optim.CpuBudget`)."""
    inputs = preflight(cfg, rd)  # every refusal before any work (`train --dry-run` makes the same ones)
    dist = dist or init_distributed(cfg.train.parallel, cfg.target.device)
    tr = setup(cfg, rd, dist, inputs, open_feed=open_feed, suffix_proposer=suffix_proposer)
    try:
        return _fit(cfg, rd, tr, show_bar=show_bar, cpu_budget_s=cpu_budget_s, inputs=inputs)
    finally:
        tr.close()


def _fit(cfg: RunConfig, rd: RunDir, tr: Trainer, *, show_bar: bool, cpu_budget_s: float | None,
         inputs: TrainInputs | None = None) -> dict:
    """`inputs`: `preflight`'s, whose checked checkpoint the run resumes from (None: found and checked here)."""
    run = _Run(cfg, rd, tr, show_bar=show_bar, cpu_budget_s=cpu_budget_s, inputs=inputs)
    run.train()
    return run.summary()


def engine_schedule(tr: Trainer, start: int, steps: int) -> tuple[Callable[[int], tuple[int, int, list[int]]], int]:
    """The training micro-batches of steps start..steps-1 on this rank, in the order `train_step` builds
    them: k → (step, micro-batch, sample indices), and their count (what the engine feed prefetches)."""
    p = tr.plan
    plan = BatchPlan(p.train_idx, p.batch_size, p.grad_accum, p.world, p.seed)  # the feed's own copy
    lock = threading.Lock()  # the feed's producer and the training loop both ask (BatchPlan caches one epoch)

    def item(k: int) -> tuple[int, int, list[int]]:
        step, m = divmod(k, p.grad_accum)
        with lock:
            return start + step, m, [i for i, _ in plan.micro_batches(start + step, tr.dist.rank)[m]]

    return item, max(0, steps - start) * p.grad_accum


class _Run:
    """One `fit` over a finished Trainer: the optimizer and lr schedule, what the latest checkpoint restores,
    the metric sinks, the learning curve and the best keeper. `train()` runs the steps (resuming where the
    checkpoint left off; SIGTERM: checkpoint at the next step boundary, then exit 143), `summary()` is fit's
    result."""

    def __init__(self, cfg: RunConfig, rd: RunDir, tr: Trainer, *, show_bar: bool, cpu_budget_s: float | None,
                 inputs: TrainInputs | None = None):
        self.cfg, self.rd, self.tr, self.dist = cfg, rd, tr, tr.dist
        self.inputs = inputs
        self.steps = total_steps(cfg, tr.plan)
        self.opt = build_optimizer(tr.drafter, cfg.train)
        if cpu_budget_s and self.dist.world > 1:  # each rank would measure its own CPU time, stop and schedule alone
            raise UsageError("a CPU-time budget (bench.cpu_minutes) needs one process",
                             hint="run `dflashkit bench recipe` without torchrun")
        self.budget = CpuBudget(cpu_budget_s, self.steps) if cpu_budget_s else None
        self.sched = build_scheduler(self.opt, total_steps=self.steps, warmup_ratio=cfg.train.warmup_ratio,
                                     min_lr_ratio=cfg.train.min_lr_ratio, budget=self.budget)
        rd.stage_dir("train")  # the sinks, checkpoints and train/final write into it
        # read once: what every checkpoint records and a resume must match
        self.traj = guards.trajectory(cfg.train, cfg.run.seed, rd)
        self.start, state = self._resume()
        self.sink = MetricSink(rd, total_steps=self.steps, start_step=self.start, train=cfg.train,
                               enabled=self.dist.is_main, show_bar=show_bar)
        self.best = BestKeeper(rd.best_dir, tr, cfg.train.keep_best)
        self.best.restore(self.start, state)
        self.curve = self._curve(state)
        self.last: dict = {}
        self.last_eval: dict | None = None
        self.done_tokens, self.t0 = 0, time.perf_counter()

    def _resume(self) -> tuple[int, dict | None]:
        """(the step to start from, the checkpoint's state.json): the latest complete checkpoint, loaded after
        another run's is refused by name (objective, trajectory; already by `preflight` when `inputs`
        are its), or (0, None)."""
        if self.inputs is not None:
            found, state = self.inputs.resume, self.inputs.resume_state
            if found is None or state is None:
                return 0, None
        else:
            found = ckpt.latest_run_checkpoint(self.rd)
            if found is None:
                return 0, None
            state = ckpt.checkpoint_state(found)
            guards.check_objective(found, state, self.cfg.train)
            guards.check_trajectory(found, state, self.cfg.train, self.cfg.run.seed, self.rd)
        start = ckpt.load_checkpoint(found, model=self.tr.drafter, optimizer=self.opt, scheduler=self.sched)
        self.tr.sync_draft_vocab()
        return start, state

    def _curve(self, state: dict | None) -> LearningCurve:
        """train/curve.json, its counters restored from the checkpoint's `state`."""
        tr, idx = self.tr, self.tr.plan.train_idx
        n = max(1, len(idx))
        curve = LearningCurve(self.rd, sorted(set(tr.sources())), enabled=self.dist.is_main,
                              supervised_per_sample=round(sum(float(tr.data.loss_mask[i].sum()) for i in idx) / n, 2),
                              tokens_per_sample=round(sum(len(tr.data.input_ids[i]) for i in idx) / n, 2))
        curve.restore(self.start, (state or {}).get("curve"))
        return curve

    def evaluated(self, n: int) -> None:
        """The held-out evaluation after step `n`: logged, a curve point, offered to the best keeper."""
        ev = evaluate_heldout(self.tr, n)
        if ev:
            self.last_eval = ev
            log_eval(self.sink, ev)
            self.curve.record(n, ev)
            self.best.offer(ev)

    def save(self, n: int) -> Path | None:
        """The checkpoint after step `n`, with what a resume restores (curve, objective, trajectory, best)."""
        extra = {"curve": self.curve.state_dict(), "objective": guards.objective(self.cfg.train),
                 "trajectory": self.traj, **({"best": self.best.record} if self.best.record else {})}
        return ckpt.save_checkpoint(self.rd, step=n, model=self.tr.drafter, optimizer=self.opt, scheduler=self.sched,
                                    is_main=self.dist.is_main, keep=self.cfg.train.keep_checkpoints, extra=extra)

    def train(self) -> None:
        """Every step from the resumed one, then the final evaluation, checkpoint and train/final."""
        tr = self.tr
        if tr.feed is not None:
            tr.feed.start(*engine_schedule(tr, self.start, self.steps))
        log.info("training %d steps from step %d: %d train / %d held-out samples, global batch %d, world %d",
                 self.steps, self.start, len(tr.plan.train_idx), len(tr.heldout), tr.plan.global_batch,
                 self.dist.world)
        self.t0 = time.perf_counter()
        ok, stop = False, StopOnSignal(self.dist)  # SIGTERM: checkpoint at the next step boundary, then exit 143
        try:
            stop.install()
            if self.start == 0 and tr.warm_start is not None:  # where the warm start begins: its held-out loss and τ
                tr.drafter.eval()
                self.evaluated(0)
            tr.drafter.train()
            for step in range(self.start, self.steps):
                if not self._step(step, stop):
                    break
            self._finish(stop)
            ok = True
        finally:
            stop.restore()
            self.sink.close(ok=ok)

    def _step(self, step: int, stop: StopOnSignal) -> bool:
        """Optimizer step `step` with its logging, evaluation and checkpoint; False once the CPU budget is spent
        (the run then ends at this step). A SIGTERM agreed by the ranks saves this step and exits 143."""
        t = self.cfg.train
        ts, cs = time.perf_counter(), time.process_time()
        last = self.last = train_step(self.tr, step, self.opt, self.sched)
        dt = time.perf_counter() - ts
        if self.budget is not None:
            self.budget.charge(time.process_time() - cs)
        self.done_tokens += last["tokens"]
        self.curve.add_step(self.tr.supervised_tokens(step), last.pop("_window"), seconds=dt)
        last.update(tok_s=round(last["tokens"] / dt, 1), anchors_s=round(last["blocks"] / dt, 1),
                    step_time_s=round(dt, 4))
        n = step + 1
        if n % max(1, t.log_every) == 0 or n == self.steps or n == self.start + 1:
            self.sink.log(last)
        self.sink.progress(n, loss=last["loss"], tau=last["tau"], tok_s=last["tok_s"])
        if t.eval_every and n % t.eval_every == 0 and n != self.steps:
            self.evaluated(n)
        saved, periodic = None, bool(t.save_every and n % t.save_every == 0)
        if periodic and n != self.steps:
            saved = self.save(n)  # the main rank gets its path, the others None
            barrier(self.dist)
        if self.budget is not None and self.budget.spent():
            log.info("CPU budget of %.1f s spent after %d steps", self.budget.seconds, n)
            self.steps = n
            return False
        if n < self.steps and stop.agreed(n):  # every rank stops after the same step, with its checkpoint
            if not periodic:
                saved = self.save(n)
                barrier(self.dist)
            stop.exit(n, saved)
        return True

    def _finish(self, stop: StopOnSignal) -> None:
        """After the last step: its held-out evaluation and checkpoint (unless done), then train/final."""
        tr, steps = self.tr, self.steps
        tr.drafter.eval()
        if self.start < steps and not (self.last_eval and self.last_eval["step"] == steps):
            self.evaluated(steps)
            self.save(steps)
        elif self.last_eval is None:
            self.last_eval = evaluate_heldout(tr, steps)
        ckpt.save_final(self.rd.final_dir, tr.drafter, tr.contract, is_main=self.dist.is_main)
        barrier(self.dist)
        if stop.agreed(steps):  # signalled during the last step or the final evaluation: finished, then 143
            stop.exit(steps, None, finished=True)

    def summary(self) -> dict:
        """fit's result: steps, where train/final and train/best are, the last train and held-out metrics."""
        tr, last, ev, budget = self.tr, self.last, self.last_eval, self.budget
        wall = time.perf_counter() - self.t0
        return {"steps": self.steps, "resumed_from": self.start, "final_dir": str(self.rd.final_dir),
                "best": ({"dir": str(self.rd.best_dir), **self.best.record} if self.best.record else None),
                "train": {k: last.get(k) for k in ("loss", "tau", "acc_mean")} if last else None,
                "heldout": ({k: v for k, v in ev.items() if k != "by_source"} if ev else None),
                "tokens_per_s": round(self.done_tokens / wall, 1) if wall > 0 else None,
                "world_size": self.dist.world, "samples": len(tr.plan.train_idx), "heldout_samples": len(tr.heldout),
                "supervised_tokens": sum(self.curve.tokens.values()),
                "heldout_by_source": ({k: {"tau": v["tau"], "acc": v["acc"], "samples": v.get("samples")}
                                       for k, v in ev.get("by_source", {}).items()} if ev else {}),
                **({"cpu_s": round(budget.used, 2), "cpu_budget_s": budget.seconds} if budget is not None else {}),
                **({"draft_vocab_size": int(tr.vocab.numel())} if tr.vocab is not None else {}),
                **({"warm_start": tr.warm_start} if tr.warm_start is not None else {}),
                **(feed_summary(tr.feed) if tr.feed is not None else {})}


def feed_summary(feed: Any) -> dict:
    """train.features=engine: the queue's measured peak on disk and what was requested (logged too)."""
    st = feed.stats()
    log.info("engine feed: peak %d B on disk (prefetch %d, largest micro-batch %d B); %d rows requested, "
             "%d reused from the queue, %d on demand", st["engine_peak_disk_bytes"], st["engine_prefetch"],
             st["engine_batch_max_bytes"], st["engine_rows_requested"], st["engine_rows_reused"],
             st["engine_rows_on_demand"])
    return st
