"""A target whose tensors cannot be what its config.json says is refused before any weight is read (exit 2,
naming the file and the tensor or key), on every path that loads it (load_target, the head reader,
capture --dry-run), and `probe` says why the local paths refuse it instead of "yes": FP8 weights whose
quantization_config is gone, a header that calls float32 bytes I32, a header inconsistent with its data,
FP8 scales that are not the config's block grid, a malformed quantization_config. An honest FP8 target
still passes (tests/target/test_quantized_targets.py loads it)."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflashkit.cli import main
from dflashkit.errors import ConfigError, UsageError
from dflashkit.target.head import load_head_parts
from dflashkit.target.quantized import check_checkpoint
from dflashkit.target.tiny import make_tiny_target
from tests.target.test_quantized_targets import BLOCK, _make_fp8

K_PROJ = "model.layers.0.self_attn.k_proj.weight"  # [32, 64] in the tiny qwen3
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


def _section(path: Path):
    from dflashkit.config import TargetSection

    return TargetSection(path=str(path), device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    return make_tiny_target(tmp_path_factory.mktemp("plain") / "t", "qwen3", num_layers=4)


@pytest.fixture(scope="module")
def fp8(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("fp8") / "t"
    _make_fp8(d, quantize_head=False)
    return d


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(d: Path, fn) -> None:
    cfg = json.loads((d / "config.json").read_text())
    fn(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


def _edit_header(f: Path, fn, tail: bytes = b"") -> None:
    """Rewrite the safetensors header of `f` with `fn(header)` (the data bytes unchanged, `tail` appended)."""
    b = f.read_bytes()
    (n,) = struct.unpack("<Q", b[:8])
    header = json.loads(b[8:8 + n])
    fn(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + b[8 + n:] + tail)


def _refused_everywhere(d: Path, monkeypatch, *needles: str, error=UsageError) -> str:
    """load_target and the head reader both refuse `d` with exit 2 before transformers reads a weight; the
    message names every needle. Returns the message."""
    from dflashkit.target.load import load_target

    def no_load(*a, **k):
        raise AssertionError("weights were read before the refusal")

    texts = []
    with monkeypatch.context() as m:
        m.setattr("transformers.AutoModelForCausalLM.from_pretrained", no_load)
        for load in (lambda: load_target(_section(d), with_tokenizer=False), lambda: load_head_parts(d)):
            with pytest.raises(UsageError) as e:
                load()
            assert isinstance(e.value, error) and e.value.exit_code == 2
            texts.append(str(e.value))
    assert texts[0] == texts[1]
    for needle in needles:
        assert needle in texts[0], (needle, texts[0])
    return texts[0]


def _probe_local(d: Path, capsys) -> str:
    """`dflashkit probe DIR --dry-run --json`'s verdict for the local paths (the head reader's agrees)."""
    assert main(["probe", str(d), "--dry-run", "--json", "drafter.mask_token_id=0"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    local, head = (next(r["verdict"] for r in out["paths"] if r["path"].startswith(p)) for p in ("local", "head"))
    assert local.startswith("yes") == head.startswith("yes")
    return local


# --- FP8 weights whose quantization_config is gone --------------------------------------------------------

def test_fp8_without_quantization_config_is_refused(fp8, tmp_path, monkeypatch, capsys):
    d = _copy(fp8, tmp_path / "t")
    _edit_config(d, lambda c: c.pop("quantization_config"))
    assert load_file(d / "model.safetensors")[Q_PROJ].dtype == torch.float8_e4m3fn  # the case under test
    text = _refused_everywhere(d, monkeypatch, str(d / "model.safetensors"), "F8_E4M3", "quantization_config",
                               str(d / "config.json"), "without their scales")
    assert "model.layers." in text  # a tensor is named
    verdict = _probe_local(d, capsys)
    assert verdict.startswith("refused (exit 2)") and "quantization_config" in verdict and "F8_E4M3" in verdict


def test_honest_fp8_passes_the_check_and_probe_says_yes(fp8, capsys):
    q = check_checkpoint(fp8)
    assert q is not None and q.method == "fp8" and q.block == (BLOCK, BLOCK)
    assert _probe_local(fp8, capsys).startswith("yes")


def test_fp8_scales_not_on_the_configs_block_grid_are_refused(fp8, tmp_path, monkeypatch):
    """config.json says 16-blocks, the scales were made for 32-blocks: transformers would spread them over
    the wrong blocks."""
    d = _copy(fp8, tmp_path / "t")
    _edit_config(d, lambda c: c["quantization_config"].update(weight_block_size=[BLOCK // 2, BLOCK // 2]))
    _refused_everywhere(d, monkeypatch, "weight_scale_inv", "weight_block_size", str(d / "model.safetensors"))


def test_fp8_weight_without_its_scale_is_refused(fp8, tmp_path, monkeypatch):
    d = _copy(fp8, tmp_path / "t")
    state = load_file(d / "model.safetensors")
    del state[Q_PROJ.removesuffix("weight") + "weight_scale_inv"]
    save_file(state, d / "model.safetensors", metadata={"format": "pt"})
    _refused_everywhere(d, monkeypatch, Q_PROJ + "_scale_inv", Q_PROJ)


def test_an_fp8_config_over_unquantized_weights_is_refused(plain, tmp_path, monkeypatch):
    d = _copy(plain, tmp_path / "t")
    _edit_config(d, lambda c: c.update(quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                                            "weight_block_size": [BLOCK, BLOCK]}))
    _refused_everywhere(d, monkeypatch, str(d / "config.json"), "no tensor", "float8")


# --- a header that lies about its bytes ----------------------------------------------------------------------

def test_integer_header_over_float_bytes_is_refused(plain, tmp_path, monkeypatch, capsys):
    """I32 over the float32 bytes of a weight (same size, so the file is consistent): it would load as integers."""
    d = _copy(plain, tmp_path / "t")
    _edit_header(d / "model.safetensors", lambda h: h[Q_PROJ].update(dtype="I32"))
    _refused_everywhere(d, monkeypatch, str(d / "model.safetensors"), Q_PROJ, "I32", "no quantization_config")
    verdict = _probe_local(d, capsys)
    assert verdict.startswith("refused (exit 2)") and Q_PROJ in verdict and "I32" in verdict


def test_integer_buffers_pass(plain, tmp_path):
    """Position ids stored as I64 are not weights: an unquantized checkpoint may hold them."""
    d = _copy(plain, tmp_path / "t")
    state = load_file(d / "model.safetensors")
    state["model.position_ids"] = torch.arange(8)[None]
    save_file(state, d / "model.safetensors", metadata={"format": "pt"})
    assert check_checkpoint(d) is None


def _shorter(h):
    b, e = h[K_PROJ]["data_offsets"]
    h[K_PROJ]["data_offsets"] = [b, e - 4]


def _wider(h):
    h[K_PROJ]["shape"] = [h[K_PROJ]["shape"][0], 2 * h[K_PROJ]["shape"][1]]


def _past_end(h):
    last = max(h, key=lambda k: h[k]["data_offsets"][1] if k != "__metadata__" else -1)
    b, e = h[last]["data_offsets"]
    h[last]["data_offsets"] = [b, e + 4096]


@pytest.mark.parametrize("edit, needles", [
    (_shorter, (K_PROJ, "data_offsets")),
    (_wider, (K_PROJ, "[32, 128]")),
    (_past_end, ("truncated", "ends at data byte")),
    (lambda h: h[K_PROJ].update(dtype="F7"), (K_PROJ, "'F7'")),
    (lambda h: h[K_PROJ].update(shape=["32", 64]), (K_PROJ, "shape")),
], ids=["offsets-short", "shape-wider-than-bytes", "past-the-end", "unknown-dtype", "string-shape"])
def test_header_inconsistent_with_its_data_is_refused(edit, needles, plain, tmp_path, monkeypatch):
    """Was a raw SafetensorError (exit 1) naming no file; now exit 2 naming the file and the tensor."""
    d = _copy(plain, tmp_path / "t")
    _edit_header(d / "model.safetensors", edit)
    _refused_everywhere(d, monkeypatch, str(d / "model.safetensors"), *needles)


def test_trailing_bytes_after_the_last_tensor_are_refused(plain, tmp_path, monkeypatch):
    d = _copy(plain, tmp_path / "t")
    _edit_header(d / "model.safetensors", lambda h: None, tail=b"\0" * 16)
    _refused_everywhere(d, monkeypatch, str(d / "model.safetensors"), "16 bytes after the last tensor")


def test_a_shape_that_is_not_the_configs_is_refused(plain, tmp_path):
    """The bytes fit the header, but [64, 32] is not config.json's k_proj [32, 64]: was transformers'
    RuntimeError (exit 1); now exit 2 naming the tensor and both shapes."""
    from dflashkit.target.load import load_target

    d = _copy(plain, tmp_path / "t")
    _edit_header(d / "model.safetensors", lambda h: h[K_PROJ].update(shape=[64, 32]))
    with pytest.raises(UsageError) as e:
        load_target(_section(d), with_tokenizer=False)
    assert e.value.exit_code == 2
    assert str(d) in str(e.value) and K_PROJ in str(e.value) and "[64, 32]" in str(e.value)
    assert "[32, 64]" in str(e.value)


# --- a malformed quantization_config -------------------------------------------------------------------------

CT = {"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "group_size": 32}}}}


@pytest.mark.parametrize("qc, key", [
    ({**CT, "config_groups": [CT["config_groups"]["group_0"]]}, "quantization_config.config_groups"),
    ({**CT, "config_groups": {"group_0": {"weights": {"num_bits": "four"}}}},
     "quantization_config.config_groups.group_0.weights.num_bits"),
    ("fp8", "quantization_config is 'fp8'"),
    ({"quant_method": "fp8", "weight_block_size": [0, 0]}, "quantization_config.weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": ["a", 16]}, "quantization_config.weight_block_size"),
    ({"quant_method": 8}, "quantization_config.quant_method"),
], ids=["groups-list", "num-bits-string", "config-string", "block-zero", "block-string", "method-number"])
def test_malformed_quantization_config_is_a_named_config_error(qc, key, plain, tmp_path, monkeypatch, capsys):
    d = _copy(plain, tmp_path / "t")
    _edit_config(d, lambda c: c.update(quantization_config=qc))
    _refused_everywhere(d, monkeypatch, str(d / "config.json"), key, error=ConfigError)
    rc = main(["probe", str(d), "--dry-run", "--json"])
    err = capsys.readouterr().err
    assert rc == 2 and key in err and "Traceback" not in err


# --- through the CLI: capture --dry-run refuses before any work ----------------------------------------------

def test_capture_dry_run_refuses_fp8_without_its_config(fp8, tmp_path, capsys):
    from tests.cli.test_refusals import _refused, _snapshot
    from tests.helpers import make_run, overrides

    d = _copy(fp8, tmp_path / "t")
    rd = make_run(tmp_path / "run", fp8)  # the contract and shards of the honest copy
    _edit_config(d, lambda c: c.pop("quantization_config"))
    before = _snapshot(rd)
    _refused(["capture", "--dry-run", *overrides(rd, d)], 2, capsys, str(d / "model.safetensors"),
             "quantization_config", "F8_E4M3")
    assert _snapshot(rd) == before and not (rd / "capture").exists()
