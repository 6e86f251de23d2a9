"""LiLiCorr (NVIDIA, arXiv 2608.20530): a DFlash backbone plus a lattice head that walks one coherent path.

Usage:
    from dflashkit.family.lilicorr import LILICORR
    drafter = LILICORR.network.build(contract, None, None)         # model/lilicorr.py's LiLiCorrDraftModel
    terms = LILICORR.terms(cfg.train.weights)                # [LatticeTerm(train.lilicorr_*)]
    tokens, law = LILICORR.decoding.propose(drafter, h, logits, anchor, sampling, None, V,
                                            block=DraftBlock(embed=target.embed, context=feats[:, -1]))   # the walk

What dflashkit knows about LiLiCorr beside its network (`model/lilicorr.py`, which mirrors vLLM's
`lilicorr.py`; the objective follows ModelOpt's `hf_lilicorr.py`; read, not copied), each part declared below:
its knobs (`LiLiCorrKnobs`: the `dflash_config` keys of the same names, K a power of 2 ≤ 16; the optional
backbone convolution is DFlash2's), its `train.lilicorr_*` weights, its tensors (`lilicorr.*`), the full
target vocabulary only, `drafter.init` from a DFlash or DFlash2 backbone, the lattice loss (`LatticeTerm`:
teacher-forced node CE + the target-logit penalty + an optional margin, each slot weighted like the unary
term), its metrics (the walk's τ / acc, the argmax's `unary_*`, `topk_coverage`, `lattice_*`), and its
decoding (the walk, which reads the target's embedding and the last committed features: `DraftBlock`;
Gumbel-noised at T > 0, its law over the K candidates the rejection rule's q). docs/architecture.md
("LiLiCorr drafters") gives the formulas, docs/engines.md which engines run it (vLLM's V2 runner only).
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
from dflashkit.family.dflash import fast_path as dflash_fast_path
from dflashkit.family.dflash import hf_keys as dflash_hf_keys
from dflashkit.family.dflash import read_knobs as dflash_knobs
from dflashkit.family.knobs import knob

if TYPE_CHECKING:
    from dflashkit.family.base import ContractSpec
    import torch

    from dflashkit.family.base import DrafterKeys

CONV = ("lilicorr_conv_kernel_size", "lilicorr_conv_group_size")   # → dflash_config conv_kernel_size, conv_group_size
HEAD = ("lilicorr_candidate_topk", "lilicorr_hidden_size", "lilicorr_num_layers", "lilicorr_num_heads",
        "lilicorr_mlp_ratio", "lilicorr_factor_dim", "lilicorr_vector_eps", "lilicorr_logit_scale")
FLOATS = ("lilicorr_mlp_ratio", "lilicorr_vector_eps", "lilicorr_logit_scale")


@dataclass(frozen=True)
class LiLiCorrKnobs(DFlashKnobs):
    """LiLiCorr's contract fields (`drafter.*` keys), after DFlash's `causal` (vLLM's LiLiCorr backbone is
    `DFlashQwen3Model`: it resolves in-block causality as DFlash's)."""

    lilicorr_candidate_topk: int = knob(8, "lilicorr: candidates K per block position (the head's top-K) in the "
                                        "lattice; a power of 2, at most 16 (vLLM's limit).")
    lilicorr_hidden_size: int = knob(0, "lilicorr: width of the lattice transformer; 0 = the draft width.", ge=0)
    lilicorr_num_layers: int = knob(2, "lilicorr: lattice transformer layers (pre-norm, over all S·K candidates).",
                                    ge=1)
    lilicorr_num_heads: int = knob(8, "lilicorr: attention heads of the lattice transformer (must divide its "
                                   "width).", ge=1)
    lilicorr_mlp_ratio: float = knob(2.0, "lilicorr: MLP width of a lattice layer / its width.", gt=0)
    lilicorr_factor_dim: int = knob(256, "lilicorr: width F of the normalised out / in factor vectors whose dot "
                                    "products score adjacent candidates (ModelOpt's recipe: 1024 at a 1024-wide "
                                    "head; 256 suits the demo's 576-wide one).", ge=1)
    lilicorr_vector_eps: float = knob(1e-4, "lilicorr: eps of the factor vectors' L2 normalisation, in (0, 0.5).",
                                      gt=0, lt=0.5)
    lilicorr_logit_scale: float = knob(8.0, "lilicorr: fixed scale of the cosine scores (the walk's logits).", gt=0)
    lilicorr_conv_kernel_size: int = knob(
        0, "lilicorr: with lilicorr_conv_group_size, wraps every draft sublayer in DFlash2's block-local grouped "
        "convolution of this many taps (identity at init); 0 (both) = a plain DFlash backbone. Written as "
        "dflash_config.conv_kernel_size.", ge=0)
    lilicorr_conv_group_size: int = knob(0, "lilicorr: channels per convolution group (see "
                                         "lilicorr_conv_kernel_size; must divide the hidden size).", ge=0)


@dataclass(frozen=True)
class LiLiCorrWeights:
    """LiLiCorr's `train.*` keys (the weights of `LatticeTerm`)."""

    lilicorr_ce_weight: float = knob(
        0.25, "drafter.type=lilicorr: weight of the lattice's K-way cross-entropy over the node scores along the "
        "gold path (blocks whose positions are all supervised; positions whose gold token is in their own and "
        "every earlier top-K), with the DFlash loss's position weights and denominator (ModelOpt's recipe: "
        "0.25).", ge=0)
    lilicorr_penalty_weight: float = knob(
        0.25, "drafter.type=lilicorr: weight of the penalty E_q[relu(target logit of the gold token - of the "
        "candidate)] over the same positions (q = the lattice's law over the K candidates; the target's logits "
        "come online from the target, or cached from the shards' last_hidden; ModelOpt's recipe: 0.25).", ge=0)
    lilicorr_margin_weight: float = knob(
        0.0, "drafter.type=lilicorr: weight of the hinge relu(lilicorr_margin - (gold node score - best other)) "
        "(ModelOpt's `margin` variant: 0.125 with lilicorr_ce_weight 0.125).", ge=0)
    lilicorr_margin: float = knob(2.0, "drafter.type=lilicorr: the hinge's margin (> 0).", gt=0)


# -- config, contract, config.json ------------------------------------------------------------------------------
def _knob_problems(get: Any, key: str) -> list[str]:
    """The knobs' rules beyond their declared ranges (`get(name)` their values; `key` the prefix each problem
    names): K a power of 2 up to 16, the two convolution knobs set together."""
    p = []
    k = get("lilicorr_candidate_topk")
    if not (1 <= k <= 16 and k & (k - 1) == 0):
        p.append(f"{key}lilicorr_candidate_topk: must be a power of 2 <= 16 (vLLM's LiLiCorr head), got {k}")
    taps, group = get(CONV[0]), get(CONV[1])
    if taps >= 0 and group >= 0 and bool(taps) != bool(group):
        p.append(f"{key}{CONV[0]} / {key}{CONV[1]}: both 0 (a DFlash backbone) or both >= 1 (DFlash2's "
                 f"convolution), got {taps} / {group}")
    return p


def config_problems(d: DrafterKeys, k: LiLiCorrKnobs) -> list[str]:
    """The knobs' rules beyond their ranges, and the heads against a lattice width the config gives."""
    p = _knob_problems(lambda name: getattr(k, name), "drafter.")
    width, heads = k.lilicorr_hidden_size or d.hidden_size, k.lilicorr_num_heads
    if width and width > 0 and heads >= 1 and width % heads:
        p.append(f"drafter.lilicorr_num_heads: {heads} must divide the lattice width {width} "
                 "(drafter.lilicorr_hidden_size; 0 = the draft width, drafter.hidden_size)")
    return p


def contract_problems(c: ContractSpec) -> list[str]:
    """The knobs' rules beyond their ranges, and what makes them unusable for this contract's target."""
    k: LiLiCorrKnobs = c.knobs
    p = _knob_problems(lambda name: getattr(k, name), "")
    width = k.lilicorr_hidden_size or c.hidden_size
    if width % k.lilicorr_num_heads:
        p.append(f"lilicorr_num_heads {k.lilicorr_num_heads} must divide the lattice width {width}")
    if k.lilicorr_conv_group_size > 0 and c.hidden_size % k.lilicorr_conv_group_size:
        p.append(f"lilicorr_conv_group_size {k.lilicorr_conv_group_size} must divide hidden_size {c.hidden_size}")
    if c.block_size < 2:
        p.append(f"block_size must be >= 2 for LiLiCorr (one slot at least), got {c.block_size}")
    if c.vocab_size and k.lilicorr_candidate_topk > c.vocab_size:
        p.append(f"lilicorr_candidate_topk {k.lilicorr_candidate_topk} exceeds vocab_size {c.vocab_size}")
    return p


def dflash_config(c: ContractSpec) -> dict[str, Any]:
    """The `dflash_config` keys vLLM's `lilicorr.py` reads (the convolution's only when it is on)."""
    k: LiLiCorrKnobs = c.knobs
    out: dict[str, Any] = {"lilicorr_enabled": True}
    out.update({name: float(getattr(k, name)) if name in FLOATS else int(getattr(k, name)) for name in HEAD})
    if k.lilicorr_conv_kernel_size:
        out.update(conv_kernel_size=k.lilicorr_conv_kernel_size, conv_group_size=k.lilicorr_conv_group_size)
    return {**out, **dflash_keys(c)}


def read_knobs(cfg: dict[str, Any], dc: dict[str, Any], source: str) -> dict[str, Any]:
    """The knobs of a `LiLiCorrDraftModel` config.json; UsageError naming a missing or refused key."""
    missing = [f"dflash_config.{k}" for k in HEAD if dc.get(k) is None]
    if missing:
        raise UsageError(f"{source}: a LiLiCorrDraftModel config without {missing}",
                         hint="re-export the drafter (vLLM reads these keys from dflash_config)")
    if dc.get("lilicorr_enabled", True) is not True:
        raise UsageError(f"{source}: dflash_config.lilicorr_enabled is {dc.get('lilicorr_enabled')!r}; vLLM "
                         "refuses a LiLiCorrDraftModel without it", hint="set it to true, or re-export")
    if cfg.get("has_own_lm_head"):
        raise UsageError(f"{source}: has_own_lm_head is true: the drafter ships its own candidate head, while "
                         "dflashkit drafts LiLiCorr with the target's head (so would vLLM without the key)",
                         hint="export the drafter with the target's head (has_own_lm_head absent or false)")
    out: dict[str, Any] = {k: (json_float if k in FLOATS else json_int)(dc[k], f"dflash_config.{k}", source)
                           for k in HEAD}
    out[CONV[0]] = json_int(dc.get("conv_kernel_size") or 0, "dflash_config.conv_kernel_size", source)
    out[CONV[1]] = json_int(dc.get("conv_group_size") or 0, "dflash_config.conv_group_size", source)
    if bool(out[CONV[0]]) != bool(out[CONV[1]]):
        raise UsageError(f"{source}: dflash_config sets only one of conv_kernel_size / conv_group_size "
                         f"({out[CONV[0]]} / {out[CONV[1]]}); vLLM's LiLiCorr needs both or neither",
                         hint="re-export the drafter")
    return {**out, **dflash_knobs(cfg, dc, source)}


# -- the network ------------------------------------------------------------------------------------------------
def build(contract: ContractSpec, draft_vocab: torch.Tensor | None = None, feature_scale: torch.Tensor | None = None):
    """A new random LiLiCorr drafter (`model.lilicorr.LiLiCorrDraftModel`); a draft vocab is refused."""
    from dflashkit.model.lilicorr import LiLiCorrDraftModel

    refuse_draft_vocab(LILICORR, None if draft_vocab is None else int(draft_vocab.numel()), where="draft vocabulary")
    return LiLiCorrDraftModel(contract, feature_scale=feature_scale)


def _from(source: str):
    def convert(model: Any, state: dict) -> dict:
        from dflashkit.model.lilicorr import init_from_backbone

        return init_from_backbone(model, state, source=source)

    return convert


# -- training ---------------------------------------------------------------------------------------------------
@dataclass
class LatticeRows:
    """The lattice's per-row values of one chunk (rows in the chunk's order)."""

    ce: torch.Tensor        # CE of the node scores on the gold path
    hinge: torch.Tensor     # relu(margin − (gold − best other))
    penalty: torch.Tensor   # E_q[relu(t(gold) − t(c))]
    trained: torch.Tensor   # bool: a slot the lattice terms train (complete block, gold path in the lattice so far)
    covered: torch.Tensor   # bool: the gold token is in the slot's top-K
    correct: torch.Tensor   # bool: trained and the best node is the gold one
    walk: torch.Tensor      # the greedy walk's token at the row (what the decoder drafts)


@dataclass(frozen=True)
class LatticeTerm:
    """The lattice's loss terms (module docstring) and the walk's re-scoring of the blocks."""

    ce: float = 0.25
    penalty: float = 0.25
    margin_weight: float = 0.0
    margin: float = 2.0
    name: str = "lattice"
    needs_prev: bool = False

    @property
    def needs_target(self) -> bool:
        """The penalty reads the target's logits. Without them (eval's teacher-forced scoring, whose loss is
        unused) it is left out; training always has them (`family.reads_target_law`)."""
        return self.penalty > 0

    def chunk(self, rows: Rows) -> LatticeRows:
        return lattice_rows(rows, margin=self.margin, penalty=self.penalty > 0)

    def total(self, parts: list, row_w: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        import torch

        def cat(name: str) -> torch.Tensor:
            return torch.cat([getattr(p, name) for p in parts]) if parts else row_w.new_zeros(0)

        w = row_w * cat("trained").float()
        ce, pen, hinge = (w * cat("ce")).sum(), (w * cat("penalty")).sum(), (w * cat("hinge")).sum()
        loss = self.ce * ce + self.penalty * pen + self.margin_weight * hinge
        stats = {"lattice_rows": float(row_w.numel()), "lattice_trained": float(cat("trained").sum()),
                 "lattice_covered": float(cat("covered").sum()), "lattice_correct": float(cat("correct").sum()),
                 "lattice_ce": float(ce.detach()), "lattice_penalty": float(pen.detach()),
                 "lattice_loss": float(loss.detach())}
        return loss, stats

    def rescore(self, s: Scored) -> tuple[torch.Tensor, dict[str, Any]]:
        """τ and accuracy of the walk; the unary argmax's kept as `unary_*`."""
        import torch

        walked = torch.full((s.labels.numel(),), -1, dtype=torch.long, device=s.labels.device)
        if s.parts:
            walked[s.rows] = torch.cat([p.walk for p in s.parts])
        walk_ok = (walked.view_as(s.labels) == s.labels) & s.supervised
        return walk_ok, {"unary_correct": s.ok.sum(dim=(0, 1)).float().cpu(), "unary_tau_sum": s.tau_sum(s.ok)}


def loss_terms(w: LiLiCorrWeights) -> list:
    return [LatticeTerm(ce=w.lilicorr_ce_weight, penalty=w.lilicorr_penalty_weight,
                        margin_weight=w.lilicorr_margin_weight, margin=w.lilicorr_margin)]


def lattice_rows(rows: Rows, *, margin: float, penalty: bool) -> LatticeRows:
    """The lattice over every block the chunk's rows touch, teacher-forced along the gold path.

    A block's positions outside the rows (unsupervised) get their candidates from the drafter's outputs too
    (detached), so the walk is the decoder's walk for every block; only blocks whose slots are all supervised
    enter the loss (ModelOpt's complete blocks: under `train.on_path=mask` judged before the mask, whose dropped
    slots then end the teacher-forced prefix, as a gold token outside the top-K does)."""
    import torch
    import torch.nn.functional as F

    from dflashkit.model.dflash2 import walk

    model, blocks, idx = rows.model, rows.blocks, rows.index
    assert blocks is not None and idx is not None  # train/loss.py hands both to every chunk
    B, K = blocks.block_size, model.top_k
    S, dev = B - 1, idx.device
    block_of, slot = idx // B, idx % B - 1
    touched, inv = torch.unique_consecutive(block_of, return_inverse=True)
    nb = touched.numel()
    cell = inv * S + slot                                                       # row → [block, slot] cell
    present = torch.zeros(nb * S, dtype=torch.bool, device=dev)
    present[cell] = True
    if blocks.supervised is None:
        complete = present.view(nb, S).all(-1)
    else:  # train.on_path=mask: a block is whole by its supervision; the gold path then stops at its first
        # off-path slot (no label there: not covered), so the on-path prefix still trains
        slots = (touched[:, None] * B + 1 + torch.arange(S, device=dev)).flatten()
        complete = blocks.supervised[slots].view(nb, S).all(-1)
    ids_r, cand, logp, hid = _slot_candidates(rows, blocks, touched, cell, present)
    n_per = blocks.anchors.shape[1]
    bi, a = touched // n_per, blocks.anchors.flatten()[touched]
    if blocks.features is None:                                                # no context (ablation): no anchor
        valid = torch.zeros(nb, dtype=torch.bool, device=dev)
        anchor = hid.new_zeros(nb, hid.shape[-1])
    else:                                                                      # the row before the block
        valid = a >= 1
        anchor = model.anchor_hidden(blocks.features[bi, (a - 1).clamp(min=0)]) * valid[:, None].to(hid.dtype)
    with torch.no_grad():
        emb = blocks.embed(cand)
    start, pairs = model.lilicorr.factors(emb, logp, hid, anchor, valid)      # [nb, K], [nb, S−1, K, K]
    gold = torch.full((nb * S,), -1, dtype=torch.long, device=dev).index_copy(0, cell, rows.labels).view(nb, S)
    hits = cand == gold[..., None]
    covered, gidx = hits.any(-1), hits.long().argmax(-1)
    trained = torch.cumprod(covered.long(), -1).bool() & complete[:, None]
    after = pairs.gather(2, gidx[:, :-1, None, None].expand(-1, -1, 1, K)).squeeze(2)
    nodes = torch.cat([start[:, None], after], dim=1)                          # [nb, S, K]: after the gold token
    logq = F.log_softmax(nodes, dim=-1)
    ce = -logq.gather(-1, gidx[..., None]).squeeze(-1)
    if K > 1:
        best_other = nodes.scatter(-1, gidx[..., None], torch.finfo(nodes.dtype).min).amax(-1)
        hinge = F.relu(margin - (nodes.gather(-1, gidx[..., None]).squeeze(-1) - best_other))
    else:
        hinge = torch.zeros_like(ce)

    def per_row(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(nb * S, *t.shape[2:])[cell]

    pen = torch.zeros_like(ids_r[:, 0], dtype=ce.dtype)
    if penalty and rows.target is not None:
        tl = rows.target.detach().float()
        gap = (tl.gather(-1, rows.labels[:, None]) - tl.gather(-1, ids_r)).clamp(min=0)     # [r, K]
        pen = (per_row(logq).exp() * gap).sum(-1)
    with torch.no_grad():
        first = start[:, None, None, :].expand(-1, 1, K, -1)
        tokens, _ = walk(torch.cat([first, pairs], dim=1), cand)
        correct = trained & (nodes.argmax(-1) == gidx)
    return LatticeRows(per_row(ce), per_row(hinge), pen, per_row(trained), per_row(covered), per_row(correct),
                       per_row(tokens))


def _slot_candidates(rows: Rows, blocks: Any, touched: torch.Tensor, cell: torch.Tensor, present: torch.Tensor):
    """(the rows' top-K ids [r, K]; candidates [nb, S, K], their log-probs and the drafter outputs [nb, S, H] of
    every slot of the `touched` blocks): the rows' live (the gradient path), a slot outside them (not
    `present`) scored from `blocks.hidden`, detached."""
    import torch

    model, B = rows.model, blocks.block_size
    nb, S, K, dev = touched.numel(), B - 1, model.top_k, touched.device
    ids_r, logp_r = model.candidates(rows.scores)                              # live log-probs: the gradient path
    cand = torch.zeros(nb * S, K, dtype=torch.long, device=dev)
    logp = logp_r.new_zeros(nb * S, K)
    hid = rows.hidden.new_zeros(nb * S, rows.hidden.shape[-1])
    miss = (~present).nonzero().flatten()
    if miss.numel():
        with torch.no_grad():
            at = (touched[:, None] * B + 1 + torch.arange(S, device=dev)).flatten()[miss]
            h_m = blocks.hidden[at].detach()
            ids_m, logp_m = model.candidates(blocks.score(h_m))
        cand, logp, hid = cand.index_copy(0, miss, ids_m), logp.index_copy(0, miss, logp_m), hid.index_copy(0, miss, h_m)
    cand = cand.index_copy(0, cell, ids_r).view(nb, S, K)
    logp = logp.index_copy(0, cell, logp_r).view(nb, S, K)
    hid = hid.index_copy(0, cell, rows.hidden).view(nb, S, -1)
    return ids_r, cand, logp, hid


STATS = (StatField("unary_tau_sum"), StatField("unary_correct", "B"), StatField("lattice_rows"),
         StatField("lattice_trained"), StatField("lattice_covered"), StatField("lattice_correct"),
         StatField("lattice_ce", loss=True), StatField("lattice_penalty", loss=True),
         StatField("lattice_loss", loss=True))


METRICS = ("unary_tau", "unary_acc", "topk_coverage", "lattice_acc", "lattice_supervised", "lattice_ce",
           "lattice_penalty", "lattice_loss")


def metrics(stats: Any) -> dict[str, Any]:
    """`METRICS`: unary τ / accuracy (the argmax's), top-K coverage, the lattice's teacher-forced accuracy and its
    losses."""
    x = stats.extra
    return {"unary_tau": float(x["unary_tau_sum"] / max(stats.blocks, 1)),
            "unary_acc": [ratio(c, t) for c, t in zip(x["unary_correct"][1:], stats.total[1:])],
            "topk_coverage": ratio(x["lattice_covered"], x["lattice_rows"]),
            "lattice_acc": ratio(x["lattice_correct"], x["lattice_trained"]),
            "lattice_supervised": ratio(x["lattice_trained"], x["lattice_rows"]),
            "lattice_ce": float(x["lattice_ce"]), "lattice_penalty": float(x["lattice_penalty"]),
            "lattice_loss": float(x["lattice_loss"])}


# -- decoding ---------------------------------------------------------------------------------------------------
def propose(drafter: Any, h: torch.Tensor, logits: torch.Tensor, anchor: int, sampling: DraftSampling,
            vocab: torch.Tensor | None, vocab_size: int, block: DraftBlock | None = None
            ) -> tuple[list[int], torch.Tensor | None]:
    """The lattice walk over each position's top-K candidates → (tokens, draft law [k, V] or None).

    `block` must hand the target's embedding and the features of the token before the anchor (the anchor
    row of the lattice; none: an invalid anchor, as vLLM's at a block without a committed row). Greedy walks
    the best edges (a point mass); at T > 0 the walk is Gumbel-noised and q_t = softmax(row_t / T) over the K
    candidates (0 elsewhere) is the law of the rejection rule."""
    import torch

    del vocab, anchor  # the full vocabulary (build refuses a draft vocab); the anchor row is `block.context`
    if block is None or block.embed is None:
        raise ValueError("a LiLiCorr draft step needs the target's input embedding (DraftBlock.embed)")
    valid = torch.tensor([block.context is not None], device=h.device)
    ctx = block.context
    anchor_h = (drafter.anchor_hidden(ctx.reshape(1, -1).to(h.dtype)) if ctx is not None
                else h.new_zeros(1, h.shape[-1]))
    temp = sampling.temperature
    tokens, ids, rows = drafter.draft(h, logits[None], block.embed, anchor_h, valid, temperature=temp,
                                      generator=sampling.generator)
    if temp <= 0:
        return tokens[0].tolist(), None
    q = torch.softmax(rows[0].float() / temp, dim=-1)                          # [k, K]
    return tokens[0].tolist(), q.new_zeros(q.shape[0], vocab_size).scatter_(1, ids[0], q)


# -- plan, export -----------------------------------------------------------------------------------------------
def reload_check(source: Any, reloaded: Any, head: torch.Tensor | None) -> dict[str, Any]:
    """The export reload check's lattice part: the same greedy lattice walk, over a random embedding table (exact
    when the export holds the source's weights bit for bit: float32)."""
    import torch

    c = source.contract
    return walk_reload_check(
        source, reloaded, head, title="LiLiCorr",
        walk=lambda model, h, logits, ctx, table: model.draft(h, logits, lambda ids: table[ids],
                                                             model.anchor_hidden(ctx[:, -1]))[0],
        extra=lambda g: torch.randn(c.vocab_size, c.hidden_size, generator=g))


def card_lines(c: ContractSpec) -> list[str]:
    return dflash_card_lines(c) + ["LiLiCorr: vLLM runs the lattice head's walk on its V2 model runner only (GPU, Triton); its V1 "
            "runner (the CPU build) cannot run it. `dflash.py`'s LiLiCorrDraftModel computes the block's hidden "
            "states and the lattice scores; `dflashkit eval` / `serve --drafter` draft through the walk. Which "
            "SGLang release runs the LiLiCorr head (the line above is DFlash's) was not checked by dflashkit.", ""]


def fast_path(c: ContractSpec) -> bool:
    """A backbone without convolutions is DFlash's (GQA: the lean forward's; the lattice head reads its outputs)."""
    k = c.knobs
    return dflash_fast_path(c) and not (k.lilicorr_conv_kernel_size and k.lilicorr_conv_group_size)


LILICORR = Family(
    name="lilicorr",
    title="LiLiCorr",
    network=Network(build=build, init_from={"dflash": _from("DFlash"), "dflash2": _from("DFlash2")},
                    tensor_markers=("lilicorr.", "attention_conv.", "mlp_conv."), reduced_vocab=False),
    objective=Objective(loss_terms=loss_terms, stats=STATS, metrics=metrics, metric_names=METRICS),
    formats=Formats(architecture="LiLiCorrDraftModel", dflash_config=dflash_config, hf_keys=dflash_hf_keys,
                    read_knobs=read_knobs, speculators=False, reload_check=reload_check, card_lines=card_lines),
    decoding=Decoding(propose=propose, vllm_runner="v2", fast_path=fast_path),
    knobs=LiLiCorrKnobs,
    weights=LiLiCorrWeights,
    config_problems=config_problems,
    contract_problems=contract_problems,
)
