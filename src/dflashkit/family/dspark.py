"""DSpark: the DFlash drafter plus a sequential low-rank Markov head and an acceptance-confidence head.

Usage:
    from dflashkit.family.dspark import DSPARK
    drafter = DSPARK.network.build(contract, None, None)   # model/dspark.py's Qwen3DSparkModel
    terms = DSPARK.terms(cfg.train.weights)                # [ConfidenceTerm, MarkovTerm]
    tokens, law = DSPARK.decoding.propose(drafter, h, logits, anchor, sampling, vocab, vocab_size)   # the walk

Everything dflashkit knows about DSpark beside its network (`model/dspark.py`, whose tensors are vLLM 0.32's
`Qwen3DSparkModel`'s; `qwen3_dspark.py` and the V2 `DSparkSpeculator`, read, not copied):
  * knobs: DFlash's (`causal`, the attention), `dspark_markov_rank` (r), `dspark_confidence_head`,
    `dspark_confidence_with_markov`; config.json carries them at the top level as vLLM reads them:
    `markov_rank`, `enable_confidence_head`, `confidence_head_with_markov`, `markov_head_type: vanilla`.
  * the block is DFlash's `[anchor, MASK, ...]` (block position j predicts the token at j), which vLLM calls
    `sample_from_anchor: false`; exports write that key (vLLM's default, true, is another layout: the anchor
    itself predicts the first draft token), and a config.json without it is refused on import.
  * checkpoints: `architectures ["Qwen3DSparkModel"]`; beside DFlash's tensors `markov_head.markov_w1.weight`
    [V, r], `markov_head.markov_w2.weight` [V', r] and, with the head, `confidence_head.proj.{weight,bias}`
    [1, H (+ r)], [1]. The speculators format (`speculators_model_type: dspark`, vLLM's `dspark` reader) carries
    `markov_rank`, `markov_head_type` and the confidence flags at its top level (`speculators_top_keys`); a
    released checkpoint in it (pruned vocab with `d2t` / `t2d`, its own taps and block size) imports as it is.
  * a reduced draft vocabulary is allowed (`d2t`): markov_w1 reads target ids, markov_w2 writes the V' rows.
  * `drafter.init` may start from a DFlash checkpoint (the DSpark heads start fresh).
  * the loss (beside CE / KL on the head's logits): `MarkovTerm`, the CE of the logits with the Markov bias
    of the gold previous token (`train.dspark_markov_loss_weight`), and `ConfidenceTerm`, the BCE of the
    confidence head against whether that biased argmax is the label (the target detached;
    `train.dspark_confidence_loss_weight`).
  * metrics: `tau` / `acc` are the Markov walk's (teacher-forced: exact for τ, since a walk that accepted the
    first j positions read their gold tokens), `base_tau` the head's argmax's, plus `markov_loss`,
    `confidence_loss`, `confidence_mean`, `confidence_hit_rate` (calibration: the two should agree) and
    `confidence_brier`.
  * decoding: position t's logits = head logits + bias(token at t − 1), drafted left to right; at T > 0
    each position's law, conditioned on the previous draw, is the q of the rejection rule.
  * vLLM serves DSpark on its V2 model runner only (`DSparkSpeculator`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dflashkit.errors import UsageError
from dflashkit.family.base import (Decoding, DraftBlock, DraftSampling, Family, Formats, Network, Objective, Rows,
                                   Scored, StatField, json_int, ratio, walk_reload_check)
from dflashkit.family.dflash import DFlashKnobs
from dflashkit.family.dflash import card_lines as dflash_card_lines
from dflashkit.family.dflash import dflash_config as dflash_keys
from dflashkit.family.dflash import hf_keys as dflash_hf_keys
from dflashkit.family.dflash import read_knobs as dflash_knobs
from dflashkit.family.knobs import knob

if TYPE_CHECKING:
    from dflashkit.family.base import ContractSpec
    import torch



@dataclass(frozen=True)
class DSparkKnobs(DFlashKnobs):
    """DSpark's contract fields (`drafter.*` keys), after DFlash's."""

    dspark_markov_rank: int = knob(256, "dspark: rank r of the Markov head (markov_w1: V x r embedding of the "
                                   "previous token, markov_w2: r x V' projection onto the head's logits).", ge=1)
    dspark_confidence_head: bool = knob(True, "dspark: train a confidence head (sigmoid of a linear map of the "
                                        "final hidden state) estimating each drafted position's acceptance.")
    dspark_confidence_with_markov: bool = knob(False, "dspark: the confidence head also reads the previous "
                                               "token's Markov embedding (vLLM's confidence_head_with_markov).")


@dataclass(frozen=True)
class DSparkWeights:
    """DSpark's `train.*` keys."""

    dspark_markov_loss_weight: float = knob(
        1.0, "drafter.type=dspark: weight of the CE of the head's logits plus the Markov bias of the gold previous "
        "token (what the walk drafts), with the CE term's position weights.", ge=0)
    dspark_confidence_loss_weight: float = knob(
        0.1, "drafter.type=dspark: weight of the confidence head's BCE against whether the Markov-biased argmax "
        "is the label (with drafter.dspark_confidence_head).", ge=0)


# -- config.json ------------------------------------------------------------------------------------------------
def hf_keys(c: ContractSpec) -> dict[str, Any]:
    """The top-level keys vLLM's `Qwen3DSparkModel` and DSpark speculator read, beside DFlash's."""
    k: DSparkKnobs = c.knobs
    return {**dflash_hf_keys(c), "markov_rank": int(k.dspark_markov_rank), "markov_head_type": "vanilla",
            "enable_confidence_head": bool(k.dspark_confidence_head),
            "confidence_head_with_markov": bool(k.dspark_confidence_with_markov), "sample_from_anchor": False}


def _flag(cfg: dict[str, Any], key: str, source: str, default: bool) -> bool:
    value = cfg.get(key, default)
    if not isinstance(value, bool):
        raise UsageError(f"{source}: {key} must be true or false, got {value!r}",
                         hint=f"fix {source}: write the JSON boolean without quotes")
    return value


def read_knobs(cfg: dict[str, Any], dc: dict[str, Any], source: str) -> dict[str, Any]:
    """The knobs of a `Qwen3DSparkModel` config.json; UsageError naming a missing or malformed key, or a layout
    dflashkit does not draft (`sample_from_anchor` true or absent, a Markov head other than vanilla)."""
    if cfg.get("markov_rank") is None:
        raise UsageError(f"{source}: a Qwen3DSparkModel config without markov_rank",
                         hint="re-export the drafter (vLLM reads markov_rank from the top level of config.json)")
    kind = cfg.get("markov_head_type", "vanilla")
    if kind != "vanilla":
        raise UsageError(f"{source}: markov_head_type {kind!r}; dflashkit drafts with the vanilla Markov head only",
                         hint="use a checkpoint with markov_head_type vanilla")
    if _flag(cfg, "sample_from_anchor", source, True):
        raise UsageError(f"{source}: sample_from_anchor is true (or absent: vLLM's default), so the anchor itself "
                         "predicts the first draft token; dflashkit's DSpark drafts DFlash's block, where block "
                         "position j predicts the token at j (sample_from_anchor: false)",
                         hint="use a checkpoint exported with sample_from_anchor: false (dflashkit's exports)")
    return {"dspark_markov_rank": json_int(cfg["markov_rank"], "markov_rank", source),
            "dspark_confidence_head": _flag(cfg, "enable_confidence_head", source, False),
            "dspark_confidence_with_markov": _flag(cfg, "confidence_head_with_markov", source, False),
            **dflash_knobs(cfg, dc, source)}


# -- the network ------------------------------------------------------------------------------------------------
def build(contract: ContractSpec, draft_vocab: torch.Tensor | None = None, feature_scale: torch.Tensor | None = None):
    """A new random DSpark drafter (`model.dspark.Qwen3DSparkModel`)."""
    from dflashkit.model.dspark import Qwen3DSparkModel

    return Qwen3DSparkModel(contract, draft_vocab=draft_vocab, feature_scale=feature_scale)


def from_dflash(model: Any, state: dict) -> dict:
    """`drafter.init` from a DFlash checkpoint: its tensors; the DSpark heads as initialised."""
    from dflashkit.model.dspark import init_from_dflash

    return init_from_dflash(model, state)


def lookup_params(c: ContractSpec) -> int:
    """markov_w1 (V × r): looked up, not multiplied."""
    return c.vocab_size * c.knobs.dspark_markov_rank


# -- training ---------------------------------------------------------------------------------------------------
def markov_rows(rows: Rows) -> tuple[torch.Tensor, torch.Tensor]:
    """[r, V'] the rows' scores plus the Markov bias of their gold predecessors (float32), and [r] whether their
    argmax is the label."""
    assert rows.prev is not None  # needs_prev
    logits = rows.scores + rows.model.markov_bias(rows.prev).float()
    return logits, logits.detach().argmax(-1) == rows.labels


@dataclass(frozen=True)
class MarkovTerm:
    """The CE of the Markov-biased logits after the gold predecessor, with the rows' position weights × `weight`;
    its verdicts (teacher-forced argmax) replace the head's for τ and accuracy."""

    weight: float = 1.0
    name: str = "dspark_markov"
    needs_prev: bool = True
    needs_target: bool = False

    def chunk(self, rows: Rows):
        import torch.nn.functional as F

        logits, ok = markov_rows(rows)
        return F.cross_entropy(logits, rows.labels, reduction="none"), ok

    def total(self, parts: list, row_w: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        import torch

        ce = torch.cat([p[0] for p in parts]) if parts else row_w.new_zeros(0)
        loss = (row_w * ce).sum()
        return self.weight * loss, {"markov_loss": float(loss.detach())}

    def rescore(self, s: Scored) -> tuple[torch.Tensor, dict[str, Any]]:
        import torch

        ok = torch.zeros(s.labels.numel(), dtype=torch.bool, device=s.labels.device)
        if s.parts:
            ok[s.rows] = torch.cat([p[1] for p in s.parts]).to(ok.device)
        ok = ok.view(s.labels.shape) & s.supervised
        return ok, {"base_tau_sum": s.tau_sum(s.ok)}


@dataclass(frozen=True)
class ConfidenceTerm:
    """The confidence head's BCE against whether the Markov-biased argmax after the gold predecessor is the label
    (the target detached), with the rows' position weights × `weight`; nothing without a confidence head."""

    weight: float = 0.1
    name: str = "dspark_confidence"
    needs_prev: bool = True
    needs_target: bool = False

    def chunk(self, rows: Rows):
        import torch.nn.functional as F

        if rows.model.confidence_head is None:
            return None
        _, ok = markov_rows(rows)
        y = ok.float()
        z = rows.model.confidence_logits(rows.hidden, rows.prev)
        return F.binary_cross_entropy_with_logits(z, y, reduction="none"), y, z.detach().sigmoid()

    def total(self, parts: list, row_w: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        import torch

        parts = [p for p in parts if p is not None]
        stats = {"confidence_loss": 0.0, "confidence_rows": 0.0, "confidence_sum": 0.0, "confidence_hits": 0.0,
                 "confidence_sq_err": 0.0}
        if not parts:
            return row_w.new_zeros(()), stats
        bce, y, p = (torch.cat([q[i] for q in parts]) for i in range(3))
        loss = (row_w * bce).sum()
        stats.update(confidence_loss=float(loss.detach()), confidence_rows=float(y.numel()),
                     confidence_sum=float(p.sum()), confidence_hits=float(y.sum()),
                     confidence_sq_err=float(((p - y) ** 2).sum()))
        return self.weight * loss, stats

    def rescore(self, s: Scored) -> tuple[None, dict[str, Any]]:
        return None, {}


def loss_terms(w: DSparkWeights) -> list:
    """The two terms, in the loss's canonical order (by name)."""
    return [ConfidenceTerm(weight=w.dspark_confidence_loss_weight),
            MarkovTerm(weight=w.dspark_markov_loss_weight)]


STATS = (StatField("base_tau_sum"), StatField("markov_loss", loss=True), StatField("confidence_loss", loss=True),
         StatField("confidence_rows"), StatField("confidence_sum"), StatField("confidence_hits"),
         StatField("confidence_sq_err"))

METRICS = ("base_tau", "markov_loss", "confidence_loss", "confidence_mean", "confidence_hit_rate",
           "confidence_brier")


def metrics(stats: Any) -> dict[str, Any]:
    """`METRICS`: the head argmax's τ, the Markov CE, and the confidence head's BCE and calibration (its mean
    estimate beside the rate it estimates, and the Brier score); None where no row was scored."""
    x = stats.extra
    return {"base_tau": float(x["base_tau_sum"] / max(stats.blocks, 1)),
            "markov_loss": float(x["markov_loss"]),
            "confidence_loss": float(x["confidence_loss"]),
            "confidence_mean": ratio(x["confidence_sum"], x["confidence_rows"]),
            "confidence_hit_rate": ratio(x["confidence_hits"], x["confidence_rows"]),
            "confidence_brier": ratio(x["confidence_sq_err"], x["confidence_rows"])}


# -- decoding ---------------------------------------------------------------------------------------------------
def propose(drafter: Any, h: torch.Tensor, logits: torch.Tensor, anchor: int, sampling: DraftSampling,
            vocab: torch.Tensor | None, vocab_size: int, block: DraftBlock | None = None
            ) -> tuple[list[int], torch.Tensor | None]:
    """The Markov walk of one block → (k target ids, draft law [k, V] or None for point masses).

    Position t drafts from its head logits plus the bias of the token drafted at t − 1 (the anchor for t = 1):
    the argmax at temperature 0, else a draw from that row's sampling law, which (0 outside a reduced vocab) is
    the q of the rejection rule at t, conditioned on the drafts before it."""
    del h, block
    if sampling.temperature <= 0:
        tokens, _ = drafter.draft(logits, anchor, vocab=vocab)
        return tokens, None
    assert sampling.law is not None and sampling.draw is not None  # the decoder hands both at T > 0
    tokens, q = drafter.draft(logits, anchor, vocab=vocab, law=sampling.law, draw=sampling.draw,
                              generator=sampling.generator)
    if vocab is None:
        return tokens, q
    return tokens, q.new_zeros(q.shape[0], vocab_size).index_copy_(1, vocab, q)


def confidence(drafter: Any, h: torch.Tensor, logits: torch.Tensor, anchor: int, tokens: list[int]) -> list[float]:
    """Each proposed token's acceptance probability for the draft-length policy: the confidence head's estimate
    when the drafter has one (trained on whether the draft was accepted), else the softmax of the Markov-biased
    logits at the token (the bias of the token before it, as `propose` drafted it)."""
    import torch

    if drafter.confidence_head is not None:
        return [float(x) for x in drafter.proposal_confidence(h, anchor, tokens).float().tolist()]
    prev = torch.tensor([anchor, *tokens[:-1]], dtype=torch.long, device=logits.device)
    biased, _ = drafter.heads(h.reshape(-1, h.shape[-1])[:len(tokens)], logits[:len(tokens)], prev)
    idx = torch.tensor(tokens, device=logits.device)
    vocab = drafter.draft_vocab
    if vocab is not None:  # target ids → draft indices (the vocab is sorted)
        vocab = vocab.to(logits.device)
        idx = torch.searchsorted(vocab, idx).clamp(max=vocab.numel() - 1)
    probs = torch.softmax(biased.float(), dim=-1)
    return probs.gather(-1, idx[:, None])[:, 0].tolist()


# -- export -----------------------------------------------------------------------------------------------------
def reload_check(source: Any, reloaded: Any, head: torch.Tensor | None) -> dict[str, Any]:
    """The export reload check's DSpark part: the same greedy Markov walk over random anchors (exact when the
    export holds the source's weights bit for bit: float32)."""
    import torch

    def walk(model: Any, h: torch.Tensor, logits: torch.Tensor, ctx: torch.Tensor, anchors: torch.Tensor):
        return torch.tensor([model.draft(logits[i], int(anchors[i]), vocab=model.draft_vocab)[0]
                             for i in range(logits.shape[0])])

    if source.draft_vocab is not None and head is None:
        return {}  # a random head of V rows cannot score a V'-row Markov bias
    return walk_reload_check(source, reloaded, head, title="DSpark", walk=walk,
                             extra=lambda g: torch.randint(0, source.contract.vocab_size, (3,), generator=g))


def card_lines(c: ContractSpec) -> list[str]:
    k: DSparkKnobs = c.knobs
    return dflash_card_lines(c) + [
        f"DSpark: a Markov head of rank {k.dspark_markov_rank} adds a bias from the previous token to each block "
        "position's logits (drafted left to right), " + ("and a confidence head estimates each draft's "
        "acceptance. " if k.dspark_confidence_head else "no confidence head. ") + "vLLM serves it on its V2 model "
        "runner (`Qwen3DSparkModel`, `sample_from_anchor: false`); `dflashkit eval` / `serve --drafter` draft "
        "through the same walk.", ""]


DSPARK = Family(
    name="dspark",
    title="DSpark",
    network=Network(build=build, init_from={"dflash": from_dflash},
                    tensor_markers=("markov_head.", "confidence_head."), reduced_vocab=True,
                    lookup_params=lookup_params),
    objective=Objective(loss_terms=loss_terms, stats=STATS, metrics=metrics, metric_names=METRICS),
    formats=Formats(architecture="Qwen3DSparkModel", dflash_config=dflash_keys, hf_keys=hf_keys,
                    read_knobs=read_knobs, reload_check=reload_check, card_lines=card_lines,
                    speculators_top_keys=("markov_rank", "markov_head_type", "enable_confidence_head",
                                          "confidence_head_with_markov")),
    decoding=Decoding(propose=propose, vllm_runner="v2", vllm_method="dspark", confidence=confidence),
    knobs=DSparkKnobs,
    weights=DSparkWeights,
)
