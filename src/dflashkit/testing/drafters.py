"""A small random drafter that fits a loaded `Target` (arbitrary but real drafts), for `gpu-check` and tests.

Usage:
    drafter = random_drafter(target, block_size=4, layers=1, seed=0)
    drafter2 = random_drafter(target, drafter_type="dflash2", conv_group_size=8, selector_top_k=4)
"""

from __future__ import annotations


def random_drafter(target, block_size: int = 4, layers: int = 1, seed: int = 0, **overrides):
    """A small random drafter that fits a loaded `Target` (arbitrary but real drafts).

    `drafter_type="dflash2"` (+ `conv_group_size=…`, `selector_top_k=…`) gives a DFlash2 drafter."""
    import torch

    from dflashkit.family import new_drafter
    from dflashkit.family.contract import DrafterContract, build_target_layer_ids

    n = target.num_layers
    heads = 4
    fields = dict(block_size=block_size, num_draft_layers=layers,
                  target_layer_ids=build_target_layer_ids(n, 2) if n >= 4 else [n // 2],
                  mask_token_id=target.vocab_size - 1, num_target_layers=n, hidden_size=target.hidden_size,
                  num_attention_heads=heads, num_key_value_heads=2, head_dim=target.hidden_size // heads,
                  intermediate_size=2 * target.hidden_size, vocab_size=target.vocab_size)
    fields.update(overrides)  # a family's knobs too (flat, as contract.json holds them)
    torch.manual_seed(seed)
    return new_drafter(DrafterContract.from_dict(fields)).eval()
