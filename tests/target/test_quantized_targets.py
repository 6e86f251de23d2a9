"""Quantized targets (FP8 block-wise, compressed-tensors INT4) built in the test from a tiny random target:
the local load path works (logits equal a model holding the dequantized weights) or refuses before loading
(exit 2, naming the quantization and the engine command); the head/embedding reader of engine-fed
training dequantizes a quantized head; plan's local memory figure matches a measured load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflashkit.errors import UsageError
from dflashkit.target.head import load_head_parts
from dflashkit.target.tiny import make_tiny_target

BLOCK = 32   # the tiny target's hidden size is 64: two FP8 blocks per side (DeepSeek ships 128)
GROUP = 32   # INT4 group size (Kimi K2.x ships 32)
IDS = torch.tensor([[1, 7, 42, 99, 3, 250, 18, 5]])


def _section(path: Path):
    from dflashkit.config import TargetSection

    return TargetSection(path=str(path), device="cpu", dtype="float32")


def _fp8_quantize(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise e4m3 as DeepSeek-V3 stores it: weight (float8) and weight_scale_inv (one per block)."""
    r, c = w.shape
    nr, nc = -(-r // block), -(-c // block)
    padded = torch.zeros(nr * block, nc * block)
    padded[:r, :c] = w
    blocks = padded.view(nr, block, nc, block)
    scale = (blocks.abs().amax(dim=(1, 3)) / torch.finfo(torch.float8_e4m3fn).max).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(nr * block, nc * block)[:r, :c]
    return q.contiguous(), scale.float()


def _fp8_dequant(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """The reference, written independently of target.quantized: every block times its own scale."""
    out = q.float().clone()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * block:(i + 1) * block, j * block:(j + 1) * block] *= scale[i, j]
    return out


def _make_fp8(out: Path, *, quantize_head: bool, block: int = BLOCK) -> tuple[dict[str, torch.Tensor],
                                                                            dict[str, torch.Tensor]]:
    """A tiny qwen3 target rewritten as an FP8 block-wise checkpoint: (original, dequantized) state dicts."""
    d = make_tiny_target(out, "qwen3", num_layers=4)
    orig = load_file(d / "model.safetensors")
    stored, deq = {}, {}
    for k, w in orig.items():
        quantize = w.dim() == 2 and "embed_tokens" not in k and (quantize_head or not k.startswith("lm_head"))
        if quantize:
            q, s = _fp8_quantize(w, block)
            stored[k], stored[k.removesuffix("weight") + "weight_scale_inv"] = q, s
            deq[k] = _fp8_dequant(q, s, block)
        else:
            stored[k] = deq[k] = w
    save_file(stored, d / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [block, block]}
    (d / "config.json").write_text(json.dumps(cfg))
    return orig, deq


def _reference_logits(model_dir: Path, state: dict[str, torch.Tensor], ids: torch.Tensor = IDS) -> torch.Tensor:
    """Logits of the unquantized checkpoint holding `state` (the dequantized weights), loaded by transformers
    from its own files (so fused-expert renames apply as for the quantized one)."""
    import tempfile

    from transformers import AutoModelForCausalLM

    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.pop("quantization_config")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(cfg))
        save_file({k: v.contiguous() for k, v in state.items()}, Path(tmp) / "model.safetensors",
                  metadata={"format": "pt"})
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def fp8_target(tmp_path_factory):
    d = tmp_path_factory.mktemp("fp8") / "t"
    orig, deq = _make_fp8(d, quantize_head=False)
    return d, orig, deq


def test_fp8_local_load_runs_the_dequantized_weights(fp8_target):
    from dflashkit.target.load import load_target

    d, orig, deq = fp8_target
    target = load_target(_section(d), with_tokenizer=False)
    q_proj = target.decoder_layers[0].self_attn.q_proj.weight
    assert q_proj.dtype == torch.float32
    torch.testing.assert_close(q_proj, deq["model.layers.0.self_attn.q_proj.weight"])
    with torch.no_grad():
        logits = target.model(IDS).logits
    torch.testing.assert_close(logits, _reference_logits(d, deq), rtol=1e-4, atol=1e-4)
    # the features path (hooks) runs too
    feats = target.features(IDS, layer_ids=[0, 1])
    assert feats.shape == (1, IDS.shape[1], 2 * target.hidden_size) and torch.isfinite(feats).all()


def test_fp8_head_reader_dequantizes_a_quantized_head(tmp_path):
    d = tmp_path / "fp8-head"
    orig, deq = _make_fp8(d, quantize_head=True)
    stored = load_file(d / "model.safetensors")
    assert stored["lm_head.weight"].dtype == torch.float8_e4m3fn  # the case under test
    parts = load_head_parts(d)
    torch.testing.assert_close(parts.lm_head.weight, deq["lm_head.weight"])
    torch.testing.assert_close(parts.embed.weight, orig["model.embed_tokens.weight"])
    torch.testing.assert_close(parts.norm_weight, orig["model.norm.weight"])
    # within FP8's rounding of the original head (e4m3: 3 mantissa bits), nowhere near a raw cast
    err = (parts.lm_head.weight - orig["lm_head.weight"]).abs().max()
    assert err <= orig["lm_head.weight"].abs().max() / 8


def test_fp8_partial_blocks_are_refused_before_loading_and_the_head_still_reads(tmp_path, monkeypatch):
    """A weight that is not a whole number of blocks (DeepSeek-V3's kv_a_proj_with_mqa [576, 7168] in
    128-blocks; here 64 columns in 48-blocks): transformers' dequantize divides it evenly over the scale
    grid (wrong scales), so the local load refuses it; the head reader dequantizes it correctly."""
    from dflashkit.target.load import load_target

    d = tmp_path / "fp8-partial"
    _, deq = _make_fp8(d, quantize_head=True, block=48)

    def no_load(*a, **k):
        raise AssertionError("weights were read before the refusal")

    with monkeypatch.context() as m:
        m.setattr("transformers.AutoModelForCausalLM.from_pretrained", no_load)
        with pytest.raises(UsageError) as e:
            load_target(_section(d), with_tokenizer=False)
    assert e.value.exit_code == 2
    text = str(e.value) + str(e.value.hint)
    assert str(d) in text and "FP8" in text and "[48, 48]" in text and "capture.engine=vllm" in text
    torch.testing.assert_close(load_head_parts(d).lm_head.weight, deq["lm_head.weight"])


def test_fp8_head_reader_unquantized_head(fp8_target):
    d, orig, _ = fp8_target
    parts = load_head_parts(d)
    torch.testing.assert_close(parts.lm_head.weight, orig["lm_head.weight"])
    torch.testing.assert_close(parts.embed.weight, orig["model.embed_tokens.weight"])


@pytest.mark.parametrize("which", ["fp8_target", "int4_target"])
def test_plan_local_memory_matches_a_measured_load(which, request):
    """`plan`'s figure for the online modes (replicate, and shard: the same bytes over the GPUs) is what the
    local load really holds: the dequantized weights, not the bits."""
    from dflashkit.sizing.budget import target_weight_bytes
    from dflashkit.inspect.config_facts import read_model_facts
    from dflashkit.target.load import load_target

    d, _, _ = request.getfixturevalue(which)
    facts = read_model_facts(d).to_dict()
    assert facts["quantization"]["local_load"] == "dequantized"
    target = load_target(_section(d), with_tokenizer=False)
    measured = sum(t.numel() * t.element_size() for t in {id(p): p for p in target.model.parameters()}.values())
    local, served = target_weight_bytes(facts, local=True), target_weight_bytes(facts)
    assert abs(local - measured) <= 0.05 * measured, (local, measured)
    assert served < local  # the engine serves the 8- / 4-bit weights; the local load holds float32


@pytest.mark.parametrize("qc, named", [({"quant_method": "awq", "bits": 4}, "awq"),
                                       ({"quant_method": "fp8", "fmt": "e4m3"}, "FP8 e4m3 per-tensor")],
                         ids=["awq", "fp8-per-tensor"])
def test_unknown_quantization_is_refused_before_loading(qc, named, tmp_path, monkeypatch):
    from dflashkit.target.load import load_target

    d = make_tiny_target(tmp_path / "q", "qwen3", num_layers=4)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = qc
    (d / "config.json").write_text(json.dumps(cfg))

    def no_load(*a, **k):
        raise AssertionError("weights were read before the refusal")

    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", no_load)
    with pytest.raises(UsageError) as e:
        load_target(_section(d), with_tokenizer=False)
    assert e.value.exit_code == 2
    text = str(e.value) + str(e.value.hint)
    assert str(d) in text and named in text and "capture.engine=vllm" in text and "train.features=engine" in text


# --- compressed-tensors INT4 (W4A16, pack-quantized), as Kimi K2.x ships ---------------------------------

def _make_int4(out: Path, *, ignore: list[str], arch: str = "qwen3", group: int = GROUP
               ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A tiny target compressed by compressed-tensors' own compressor: (original, fake-quantized) state dicts
    under the checkpoint's tensor names. Every nn.Linear is quantized (symmetric, per group of `group`)."""
    ct = pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed "
                             "(pip install 'dflashkit[quantized]'); the INT4 load path needs it")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from transformers import AutoModelForCausalLM

    del ct
    d = make_tiny_target(out, arch, num_layers=4)
    orig = load_file(d / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=4, type="int", symmetric=True, strategy="group", group_size=group))
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=ignore,
                                                        format="pack-quantized"))
    fake = dict(orig)
    for name, mod in model.named_modules():
        if hasattr(mod, "weight_scale"):  # symmetric absmax scales per group of GROUP columns (no calibration)
            w = mod.weight.data
            r, c = w.shape
            q, s = _int4_quantize(w, group)
            mod.weight_scale.data.copy_(s.to(mod.weight_scale.dtype))
            fake[name + ".weight"] = (q * s[..., None]).view(r, c)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, d / "model.safetensors",
              metadata={"format": "pt"})
    compressor.update_config(str(d))
    return orig, fake


def _int4_quantize(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax 4-bit per group of columns: q in [-8, 7] as [out, in / group, group], scales [out, in / group]."""
    r, c = w.shape
    s = (w.view(r, c // group, group).abs().amax(-1) / 7.0).clamp(min=1e-8)
    return torch.clamp(torch.round(w.view(r, c // group, group) / s[..., None]), -8, 7), s


@pytest.fixture(scope="module")
def int4_target(tmp_path_factory):
    d = tmp_path_factory.mktemp("int4") / "t"
    orig, fake = _make_int4(d, ignore=["lm_head"])
    return d, orig, fake


def test_int4_checkpoint_is_what_kimi_ships(int4_target):
    d, _, _ = int4_target
    stored = load_file(d / "model.safetensors")
    assert stored["model.layers.0.mlp.up_proj.weight_packed"].dtype == torch.int32
    assert {"model.layers.0.mlp.up_proj.weight_scale", "model.layers.0.mlp.up_proj.weight_shape"} <= set(stored)
    q = json.loads((d / "config.json").read_text())["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "pack-quantized"


def test_int4_local_load_runs_the_dequantized_weights(int4_target):
    from dflashkit.target.load import load_target

    d, _, fake = int4_target
    target = load_target(_section(d), with_tokenizer=False)
    torch.testing.assert_close(target.decoder_layers[1].mlp.down_proj.weight,
                               fake["model.layers.1.mlp.down_proj.weight"])
    with torch.no_grad():
        logits = target.model(IDS).logits
    torch.testing.assert_close(logits, _reference_logits(d, fake), rtol=1e-4, atol=1e-4)


def test_int4_without_compressed_tensors_is_refused_before_loading(int4_target, monkeypatch):
    import builtins

    from dflashkit.target.load import load_target

    d, _, _ = int4_target
    real_import = builtins.__import__

    def no_ct(name, *a, **k):
        if name.split(".")[0] == "compressed_tensors":
            raise ImportError(name)
        return real_import(name, *a, **k)

    def no_load(*a, **k):
        raise AssertionError("weights were read before the refusal")

    monkeypatch.setattr(builtins, "__import__", no_ct)
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", no_load)
    with pytest.raises(UsageError) as e:
        load_target(_section(d), with_tokenizer=False)
    assert e.value.exit_code == 2
    text = str(e.value) + str(e.value.hint)
    assert str(d) in text and "compressed-tensors" in text and "int4" in text
    assert "dflashkit[quantized]" in text and "capture.engine=vllm" in text


def test_int4_head_reader_unquantized_head(int4_target):
    d, orig, _ = int4_target
    parts = load_head_parts(d)
    torch.testing.assert_close(parts.lm_head.weight, orig["lm_head.weight"])
    torch.testing.assert_close(parts.embed.weight, orig["model.embed_tokens.weight"])
    torch.testing.assert_close(parts.norm_weight, orig["model.norm.weight"])


def test_int4_head_reader_unpacks_a_quantized_head(tmp_path):
    d = tmp_path / "int4-head"
    orig, fake = _make_int4(d, ignore=[])
    assert "lm_head.weight_packed" in load_file(d / "model.safetensors")  # the case under test
    parts = load_head_parts(d)
    torch.testing.assert_close(parts.lm_head.weight, fake["lm_head.weight"])
    torch.testing.assert_close(parts.embed.weight, orig["model.embed_tokens.weight"])


# --- through the CLI: a path that works, and a refusal before any work -----------------------------------

@pytest.fixture(scope="module")
def awq_target(tmp_path_factory):
    d = make_tiny_target(tmp_path_factory.mktemp("awq") / "t", "qwen3", num_layers=4)
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("argv", [["capture"], ["train"]], ids=["capture", "train-online"])
def test_cli_refuses_an_unloadable_quantization_before_any_work(argv, awq_target, tmp_path, capsys):
    from tests.cli.test_refusals import _refused, _snapshot
    from tests.helpers import make_run, overrides

    rd = make_run(tmp_path / "run", awq_target)
    before = _snapshot(rd)
    _refused([*argv, *overrides(rd, awq_target)], 2, capsys, str(awq_target), "awq", "capture.engine=vllm",
             "train.features=engine")
    assert _snapshot(rd) == before and not (rd / "capture").exists() and not (rd / "train").exists()


def test_cli_capture_on_an_fp8_target(fp8_target, tmp_path):
    from dflashkit.cli import main
    from tests.helpers import make_run, overrides

    d, _, deq = fp8_target
    rd = make_run(tmp_path / "run", d)
    assert main(["capture", *overrides(rd, d)]) == 0
    # the captured greedy next tokens are those of the dequantized model, sample by sample
    import pyarrow.parquet as pq

    rows = pq.read_table(rd / "tokenize" / "shard-00000.parquet").column("input_ids").to_pylist()
    shard = load_file(rd / "capture" / "shard-00000.safetensors")
    offsets, next_ids = shard["offsets"].tolist(), shard["next_ids"]
    assert len(offsets) == len(rows) + 1
    for i in (0, len(rows) - 1):
        ids = torch.tensor([rows[i]])
        want = _reference_logits(d, deq, ids)[0].argmax(-1)
        assert torch.equal(next_ids[offsets[i]:offsets[i + 1]].long(), want)


def test_int4_kimi_shaped_moe_target(tmp_path):
    """Kimi K2.x's layout: the DeepSeek-V3 architecture (MLA, routed experts) with every expert's projections
    stored per expert as `experts.N.*_proj.weight_packed` (packed by compressed-tensors' own pack_to_int32):
    the local load dequantizes them into transformers' fused experts, logits equal the dequantized model's."""
    pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed")
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from dflashkit.target.load import load_target

    d = tmp_path / "kimi-int4"
    orig, fake = _make_int4(d, ignore=["lm_head"], arch="deepseek_v3", group=16)
    stored = load_file(d / "model.safetensors")
    stored = {k: v for k, v in stored.items() if not (".mlp.experts." in k and "_proj" in k)}  # fused, unquantized
    experts = [k for k in orig if ".mlp.experts." in k and k.split(".mlp.experts.")[1][0].isdigit()]
    assert experts  # the tiny deepseek_v3 has routed experts, saved per expert
    for k in experts:
        q, s = _int4_quantize(orig[k], 16)
        r, c = orig[k].shape
        stem = k.removesuffix("weight")
        stored.update({stem + "weight_packed": pack_to_int32(q.reshape(r, c).to(torch.int8), 4),
                       stem + "weight_scale": s, stem + "weight_shape": torch.tensor([r, c])})
        fake[k] = (q * s[..., None]).reshape(r, c)
    save_file(stored, d / "model.safetensors", metadata={"format": "pt"})
    target = load_target(_section(d), with_tokenizer=False)
    with torch.no_grad():
        logits = target.model(IDS).logits
    torch.testing.assert_close(logits, _reference_logits(d, fake), rtol=1e-4, atol=1e-4)
    parts = load_head_parts(d)
    torch.testing.assert_close(parts.lm_head.weight, orig["lm_head.weight"])
