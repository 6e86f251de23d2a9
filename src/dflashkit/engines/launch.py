"""Start the server `generate` and `bench serve` talk to when `server.urls` is empty: `dflashkit serve`
or vLLM (`server.engine`), for `target.path`, with the target's dtype and chat template.

Usage:
    with start_target_server(cfg, log_dir=rd.generate_dir) as base_url:   # "http://127.0.0.1:P/v1"
        ...                                                                      # stopped on exit
    with start_vllm_for_target(cfg, log_path=p, speculative={...}) as eng:     # vllm.Engine
        eng.base_url
    check_target_server(cfg)          # in a stage's checks (and its --dry-run): what starting one needs

Without vLLM installed these refuse (exit 3, naming `dflashkit engines install vllm`) unless
$DFLASHKIT_VLLM_AUTO_INSTALL=1 lets the command install it (`engines/vllm.py` `check_available`).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch

from dflashkit.engines import vllm
from dflashkit.errors import UsageError
from dflashkit.inspect.target import resolve_target_path
from dflashkit.target.hybrid import refuse_recurrent
from dflashkit.target.load import announce, compute_dtype, text_config_dict
from dflashkit.serving.local import start_local_server

if TYPE_CHECKING:
    from dflashkit.config import RunConfig

MAX_MODEL_LEN = 8192  # cap on the engine's context (its KV cache must hold one full sequence)


def engine_dtype(cfg: RunConfig) -> str:
    """The target's dtype for the engine (vLLM here runs on CPU), as load_target resolves `target.dtype` on the
    CPU: `auto` is float32, `native` bfloat16 only where the CPU computes it natively."""
    return announce(compute_dtype(cfg.target.dtype, torch.device("cpu"), key="target.dtype")).name


def check_vllm_for_target(cfg: RunConfig, what: str = "server.engine=vllm") -> Path:
    """What starting vLLM for `target.path` needs, checked before any work (stages call it in their checks,
    `start_vllm_for_target` again): a HF model dir (not a GGUF file), and vLLM installed (exit 3, or
    $DFLASHKIT_VLLM_AUTO_INSTALL=1). `what` is the key that asks for vLLM. Returns the model dir."""
    model_dir, gguf = resolve_target_path(cfg.target.path, cfg.target.gguf_file)
    if gguf:
        raise UsageError(f"{what}: target.path {cfg.target.path} is a GGUF file",
                         hint="point target.path at a HF model dir (dflashkit converts GGUF assets into one), "
                         "or use server.engine=dflashkit")
    check_engine_architecture(cfg, model_dir, what)
    vllm.check_available(what)
    return model_dir


# what to use instead of vLLM's CPU build for a hybrid (linear-attention / state-space) target, by asking key
_HYBRID_INSTEAD = {
    "server.engine": "set server.engine: dflashkit (dflashkit serve decodes such targets)",
    "verify-engine": "judge the export with `dflashkit eval` (lossless speculative decoding on this target); "
                     "checking it in vLLM needs a vLLM build that serves the architecture (a GPU one, run by you)",
    "capture.engine": "set capture.engine: local, or point capture.server_url at a vLLM you run on a GPU",
    "train.features": "set train.features: online or cached",
}


def check_engine_architecture(cfg: RunConfig, model_dir: Path, what: str) -> None:
    """Refuse (exit 2) a target with linear-attention / state-space layers for vLLM's CPU build, before any work:
    vLLM's Gated DeltaNet and Mamba layers rely on GPU kernels, and dflashkit does not run them on its CPU build.
    The message names the target, its layer types and what to use instead (by the key in `what`)."""
    instead = next((v for k, v in _HYBRID_INSTEAD.items() if what.startswith(k)),
                   "use dflashkit's own paths (server.engine: dflashkit, capture.engine: local, train.features: "
                   "online) or a vLLM you run on a GPU")
    refuse_recurrent(what, model_dir, why=f"dflashkit's engine is vLLM's CPU build ({vllm.PACKAGE} {vllm.VERSION}), "
                     "which it does not run on such targets (vLLM's Gated DeltaNet / Mamba layers rely on GPU kernels)",
                     instead=instead, trust_remote_code=cfg.target.trust_remote_code)


@contextmanager
def start_vllm_for_target(cfg: RunConfig, *, log_path: Path, speculative: dict[str, Any] | None = None,
                          served_name: str | None = None, extra_args: list[str] | None = None,
                          what: str = "server.engine=vllm") -> Iterator[Any]:
    """vLLM for `target.path` (a HF dir; the tokenizer and template are the target's); yields a vllm.Engine.
    `what`: the key that asks for vLLM (named when it is not installed)."""
    model_dir = check_vllm_for_target(cfg, what)
    max_pos = int(text_config_dict(model_dir).get("max_position_embeddings") or MAX_MODEL_LEN)
    with vllm.start(model_dir, dtype=engine_dtype(cfg), served_name=served_name or cfg.server.model or "target",
                    chat_template=cfg.target.chat_template, tokenizer=cfg.target.tokenizer,
                    speculative=speculative, max_model_len=min(max_pos, MAX_MODEL_LEN), log_path=log_path,
                    startup_timeout_s=max(cfg.server.startup_timeout_s, 600.0), extra_args=extra_args,
                    what=what) as eng:
        yield eng


def parser_args(cfg: RunConfig) -> list[str]:
    """vLLM's flags for `server.tool_call_parser` and `server.reasoning_parser` ([] when neither is set)."""
    s = cfg.server
    return ([*(["--enable-auto-tool-choice", "--tool-call-parser", s.tool_call_parser] if s.tool_call_parser else []),
             *(["--reasoning-parser", s.reasoning_parser] if s.reasoning_parser else [])])


def check_target_server(cfg: RunConfig) -> None:
    """What `start_target_server` needs, checked before any work: with server.engine=vllm, vLLM for the target."""
    if cfg.server.engine == "vllm":
        check_vllm_for_target(cfg, "server.engine=vllm (server.urls is empty)")


@contextmanager
def start_target_server(cfg: RunConfig, *, log_dir: Path) -> Iterator[str]:
    """`server.engine`'s server for the target on 127.0.0.1; yields its base URL (…/v1); logs in log_dir."""
    check_target_server(cfg)
    if cfg.server.engine == "vllm":
        with start_vllm_for_target(cfg, log_path=Path(log_dir) / "engine.log", extra_args=parser_args(cfg),
                                   what="server.engine=vllm (server.urls is empty)") as eng:
            yield eng.base_url
        return

    with start_local_server(cfg, log_path=Path(log_dir) / "serve.log") as url:
        yield url
