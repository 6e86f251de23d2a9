"""vLLM's own "speculators" checkpoint format for DFlash: write it, read it, tell it from z-lab's.

Usage:
    info = export_speculators("runs/x/train/best", "runs/x/export-spec", target=cfg.target)  # checked
    write_speculators(model, tmp, verifier=v, dtype="float32")       # config.json + model.safetensors
    model, fmt = load_any_drafter("some/drafter")                    # fmt: "zlab" | "speculators"
    `vllm serve runs/x/export-spec`                                  # the verifier comes from config.json

The format (vllm-project/speculators `DFlashSpeculatorConfig`, as vLLM's speculators adapter reads
it; written here from our contract, no code shared): `config.json` holds the draft's Qwen3 config as
`transformer_layer_config` (sliding-window layers and `is_causal` included), `block_size`,
`draft_vocab_size`, `mask_token_id`, `aux_hidden_state_layer_ids` = our `target_layer_ids` + 1,
`sample_from_anchor false`, `sliding_window_non_causal` = not `drafter.causal` (vLLM applies it to
every layer: a wrong value silently serves the wrong attention) and `speculators_config` (greedy,
B − 1 speculative tokens, the verifier). `model.safetensors` holds our draft tensors plus the
verifier's embedding and head rows (and `d2t` / `t2d` for V' < V).

Another drafter family writes its own `architectures`, `speculators_model_type` and algorithm name
and the knobs vLLM reads at the top level (`Formats.speculators_keys`); a set knob vLLM would drop, or
a family its reader does not know (`Formats.speculators` False), is refused (exit 2). The reader takes in-block causality as vLLM resolves it, refuses what the decoder cannot run and any
missing or malformed key with a `UsageError` (exit 2) naming the file and key, and checks the stored
embedding and head for shape before dropping them (we draft with the target's head rows).
The keys that are easy to get wrong: docs/architecture.md, "Export formats".
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import save_file

from dflashkit import family
from dflashkit.errors import DflashkitError, UsageError
from dflashkit.export.profile import PROFILE_FILE
from dflashkit.export.hf import (DTYPES, WEIGHTS, build_drafter, load_drafter, open_weights, read_config,
                                 read_draft_vocab_size, read_target_head)
from dflashkit.model.draft_vocab import t2d_mask
from dflashkit.model.drafter import DFlashDraftModel
from dflashkit.family.contract import DrafterContract
from dflashkit.target.load import resolve_target_path
from dflashkit.rundir import atomic_dir, atomic_path, atomic_write_json, write_manifest

log = logging.getLogger("dflashkit.export")

FORMATS = ("zlab", "speculators")
# z-lab config keys that are DFlash's, not the draft transformer's
_DFLASH_KEYS = ("architectures", "auto_map", "block_size", "num_target_layers", "dflash_config", "draft_vocab_size")
# tensors the speculators library itself keeps out of, or tolerates in, a checkpoint
_IGNORED = ("verifier_lm_head.weight", "verifier_norm.weight")
# dflash_config keys vLLM's `update_dflash` writes itself from the speculators config (`causal` from
# `sliding_window_non_causal`), or that the transformer_layer_config carries (`attention: mla`: its DeepSeek MLA
# keys, read back by `family.dflash.read_attention`); a family's other dflash_config keys travel only as its
# `speculators_keys`
_CARRIED = ("causal", "attention")


def is_speculators(cfg: dict[str, Any]) -> bool:
    """True for a speculators config.json (what vLLM checks: a `speculators_config`; or the model type)."""
    return "speculators_config" in cfg or "speculators_model_type" in cfg


def refuse_format(fam: family.Family, *, where: str) -> None:
    """UsageError (exit 2) for a family vLLM's speculators reader does not know (`Formats.speculators`)."""
    if not fam.formats.speculators:
        raise UsageError(f"{where}: vLLM 0.32's speculators reader has no {fam.title} algorithm (its `dflash` "
                         f"reader would declare the drafter DFlashDraftModel and serve it without its "
                         f"{fam.title} head), so a {fam.architecture} travels in the z-lab format only",
                         hint="export with export.format=zlab; serve it with --speculative-config "
                         "'{\"method\": \"dflash\", \"model\": DIR, ...}'")


def speculators_config(contract: DrafterContract, *, verifier: str, verifier_architectures: list[str],
                       dtype: str = "bfloat16", draft_vocab_size: int | None = None) -> dict[str, Any]:
    """The speculators `config.json` for a drafter contract (a pure function: same inputs, same bytes)."""
    zlab = contract.to_hf_config(dtype=dtype)
    layer = {k: v for k, v in zlab.items() if k not in _DFLASH_KEYS}
    b = contract.block_size
    fam = contract.family
    refuse_format(fam, where="export.format=speculators")
    knobs = {k: getattr(contract.knobs, k) for k in fam.knob_names}
    per_layer = getattr(contract, "causal_layers", None)
    if per_layer is not None:
        raise UsageError(f"the drafter is causal in its sliding layers only (causal_layers {per_layer}); "
                         "vLLM 0.32's speculators reader sets one in-block causality for every layer "
                         "(dflash_config.causal = not sliding_window_non_causal), so it would serve another drafter",
                         hint="export with export.format=zlab (vLLM reads that per-layer causality from layer_types)")
    family_keys = fam.formats.dflash_config(contract)  # what the z-lab format carries in dflash_config
    dropped = [k for k in family_keys if k not in fam.formats.speculators_keys and k not in _CARRIED]
    if dropped:
        raise UsageError(f"drafter.{dropped[0]} is set ({', '.join(f'{k}={family_keys[k]}' for k in dropped)}); "
                         f"vLLM 0.32's speculators reader carries only {', '.join(fam.formats.speculators_keys)} of a "
                         f"{fam.architecture} into dflash_config, so vLLM would serve another drafter",
                         hint="export with export.format=zlab (its dflash_config carries them)")
    return {
        "architectures": [fam.architecture],
        "speculators_model_type": fam.name,
        "transformer_layer_config": layer,
        "draft_vocab_size": int(draft_vocab_size or contract.vocab_size),
        "block_size": b,
        "aux_hidden_state_layer_ids": [i + 1 for i in contract.target_layer_ids],
        "mask_token_id": contract.mask_token_id,
        "sample_from_anchor": False,
        "sliding_window_non_causal": not zlab["dflash_config"].get("causal", False),
        "dtype": dtype,
        **{k: knobs[k] for k in fam.formats.speculators_keys},
        **{k: zlab[k] for k in fam.formats.speculators_top_keys},
        "speculators_config": {
            "algorithm": fam.name,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": b - 1,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
    }


def _need(cfg: dict[str, Any], dotted: str, source: str, kind: type) -> Any:
    """The value at `dotted` in `cfg`, of `kind`; else UsageError naming the file and the key."""
    node: Any = cfg
    for part in dotted.split("."):
        if isinstance(node, list):
            node = node[int(part)] if part.isdigit() and int(part) < len(node) else None
        elif isinstance(node, dict):
            node = node.get(part)
        else:
            node = None
        if node is None:
            raise UsageError(f"{source}: missing key `{dotted}` (speculators DFlash config)",
                             hint="re-export with `dflashkit export export.format=speculators`")
    if not isinstance(node, kind) or (isinstance(node, bool) and kind is not bool):
        raise UsageError(f"{source}: key `{dotted}` is {node!r}, expected {kind.__name__}",
                         hint="re-export with `dflashkit export export.format=speculators`")
    return node


def read_speculators_contract(cfg: dict[str, Any], *, source: str = "config.json") -> tuple[DrafterContract, int | None]:
    """The drafter contract and draft vocab size (None = full) of a speculators DFlash config.json."""
    kind = _need(cfg, "speculators_model_type", source, str)
    if kind not in family.FAMILIES:
        raise UsageError(f"{source}: key `speculators_model_type` is {kind!r}, not one of {family.names()}: "
                         "dflashkit reads its drafter families only", hint="pass a DFlash speculators checkpoint")
    fam = family.get(kind, key="speculators_model_type")
    refuse_format(fam, where=f"{source}: speculators_model_type {kind}")
    missing = [k for k in fam.formats.speculators_keys if cfg.get(k) is None]
    if missing:
        raise UsageError(f"{source}: a `speculators_model_type` {kind} config without the key(s) {missing} "
                         "(vLLM's reader takes them from the top level)",
                         hint="re-export with `dflashkit export export.format=speculators`")
    defaults = fam.knobs()
    knobs = {k: _need(cfg, k, source, type(getattr(defaults, k))) for k in fam.formats.speculators_keys}
    layer = _need(cfg, "transformer_layer_config", source, dict)
    aux = _need(cfg, "aux_hidden_state_layer_ids", source, list)
    if not aux or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 1 for i in aux):
        raise UsageError(f"{source}: key `aux_hidden_state_layer_ids` {aux!r} must be a non-empty list of "
                         "integers >= 1 (hidden_states indices: our target_layer_ids + 1)")
    mask = _need(cfg, "mask_token_id", source, int)
    spec = _need(cfg, "speculators_config.proposal_methods.0.speculative_tokens", source, int)
    _need(cfg, "speculators_config.verifier.name_or_path", source, str)
    b = cfg.get("block_size", spec + 1)
    if cfg.get("sample_from_anchor"):
        raise UsageError(f"{source}: key `sample_from_anchor` is true; dflashkit drafts B - 1 tokens after the "
                         "anchor (the bonus token) and cannot run this drafter")
    if isinstance(b, bool) or not isinstance(b, int) or b - 1 != spec:
        raise UsageError(f"{source}: key `block_size` {b!r} does not match "
                         f"`speculators_config.proposal_methods.0.speculative_tokens` {spec} (must be block_size - 1)")
    non_causal = cfg.get("sliding_window_non_causal", True)  # vLLM's default: a missing key reads as true
    if not isinstance(non_causal, bool):
        raise UsageError(f"{source}: key `sliding_window_non_causal` is {non_causal!r}, expected true or false",
                         hint="re-export with `dflashkit export export.format=speculators`")
    zlab = {**layer, **{k: cfg[k] for k in fam.formats.speculators_top_keys if k in cfg},
            "sample_from_anchor": False, "block_size": b, "architectures": [fam.architecture],
            "dflash_config": {"block_size": b, "mask_token_id": mask, "target_layer_ids": [i - 1 for i in aux],
                              "causal": not non_causal, **knobs}}
    missing = [f"transformer_layer_config.{k}" for k in ("hidden_size", "num_hidden_layers", "num_attention_heads")
               if k not in layer]
    if missing:
        raise UsageError(f"{source}: missing key `{missing[0]}`" + (f" (and {missing[1:]})" if missing[1:] else ""),
                         hint="re-export with `dflashkit export export.format=speculators`")
    contract = DrafterContract.from_hf_config(zlab, source=source)
    contract.check()
    size = cfg.get("draft_vocab_size")
    return contract, read_draft_vocab_size({"vocab_size": contract.vocab_size, "draft_vocab_size": size},
                                           source=source)


def load_speculators(drafter_dir: str | Path, *, dtype: torch.dtype | None = None,
                     device: str | torch.device = "cpu") -> DFlashDraftModel:
    """Load a speculators DFlash dir into our drafter (checked like `load_drafter`; eval mode, no grad)."""
    d = Path(drafter_dir)
    config_path, cfg = read_config(d)
    contract, size = read_speculators_contract(cfg, source=str(config_path))
    state = open_weights(d)
    h, n = contract.hidden_size, contract.vocab_size
    embed = state.pop("embed_tokens.weight", None)
    if embed is not None and tuple(embed.shape) != (n, h):
        raise UsageError(f"{d / WEIGHTS}: embed_tokens.weight has shape {tuple(embed.shape)}, expected "
                         f"[transformer_layer_config.vocab_size {n}, hidden_size {h}]",
                         hint="config.json and model.safetensors come from different drafters; re-export")
    if size is None:  # the full-vocab head is the verifier's: checked, not kept (z-lab keeps none)
        head = state.pop("lm_head.weight", None)
        if head is not None and tuple(head.shape) != (n, h):
            raise UsageError(f"{d / WEIGHTS}: lm_head.weight has shape {tuple(head.shape)}, expected "
                             f"[draft_vocab_size {n}, hidden_size {h}]",
                             hint="config.json and model.safetensors come from different drafters; re-export")
    for k in _IGNORED:
        state.pop(k, None)
    return build_drafter(contract, size, state, d, dtype=dtype, device=device)


def head_mismatch(drafter_dir: str | Path, target: Any) -> float | None:
    """Max |stored lm_head - the target head's rows| relative to the head's scale, with a warning if > 1e-2.

    vLLM drafts with the checkpoint's own head, dflashkit with the target's: a speculators drafter
    whose head is not the target's is decoded differently by the two (τ will differ). None when
    either head cannot be read (no stored head, a GGUF target).
    """
    from safetensors import safe_open

    d = Path(drafter_dir)
    try:
        model_dir, gguf = resolve_target_path(target.path, target.gguf_file)
        head = None if gguf else read_target_head(model_dir)
        with safe_open(str(d / WEIGHTS), "pt") as fh:
            stored = fh.get_tensor("lm_head.weight") if "lm_head.weight" in fh.keys() else None
            d2t = fh.get_tensor("d2t") if "d2t" in fh.keys() else None
    except (DflashkitError, OSError) as e:
        log.debug("head check skipped: %s", e)
        return None
    if head is None or stored is None:
        return None
    rows = head if d2t is None else head.index_select(0, torch.arange(d2t.numel()) + d2t)
    if rows.shape != stored.shape:
        return None  # the loader has named the shape problem already
    scale = max(1e-6, rows.float().abs().max().item())
    diff = (stored.float() - rows.float()).abs().max().item() / scale
    if diff > 1e-2:
        log.warning("%s: lm_head.weight is not the target's head (max relative diff %.3g): vLLM drafts with the "
                    "stored head, dflashkit with the target's, so their acceptance will differ", d / WEIGHTS, diff)
    return diff


def drafter_format(drafter_dir: str | Path) -> str:
    """"speculators" or "zlab", from the dir's config.json (UsageError if it is missing or not JSON)."""
    return "speculators" if is_speculators(read_config(Path(drafter_dir))[1]) else "zlab"


def load_any_drafter(drafter_dir: str | Path, *, dtype: torch.dtype | None = None,
                     device: str | torch.device = "cpu") -> tuple[DFlashDraftModel, str]:
    """Either format into the same drafter, and which format it was."""
    fmt = drafter_format(drafter_dir)
    load = load_speculators if fmt == "speculators" else load_drafter
    return load(drafter_dir, dtype=dtype, device=device), fmt


def write_speculators(model: DFlashDraftModel, out_dir: str | Path, *, verifier: str,
                      verifier_architectures: list[str], embed: torch.Tensor, head: torch.Tensor,
                      dtype: str = "bfloat16") -> Path:
    """Write `config.json` + `model.safetensors` of the speculators format into `out_dir` (atomic per file).

    Args:
        verifier: what vLLM serves as the target (`speculators_config.verifier.name_or_path`).
        embed, head: the target's input embedding and output head, both [V, H].
    """
    if dtype not in DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}", hint=f"one of {sorted(DTYPES)}")
    c = model.contract
    for name, t in (("embedding", embed), ("head", head)):
        if tuple(t.shape) != (c.vocab_size, c.hidden_size):
            raise UsageError(f"target {name} {tuple(t.shape)} does not fit the drafter (vocab {c.vocab_size}, "
                             f"hidden {c.hidden_size})", hint="set target.path to the drafter's target")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    to = DTYPES[dtype]
    state = {k: v.detach().to("cpu", to if v.is_floating_point() else v.dtype).contiguous()
             for k, v in model.state_dict().items()}
    vocab = model.draft_vocab
    rows = head.detach().cpu() if vocab is None else head.detach().cpu().index_select(0, vocab.cpu())
    state["embed_tokens.weight"] = embed.detach().to("cpu", to).contiguous()
    state["lm_head.weight"] = rows.to(to).contiguous()
    if vocab is not None:
        state["t2d"] = t2d_mask(vocab, c.vocab_size)
    with atomic_path(out / WEIGHTS) as tmp:
        save_file(state, str(tmp), metadata={"format": "pt"})
    atomic_write_json(out / "config.json", speculators_config(
        c, verifier=verifier, verifier_architectures=verifier_architectures, dtype=dtype,
        draft_vocab_size=model.draft_vocab_size))
    return out


def check_speculators(source: DFlashDraftModel, export_dir: Path, head: torch.Tensor, atol: float) -> dict[str, Any]:
    """Reload `export_dir` and compare with `source` on a fixed input, through the target head; raise on mismatch.

    Also checks that the contract (layer ids, mask id, block size, vocab map) survived unchanged.
    """
    c = source.contract
    back = load_speculators(export_dir, dtype=torch.float32)
    bc = back.contract
    vocab = source.draft_vocab
    same_vocab = (vocab is None) == (back.draft_vocab is None) and (vocab is None or torch.equal(vocab, back.draft_vocab))
    changed = [k for k in ("block_size", "target_layer_ids", "mask_token_id", "hidden_size", "num_draft_layers",
                           "vocab_size", "drafter_type") if getattr(c, k) != getattr(bc, k)]
    changed += [k for k in c.family.knob_names if getattr(c.knobs, k) != getattr(bc.knobs, k, None)]
    changed += [] if same_vocab else ["draft vocab"]
    if changed:
        raise DflashkitError(f"export reload check failed in {export_dir}: {changed} differ from the source",
                             hint="nothing was replaced; this is a bug, please report it")
    g = torch.Generator().manual_seed(0)
    t, q = 8, c.block_size
    noise = torch.randn(1, q, c.hidden_size, generator=g)
    ctx = torch.randn(1, t, c.num_features * c.hidden_size, generator=g)
    pos = torch.arange(t + q)[None]
    proj = (head if vocab is None else head.index_select(0, vocab)).float()
    with torch.inference_mode():
        ref = source.float()(noise, ctx, pos) @ proj.T
        got = back(noise, ctx, pos) @ proj.T
    scale = max(1.0, ref.abs().max().item())
    diff = (got - ref).abs().max().item()
    if diff > atol * scale:
        raise DflashkitError(f"export reload check failed in {export_dir}: max |logits diff| exported vs source "
                             f"{diff:.3g} (allowed {atol * scale:.3g})",
                             hint="nothing was replaced; try export.dtype=float32 or raise export.check_atol")
    top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    walk = c.family.formats.reload_check(source, back, head)  # the family's own part (DFlash2: the selector's walk)
    return {"max_diff_vs_source": diff, "logit_scale": scale, "top1_agreement": top1, "compared": "logits", **walk}


def target_tensors(target: Any) -> tuple[torch.Tensor, torch.Tensor, str, list[str]]:
    """(embedding [V, H], head [V, H], verifier name, architectures) of a `TargetSection`, in float32."""
    from dflashkit.target.load import load_target

    if not target.path:
        raise UsageError("the speculators format holds the target's embedding and head and names the target "
                         "(verifier) vLLM serves, so it needs the target", hint="set target.path")
    t = load_target(target, device="cpu", dtype="float32", with_tokenizer=False)
    local = Path(target.path).expanduser()
    verifier = str(local.resolve()) if local.exists() else str(target.path)
    archs = list(getattr(t.config, "architectures", None) or [])  # transformers may drop it on load:
    if not archs and (t.model_dir / "config.json").is_file():      # the file says what the target is
        archs = list(json.loads((t.model_dir / "config.json").read_text()).get("architectures") or [])
    return (t.model.get_input_embeddings().weight.detach(), t.lm_head.weight.detach(), verifier, archs)


def export_speculators(src_dir: str | Path, out_dir: str | Path, *, target: Any, dtype: str = "bfloat16",
                       atol: float = 5e-2, readme: Callable[[DFlashDraftModel], str] | None = None,
                       config_hash: str = "", inputs: dict[str, Any] | None = None,
                       profile: Callable[[Path], dict[str, Any]] | None = None) -> dict[str, Any]:
    """A trained drafter dir (either format) → a checked speculators dir at `out_dir`.

    Built in a temp dir beside `out_dir` (config.json, model.safetensors, README.md from `readme`,
    manifest.json of stage export), reloaded and compared with the source, and only then renamed
    into place (`out_dir` may only replace an earlier export). `target` is a `TargetSection`. `profile`
    writes the speculation profile into the temp dir (the export stage's) and says what it did.
    """
    t0 = time.time()
    model, fmt = load_any_drafter(src_dir, dtype=torch.float32)
    refuse_format(model.contract.family, where="export.format=speculators")   # before the target is read
    embed, head, verifier, archs = target_tensors(target)
    outputs = ["config.json", WEIGHTS] + (["README.md"] if readme else [])
    with atomic_dir(out_dir, owner="export") as tmp:
        write_speculators(model, tmp, verifier=verifier, verifier_architectures=archs, embed=embed, head=head,
                          dtype=dtype)
        if readme:
            (tmp / "README.md").write_text(readme(model))
        check = check_speculators(model, tmp, head, atol)
        shipped = profile(tmp) if profile else None
        write_manifest(tmp, stage="export", config_hash=config_hash, started=t0,
                       inputs={"source": str(src_dir), "source_format": fmt, **(inputs or {})},
                       counts={"tensors": len(model.state_dict())},
                       outputs=outputs + ([PROFILE_FILE] if (shipped or {}).get("shipped") else []),
                       extra={"format": "speculators", "reload_check": check, "speculation_profile": shipped})
    return {"out_dir": str(out_dir), "format": "speculators", "dtype": dtype, "block_size": model.contract.block_size,
            "reload_check": check, "speculation_profile": shipped,
            **({"draft_vocab_size": model.draft_vocab_size} if model.draft_vocab is not None else {})}
