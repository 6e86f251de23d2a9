"""The suite's split (tests/conftest.py): a test module that starts torchrun ranks says so with the
`distributed` or `serial` mark, so `make test` runs its tests alone instead of beside a parallel worker.

Usage:
    .venv/bin/python -m pytest tests/test_suite_split.py
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
TORCHRUN = re.compile(r"torch\.distributed\.run|--nproc-per-node")  # how a test starts ranks (or the CLI's relaunch)
MARKED = re.compile(r"pytest\.mark\.(distributed|serial)\b")


def unmarked_torchrun_modules(sources: dict[str, str]) -> list[str]:
    return sorted(name for name, src in sources.items() if TORCHRUN.search(src) and not MARKED.search(src))


def test_torchrun_test_modules_are_marked_serial():
    sources = {str(p.relative_to(TESTS)): p.read_text() for p in sorted(TESTS.rglob("test_*.py"))}
    assert TORCHRUN.search(sources["integration/test_distributed.py"])  # the scan sees the torchrun tests
    bad = unmarked_torchrun_modules(sources)
    assert not bad, "modules that start torchrun without @pytest.mark.distributed or .serial:\n  " + "\n  ".join(bad)


@pytest.mark.parametrize("src,flagged", [
    ('subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", s])', True),
    ('main(["train", "--nproc-per-node", "2"])', True),
    ('pytestmark = pytest.mark.distributed\nmain(["train", "--nproc-per-node", "2"])', False),
    ('@pytest.mark.serial\ndef test_x(): main(["train", "--nproc-per-node", "2"])', False),
    ('assert checks["torchrun"]["status"] == "ok"', False),
])
def test_the_check_can_fail(src, flagged):
    assert unmarked_torchrun_modules({"m.py": src}) == (["m.py"] if flagged else [])
