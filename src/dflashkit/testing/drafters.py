"""A small random drafter that fits a loaded `Target` (arbitrary but real drafts), for tests.

Usage:
    drafter = random_drafter(target, block_size=4, layers=1, seed=0)
    drafter2 = random_drafter(target, drafter_type="dflash2", conv_group_size=8, selector_top_k=4)
"""

from __future__ import annotations


def random_drafter(target, block_size: int = 4, layers: int = 1, seed: int = 0, **overrides):
    """A small random drafter that fits a loaded `Target` (arbitrary but real drafts).

    `drafter_type="dflash2"` (+ `conv_group_size=…`, `selector_top_k=…`) gives a DFlash2 drafter."""
    import torch

    from dflashkit.model.dflash2 import drafter_for
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
    return drafter_for(DrafterContract(**fields)).eval()
