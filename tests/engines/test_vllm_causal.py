"""vLLM 0.32 reads our exports' in-block causality as we wrote it (marker `engine`; `make test-engine`): its own
config loader (`get_config`, the speculators translation included) and `_dflash_layer_causal` on z-lab and
speculators exports of DFlash and DFlash2 drafters, causal (JetSpec) and not. ~10 s: one engine-venv process
importing vLLM's config code (the end-to-end causal drafter is in tests/engines/test_vllm.py)."""

from __future__ import annotations

import pytest

from dflashkit.config import TargetSection
from dflashkit.export.hf import save_drafter
from dflashkit.export.speculators import write_speculators
from dflashkit.target.load import load_target
from dflashkit.testing import random_drafter
from tests.helpers import vllm_causality

pytestmark = pytest.mark.engine

DFLASH2 = {"drafter_type": "dflash2", "conv_group_size": 16, "selector_rank": 4, "selector_top_k": 3}


def test_vllm_resolves_the_causality_we_export(tmp_path, tiny_qwen3):
    from dflashkit.engines import vllm

    vllm.install()  # a no-op when the cache has it
    target = load_target(TargetSection(path=str(tiny_qwen3), device="cpu", dtype="float32"))
    embed, head = target.model.get_input_embeddings().weight.detach(), target.lm_head.weight.detach()
    want, dirs = {}, []
    for fam, extra in (("dflash", {}), ("dflash2", DFLASH2)):
        for causal in (False, True):
            d = random_drafter(target, block_size=4, layers=2, causal=causal, **extra)
            zlab, spec = tmp_path / f"{fam}-{causal}-zlab", tmp_path / f"{fam}-{causal}-spec"
            save_drafter(d, zlab, dtype="float32")
            write_speculators(d, spec, verifier=str(tiny_qwen3), verifier_architectures=["Qwen3ForCausalLM"],
                              embed=embed, head=head, dtype="float32")
            for p in (zlab, spec):
                want[str(p)], dirs = causal, dirs + [p]
    got = vllm_causality(dirs, tmp_path / "vllm")
    for d, causal in want.items():
        assert got[d]["layers"] == [causal, causal], (d, got[d])
        assert got[d]["any_non_causal"] is (not causal), (d, got[d])  # a bidirectional one asks for non-causal
        assert got[d]["config"] == ("SpeculatorsConfig" if d.endswith("spec") else "Qwen3Config"), got[d]
