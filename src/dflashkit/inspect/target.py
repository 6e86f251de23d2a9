"""Find a target's files and read its facts: the part of `probe` that `plan` and `bench train` share.

Usage:
    model_dir, gguf_file = resolve_target_path("smollm2-135m-instruct")  # dir, .gguf, config.json or asset
    model_dir, gguf_file, facts, tok = inspect_target(cfg, "path/to/Qwen3-8B", load_tokenizer=False)

Reads files only (json, the GGUF header, tokenizer files); the tokenizer is loaded for real only
with `load_tokenizer=True`. Writes nothing.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from dflashkit.errors import ConfigError, UsageError
from dflashkit.inspect.config_facts import read_model_facts
from dflashkit.inspect.gguf_facts import read_gguf_facts
from dflashkit.inspect.tokenizer_facts import read_tokenizer_facts, tokenizer_facts_from_gguf
from dflashkit.target.files import resolve_target_path  # noqa: F401  (re-exported: the one resolver lives in model/)
from dflashkit.target.quantized import check_checkpoint

if TYPE_CHECKING:
    from dflashkit.inspect.config_facts import ModelFacts
    from dflashkit.config import RunConfig
    from dflashkit.inspect.tokenizer_facts import TokenizerFacts

log = logging.getLogger("dflashkit.probe")


def inspect_target(cfg: RunConfig, path: str, *, load_tokenizer: bool = True
                   ) -> tuple[Path, str | None, ModelFacts, TokenizerFacts | None]:
    """(model dir, gguf file, ModelFacts, TokenizerFacts | None) — reads files, writes nothing."""
    model_dir, gguf_file = resolve_target_path(path, cfg.target.gguf_file)
    tok_dir = Path(cfg.target.tokenizer).expanduser() if cfg.target.tokenizer else model_dir
    if gguf_file:
        facts, meta = read_gguf_facts(model_dir / gguf_file)
        tok_facts = read_tokenizer_facts(tok_dir) if cfg.target.tokenizer else \
            tokenizer_facts_from_gguf(model_dir / gguf_file, meta)
    else:
        facts = read_model_facts(model_dir)
        facts.checkpoint = checkpoint_problem(model_dir)
        if cfg.target.tokenizer and not tok_dir.is_dir():
            raise UsageError(f"target.tokenizer {tok_dir} is not a directory")
        tok_facts = read_tokenizer_facts(tok_dir)
    tok: TokenizerFacts | None = tok_facts
    if not tok_facts.files:
        if load_tokenizer:
            log.warning("no tokenizer files in %s (set target.tokenizer to the tokenizer dir)", tok_dir)
        tok = None
    if tok is not None and cfg.target.chat_template:
        tpl = Path(cfg.target.chat_template).expanduser()
        if not tpl.is_file():
            raise UsageError(f"target.chat_template {tpl}: no such file")
        tok.chat_template, tok.chat_template_source = tpl.read_text(), str(tpl)
        tok.chat_template_chars = len(tok.chat_template)
    if tok is not None and load_tokenizer:
        use_gguf = gguf_file if not cfg.target.tokenizer else None
        tok.check_load(trust_remote_code=cfg.target.trust_remote_code, model_dir=tok_dir, gguf_file=use_gguf)
        if not tok.loaded["ok"]:
            log.warning("%s — fix: %s", tok.loaded["diagnosis"], tok.loaded["fix"])
    return model_dir, gguf_file, facts, tok


def checkpoint_problem(model_dir: Path) -> str | None:
    """Why the safetensors in `model_dir` cannot be what its config.json says (`check_checkpoint`'s refusal,
    which every loading stage raises with exit 2), or None; from the headers and file sizes only."""
    try:
        check_checkpoint(model_dir)
    except ConfigError:
        raise  # a malformed config.json is probe's own error too
    except UsageError as e:
        return e.message + (f"; fix: {e.hint}" if e.hint else "")
    return None
