"""Golden loss masks on the real Qwen3, Llama-3 and SmolLM2 tokenizers/templates, policies, and a
slow-loop oracle vs the fast batched builder on random conversations."""

from __future__ import annotations

import random
import zlib

import numpy as np
import pytest

from dflashkit.data.chat import ChatTemplate, build_samples
from dflashkit.data.records import Conversation


@pytest.fixture(scope="module")
def toks():
    from transformers import AutoTokenizer

    from dflashkit.assets import asset_path

    return {name: AutoTokenizer.from_pretrained(asset_path(name))
            for name in ("tokenizer-qwen3", "tokenizer-llama3", "smollm2-135m-instruct")}


def conv(*turns, system=None, meta=None):
    msgs = [{"role": "system", "content": system}] if system else []
    for i, t in enumerate(turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    c = Conversation.from_messages("t", msgs)
    c.meta = meta or {}
    return c


def spans(tok, sample):
    """Decoded maximal runs of supervised tokens."""
    out, cur = [], []
    for t, m in zip(sample.input_ids.tolist(), sample.loss_mask.tolist()):
        if m:
            cur.append(t)
        elif cur:
            out.append(tok.decode(cur))
            cur = []
    if cur:
        out.append(tok.decode(cur))
    return out


def run(tok, c, kwargs=None, **policy):
    chat = ChatTemplate(tok, kwargs=kwargs)
    plans, counts = chat.plan(c, thinking=policy.get("thinking", "keep"),
                              system_prompt=policy.get("system_prompt", "keep"))
    samples, checks = build_samples(tok, plans, max_length=policy.get("max_length", 4096),
                                    thinking=policy.get("thinking", "keep"))
    for s in samples:  # decoding the whole sample reproduces the rendered text
        assert tok.decode(s.input_ids.tolist()) == next(p.text for p in plans if p.id == s.id)
    return samples, counts, checks


TWO = ("What is the capital of France?", "Paris.", "And of Germany?", "Berlin.")
THREE = TWO + ("And of Italy?", "Rome.")


def test_smollm2_default_system_prompt(toks):
    tok = toks["smollm2-135m-instruct"]
    (s,), _, _ = run(tok, conv(*TWO))
    text = tok.decode(s.input_ids.tolist())
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert spans(tok, s) == ["Paris.<|im_end|>", "Berlin.<|im_end|>"]
    # the header and the "\n" after <|im_end|> are not supervised; the sample ends at the last answer
    assert tok.decode(s.input_ids[-1:].tolist()) == "<|im_end|>" and s.loss_mask[-1] == 1


def test_llama3_masks_eot_not_header(toks):
    tok = toks["tokenizer-llama3"]
    (s,), counts, _ = run(tok, conv(*THREE, system="Be brief."))
    assert spans(tok, s) == ["Paris.<|eot_id|>", "Berlin.<|eot_id|>", "Rome.<|eot_id|>"]
    # the template always appends an assistant header; it must not survive at the end
    assert tok.decode(s.input_ids.tolist()).endswith("<|end_header_id|>\n\nRome.<|eot_id|>")
    assert tok.decode(s.input_ids[:1].tolist()) == "<|begin_of_text|>"
    assert counts["samples"] == 1 and not counts["turns_rewritten"]


def test_qwen3_thinking_off_multi_turn(toks):
    tok = toks["tokenizer-qwen3"]
    samples, counts, _ = run(tok, conv(*THREE), kwargs={"enable_thinking": False})
    # Qwen3 renders earlier answers without the empty think block the generation prompt adds,
    # so each turn gets the exact prompt it was generated from: one sample per turn.
    assert [spans(tok, s) for s in samples] == [["Paris.<|im_end|>"], ["Berlin.<|im_end|>"], ["Rome.<|im_end|>"]]
    assert counts["turns_rewritten"] == 3 and len({s.id for s in samples}) == 3
    last = tok.decode(samples[-1].input_ids.tolist())
    assert last.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nRome.<|im_end|>")
    assert "assistant\nParis.<|im_end|>" in last  # earlier turn as the template rewrites it (context)


def test_qwen3_rewritten_turns_drop(toks):
    tok = toks["tokenizer-qwen3"]
    chat = ChatTemplate(tok, kwargs={"enable_thinking": False})
    plans, counts = chat.plan(conv(*THREE), rewritten_turns="drop")
    (s,), _ = build_samples(tok, plans, max_length=4096)
    assert spans(tok, s) == ["Rome.<|im_end|>"] and counts["turns_rewritten"] == 2


def test_qwen3_thinking_on(toks):
    tok = toks["tokenizer-qwen3"]
    c = conv("What is 2+2?", "<think>\nAdd two and two.\n</think>\n\n4.")
    (s,), _, _ = run(tok, c)
    assert spans(tok, s) == ["<think>\nAdd two and two.\n</think>\n\n4.<|im_end|>"]
    (s,), _, _ = run(tok, c, thinking="mask")
    assert spans(tok, s) == ["4.<|im_end|>"]
    assert "Add two and two." in tok.decode(s.input_ids.tolist())  # kept in the input, loss 0
    (s,), _, _ = run(tok, c, thinking="strip")
    assert spans(tok, s) == ["<think>\n\n</think>\n\n4.<|im_end|>"]  # the template's own empty block
    assert "Add two" not in tok.decode(s.input_ids.tolist())


def test_qwen3_thinking_on_multi_turn_drops_earlier_think(toks):
    tok = toks["tokenizer-qwen3"]
    c = conv("Capital of France?", "<think>\nFrance: Paris.\n</think>\n\nParis.",
             "And Germany?", "<think>\nGermany: Berlin.\n</think>\n\nBerlin.")
    samples, counts, _ = run(tok, c)
    assert [spans(tok, s) for s in samples] == [
        ["<think>\nFrance: Paris.\n</think>\n\nParis.<|im_end|>"],
        ["<think>\nGermany: Berlin.\n</think>\n\nBerlin.<|im_end|>"]]
    last = tok.decode(samples[1].input_ids.tolist())
    assert "France: Paris." not in last and "<|im_start|>assistant\nParis.<|im_end|>" in last
    assert counts["turns_rewritten"] == 1


def test_system_drop_and_length_cut(toks):
    tok = toks["smollm2-135m-instruct"]
    c = conv(*TWO, system="Only ever answer in French.", meta={"finish_reasons": ["stop", "length"]})
    (s,), _, _ = run(tok, c, system_prompt="drop")
    text = tok.decode(s.input_ids.tolist())
    assert "French" not in text and "named SmolLM" in text
    # the second answer was cut by max_tokens: the appended <|im_end|> was never produced
    assert spans(tok, s) == ["Paris.<|im_end|>", "Berlin."]


def test_truncation_keeps_prefix(toks):
    tok = toks["tokenizer-llama3"]
    (full,), _, _ = run(tok, conv(*TWO))
    chat = ChatTemplate(tok)
    plans, _ = chat.plan(conv(*TWO))
    (cut,), _ = build_samples(tok, plans, max_length=len(full.input_ids) - 3)
    assert cut.truncated and np.array_equal(cut.input_ids, full.input_ids[:-3])
    assert np.array_equal(cut.loss_mask, full.loss_mask[:-3])


def test_server_token_ids_checked_and_used(toks):
    tok = toks["smollm2-135m-instruct"]
    good = tok.encode("Paris.", add_special_tokens=False)  # server ids without the stop token
    bad = tok.encode("Paris!!", add_special_tokens=False) + tok.encode("<|im_end|>", add_special_tokens=False)
    (s,), _, checks = run(tok, conv(*TWO, meta={"token_ids": [good, None]}))
    assert {k: checks[k] for k in ("server_turns", "server_mismatches", "first_mismatch")} == \
        {"server_turns": 1, "server_mismatches": 0, "first_mismatch": None}
    assert spans(tok, s) == ["Paris.<|im_end|>", "Berlin.<|im_end|>"]
    chat = ChatTemplate(tok)
    plans, _ = chat.plan(conv(*TWO, meta={"token_ids": [bad, None]}))
    (s,), checks = build_samples(tok, plans, max_length=4096)
    assert checks["server_mismatches"] == 1 and checks["first_mismatch"]["turn"] == 0
    assert "!!" in checks["first_mismatch"]["server"]
    assert spans(tok, s) == ["Paris!!<|im_end|>", "Berlin.<|im_end|>"]


# ------------------------------------------------------------------------------------------
# Slow-loop oracle vs the fast batched builder
# ------------------------------------------------------------------------------------------

WORDS = ["the", "Paris", "naïve", "ÜBER", "数据", "🙂", "def f(x):", "    return x", "\n", "\n\n", "  ",
         "1234", "3.14", "-", "**bold**", "`code`", "a,b", "Hello!", "tab\t", "{\"k\": 1}", "'", "x"]


def rand_text(rng, n=None):
    return "".join(rng.choice(WORDS) + rng.choice(["", " ", "\n"]) for _ in range(n or rng.randint(1, 12)))


def rand_conv(rng, think):
    turns = []
    for _ in range(rng.randint(1, 3)):
        answer = rand_text(rng).strip() or "ok"
        if think and rng.random() < 0.5:
            answer = f"<think>\n{rand_text(rng).strip() or 'hm'}\n</think>\n\n{answer}"
        turns += [rand_text(rng).strip() or "hi", answer]
    return conv(*turns, system=rand_text(rng).strip() or None if rng.random() < 0.5 else None)


def oracle(tok, c, kwargs, thinking):
    """Per-character spec with loops: public apply_chat_template, char-by-char terminator scan,
    one tokenizer call per constant-mask run."""
    specials = [t.content for t in tok.added_tokens_decoder.values() if t.special]
    msgs = c.messages
    render = lambda m, g: tok.apply_chat_template(m, tokenize=False, add_generation_prompt=g, **kwargs)  # noqa: E731
    info = {}
    for j, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        p, f = render(msgs[:j], True), render(msgs[:j + 1], False)
        if not f.startswith(p):
            continue
        ans = f[len(p):]
        tail = m["content"].strip()[-32:]
        start = ans.rfind(tail) + len(tail) if tail in ans else 0
        end = None
        for pos in range(start, len(ans)):
            hit = [s for s in specials if ans.startswith(s, pos)]
            if hit:
                end = pos + max(map(len, hit))
                break
        info[j] = (p, ans[:end] if end else ans.rstrip())
    out = []
    todo = sorted(info)
    while todo:
        text = render(msgs[:todo[-1] + 1], False)
        charmask = [0] * len(text)
        done, cursor, stop = [], 0, 0
        for j in todo:
            p, a = info[j]
            if len(p) >= cursor and text.startswith(p) and text[len(p):len(p) + len(a)] == a:
                for k in range(len(p), len(p) + len(a)):
                    charmask[k] = 1
                if thinking == "mask" and "</think>" in a:
                    e = a.index("</think>") + len("</think>")
                    while e < len(a) and a[e].isspace():
                        e += 1
                    s0 = a.find("<think>")
                    for k in range(len(p) + max(s0, 0), len(p) + e):
                        charmask[k] = 0
                cursor = stop = len(p) + len(a)
                done.append(j)
        ids, mask, k = [], [], 0
        while k < stop:
            e = k
            while e < stop and charmask[e] == charmask[k]:
                e += 1
            piece = tok.encode(text[k:e], add_special_tokens=False)
            ids += piece
            mask += [charmask[k]] * len(piece)
            k = e
        out.append((ids, mask))
        todo = [j for j in todo if j not in done]
    return out[::-1]


@pytest.mark.parametrize("name,kwargs,thinking", [
    ("smollm2-135m-instruct", {}, "keep"),
    ("tokenizer-llama3", {}, "mask"),
    ("tokenizer-qwen3", {}, "keep"),
    ("tokenizer-qwen3", {"enable_thinking": False}, "mask"),
])
def test_oracle_matches_fast_builder(toks, name, kwargs, thinking):
    tok = toks[name]
    rng = random.Random(zlib.crc32(f"{name}{kwargs}{thinking}".encode()))
    chat = ChatTemplate(tok, kwargs=kwargs)
    convs = [rand_conv(rng, think=name == "tokenizer-qwen3") for _ in range(12)]
    plans = [p for c in convs for p in chat.plan(c, thinking=thinking)[0]]
    samples, _ = build_samples(tok, plans, max_length=1 << 20, thinking=thinking)
    expected = [x for c in convs for x in oracle(tok, c, kwargs, thinking)]
    assert len(samples) == len(expected) >= 8  # enable_thinking=False + a think answer: no sample
    for s, (ids, mask) in zip(samples, expected):
        assert s.input_ids.tolist() == ids, s.id
        assert s.loss_mask.tolist() == mask, s.id
        assert 0 < s.loss_mask.sum() < len(mask)
