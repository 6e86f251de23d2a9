"""What the GPU check trains and decodes on: target shapes, random targets built in memory, tiny run dirs.

Usage:
    target = random_target(QWEN3_8B, device="cuda", dtype=torch.bfloat16)   # random init on the GPU, seconds
    contract = contract_for(QWEN3_8B, block_size=16, num_draft_layers=5)    # probe's derivation of the drafter
    rd = write_run(work / "run", contract, samples=32, seq_len=2048)         # contract.json + random token shards
    cfg = train_config(rd, device="cuda", **{"train.max_steps": 4})          # the check's RunConfig
    argv = check_overrides(rd, device="cuda", target_path=tiny)             # the same as dotted overrides
    tiny = tiny_target_dir(work)                                              # target/tiny.py's target on disk

No weights of a real 8B model exist on a lent GPU machine (no hub, no internet), and writing 16 GB of
random safetensors would take longer than the check: the 8B-shaped target is built in memory
(`AutoModelForCausalLM.from_config` under a `torch.device` context, so its parameters are allocated and
initialised on the GPU directly, in the requested dtype) and handed to `train.loop.setup(target=...)` and
`SpecDecoder`. The tiny target is the real on-disk path (`load_target`: safetensors, tokenizer).
`SMALL` stands in for `MEDIUM` and `QWEN3_8B` when the check's CPU halves run (`make test`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dflashkit.config import load_config
from dflashkit.data.shards import shard_name, write_parquet_shard
from dflashkit.family.contract import DrafterContract
from dflashkit.inspect.config_facts import facts_from_config
from dflashkit.inspect.contract import derive_contract
from dflashkit.target.load import Target
from dflashkit.target.tiny import make_tiny_target
from dflashkit.rundir import RunDir, atomic_write_json

# Qwen3-8B's config.json (the fields a model needs; the weights are random)
QWEN3_8B: dict[str, Any] = {
    "name": "qwen3-8b-shape", "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096,
    "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645}
# Qwen3-0.6B's attention and MLP widths on 8 layers: a medium drafter (2048 q / 1024 kv channels, head_dim 128)
MEDIUM: dict[str, Any] = {**QWEN3_8B, "name": "qwen3-medium-shape", "hidden_size": 1024, "intermediate_size": 3072,
                          "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 8}
# the CPU halves' stand-in for both (same code path, a size a 2-core test runs in a second)
SMALL: dict[str, Any] = {**QWEN3_8B, "name": "small-shape", "vocab_size": 320, "hidden_size": 64,
                         "intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4,
                         "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 2048,
                         "bos_token_id": None, "eos_token_id": 258}


def torch_device(name: str) -> torch.device:
    """`cuda` → `cuda:<current>` (an index, as `DistInfo` and the loaders give it), else as named."""
    dev = torch.device(name)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def hf_config(shape: dict[str, Any]):
    """The transformers config of a shape dict."""
    return AutoConfig.for_model(shape["model_type"], **{k: v for k, v in shape.items()
                                                        if k not in ("name", "model_type")})


def random_target(shape: dict[str, Any], *, device: str, dtype: torch.dtype, seed: int = 0) -> Target:
    """A frozen random target of `shape`, allocated and initialised on `device` in `dtype` (no tokenizer)."""
    dev = torch_device(device)
    torch.manual_seed(seed)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(hf_config(shape), dtype=dtype)
    model.eval()
    model.requires_grad_(False)
    return Target(model=model, tokenizer=None, model_dir=Path(f"random:{shape['name']}"), device=dev, dtype=dtype)


def tiny_target_dir(work: Path) -> Path:
    """target/tiny.py's qwen3 target (6 layers, hidden 64, byte tokenizer) saved under `work` (once)."""
    out = Path(work) / "tiny-target"
    if not (out / "model.safetensors").is_file():
        make_tiny_target(out, arch="qwen3")
    return out


def contract_for(config: dict[str, Any], *, block_size: int, num_draft_layers: int,
                 mask_token_id: int | None = None) -> DrafterContract:
    """The contract `probe` derives for a target config (a shape, or a config.json's dict): the target's
    attention and MLP widths, the reference layer ids, the mask token the last embedding row unless given."""
    facts = facts_from_config({k: v for k, v in config.items() if k != "name"}, source=str(config.get("name")))
    mask = facts.vocab_size - 1 if mask_token_id is None else mask_token_id
    drafter = load_config(None, [f"drafter.block_size={block_size}", f"drafter.num_draft_layers={num_draft_layers}",
                                 f"drafter.mask_token_id={mask}"]).drafter
    return derive_contract(drafter, facts, None)


def write_run(run_dir: Path, contract: DrafterContract, *, samples: int, seq_len: tuple[int, int] | int,
              token_range: int | None = None, seed: int = 0) -> Path:
    """A run dir a `train` can start from: `contract.json` and tokenized shards of random samples.

    Each sample has a length in `seq_len` (min, max), ids below `token_range` (default the vocab, without the
    mask id's row), and its last three quarters supervised (a prompt, then an answer)."""
    rd = RunDir(run_dir)
    atomic_write_json(rd.contract_path, contract.to_dict())
    lo, hi = (seq_len, seq_len) if isinstance(seq_len, int) else seq_len
    top = min(token_range or contract.vocab_size, contract.mask_token_id)
    rng = np.random.default_rng([seed, 17])
    rows = []
    for i in range(samples):
        n = int(rng.integers(lo, hi + 1))
        mask = np.zeros(n, dtype=np.int8)
        mask[n // 4:] = 1
        rows.append({"id": f"s{i:05d}", "input_ids": rng.integers(0, top, n), "loss_mask": mask})
    rd.tokenize_dir.mkdir(parents=True, exist_ok=True)
    write_parquet_shard(rd.tokenize_dir / shard_name(0), rows)
    return Path(run_dir)


def check_overrides(run_dir: Path, *, device: str, target_path: str | Path = "", **overrides: Any) -> list[str]:
    """The dotted overrides of a short check run: tiny batches, no held-out evaluation or checkpoints between
    steps, float32 unless `train.dtype` says otherwise; `overrides` win (`**{"train.max_steps": 4}`). The same
    list configures an in-process `fit` (`train_config`) and a `dflashkit train` command line."""
    base: dict[str, Any] = {
        "run.run_dir": str(run_dir), "target.device": device, "target.dtype": "float32", "train.dtype": "float32",
        "train.batch_size": 2, "train.max_steps": 4, "train.heldout_samples": 2, "train.lr": 3e-3,
        "train.warmup_ratio": 0.0, "train.log_every": 1, "train.eval_every": 0, "train.save_every": 0,
        "train.num_anchors": 8}
    if target_path:
        base["target.path"] = str(target_path)
    base.update(overrides)
    return [f"{k}={v}" for k, v in base.items()]


def train_config(run_dir: Path, *, device: str, target_path: str | Path = "", **overrides: Any):
    """The RunConfig of `check_overrides(...)`."""
    return load_config(None, check_overrides(run_dir, device=device, target_path=target_path, **overrides))
