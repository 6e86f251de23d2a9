"""`fit()`: the drafter training loop, readable top to bottom.

Usage:
    result = fit(cfg, rd)              # one process, or one rank under torchrun

Flow: contract + tokenized data (+ cached features) → target (frozen; online features, embedding,
head) → drafter (random or target init) → DDP/FSDP2 → AdamW + cosine → resume from the latest
complete checkpoint → per step: this rank's micro-batches of the deterministic global batch,
anchors, the step's global Σw (all-reduced), forward/backward per micro-batch, clip, step →
metrics, held-out simulated τ, checkpoints → `train/final/` (z-lab drafter dir).

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
import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from dflashkit.errors import UsageError
from dflashkit.family import new_drafter, reads_target_law
from dflashkit.family.contract import REPROBE_HINT, DrafterContract
from dflashkit.model.path_labels import path_depth
from dflashkit.train import checkpoint as ckpt
from dflashkit.train import guards
from dflashkit.train.data import BatchPlan, FeatureStore, first_of, load_tokenized
from dflashkit.train.heldout import BestKeeper, evaluate_heldout, log_eval
from dflashkit.train.levers import feature_scale_of, split_samples
from dflashkit.train.logging import CURVE_FILE, LearningCurve, MetricSink
from dflashkit.train.loss import DraftLoss
from dflashkit.train.objective import gamma_for, weight_sum
from dflashkit.train.optim import CpuBudget, build_optimizer, build_scheduler
from dflashkit.train.stats import StepStats
from dflashkit.train.stopping import StopOnSignal
from dflashkit.train.target_side import heldout_labels, target_side
from dflashkit.train.trainer import Trainer, autocast_dtype
from dflashkit.train.vocab import pick_draft_vocab
from dflashkit.train.parallel import (DistInfo, TargetParts, all_reduce_sum, barrier, init_distributed,
                                      shard_target, wrap_drafter)

if TYPE_CHECKING:
    from dflashkit.config import RunConfig
    from dflashkit.model.head import HeadOnlyTarget
    from dflashkit.model.target import Target
    from dflashkit.rundir import RunDir

log = logging.getLogger("dflashkit.train")


def setup(cfg: RunConfig, rd: RunDir, dist: DistInfo, *, open_feed: Callable[..., Any] | None = None,
          target: Target | None = None) -> Trainer:
    """Everything a step needs. train.features=engine: `open_feed` (the train stage passes
    `engines.feed.open_engine_feed`) opens the engine and its feed, which run until `Trainer.close`.
    `target`: a target already in memory instead of `cfg.target` (the GPU check's random
    Qwen3-8B-shaped target, whose weights exist nowhere on disk)."""
    opened: list[Any] = []
    try:
        return _setup(cfg, rd, dist, opened, open_feed, target)
    except BaseException:
        for feed in opened:
            feed.close()
        raise


def engine_feed_key(cfg: RunConfig, rd: RunDir, contract: DrafterContract, dist: DistInfo) -> dict[str, Any]:
    """What an engine queue's rows depend on (a queue left by a killed run is reused only when it matches)."""
    t = cfg.train
    return {"target_layer_ids": list(contract.target_layer_ids), "dtype": cfg.capture.dtype,
            "last_hidden": reads_target_law(t, contract.family), "seed": cfg.run.seed, "batch_size": t.batch_size,
            "grad_accum": t.grad_accum, "world": dist.world, "rank": dist.rank,
            "heldout": [t.heldout_samples, list(t.heldout_sources)], "train_samples": t.train_samples,
            "tokenize": (rd.manifest("tokenize") or {}).get("config_hash")}


def _setup(cfg: RunConfig, rd: RunDir, dist: DistInfo, opened: list[Any],
           open_feed: Callable[..., Any] | None, loaded: Target | None = None) -> Trainer:
    from dflashkit.model.target import load_target

    contract = DrafterContract.load(rd.contract_path)
    guards.check_drafter_overrides(cfg, contract, rd.contract_path)
    guards.check_family_objective(cfg, contract)
    warm = None
    if cfg.drafter.init not in ("random", "target"):  # a drafter dir: read and checked before any work
        from dflashkit.train.warm_start import check_fits, read_warm_start

        warm = read_warm_start(cfg.drafter.init)
        check_fits(warm, contract)
    data = load_tokenized(rd)
    if cfg.train.features == "cached":
        data.features = FeatureStore(rd.capture_dir, data.shards, contract.target_layer_ids)
        if cfg.train.labels == "target":
            data.features.require("next_ids", "train.labels=target reads the target's argmax from the shards")
        if cfg.train.on_path == "rollout":
            data.features.require_paths(path_depth(contract.block_size), "train.on_path=rollout learns it")
    elif cfg.train.features == "engine":  # rows from the engine as training consumes them (engines/feed.py)
        if open_feed is None:
            raise UsageError("train.features=engine is served by `dflashkit train` (and `dflashkit run`) only",
                             hint="train with train.features=cached or online here")
        feed = open_feed(cfg, contract, data, rd.stage_dir("train"), rank=dist.rank, world=dist.world,
                         key=engine_feed_key(cfg, rd, contract, dist))
        opened.append(feed)
        data.features = feed  # type: ignore[assignment]  # FeatureStore's reading API (has / require / get)
    target: Target | HeadOnlyTarget
    if loaded is None and head_only(cfg, data.features, contract):  # every output in the shards: embedding + head
        from dflashkit.model.head import load_head_only_target

        target = load_head_only_target(cfg.target, device=str(dist.device))
        parts = TargetParts(target.parts.embed, target.lm_head)
    else:
        full = loaded if loaded is not None else load_target(cfg.target, device=str(dist.device))
        target, parts = full, TargetParts(full.model.get_input_embeddings(), full.lm_head)
        if cfg.train.parallel.target == "shard":
            parts = shard_target(full, dist)
    contract.check(target, where=str(rd.contract_path), hint=REPROBE_HINT)
    train_idx, heldout = split_samples(cfg, data)
    if cfg.train.train_samples is not None:
        kept = first_of(train_idx, cfg.train.train_samples, seed=cfg.run.seed)
        log.info("train.train_samples: training on %d of %d training samples", len(kept), len(train_idx))
        train_idx = kept
    vocab = None
    if warm is not None:
        from dflashkit.train.warm_start import keep_source_vocab

        vocab = keep_source_vocab(warm, cfg.drafter.draft_vocab_size)
    if vocab is None:
        vocab = pick_draft_vocab(cfg, contract, target, data, train_idx)
    torch.manual_seed(cfg.run.seed)
    scale = feature_scale_of(cfg, contract, target, data, train_idx) if cfg.drafter.feature_scale == "rms" else None
    drafter = new_drafter(contract, draft_vocab=vocab, feature_scale=scale).to(dist.device)
    warm_report = None
    if cfg.drafter.init == "target":
        from dflashkit.model.init import init_from_target

        init_from_target(drafter, target, cfg.drafter.init_layer_ids)
    elif warm is not None:
        from dflashkit.train.warm_start import warm_start

        warm_report = warm_start(drafter, warm, contract)
    if cfg.train.compile:
        for layer in drafter.layers:
            layer.compile()
    attention = cfg.drafter.attention
    if attention == "flex" and dist.device.type != "cuda":
        log.warning("drafter.attention=flex needs CUDA for training (flex backward); using sdpa on %s", dist.device)
        attention = "sdpa"
    drafter = wrap_drafter(drafter, cfg.train.parallel.mode, dist)
    plan = BatchPlan(train_idx, cfg.train.batch_size, cfg.train.grad_accum, dist.world, cfg.run.seed)
    amp = autocast_dtype(cfg.train.dtype, dist.device)
    loss = DraftLoss.from_train(cfg.train, contract, gamma=gamma_for(cfg.train.gamma, contract.block_size),
                                attention=attention, amp=amp)
    tr = Trainer(cfg, contract, dist, drafter, target, parts, data, plan, heldout, loss)
    tr.use_draft_vocab(vocab)
    tr.target_side = target_side(cfg.train, contract, target, parts, device=dist.device, amp=amp,
                                 store=data.features)
    tr.heldout_labels, tr.heldout_paths = heldout_labels(cfg.train, data.features, target, data, heldout,
                                                         path_depth(contract.block_size))
    tr.warm_start = warm_report
    tr.feed = opened[0] if opened else None
    return tr


def head_only(cfg: RunConfig, store: FeatureStore | None, contract: DrafterContract) -> bool:
    """Whether training needs only the target's embedding and head (model/head.py), not its layers: the
    features, and the labels / KL target the recipe asks for, all come from the feature shards, and the
    drafter is not initialised from the target's layers (`drafter.init: target`)."""
    train = cfg.train
    if train.features not in ("cached", "engine") or store is None or cfg.drafter.init == "target":
        return False
    return (train.labels != "target" or store.has("next_ids")) and (
        not reads_target_law(train, contract.family) or store.has("last_hidden"))


def total_steps(cfg: RunConfig, plan: BatchPlan) -> int:
    if cfg.train.max_steps:
        return int(cfg.train.max_steps)
    return max(1, math.ceil(cfg.train.epochs * len(plan.train_idx) / plan.global_batch))


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
        norm = torch.nn.utils.clip_grad_norm_(params, tr.cfg.train.grad_clip if tr.cfg.train.grad_clip > 0 else
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
        cpu_budget_s: float | None = None, open_feed: Callable[..., Any] | None = None) -> dict:
    """Train (or resume) until the configured number of steps; returns the final metrics.

    `cpu_budget_s` (`bench recipe` at equal CPU-minutes): stop once the optimizer steps have used this
    much process CPU time (or at the configured steps, whichever comes first); the lr schedule runs
    over the steps the budget affords (`optim.CpuBudget`)."""
    guards.preflight(cfg, rd)  # every refusal before any work (`train --dry-run` makes the same ones)
    dist = dist or init_distributed(cfg.train.parallel, cfg.target.device)
    tr = setup(cfg, rd, dist, open_feed=open_feed)
    try:
        return _fit(cfg, rd, tr, dist, show_bar=show_bar, cpu_budget_s=cpu_budget_s)
    finally:
        tr.close()


def engine_schedule(tr: Trainer, start: int, steps: int) -> tuple[Callable[[int], tuple[int, int, list[int]]], int]:
    """The training micro-batches of steps start..steps-1 on this rank, in the order `train_step` builds
    them: k → (step, micro-batch, sample indices), and their count (what the engine feed prefetches)."""
    import threading

    p = tr.plan
    plan = BatchPlan(p.train_idx, p.batch_size, p.grad_accum, p.world, p.seed)  # the feed's own copy
    lock = threading.Lock()  # the feed's producer and the training loop both ask (BatchPlan caches one epoch)

    def item(k: int) -> tuple[int, int, list[int]]:
        step, m = divmod(k, p.grad_accum)
        with lock:
            return start + step, m, [i for i, _ in plan.micro_batches(start + step, tr.dist.rank)[m]]

    return item, max(0, steps - start) * p.grad_accum


def _fit(cfg, rd, tr: Trainer, dist: DistInfo, *, show_bar: bool, cpu_budget_s: float | None) -> dict:
    steps = total_steps(cfg, tr.plan)
    opt = build_optimizer(tr.drafter, cfg.train)
    if cpu_budget_s and dist.world > 1:  # each rank would measure its own CPU time, stop and schedule alone
        raise UsageError("a CPU-time budget (bench.cpu_minutes) needs one process",
                         hint="run `dflashkit bench recipe` without torchrun")
    budget = CpuBudget(cpu_budget_s, steps) if cpu_budget_s else None
    sched = build_scheduler(opt, total_steps=steps, warmup_ratio=cfg.train.warmup_ratio,
                            min_lr_ratio=cfg.train.min_lr_ratio, budget=budget)
    out_dir = rd.stage_dir("train")
    ck_root = out_dir / "checkpoints"
    start, state = 0, None
    traj = guards.trajectory(cfg, rd)  # read once: what every checkpoint records and a resume must match
    found = ckpt.latest_checkpoint(ck_root)
    if found is not None:  # another run's checkpoint is refused by name before any of it is loaded
        state = ckpt.checkpoint_state(found)
        guards.check_objective(found, state, cfg.train)
        guards.check_trajectory(found, state, cfg, rd)
        start = ckpt.load_checkpoint(found, model=tr.drafter, optimizer=opt, scheduler=sched)
        tr.sync_draft_vocab()
    sink = MetricSink(out_dir, total_steps=steps, start_step=start, train=cfg.train, enabled=dist.is_main,
                      show_bar=show_bar)
    best = BestKeeper(out_dir, tr, cfg.train.keep_best)
    best.restore(start, state)
    n_train = max(1, len(tr.plan.train_idx))
    curve = LearningCurve(out_dir / CURVE_FILE, sorted(set(tr.sources())), enabled=dist.is_main,
                          supervised_per_sample=round(sum(float(tr.data.loss_mask[i].sum())
                                                          for i in tr.plan.train_idx) / n_train, 2),
                          tokens_per_sample=round(sum(len(tr.data.input_ids[i]) for i in tr.plan.train_idx)
                                                  / n_train, 2))
    curve.restore(start, (state or {}).get("curve"))
    if tr.feed is not None:
        tr.feed.start(*engine_schedule(tr, start, steps))
    log.info("training %d steps from step %d: %d train / %d held-out samples, global batch %d, world %d",
             steps, start, len(tr.plan.train_idx), len(tr.heldout), tr.plan.global_batch, dist.world)
    last, last_eval, t0, done_tokens = {}, None, time.perf_counter(), 0

    def evaluated(n: int) -> None:
        nonlocal last_eval
        ev = evaluate_heldout(tr, n)
        if ev:
            last_eval = ev
            log_eval(sink, ev)
            curve.record(n, ev)
            best.offer(ev)

    def extra_state() -> dict:
        return {"curve": curve.state_dict(), "objective": guards.objective(cfg.train),
                "trajectory": traj,
                **({"best": best.record} if best.record else {})}

    ok, stop = False, StopOnSignal(dist)  # SIGTERM: checkpoint at the next step boundary, then exit 143
    try:
        stop.install()
        if start == 0 and tr.warm_start is not None:  # where the warm start begins: its held-out loss and τ
            tr.drafter.eval()
            evaluated(0)
        tr.drafter.train()
        for step in range(start, steps):
            ts, cs = time.perf_counter(), time.process_time()
            last = train_step(tr, step, opt, sched)
            dt = time.perf_counter() - ts
            if budget is not None:
                budget.charge(time.process_time() - cs)
            done_tokens += last["tokens"]
            curve.add_step(tr.supervised_tokens(step), last.pop("_window"), seconds=dt)
            last.update(tok_s=round(last["tokens"] / dt, 1), anchors_s=round(last["blocks"] / dt, 1),
                        step_time_s=round(dt, 4))
            n = step + 1
            if n % max(1, cfg.train.log_every) == 0 or n == steps or n == start + 1:
                sink.log(last)
            sink.progress(n, loss=last["loss"], tau=last["tau"], tok_s=last["tok_s"])
            if cfg.train.eval_every and n % cfg.train.eval_every == 0 and n != steps:
                evaluated(n)
            if cfg.train.save_every and n % cfg.train.save_every == 0 and n != steps:
                ckpt.save_checkpoint(ck_root, step=n, model=tr.drafter, optimizer=opt, scheduler=sched,
                                     is_main=dist.is_main, keep=cfg.train.keep_checkpoints, extra=extra_state())
                barrier(dist)
            if budget is not None and budget.spent():
                log.info("CPU budget of %.1f s spent after %d steps", budget.seconds, n)
                steps = n
                break
            if n < steps and stop.agreed(n):  # every rank stops after the same step, with its checkpoint
                saved = ck_root / f"step-{n:07d}"
                if not (cfg.train.save_every and n % cfg.train.save_every == 0):
                    ckpt.save_checkpoint(ck_root, step=n, model=tr.drafter, optimizer=opt, scheduler=sched,
                                         is_main=dist.is_main, keep=cfg.train.keep_checkpoints, extra=extra_state())
                    barrier(dist)
                stop.exit(n, saved)
        tr.drafter.eval()
        if start < steps and not (last_eval and last_eval["step"] == steps):
            evaluated(steps)
            ckpt.save_checkpoint(ck_root, step=steps, model=tr.drafter, optimizer=opt, scheduler=sched,
                                 is_main=dist.is_main, keep=cfg.train.keep_checkpoints, extra=extra_state())
        elif last_eval is None:
            last_eval = evaluate_heldout(tr, steps)
        ckpt.save_final(out_dir / "final", tr.drafter, tr.contract, is_main=dist.is_main)
        barrier(dist)
        if stop.agreed(steps):  # signalled during the last step or the final evaluation: finished, then 143
            stop.exit(steps, None, finished=True)
        ok = True
    finally:
        stop.restore()
        sink.close(ok=ok)
    wall = time.perf_counter() - t0
    return {"steps": steps, "resumed_from": start, "final_dir": str(out_dir / "final"),
            "best": ({"dir": str(out_dir / "best"), **best.record} if best.record else None),
            "train": {k: last.get(k) for k in ("loss", "tau", "acc_mean")} if last else None,
            "heldout": ({k: v for k, v in last_eval.items() if k != "by_source"} if last_eval else None),
            "tokens_per_s": round(done_tokens / wall, 1) if wall > 0 else None,
            "world_size": dist.world, "samples": len(tr.plan.train_idx), "heldout_samples": len(tr.heldout),
            "supervised_tokens": sum(curve.tokens.values()),
            "heldout_by_source": ({k: {"tau": v["tau"], "acc": v["acc"], "samples": v.get("samples")}
                                   for k, v in last_eval.get("by_source", {}).items()} if last_eval else {}),
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
