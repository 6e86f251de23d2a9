"""Derive the drafter contract from target facts, honouring explicit `drafter.*` values.

Usage:
    contract = derive_contract(cfg.drafter, facts, tok)        # DrafterContract, .check()ed
    mask_id, reason = choose_mask_token(facts.vocab_size, tok)

Mask token rule (never resizes the target embedding; dflash-spec §1.5), first match wins:
  1. `drafter.mask_token_id` when set (must be inside the target vocab, else exit 2).
  2. A token the tokenizer already calls a mask (`mask_token`, `<|MASK|>`, `<mask>`, `[MASK]`).
  3. The first unused embedding row: the lowest id < config vocab_size that no token of the
     tokenizer maps to (Qwen3: vocab 151936 > 151669 tokens → 151669; GGUF UNUSED-type tokens and
     the unnamed rows of custom tokenizers count as unused). Needs a known base vocabulary.
  4. The first reserved special token (`<|reserved_special_token_0|>`, `<|reserved_token_N|>`,
     `<unusedN>`, …) that the chat template does not use and is not bos/eos/pad/unk (Llama 3: 128002).
  5. Otherwise exit 2, listing rarely used special tokens the user may pick.

Draft dims: hidden = the target's (an override that differs is exit 2); heads/kv/head_dim/
intermediate from the target or `drafter.*`; MLA targets get Qwen3-style attention (heads =
num_attention_heads, kv = min(8, heads) (a divisor), head_dim = v_head_dim or 128); MoE targets
use the dense `intermediate_size`. RoPE theta/scaling and max positions are copied.
Layer convention: output of decoder layer id = HF hidden_states[id+1].
"""

from __future__ import annotations

import logging
import math
import re
from typing import TYPE_CHECKING

from dflashkit import family
from dflashkit.errors import UsageError
from dflashkit.inspect.config_facts import ModelFacts
from dflashkit.inspect.target import inspect_target
from dflashkit.inspect.tokenizer_facts import TokenizerFacts
from dflashkit.family.contract import DrafterContract, build_target_layer_ids, sliding_fields

if TYPE_CHECKING:
    from dflashkit.config import DrafterSection, RunConfig
    from dflashkit.rundir import RunDir

MASK_NAMES = ("<|mask|>", "<mask>", "[mask]", "<|mask_token|>")
RESERVED = re.compile(r"reserved|^<unused\d+>$|^\[unused\d+\]$", re.I)
log = logging.getLogger("dflashkit.probe")
LAYER_CONVENTION = "output of decoder layer id = HF hidden_states[id+1]"


def _specials(tok: TokenizerFacts) -> set[int]:
    return {i for k, i in tok.special_ids.items() if k != "mask" and isinstance(i, int)}


def _in_template(tok: TokenizerFacts, text: str) -> bool:
    return bool(tok.chat_template) and text in (tok.chat_template or "")


def choose_mask_token(vocab_size: int, tok: TokenizerFacts | None,
                      explicit: int | None = None) -> tuple[int, str]:
    """Pick the mask token row by the rule in the module docstring.

    Args:
        vocab_size: rows of the target embedding (config vocab_size).
        tok: tokenizer facts (None when no tokenizer files were found).
        explicit: `drafter.mask_token_id`, if set.
    Returns:
        (mask_token_id, human-readable reason).
    Raises:
        UsageError: (exit 2) explicit id outside the vocab, or no unused/reserved row exists.
    """
    if explicit is not None:
        if not 0 <= explicit < vocab_size:
            raise UsageError(f"drafter.mask_token_id={explicit} is outside the target vocab [0, {vocab_size})",
                             hint="pick an id inside the embedding (an unused/reserved row); the target is "
                             "never resized")
        if tok is not None and explicit in _specials(tok):
            log.warning("drafter.mask_token_id=%d is also a bos/eos/pad/unk token of the tokenizer; allowed "
                        "(some drafters do this) but an unused row is safer", explicit)
        return explicit, "drafter.mask_token_id (explicit)"
    if tok is None:
        raise UsageError("no tokenizer files found, so no mask token can be chosen safely",
                         hint="set target.tokenizer to the tokenizer dir, or drafter.mask_token_id")
    mask_text = tok.special_tokens.get("mask")
    named = [(i, t) for i, (t, _) in sorted(tok.added.items()) if t.lower() in MASK_NAMES or t == mask_text]
    named = [(i, t) for i, t in named if i < vocab_size]
    if named:
        return named[0][0], f"existing mask token {named[0][1]!r}"
    base_known = tok.base_vocab_size is not None or bool(tok.loaded.get("ok"))
    if base_known and tok.assigned_ids is not None:
        used = tok.assigned_ids
        free = next((i for i in range(vocab_size) if i not in used), None)
        if free is not None:
            return free, (f"first unused embedding row: config vocab_size {vocab_size} > the {len(used)} "
                          f"tokens the tokenizer maps; row {free} has no token")
    specials = _specials(tok)
    reserved = [(i, t) for i, (t, _) in sorted(tok.added.items())
                if RESERVED.search(t) and i < vocab_size and i not in specials and not _in_template(tok, t)]
    if reserved:
        i, t = reserved[0]
        return i, f"reserved special token {t!r} (id {i}), not used by the chat template"
    rare = [(i, t) for i, (t, special) in sorted(tok.added.items())
            if special and i < vocab_size and i not in specials and not _in_template(tok, t)]
    pick = ", ".join(f"{t}={i}" for i, t in rare[-5:]) or "any rarely used token id"
    raise UsageError(
        f"no unused or reserved embedding row for the mask token: the tokenizer ({tok.source}) maps all "
        f"{vocab_size} rows of the target embedding and has no <|MASK|>/reserved special token",
        hint=f"set drafter.mask_token_id to a rarely used token id (candidates: {pick}), or use a checkpoint "
        "whose embedding is padded beyond the tokenizer; dflashkit never resizes the target")


def _draft_attention(d: DrafterSection, facts: ModelFacts) -> tuple[int, int, int, str]:
    """(heads, kv heads, head_dim, reason)."""
    if facts.attention == "MLA":
        heads = d.num_attention_heads or facts.num_attention_heads
        kv = d.num_key_value_heads or math.gcd(heads, 8)
        head_dim = d.head_dim or (facts.mla or {}).get("v_head_dim") or 128
        why = f"MLA target: Qwen3-style draft attention (heads {heads}, kv {kv}, head_dim {head_dim})"
        return heads, kv, head_dim, why
    heads = d.num_attention_heads or facts.num_attention_heads
    kv = d.num_key_value_heads or facts.num_key_value_heads
    head_dim = d.head_dim or facts.head_dim
    return heads, kv, head_dim, "copied from the target config (drafter.* overrides win)"


def derive_contract(d: DrafterSection, facts: ModelFacts, tok: TokenizerFacts | None) -> DrafterContract:
    """The drafter contract for a target.

    Args:
        d: `cfg.drafter` (explicit values win over derived ones).
        facts: the target's ModelFacts.
        tok: its TokenizerFacts (None: only an explicit mask id works).
    Returns:
        A checked DrafterContract (target_layer_ids written explicitly, reasons in `extra`).
    Raises:
        UsageError: (exit 2) hidden-size override mismatch, layer ids out of range, bad mask id,
            heads not a multiple of kv heads.
    """
    if d.hidden_size is not None and d.hidden_size != facts.hidden_size:
        raise UsageError(f"drafter.hidden_size={d.hidden_size} differs from the target hidden size "
                         f"{facts.hidden_size} ({facts.source})",
                         hint="remove drafter.hidden_size: DFlash drafters share the target's hidden size")
    n = facts.num_layers
    if d.target_layer_ids is not None:
        ids = [int(i) for i in d.target_layer_ids]
        bad = [i for i in ids if not 0 <= i < n]
        if bad:
            raise UsageError(f"drafter.target_layer_ids {bad} are outside the target's {n} decoder layers "
                             f"[0, {n})", hint="use 0-based decoder-layer ids, or null for the default")
        ids_reason = "drafter.target_layer_ids (explicit)"
    else:
        k = d.num_target_features or d.num_draft_layers
        ids = build_target_layer_ids(n, k)
        ids_reason = f"reference formula build_target_layer_ids({n}, {k})"
        if len(set(ids)) < len(ids):
            log.warning("target_layer_ids %s repeat layers (%d-layer target, %d features); set "
                        "drafter.num_target_features lower or drafter.target_layer_ids explicitly", ids, n, k)
    mask_id, mask_reason = choose_mask_token(facts.vocab_size, tok, d.mask_token_id)
    heads, kv, head_dim, attn_reason = _draft_attention(d, facts)
    if heads % kv:
        raise UsageError(f"drafter attention: num_attention_heads {heads} is not a multiple of "
                         f"num_key_value_heads {kv}", hint="set drafter.num_key_value_heads to a divisor of "
                         "drafter.num_attention_heads")
    rope = facts.rope or {}
    eos = facts.eos_token_id if facts.eos_token_id is not None else (tok.special_ids.get("eos") if tok else None)
    bos = facts.bos_token_id if facts.bos_token_id is not None else (tok.special_ids.get("bos") if tok else None)
    contract = DrafterContract(
        block_size=d.block_size, num_draft_layers=d.num_draft_layers, target_layer_ids=ids,
        mask_token_id=mask_id, num_target_layers=n, hidden_size=facts.hidden_size,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
        intermediate_size=d.intermediate_size or facts.intermediate_size, vocab_size=facts.vocab_size,
        rms_norm_eps=float(d.rms_norm_eps or facts.rms_norm_eps or 1e-6),
        rope_theta=float(rope.get("theta") or 10000.0), rope_scaling=rope.get("scaling"),
        max_position_embeddings=int(facts.max_position_embeddings or 4096),
        tie_word_embeddings=facts.tie_word_embeddings,
        target_model_type=facts.model_type, target_architecture=facts.architecture,
        mask_token_reason=mask_reason, bos_token_id=bos, eos_token_id=eos,
        **sliding_fields(d.layer_types, d.sliding_window, d.num_draft_layers),
        **family.get(d.type).contract_fields(d),
        extra={"layer_convention": LAYER_CONVENTION, "target_layer_ids_reason": ids_reason,
               "attention_reason": attn_reason, "target_attention": facts.attention,
               "target_text_model_type": facts.text_model_type, "target_source": facts.source},
    )
    contract.check()
    return contract


def run_contract(cfg: RunConfig, rd: RunDir) -> DrafterContract:
    """The run's contract: `contract.json` when probe wrote one, else derived here as probe would (nothing written)."""
    if rd.contract_path.is_file():
        return DrafterContract.load(rd.contract_path)

    _, _, facts, tok = inspect_target(cfg, cfg.target.path)
    return derive_contract(cfg.drafter, facts, tok)
