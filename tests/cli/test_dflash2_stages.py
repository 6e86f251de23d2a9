"""DFlash2 drafters through `eval`, `serve --drafter` and `bench decode`: lossless, walk-drafted."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dflashkit.cli import main
from dflashkit.config import TargetSection
from dflashkit.target.load import load_target
from tests.harness.servers import serving
from tests.helpers import run_dir_with_drafter

DFLASH2 = dict(drafter_type="dflash2", conv_group_size=16, selector_rank=8, selector_top_k=6)


@pytest.fixture(scope="module")
def target(tiny_qwen3):
    return load_target(TargetSection(path=str(tiny_qwen3), device="cpu", dtype="float32"))


def _run_dir(tmp_path, target):
    rd = run_dir_with_drafter(tmp_path, target, block_size=4, prompts=2, **DFLASH2)
    (rd / "tokenize").mkdir()
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, 259, 30).tolist() for _ in range(4)]
    pq.write_table(pa.table({"id": [f"s{i}" for i in range(4)], "input_ids": ids,
                             "loss_mask": [[0] * 10 + [1] * 20 for _ in ids]}), rd / "tokenize" / "shard-00000.parquet")
    return rd


def test_eval_and_bench_decode_take_a_dflash2_drafter(tmp_path, target, tiny_qwen3):
    rd = _run_dir(tmp_path, target)
    assert json.loads((rd / "train" / "final" / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    common = [f"target.path={tiny_qwen3}", "eval.max_new_tokens=12", "eval.warmup=0", "--run-dir", str(rd), "--json"]
    assert main(["eval", *common, "eval.block_sizes=[2,4]"]) == 0
    res = json.loads((rd / "eval" / "results.json").read_text())
    assert res["lossless"]["verdict"] == "exact"
    assert all(1 <= r["tau"] <= int(bs) for bs, r in res["speculative"].items())
    assert main(["bench", "decode", *common, "eval.num_prompts=1"]) == 0
    bench = json.loads((rd / "bench" / "decode.json").read_text())
    assert bench["drafter_type"] == "dflash2" and bench["identical_tokens"] is None and bench["tau"] >= 1
    # the suffix proposer and the hybrid grid beside it (eval.hybrid), lossless in eval and in the bench
    assert set(res["hybrid"]) == {"4@2", "4@4", "4@4+graft"}
    assert all(r["identical_to_baseline"] for r in [*res["suffix"].values(), *res["hybrid"].values()])
    assert set(bench["suffix"]) == {"4"} and set(bench["hybrid"]) == {"4@2", "4@4", "4@4+graft"}
    assert all(r["identical_tokens"] is True and 1 <= r["tau"] <= 4 for r in bench["hybrid"].values())


def test_serve_with_a_dflash2_drafter_is_lossless(tmp_path, target, tiny_qwen3):
    rd = run_dir_with_drafter(tmp_path, target, block_size=4, prompts=1, **DFLASH2)
    tok = target.tokenizer
    msgs = [{"role": "user", "content": "Hello, speculative world"}]
    ids = tok.encode(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)
    ref = target.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=16, do_sample=False, eos_token_id=tok.eos_token_id,
                                pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
    drafter = str(rd / "train" / "final")
    with serving({"target": {"path": str(tiny_qwen3)}, "serve": {"drafter": drafter}}) as (_, url):
        out = httpx.post(url + "/chat/completions", json={"messages": msgs, "max_tokens": 16}, timeout=120).json()
    assert out["choices"][0]["token_ids"] == ref
    assert all(1 <= a <= 4 for a in out["usage"]["acceptance_lengths"])
