"""DFlash (z-lab, arXiv 2602.06036): every block position predicted on its own by the target's head.

Usage:
    from dflashkit.family.dflash import DFLASH
    drafter = DFLASH.network.build(contract, None, None)         # model/drafter.py's DFlashDraftModel
    tokens, law = DFLASH.decoding.propose(drafter, h, logits, anchor, DraftSampling(), vocab, vocab_size)
    DFLASH.make_knobs({"causal": True})                   # DFlashKnobs(causal=True): drafter.causal (JetSpec)
    read_causal(config_json, config_json["dflash_config"], "x/config.json")   # as vLLM 0.32 resolves it

The base family: a reduced draft vocabulary allowed (`d2t`), the loss is train/loss.py's CE / KL
alone, vLLM runs it on either model runner, and the z-lab PyPI loop decodes it. Its proposal step is
the head's argmax, or a draw from the head's sampling law (then that law, 0 outside a reduced vocab,
goes to the rejection rule).

Its one knob, `causal` (`drafter.causal`; JetSpec, arXiv 2606.18394): in-block attention where query
offset i sees the context and block offsets j <= i only, instead of the whole block. The inputs stay
`[anchor, MASK, ...]`. It is written where the engines read it, in their order (vLLM 0.32's
`qwen3_dflash._dflash_layer_causal`: the top-level `is_causal`, else `dflash_config.causal`, else
causal exactly on `layer_types[i] == "sliding_attention"`; SGLang reads `is_causal` only), so a causal
drafter's config.json holds both keys; a bidirectional one holds neither (vLLM's default for
full-attention layers). DFlash2 and LiLiCorr take the knob too (`DFlash2Knobs` and `LiLiCorrKnobs` extend
`DFlashKnobs`; their networks extend DFlash's, whose masks read it): vLLM's `DFlash2Qwen3DecoderLayer`
resolves its attention through the same `_resolve_layer_attention`, its V2 speculator takes the per-layer
causality from the same `get_draft_attn_causal`, and its LiLiCorr backbone is DFlash's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dflashkit.errors import UsageError
from dflashkit.family.base import Decoding, DraftBlock, DraftSampling, Family, Formats, Network, Objective
from dflashkit.family.knobs import knob

if TYPE_CHECKING:
    from dflashkit.family.contract import DrafterContract
    import torch

log = logging.getLogger("dflashkit.contract")
SLIDING = "sliding_attention"


@dataclass(frozen=True)
class DFlashKnobs:
    """DFlash's contract field, `drafter.causal`; DFlash2's and LiLiCorr's extend it."""

    causal: bool = knob(False, "dflash, dflash2, lilicorr: causal in-block attention (JetSpec, arXiv 2606.18394): "
                        "block offset i attends to the context before the anchor and to offsets j <= i only, in "
                        "training (the mask) and decoding; false = the whole block (DFlash). Exports write "
                        "is_causal: true and dflash_config.causal: true (vLLM, SGLang); the speculators format "
                        "sliding_window_non_causal: false.")


def dflash_config(c: DrafterContract) -> dict[str, Any]:
    """`dflash_config.causal: true` for a causal drafter (nothing for a bidirectional one: vLLM's default)."""
    return {"causal": True} if c.knobs.causal else {}


def hf_keys(c: DrafterContract) -> dict[str, Any]:
    """The top-level `is_causal: true` of a causal drafter: the key vLLM reads first and SGLang reads alone."""
    return {"is_causal": True} if c.knobs.causal else {}


def _flag(value: Any, key: str, source: str) -> bool:
    if not isinstance(value, bool):
        raise UsageError(f"{source}: {key} must be true or false, got {value!r}",
                         hint=f"fix {source}: write the JSON boolean without quotes")
    return value


def read_causal(cfg: dict[str, Any], dc: dict[str, Any], source: str) -> bool:
    """The in-block causality of a drafter config.json, resolved as vLLM 0.32 does: `is_causal`, else
    `dflash_config.causal`, else causal where `layer_types[i]` is sliding; UsageError when that leaves the
    layers mixed (a dflashkit drafter is causal in all its layers or in none)."""
    if cfg.get("is_causal") is not None:
        top = _flag(cfg["is_causal"], "is_causal", source)
        inner = dc.get("causal")
        if inner is not None and inner != top:
            log.warning("%s: is_causal %s and dflash_config.causal %s disagree; the engines (vLLM, SGLang) follow "
                        "is_causal", source, top, inner)
        return top
    if dc.get("causal") is not None:
        return _flag(dc["causal"], "dflash_config.causal", source)
    types = cfg.get("layer_types") or []
    sliding = {t == SLIDING for t in types}
    if len(sliding) > 1:
        raise UsageError(f"{source}: layer_types {types} make vLLM attend causally in the sliding layers only "
                         "(no is_causal or dflash_config.causal); a dflashkit drafter is causal in every layer or "
                         "in none", hint="set is_causal (and dflash_config.causal) to the attention it was trained with")
    return sliding == {True}


def read_knobs(cfg: dict[str, Any], dc: dict[str, Any], source: str) -> dict[str, Any]:
    """DFlash's knobs from a config.json (`read_causal`)."""
    return {"causal": read_causal(cfg, dc, source)}


def build(contract: DrafterContract, draft_vocab: torch.Tensor | None = None, feature_scale: torch.Tensor | None = None):
    """A new random DFlash drafter (`model.drafter.DFlashDraftModel`)."""
    from dflashkit.model.drafter import DFlashDraftModel

    return DFlashDraftModel(contract, draft_vocab=draft_vocab, feature_scale=feature_scale)


def propose(drafter: Any, h: torch.Tensor, logits: torch.Tensor, anchor: int, sampling: DraftSampling,
            vocab: torch.Tensor | None, vocab_size: int, block: DraftBlock | None = None
            ) -> tuple[list[int], torch.Tensor | None]:
    """One DFlash draft step: the argmax of each position's head logits, or a draw from their sampling law.

    Args:
        drafter: unused (the logits are the draft); h: [1, k, H] unused.
        logits: [k, V'] head logits of block positions 1 … k (V' = the draft vocab, if reduced).
        anchor: unused; sampling: temperature 0 = argmax, else `sampling.law` / `sampling.draw`.
        vocab: sorted target ids [V'] of a reduced draft vocab (None: the full one); vocab_size: V.
        block: unused (what the decoder knows of the block: `DraftBlock`).
    Returns:
        k target ids, and their draft law [k, V] (None for point masses).
    """
    del drafter, h, anchor, block
    if sampling.temperature <= 0:
        idx = logits.argmax(-1)
        return (idx if vocab is None else vocab[idx]).tolist(), None
    assert sampling.law is not None and sampling.draw is not None  # the decoder hands both at T > 0
    q = sampling.law(logits)
    tokens = sampling.draw(q, sampling.generator)
    if vocab is None:
        return tokens.tolist(), q
    full = q.new_zeros(q.shape[0], vocab_size).index_copy_(1, vocab, q)  # q = 0 outside the vocab
    return vocab[tokens].tolist(), full


def card_lines(c: DrafterContract) -> list[str]:
    if not c.knobs.causal:
        return []
    return ["Causal in-block attention (JetSpec): block offset i attends to the context and offsets j <= i. "
            "config.json says so twice, `is_causal: true` (vLLM reads it first, SGLang only it) and "
            "`dflash_config.causal: true`; serve it with the usual flags, nothing more to pass.", ""]


DFLASH = Family(
    name="dflash",
    title="DFlash",
    network=Network(build=build, reduced_vocab=True),
    objective=Objective(packs=True),
    formats=Formats(architecture="DFlashDraftModel", dflash_config=dflash_config, hf_keys=hf_keys,
                    read_knobs=read_knobs, card_lines=card_lines),
    decoding=Decoding(propose=propose, reference_loop=True),
    knobs=DFlashKnobs,
)
