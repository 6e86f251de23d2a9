"""dflashkit: train and prove DFlash block-diffusion speculative-decoding drafters.

Usage:
    dflashkit probe path/to/model --json
    dflashkit run -c configs/smollm2-135m.yaml

Importing ``dflashkit`` must stay cheap: torch and transformers are imported inside commands.
"""

__version__ = "0.1.0"
