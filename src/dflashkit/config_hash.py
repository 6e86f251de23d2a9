"""The stable hash of config sections that manifests record: a stage is up to date while its sections hash the same.

Usage:
    section_hash(cfg.train, cfg.drafter)       # 16 hex digits

A field marked `hash_default=False` in the schema is left out while it holds its default, so adding an optional
key never makes existing run dirs look out of date; keys are sorted, so field order does not matter. It lives
below the config package (it reads any dataclass, never the schema) so that the stage table and the run dir,
which rank below the config, hash without importing it. `dflashkit.config` re-exports `section_hash`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any


def _hashed(section: Any) -> Any:
    """The dict hashed for a dataclass section: fields marked hash_default=False left out at their default,
    in its nested sections and lists of sections (`data.sources[]`) too; a field marked `flat` (a drafter family's
knobs or weights, `config/schema.py`) adds its fields to the section's, as the flat keys they are written as."""
    data = dataclasses.asdict(section)
    for fl in dataclasses.fields(section):
        value = getattr(section, fl.name)
        if fl.metadata.get("flat"):  # a family's settings: its fields are the section's own keys
            data.pop(fl.name)
            data.update(_hashed(value))
        elif dataclasses.is_dataclass(value):
            data[fl.name] = _hashed(value)
        elif isinstance(value, list) and value and all(dataclasses.is_dataclass(v) for v in value):
            data[fl.name] = [_hashed(v) for v in value]
        if fl.metadata.get("hash_default") is False:
            default = fl.default if fl.default is not dataclasses.MISSING else fl.default_factory()  # type: ignore[misc,operator]
            if data.get(fl.name) == default:
                data.pop(fl.name)
    return data


def section_hash(*sections: Any) -> str:
    """Stable hash of config sections (manifests use it to decide whether a stage is up to date)."""
    blob = json.dumps([_hashed(s) if dataclasses.is_dataclass(s) else s for s in sections],
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
