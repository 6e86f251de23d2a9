"""Serving engines run beside dflashkit from their own environments (`engines/vllm.py`), and the
check that an exported drafter behaves the same in an engine as in our decoder (`engines/verify.py`)."""
