"""Test gear: tiny targets (from `dflashkit.model.tiny`), random drafters, our server on a free port.

Usage:
    make_tiny_target("/tmp/t", arch="qwen3")                  # Qwen3ForCausalLM + byte tokenizer
    python -m dflashkit.testing /tmp/t qwen3
    with serving({"target": {"path": "/tmp/t"}}) as (app, url): ...   # our `serve` on 127.0.0.1
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

from dflashkit.model.tiny import (  # noqa: F401
    CHATML_TEMPLATE,
    SPECIALS,
    TINY_VOCAB,
    make_byte_tokenizer,
    make_tiny_target,
    tiny_config,
)


def random_drafter(target, block_size: int = 4, layers: int = 1, seed: int = 0, **overrides):
    """A small random drafter that fits a loaded `Target` (arbitrary but real drafts)."""
    import torch

    from dflashkit.model.drafter import DFlashDraftModel
    from dflashkit.model.drafter_config import DrafterContract, build_target_layer_ids

    n = target.num_layers
    heads = 4
    fields = dict(block_size=block_size, num_draft_layers=layers,
                  target_layer_ids=build_target_layer_ids(n, 2) if n >= 4 else [n // 2],
                  mask_token_id=target.vocab_size - 1, num_target_layers=n, hidden_size=target.hidden_size,
                  num_attention_heads=heads, num_key_value_heads=2, head_dim=target.hidden_size // heads,
                  intermediate_size=2 * target.hidden_size, vocab_size=target.vocab_size)
    fields.update(overrides)
    torch.manual_seed(seed)
    return DFlashDraftModel(DrafterContract(**fields)).eval()


@contextmanager
def serving(config: dict):
    """Build `dflashkit serve`'s app from a config dict and serve it on 127.0.0.1 (a free port).

    Yields (app, base_url ending in /v1). Torch runs one intra-op thread meanwhile (the engine
    thread shares a small box with the client), and the engine is stopped on exit.
    """
    import torch

    from dflashkit.config import config_from_dict
    from dflashkit.serve_app import build_app
    from dflashkit.serving.server import serve_in_thread

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    app = build_app(config_from_dict(config))
    try:
        with serve_in_thread(app) as url:
            yield app, url
    finally:
        app.engine.stop()
        torch.set_num_threads(threads)


if __name__ == "__main__":
    make_tiny_target(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "qwen3",
                     wrapper=sys.argv[3] if len(sys.argv) > 3 else None)
    print(sys.argv[1])
