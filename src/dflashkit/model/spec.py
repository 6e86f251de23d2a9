"""What a drafter network reads of the rooms above it: `DraftSpec` (a contract).

Usage:
    def __init__(self, contract: DraftSpec, ...)      # a network's constructor (model/drafter.py and the heads)
    DFlashDraftModel(contract)                         # a DrafterContract is one: nothing to convert

The drafter families (`dflashkit.family`) own the contract: its checks, its family lookup, its formats. They
rank above this package, which builds the networks they ask for, so a network names what it reads of the
contract here, as a Protocol, instead of importing the contract's class, even for its type: model/ stays a
leaf for the type checker as it is at run time (tests/test_layering.py reads type-only imports too). The
knobs are the family's own frozen dataclass; each network reads its own family's fields from them.
The target loaders read the `target.*` keys the same way (`target/spec.py`).
"""

from __future__ import annotations

from typing import Any, Protocol


class DraftSpec(Protocol):
    """The contract fields and views a drafter network reads (`DrafterContract` provides every one)."""

    @property
    def block_size(self) -> int: ...

    @property
    def num_draft_layers(self) -> int: ...

    @property
    def target_layer_ids(self) -> list[int]: ...

    @property
    def mask_token_id(self) -> int: ...

    @property
    def hidden_size(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def rms_norm_eps(self) -> float: ...

    @property
    def knobs(self) -> Any: ...

    @property
    def layer_windows(self) -> list[int | None]: ...

    @property
    def layer_causal(self) -> list[bool]: ...

    def check(self) -> None: ...

    def to_hf_config(self, *, dtype: str = "bfloat16") -> dict[str, Any]: ...
