"""The drafter directory format (z-lab): `config.json` + `model.safetensors`, read and written here.

Usage:
    save_drafter(model, "runs/x/train/final", dtype="bfloat16")   # trainer and export write this
    save_drafter(model, "runs/x/export", head=target_head)        # reduced vocab: + lm_head rows, t2d
    drafter = load_drafter("runs/x/train/final", dtype=torch.float32)  # validated, safetensors only
    drafter.contract.check(target)                                # fits the loaded target? (exit 2)
    head = read_target_head("path/to/target")                     # [V, H] lm_head (or tied embedding)

`config.json` is `DrafterContract.to_hf_config()` (a Qwen3 config plus `dflash_config`,
top-level `block_size` / `num_target_layers`); tensor names are the z-lab ones (dflash-spec §2.2).
Every problem raises `UsageError` (exit 2) naming the file and key, before any decoding.

A reduced draft vocabulary (`model/draft_vocab.py`) adds, and only then: `draft_vocab_size` at
the top of config.json (what vLLM reads) and in `dflash_config`; the int64 tensor `d2t` [V']
(vLLM offsets, target id = i + d2t[i]); and, when `save_drafter` is given the target head (export),
`lm_head.weight` [V', H] = those target-head rows plus the bool `t2d` [V]. `load_drafter` checks
all of them against each other and accepts full-vocab z-lab checkpoints unchanged; our decoder
drafts with the target's own head rows, so a stored `lm_head.weight` is checked, not used.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dflashkit import family
from dflashkit.errors import UsageError
from dflashkit.model.draft_vocab import check_draft_vocab, from_offsets, t2d_mask, to_offsets
from dflashkit.model.drafter import DFlashDraftModel
from dflashkit.family import Family, by_architecture
from dflashkit.family.contract import DrafterContract
from dflashkit.rundir import atomic_path, atomic_write_json

log = logging.getLogger("dflashkit.export")

WEIGHTS = "model.safetensors"
MODELING_FILE = "dflash.py"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def write_modeling_file(out_dir: str | Path, fam: Family) -> Path:
    """The shipped remote-code `dflash.py` in `out_dir`: `export/dflash_modeling.py`, plus the family's own
    class when it is not in that file (`Formats.modeling_source`: a plugin family)."""
    text = (Path(__file__).parent / "dflash_modeling.py").read_text()
    if fam.formats.modeling_source:
        text = text.rstrip("\n") + "\n\n\n" + fam.formats.modeling_source.strip("\n") + "\n"
    path = Path(out_dir) / MODELING_FILE
    path.write_text(text)
    return path


def save_drafter(model: DFlashDraftModel, out_dir: str | Path, dtype: str = "bfloat16",
                 head: torch.Tensor | None = None) -> Path:
    """Write `config.json` + `model.safetensors` (z-lab names, `dtype`) into `out_dir`, atomically per file.

    Args:
        head: the target's output head [V, H]; with a reduced draft vocab it adds `lm_head.weight`
            (its rows d2t, in `dtype`) and `t2d`, which vLLM needs. Ignored for a full-vocab drafter.
    """
    if dtype not in DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}", hint=f"one of {sorted(DTYPES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", DTYPES[dtype] if v.is_floating_point() else v.dtype).contiguous()
             for k, v in model.state_dict().items()}
    vocab = model.draft_vocab
    if vocab is not None and head is not None:
        if head.shape[-1] != model.contract.hidden_size:
            raise UsageError(f"target head {tuple(head.shape)} does not match the drafter's hidden size "
                             f"{model.contract.hidden_size}", hint="set target.path to the drafter's target")
        state["lm_head.weight"] = head.detach().to("cpu").index_select(0, vocab.cpu()).to(DTYPES[dtype]).contiguous()
        state["t2d"] = t2d_mask(vocab, head.shape[0])
    with atomic_path(out / WEIGHTS) as tmp:
        save_file(state, str(tmp), metadata={"format": "pt"})
    atomic_write_json(out / "config.json", model.contract.to_hf_config(dtype=dtype,
                                                                       draft_vocab_size=model.draft_vocab_size))
    return out


def read_draft_vocab_size(cfg: dict, *, source: str = "config.json") -> int | None:
    """V' of a drafter config.json (top-level `draft_vocab_size`, as vLLM, or in `dflash_config`).

    None when absent or equal to `vocab_size` (the full vocab, as vLLM reads it).
    """
    top = cfg.get("draft_vocab_size")
    inner = (cfg.get("dflash_config") or {}).get("draft_vocab_size")
    if top is not None and inner is not None and top != inner:
        raise UsageError(f"{source}: draft_vocab_size {top} != dflash_config.draft_vocab_size {inner}",
                         hint="the two must agree; re-export the drafter")
    n = top if top is not None else inner
    if n is None:
        return None
    vocab = int(cfg.get("vocab_size") or 0)
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0 or (vocab and n > vocab):
        raise UsageError(f"{source}: draft_vocab_size {n!r} must be an integer in [1, vocab_size {vocab}]")
    return None if n == vocab else n


def read_config(drafter_dir: str | Path) -> tuple[Path, dict]:
    path = Path(drafter_dir) / "config.json"
    if not path.is_file():
        raise UsageError(f"{path} not found: not a drafter directory",
                         hint="point at a dir with config.json + model.safetensors (e.g. train/final)")
    try:
        return path, json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UsageError(f"{path}: invalid JSON ({e})", hint="re-export the drafter") from None


def read_contract(drafter_dir: str | Path) -> DrafterContract:
    """The contract stored in a drafter dir's `config.json` (UsageError naming the missing key)."""
    return _contract(*read_config(drafter_dir))


def _contract(path: Path, cfg: dict) -> DrafterContract:
    if "speculators_model_type" in cfg or "speculators_config" in cfg:
        raise UsageError(f"{path}: a vLLM speculators-format checkpoint (key `speculators_model_type`), not the "
                         "z-lab format dflashkit decodes with",
                         hint="`dflashkit import DIR` converts it (or export with export.format=zlab)")
    contract = DrafterContract.from_hf_config(cfg, source=str(path))
    contract.check()
    return contract


def open_weights(drafter_dir: Path) -> dict[str, torch.Tensor]:
    files = [drafter_dir / WEIGHTS]
    index = drafter_dir / f"{WEIGHTS}.index.json"
    if not files[0].is_file() and index.is_file():
        files = sorted({drafter_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
    if not files[0].is_file():
        raise UsageError(f"{files[0]} not found (dflashkit reads safetensors only)",
                         hint="re-export the drafter with `dflashkit export`")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise UsageError(f"{f}: cannot read safetensors ({e})",
                             hint="the file is corrupt or truncated; re-export or re-download it") from None
    return state


def _draft_vocab(state: dict[str, torch.Tensor], size: int | None, contract: DrafterContract, weights: Path,
                 config: Path) -> torch.Tensor | None:
    """Validate the reduced-vocab tensors of a checkpoint (d2t, t2d, lm_head.weight) → target ids or None.

    Leaves a normalised int64 `d2t` in `state` and removes `t2d` / `lm_head.weight` (checked, not loaded).
    """
    hint = "config.json and model.safetensors come from different drafters; re-export"
    d2t = state.get("d2t")
    if size is None:
        if d2t is not None or "t2d" in state:
            raise UsageError(f"{weights} holds d2t/t2d (a reduced draft vocabulary) but {config} sets no "
                             "draft_vocab_size", hint=hint)
        return None
    if d2t is None:
        raise UsageError(f"{config} sets draft_vocab_size {size} but {weights} has no `d2t` tensor", hint=hint)
    if d2t.dim() != 1 or d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise UsageError(f"{weights}: d2t must be a 1-D integer tensor (offsets), got "
                         f"{str(d2t.dtype).removeprefix('torch.')} {tuple(d2t.shape)}", hint=hint)
    vocab = from_offsets(d2t)
    check_draft_vocab(vocab, vocab_size=contract.vocab_size, size=size, source=f"{weights}: d2t")
    state["d2t"] = to_offsets(vocab)
    head = state.pop("lm_head.weight", None)
    if head is not None and tuple(head.shape) != (size, contract.hidden_size):
        raise UsageError(f"{weights}: lm_head.weight has shape {tuple(head.shape)}, expected "
                         f"[draft_vocab_size {size}, hidden_size {contract.hidden_size}]", hint=hint)
    t2d = state.pop("t2d", None)
    if t2d is not None:
        n = contract.vocab_size
        if t2d.dim() != 1 or (n and t2d.numel() != n) or not torch.equal(t2d.bool().nonzero().flatten(), vocab):
            raise UsageError(f"{weights}: t2d {tuple(t2d.shape)} does not mark exactly the target ids of d2t "
                             f"(vocab_size {n})", hint=hint)
    return vocab


def load_drafter(drafter_dir: str | Path, *, dtype: torch.dtype | None = None,
                 device: str | torch.device = "cpu") -> DFlashDraftModel:
    """Load a z-lab/dflashkit drafter dir, validating tensor names and shapes; eval mode, no grad.

    Args:
        drafter_dir: dir with config.json (+ dflash_config) and model.safetensors.
        dtype: cast to this dtype (default: the stored dtype).
        device: where to put the model.
    Raises:
        UsageError: missing/invalid config keys, missing, unexpected or mis-shaped tensors, corrupt
            file, or reduced-vocab tensors (d2t, t2d, lm_head.weight) that disagree with draft_vocab_size.
    """
    d = Path(drafter_dir)
    config_path, cfg = read_config(d)  # read once: the contract and the draft vocab size
    contract = _contract(config_path, cfg)
    size = read_draft_vocab_size(cfg, source=str(config_path))
    return build_drafter(contract, size, open_weights(d), d, dtype=dtype, device=device)


def build_drafter(contract: DrafterContract, size: int | None, state: dict[str, torch.Tensor], d: Path, *,
                  dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> DFlashDraftModel:
    """The drafter from a contract and the tensors of `d`/model.safetensors, checked as `load_drafter` says.

    `size` is the draft vocab size (None: full vocab); the other reader (export/speculators.py) uses this.
    """
    config_path = d / "config.json"

    fam = contract.family
    vocab = _draft_vocab(state, size, contract, d / WEIGHTS, config_path)
    family.refuse_draft_vocab(fam, size, where=f"{config_path}: draft_vocab_size",
                              hint="re-export the drafter without a reduced draft vocabulary")
    model = family.new_drafter(contract, draft_vocab=vocab)
    want = model.state_dict()
    family.check_tensors(fam, set(state), set(want), weights=d / WEIGHTS, config=config_path)
    missing = sorted(set(want) - set(state))
    unexpected = sorted(set(state) - set(want))
    shapes = [f"{k}: file {tuple(state[k].shape)} != config {tuple(want[k].shape)}"
              for k in want if k in state and state[k].shape != want[k].shape]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing tensors {missing[:5]}{' …' if len(missing) > 5 else ''}")
        if unexpected:
            parts.append(f"unexpected tensors {unexpected[:5]}{' …' if len(unexpected) > 5 else ''}")
        parts.extend(shapes[:5])
        raise UsageError(f"{d / WEIGHTS} does not match {d / 'config.json'}: " + "; ".join(parts),
                         hint="the weights and config come from different drafters; re-export")
    not_float = [f"{k} ({str(state[k].dtype).removeprefix('torch.')})" for k in want
                 if want[k].is_floating_point() and not state[k].is_floating_point()]
    if not_float:
        raise UsageError(f"{d / WEIGHTS}: {len(not_float)} of the drafter's weight tensors are not floating point: "
                         f"{', '.join(not_float[:3])}{' …' if len(not_float) > 3 else ''}; dflashkit reads "
                         "float32, bfloat16 or float16 drafters",
                         hint="a quantized drafter cannot be imported, decoded or warm-started from: export its "
                         "weights in a float dtype (the checkpoint before quantization)")
    stored = next((v.dtype for v in state.values() if v.is_floating_point()), torch.float32)
    model.load_state_dict(state, strict=True)
    model.to(device=device, dtype=dtype or stored).eval().requires_grad_(False)
    return model


def read_target_head(target_dir: str | Path) -> torch.Tensor | None:
    """The target's output head [V, H] read straight from its safetensors (tied: the embedding)."""
    from safetensors import safe_open

    d = Path(target_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
    else:
        weight_map = {}
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(str(f), "pt") as fh:
                weight_map.update({k: f.name for k in fh.keys()})
    for suffix in ("lm_head.weight", "embed_tokens.weight"):
        names = [k for k in weight_map if k.endswith(suffix)]
        if names:
            with safe_open(str(d / weight_map[names[0]]), "pt") as fh:
                return fh.get_tensor(names[0])
    return None


def load_shipped_model(export_dir: str | Path):
    """Load an export through its own `dflash.py` (as trust_remote_code would), without caching code."""
    path = Path(export_dir) / MODELING_FILE
    spec = importlib.util.spec_from_file_location(f"dflash_export_{abs(hash(str(path)))}", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    arch = by_architecture(read_config(export_dir)[1].get("architectures")).architecture  # its family's class
    return getattr(module, arch).from_pretrained(str(export_dir), dtype=torch.float32).eval()
