"""What the target loaders read of the config: `TargetSpec`, the `target.*` keys.

Usage:
    load_target(cfg.target)          # a TargetSection is a TargetSpec: nothing to convert

The config ranks above this package (it holds the families' settings, which rank above the networks), so the
loaders name the keys they read here, as a Protocol, instead of importing the config's class even for its type:
tests/test_layering.py reads type-only imports too.
"""

from __future__ import annotations

from typing import Protocol


class TargetSpec(Protocol):
    """The `target.*` keys the target loaders read (the config's `TargetSection` is one)."""

    @property
    def path(self) -> str: ...

    @property
    def gguf_file(self) -> str | None: ...

    @property
    def dtype(self) -> str: ...

    @property
    def device(self) -> str: ...

    @property
    def trust_remote_code(self) -> bool: ...

    @property
    def tokenizer(self) -> str | None: ...

    @property
    def chat_template(self) -> str | None: ...
