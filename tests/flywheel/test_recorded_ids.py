"""`learn` trains on the target's own tokens: a recorded reply's `completion_token_ids` become its labels, through
`to_conversation` → `write_conversations` → the round's tokenize; ids that spell another text fall back to the
reply's text, counted and warned."""

from __future__ import annotations

import logging

import numpy as np
from transformers import AutoTokenizer

from dflashkit.config import load_config
from dflashkit.data.chat import load_chat
from dflashkit.data.shards import load_tokenized
from dflashkit.flywheel.rounds import _tokenize
from dflashkit.flywheel.traffic import to_conversation
from dflashkit.generate.conversations import regenerated_file, write_conversations
from dflashkit.rundir import RunDir


def _record(rid, question, answer, ids):
    return {"id": rid, "v": 1, "time": 1000.0, "endpoint": "chat", "target": {"fingerprint": "fp", "how": "files"},
            "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
            "completion_token_ids": ids}


def _charwise(tok, text):
    """Ids that decode to `text` but tokenize it one character at a time (not how the tokenizer would)."""
    return [i for ch in text for i in tok.encode(ch, add_special_tokens=False)]


def test_learn_labels_are_the_recorded_completion_ids(smollm2_dir, tmp_path, caplog):
    cfg = load_config(None, [f"target.path={smollm2_dir}", f"run.run_dir={tmp_path}", "tokenize.workers=1",
                             "tokenize.min_supervised=1"])
    tok = AutoTokenizer.from_pretrained(smollm2_dir)  # a BPE: merges make ids differ
    chat = load_chat(cfg)
    question, answer = "What is two plus two?", "Two plus two is four, an even number."
    msgs = to_conversation(_record("x", question, answer, None))["messages"]
    prompt, full = chat.render(msgs[:-1], add_generation_prompt=True), chat.render(msgs)
    span, found = chat.answer_span(full[len(prompt):], msgs[-1])
    assert found and chat.end_token and span.endswith(chat.end_token)
    eot = tok.convert_tokens_to_ids(chat.end_token)
    recorded = _charwise(tok, span[:-len(chat.end_token)]) + [eot]  # the stop token included, as servers record
    assert recorded != tok.encode(span, add_special_tokens=False)  # re-tokenizing the text gives other ids
    wrong = _charwise(tok, "Five.") + [eot]  # spells another reply: not the rendering's tokens
    rd = RunDir(tmp_path)
    write_conversations(rd.generate_dir, [to_conversation(_record("same", question, answer, recorded)),
                                          to_conversation(_record("other", question, answer, wrong))])
    with caplog.at_level(logging.WARNING, logger="dflashkit.tokenize"):
        res = _tokenize(cfg, rd, regenerated_file(rd))
    data = load_tokenized(rd)
    labels = {sid: ids[mask.astype(bool)].tolist() for sid, ids, mask in zip(data.ids, data.input_ids, data.loss_mask)}
    assert labels["same"] == recorded
    assert labels["other"] == tok.encode(span, add_special_tokens=False)  # the text, as the template renders it
    assert res["recorded_ids"] == {"used": 1, "unlike_text_tokens": 1, "disagree_text_used": 1}
    assert "1 recorded replies' completion_token_ids do not spell the reply" in caplog.text
    i = data.ids.index("same")
    assert tok.decode(data.input_ids[i].tolist()) == full[:len(prompt) + len(span)]  # the same text, the target's ids
    assert np.all(data.loss_mask[i][:len(tok.encode(prompt, add_special_tokens=False))] == 0)
