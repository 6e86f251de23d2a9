"""The run config: the schema users read, and the loader that builds, validates and dumps it.

Usage:
    from dflashkit.config import RunConfig, load_config
    cfg = load_config("run.yaml", ["train.lr=3e-4", "drafter.block_size=8"])

- `schema.py`: the sections, every field with its default and help (docs/config.md is built from them).
- `loader.py`: strict build from YAML/dicts, dotted overrides, given keys, dump, section hashes,
  the docs reference (`python -m dflashkit.config > docs/config.md`).
- `validate.py`: every check of a built config, collected into one ConfigError (exit 2).

Every name is re-exported here: import from `dflashkit.config`, not from the modules.
"""

from __future__ import annotations

from dflashkit.config.loader import (
    config_from_dict,
    config_reference_markdown,
    config_to_dict,
    dump_config,
    flat_settings,
    given_keys,
    iter_fields,
    load_config,
    parse_override,
    redacted_dict,
    section_hash,
    set_given_keys,
)
from dflashkit.config.schema import (
    BenchSection,
    CaptureSection,
    DataSection,
    DrafterSection,
    EvalSection,
    ExportSection,
    GenerateSection,
    ParallelSection,
    RunConfig,
    RunSection,
    ServerSection,
    ServeSection,
    SourceSection,
    TargetSection,
    TokenizeSection,
    TrainSection,
    f,
    sub,
    url_fields,
)
from dflashkit.config.validate import (
    VARIANT_NAME,
    chat_template_problem,
    recipe_variant_problems,
    url_problem,
)
from dflashkit.config.validate import problems as config_problems
from dflashkit.redact import redact_text, redact_url

__all__ = [
    "BenchSection", "CaptureSection", "DataSection", "DrafterSection", "EvalSection", "ExportSection",
    "GenerateSection", "ParallelSection", "RunConfig", "RunSection", "ServeSection", "ServerSection",
    "SourceSection", "TargetSection", "TokenizeSection", "TrainSection", "VARIANT_NAME", "chat_template_problem",
    "config_from_dict", "config_problems", "config_reference_markdown", "config_to_dict", "dump_config", "f",
    "flat_settings",
    "given_keys", "iter_fields", "load_config", "parse_override", "recipe_variant_problems", "redact_text",
    "redact_url", "redacted_dict", "section_hash", "set_given_keys", "sub", "url_fields", "url_problem",
]
