"""A speculation profile that describes another drafter is never shipped, reported or compared (export, import and
verify-engine refuse it, exit 2 naming the file and both K), and one export at a time writes an `export.out_dir`
(a second, from another run dir, is refused naming the first's PID; a later one proceeds)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dflashkit.cli import main
from dflashkit.config import TargetSection
from dflashkit.export.profile import Measurement, build_profile, weights_digest, write_profile
from dflashkit.target.load import load_target
from tests.helpers import run_dir_with_drafter

PROFILE = "speculation_profile.json"


@pytest.fixture(scope="module")
def target(tiny_qwen3):
    return load_target(TargetSection(path=str(tiny_qwen3), device="cpu", dtype="float32"))


def _profile(drafter_dir: Path, *, measured_b: int, block_size: int | None, method: str = "dflash") -> dict:
    """A self-consistent profile measured on `drafter_dir`'s weights at block size `measured_b` (K = measured_b - 1),
    saying the drafter it describes has `block_size` (and max_supported_k = block_size - 1)."""
    lengths = [[measured_b, 2, 1, measured_b - 1], [1, 2]]  # tokens per verify step, each in [1, measured_b]
    return build_profile([Measurement(measured_b, lengths, [[False] * len(r) for r in lengths])],
                         headline=measured_b, method=method,
                         draft_checkpoint={"name": "other", "kind": "final",
                                           "weights_sha256": weights_digest(drafter_dir)},
                         target_model={"id": "t/qwen3", "architecture": "Qwen3ForCausalLM"},
                         block_size=block_size, max_supported_k=None if block_size is None else block_size - 1,
                         conditions={"measured_by": "a test"})


def _snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _run(capsys, argv: list[str]) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, err + out


def test_export_refuses_a_profile_of_another_k_or_family_and_leaves_the_export_as_it_was(tmp_path, target,
                                                                                         tiny_qwen3, capsys):
    rd = run_dir_with_drafter(tmp_path, target)  # B = 4: K = 3
    base = ["export", f"target.path={tiny_qwen3}", "--run-dir", str(rd), "--json"]
    assert main(base) == 0  # an earlier export, without a profile
    before = _snapshot(rd / "export")
    path = rd / "eval" / PROFILE
    write_profile(path, _profile(rd / "train" / "final", measured_b=8, block_size=8))  # K = 7, on these weights
    for extra in ([], ["--dry-run"], ["export.format=speculators", f"export.out_dir={tmp_path / 'spec'}"]):
        rc, text = _run(capsys, base + extra)
        assert rc == 2, text
        assert str(path) in text and "K=7" in text and "K=3" in text and "dflashkit eval" in text
        assert "Traceback" not in text
    assert _snapshot(rd / "export") == before and not (tmp_path / "spec").exists()
    # the same K and block size, another family
    write_profile(path, _profile(rd / "train" / "final", measured_b=4, block_size=4, method="dflash2"))
    rc, text = _run(capsys, base)
    assert rc == 2 and str(path) in text and "'dflash2'" in text and "'dflash'" in text
    assert _snapshot(rd / "export") == before
    # measured at a smaller K on this drafter (eval.block_sizes without its B): it describes this drafter, shipped
    write_profile(path, _profile(rd / "train" / "final", measured_b=2, block_size=4))
    rc, text = _run(capsys, base)
    assert rc == 0, text
    assert json.loads((rd / "export" / PROFILE).read_text())["num_speculative_tokens"] == 1


def test_import_and_verify_engine_refuse_a_profile_of_another_k(tmp_path, target, tiny_qwen3, capsys):
    rd = run_dir_with_drafter(tmp_path, target)
    src = rd / "train" / "final"
    path = src / PROFILE
    write_profile(path, _profile(src, measured_b=8, block_size=8))
    before = path.read_bytes()
    rc, text = _run(capsys, ["import", str(src), f"target.path={tiny_qwen3}", "--run-dir", str(tmp_path / "new"),
                             "--json"])
    assert rc == 2 and str(path) in text and "K=7" in text and "K=3" in text, text
    assert not (tmp_path / "new" / "train").exists() and not (tmp_path / "new" / "contract.json").exists()
    for extra in ([], ["--dry-run"]):  # refused before vLLM is looked for or started
        rc, text = _run(capsys, ["verify-engine", str(src), f"target.path={tiny_qwen3}", "--run-dir", str(rd),
                                 "--json", *extra])
        assert rc == 2 and str(path) in text and "K=7" in text and "K=3" in text, text
    assert path.read_bytes() == before and not (rd / "verify-engine").exists()


def test_the_check_compares_what_the_profile_records(tmp_path, target):
    from dflashkit.export.profile_ship import drafter_contract, other_drafter

    rd = run_dir_with_drafter(tmp_path, target)
    src = rd / "train" / "final"
    contract = drafter_contract(src)  # B = 4, dflash
    assert other_drafter(_profile(src, measured_b=4, block_size=4), contract) == []
    assert other_drafter(_profile(src, measured_b=3, block_size=None), contract) == []  # a producer without B
    assert other_drafter(_profile(src, measured_b=4, block_size=4, method="DFlash"), contract) == []
    bad = other_drafter(_profile(src, measured_b=8, block_size=None), contract)
    assert len(bad) == 1 and "num_speculative_tokens 7" in bad[0]
    assert len(other_drafter(_profile(src, measured_b=2, block_size=8), contract)) == 2  # block_size, max_supported_k
    assert "'eagle3'" in other_drafter(_profile(src, measured_b=4, block_size=4, method="eagle3"), contract)[0]


HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from dflashkit.cli import main
    from dflashkit.stages import export

    inside, release = Path(sys.argv[1]), Path(sys.argv[2])
    real = export.reload_check

    def paused(*a, **k):  # mid-export: the new dir is being built beside export.out_dir
        inside.write_text("x")
        deadline = time.monotonic() + 120
        while not release.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        return real(*a, **k)

    export.reload_check = paused
    sys.exit(main(["export", *sys.argv[3:]]))
""")


def _source(d: Path) -> str:
    return json.loads((d / "manifest.json").read_text())["inputs"]["source"]


def test_a_second_export_into_the_same_out_dir_is_refused_naming_the_first(tmp_path, target, tiny_qwen3, capsys):
    a = run_dir_with_drafter(tmp_path / "a", target)
    b = run_dir_with_drafter(tmp_path / "b", target, seed=1)  # two run dirs, so two run-dir locks
    out = tmp_path / "models" / "drafter"
    args = [f"target.path={tiny_qwen3}", f"export.out_dir={out}", "--json"]
    inside, release = tmp_path / "inside", tmp_path / "release"
    with open(tmp_path / "first.err", "w") as err:
        first = subprocess.Popen([sys.executable, "-c", HOLDER, str(inside), str(release), *args, "--run-dir", str(a)],
                                 stdout=subprocess.DEVNULL, stderr=err, env={**os.environ})
    try:
        deadline = time.monotonic() + 120
        while not inside.exists():  # the first export holds the out dir's lock and is writing
            assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "first.err").read_text()
            time.sleep(0.05)
        before = _snapshot(out.parent)
        rc, text = _run(capsys, ["export", *args, "--run-dir", str(b)])
        assert rc == 2, text
        assert f"PID {first.pid}" in text and "export.out_dir" in text and str(out) in text
        assert "Traceback" not in text and json.loads(text.strip().splitlines()[-1])["exit_code"] == 2
        assert _snapshot(out.parent) == before
    finally:
        release.write_text("x")
        assert first.wait(timeout=120) == 0, (tmp_path / "first.err").read_text()
    assert _source(out) == str(a / "train" / "final")  # the first writer's export, whole
    assert not (out.parent / ".drafter.lock").exists()  # released with its process
    (out.parent / ".drafter.lock").write_text(json.dumps({"pid": 999999, "command": "export"}))  # a stale file
    rc, text = _run(capsys, ["export", *args, "--run-dir", str(b)])  # a sequential export proceeds
    assert rc == 0, text
    assert _source(out) == str(b / "train" / "final")
    assert sorted(p.name for p in out.parent.iterdir()) == ["drafter"]
