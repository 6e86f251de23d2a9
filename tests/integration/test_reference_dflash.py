"""An exported checkpoint runs in the z-lab reference (PyPI dflash==0.1.0) with the same tokens and τ as ours."""

from __future__ import annotations

import json
import time

import pytest
import torch

from dflashkit.cli import main
from dflashkit.config import TargetSection
from dflashkit.decode.api import SamplingParams
from dflashkit.decode.spec_decode import SpecDecoder
from dflashkit.export.hf import load_drafter, save_drafter
from dflashkit.target.load import load_target

ref = pytest.importorskip("dflash.model", reason="test-only dependency: pip install --no-deps dflash==0.1.0")
from dflashkit.testing import random_drafter


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    return load_target(TargetSection(path=str(smollm2_dir), device="cpu", dtype="float32"))


def test_export_loads_in_reference_and_decodes_identically(tmp_path, smol, smollm2_dir, monkeypatch):
    rd = tmp_path / "run"
    drafter = random_drafter(smol, block_size=8, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                             intermediate_size=256)
    with torch.no_grad():  # a drafter that agrees with the target sometimes: reuse target rows in fc
        drafter.fc.weight.mul_(5.0)
    save_drafter(drafter, rd / "train" / "final", dtype="float32")
    assert main(["export", f"target.path={smollm2_dir}", "export.dtype=float32", "--run-dir", str(rd), "--json"]) == 0
    out = rd / "export"
    theirs = ref.DFlashDraftModel.from_pretrained(str(out), dtype=torch.float32).eval()
    assert theirs.block_size == 8 and theirs.target_layer_ids == drafter.target_layer_ids
    assert theirs.mask_token_id == drafter.mask_token_id
    ours = SpecDecoder(smol, load_drafter(out, dtype=torch.float32), block_size=8)

    monkeypatch.setattr(ref, "_cuda_time", time.perf_counter)  # its stats path calls torch.cuda.synchronize
    tok = smol.tokenizer
    eos = tok.eos_token_id
    for text in ("Write a haiku about the sea.", "def fibonacci(n):"):
        msgs = [{"role": "user", "content": text}]
        prompt = tok.encode(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False)
        for b in (4, 8):
            ours.block_size = b
            r = ours.generate(prompt, SamplingParams(max_new_tokens=20, stop_token_ids=(eos,)))
            stats = ref.dflash_generate(theirs, smol.model, torch.tensor([prompt]), 20, [eos], block_size=b,
                                        return_stats=True)
            assert stats.output_ids[0, len(prompt):].tolist() == r.token_ids, f"B={b} {text!r}"
            assert list(stats.acceptance_lengths) == r.acceptance_lengths, f"B={b} {text!r}"


def test_bench_decode_against_reference(tmp_path, smollm2_dir):
    """`dflashkit bench decode` runs both loops on the same prompts and reports identical tokens."""
    rd = tmp_path / "run"
    smol = load_target(TargetSection(path=str(smollm2_dir), device="cpu", dtype="float32"), with_tokenizer=False)
    save_drafter(random_drafter(smol, block_size=4, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                intermediate_size=256), rd / "train" / "final", dtype="float32")
    (rd / "prepare").mkdir(parents=True)
    (rd / "prepare" / "heldout.jsonl").write_text(json.dumps({"prompt": "Name three colors."}) + "\n")
    assert main(["bench", "decode", f"target.path={smollm2_dir}", "eval.num_prompts=1", "eval.max_new_tokens=8",
                 "eval.warmup=0", "--run-dir", str(rd), "--json"]) == 0
    res = json.loads((rd / "bench" / "decode.json").read_text())
    assert res["identical_tokens"] is True and res["block_size"] == 4
    assert res["tokens_per_s_e2e"]["reference"] > 0 and res["t1_ms"] > 0 and res["bound"] > 0
    # the lean draft forward beside the module forward: the same proposals, the parts of its step, the shares
    assert res["module_forward"]["identical_decodes"] is True
    assert set(res["draft_profile_ms"]) == {"context_kv", "block", "head", "total"}
    assert 0 < res["draft_share"] and res["adaptive"]["identical_tokens"] is True


def test_reduced_vocab_export_loads_in_reference(tmp_path, tiny_qwen3, monkeypatch):
    """The reference ignores d2t / t2d / lm_head.weight: it loads, its network equals ours, and its decoder
    (drafting over the full target head) and ours (over the draft vocab) both emit the target's greedy tokens."""
    from dflashkit.model.drafter import DFlashDraftModel

    target = load_target(TargetSection(path=str(tiny_qwen3), device="cpu", dtype="float32"))
    rd = tmp_path / "run"
    src = random_drafter(target, block_size=4)
    small = DFlashDraftModel(src.contract, draft_vocab=torch.tensor([10, 32, 97, 101, 115, 258]))
    small.load_state_dict({**src.state_dict(), "d2t": small.d2t})
    save_drafter(small, rd / "train" / "final", dtype="float32")
    assert main(["export", f"target.path={tiny_qwen3}", "export.dtype=float32", "--run-dir", str(rd), "--json"]) == 0
    out = rd / "export"
    theirs = ref.DFlashDraftModel.from_pretrained(str(out), dtype=torch.float32).eval()
    ours = load_drafter(out, dtype=torch.float32)
    assert ours.draft_vocab_size == 6 and theirs.block_size == 4
    g = torch.Generator().manual_seed(0)
    noise, ctx = torch.randn(1, 4, 64, generator=g), torch.randn(1, 7, 128, generator=g)
    pos = torch.arange(11)[None]
    with torch.no_grad():
        torch.testing.assert_close(theirs(position_ids=pos, noise_embedding=noise, target_hidden=ctx),
                                   ours(noise, ctx, pos), atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(ref, "_cuda_time", time.perf_counter)
    tok, eos = target.tokenizer, target.tokenizer.eos_token_id
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Say hello."}], tokenize=False,
                                                add_generation_prompt=True), add_special_tokens=False)
    r = SpecDecoder(target, ours, block_size=4).generate(prompt, SamplingParams(max_new_tokens=12,
                                                                               stop_token_ids=(eos,)))
    stats = ref.dflash_generate(theirs, target.model, torch.tensor([prompt]), 12, [eos], block_size=4,
                                return_stats=True)
    assert stats.output_ids[0, len(prompt):].tolist() == r.token_ids and len(r.token_ids) > 1
