"""Disk, memory and time estimates for training a drafter (what `dflashkit plan` prints).

Usage:
    p = plan_budget(contract, target_facts, cfg, tokens=T, sequences=N, gpus=8, mem_gib=80)
    p["modes"], p["recommended"], p["logits"]["max_loss_chunk_blocks"]

Pure arithmetic over the contract, the target's facts and the config, per GPU, in bytes: cached
features, the drafter with fp32 grads and AdamW state (plus its family's own parameters), the frozen
embedding and LM head, activations, one logits chunk, KL targets, and the target's weights (at the
dtype the local path loads them in, or the engine's bits). Modes: online-replicate, online-shard,
cached and engine, in that order; the recommended one is the first that fits the usable memory.
Time comes from this machine's saved calibration when there is one (`sizing/calibration.py`), else
from FLOPs at an assumed per-GPU throughput; `time.source` says which. Every formula and assumption:
docs/budget.md, "`dflashkit plan`'s disk and memory model".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflashkit.family import DEFAULT as DEFAULT_FAMILY
from dflashkit.family.recipe import resolve_recipe
from dflashkit.inspect.paths import target_paths

if TYPE_CHECKING:
    from dflashkit.config import RunConfig

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1}
USABLE = 0.9
TFLOPS_PER_GPU = 400e12
LOGIT_BYTES = 12


def attention_params(c: Any) -> int:
    """Parameters of one draft layer's attention: GQA's q/k/v/o projections and q/k norms, or MLA's (q-LoRA
    down + norm + up, or one q_proj; kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj; o_proj)."""
    h, n, a = c.hidden_size, c.num_attention_heads, c.attention
    if a["attention_type"] != "mla":
        d = c.head_dim
        return h * n * d * 2 + 2 * h * c.num_key_value_heads * d + 2 * d
    qr, kvr, rope, v = a["mla_q_lora_rank"], a["mla_kv_lora_rank"], a["mla_qk_rope_head_dim"], a["mla_v_head_dim"]
    qk = a["mla_qk_nope_head_dim"] + rope
    q = h * qr + qr + qr * n * qk if qr else h * n * qk
    return q + h * (kvr + rope) + kvr + kvr * n * (a["mla_qk_nope_head_dim"] + v) + n * v * h


def attention_act_width(c: Any) -> int:
    """Numbers per query token one draft layer's attention keeps for backward besides its input: the queries and
    the attention output, 2·heads·head_dim for GQA; MLA's q-LoRA latent, queries (qk_nope + qk_rope per head) and
    output (v_head_dim per head)."""
    a, n = c.attention, c.num_attention_heads
    if a["attention_type"] != "mla":
        return 2 * n * c.head_dim
    return a["mla_q_lora_rank"] + n * (a["mla_qk_nope_head_dim"] + a["mla_qk_rope_head_dim"] + a["mla_v_head_dim"])


def attention_kv_width(c: Any) -> int:
    """Key + value numbers per token per draft layer (what the context rows' K/V cost): 2·kv_heads·head_dim for
    GQA, heads·(qk_nope + qk_rope + v_head_dim) for MLA (expanded per head, as the drafter computes them)."""
    a = c.attention
    if a["attention_type"] != "mla":
        return 2 * c.num_key_value_heads * c.head_dim
    return c.num_attention_heads * (a["mla_qk_nope_head_dim"] + a["mla_qk_rope_head_dim"] + a["mla_v_head_dim"])


def attention_text(c: Any) -> str:
    """How `plan` names the draft attention: `gqa 32/8×128` or `mla q-LoRA 1536, kv-LoRA 512, qk 128+64, v 128`."""
    a = c.attention
    if a["attention_type"] != "mla":
        return f"gqa {c.num_attention_heads}/{c.num_key_value_heads}×{c.head_dim}"
    q = f"q-LoRA {a['mla_q_lora_rank']}" if a["mla_q_lora_rank"] else "no q-LoRA"
    return (f"mla {c.num_attention_heads} heads, {q}, kv-LoRA {a['mla_kv_lora_rank']}, "
            f"qk {a['mla_qk_nope_head_dim']}+{a['mla_qk_rope_head_dim']}, v {a['mla_v_head_dim']}")


def draft_vocab_size(c: Any, cfg: Any) -> int | None:
    """The reduced draft vocabulary V' the run trains (`drafter.draft_vocab_size` below the target's, for a family
    that allows one), else None (the full vocab)."""
    v = getattr(getattr(cfg, "drafter", None), "draft_vocab_size", None)
    return int(v) if v and int(v) < c.vocab_size and c.family.network.reduced_vocab else None


def _module_params(c: Any, vocab: int | None) -> dict[str, int]:
    """Parameters per top-level module of the contract's network, built on the meta device (no memory) with a
    draft vocabulary of `vocab` ids when given."""
    import torch

    from dflashkit.family import new_drafter

    ids = None if vocab is None else torch.arange(vocab, device="cpu")
    with torch.device("meta"):
        net = new_drafter(c, ids)
    out: dict[str, int] = {}
    for name, p in net.named_parameters():
        top = name.split(".")[0]
        out[top] = out.get(top, 0) + p.numel()
    return out


def family_params(c: Any, vocab: int | None = None) -> dict[str, int]:
    """The family's parameters beyond a DFlash drafter's of the same contract, per top-level module of its network
    (a module of its own, e.g. DSpark's `markov_head` [V·r + V'·r] and `confidence_head`, or the growth of a DFlash
    module, e.g. DFlash2's convolutions inside `layers`, keyed "layers (dflash2's own)"), at draft vocabulary `vocab` (None: the full vocab); {} for
    DFlash. Counted on networks built on the meta device, so exact for any family."""
    if c.family is DEFAULT_FAMILY:
        return {}
    kept = {f.name: getattr(c.knobs, f.name) for f in dataclasses.fields(DEFAULT_FAMILY.knobs)
            if hasattr(c.knobs, f.name)}  # DFlash's own knobs as the family sets them (its attention: MLA too)
    base = dataclasses.replace(c, drafter_type=DEFAULT_FAMILY.name, knobs=DEFAULT_FAMILY.knobs(**kept),
                               causal_layers=None)
    own, dflash = _module_params(c, vocab), _module_params(base, None)
    return {(f"{k} ({c.drafter_type}'s own)" if k in dflash else k): n - dflash.get(k, 0)
            for k, n in own.items() if n != dflash.get(k, 0)}


def drafter_parts(c: Any, vocab: int | None = None) -> dict[str, Any]:
    """The drafter's parameters part by part: `layer` (one draft layer's attention, MLP and its two norms, in
    closed form), `layers` (all of them), `fc` (the target features' projection), `norms` (hidden_norm and the
    final norm), `family` (`family_params`) and `params`, their sum. The drafter holds no embedding or LM head:
    the target's are frozen beside it (`plan`'s memory), a reduced vocab's V' head rows copied once."""
    h, i = c.hidden_size, c.intermediate_size
    layer = {"attention": attention_params(c), "mlp": 3 * h * i, "norms": 2 * h}
    fam = family_params(c, vocab)
    parts = {"layer": layer, "layers": c.num_draft_layers * sum(layer.values()), "fc": len(c.target_layer_ids) * h * h,
             "norms": 2 * h, "family": fam}
    parts["params"] = parts["layers"] + parts["fc"] + parts["norms"] + sum(fam.values())
    return parts


def drafter_params(c: Any, vocab: int | None = None) -> int:
    """Parameters of the contract's drafter (no embedding / LM head of its own): DFlash's, plus its family's, at
    draft vocabulary `vocab` (None: the full vocab)."""
    return int(drafter_parts(c, vocab)["params"])


def lookup_params(c: Any) -> int:
    """The drafter's looked-up parameters, as its family counts them (`Network.lookup_params`; DFlash2's selector
    codebooks, 2·V·r; 0 for DFlash): a lookup costs no FLOPs per parameter, so the FLOPs leave them out."""
    return c.family.network.lookup_params(c)


def target_bytes_per_param(facts: dict[str, Any], *, local: bool = False) -> float:
    """Bytes per target parameter: the quantization bits as an engine serves them, or (`local`: the local
    paths, which load FP8 / compressed-tensors checkpoints dequantized, `target.quantized`) the dtype's."""
    q = facts.get("quantization") or {}
    if q.get("bits") and not (local and q.get("local_load") in ("dequantized", "transformers")):
        return float(q["bits"]) / 8
    return float(DTYPE_BYTES.get(str(facts.get("dtype") or "bfloat16"), 2))


def target_weight_bytes(facts: dict[str, Any], *, local: bool = False) -> float:
    """Target weights in memory: a GGUF file's own size, else params · bytes/param (`local` as above)."""
    src = Path(str(facts.get("source") or ""))
    if facts.get("format") == "gguf" and src.is_file():
        return float(src.stat().st_size)
    return int(facts.get("params_total") or 0) * target_bytes_per_param(facts, local=local)


def _gib(n: float) -> float:
    return round(n / 2**30, 2)


def measured_time(cal: dict[str, Any], cfg: RunConfig, *, tokens: int, sequences: int, gpus: int) -> dict[str, Any]:
    """Hours from a saved calibration's rates (the module docstring)."""
    capture_h = tokens / float(cal["capture_tok_s"]) / gpus / 3600
    steps = -(-sequences // max(1, cfg.train.batch_size))
    cached_h = steps * float(cal["train_step_s"]) / gpus / 3600
    m = cal.get("machine") or {}
    return {"source": f"measured on this machine ({m.get('name') or m.get('kind')}; {cal.get('path', 'calibration')}, "
                      f"{cal.get('sample_tokens')} tokens per sample)",
            "capture_tok_s": cal["capture_tok_s"], "train_step_s": cal["train_step_s"],
            "hours_per_epoch_online": round(cached_h + capture_h, 3), "hours_per_epoch_cached": round(cached_h, 3),
            "hours_capture": round(capture_h, 3)}


@dataclass(frozen=True)
class _Sizes:
    """The per-GPU byte counts one estimate is built from (`_sizes`; names as in docs/budget.md)."""

    seq: int          # mean tokens per sequence
    q: int            # query tokens per sequence: anchors × B
    cap_bpt: int      # bytes per token capture writes (the contract's layers + capture.extra_layer_ids)
    row_bpt: int      # bytes per token of an engine row (features + next ids + last hidden when the law is read)
    p_d: int          # drafter parameters
    vocab: int        # the logits' width: the draft vocabulary V' when reduced, else V
    opt: int          # drafter weights + fp32 grads + AdamW state
    frozen: int       # the frozen embedding and LM head (+ a reduced vocab's V' head rows, copied once)
    act: int          # activations
    kl: int           # KL targets (0 when the loss reads no target law)
    chunk: int        # one logits chunk of train.loss_chunk_blocks
    t_w: float        # target weights as an engine serves them (quantized: the bits)
    t_wl: float       # target weights as the local paths load them (dequantized)
    t_act: int        # the target forward's activations

    @property
    def train_fixed(self) -> int:
        return self.opt + self.frozen + self.act + self.kl


def _sizes(c: Any, facts: dict[str, Any], cfg: RunConfig, *, tokens: int, sequences: int) -> _Sizes:
    """The byte counts of `plan_budget` for the contract `c`, the target's facts and the config."""
    t, h, v = cfg.train, c.hidden_size, c.vocab_size
    recipe = resolve_recipe(t, c)  # the loss reads the target's law: KL, or a family's term (LiLiCorr)
    n_feat = len(c.target_layer_ids)
    seq = max(1, tokens // max(1, sequences))
    q = min(t.num_anchors, seq) * c.block_size
    dtype_bytes = DTYPE_BYTES[cfg.capture.dtype]
    captured = len(set(c.target_layer_ids) | set(cfg.capture.extra_layer_ids))  # what capture writes per token
    vp = draft_vocab_size(c, cfg)
    p_d = drafter_params(c, vp)
    per_layer = q * (4 * h + attention_act_width(c) + 3 * c.intermediate_size) + seq * attention_kv_width(c)
    return _Sizes(seq=seq, q=q, cap_bpt=captured * h * dtype_bytes,
                  row_bpt=n_feat * h * dtype_bytes + 4 + (h * dtype_bytes if recipe.needs_target_logits else 0),
                  p_d=p_d, vocab=vp or v, opt=16 * p_d,
                  frozen=v * h * 2 * (1 if c.tie_word_embeddings else 2) + (vp or 0) * h * 2,
                  act=t.batch_size * (c.num_draft_layers * per_layer + seq * (n_feat + 1) * h + q * h) * 2,
                  kl=t.batch_size * seq * v * 2 if recipe.needs_target_logits else 0,
                  chunk=t.loss_chunk_blocks * c.block_size * (vp or v) * LOGIT_BYTES,
                  t_w=target_weight_bytes(facts), t_wl=target_weight_bytes(facts, local=True),
                  t_act=t.batch_size * seq * h * 2 * 4)


def _modes(c: Any, cfg: RunConfig, s: _Sizes, *, tokens: int, gpus: int, budget: float) -> list[dict[str, Any]]:
    """One entry per training mode (the module docstring's order): per-GPU GiB, whether it fits `budget`
    bytes, its config, the largest loss chunk that fits, and for cached / engine the disk and the capture."""
    t, b, v = cfg.train, c.block_size, s.vocab
    blocks_total = min(t.num_anchors, s.seq) * t.batch_size
    t_wc = s.t_w if cfg.capture.engine == "vllm" else s.t_wl
    queue_bytes = t.engine_prefetch * t.batch_size * s.seq * s.row_bpt

    def max_chunk(other: float) -> int:
        free = budget - other
        return int(max(0, min(blocks_total, free // (b * v * LOGIT_BYTES))))

    modes = []
    for name, target_share, conf in (
            ("online-replicate", s.t_wl + s.t_act, "train.features=online train.parallel.target=replicate"),
            ("online-shard", s.t_wl / gpus + s.t_act, "train.features=online train.parallel.target=shard"),
            ("cached", 0.0, "train.features=cached (run `dflashkit capture` first)"),
            ("engine", 0.0, "train.features=engine capture.engine=vllm (a vLLM serves the target's features)")):
        if name == "online-shard" and gpus < 2:
            continue
        need = target_share + s.train_fixed + s.chunk
        entry = {"mode": name, "per_gpu_gib": _gib(need), "fits": need <= budget, "config": conf,
                 "max_loss_chunk_blocks": max_chunk(target_share + s.train_fixed)}
        if name == "cached":
            entry["disk_gib"] = _gib(s.cap_bpt * tokens)
            entry["disk_bytes"] = int(s.cap_bpt * tokens)
            entry["capture_fits"] = (t_wc / gpus + s.t_act) <= budget
        if name == "engine":  # the bounded queue, per rank: prefetch micro-batches of rows
            entry["disk_gib"] = _gib(queue_bytes)
            entry["disk_bytes"] = int(queue_bytes)
            entry["capture_fits"] = (s.t_w / gpus + s.t_act) <= budget
        modes.append(entry)
    return modes


def _time(c: Any, facts: dict[str, Any], cfg: RunConfig, s: _Sizes, *, tokens: int, sequences: int, gpus: int,
          calibration: dict[str, Any] | None, no_calibration: str) -> dict[str, Any]:
    """The time estimate: FLOPs, and hours from `calibration`'s rates or from FLOPs at the assumed throughput."""
    flops_target = 2 * int(facts.get("params_active") or facts.get("params_total") or 0) * tokens
    flops_draft = 6 * (s.p_d - lookup_params(c)) * s.q * sequences
    rate = TFLOPS_PER_GPU * gpus
    assumed = {"source": f"assumed {TFLOPS_PER_GPU / 1e12:.0f} TFLOP/s per GPU ({no_calibration})",
               "hours_per_epoch_online": round((flops_target + flops_draft) / rate / 3600, 3),
               "hours_per_epoch_cached": round(flops_draft / rate / 3600, 3),
               "hours_capture": round(flops_target / rate / 3600, 3)}
    timing = measured_time(calibration, cfg, tokens=tokens, sequences=sequences, gpus=gpus) if calibration \
        else assumed
    return {"assumed_tflops_per_gpu": TFLOPS_PER_GPU / 1e12, "target_forward_pflop": round(flops_target / 1e15, 3),
            "drafter_train_pflop": round(flops_draft / 1e15, 3), **timing}


def plan_budget(c: Any, facts: dict[str, Any], cfg: RunConfig, *, tokens: int, sequences: int, gpus: int,
                mem_gib: float, calibration: dict[str, Any] | None = None,
                no_calibration: str = "no calibration saved for this machine") -> dict[str, Any]:
    """Every estimate in the module docstring, plus the mode that fits and a loss-chunk size.

    Args:
        c: the drafter contract.
        facts: target facts as a dict (`ModelFacts.to_dict()`; may be empty if unknown).
        cfg: the run config (train.*, capture.dtype).
        tokens: total training tokens; sequences: number of conversations.
        gpus: GPU count; mem_gib: memory per GPU in GiB.
        calibration: a saved calibration (`sizing.calibration.saved_calibration`): times from its rates;
            None: from FLOPs at the assumed throughput, `no_calibration` saying why.
    Returns:
        JSON-ready dict: features, drafter, logits, target, modes, recommended, time.
    """
    t, b = cfg.train, c.block_size
    s = _sizes(c, facts, cfg, tokens=tokens, sequences=sequences)
    vp = draft_vocab_size(c, cfg)
    parts = drafter_parts(c, vp)
    modes = _modes(c, cfg, s, tokens=tokens, gpus=gpus, budget=mem_gib * 2**30 * USABLE)
    fitting = [m for m in modes if m["fits"] and (m["mode"] not in ("cached", "engine") or m["capture_fits"])]
    recommended = fitting[0]["mode"] if fitting else None
    return {
        "features": {"dtype": cfg.capture.dtype, "bytes_per_token": s.cap_bpt,
                     "total_gib": _gib(s.cap_bpt * tokens)},
        "drafter": {"params": s.p_d, "type": c.drafter_type, "attention": attention_text(c),
                    "attention_params_per_layer": attention_params(c), "draft_vocab_size": vp,
                    "parts": {k: parts[k] for k in ("layer", "layers", "fc", "norms", "family")},
                    "num_draft_layers": c.num_draft_layers,
                    "lookup_params": lookup_params(c), "weights_gib": _gib(s.p_d * DTYPE_BYTES[cfg.export.dtype]),
                    "weights_dtype": cfg.export.dtype, "weights_grads_adam_gib": _gib(s.opt),
                    "frozen_embed_head_gib": _gib(s.frozen), "activations_gib": _gib(s.act),
                    "kl_targets_gib": _gib(s.kl)},
        "logits": {"per_sequence_gib": _gib(t.num_anchors * b * s.vocab * 4), "chunk_gib": _gib(s.chunk),
                   "vocab": s.vocab,
                   "loss_chunk_blocks": t.loss_chunk_blocks,
                   "max_loss_chunk_blocks": next((m["max_loss_chunk_blocks"] for m in modes
                                                  if m["mode"] == recommended), 0)},
        "target": {"params_total": int(facts.get("params_total") or 0),
                   "bytes_per_param": target_bytes_per_param(facts),
                   "weights_bytes": int(s.t_w), "weights_gib": _gib(s.t_w),
                   "local_bytes_per_param": target_bytes_per_param(facts, local=True),
                   "local_weights_bytes": int(s.t_wl), "local_weights_gib": _gib(s.t_wl),
                   "forward_activations_gib": _gib(s.t_act)},
        "modes": modes, "recommended": recommended, "paths": target_paths(facts),
        "time": _time(c, facts, cfg, s, tokens=tokens, sequences=sequences, gpus=gpus, calibration=calibration,
                      no_calibration=no_calibration),
        "mean_tokens": s.seq, "query_tokens_per_sequence": s.q,
    }
