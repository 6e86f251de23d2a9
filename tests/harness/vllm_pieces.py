"""vLLM's own DFlash2 and LiLiCorr code, run in the engine's venv on an export's weights: what the engine computes.

Usage:
    [(outputs, report)] = vllm_dflash2_reference([export_dir], inputs, work_dir=tmp)   # tensors by name
    outputs["scores"]                       # [blocks, B-1, K, K] from vLLM's CandidateSelector
    [(outputs, report)] = vllm_lilicorr_reference([export_dir], inputs, work_dir=tmp)
    outputs["scores"]                       # [blocks, n, K, K] from vLLM's LiLiCorrHead
    [(outputs, report)] = vllm_mla_reference([export_dir], inputs, work_dir=tmp)
    outputs["layers.0.out"]                 # [T, H] from vLLM's DeepseekV2MLAAttention
    [(outputs, report)] = vllm_dspark_reference([export_dir], inputs, work_dir=tmp)
    outputs["greedy"]                       # [blocks, k] vLLM's sequential Markov walk (Qwen3DSparkForCausalLM)

`inputs` (tensors, written to safetensors in `work_dir`) and the outputs are described in
`vllm_dflash2_reference.py` and `vllm_lilicorr_reference.py` (beside this file), the scripts these run with
the engine venv's python (vLLM pins its own torch; nothing of dflashkit is imported there). The engine
tests compare them with our models (tests/engines/test_vllm_dflash2.py, test_vllm_lilicorr.py). What they
cannot run on CPU: the attention layer (vLLM's paged KV cache and forward context) and the Triton kernels
(the walk, the CUDA branch of the convolution): those need a GPU (docs/engines.md).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

from dflashkit.errors import DflashkitError

SCRIPT = Path(__file__).with_name("vllm_dflash2_reference.py")
LILICORR_SCRIPT = Path(__file__).with_name("vllm_lilicorr_reference.py")
MLA_SCRIPT = Path(__file__).with_name("vllm_mla_reference.py")
DSPARK_SCRIPT = Path(__file__).with_name("vllm_dspark_reference.py")


def vllm_dflash2_reference(export_dirs: list[Path], inputs: dict[str, Any], *, work_dir: str | Path,
                           timeout_s: float = 300.0) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Run vLLM's DFlash2 modules on each export's weights and `inputs` (one engine-venv process);
    (outputs, report) per export.

    Raises:
        DflashkitError: the engine venv is missing or the script failed (the message holds its stderr).
    """
    return _run(SCRIPT, "DFlash2", export_dirs, inputs, work_dir=work_dir, timeout_s=timeout_s)


def vllm_lilicorr_reference(export_dirs: list[Path], inputs: dict[str, Any], *, work_dir: str | Path,
                            timeout_s: float = 300.0) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Run vLLM's LiLiCorr modules on each (z-lab) export's weights and `inputs`; (outputs, report) per export.

    Raises:
        DflashkitError: the engine venv is missing or the script failed (the message holds its stderr).
    """
    return _run(LILICORR_SCRIPT, "LiLiCorr", export_dirs, inputs, work_dir=work_dir, timeout_s=timeout_s)


def vllm_mla_reference(export_dirs: list[Path], inputs: dict[str, Any], *, work_dir: str | Path,
                       timeout_s: float = 300.0) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Run vLLM's MLA attention module (`DeepseekV2MLAAttention`) on each MLA export's weights and `inputs`
    (`vllm_mla_reference.py`); (outputs, report) per export."""
    return _run(MLA_SCRIPT, "MLA", export_dirs, inputs, work_dir=work_dir, timeout_s=timeout_s)


def vllm_dspark_reference(export_dirs: list[Path], inputs: dict[str, Any], *, work_dir: str | Path,
                          timeout_s: float = 300.0) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Run vLLM's DSpark heads (Markov bias, draft logits, sequential walk, confidence) on each DSpark export's
    weights and `inputs` (`vllm_dspark_reference.py`); (outputs, report) per export."""
    return _run(DSPARK_SCRIPT, "DSpark", export_dirs, inputs, work_dir=work_dir, timeout_s=timeout_s)


def _run(script: Path, title: str, export_dirs: list[Path], inputs: dict[str, Any], *, work_dir: str | Path,
         timeout_s: float) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    from safetensors.torch import load_file, save_file

    from dflashkit.engines import vllm

    venv = vllm.engine_dir()
    if not vllm.installed(venv):
        raise DflashkitError(f"vLLM {vllm.VERSION} is not installed in {venv}",
                             hint="dflashkit engines install vllm")
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in inputs.items()}, str(work / "inputs.safetensors"))
    cmd = [str(venv / "bin" / "python"), str(script), str(work / "inputs.safetensors"), str(work / "vllm"),
           *(str(Path(d).resolve()) for d in export_dirs)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=vllm.engine_env(venv), cwd=work, capture_output=True, text=True,
                          timeout=timeout_s, check=False)
    (work / "vllm.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise DflashkitError(f"vLLM's {title} reference failed (exit {proc.returncode}); log: {work / 'vllm.log'}\n"
                             + "\n".join(proc.stderr.splitlines()[-15:]),
                             hint="read the log; `dflashkit engines status` checks the install")
    wall = round(time.perf_counter() - t0, 1)
    out = []
    for i in range(len(export_dirs)):
        report = {**json.loads((work / "vllm" / str(i) / "report.json").read_text()), "wall_s": wall}
        out.append((load_file(str(work / "vllm" / str(i) / "outputs.safetensors")), report))
    return out
