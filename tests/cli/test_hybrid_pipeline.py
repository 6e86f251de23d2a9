"""`generate` on a hybrid target (Qwen3-Next: Gated DeltaNet + full attention): the `dflashkit serve` it starts
answers every turn with the target's own greedy output (it used to fail every turn with HTTP 500)."""

from __future__ import annotations

import json

import torch

from dflashkit.cli import main
from dflashkit.config import TargetSection
from dflashkit.target.load import load_target
from tests.cli.test_generate_serve import CONVS, write_prepared
from tests.harness.hybrid import make_tiny_hybrid_target

MAX_TOKENS = 8


def test_generate_through_a_local_server_on_a_hybrid_target(tmp_path, capsys):
    target_dir = make_tiny_hybrid_target(tmp_path / "qwen3_next", "qwen3_next")
    run_dir = tmp_path / "run"
    write_prepared(run_dir)
    rc = main(["generate", f"run.run_dir={run_dir}", f"target.path={target_dir}", f"generate.max_tokens={MAX_TOKENS}",
               "generate.concurrency=4", "generate.progress=false", "serve.cpu_threads=1", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0, out
    assert out["generate"]["conversations_written"] == len(CONVS)
    rows = {r["id"]: r for r in map(json.loads, (run_dir / "generate" / "conversations.jsonl").read_text().splitlines())}
    # a single-turn conversation: its answer is the target's greedy continuation of the rendered prompt
    conv = next(c for c in CONVS if len(c["messages"]) == 1)
    target = load_target(TargetSection(path=str(target_dir), device="cpu", dtype="float32"))
    tok = target.tokenizer
    ids = tok.encode(tok.apply_chat_template(conv["messages"], tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)
    with torch.inference_mode():
        ref = target.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=tok.eos_token_id,
                                    pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
    assert rows[conv["id"]]["meta"]["token_ids"] == [ref]
