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
from typing import TYPE_CHECKING, Any, Literal

from dflashkit.errors import UsageError
from dflashkit.family.base import (Decoding, DraftBlock, DraftSampling, Family, Formats, Network, Objective,
                                   json_int)
from dflashkit.family.knobs import knob

if TYPE_CHECKING:
    from dflashkit.family.base import ContractSpec
    import torch

log = logging.getLogger("dflashkit.contract")
SLIDING = "sliding_attention"


@dataclass(frozen=True)
class DFlashKnobs:
    """DFlash's contract field, `drafter.causal`; DFlash2's and LiLiCorr's extend it."""

    causal: bool = knob(False, "dflash, dflash2, lilicorr, dspark: causal in-block attention (JetSpec, arXiv 2606.18394): "
                        "block offset i attends to the context before the anchor and to offsets j <= i only, in "
                        "training (the mask) and decoding; false = the whole block (DFlash). Exports write "
                        "is_causal: true and dflash_config.causal: true (vLLM, SGLang); the speculators format "
                        "sliding_window_non_causal: false.")
    attention_type: Literal["gqa", "mla"] = knob(
        "gqa", "dflash, dflash2, lilicorr, dspark: the draft layers' attention: gqa (q/k/v projections with q/k norms, "
        "num_key_value_heads groups; the z-lab layer) or mla (multi-head latent attention as DeepSeek-V3 and Kimi "
        "K2/K3 define it: low-rank q and compressed kv, RoPE on drafter.mla_qk_rope_head_dim dims of each head; "
        "num_attention_heads heads, head_dim unused). Exports write dflash_config.attention: mla and the "
        "DeepSeek config keys q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim.")
    mla_q_lora_rank: int = knob(1536, "dflash, dflash2, lilicorr, dspark (attention_type mla): rank of the query's "
                                "low-rank projection (q_a_proj → q_a_layernorm → q_b_proj); 0 = one q_proj.", ge=0)
    mla_kv_lora_rank: int = knob(512, "dflash, dflash2, lilicorr, dspark (attention_type mla): width of the compressed "
                                 "key/value latent (kv_a_proj_with_mqa → kv_a_layernorm → kv_b_proj).", ge=1)
    mla_qk_nope_head_dim: int = knob(128, "dflash, dflash2, lilicorr, dspark (attention_type mla): per-head query/key "
                                     "dims without RoPE.", ge=1)
    mla_qk_rope_head_dim: int = knob(64, "dflash, dflash2, lilicorr, dspark (attention_type mla): per-head query/key "
                                     "dims with RoPE (the key's are shared by all heads); even.", ge=2)
    mla_v_head_dim: int = knob(128, "dflash, dflash2, lilicorr, dspark (attention_type mla): per-head value dims.", ge=1)


MLA_KEYS = {"mla_q_lora_rank": "q_lora_rank", "mla_kv_lora_rank": "kv_lora_rank",
            "mla_qk_nope_head_dim": "qk_nope_head_dim", "mla_qk_rope_head_dim": "qk_rope_head_dim",
            "mla_v_head_dim": "v_head_dim"}  # knob → the DeepSeek / Kimi config.json key (top level)


def attention_fields(c: ContractSpec) -> dict[str, Any]:
    """What of a contract shapes its attention tensors: `attention_type`, and an MLA drafter's ranks (a warm start
    or an import must match them all)."""
    kind = getattr(c.knobs, "attention_type", "gqa")
    return {"attention_type": kind, **({name: getattr(c.knobs, name) for name in MLA_KEYS} if kind == "mla" else {})}


def mla_problems(c: ContractSpec) -> list[str]:
    """What makes an MLA drafter's knobs unusable (nothing for a GQA one): an odd rope width."""
    k = c.knobs
    if getattr(k, "attention_type", "gqa") != "mla":
        return []
    return [f"mla_qk_rope_head_dim {k.mla_qk_rope_head_dim} must be even (RoPE turns pairs of dims)"] \
        if k.mla_qk_rope_head_dim % 2 else []


def dflash_config(c: ContractSpec) -> dict[str, Any]:
    """`dflash_config.causal: true` for a causal drafter (nothing for a bidirectional one: vLLM's default);
    `attention: mla` for an MLA drafter (nothing for GQA)."""
    out: dict[str, Any] = {"causal": True} if c.knobs.causal else {}
    if getattr(c.knobs, "attention_type", "gqa") == "mla":
        out["attention"] = "mla"
    return out


def hf_keys(c: ContractSpec) -> dict[str, Any]:
    """The top-level `is_causal: true` of a causal drafter: the key vLLM reads first and SGLang reads alone; an
    MLA drafter's ranks under the DeepSeek-V3 / Kimi names (`q_lora_rank` null without q-LoRA, as DeepSeek-V2-Lite
    writes it)."""
    out: dict[str, Any] = {"is_causal": True} if c.knobs.causal else {}
    if getattr(c.knobs, "attention_type", "gqa") == "mla":
        out.update({key: getattr(c.knobs, name) for name, key in MLA_KEYS.items()})
        out["q_lora_rank"] = out["q_lora_rank"] or None
    return out


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


def read_attention(cfg: dict[str, Any], dc: dict[str, Any], source: str) -> dict[str, Any]:
    """The attention knobs of a drafter config.json: MLA when `dflash_config.attention` is mla or the config has
    the DeepSeek `kv_lora_rank` (a Kimi K3-style drafter), its ranks from the top-level DeepSeek keys (a null or
    absent `q_lora_rank`: no q-LoRA); {} for GQA. UsageError naming a missing or malformed key."""
    kind = dc.get("attention", "mla" if cfg.get("kv_lora_rank") is not None else "gqa")
    if kind not in ("gqa", "mla"):
        raise UsageError(f"{source}: dflash_config.attention {kind!r} is not gqa or mla",
                         hint=f"fix {source}: dflash_config.attention must be gqa or mla")
    if kind == "gqa":
        return {}
    missing = [key for name, key in MLA_KEYS.items() if name != "mla_q_lora_rank" and cfg.get(key) is None]
    if missing:
        raise UsageError(f"{source}: an MLA drafter config without {missing}",
                         hint=f"add the DeepSeek-V3 MLA keys {list(MLA_KEYS.values())} to {source}")
    out: dict[str, Any] = {"attention_type": "mla"}
    for name, key in MLA_KEYS.items():
        value = cfg.get(key)
        out[name] = 0 if value is None else json_int(value, key, source)
    return out


def read_knobs(cfg: dict[str, Any], dc: dict[str, Any], source: str) -> dict[str, Any]:
    """DFlash's knobs from a config.json (`read_causal`, `read_attention`)."""
    return {"causal": read_causal(cfg, dc, source), **read_attention(cfg, dc, source)}


def fast_path(c: ContractSpec) -> bool:
    """A GQA drafter's layers are the plain DFlash layers `decode/fast_draft.py` computes; an MLA one decodes
    through the module."""
    return getattr(c.knobs, "attention_type", "gqa") == "gqa"


def build(contract: ContractSpec, draft_vocab: torch.Tensor | None = None, feature_scale: torch.Tensor | None = None):
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


def card_lines(c: ContractSpec) -> list[str]:
    out = []
    if c.knobs.causal:
        out += ["Causal in-block attention (JetSpec): block offset i attends to the context and offsets j <= i. "
                "config.json says so twice, `is_causal: true` (vLLM reads it first, SGLang only it) and "
                "`dflash_config.causal: true`; serve it with the usual flags, nothing more to pass.", ""]
    if getattr(c.knobs, "attention_type", "gqa") == "mla":
        k = c.knobs
        out += [f"MLA draft layers (DeepSeek-V3 / Kimi names and config keys): q-LoRA {k.mla_q_lora_rank or 'none'}, "
                f"kv-LoRA {k.mla_kv_lora_rank}, qk {k.mla_qk_nope_head_dim} + {k.mla_qk_rope_head_dim} rope, "
                f"v {k.mla_v_head_dim}; `dflash_config.attention: mla`. The shipped `dflash.py` and `dflashkit "
                "eval` / `serve --drafter` run them; vLLM 0.32's DFlash draft models build GQA layers only, so it "
                "cannot load this checkpoint.", ""]
    return out


DFLASH = Family(
    name="dflash",
    title="DFlash",
    network=Network(build=build, reduced_vocab=True),
    objective=Objective(packs=True),
    formats=Formats(architecture="DFlashDraftModel", dflash_config=dflash_config, hf_keys=hf_keys,
                    read_knobs=read_knobs, card_lines=card_lines),
    decoding=Decoding(propose=propose, reference_loop=True, fast_path=fast_path),
    knobs=DFlashKnobs,
)
