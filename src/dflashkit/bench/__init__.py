"""The benchmarks behind `dflashkit bench SUBJECT` (one module per subject; `stages/bench.py` dispatches).

    generate.py   the generate client's req/s and CPU per request against a zero-latency server
    serve.py      concurrency sweeps over one or two OpenAI-compatible endpoints
    tokenize.py   the tokenize stage's samples/s vs the raw batched tokenizer
    train.py      a drafter training step vs the target forward
    decode.py     speculative decoding vs block_size=1 vs the reference dflash_generate
    suffix.py     the suffix proposer's index and per-step cost at long contexts, prompt lookup beside it
    recipe.py     short training runs of recipe variants on a run's data (held-out τ, acc@1, bigram)
    results.py    `bench/<subject>.json`: its writer (the bench stage) and reader (report)
"""
