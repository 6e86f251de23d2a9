"""Overfitting ONE conversation drives simulated τ to ≥ 0.9·B, and the trained drafter, called the
way inference calls it (context = features before the anchor, block [x_a, MASK…], no mask), then
predicts the tokens at the SAME positions a+1…a+B−1 — this fails for shifted labels."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dflashkit.cli import main
from dflashkit.config import load_config
from dflashkit.model.drafter import DFlashDraftModel
from dflashkit.family.contract import DrafterContract
from dflashkit.target.load import load_target
from dflashkit.train.data import load_tokenized
from dflashkit.rundir import RunDir
from tests.helpers import TEXTS, make_run, overrides


@pytest.mark.slow  # a 150-step CLI training run
def test_overfit_one_conversation(tmp_path, tiny_qwen3):
    B = 4
    rd = make_run(tmp_path / "r", tiny_qwen3, texts=TEXTS[:1], block_size=B)
    ov = overrides(rd, tiny_qwen3, train__max_steps=150, train__batch_size=1, train__lr=1.5e-2, train__min_lr_ratio=0.1,
                   train__num_anchors=64, train__heldout_samples=0, train__log_every=10, train__warmup_ratio=0.05)
    assert main(["train", "--json", *ov]) == 0
    last = json.loads((rd / "train" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["tau"] >= 0.9 * B, last

    contract = DrafterContract.load(rd / "contract.json")
    drafter = DFlashDraftModel(contract).eval()
    drafter.load_state_dict(load_file(rd / "train" / "final" / "model.safetensors"))
    target = load_target(load_config(None, ov).target)
    data = load_tokenized(RunDir(rd))
    ids = torch.from_numpy(data.input_ids[0])[None]
    mask = data.loss_mask[0]
    feats = target.features(ids, layer_ids=contract.target_layer_ids)
    same = shifted = n = 0
    with torch.no_grad():
        for a in range(1, ids.shape[1] - B):
            if not (mask[a] and mask[a + 1]):
                continue
            block = torch.tensor([[ids[0, a].item()] + [contract.mask_token_id] * (B - 1)])
            h = drafter(target.embed(block), feats[:, :a], torch.arange(a + B)[None])
            draft = target.lm_head(h[:, 1:]).argmax(-1)[0]
            same += int(torch.equal(draft, ids[0, a + 1:a + B]))
            shifted += int(torch.equal(draft[:-1], ids[0, a + 2:a + B]))
            n += 1
    assert n > 10 and same / n >= 0.9, (same, n)
    assert shifted / n < 0.5, (shifted, n)
