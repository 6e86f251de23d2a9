"""`dflashkit export`: the serving-ready drafter dir (z-lab format) with a model card, checked on reload.

Inputs:  `train/best/` (the best held-out simulated τ, `train.keep_best`), else `train/final/` (or a
         positional DIR), `eval/results.json` and manifests if present.
Outputs: `export.out_dir` (default `<run_dir>/export/`): config.json (architectures, auto_map →
         dflash.py, dflash_config, top-level block_size/num_target_layers), model.safetensors
         (z-lab tensor names, `export.dtype`), dflash.py (our modeling file:
         `AutoModel.from_pretrained(dir, trust_remote_code=True)`), README.md (model card with the
         SGLang and vLLM launch lines), manifest.json.
Example: dflashkit export -c run.yaml export.dtype=bfloat16
         dflashkit export -c run.yaml --format speculators   (export.format: vLLM's own format,
         export/speculators.py: config.json + model.safetensors + README.md + manifest.json, reloaded
         through our speculators reader and compared the same way; no dflash.py)

A DFlash2 drafter (`drafter.type: dflash2`) exports as `DFlash2DraftModel` (export/dflash2.py; dflash.py
has the class too) and the reload check also requires the same walk through the candidates.

The dir is built in a temp dir beside the destination, reloaded twice (our loader and the shipped
dflash.py) and compared with the source drafter on a fixed input — the logits through the target's
own head when its weights can be read — and only then renamed into place.

A drafter with a reduced draft vocabulary (`drafter.draft_vocab_size`) also gets what vLLM needs:
`lm_head.weight` (the target head's rows d2t, `export.dtype`) and `t2d` beside `d2t`, and the
top-level `draft_vocab_size`; this needs the target head (target.path). SGLang, the z-lab reference
and the shipped dflash.py ignore those tensors and draft with the target's full head (lossless,
but not the vocabulary the drafter was trained for).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from dflashkit.config import RunConfig
from dflashkit.context import StageContext
from dflashkit.errors import DflashkitError, MissingArtifactError
from dflashkit.rundir import RunDir, atomic_dir, write_manifest
from dflashkit.stage_table import stage_hash

log = logging.getLogger("dflashkit.export")


def _counts(rd: Any) -> dict[str, Any]:
    out = {}
    for stage in ("prepare", "generate", "tokenize", "train"):
        m = rd.manifest(stage)
        if m and m.get("counts"):
            out[stage] = m["counts"]
    return out


def model_card(cfg: Any, contract: Any, out_dir: Path, rd: Any, draft_vocab_size: int | None = None,
               fmt: str = "zlab") -> str:
    """README.md: target, data counts, settings, measured τ/speedup, launch lines (for format `fmt`)."""
    b = contract.block_size
    target = cfg.target.path or "TARGET"
    lines = ["---", "library_name: transformers", "tags: [dflash, speculative-decoding, block-diffusion, dflashkit]",
             f"base_model: {target}", "---", "", f"# {cfg.run.name}: DFlash drafter for `{target}`", "",
             "A DFlash block-diffusion draft model (" + ("vLLM speculators" if fmt == "speculators" else "z-lab")
             + " checkpoint format) trained with dflashkit.", "",
             "## Settings", "", "| key | value |", "|---|---|"]
    for k in ("block_size", "num_draft_layers", "target_layer_ids", "mask_token_id", "num_target_layers",
              "hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        lines.append(f"| {k} | {getattr(contract, k)} |")
    if draft_vocab_size:
        lines.append(f"| draft_vocab_size | {draft_vocab_size} (`d2t` offsets, `t2d`, own `lm_head.weight` rows) |")
    lines.append(f"| dtype | {cfg.export.dtype} |")
    counts = _counts(rd)
    if counts:
        lines += ["", "## Training data", ""]
        lines += [f"- {stage}: " + ", ".join(f"{k}={v}" for k, v in c.items()) for stage, c in counts.items()]
    results = rd.root / "eval" / "results.json"
    if results.is_file():
        res = json.loads(results.read_text())
        lines += ["", "## Measured (dflashkit eval, HF reference loop)", "",
                  "| block size | τ | speedup | bound τ·t(1)/t(B) | tokens/s |", "|---|---|---|---|---|"]
        for bs, r in res.get("speculative", {}).items():
            lines.append(f"| {bs} | {r['tau']:.2f} | {r['speedup']:.2f} | {r['bound']:.2f} | "
                         f"{r['decode_tokens_per_s']:.1f} |")
        lines.append(f"\n{res.get('prompts')} prompts, max_new_tokens {res.get('max_new_tokens')}, "
                     f"temperature {res.get('temperature')}, device {res.get('device')}.")
    if fmt == "speculators":  # vLLM reads the target and the draft length from config.json
        return "\n".join(lines + ["", "## Serve", "", "vLLM (the target is `speculators_config.verifier`):", "",
                                  "```bash", f"vllm serve {out_dir}", "```", "",
                                  "SGLang and transformers read the z-lab format: `dflashkit export "
                                  "export.format=zlab`.", ""])
    lines += ["", "## Serve", "", "SGLang:", "", "```bash",
              f"python -m sglang.launch_server --model-path {target} --speculative-algorithm DFLASH "
              f"--speculative-draft-model-path {out_dir} --speculative-num-draft-tokens {b}", "```", "",
              *([("(SGLang ignores the reduced draft vocabulary and drafts over the target's full head: "
                  "lossless, but τ may differ from dflashkit's and vLLM's.)"), ""] if draft_vocab_size else []),
              "vLLM:", "", "```bash",
              f"vllm serve {target} --speculative-config "
              f"'{{\"method\":\"dflash\",\"model\":\"{out_dir}\",\"num_speculative_tokens\":{b - 1}}}'", "```", "",
              "Transformers (this dir ships its own `dflash.py`):", "", "```python",
              "from transformers import AutoModel",
              f"drafter = AutoModel.from_pretrained(\"{out_dir}\", trust_remote_code=True)", "```", ""]
    if getattr(contract, "is_dflash2", False):
        lines += ["DFlash2: vLLM runs the candidate selector on its V2 model runner only (GPU, Triton); its V1 "
                  "runner (the CPU build) refuses the checkpoint. `dflash.py`'s DFlash2DraftModel computes the "
                  "block's hidden states and holds the selector; `dflashkit eval` / `serve --drafter` draft "
                  "through the walk.", ""]
    return "\n".join(lines)


def reload_check(source: Any, export_dir: Path, head: Any, atol: float) -> dict[str, float]:
    """Compare source vs reloaded (ours) vs shipped dflash.py on a fixed input; raise on mismatch.

    `head` [V, H] (or None: hidden states are compared); a reduced-vocab drafter is compared through
    its V' rows, and the reloaded draft vocab must equal the source's.
    """
    import torch

    from dflashkit.export.hf import load_drafter, load_shipped_model

    c = source.contract
    g = torch.Generator().manual_seed(0)
    t, q = 8, c.block_size
    noise = torch.randn(1, q, c.hidden_size, generator=g)
    ctx = torch.randn(1, t, c.num_features * c.hidden_size, generator=g)
    pos = torch.arange(t + q)[None]
    ours = load_drafter(export_dir, dtype=torch.float32)
    shipped = load_shipped_model(export_dir)
    vocab = source.draft_vocab
    if (vocab is None) != (ours.draft_vocab is None) or (vocab is not None and not torch.equal(vocab, ours.draft_vocab)):
        raise DflashkitError(f"export reload check failed in {export_dir}: the reloaded draft vocabulary differs "
                             "from the source's", hint="nothing was replaced; this is a bug, please report it")
    if head is not None and vocab is not None:
        head = head.index_select(0, vocab)
    with torch.inference_mode():
        ref = source.float()(noise, ctx, pos)
        a = ours(noise, ctx, pos)
        b = shipped(noise_embedding=noise, target_hidden=ctx, position_ids=pos)
        proj = head.float() if head is not None else torch.eye(c.hidden_size)
        lr, la, lb = ref @ proj.T, a @ proj.T, b @ proj.T
    scale = max(1.0, lr.abs().max().item())
    diff_export = (la - lr).abs().max().item()
    diff_shipped = (lb - la).abs().max().item()
    if diff_export > atol * scale or diff_shipped > 1e-4 * scale:
        raise DflashkitError(
            f"export reload check failed in {export_dir}: max |logits diff| exported vs source {diff_export:.3g}, "
            f"shipped dflash.py vs our loader {diff_shipped:.3g} (allowed {atol * scale:.3g} / {1e-4 * scale:.3g})",
            hint="nothing was replaced; try export.dtype=float32 or raise export.check_atol")
    top1 = (la.argmax(-1) == lr.argmax(-1)).float().mean().item()
    walk = {}
    if c.is_dflash2:  # the selector's path too: exact when the export is float32
        from dflashkit.export.dflash2 import walk_check

        exact = next(v.dtype for v in ours.state_dict().values() if v.is_floating_point()) == torch.float32
        walk = walk_check(source, ours, head, exact=exact)
    return {"max_diff_vs_source": diff_export, "max_diff_shipped_vs_ours": diff_shipped, "logit_scale": scale,
            "top1_agreement": top1, "compared": "logits" if head is not None else "hidden states", **walk}


def _target_head(cfg: Any):
    from dflashkit.export.hf import read_target_head
    from dflashkit.inspect.target import resolve_target_path

    if not cfg.target.path:
        return None
    try:
        model_dir, gguf = resolve_target_path(cfg.target.path, cfg.target.gguf_file)
        return None if gguf else read_target_head(model_dir)
    except (DflashkitError, OSError) as e:
        log.warning("target head not readable (%s): comparing hidden states instead of logits", e)
        return None


def _loaded_target_head(cfg: Any, hidden_size: int):
    """The target head through the full loader (GGUF targets too); a reduced-vocab export needs its rows."""
    from dflashkit.errors import UsageError
    from dflashkit.model.target import load_target

    if not cfg.target.path:
        raise UsageError("this drafter has a reduced draft vocabulary: its export holds lm_head.weight = the "
                         "target head's rows d2t (vLLM needs them), so `dflashkit export` needs the target",
                         hint="set target.path (in -c run.yaml or target.path=...)")
    head = load_target(cfg.target, device="cpu", with_tokenizer=False).lm_head.weight.detach()
    if head.shape[-1] != hidden_size:
        raise UsageError(f"target head {tuple(head.shape)} does not match the drafter's hidden size {hidden_size}",
                         hint="set target.path to the target this drafter was trained for")
    return head


def run(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict[str, Any]:
    import torch

    from dflashkit.export.hf import MODELING_FILE, save_drafter
    from dflashkit.export.speculators import load_any_drafter

    t0 = time.time()
    from dflashkit.train.checkpoint import read_best, trained_drafter_dir

    if ctx.positionals:
        src, which = Path(ctx.positionals[0]), "dir"
    else:
        src, which = trained_drafter_dir(rd.root / "train")
    source = {"kind": which, **((read_best(src) or {}) if which == "best" else {})}
    if not (src / "config.json").is_file():
        raise MissingArtifactError("trained drafter", src, run="dflashkit train -c run.yaml")
    out = Path(cfg.export.out_dir) if cfg.export.out_dir else rd.root / "export"
    if ctx.dry_run:
        return {"dry_run": True, "source": str(src), "source_kind": which, "out_dir": str(out),
                "format": cfg.export.format}
    if cfg.export.format == "speculators":
        return _run_speculators(cfg, rd, src, which, source, out, t0)
    model, _ = load_any_drafter(src, dtype=torch.float32)  # a speculators source converts back to z-lab
    head = _target_head(cfg)
    if head is not None and head.shape[-1] != model.contract.hidden_size:
        head = None
    if model.draft_vocab is not None and head is None:
        head = _loaded_target_head(cfg, model.contract.hidden_size)
    with atomic_dir(out, owner="export") as tmp:
        save_drafter(model, tmp, dtype=cfg.export.dtype, head=head)
        shutil.copyfile(Path(__file__).parent.parent / "export" / "dflash_modeling.py", tmp / MODELING_FILE)
        (tmp / "README.md").write_text(model_card(cfg, model.contract, out.resolve(), rd, model.draft_vocab_size))
        check = reload_check(model, tmp, head, cfg.export.check_atol)
        write_manifest(tmp, stage="export", config_hash=stage_hash("export", cfg), started=t0,
                       inputs={"source": str(src), "source_kind": which}, counts={"tensors": len(model.state_dict())},
                       outputs=["config.json", "model.safetensors", MODELING_FILE, "README.md"],
                       extra={"reload_check": check})
    if out.resolve() != rd.stage_dir("export", create=False).resolve():
        write_manifest(rd.stage_dir("export"), stage="export", config_hash=stage_hash("export", cfg), started=t0,
                       inputs={"source": str(src)}, outputs=[str(out)], extra={"reload_check": check})
    log.info("exported %s (%s) → %s (reload check: %s max diff %.2g)", src, which, out, check["compared"],
             check["max_diff_vs_source"])
    return {"out_dir": str(out), "source": str(src), "source_info": source, "dtype": cfg.export.dtype, "block_size": model.contract.block_size,
            "reload_check": check,
            **({"draft_vocab_size": model.draft_vocab_size} if model.draft_vocab is not None else {})}


def _run_speculators(cfg: RunConfig, rd: RunDir, src: Path, which: str, source: dict[str, Any], out: Path,
                     t0: float) -> dict[str, Any]:
    """export.format=speculators: vLLM's own format (export/speculators.py), checked the same way."""
    from dflashkit.export.speculators import export_speculators

    res = export_speculators(src, out, target=cfg.target, dtype=cfg.export.dtype, atol=cfg.export.check_atol,
                             readme=lambda m: model_card(cfg, m.contract, out.resolve(), rd, m.draft_vocab_size,
                                                         fmt="speculators"),
                             config_hash=stage_hash("export", cfg), inputs={"source_kind": which})
    if out.resolve() != rd.stage_dir("export", create=False).resolve():
        write_manifest(rd.stage_dir("export"), stage="export", config_hash=stage_hash("export", cfg), started=t0,
                       inputs={"source": str(src)}, outputs=[str(out)],
                       extra={"format": "speculators", "reload_check": res["reload_check"]})
    log.info("exported %s (%s) → %s, speculators format (reload check: max diff %.2g)", src, which, out,
             res["reload_check"]["max_diff_vs_source"])
    return {**res, "source": str(src), "source_info": source}
