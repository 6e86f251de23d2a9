"""Shared fixtures: offline, deterministic, tiny real models built in code."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_targets(tmp_path_factory):
    """Directories of tiny random targets: qwen3, llama (tied embeddings), deepseek_v3 (MLA+MoE)."""
    from dflashkit.testing import make_tiny_target

    base = tmp_path_factory.mktemp("tiny_targets")
    return {arch: make_tiny_target(base / arch, arch) for arch in ("qwen3", "llama", "deepseek_v3")}


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_targets):
    return tiny_targets["qwen3"]


@pytest.fixture(scope="session")
def smollm2_dir():
    """The real SmolLM2-135M-Instruct, converted into the cache (fetched by `make test` first)."""
    from dflashkit.assets import asset_path

    return asset_path("smollm2-135m-instruct")


@pytest.fixture(autouse=True)
def _torch_hygiene():
    try:
        import torch
    except ImportError:
        yield
        return
    torch.set_default_dtype(torch.float32)
    threads = torch.get_num_threads()
    # Tiny models, and a 2-core box shared with the test's own server/torchrun subprocesses: one
    # intra-op thread is steadier and often ~10x faster than two spin-waiting OpenMP threads.
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    torch.set_default_dtype(torch.float32)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
