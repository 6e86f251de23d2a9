"""Helpers that build a real run dir (contract + tokenized Parquet shards) for a tiny target, and
tests of the deterministic data plan."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dflashkit.model.drafter_config import DrafterContract, build_target_layer_ids
from dflashkit.model.target import text_config_dict
from dflashkit.train.data import BatchPlan, split_heldout

TEXTS = [
    ("What is two plus two?", "Two plus two is four. Four is an even number."),
    ("Name a color.", "Blue is a color, and so is red."),
    ("Say hello.", "Hello! Nice to meet you, have a good day."),
    ("Count to five.", "One, two, three, four, five."),
    ("What is the sky?", "The sky is the air above us, often blue in the day."),
    ("Spell cat.", "C, A, T spells cat."),
    ("Give a fruit.", "An apple is a fruit; so is a pear."),
    ("Is ice cold?", "Yes, ice is cold because it is frozen water."),
]


def make_contract(target_dir: Path, *, block_size: int = 4, num_draft_layers: int = 1, n_feat: int = 2,
                  mask_token_id: int = 300, **over) -> DrafterContract:
    cfg = text_config_dict(Path(target_dir))
    layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    c = DrafterContract(block_size=block_size, num_draft_layers=num_draft_layers,
                        target_layer_ids=build_target_layer_ids(layers, n_feat), mask_token_id=mask_token_id,
                        num_target_layers=layers, hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=hidden // 4, intermediate_size=2 * hidden, vocab_size=cfg["vocab_size"],
                        rope_theta=10000.0)
    for k, v in over.items():
        setattr(c, k, v)
    return c


def tokenize_texts(target_dir: Path, texts=TEXTS) -> list[dict]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    rows = []
    for i, (q, a) in enumerate(texts):
        prompt = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        p_ids = tok.encode(prompt, add_special_tokens=False)
        a_ids = tok.encode(a + "<|im_end|>", add_special_tokens=False)
        rows.append({"id": f"{i:016x}", "input_ids": p_ids + a_ids, "loss_mask": [0] * len(p_ids) + [1] * len(a_ids)})
    return rows


def write_shards(run_dir: Path, rows: list[dict], per_shard: int = 4) -> list[Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(run_dir) / "tokenize"
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for si in range(0, len(rows), per_shard):
        part = rows[si:si + per_shard]
        table = pa.table({"id": pa.array([r["id"] for r in part], pa.string()),
                          "input_ids": pa.array([r["input_ids"] for r in part], pa.list_(pa.int32())),
                          "loss_mask": pa.array([r["loss_mask"] for r in part], pa.list_(pa.int8()))})
        p = out / f"shard-{si // per_shard:05d}.parquet"
        pq.write_table(table, p)
        paths.append(p)
    return paths


def make_run(run_dir: Path, target_dir: Path, *, texts=TEXTS, contract: DrafterContract | None = None,
             **contract_kw) -> Path:
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    c = contract or make_contract(target_dir, **contract_kw)
    (run_dir / "contract.json").write_text(json.dumps(c.to_dict()))
    write_shards(run_dir, tokenize_texts(target_dir, texts))
    return run_dir


def overrides(run_dir: Path, target_dir: Path, **train) -> list[str]:
    base = {"run.run_dir": str(run_dir), "target.path": str(target_dir), "train.batch_size": 2,
            "train.max_steps": 4, "train.heldout_samples": 2, "train.lr": 3e-3, "train.warmup_ratio": 0.0,
            "train.log_every": 1, "train.eval_every": 0, "train.save_every": 0, "train.num_anchors": 8}
    base.update({k.replace("__", "."): v for k, v in train.items()})
    return [f"{k}={json.dumps(v) if isinstance(v, (list, dict)) else v}" for k, v in base.items()]


def test_global_batch_same_for_any_world_size():
    idx, held = split_heldout(20, 4, seed=3)
    assert len(held) == 4 and not set(idx) & set(held)
    one = BatchPlan(idx, batch_size=4, grad_accum=1, world=1, seed=3)
    two = BatchPlan(idx, batch_size=2, grad_accum=1, world=2, seed=3)
    acc = BatchPlan(idx, batch_size=1, grad_accum=2, world=2, seed=3)
    for step in range(9):  # crosses epoch boundaries
        g1 = sorted(sum(one.micro_batches(step, 0), []))
        g2 = sorted(sum(two.micro_batches(step, 0) + two.micro_batches(step, 1), []))
        g3 = sorted(sum(acc.micro_batches(step, 0) + acc.micro_batches(step, 1), []))
        assert g1 == g2 == g3
    seen = [i for s in range(4) for m in one.micro_batches(s, 0) for i, e in m if e == 0]
    assert sorted(seen) == sorted(idx)  # one epoch = every training sample once
    assert np.unique([len(m) for m in one.micro_batches(0, 0)]).tolist() == [4]
