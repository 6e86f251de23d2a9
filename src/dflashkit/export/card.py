"""The exported drafter's model card (README.md): target, training-data counts, settings, the measured
τ/speedup from `eval/results.json`, and the SGLang / vLLM / transformers launch lines for its format.

Usage:
    text = model_card(cfg, contract, out_dir, rd, draft_vocab_size, fmt="zlab",   # or fmt="speculators"
                      results=read_eval_results(rd))                          # dflashkit.decode.evaluation
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _counts(rd: Any) -> dict[str, Any]:
    out = {}
    for stage in ("prepare", "generate", "tokenize", "train"):
        m = rd.manifest(stage)
        if m and m.get("counts"):
            out[stage] = m["counts"]
    return out


def model_card(cfg: Any, contract: Any, out_dir: Path, rd: Any, draft_vocab_size: int | None = None,
               fmt: str = "zlab", results: dict[str, Any] | None = None) -> str:
    """README.md: target, data counts, settings, measured τ/speedup (`results`: eval's results.json, read by
    the stage through `decode.evaluation.read_eval_results`), launch lines (for format `fmt`)."""
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
    res = results
    if res is not None:
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
    lines += contract.family.formats.card_lines(contract)  # what serving this family needs (DFlash2: vLLM's V2 runner)
    return "\n".join(lines)
