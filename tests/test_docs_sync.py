"""docs/config.md lists every config key exactly as the schema defines it."""

from pathlib import Path

from dflashkit.config import config_reference_markdown, iter_fields

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def test_config_reference_is_in_sync():
    text = DOC.read_text()
    missing = [k for k, *_ in iter_fields() if f"`{k}`" not in text]
    assert not missing, f"docs/config.md lacks {missing}; run `python -m dflashkit.config > docs/config.md`"
    assert text == config_reference_markdown(), "docs/config.md is stale: python -m dflashkit.config > docs/config.md"
