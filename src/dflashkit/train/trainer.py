"""`Trainer`: everything one training step needs, built once and complete by `train.loop.setup`.

Usage:
    tr = setup(cfg, rd, dist)                              # train/loop.py
    tr.recipe.target_labels                                # the run's resolved recipe (family/recipe.py)
    b = tr.batch(items); a = tr.anchors(b)                 # a collated micro-batch and its anchors
    out = tr.micro_loss(b, a, denom, training=True)        # `tr.loss` (train/loss.py) on the batch
    tr.use_draft_vocab(vocab)                              # the loss's head over a reduced draft vocab

`train/loop.py` (fit, train_step) and `train/heldout.py` (held-out evaluation, best keeping) both
take a Trainer; it holds the run's one loss object (`DraftLoss.from_train`: `train.*` and the
drafter family's terms), the frozen target parts it uses and the run's feature source (`target_side`).
Every field is given when it is built; only `use_draft_vocab` / `sync_draft_vocab` change the head.
It holds the settings a step reads (`train`: the run's train.*, `seed`: run.seed, the packing length, each
data source's thinking mode), not the run's config: `setup` is where the config is read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from dflashkit.family.contract import DrafterContract
from dflashkit.family.recipe import Recipe
from dflashkit.model.draft_vocab import restricted_head
from dflashkit.target.load import announce, compute_dtype
from dflashkit.train.data import Batch, BatchPlan, FeatureStore, TokenData, collate
from dflashkit.train.loss import DraftLoss, Heads, LossInputs, LossOutput
from dflashkit.train.objective import Anchors, sample_anchors
from dflashkit.train.parallel import DistInfo, TargetParts
from dflashkit.train.target_side import TargetOut, scored

if TYPE_CHECKING:
    from dflashkit.config import TrainSection
    from dflashkit.target.head import HeadOnlyTarget
    from dflashkit.target.load import Target
    from dflashkit.train.suffix_complement import SuffixComplement

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


def sources_of(data: TokenData) -> list[str]:
    """Each sample's data source (`TokenData.source`; "all" for samples without one)."""
    src = getattr(data, "source", None) or [""] * len(data)
    return [s or "all" for s in src]


def autocast_dtype(train_dtype: str, device: torch.device) -> torch.dtype | None:
    """The drafter's autocast dtype (`train.dtype`, as `compute_dtype` resolves it; announced once), or None."""
    choice = announce(compute_dtype(train_dtype, device, key="train.dtype"))
    return None if choice.dtype == torch.float32 else choice.dtype


@dataclass
class Trainer:
    """Everything one step needs (built by `setup`; `vocab` given here becomes the loss's head at once)."""

    train: TrainSection                       # the run's train.* (anchors, feature noise, packing, batch size)
    seed: int                                 # run.seed: each sample's seed in a batch
    recipe: Recipe                            # the run's resolved recipe (family/recipe.py)
    contract: DrafterContract
    dist: DistInfo
    drafter: torch.nn.Module
    target: Target | HeadOnlyTarget  # head-only when every target output comes from the feature shards
    parts: TargetParts
    data: TokenData
    plan: BatchPlan
    heldout: list[int]
    loss: DraftLoss                           # the run's loss (`train.*` + the drafter family's terms)
    target_side: Callable[..., TargetOut]     # train/target_side.py: this run's feature source
    vocab: torch.Tensor | None = None         # reduced draft vocab (sorted target ids), on the device
    warm_start: dict | None = None            # drafter.init=<dir>: what was copied (train/warm_start.py)
    feed: Any = None                          # train.features=engine: engines/feed.EngineFeed (also data.features)
    heldout_labels: str = "raw"               # the yardstick's labels (train/target_side.py heldout_scoring)
    heldout_paths: dict[int, torch.Tensor] | None = None  # held-out greedy paths computed at setup (online)
    complement: SuffixComplement | None = None  # train.suffix_complement (training micro-batches only)
    pack_length: int | None = None            # train.pack: the packed rows' length (train.pack_length or
                                              # tokenize.max_length); None: no packing
    modes: dict[str, str] = field(default_factory=dict)  # each data source's thinking mode (data.chat.source_modes)
    head: torch.nn.Module = field(init=False)  # the loss's head: parts.lm_head, or its rows `vocab`

    def __post_init__(self):
        self.use_draft_vocab(self.vocab)

    def close(self) -> None:
        """Stop what `setup` started: the engine feed (and the vLLM it runs), if any."""
        if self.feed is not None:
            self.feed.close()

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

    def target_outputs(self, b: Batch, a: Anchors | None = None) -> TargetOut:
        """What the loss needs from the target for batch `b` with anchors `a` (`train/target_side.py`: the
        builder of this run's feature source; an online rollout decodes the paths of `a`'s blocks only)."""
        return self.target_side(b, a)

    def heads(self) -> Heads:
        """The frozen target parts the loss uses (the loss's head follows `use_draft_vocab`)."""
        return Heads(self.parts.embed, self.head, self.vocab, self.parts.lm_head)

    def micro_loss(self, b: Batch, a: Anchors, denom: float | None, tout: TargetOut | None = None, *,
                   training: bool = False, scoring: str | None = None) -> LossOutput:
        """The loss and statistics of one micro-batch; `scoring` (held-out): the labels to score with
        (`target_side.scored`), else the training labels."""
        tout = tout or self.target_outputs(b, a)
        if scoring is not None:
            tout = scored(tout, b, scoring)
        t = self.train
        feats = tout.features
        if training and t.feature_noise > 0:
            feats = feature_noise(feats, b, scale=t.feature_noise, n_feat=len(self.contract.target_layer_ids))
        x = LossInputs(feats, b.input_ids, b.loss_mask, b.seq_lens, label_ids=tout.label_ids,
                       target_logits=tout.logits, target_hidden=tout.last_hidden, path_ids=tout.path_ids,
                       on_path_only=tout.on_path_only,
                       complement=self.complement if training else None)
        return self.loss(self.drafter, self.heads(), x, a, denom=denom)

    def denom_gamma(self) -> float | None:
        """γ of the step denominator Σw: the loss's weighting (none under D-PACE: a count of supervised positions)."""
        return self.loss.weighting.label_gamma

    def sources(self) -> list[str]:
        """Each sample's data source (`sources_of`)."""
        return sources_of(self.data)

    def supervised_tokens(self, step: int) -> dict[str, int]:
        """Supervised (loss_mask) tokens of the step's GLOBAL batch, all ranks, by source."""
        src, out = self.sources(), {}  # type: list[str], dict[str, int]
        for rank in range(self.dist.world):
            for items in self.plan.micro_batches(step, rank):
                for i, _ in items:
                    out[src[i]] = out.get(src[i], 0) + int(self.data.loss_mask[i].sum())
        return out

    def batch(self, items, *, heldout: bool = False) -> Batch:
        """The micro-batch of `items`; `heldout`: also what the held-out scoring reads (next ids, paths)."""
        pad = self.target.tokenizer.pad_token_id if getattr(self.target, "tokenizer", None) else 0
        r = self.recipe
        cached = r.from_store  # engine: the rows of these samples, staged from the engine
        store = self.data.features
        if self.feed is not None:
            self.feed.stage([i for i, _ in items])
        labels = r.target_labels or (heldout and self.heldout_labels == "on_path_positions")
        stored_paths = r.rollout or (heldout and self.heldout_labels == "target_path" and self.heldout_paths is None)
        return collate(self.data, items, run_seed=self.seed, pad_id=pad or 0, with_features=cached,
                       with_next_ids=cached and labels and store is not None and store.has("next_ids"),
                       with_last_hidden=cached and r.needs_target_logits and store is not None
                       and store.has("last_hidden"),
                       with_path_ids=cached and stored_paths and isinstance(store, FeatureStore),
                       paths=self.heldout_paths if heldout else None,
                       pack=self.pack_length if not heldout else None,
                       ).to(self.dist.device)

    def anchors(self, b: Batch) -> Anchors:
        return sample_anchors(b.loss_mask, b.seq_lens, num_anchors=self.train.num_anchors,
                              block_size=self.contract.block_size, seeds=b.seeds,
                              coverage=self.train.anchor_coverage, docs=b.docs)
