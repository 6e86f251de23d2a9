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
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dflashkit.errors import UsageError
from dflashkit.model.draft_vocab import label_token_counts, restricted_head, vocab_from_counts
from dflashkit.model.dflash2 import drafter_for
from dflashkit.model.drafter_config import REPROBE_HINT, DrafterContract
from dflashkit.model.target import target_autocast
from dflashkit.train import checkpoint as ckpt
from dflashkit.train import guards
from dflashkit.train.data import Batch, BatchPlan, FeatureStore, TokenData, collate, load_tokenized, split_heldout
from dflashkit.train.levers import feature_scale_of, held_out_sources
from dflashkit.train.logging import LearningCurve, MetricSink
from dflashkit.train.objective import dflash_loss, gamma_for, sample_anchors, target_label_ids, weight_sum
from dflashkit.train.optim import CpuBudget, build_optimizer, build_scheduler
from dflashkit.train.parallel import (DistInfo, TargetParts, all_reduce_sum, barrier, init_distributed,
                                      shard_target, wrap_drafter)

if TYPE_CHECKING:
    from dflashkit.config import RunConfig
    from dflashkit.model.head import HeadOnlyTarget
    from dflashkit.model.target import Target
    from dflashkit.rundir import RunDir

log = logging.getLogger("dflashkit.train")


def feature_noise(feats: torch.Tensor, b: Batch, *, scale: float, n_feat: int) -> torch.Tensor:
    """Training-only feature noise: feats + U(−scale, scale)·RMS, per token and target layer.

    speculators (`train/noise_transforms.py`, AddUniformNoise, std 0.05) adds an absolute
    U(−0.05, 0.05) to every element of the raw target hidden states, whatever their size; target
    residual streams differ by orders of magnitude between channels and models (SmolLM2: channel
    RMS 5 … 1,650), so the noise here is relative: U(−scale, scale) times the RMS of each token's
    H-dim feature of each target layer (scale 0.05 ≈ speculators' noise on unit-RMS features).
    Each sample draws from its own seeded generator over its true length only (padding gets none),
    so the noise does not depend on the batch a sample lands in or on the number of ranks.
    """
    bsz, s, d = feats.shape
    h = d // n_feat
    noise = torch.zeros(bsz, s, d, dtype=torch.float32)
    for i in range(bsz):
        n = int(b.seq_lens[i])
        g = torch.Generator().manual_seed((int(b.seeds[i]) ^ 0x5DEECE66D) & 0x7FFFFFFFFFFFFFFF)
        noise[i, :n] = torch.rand(n, d, generator=g) * 2 - 1
    f = feats.float().view(bsz, s, n_feat, h)
    rms = f.pow(2).mean(-1, keepdim=True).sqrt()
    out = f + noise.to(feats.device).view(bsz, s, n_feat, h) * rms * scale
    return out.view(bsz, s, d).to(feats.dtype)


def autocast_dtype(train_dtype: str, device: torch.device) -> torch.dtype | None:
    if train_dtype == "bfloat16" or (train_dtype == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


@dataclass
class TargetOut:
    """The target's side of one micro-batch (see `Trainer.target_outputs`)."""

    features: torch.Tensor                  # [b, S, n_feat·H]
    logits: torch.Tensor | None = None      # [b, S, V] (sharded targets, for KL)
    last_hidden: torch.Tensor | None = None  # [b, S, H] final-norm output (for KL)
    label_ids: torch.Tensor | None = None   # [b, S] labels from the target (train.labels=target)


@dataclass
class Trainer:
    """Everything one step needs (built by `setup`)."""

    cfg: RunConfig
    contract: DrafterContract
    dist: DistInfo
    drafter: torch.nn.Module
    target: Target | HeadOnlyTarget  # head-only when every target output comes from the feature shards
    parts: TargetParts
    data: TokenData
    plan: BatchPlan
    heldout: list[int]
    gamma: float
    attention: str
    amp: torch.dtype | None
    head: torch.nn.Module | None = None       # the loss's head: parts.lm_head, or its rows `vocab`
    vocab: torch.Tensor | None = None         # reduced draft vocab (sorted target ids), on the device
    warm_start: dict | None = None            # drafter.init=<dir>: what was copied (train/warm_start.py)

    def __post_init__(self):
        if self.head is None:
            self.head = self.parts.lm_head

    def use_draft_vocab(self, vocab: torch.Tensor | None) -> None:
        """Train over `vocab` (None: the full vocab): the restricted head is built here, once."""
        self.vocab = None if vocab is None else vocab.to(self.dist.device)
        self.head = self.parts.lm_head if vocab is None else restricted_head(self.parts.lm_head, self.vocab)

    def sync_draft_vocab(self) -> None:
        """After a resume: the checkpoint's d2t (loaded into the drafter) wins over today's choice."""
        loaded = getattr(self.drafter, "module", self.drafter).draft_vocab
        if loaded is None or (self.vocab is not None and torch.equal(loaded.cpu(), self.vocab.cpu())):
            return
        log.warning("the checkpoint's draft vocab differs from the one chosen from today's data; "
                    "continuing with the checkpoint's")
        self.use_draft_vocab(loaded)

    def target_outputs(self, b: Batch) -> "TargetOut":
        """What the loss needs from the target for batch `b`: features (cached or online), the labels
        (`train.labels`), and the target's distribution for KL (logits, or its last hidden state)."""
        t = self.cfg.train
        need_kl = t.loss != "ce"
        need_labels = t.labels == "target"
        have_labels = b.next_ids is not None
        have_kl = b.last_hidden is not None
        if b.features is not None and (have_labels or not need_labels) and (have_kl or not need_kl):
            labels = target_label_ids(b.input_ids, b.next_ids) if need_labels else None
            return TargetOut(b.features, None, b.last_hidden if need_kl else None, labels)
        logits = hidden = None
        tamp = target_autocast(t.target_dtype, self.dist.device, self.target.dtype)
        with torch.no_grad(), torch.autocast(self.dist.device.type, dtype=tamp, enabled=tamp is not None):
            if self.parts.sharded:  # a sharded target gives logits, not its final-norm hidden state
                feats, out = self.target.features(b.input_ids, layer_ids=self.contract.target_layer_ids,
                                                  need_logits=True, attention_mask=b.attention_mask)
                logits = out.logits
                nxt = logits.argmax(-1) if need_labels else None
            elif need_labels or need_kl:
                feats, hidden = self.target.features(b.input_ids, layer_ids=self.contract.target_layer_ids,
                                                     need_last_hidden=True, attention_mask=b.attention_mask)
                nxt = self.target.next_token_ids(hidden) if need_labels else None
            else:
                feats, nxt = self.target.features(b.input_ids, layer_ids=self.contract.target_layer_ids,
                                                  attention_mask=b.attention_mask), None
        if b.next_ids is not None and need_labels:
            nxt = b.next_ids
        feats = b.features if b.features is not None else feats
        feats = feats.float() if self.amp is None else feats
        labels = target_label_ids(b.input_ids, nxt) if need_labels else None
        return TargetOut(feats, logits if need_kl else None, hidden if need_kl and logits is None else None, labels)

    def micro_loss(self, b: Batch, a, denom: float | None, tout: "TargetOut | None" = None, *,
                   training: bool = False):
        tout = tout or self.target_outputs(b)
        t = self.cfg.train
        feats = tout.features
        if training and t.feature_noise > 0:
            feats = feature_noise(feats, b, scale=t.feature_noise, n_feat=len(self.contract.target_layer_ids))
        return dflash_loss(self.drafter, self.parts.embed, self.head, feats, b.input_ids, b.loss_mask,
                           b.seq_lens, a, mask_token_id=self.contract.mask_token_id, gamma=self.gamma, denom=denom,
                           loss=t.loss, kl_weight=t.kl_weight, target_logits=tout.logits,
                           target_hidden=tout.last_hidden, target_head=self.parts.lm_head,
                           chunk_blocks=t.loss_chunk_blocks, attention=self.attention, autocast_dtype=self.amp,
                           vocab=self.vocab, label_ids=tout.label_ids, position_weighting=t.position_weighting,
                           dpace_alpha=t.dpace_alpha, selector_weight=t.selector_loss_weight,
                           context=not t.ablate_features)

    def denom_gamma(self) -> float | None:
        """γ of the step denominator Σw: none (a plain count of supervised positions) under D-PACE."""
        return None if self.cfg.train.position_weighting == "dpace" else self.gamma

    def sources(self) -> list[str]:
        """Each sample's data source (`TokenData.source`; "all" for samples without one)."""
        src = getattr(self.data, "source", None) or [""] * len(self.data)
        return [s or "all" for s in src]

    def supervised_tokens(self, step: int) -> dict[str, int]:
        """Supervised (loss_mask) tokens of the step's GLOBAL batch, all ranks, by source."""
        src, out = self.sources(), {}  # type: list[str], dict[str, int]
        for rank in range(self.dist.world):
            for items in self.plan.micro_batches(step, rank):
                for i, _ in items:
                    out[src[i]] = out.get(src[i], 0) + int(self.data.loss_mask[i].sum())
        return out

    def batch(self, items) -> Batch:
        pad = self.target.tokenizer.pad_token_id if getattr(self.target, "tokenizer", None) else 0
        t = self.cfg.train
        cached = t.features == "cached"
        store = self.data.features
        return collate(self.data, items, run_seed=self.cfg.run.seed, pad_id=pad or 0, with_features=cached,
                       with_next_ids=cached and t.labels == "target" and store is not None and store.has("next_ids"),
                       with_last_hidden=cached and t.loss != "ce" and store is not None and store.has("last_hidden")
                       ).to(self.dist.device)

    def anchors(self, b: Batch):
        return sample_anchors(b.loss_mask, b.seq_lens, num_anchors=self.cfg.train.num_anchors,
                              block_size=self.contract.block_size, seeds=b.seeds,
                              coverage=self.cfg.train.anchor_coverage)


def setup(cfg: RunConfig, rd: RunDir, dist: DistInfo) -> Trainer:
    from dflashkit.model.target import load_target

    contract = DrafterContract.load(rd.contract_path)
    guards.check_drafter_overrides(cfg, contract, rd.contract_path)
    check_recipe(cfg.train)
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
    target: Target | HeadOnlyTarget
    if head_only(cfg.train, data.features):  # every target output is in the shards: embedding + head suffice
        from dflashkit.model.head import load_head_only_target

        target = load_head_only_target(cfg.target, device=str(dist.device))
        parts = TargetParts(target.parts.embed, target.lm_head)
    else:
        full = load_target(cfg.target, device=str(dist.device))
        target, parts = full, TargetParts(full.model.get_input_embeddings(), full.lm_head)
        if cfg.train.parallel.target == "shard":
            parts = shard_target(full, dist)
    contract.check(target, where=str(rd.contract_path), hint=REPROBE_HINT)
    train_idx, heldout = split_heldout(len(data), cfg.train.heldout_samples, seed=cfg.run.seed)
    if cfg.train.heldout_sources:
        train_idx, heldout = held_out_sources(cfg, data, train_idx, heldout)
    vocab = None
    if warm is not None:
        from dflashkit.train.warm_start import keep_source_vocab

        vocab = keep_source_vocab(warm, cfg.drafter.draft_vocab_size)
    if vocab is None:
        vocab = pick_draft_vocab(cfg, contract, target, data, train_idx)
    torch.manual_seed(cfg.run.seed)
    scale = feature_scale_of(cfg, contract, target, data, train_idx) if cfg.drafter.feature_scale == "rms" else None
    drafter = drafter_for(contract, draft_vocab=vocab, feature_scale=scale).to(dist.device)
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
    tr = Trainer(cfg, contract, dist, drafter, target, parts, data, plan, heldout,
                 gamma_for(cfg.train.gamma, contract.block_size), attention,
                 autocast_dtype(cfg.train.dtype, dist.device))
    tr.use_draft_vocab(vocab)
    tr.warm_start = warm_report
    return tr


def head_only(train, store: FeatureStore | None) -> bool:
    """Whether training needs only the target's embedding and head (model/head.py), not its layers: the
    features, and the labels / KL target the recipe asks for, all come from the feature shards."""
    if train.features != "cached" or store is None:
        return False
    return (train.labels != "target" or store.has("next_ids")) and (train.loss == "ce" or store.has("last_hidden"))


def check_recipe(train) -> None:
    """Range checks of the recipe keys (exit 2, naming the key)."""
    problems = []
    if not 0 < train.dpace_alpha <= 1:
        problems.append(f"train.dpace_alpha {train.dpace_alpha} is outside (0, 1]")
    if train.anchor_coverage is not None and not 0 < train.anchor_coverage <= 1:
        problems.append(f"train.anchor_coverage {train.anchor_coverage} is outside (0, 1]")
    if train.optimizer == "muon" and train.parallel.mode == "fsdp":
        problems.append("train.optimizer=muon does not support train.parallel.mode=fsdp (use ddp or none)")
    if not train.feature_noise >= 0:
        problems.append(f"train.feature_noise {train.feature_noise} is negative")
    if problems:
        raise UsageError("; ".join(problems), hint="e.g. train.dpace_alpha=0.5 train.feature_noise=0")


def pick_draft_vocab(cfg, contract: DrafterContract, target, data, train_idx: list[int]) -> torch.Tensor | None:
    """The reduced draft vocab for `drafter.draft_vocab_size` (None: unset, 0, or the whole vocab).

    The most frequent supervised tokens of the training samples (held-out ones excluded) plus the
    eos ids of the contract and the tokenizer; the same on every rank (a pure function of the data).
    """
    n, vocab_size = cfg.drafter.draft_vocab_size, target.vocab_size
    if not n:
        return None
    if n > vocab_size:
        raise UsageError(f"drafter.draft_vocab_size {n} exceeds the target vocab of {vocab_size} tokens",
                         hint=f"use at most {vocab_size}, or null for the full vocab")
    if n == vocab_size:
        log.info("drafter.draft_vocab_size %d is the whole target vocab: training over the full vocab", n)
        return None
    eos = contract.eos_token_id
    always = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    tok_eos = getattr(getattr(target, "tokenizer", None), "eos_token_id", None)
    if tok_eos is not None:
        always.add(int(tok_eos))
    labels = [data.input_ids[i] for i in train_idx]
    if cfg.train.labels == "target":  # the labels trained on are the target's own predictions: count those
        labels = target_labels_of(cfg, contract, target, data, train_idx)
    counts = label_token_counts(labels, [data.loss_mask[i] for i in train_idx], vocab_size)
    vocab = vocab_from_counts(counts, n, always=always)
    log.info("draft vocab: %d of %d target tokens, covering %.2f%% of the training label tokens", n, vocab_size,
             100 * counts[vocab.numpy()].sum() / max(1, counts.sum()))
    return vocab


def target_labels_of(cfg, contract: DrafterContract, target, data, idx: list[int]) -> list:
    """`train.labels=target` labels of samples `idx` (np.int64 arrays): from the cached `next_ids`, or
    (online) from one batched prefill pass of the target over those samples."""
    import numpy as np

    out = []
    if data.features is not None and data.features.has("next_ids"):
        for i in idx:
            nxt = data.features.get(data.where[i], len(data.input_ids[i]), "next_ids").to(torch.long)[None]
            out.append(target_label_ids(torch.from_numpy(data.input_ids[i])[None], nxt)[0].numpy())
        return out
    log.info("draft vocab: labelling %d training samples with the target (one prefill pass)", len(idx))
    pad = (getattr(getattr(target, "tokenizer", None), "pad_token_id", None) or 0)
    bs = max(1, cfg.train.batch_size)
    for k in range(0, len(idx), bs):
        items = [(i, 0) for i in idx[k:k + bs]]
        b = collate(data, items, run_seed=0, pad_id=pad).to(target.device)
        with torch.no_grad():
            _, hidden = target.features(b.input_ids, layer_ids=contract.target_layer_ids, need_last_hidden=True,
                                        attention_mask=b.attention_mask)
            lab = target_label_ids(b.input_ids, target.next_token_ids(hidden)).cpu()
        out.extend(lab[r, :int(n)].numpy().astype(np.int64) for r, n in enumerate(b.seq_lens.tolist()))
    return out


def total_steps(cfg, plan: BatchPlan) -> int:
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
    touts = [tr.target_outputs(b) for b in batches]
    local_w = sum(weight_sum(b.loss_mask, b.seq_lens, a, input_ids=b.input_ids, block_size=B,
                             gamma=tr.denom_gamma(), vocab=tr.vocab, label_ids=o.label_ids)
                  for b, a, o in zip(batches, anchors, touts))
    denom = float(all_reduce_sum(torch.tensor([local_w], dtype=torch.float64), tr.dist)[0])
    stats = torch.zeros(stats_size(B), dtype=torch.float64)  # loss, tau_sum, blocks, tokens, correct, total, +
    for b, a, o in zip(batches, anchors, touts):
        out = tr.micro_loss(b, a, denom, o, training=True)
        if denom > 0:
            (out.loss * tr.dist.world).backward()
        stats[0] += float(out.loss.detach())
        stats[1] += out.tau_sum
        stats[2] += out.blocks
        stats[3] += float(b.seq_lens.sum())
        stats[4:4 + B] += out.correct.double()
        stats[4 + B:4 + 2 * B] += out.total.double()
        stats[4 + 2 * B:] += _dflash2_stats(out, B, loss_scale=1 / max(denom, 1e-6))
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
    stats = all_reduce_sum(stats, tr.dist)  # loss terms were divided by the global Σw: the sum is the mean
    return _metrics(stats, B, step + 1, dflash2=tr.contract.is_dflash2, lr=lr, grad_norm=grad_norm)


def stats_size(B: int) -> int:
    """Length of a step's summable statistics: loss, τ sum, blocks, tokens, correct [B], total [B], then
    DFlash2's unary τ sum, unary correct [B] and selector rows, covered, correct, loss."""
    return 4 + 2 * B + 1 + B + 4


def _dflash2_stats(out, B: int, *, loss_scale: float) -> torch.Tensor:
    """The DFlash2 tail of the statistics (zeros for a DFlash drafter)."""
    tail = torch.zeros(1 + B + 4, dtype=torch.float64)
    if out.selector is None:
        return tail
    tail[0] = out.unary_tau_sum
    tail[1:1 + B] = out.unary_correct.double()
    sel = out.selector.as_list()
    tail[1 + B:] = torch.tensor(sel[:3] + [sel[3] * loss_scale], dtype=torch.float64)
    return tail


def _ratio(a: torch.Tensor, b: torch.Tensor) -> float | None:
    return round(float(a / b), 4) if b > 0 else None


def _metrics(stats: torch.Tensor, B: int, step: int, *, dflash2: bool = False, **extra) -> dict:
    """Metrics of summed statistics; a DFlash2 drafter's τ / acc are the walk's, `unary_*` the argmax's."""
    correct, total = stats[4:4 + B], stats[4 + B:4 + 2 * B]
    acc = [_ratio(c, t) for c, t in zip(correct[1:], total[1:])]
    out = {"step": step, "loss": float(stats[0]), "tau": float(stats[1] / max(stats[2], 1)),
           "acc": acc, "acc_mean": float(correct[1:].sum() / max(total[1:].sum(), 1)),
           "blocks": int(stats[2]), "tokens": int(stats[3]),
           "_window": [float(stats[1]), float(stats[2]), float(correct[1]), float(total[1])], **extra}
    if dflash2:
        tail = stats[4 + 2 * B:]
        unary = tail[1:1 + B]
        rows, covered, sel_ok, sel_loss = tail[1 + B:]
        out.update(unary_tau=float(tail[0] / max(stats[2], 1)),
                   unary_acc=[_ratio(c, t) for c, t in zip(unary[1:], total[1:])],
                   selector_acc=_ratio(sel_ok, rows), topk_coverage=_ratio(covered, rows),
                   selector_loss=float(sel_loss))
    return out


@torch.no_grad()
def evaluate_heldout(tr: Trainer, step: int) -> dict | None:
    """Simulated τ / per-position accuracy on the held-out samples (fixed anchors; same on every rank).

    Samples are batched within their data source, so the result also holds `by_source` (the same
    numbers per source; the overall numbers are their pooled sums)."""
    if not tr.heldout:
        return None
    B = tr.contract.block_size
    src = tr.sources()
    groups: dict[str, list[int]] = {}
    for j in tr.heldout:
        groups.setdefault(src[j], []).append(j)
    bs = tr.cfg.train.batch_size
    total = torch.zeros(stats_size(B), dtype=torch.float64)
    by_source = {}
    for name in sorted(groups):
        stats = torch.zeros(stats_size(B), dtype=torch.float64)
        idx = groups[name]
        for i in range(0, len(idx), bs):
            b = tr.batch([(j, -1) for j in idx[i:i + bs]])
            a = tr.anchors(b)
            out = tr.micro_loss(b, a, None)
            stats[0] += float(out.loss) * out.weight_sum
            stats[1] += out.tau_sum
            stats[2] += out.blocks
            stats[3] += out.weight_sum
            stats[4:4 + 2 * B] += torch.cat([out.correct, out.total]).double()
            stats[4 + 2 * B:] += _dflash2_stats(out, B, loss_scale=1.0)
        total += stats
        by_source[name] = _heldout_row(stats, B, step, dflash2=tr.contract.is_dflash2, samples=len(idx))
    row = _heldout_row(total, B, step, dflash2=tr.contract.is_dflash2)
    return {"split": "heldout", **row, "by_source": by_source}


def _heldout_row(stats: torch.Tensor, B: int, step: int, *, dflash2: bool = False, **extra) -> dict:
    stats = stats.clone()
    stats[0] /= max(float(stats[3]), 1e-6)
    stats[-1] /= max(float(stats[3]), 1e-6)   # DFlash2's selector loss: Σ w·CE / Σ w, as the loss
    m = _metrics(stats, B, step, dflash2=dflash2)
    keys = ("unary_tau", "unary_acc", "selector_acc", "topk_coverage", "selector_loss") if dflash2 else ()
    return {"step": step, "loss": m["loss"], "tau": m["tau"], "acc": m["acc"], "acc_mean": m["acc_mean"],
            "blocks": m["blocks"], **{k: m[k] for k in keys}, **extra}


def _log_eval(sink: MetricSink, ev: dict) -> None:
    """The metrics.jsonl row of a held-out evaluation (per-source numbers only with several sources)."""
    row = {k: v for k, v in ev.items() if k != "by_source"}
    if len(ev.get("by_source", {})) > 1:
        row["by_source"] = {k: {"tau": v["tau"], "acc": v["acc"], "loss": v["loss"]}
                            for k, v in ev["by_source"].items()}
    sink.log(row)


class BestKeeper:
    """`train/best/`: the drafter of the held-out evaluation with the highest τ so far (earliest on ties)."""

    def __init__(self, out_dir, tr: Trainer, enabled: bool):
        self.dir, self.tr, self.enabled = out_dir / "best", tr, enabled
        self.record: dict | None = None

    def restore(self, start: int, state: dict | None) -> None:
        """Fresh run (or keep_best off): a stale best/ is removed. Resume: the checkpoint's record
        (else best.json, if it is not newer than the checkpoint) is the best so far."""
        if start == 0 or not self.enabled:
            if self.tr.dist.is_main and self.dir.exists():
                import shutil

                from dflashkit.rundir import check_replaceable

                check_replaceable(self.dir, owner="train", marker="model.safetensors")  # never a user's dir
                log.info("removing %s from an earlier run", self.dir)
                shutil.rmtree(self.dir)
            barrier(self.tr.dist)
            return
        if state is not None and "best" in state:
            self.record = state["best"]
            return
        rec = ckpt.read_best(self.dir)
        self.record = rec if rec is not None and rec["step"] <= start else None

    def offer(self, ev: dict | None) -> bool:
        """Save the drafter as best when `ev` beats the record; True when it did."""
        if not self.enabled or not ev:
            return False
        better = self.record is None or ev["tau"] > self.record["tau"]
        if self.tr.dist.world > 1:  # every rank gathers the weights: follow the main rank's decision
            flag = torch.tensor([1.0 if better and self.tr.dist.is_main else 0.0], dtype=torch.float64)
            better = float(all_reduce_sum(flag, self.tr.dist)[0]) > 0
        if not better:
            return False
        acc1 = ev["acc"][0] if ev["acc"] else None
        self.record = {"step": ev["step"], "tau": ev["tau"], "acc": ev["acc"], "acc_pos1": acc1,
                       "loss": ev["loss"]}
        ckpt.save_final(self.dir, self.tr.drafter, self.tr.contract, is_main=self.tr.dist.is_main, best=self.record)
        barrier(self.tr.dist)
        log.info("best held-out τ %.4f at step %d → %s", ev["tau"], ev["step"], self.dir)
        return True


def fit(cfg, rd, *, dist: DistInfo | None = None, show_bar: bool = True, cpu_budget_s: float | None = None) -> dict:
    """Train (or resume) until the configured number of steps; returns the final metrics.

    `cpu_budget_s` (`bench recipe` at equal CPU-minutes): stop once the optimizer steps have used this
    much process CPU time (or at the configured steps, whichever comes first); the lr schedule runs
    over the steps the budget affords (`optim.CpuBudget`)."""
    guards.check_outputs_ours(rd.root / "train", cfg)  # before any work: never replace what is not ours
    dist = dist or init_distributed(cfg.train.parallel, cfg.target.device)
    tr = setup(cfg, rd, dist)
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
    found = ckpt.latest_checkpoint(ck_root)
    if found is not None:
        start = ckpt.load_checkpoint(found, model=tr.drafter, optimizer=opt, scheduler=sched)
        state = ckpt.checkpoint_state(found)
        guards.check_objective(found, state, cfg.train)
        tr.sync_draft_vocab()
    sink = MetricSink(out_dir, total_steps=steps, start_step=start, train=cfg.train, enabled=dist.is_main,
                      show_bar=show_bar)
    best = BestKeeper(out_dir, tr, cfg.train.keep_best)
    best.restore(start, state)
    n_train = max(1, len(tr.plan.train_idx))
    curve = LearningCurve(out_dir / "curve.json", sorted(set(tr.sources())), enabled=dist.is_main,
                          supervised_per_sample=round(sum(float(tr.data.loss_mask[i].sum())
                                                          for i in tr.plan.train_idx) / n_train, 2),
                          tokens_per_sample=round(sum(len(tr.data.input_ids[i]) for i in tr.plan.train_idx)
                                                  / n_train, 2))
    curve.restore(start, (state or {}).get("curve"))
    log.info("training %d steps from step %d: %d train / %d held-out samples, global batch %d, world %d",
             steps, start, len(tr.plan.train_idx), len(tr.heldout), tr.plan.global_batch, dist.world)
    last, last_eval, t0, done_tokens = {}, None, time.perf_counter(), 0

    def evaluated(n: int) -> None:
        nonlocal last_eval
        ev = evaluate_heldout(tr, n)
        if ev:
            last_eval = ev
            _log_eval(sink, ev)
            curve.record(n, ev)
            best.offer(ev)

    def extra_state() -> dict:
        return {"curve": curve.state_dict(), "objective": guards.objective(cfg.train),
                **({"best": best.record} if best.record else {})}

    try:
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
        tr.drafter.eval()
        if start < steps and not (last_eval and last_eval["step"] == steps):
            evaluated(steps)
            ckpt.save_checkpoint(ck_root, step=steps, model=tr.drafter, optimizer=opt, scheduler=sched,
                                 is_main=dist.is_main, keep=cfg.train.keep_checkpoints, extra=extra_state())
        elif last_eval is None:
            last_eval = evaluate_heldout(tr, steps)
        ckpt.save_final(out_dir / "final", tr.drafter, tr.contract, is_main=dist.is_main)
        barrier(dist)
    finally:
        sink.close()
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
            **({"warm_start": tr.warm_start} if tr.warm_start is not None else {})}
