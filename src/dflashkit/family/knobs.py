"""A family's settings, declared once: its `drafter.*` knobs (contract fields) and its `train.*` weights.

Usage:
    @dataclass(frozen=True)
    class ToyKnobs(DFlashKnobs):
        toy_scale: float = knob(1.0, "toy: multiplies the block's hidden states.", gt=0)

    range_problems(ToyKnobs(toy_scale=0))                      # ["toy_scale: must be > 0, got 0"]
    range_problems(cfg.drafter.knobs, prefix="drafter.")       # the same checks of a run's knobs
    settings(ToyKnobs, cfg.drafter.knobs).toy_scale            # typed: a misspelt name is a mypy error

A field made by `knob` holds its default, its one-line help text (the schema's: docs/config.md shows it) and
its range (`ge`, `gt`, `le`, `lt`); `hash_default=False` (the default) leaves it out of the section hash while
it holds its default, so adding a knob never makes existing run dirs look out of date. A run's config holds
one instance of its family's knobs (`cfg.drafter.knobs`) and weights (`cfg.train.weights`); their field names
are the flat `drafter.*` / `train.*` keys of the YAML and the command line (`config/loader.py` maps them).
The type and range checks of both the config and the contract come from this metadata, and only a family's
cross-field rules (a group size that divides the hidden size) stay hand-written. No torch here.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

S = TypeVar("S")


def knob(default: Any, help: str, *, ge: float | None = None, gt: float | None = None,  # noqa: A002
         le: float | None = None, lt: float | None = None, hash_default: bool = False) -> Any:
    """A knob or weight field: its default, help text and range (None: unbounded on that side)."""
    meta: dict[str, Any] = {"help": help, "range": declared_range(ge=ge, gt=gt, le=le, lt=lt)}
    if not hash_default:
        meta["hash_default"] = False
    return field(default=default, metadata=meta)


def declared_range(*, ge: float | None = None, gt: float | None = None, le: float | None = None,
                   lt: float | None = None) -> dict[str, float]:
    """The bounds given (None: unbounded on that side), as a field's `range` metadata."""
    return {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}


@dataclass(frozen=True)
class NoKnobs:
    """The knobs of a family that adds no contract field (and the weights of one that adds no `train.*` key)."""


def settings(cls: type[S], value: object) -> S:
    """`value` (a run's `cfg.drafter.knobs` or `cfg.train.weights`) as the settings class `cls`, for the type
    checker; TypeError when the run holds another family's (its `drafter.type` is not `cls`'s family)."""
    if not isinstance(value, cls):
        raise TypeError(f"the run's settings are {type(value).__name__}, not {cls.__name__}")
    return value


def type_of(cls: type, name: str) -> Any:
    """The resolved type of field `name` of the dataclass `cls` (its annotations are strings)."""
    return typing.get_type_hints(cls)[name]


def _range_text(r: dict[str, float]) -> str:
    low = f"[{r['ge']:g}" if "ge" in r else f"({r['gt']:g}" if "gt" in r else None
    high = f"{r['le']:g}]" if "le" in r else f"{r['lt']:g})" if "lt" in r else None
    if low and high:
        return f"in {low}, {high}"
    if low:
        return f"{'>=' if low[0] == '[' else '>'} {low[1:]}"
    return f"{'<=' if high and high[-1] == ']' else '<'} {(high or '')[:-1]}"


def in_range(value: Any, r: dict[str, float]) -> bool:
    return (("ge" not in r or value >= r["ge"]) and ("gt" not in r or value > r["gt"])
            and ("le" not in r or value <= r["le"]) and ("lt" not in r or value < r["lt"]))


def range_problems(values: Any, cls: type | None = None, *, prefix: str = "") -> list[str]:
    """`<prefix><name>: must be …, got v` for each field of the dataclass `cls` (default: `values`' own class)
    whose value in `values` is outside the range its `knob` (or the config schema's `f`) declares, and
    `<prefix><name>[i]: …` for each number of a list field outside it (a None where the field may be None is
    fine; the field's `note` follows the range). Values of the wrong type are `type_problems`' to report:
    check those first."""
    out = []
    for f in dataclasses.fields(cls or values):
        r, v = f.metadata.get("range"), getattr(values, f.name)
        if not r:
            continue
        note = f.metadata.get("note", " (or null)" if f.default is None else "")
        items = enumerate(v) if isinstance(v, (list, tuple)) else [(None, v)]  # a list: each of its numbers
        for i, x in items:
            if x is None or isinstance(x, bool) or not isinstance(x, (int, float)) or in_range(x, r):
                continue
            key = f"{prefix}{f.name}" if i is None else f"{prefix}{f.name}[{i}]"
            out.append(f"{key}: must be {_range_text(r)}{note}, got {x}")
    return out


def type_problems(values: Any, cls: type | None = None, *, prefix: str = "") -> list[str]:
    """`<prefix><name> must be …, got v` for each field whose value is not of its declared type (a hand-edited
    contract.json could hold "4" or 1 where an integer or a boolean belongs); checked before any range."""
    out = []
    for f in dataclasses.fields(cls or values):
        v, kind = getattr(values, f.name), str(f.type)
        if v is None and "None" in kind:
            continue
        if kind.startswith("Literal"):  # a choice of names: one of them
            choices = typing.get_args(type_of(cls or type(values), f.name))
            ok, what = v in choices, "one of " + " | ".join(map(str, choices))
        elif kind.startswith("bool"):
            ok, what = isinstance(v, bool), "true or false"
        elif kind.startswith("int"):
            ok, what = isinstance(v, int) and not isinstance(v, bool), "an integer"
        else:
            ok, what = isinstance(v, (int, float)) and not isinstance(v, bool), "a number"
        if not ok:
            out.append(f"{prefix}{f.name} must be {what}, got {v!r}")
    return out


def field_names(cls: type) -> tuple[str, ...]:
    """The fields of a knobs or weights dataclass, in their order."""
    return tuple(f.name for f in dataclasses.fields(cls))
