"""Roll a target's cache back after a verify pass: exact for full-attention, sliding-window and recurrent layers.

Usage:
    cache = DynamicCache(config=target.config)
    target.model(input_ids=prompt, cache=cache, use_cache=True)      # prefill (nothing recorded)
    arm(cache, max_tokens=B)                                          # once, before the first verify pass
    target.model(input_ids=block, cache=cache, use_cache=True)        # ≤ B tokens
    rollback(cache, drop)                                             # forget the last `drop` of them (0 too)

A full-attention layer forgets positions by cropping its keys and values (`Cache.crop`); for such a
cache `arm` does nothing and `rollback(cache, 0)` touches nothing. A linear-attention or state-space
layer (Gated DeltaNet, Mamba-2) keeps no per-position state, so after `arm` it uses transformers' own
past recording (`Cache.activate_past_recording`): a forward keeps its convolution inputs and the
recurrent state after each of its last `max_tokens` tokens, and `crop(-drop)` restores the state
after the kept prefix. This costs less than a snapshot plus a second forward on rejection, or
recomputing the block. A sliding-window layer records too, so it rolls back past its window.
Recording starts at `arm`, after the prefill, so a long prompt's convolution inputs are never kept.

Invariant: after `arm(cache, max_tokens=k)` every forward through the cache is at most k tokens and is
followed by `rollback(cache, drop)` (0 ≤ drop ≤ its length) before the next one; the cache then holds exactly
what a cache fed only the kept tokens holds (recurrent and convolution states, keys and values, the length),
so the next forward computes what one-token decoding over the same committed tokens computes.
More: docs/hybrid-targets.md.
"""

from __future__ import annotations

from typing import Any

from dflashkit.errors import UsageError


def recurrent_layers(cache: Any) -> list[int]:
    """Indices of the cache's linear-attention / state-space layers (a hybrid layer with attention too counts)."""
    try:
        from transformers.cache_utils import LinearAttentionCacheLayerMixin
    except ImportError:  # a transformers without linear-attention cache layers
        return []
    return [i for i, layer in enumerate(getattr(cache, "layers", []))
            if isinstance(layer, LinearAttentionCacheLayerMixin)]


def _records(layer: Any) -> bool:
    return hasattr(layer, "activate_past_recording")


def arm(cache: Any, max_tokens: int) -> None:
    """Make `rollback` exact for forwards of at most `max_tokens` tokens (see the module doc).

    Nothing happens for a cache of plain full-attention layers. Call it after the prefill and before the
    first forward that may be rolled back; calling it again (same or larger `max_tokens`) is harmless.

    Raises:
        UsageError: the cache has recurrent layers and the installed transformers cannot record their past.
    """
    layers = getattr(cache, "layers", [])
    rec = recurrent_layers(cache)
    if not rec and not any(_records(layer) for layer in layers):
        return
    if rec and not hasattr(cache, "activate_past_recording"):
        import transformers

        raise UsageError(f"transformers {transformers.__version__} cannot roll back linear-attention / state-space "
                         "cache layers (no Cache.activate_past_recording)",
                         hint="upgrade transformers (pip install -U 'transformers>=5.25,<6')")
    for i, layer in enumerate(layers):
        if not _records(layer):
            continue
        if getattr(layer, "record_past", False) and getattr(layer, "recurrent_states_to_keep", max_tokens) >= max_tokens:
            continue
        if i in rec:
            layer.activate_past_recording(recurrent_states_to_keep=int(max_tokens))
            # one history list per state (transformers' dict.fromkeys shares one list between a layer's states)
            layer.recurrent_states_history = {s: [] for s in range(layer.number_of_states)}
        else:
            layer.activate_past_recording()


def recording(cache: Any) -> bool:
    """Whether any layer of `cache` records its past (then every forward must be followed by `rollback`)."""
    return any(getattr(layer, "record_past", False) for layer in getattr(cache, "layers", []))


def rollback(cache: Any, drop: int) -> None:
    """Forget the last `drop` positions of the last forward (exact; see the module doc).

    A recording cache is cropped also when `drop` is 0: that trims the convolution windows and sliding-window
    keys back to their working size and frees the recorded states. A cache that does not record is cropped only
    when there is something to drop (the plain full-attention crop, at its speed).

    Raises:
        RuntimeError: `drop` is negative, or the cache has recurrent layers and `arm` was not called.
    """
    if drop < 0:
        raise RuntimeError(f"rollback: drop must be >= 0, got {drop}")
    if recording(cache):
        cache.crop(-drop)
    elif drop:
        if recurrent_layers(cache):
            raise RuntimeError("rollback of a linear-attention / state-space cache needs `arm(cache, …)` before the "
                               "forward it rolls back")
        cache.crop(-drop)
