"""Shared fixtures: offline, deterministic, tiny real models built in code.

How the suite is split (`make test`, see the Makefile): pytest-xdist runs every test not marked
`serial` on 2 workers, one single-threaded test per core; then the `serial` tests run alone, one
at a time. A test opts into the serial part with `@pytest.mark.serial` (a whole module:
`pytestmark = pytest.mark.serial`), next to a comment saying why, when it keeps two or more
CPU-busy processes going at once (torchrun ranks, a server and the client that floods it, a
browser) or when its deadlines assume the CPUs are its own; `distributed` (torchrun) tests are
serial without saying so. A test that starts one child process and waits for it stays parallel:
the child is single-threaded (OMP_NUM_THREADS=1 below) and the waiting test uses no CPU.
Run one test serially with `.venv/bin/python -m pytest tests/x.py::test_y`.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
if "PYTEST_XDIST_WORKER" in os.environ:  # the parallel part of `make test`
    # Its tests' child processes (CLI runs, servers) inherit this: one OpenMP thread each, as the tests
    # themselves (`_torch_hygiene`). Two workers' children spin-waiting on two threads apiece on a
    # 2-core box run many times slower, and a deadline that held alone can then expire. (The serial
    # part and `make test-engine` leave the children's threads alone: they have the CPUs to themselves.)
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: `-m "not serial"` must see the added mark
def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("distributed"):  # torchrun: two ranks, a core each
            item.add_marker(pytest.mark.serial)


@pytest.fixture(scope="session")
def tiny_targets(tmp_path_factory):
    """Directories of tiny random targets: qwen3, llama (tied embeddings), deepseek_v3 (MLA+MoE)."""
    from dflashkit.target.tiny import make_tiny_target

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
