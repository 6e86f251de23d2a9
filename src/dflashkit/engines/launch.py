"""Start the server `generate` and `bench serve` talk to when `server.urls` is empty: `dflashkit serve`
or vLLM (`server.engine`), for `target.path`, with the target's dtype and chat template.

Usage:
    with start_target_server(cfg, log_dir=rd.generate_dir) as base_url:   # "http://127.0.0.1:P/v1"
        ...                                                                      # stopped on exit
    with start_vllm_for_target(cfg, log_path=p, speculative={...}) as eng:     # vllm.Engine
        eng.base_url
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from dflashkit.errors import UsageError

if TYPE_CHECKING:
    from dflashkit.config import RunConfig

MAX_MODEL_LEN = 8192  # cap on the engine's context (its KV cache must hold one full sequence)


def engine_dtype(cfg: RunConfig) -> str:
    """The target's dtype for the engine: `auto` is float32 on CPU (vLLM here runs on CPU), as in load_target."""
    return "float32" if cfg.target.dtype == "auto" else cfg.target.dtype


@contextmanager
def start_vllm_for_target(cfg: RunConfig, *, log_path: Path, speculative: dict[str, Any] | None = None,
                          served_name: str | None = None, extra_args: list[str] | None = None) -> Iterator[Any]:
    """vLLM for `target.path` (a HF dir; the tokenizer and template are the target's); yields a vllm.Engine."""
    from dflashkit.engines import vllm
    from dflashkit.inspect.target import resolve_target_path
    from dflashkit.model.target import text_config_dict

    model_dir, gguf = resolve_target_path(cfg.target.path, cfg.target.gguf_file)
    if gguf:
        raise UsageError(f"server.engine=vllm: target.path {cfg.target.path} is a GGUF file",
                         hint="point target.path at a HF model dir (dflashkit converts GGUF assets into one), "
                         "or use server.engine=dflashkit")
    max_pos = int(text_config_dict(model_dir).get("max_position_embeddings") or MAX_MODEL_LEN)
    with vllm.start(model_dir, dtype=engine_dtype(cfg), served_name=served_name or cfg.server.model or "target",
                    chat_template=cfg.target.chat_template, tokenizer=cfg.target.tokenizer,
                    speculative=speculative, max_model_len=min(max_pos, MAX_MODEL_LEN), log_path=log_path,
                    startup_timeout_s=max(cfg.server.startup_timeout_s, 600.0), extra_args=extra_args) as eng:
        yield eng


@contextmanager
def start_target_server(cfg: RunConfig, *, log_dir: Path) -> Iterator[str]:
    """`server.engine`'s server for the target on 127.0.0.1; yields its base URL (…/v1); logs in log_dir."""
    if cfg.server.engine == "vllm":
        with start_vllm_for_target(cfg, log_path=Path(log_dir) / "engine.log") as eng:
            yield eng.base_url
        return
    from dflashkit.serving.local import start_local_server

    with start_local_server(cfg, log_path=Path(log_dir) / "serve.log") as url:
        yield url
