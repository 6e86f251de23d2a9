"""`python -m dflashkit.config > docs/config.md`: print the config reference generated from the schema."""

from dflashkit.config.loader import config_reference_markdown

print(config_reference_markdown(), end="")
