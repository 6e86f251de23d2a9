"""`dflashkit bench train`: one drafter training step vs the target's forward on the same batch.

Usage:
    dflashkit bench train -c run.yaml                 # contract.json if probed, else derived here
    dflashkit bench train -c run.yaml 10              # 10 timed iterations (after 2 warm-up ones)

Measured in one process, warm-up excluded, each number the median of the timed iterations:
  * target_forward_s — full target forward (logits) on the batch;
  * features_s — the online feature pass (taps only, stops after the deepest tapped layer), with
    `train.target_dtype`'s autocast; features_{float32,bf16_autocast}_s time both when they differ;
  * drafter_step_s — drafter forward + chunked loss + backward + AdamW step (features given);
  * online_step_s = features_s + drafter_step_s (what a `train.features=online` step costs);
  * context_tokens_per_s — sequence tokens through the whole online step, and the split
    (features_share / drafter_share of the step);
  * ratios drafter_step / target_forward and online_step / target_forward (goal: drafter ≤ 1.5×);
  * tokens/s and anchors/s of the online step; on CPU the drafter step also with bf16 autocast;
  * the CPU model and its bf16 instructions (avx512_bf16, amx_bf16).
The batch is the first `train.batch_size` tokenized samples when `tokenize/` exists, else random
token ids of length min(tokenize.max_length, 512) with the last 3/4 supervised. With
`drafter.draft_vocab_size` the drafter step uses a reduced draft vocab (chosen from that batch's
label tokens, as training would from the whole data), so its saving on the vocab projection shows.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from dflashkit.family.contract import REPROBE_HINT
from dflashkit.inspect.contract import run_contract
from dflashkit.train.data import collate, load_tokenized, tokenized_shards
from dflashkit.sizing.step_probe import drafter_step
from dflashkit.timing import median_time

if TYPE_CHECKING:
    from dflashkit.config import RunConfig
    from dflashkit.context import StageContext
    from dflashkit.rundir import RunDir

log = logging.getLogger("dflashkit.bench")


def _batch(cfg: RunConfig, rd: RunDir, target: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    bs = cfg.train.batch_size
    if tokenized_shards(rd):
        data = load_tokenized(rd)
        b = collate(data, [(i, 0) for i in range(min(bs, len(data)))], run_seed=cfg.run.seed)
        return b.input_ids, b.loss_mask, b.seq_lens
    s = min(cfg.tokenize.max_length, 512)
    vocab = len(target.tokenizer) if target.tokenizer is not None else target.vocab_size
    ids = torch.randint(0, min(vocab, target.vocab_size), (bs, s), generator=torch.Generator().manual_seed(0))
    lm = torch.zeros(bs, s, dtype=torch.long)
    lm[:, s // 4:] = 1
    return ids, lm, torch.full((bs,), s)


def bench_train(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict:
    """Measure one training step (see the module docstring); returns the numbers."""
    from dflashkit.target.load import cpu_facts, load_target, target_autocast

    iters = int(ctx.positionals[1]) if len(ctx.positionals) > 1 else 5
    target = load_target(cfg.target)
    contract = run_contract(cfg, rd)
    contract.check(target, where=str(rd.contract_path), hint=REPROBE_HINT)
    dev = target.device
    ids, lm, lens = (t.to(dev) for t in _batch(cfg, rd, target))
    att = (torch.arange(ids.shape[1], device=dev)[None] < lens[:, None]).long()
    layer_ids = contract.target_layer_ids
    with torch.no_grad():
        feats = target.features(ids, layer_ids=layer_ids, attention_mask=att).float()
    step = drafter_step(cfg.train, contract, target, ids, lm, lens, feats,
                        draft_vocab_size=cfg.drafter.draft_vocab_size, seed=cfg.run.seed)

    def target_forward():
        with torch.no_grad():
            target.model(input_ids=ids, attention_mask=att)

    tamp = target_autocast(cfg.train.target_dtype, dev, target.dtype)

    def features(dtype=tamp):
        with torch.no_grad(), torch.autocast(dev.type, dtype=dtype, enabled=dtype is not None):
            target.features(ids, layer_ids=layer_ids, attention_mask=att)

    amp = step.amp
    for fn in (target_forward, features, step):
        median_time(fn, dev, 2)  # warm-up
    t_target = median_time(target_forward, dev, iters)
    t_feat = median_time(features, dev, iters)
    t_draft = median_time(step, dev, iters)
    tokens, blocks = int(lens.sum()), int(step.anchors.keep.sum())
    t_step = t_feat + t_draft
    result = {
        "device": str(dev), **(cpu_facts() if dev.type == "cpu" else {}), "threads": torch.get_num_threads(),
        "target": str(target.model_dir), "batch_size": int(ids.shape[0]),
        "seq_len": int(ids.shape[1]), "tokens": tokens, "anchors": blocks, "block_size": contract.block_size,
        "draft_layers": contract.num_draft_layers, "iters": iters, "autocast": str(amp) if amp else None,
        "target_autocast": str(tamp) if tamp else None, "vocab_projected": int(step.head.weight.shape[0]),
        "target_forward_s": round(t_target, 5), "features_s": round(t_feat, 5), "drafter_step_s": round(t_draft, 5),
        "online_step_s": round(t_step, 5),
        "context_tokens_per_s": round(tokens / t_step, 1),
        "features_share": round(t_feat / t_step, 3), "drafter_share": round(t_draft / t_step, 3),
        "drafter_over_target_forward": round(t_draft / t_target, 3),
        "online_over_target_forward": round(t_step / t_target, 3),
        "tokens_per_s": round(tokens / t_step, 1), "anchors_per_s": round(blocks / t_step, 1),
        "goal_drafter_le_1_5x": t_draft / t_target <= 1.5,
    }
    if target.dtype == torch.float32:  # the other choice of train.target_dtype, timed for comparison
        other = torch.bfloat16 if tamp is None else None
        median_time(lambda: features(other), dev, 1)
        t_other = median_time(lambda: features(other), dev, iters)
        fp32, bf16 = (t_feat, t_other) if tamp is None else (t_other, t_feat)
        result.update({"features_float32_s": round(fp32, 5), "features_bf16_autocast_s": round(bf16, 5),
                       "context_tokens_per_s_bf16_target": round(tokens / (bf16 + t_draft), 1)})
    if dev.type == "cpu" and amp is None:
        median_time(lambda: step.run(torch.bfloat16), dev, 1)
        result["drafter_step_bf16_autocast_s"] = round(median_time(lambda: step.run(torch.bfloat16), dev, iters), 5)
    if not ctx.json:
        for k, v in result.items():
            print(f"{k:>30}  {v}")
    return result
