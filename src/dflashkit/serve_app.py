"""Build the `dflashkit serve` app (target, optional drafter, engine) from a config; the library half of `serve`.

Usage:
    app = build_app(load_config("run.yaml"), "path/to/model")   # a started `serving.server.App`
    with serve_in_thread(app) as url: ...                        # or `stages/serve.py` binds a port

Kept outside `serving/` so that `serving` stays the server alone and `testing.serving` can build an
app without importing a stage.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from dflashkit.decode.api import default_stop_ids
from dflashkit.decode.spec_decode import SpecDecoder
from dflashkit.errors import UsageError
from dflashkit.export.hf import load_drafter
from dflashkit.inspect.target import resolve_target_path
from dflashkit.serving.batching import BatchEngine
from dflashkit.serving.engine import SerialEngine
from dflashkit.serving.server import App

if TYPE_CHECKING:
    from dflashkit.config import RunConfig

log = logging.getLogger("dflashkit.serve")


def build_app(cfg: RunConfig, model_path: str | None = None) -> App:
    """Load the target (and drafter) named by `cfg`/`model_path`; return a started `App`.

    Raises:
        UsageError: bad model path, or a drafter that does not fit the target.
    """
    from dflashkit.model.target import load_target

    section = dataclasses.replace(cfg.target, path=model_path) if model_path else cfg.target
    target = load_target(section)
    if target.tokenizer is None or not getattr(target.tokenizer, "chat_template", None):
        log.warning("%s has no chat template; /v1/chat/completions will fail (use /v1/completions "
                    "or set target.chat_template)", section.path)
    name = cfg.serve.model_name or resolve_target_path(section.path, section.gguf_file)[0].name
    s = cfg.serve
    if s.drafter:
        if not Path(s.drafter).is_dir():
            raise UsageError(f"serve.drafter {s.drafter!r} is not a directory",
                             hint="pass a drafter dir with config.json + model.safetensors "
                                  "(e.g. <run_dir>/train/final or <run_dir>/export)")
        drafter = load_drafter(s.drafter)
        engine: SerialEngine | BatchEngine = SerialEngine(SpecDecoder(target, drafter, adaptive=s.adaptive_length), target.tokenizer,
                                                           default_stop_ids(target))
    else:
        engine = BatchEngine(target, max_batch=s.max_batch, batch_wait_ms=s.batch_wait_ms)
    engine.start()
    return App(engine, target.tokenizer, model_name=name, max_new_tokens=s.max_new_tokens,
               speculative=bool(s.drafter))
