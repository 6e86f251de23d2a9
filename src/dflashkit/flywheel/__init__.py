"""The flywheel: learn from served traffic (`traffic`: records → conversations, cursor, fingerprint), one round
of fine-tune / paired score / promote (`rounds`), and the promotion pointer `serve` watches (`pointer`).
Ranked above the library it composes (train, decode, export, sizing) and below serve_app (tests/test_layering.py)."""
