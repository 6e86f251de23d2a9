"""The CPU decode fast path: oneDNN-packed linear layers and the in-place KV cache.

Invariants: a packed layer computes F.linear up to float rounding for any row count; a packed target's greedy
speculative output equals the same packed target's greedy output (and HF's greedy output on the unpacked
weights, on these tiny targets); the in-place cache gives the attention exactly DynamicCache's keys and
values through steps, rollbacks and regrowth; the roofline record's arithmetic.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflashkit.config import TargetSection
from dflashkit.decode.api import SamplingParams
from dflashkit.decode.spec_decode import SpecDecoder
from dflashkit.sizing.step_cost import roofline, step_times
from dflashkit.sizing.roofline import weight_bytes
from dflashkit.target.kv_cache import GrowingLayer, decode_cache
from dflashkit.target.packed import PackedLinear, pack_linears, packable, prepare_for_decode
from dflashkit.target.load import cache_kwarg, load_target
from dflashkit.testing import random_drafter
from dflashkit.testing.proposers import CopyTargetProposer

PROMPT = [1, 60, 61, 62, 63, 64, 10, 65, 66, 67, 68, 2, 10]
needs_onednn = pytest.mark.skipif(not packable(torch.device("cpu"), torch.float32)[0],
                                  reason="this torch has no oneDNN linear")


def _load(d):
    return load_target(TargetSection(path=str(d), device="cpu", dtype="float32"))


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_linear_is_f_linear_for_any_row_count(bias):
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(40, 72, bias=bias)
    packed = PackedLinear(lin, rows=4)
    for rows in (1, 2, 3, 4, 7, 33):
        x = torch.randn(1, rows, 40, generator=g)
        torch.testing.assert_close(packed(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_a_packed_target_decodes_as_the_unpacked_one(tiny_targets, arch):
    plain, packed = _load(tiny_targets[arch]), _load(tiny_targets[arch])
    info = prepare_for_decode(packed)
    assert info["packed"] == sum(isinstance(m, PackedLinear) for m in packed.model.modules()) > 0
    assert not any(type(m) is torch.nn.Linear for m in packed.model.modules())
    # the head keeps its weight (llama ties it to the input embedding): the draft head and embedding still read it
    assert packed.lm_head.weight is not None
    assert torch.equal(packed.embed(torch.tensor([[5, 6]])), plain.embed(torch.tensor([[5, 6]])))
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        torch.testing.assert_close(packed.model(input_ids=ids).logits, plain.model(input_ids=ids).logits,
                                   rtol=1e-4, atol=1e-4)
        ref = plain.model.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)[0, len(PROMPT):].tolist()
    params = SamplingParams(max_new_tokens=20)
    base = SpecDecoder(packed, None, block_size=1).generate(PROMPT, params)
    assert base.token_ids == ref
    drafter = random_drafter(packed, block_size=4)
    for b in (2, 4):
        for dec in (SpecDecoder(packed, drafter, block_size=b),
                    SpecDecoder(packed, None, block_size=b, proposer=CopyTargetProposer(plain))):
            r = dec.generate(PROMPT, params)
            assert r.token_ids == base.token_ids
            assert all(1 <= a <= b for a in r.acceptance_lengths)


def test_packing_is_refused_off_the_cpu_and_for_emulated_or_other_dtypes(tiny_qwen3, monkeypatch):
    assert not packable(torch.device("cuda"), torch.float32)[0]
    assert not packable(torch.device("cpu"), torch.float16)[0]
    monkeypatch.setattr("dflashkit.target.load.native_half", lambda name, dev: (False, "bf16 is emulated here"))
    ok, why = packable(torch.device("cpu"), torch.bfloat16)
    assert not ok and "emulated" in why
    t = _load(tiny_qwen3)
    assert prepare_for_decode(t, "off") == {"packed": 0, "reason": "eval.packed_weights=off"}
    assert any(type(m) is torch.nn.Linear for m in t.model.modules())


@pytest.mark.parametrize("capacity", [1, 5, 64])
def test_the_in_place_cache_holds_what_dynamic_cache_holds(tiny_qwen3, capacity):
    """Prefill, steps of 1 and 4 tokens, rollbacks of 0–3 positions and regrowth (a small capacity): the logits
    of every forward equal DynamicCache's bit for bit."""
    from transformers import DynamicCache

    t = _load(tiny_qwen3)
    ours, theirs = decode_cache(t.config, capacity=capacity), DynamicCache(config=t.config)
    assert any(isinstance(layer, GrowingLayer) for layer in ours.layers)
    kw = {"use_cache": True}
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for n, drop in [(len(PROMPT), 0), (4, 3), (1, 0), (4, 1), (4, 0), (2, 2), (4, 4), (1, 0)]:
            ids = torch.randint(3, 200, (1, n), generator=g)
            a = t.model(input_ids=ids, **{cache_kwarg(t.model): ours}, **kw).logits
            b = t.model(input_ids=ids, **{cache_kwarg(t.model): theirs}, **kw).logits
            assert torch.equal(a, b)
            ours.crop(-drop)
            theirs.crop(-drop)
            assert ours.get_seq_length() == theirs.get_seq_length()
    with pytest.raises(ValueError):
        ours.layers[0].crop(2)


def test_the_roofline_record(tiny_qwen3):
    t = _load(tiny_qwen3)
    times = step_times(t, [1, 4], context=8, reps=1)
    assert set(times) == {1, 4} and all(v > 0 for v in times.values())
    nbytes = weight_bytes(t.model)
    assert nbytes == sum(p.numel() * p.element_size() for p in t.model.parameters())
    r = roofline(t, {1: 0.02, 4: 0.03}, bandwidth=1e9)
    assert r["t1_roofline_s"] == pytest.approx(nbytes / 1e9)
    assert r["t1_share"] == pytest.approx(round(nbytes / 1e9 / 0.02, 3))
    assert r["t_ratio"] == {4: 1.5}
    if packable(t.device, t.dtype)[0]:  # packed: the blocked weights are what a step streams, counted once
        pack_linears(t.model)
        assert weight_bytes(t.model) >= nbytes * 0.99


@pytest.mark.parametrize("env", [{"ONEDNN_MAX_CPU_ISA": "AVX2"}, {"ATEN_CPU_CAPABILITY": "avx2"},
                                 {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}])
def test_an_isa_cap_that_imitates_an_older_cpu_hides_its_bf16(monkeypatch, env):
    """`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2` imitates an AVX2-only CPU: `native` must then pick
    float32 even on a CPU whose flags list avx512_bf16 (its bf16 kernels are out of reach)."""
    from dflashkit.target import load as tm

    monkeypatch.setattr(tm.Path, "read_text", lambda self, *a, **k: "model name : X\nflags : avx2 avx512_bf16\n")
    for k in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY"):
        monkeypatch.delenv(k, raising=False)
    assert tm.native_half("bfloat16", torch.device("cpu"))[0]
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    native, why = tm.native_half("bfloat16", torch.device("cpu"))
    if env.get("ONEDNN_MAX_CPU_ISA") == "AVX512_CORE_BF16":
        assert native
    else:
        assert not native and next(iter(env)) in why


def test_capture_logs_its_share_of_the_matmul_ceiling(tiny_qwen3, caplog):
    """2 x the parameters of the layers run, times tokens/s, over the measured matmul FLOP/s; MoE → no share."""
    import logging
    from types import SimpleNamespace

    from dflashkit.sizing.roofline import log_capture_roofline
    from dflashkit.sizing.roofline import forward_flops_per_token, matmul_throughput

    t = _load(tiny_qwen3)
    layers = t.decoder_layers
    plan = SimpleNamespace(keep_last=False, layer_ids=[0], autocast=None)
    with caplog.at_level(logging.INFO, logger="dflashkit"):
        r = log_capture_roofline(t, tokens=1000, seconds=2.0, plan=plan)
    assert r is not None and r["tokens_per_s"] == 500
    one = forward_flops_per_token(layers, 1)
    assert one == 2 * sum(p.numel() for p in layers[0].parameters())
    assert r["gflops"] == pytest.approx(one * 500 / 1e9)
    assert r["share"] == pytest.approx(one * 500 / matmul_throughput(t.dtype, "cpu", k=t.hidden_size,
                                                                      n=t.config.intermediate_size))
    assert "of this machine's float32 matmul throughput" in caplog.text
    assert forward_flops_per_token(layers, len(layers)) == len(layers) * one  # identical layers


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_grouped_attention_verifies_like_transformers_sdpa_without_copying_the_cache(tiny_targets, arch, monkeypatch):
    """A verify step over 1–5 tokens against a cache, through `grouped_sdpa` (K/V heads grouped, the mask given to
    SDPA) == transformers' SDPA, on a GQA target; a target whose heads are not grouped is left as loaded. The
    grouped function is the one that ran on every masked step, and it never repeated the cached K/V."""
    import transformers.integrations.sdpa_attention as hf_sdpa
    from transformers import AttentionInterface

    from dflashkit.target import packed as packed_mod

    plain, grouped = _load(tiny_targets[arch]), _load(tiny_targets[arch])
    gqa = plain.config.num_key_value_heads < plain.config.num_attention_heads
    got = packed_mod.use_grouped_attention(grouped.model)
    assert (got == "grouped-KV sdpa") == gqa, got
    if not gqa:
        assert grouped.model.config._attn_implementation == "sdpa"
        return
    assert grouped.model.config._attn_implementation == packed_mod.GROUPED_SDPA
    masked, copies = [], []
    registered = AttentionInterface._global_mapping[packed_mod.GROUPED_SDPA]

    def counted(module, query, key, value, attention_mask, *args, **kwargs):
        masked.append(attention_mask is not None)
        return registered(module, query, key, value, attention_mask, *args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, packed_mod.GROUPED_SDPA, counted)
    real_repeat = hf_sdpa.repeat_kv
    kw = cache_kwarg(plain.model)
    with torch.inference_mode():
        caches = [decode_cache(t.config, capacity=64) for t in (plain, grouped)]
        for t, c in zip((plain, grouped), caches):
            t.model(input_ids=torch.tensor([PROMPT]), **{kw: c}, use_cache=True)
        for n in (2, 3, 5, 1):
            step = torch.tensor([[40 + i for i in range(n)]])
            ref = plain.model(input_ids=step, **{kw: caches[0]}, use_cache=True).logits
            masked.clear()
            monkeypatch.setattr(hf_sdpa, "repeat_kv", lambda h, r: copies.append(r) or real_repeat(h, r))
            out = grouped.model(input_ids=step, **{kw: caches[1]}, use_cache=True).logits
            monkeypatch.setattr(hf_sdpa, "repeat_kv", real_repeat)
            assert len(masked) == plain.config.num_hidden_layers, (n, masked)  # every layer went through it
            assert all(masked) == (n > 1) or n == 1, (n, masked)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert not copies, f"the grouped path repeated the cached K/V ({len(copies)} times)"
