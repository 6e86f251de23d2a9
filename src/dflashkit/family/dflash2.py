"""DFlash2 (z-lab with inco.ai): DFlash + block-local grouped convolutions + a candidate selector's walk.

Usage:
    from dflashkit.family.dflash2 import DFLASH2
    drafter = DFLASH2.network.build(contract, None, None)         # model/dflash2.py's DFlash2DraftModel
    terms = DFLASH2.terms(cfg.train.weights)                 # [SelectorTerm(train.selector_loss_weight)]
    tokens, law = DFLASH2.decoding.propose(drafter, h, logits, anchor, sampling, None, vocab_size)   # the walk

Everything dflashkit knows about DFlash2 beside its network (`model/dflash2.py`, which mirrors vLLM
0.32's `qwen3_dflash2.py`; read, not copied):
  * knobs (contract fields = `drafter.*` keys = `dflash_config` keys): DFlash's `causal` (family/dflash.py:
    vLLM resolves a DFlash2 layer's in-block causality exactly as a DFlash layer's), `conv_kernel_size`,
    `conv_group_size`, `selector_rank`, `selector_top_k`, and the optional `input_embedding_scale`,
    `output_multiplier`, `final_logit_softcapping` (written only when set). vLLM's speculators reader
    (`update_dflash2`) carries the first four only, so an optional one that is set cannot travel in
    that format.
  * checkpoints: `architectures ["DFlash2DraftModel"]`; beside DFlash's tensors
    `layers.{i}.{attention_conv,mlp_conv}.*` and `candidate_selector.*` (the markers below).
  * full target vocabulary only (the selector indexes its codebooks by target id).
  * `drafter.init` may start from a DFlash checkpoint (`model.dflash2.init_from_dflash`: the shared
    tensors; identity convolutions, so it computes the DFlash hidden states exactly).
  * the loss adds the selector's K-way CE after the gold predecessor (`SelectorTerm`; the gold label
    replaces the K-th candidate when the top-K misses it), with the unary term's position weights
    times `train.selector_loss_weight`; the head's logits are scored as the unary scores U.
  * metrics: `tau` / `acc` are the walk's (what the decoder drafts, greedy over the strict top-K),
    `unary_tau` / `unary_acc` the unary argmax's, plus `topk_coverage`, `selector_acc`, `selector_loss`.
  * decoding: the walk (`propose`); at T > 0 it is Gumbel-noised and its law over the K candidates is
    the q of the rejection rule.
  * vLLM runs the selector on its V2 model runner only (Triton); the z-lab PyPI loop has no DFlash2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dflashkit.errors import UsageError
from dflashkit.family.base import (Decoding, DraftBlock, DraftSampling, Family, Formats, Network, Objective, Rows,
                                   Scored, StatField, json_float, json_int, ratio, refuse_draft_vocab,
                                   walk_reload_check)
from dflashkit.family.dflash import DFlashKnobs
from dflashkit.family.dflash import card_lines as dflash_card_lines
from dflashkit.family.dflash import dflash_config as dflash_keys
from dflashkit.family.dflash import hf_keys as dflash_hf_keys
from dflashkit.family.dflash import read_knobs as dflash_knobs
from dflashkit.family.knobs import knob

if TYPE_CHECKING:
    from dflashkit.family.base import ContractSpec
    import torch


REQUIRED = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
OPTIONAL = ("input_embedding_scale", "output_multiplier", "final_logit_softcapping")


@dataclass(frozen=True)
class DFlash2Knobs(DFlashKnobs):
    """DFlash2's contract fields (`drafter.*` keys), after DFlash's `causal` (vLLM resolves a DFlash2 layer's
    attention as a DFlash layer's: family/dflash.py)."""

    conv_kernel_size: int = knob(2, "dflash2: taps of the block-local convolution (tap j reads the position j "
                                 "back in the same block; never across a block boundary).", ge=1)
    conv_group_size: int = knob(16, "dflash2: channels per convolution group (one dynamic kernel delta per "
                                "group and token); must divide the hidden size.", ge=1)
    selector_rank: int = knob(256, "dflash2: rank r of the selector's token codebooks (2 codebooks of V x r "
                              "parameters: 84M for V = 163,840 and r = 256; `dflashkit plan` shows them).", ge=1)
    selector_top_k: int = knob(16, "dflash2: candidates K per block position (the unary head's top-K) that the "
                               "selector's walk chooses from.", ge=1)
    input_embedding_scale: float | None = knob(
        None, "dflash2: multiplies the block's input embeddings; null = 1 (not written).", gt=0)
    output_multiplier: float | None = knob(
        None, "dflash2: multiplies the unary logits; null = 1 (not written).", gt=0)
    final_logit_softcapping: float | None = knob(
        None, "dflash2: unary logits become cap·tanh(logits / cap); null = none.", gt=0)


@dataclass(frozen=True)
class DFlash2Weights:
    """DFlash2's `train.*` key."""

    selector_loss_weight: float = knob(
        1.0, "drafter.type=dflash2: weight of the selector's loss (a K-way cross-entropy over each position's "
        "top-K candidates, scored after the gold previous token; the gold token replaces the K-th candidate "
        "when it is missing) beside the unary DFlash loss, with the same position weights.", ge=0)


# -- config, contract, config.json ------------------------------------------------------------------------------
def contract_problems(c: ContractSpec) -> list[str]:
    """What makes the knobs (in their declared ranges) unusable for this contract's target."""
    k: DFlash2Knobs = c.knobs
    p = []
    if c.hidden_size % k.conv_group_size:
        p.append(f"conv_group_size {k.conv_group_size} must divide hidden_size {c.hidden_size}")
    if k.selector_top_k > max(1, c.vocab_size):
        p.append(f"selector_top_k {k.selector_top_k} must be in [1, vocab_size {c.vocab_size}]")
    return p


def dflash_config(c: ContractSpec) -> dict[str, Any]:
    """The `dflash_config` keys vLLM's `qwen3_dflash2.py` reads; the optional ones only when set."""
    k: DFlash2Knobs = c.knobs
    out: dict[str, Any] = {name: getattr(k, name) for name in REQUIRED}
    for name in OPTIONAL:
        if getattr(k, name) is not None:
            out[name] = float(getattr(k, name))
    return {**out, **dflash_keys(c)}


def read_knobs(cfg: dict[str, Any], dc: dict[str, Any], source: str) -> dict[str, Any]:
    """The knobs of a `DFlash2DraftModel` config.json (`dflash_config`); UsageError naming a missing key."""
    missing = [f"dflash_config.{k}" for k in REQUIRED if dc.get(k) is None]
    if missing:
        raise UsageError(f"{source}: a DFlash2DraftModel config without {missing}",
                         hint="re-export the drafter (vLLM reads these keys from dflash_config)")
    out: dict[str, Any] = {k: json_int(dc[k], f"dflash_config.{k}", source) for k in REQUIRED}
    for k in OPTIONAL:
        if dc.get(k) is not None:
            out[k] = json_float(dc[k], f"dflash_config.{k}", source)
    return {**out, **dflash_knobs(cfg, dc, source)}


# -- the network ------------------------------------------------------------------------------------------------
def build(contract: ContractSpec, draft_vocab: torch.Tensor | None = None, feature_scale: torch.Tensor | None = None):
    """A new random DFlash2 drafter (`model.dflash2.DFlash2DraftModel`); a draft vocab is refused."""
    from dflashkit.model.dflash2 import DFlash2DraftModel

    refuse_draft_vocab(DFLASH2, None if draft_vocab is None else int(draft_vocab.numel()), where="draft vocabulary")
    return DFlash2DraftModel(contract, feature_scale=feature_scale)


def from_dflash(model: Any, state: dict) -> dict:
    """`drafter.init` from a DFlash checkpoint: its shared tensors (`model.dflash2.init_from_dflash`)."""
    from dflashkit.model.dflash2 import init_from_dflash

    return init_from_dflash(model, state)


# -- training ---------------------------------------------------------------------------------------------------
def scores(model: Any, logits: torch.Tensor) -> torch.Tensor:
    """The unary scores U (the head's logits × output_multiplier, soft-capped)."""
    return model.unary(logits)


@dataclass(frozen=True)
class SelectorTerm:
    """The selector's loss: per supervised row, a K-way CE over its strict top-K scored after the gold
    predecessor, the gold label replacing the K-th candidate when missing (in the loss only); the row's
    position weight × `weight`. It also re-scores the blocks by the greedy walk (what the decoder drafts)."""

    weight: float = 1.0
    name: str = "selector"
    needs_prev: bool = True
    needs_target: bool = False

    def chunk(self, rows: Rows):
        return selector_rows(rows.model, rows.scores, rows.hidden, rows.labels, rows.prev)

    def total(self, parts: list, row_w: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        import torch

        sel_ce = torch.cat([p[0] for p in parts]) if parts else row_w.new_zeros(0)
        sel_loss = (row_w * sel_ce).sum()
        stats = {"selector_rows": float(row_w.numel()),
                 "selector_covered": float(sum(float(p[3].sum()) for p in parts)),
                 "selector_correct": float(sum(float(p[4].sum()) for p in parts)),
                 "selector_loss": float(sel_loss.detach())}
        return self.weight * sel_loss, stats

    def rescore(self, s: Scored) -> tuple[torch.Tensor, dict[str, Any]]:
        """τ and accuracy of the walk; the unary argmax's kept as `unary_*`."""
        walked = walk_tokens(s.model, s.hidden, s.rows, s.parts, s.input_ids, s.anchors,
                             block_size=s.labels.shape[-1])
        walk_ok = (walked == s.labels) & s.supervised
        return walk_ok, {"unary_correct": s.ok.sum(dim=(0, 1)).float().cpu(), "unary_tau_sum": s.tau_sum(s.ok)}


def loss_terms(w: DFlash2Weights) -> list:
    return [SelectorTerm(weight=w.selector_loss_weight)]


def selector_rows(model: Any, unary: torch.Tensor, h: torch.Tensor, labels: torch.Tensor, prev: torch.Tensor):
    """The selector on supervised rows: (CE over the K candidates after the gold predecessor, with the gold label
    inserted as the K-th candidate when the unary top-K misses it; strict top-K ids [rows, K]; their unary
    scores [rows, K]; gold covered [rows]; selector correct [rows] (strict, no insertion))."""
    import torch
    import torch.nn.functional as F

    k = model.top_k
    ids = torch.topk(unary.detach(), k, dim=-1).indices                      # [rows, K] strict candidates
    covered = (ids == labels[:, None]).any(-1)
    cand = ids.clone()
    cand[~covered, -1] = labels[~covered]                                    # gold insertion (training only)
    sc = model.candidate_selector.pair_scores(prev[:, None], cand, unary.gather(-1, cand), h)[:, 0]
    gold = (cand == labels[:, None]).long().argmax(-1)
    ce = F.cross_entropy(sc, gold, reduction="none")
    correct = covered & (sc.detach().argmax(-1) == gold)                     # with gold covered, cand == ids
    return ce, ids, unary.detach().gather(-1, ids), covered, correct


def walk_tokens(model: Any, hidden: torch.Tensor, rows: torch.Tensor, parts: list, input_ids: torch.Tensor,
                a: Any, *, block_size: int) -> torch.Tensor:
    """[b, N, B] the greedy walk's tokens per block (slot 0: −1), from the supervised rows' strict top-K.

    Rows without logits (unsupervised) get candidate id 0 and unary 0; the walk through them is never
    scored (τ and accuracy count supervised positions only and stop at the first unsupervised one)."""
    import torch

    from dflashkit.model.dflash2 import walk_path

    with torch.no_grad():
        b, n = a.anchors.shape
        k = model.top_k
        cand = torch.zeros(b * n * block_size, k, dtype=torch.long, device=hidden.device)
        unary = torch.zeros(b * n * block_size, k, dtype=torch.float32, device=hidden.device)
        if parts:
            cand[rows] = torch.cat([p[1] for p in parts])
            unary[rows] = torch.cat([p[2] for p in parts])
        cand, unary = cand.view(b * n, block_size, k)[:, 1:], unary.view(b * n, block_size, k)[:, 1:]
        h = hidden.view(b * n, block_size, -1)[:, 1:]
        anchor = torch.gather(input_ids, 1, a.anchors).flatten()
        tokens, _ = walk_path(model.candidate_selector, cand, unary, h, anchor)
        out = torch.full((b * n, block_size), -1, dtype=torch.long, device=hidden.device)
        out[:, 1:] = tokens
        return out.view(b, n, block_size)


STATS = (StatField("unary_tau_sum"), StatField("unary_correct", "B"), StatField("selector_rows"),
         StatField("selector_covered"), StatField("selector_correct"), StatField("selector_loss", loss=True))


METRICS = ("unary_tau", "unary_acc", "selector_acc", "topk_coverage", "selector_loss")


def metrics(stats: Any) -> dict[str, Any]:
    """`METRICS`: unary τ / accuracy (the argmax's) and the selector's coverage, accuracy and loss."""
    x = stats.extra
    return {"unary_tau": float(x["unary_tau_sum"] / max(stats.blocks, 1)),
            "unary_acc": [ratio(c, t) for c, t in zip(x["unary_correct"][1:], stats.total[1:])],
            "selector_acc": ratio(x["selector_correct"], x["selector_rows"]),
            "topk_coverage": ratio(x["selector_covered"], x["selector_rows"]),
            "selector_loss": float(x["selector_loss"])}


# -- decoding ---------------------------------------------------------------------------------------------------
def propose(drafter: Any, h: torch.Tensor, logits: torch.Tensor, anchor: int, sampling: DraftSampling,
            vocab: torch.Tensor | None, vocab_size: int, block: DraftBlock | None = None
            ) -> tuple[list[int], torch.Tensor | None]:
    """The walk over each position's top-K candidates → (tokens, draft law [k, V] or None).

    Greedy (temperature 0) walks the best edges: a point mass. Otherwise the walk is Gumbel-noised, i.e.
    position t draws from q_t = softmax(row_t / T) over its K candidates, row_t being the edge scores
    after the token drawn at t − 1: q_t (0 outside the candidates) is the law the rejection rule needs."""
    import torch

    del vocab, block  # the full vocabulary (build refuses a draft vocab); the walk reads h and the logits only
    temp = sampling.temperature
    tokens, ids, rows = drafter.draft(h, logits[None], h.new_tensor([anchor], dtype=torch.long),
                                      temperature=temp, generator=sampling.generator)
    if temp <= 0:
        return tokens[0].tolist(), None
    q = torch.softmax(rows[0].float() / temp, dim=-1)                          # [k, K]
    full = q.new_zeros(q.shape[0], vocab_size).scatter_(1, ids[0], q)
    return tokens[0].tolist(), full


# -- plan, export -----------------------------------------------------------------------------------------------
def lookup_params(c: ContractSpec) -> int:
    """The selector's codebooks (predecessor + successor, V × r each): 2·V·r, looked up, not multiplied
    (2·r·(K+1) FLOPs per drafted position, whatever V is)."""
    return 2 * c.vocab_size * c.knobs.selector_rank


def reload_check(source: Any, reloaded: Any, head: torch.Tensor | None) -> dict[str, Any]:
    """The export reload check's selector part: the same greedy walk over random anchors (exact when the export
    holds the source's weights bit for bit: float32)."""
    import torch

    return walk_reload_check(source, reloaded, head, title="DFlash2",
                             walk=lambda model, h, logits, ctx, anchors: model.draft(h, logits, anchors)[0],
                             extra=lambda g: torch.randint(0, source.contract.vocab_size, (3,), generator=g))


def card_lines(c: ContractSpec) -> list[str]:
    return dflash_card_lines(c) + ["DFlash2: vLLM runs the candidate selector on its V2 model runner only (GPU, Triton); its V1 "
            "runner (the CPU build) refuses the checkpoint. `dflash.py`'s DFlash2DraftModel computes the "
            "block's hidden states and holds the selector; `dflashkit eval` / `serve --drafter` draft "
            "through the walk.", ""]


DFLASH2 = Family(
    name="dflash2",
    title="DFlash2",
    network=Network(build=build, init_from={"dflash": from_dflash},
                    tensor_markers=("attention_conv.", "mlp_conv.", "candidate_selector."), reduced_vocab=False,
                    scores=scores, lookup_params=lookup_params),
    objective=Objective(loss_terms=loss_terms, stats=STATS, metrics=metrics, metric_names=METRICS),
    formats=Formats(architecture="DFlash2DraftModel", dflash_config=dflash_config, hf_keys=dflash_hf_keys,
                    read_knobs=read_knobs, speculators_keys=REQUIRED, reload_check=reload_check,
                    card_lines=card_lines),
    decoding=Decoding(propose=propose, vllm_runner="v2"),
    knobs=DFlash2Knobs,
    weights=DFlash2Weights,
    contract_problems=contract_problems,
)
