"""`python -m dflashkit.config > docs/config.md`: print the config reference generated from the schema."""

from dflashkit import family
from dflashkit.config.loader import config_reference_markdown

family.load_plugins()  # the installed plugin families' keys are documented too
print(config_reference_markdown(), end="")
