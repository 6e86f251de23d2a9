"""Read a target's files (config.json, GGUF header, tokenizer files) into plain facts.

Usage:
    from dflashkit.inspect.config_facts import read_model_facts
    facts = read_model_facts(Path("Qwen3-8B"))       # json only: no transformers, no weights
    from dflashkit.inspect.tokenizer_facts import read_tokenizer_facts
    tok = read_tokenizer_facts(Path("Qwen3-8B"))      # files only; `.check_load()` tries for real
    from dflashkit.inspect.contract import derive_contract
    contract = derive_contract(cfg.drafter, facts, tok)

`inspect.target.inspect_target` finds the files and reads them all (used by `probe`, `plan` and
`bench train`); `probe` writes the drafter contract, `plan` does the memory/disk math.
"""
