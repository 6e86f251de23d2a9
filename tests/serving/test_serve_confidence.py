"""`serve.confidence_truncation`: a DSpark drafter served with verification truncated by its confidence head gives
the target's own greedy output while some steps verify fewer drafts; a drafter whose family has no confidence is
served at fixed B with a warning (as eval skips its `confident` rows), and a hot swap applies the rule to the
drafter it brings in; settings the rule cannot run with are refused before the model loads (exit 2, naming the
key)."""

from __future__ import annotations

import logging

import httpx
import pytest
import torch

from dflashkit.cli import main
from dflashkit.config import TargetSection, config_from_dict
from dflashkit.decode.draft_length import ConfidenceCut
from dflashkit.export.hf import save_drafter
from dflashkit.target.load import load_target
from dflashkit.serve_app import build_app
from dflashkit.testing import random_drafter
from tests.decode.test_confidence_cut import dspark, record_cuts
from tests.harness.servers import serving

MSGS = [{"role": "user", "content": "Count from one to twenty, please"}]


@pytest.fixture(scope="module")
def target(tiny_qwen3):
    return load_target(TargetSection(path=str(tiny_qwen3)))


def _reference(target, n: int) -> list[int]:
    tok = target.tokenizer
    text = tok.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    out = target.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=n, do_sample=False, eos_token_id=tok.eos_token_id,
                                pad_token_id=tok.pad_token_id)
    return out[0, len(ids):].tolist()


def test_a_dspark_drafter_served_with_truncation_gives_the_targets_greedy_output(tiny_qwen3, target, tmp_path,
                                                                                  monkeypatch):
    save_drafter(dspark(target), tmp_path / "dspark", dtype="float32")
    ref = _reference(target, 24)
    seen = record_cuts(monkeypatch)
    cfg = {"target": {"path": str(tiny_qwen3)},
           "serve": {"drafter": str(tmp_path / "dspark"), "confidence_truncation": True, "confidence_threshold": 0.5}}
    with serving(cfg) as (app, url):
        out = httpx.post(url + "/chat/completions", json={"messages": MSGS, "max_tokens": 24}, timeout=120).json()
        policy = app.engine.decoder.policy
    assert out["choices"][0]["token_ids"] == ref  # lossless: the cut only changes how many drafts a step verifies
    assert isinstance(policy, ConfidenceCut) and policy.threshold == 0.5 and policy.max_drafts == 3
    acc = out["usage"]["acceptance_lengths"]
    assert seen and any(k < len(conf) for conf, k in seen)  # some steps were cut short by the confidence head
    assert len(seen) >= len(acc) - 1 and all(a <= k + 1 for a, (_, k) in zip(acc, seen))


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_a_drafter_without_a_confidence_is_served_at_fixed_b_and_a_swap_applies_the_rule(tiny_qwen3, target,
                                                                                        tmp_path):
    save_drafter(random_drafter(target, block_size=4), tmp_path / "dflash", dtype="float32")
    save_drafter(dspark(target), tmp_path / "dspark", dtype="float32")
    logger, records = logging.getLogger("dflashkit.serve"), _Records()
    logger.addHandler(records)
    app = None
    try:
        app = build_app(config_from_dict({"target": {"path": str(tiny_qwen3)},
                                          "serve": {"drafter": str(tmp_path / "dflash"), "confidence_truncation": True,
                                                    "confidence_threshold": 0.7}}))
        assert app.engine.decoder.policy is None  # DFlash: fixed B, as eval decodes no `confident` row for it
        said = [m for m in records.messages if "serve.confidence_truncation" in m]
        assert said and "family dflash" in said[0] and "fixed block size 4" in said[0], records.messages
        app.swap_drafter(str(tmp_path / "dspark"))
        policy = app.engine.decoder.policy
        assert isinstance(policy, ConfidenceCut) and policy.threshold == 0.7
    finally:
        logger.removeHandler(records)
        if app is not None:
            app.engine.stop()


@pytest.mark.parametrize(("serve", "said"), [
    (["serve.proposer=suffix"], "serve.proposer is suffix"),
    ([], "serve.proposer is none"),
    (["serve.drafter={d}", "serve.proposer=hybrid"], "serve.proposer is hybrid"),
    (["serve.drafter={d}", "serve.adaptive_length=true"], "serve.adaptive_length"),
])
def test_truncation_where_it_cannot_run_is_refused_before_loading(tmp_path, capsys, serve, said):
    args = [a.format(d=tmp_path) for a in serve]
    assert main(["serve", str(tmp_path), "--dry-run", "serve.port=0", "serve.confidence_truncation=true", *args]) == 2
    err = capsys.readouterr().err
    assert "serve.confidence_truncation" in err and said in err, err[-2000:]
    assert main(["serve", str(tmp_path), "--dry-run", "serve.port=0", *args]) == 0  # the rest of it runs


def test_a_threshold_outside_0_1_is_a_config_error(tmp_path, capsys):
    assert main(["serve", str(tmp_path), "--dry-run", "serve.port=0", f"serve.drafter={tmp_path}",
                 "serve.confidence_truncation=true", "serve.confidence_threshold=1.5"]) == 2
    assert "serve.confidence_threshold: must be in [0, 1], got 1.5" in capsys.readouterr().err
