"""Loss masks of agent conversations: the target's template renders the tools, tool calls and tool results
(the real Qwen3 template; a Kimi-K2-style one), the assistant's content, thinking (per policy) and tool-call
tokens are supervised, declarations and results never; a slow oracle that renders turn by turn agrees; a
template that cannot render tools is refused (exit 2) before anything is tokenized."""

from __future__ import annotations

import copy
import json
import re

import pytest
import yaml

from dflashkit.cli import main
from dflashkit.data.chat import ChatTemplate, build_samples
from dflashkit.data.records import Conversation, write_jsonl
from tests.helpers import tokenized_rows

POLICIES = ("keep", "mask", "strip")
THINK = re.compile(r"<think>.*?</think>\s*", re.S)
EOT = "<|im_end|>"  # both templates below end a turn with it
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

# Kimi K2's tool-call format (Moonshot's docs/tool_call_guidance.md): tools in a `tool_declare` turn as
# compact JSON, calls in a tool-calls section after the content (thinking may precede it directly), each
# result its own turn, `<|im_end|>` closing every turn.
KIMI_TEMPLATE = """\
{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>{%- endif -%}
{%- for message in messages -%}
{%- if loop.first and message.role != 'system' -%}\
<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>{%- endif -%}
{%- set role_name = message.name or message.role -%}
{%- if message.role == 'user' -%}<|im_user|>{{ role_name }}<|im_middle|>\
{%- elif message.role == 'assistant' -%}<|im_assistant|>{{ role_name }}<|im_middle|>\
{%- else -%}<|im_system|>{{ role_name }}<|im_middle|>{%- endif -%}
{%- if message.role == 'assistant' and message.tool_calls -%}{{ message.content }}<|tool_calls_section_begin|>
{%- for call in message.tool_calls -%}<|tool_call_begin|>{{ call.id }}<|tool_call_argument_begin|>\
{{ call.function.arguments }}<|tool_call_end|>{%- endfor -%}<|tool_calls_section_end|>
{%- elif message.role == 'tool' -%}## Return of {{ message.tool_call_id }}
{{ message.content }}
{%- else -%}{{ message.content }}{%- endif -%}<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"""
KIMI_SPECIALS = ["<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", "<|tool_calls_section_begin|>",
                 "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
                 "<|tool_call_end|>"]
ROLE_CONTENT = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def call(cid: str, city: str) -> dict:
    return {"id": cid, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}


def agent_convs(ids: tuple[str, ...] = ("call_1", "call_2", "call_3", "call_4")) -> list[Conversation]:
    """Parallel calls + their results + a final answer; two rounds (the first loses its thinking in the
    second's rendering on Qwen3); one ending on a call."""
    a, b, c, d = ids
    parallel = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "Weather in Paris and Rome?"},
                {"role": "assistant", "content": "<think>\nTwo cities: two calls.\n</think>\n\n",
                 "tool_calls": [call(a, "Paris"), call(b, "Rome")]},
                {"role": "tool", "tool_call_id": a, "name": "get_weather", "content": "Paris: 18 C, sunny"},
                {"role": "tool", "tool_call_id": b, "name": "get_weather", "content": "Rome: 24 C, cloudy"},
                {"role": "assistant", "content": "<think>\nBoth results are in.\n</think>\n\nParis 18 C, Rome 24 C."}]
    rounds = [{"role": "user", "content": "Weather in Oslo?"},
              {"role": "assistant", "content": "<think>\nOne call.\n</think>\n\n", "tool_calls": [call(c, "Oslo")]},
              {"role": "tool", "tool_call_id": c, "name": "get_weather", "content": "Oslo: 3 C, snow"},
              {"role": "assistant", "content": "<think>\nCold.\n</think>\n\nOslo: 3 C and snowing."},
              {"role": "user", "content": "Should I take a coat?"},
              {"role": "assistant", "content": "<think>\n3 C is cold.\n</think>\n\nYes, a warm one."}]
    ends_on_call = [{"role": "user", "content": "Weather in Lima?"},
                    {"role": "assistant", "content": "<think>\nLima.\n</think>\n\n", "tool_calls": [call(d, "Lima")]}]
    return [Conversation.from_messages("agentic", m, tools=TOOLS) for m in (parallel, rounds, ends_on_call)]


def kimi_convs() -> list[Conversation]:
    return agent_convs(tuple(f"functions.get_weather:{i}" for i in range(4)))


# -- the oracle: render turn by turn through the tokenizer's public API, diff the prefixes ----------------
def oracle(tok, conv: Conversation, thinking: str, template: str | None = None) -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) per sample: each assistant turn j's answer is render(messages[:j+1]) minus
    render(messages[:j], add_generation_prompt) up to the last end-of-turn token; a sample is the last
    remaining answer's rendering and supervises every answer found verbatim after its own prompt in it."""
    msgs = copy.deepcopy(conv.messages)
    if thinking == "strip":
        for m in msgs:
            if m["role"] == "assistant":
                m["content"] = THINK.sub("", m["content"])

    def render(ms, gen):
        return tok.apply_chat_template(ms, tools=conv.tools, chat_template=template, tokenize=False,
                                       add_generation_prompt=gen)

    turns = {}
    for j, m in enumerate(msgs):
        if m["role"] == "assistant":
            prompt, full = render(msgs[:j], True), render(msgs[:j + 1], False)
            assert full.startswith(prompt)
            rest = full[len(prompt):]
            turns[j] = (prompt, rest[:rest.rindex(EOT) + len(EOT)])
    out, todo = [], sorted(turns)
    while todo:
        text = "".join(turns[todo[-1]])
        charmask, done = [0] * len(text), []
        for j in todo:
            prompt, answer = turns[j]
            if text.startswith(prompt) and text.startswith(answer, len(prompt)):
                charmask[len(prompt):len(prompt) + len(answer)] = [1] * len(answer)
                if thinking == "mask":
                    for t in THINK.finditer(answer):
                        charmask[len(prompt) + t.start():len(prompt) + t.end()] = [0] * len(t.group())
                done.append(j)
        ids, mask, k = [], [], 0
        while k < len(text):  # runs of equal mask, tokenized apart (prompt and answer are tokenized apart)
            e = k
            while e < len(text) and charmask[e] == charmask[k]:
                e += 1
            piece = tok.encode(text[k:e], add_special_tokens=False)
            ids, mask, k = ids + piece, mask + [charmask[k]] * len(piece), e
        out.append((ids, mask))
        todo = [j for j in todo if j not in done]
    return out[::-1]


def fast(tok, convs: list[Conversation], thinking: str, template: str | None = None):
    chat = ChatTemplate(tok, template)
    plans = [p for c in convs for p in chat.plan(c, thinking=thinking)[0]]
    samples, _ = build_samples(tok, plans, max_length=1 << 20, thinking=thinking)
    return samples


def marked(tok, ids: list[int], mask: list[int], begin: str, end: str) -> list[list[int]]:
    """The mask values of the tokens of each `begin`…`end` stretch of the decoded sample."""
    pieces = [tok.decode([i]) for i in ids]
    starts = [0]
    for p in pieces:
        starts.append(starts[-1] + len(p))
    text = "".join(pieces)
    assert text == tok.decode(ids)
    out = []
    for m in re.finditer(re.escape(begin) + ".*?" + re.escape(end), text, re.S):
        out.append([mask[t] for t in range(len(ids)) if starts[t] < m.end() and starts[t + 1] > m.start()])
    return out


@pytest.fixture(scope="module")
def qwen3():
    from transformers import AutoTokenizer

    from dflashkit.assets import asset_path

    return AutoTokenizer.from_pretrained(asset_path("tokenizer-qwen3"))


@pytest.fixture(scope="module")
def kimi_tok():
    """The Qwen3 tokenizer with Kimi K2's markers added as special tokens (each is one special token in Kimi's)."""
    from transformers import AutoTokenizer

    from dflashkit.assets import asset_path

    tok = AutoTokenizer.from_pretrained(asset_path("tokenizer-qwen3"))
    tok.add_special_tokens({"additional_special_tokens": KIMI_SPECIALS})
    return tok


@pytest.mark.parametrize("thinking", POLICIES)
def test_qwen3_agent_masks_match_the_oracle(qwen3, thinking):
    convs = agent_convs()
    samples = fast(qwen3, convs, thinking)
    expected = [x for c in convs for x in oracle(qwen3, c, thinking)]
    assert len(samples) == len(expected) >= 3
    for s, (ids, mask) in zip(samples, expected):
        assert s.input_ids.tolist() == ids, s.id
        assert s.loss_mask.tolist() == mask, s.id
    # Qwen3 drops the first round's thinking once the next user turn follows: that round is trained in
    # its own sample, after exactly the prompt it was answered to
    rounds = [qwen3.decode(s.input_ids[s.loss_mask == 1].tolist()) for s in samples if s.id.startswith(convs[1].id)]
    assert len(rounds) >= 2 and rounds[-1].endswith("Yes, a warm one.<|im_end|>")
    assert ("3 C is cold." in rounds[-1]) == (thinking == "keep")
    assert ("One call." in rounds[0]) == (thinking == "keep") and "Oslo: 3 C and snowing." in rounds[-2]


@pytest.mark.parametrize("thinking", POLICIES)
def test_qwen3_supervises_calls_not_declarations_or_results(qwen3, thinking):
    parallel = agent_convs()[0]
    s = fast(qwen3, [parallel], thinking)[-1]  # the whole conversation (strip: the last sample)
    ids, mask = s.input_ids.tolist(), s.loss_mask.tolist()
    text = qwen3.decode(ids)
    calls = marked(qwen3, ids, mask, "<tool_call>\n{\"name\": \"", "</tool_call>")
    declared = marked(qwen3, ids, mask, "<tools>", "</tools>")
    results = marked(qwen3, ids, mask, "<tool_response>", "</tool_response>")
    if thinking == "strip":  # the call turn is rewritten once the answer follows: its own sample supervises it
        first = fast(qwen3, [parallel], thinking)[0]
        calls = marked(qwen3, first.input_ids.tolist(), first.loss_mask.tolist(), "<tool_call>\n{\"name\": \"", "</tool_call>")
    assert len(calls) == 2 and all(v == [1] * len(v) for v in calls)  # both parallel calls, every token
    assert len(declared) == 2 and all(set(v) == {0} for v in declared)  # "<tools></tools> tags:", the block
    assert '"get_weather"' in text.split("<tools>")[2]
    assert len(results) == 2 and all(set(v) == {0} for v in results)
    assert "Paris: 18 C" in text and "Answer briefly." in text  # results and system prompt are context
    sup = qwen3.decode([i for i, m in zip(ids, mask) if m])
    assert sup.endswith("Paris 18 C, Rome 24 C.<|im_end|>") and "Answer briefly" not in sup
    assert ("Both results are in." in sup) == (thinking == "keep")


@pytest.mark.parametrize("kimi", [False, True])
def test_a_conversation_ending_on_a_call_supervises_the_call(qwen3, kimi_tok, kimi):
    tok, conv, template = (kimi_tok, kimi_convs()[2], KIMI_TEMPLATE) if kimi else (qwen3, agent_convs()[2], None)
    (s,) = fast(tok, [conv], "mask", template)
    sup = tok.decode(s.input_ids[s.loss_mask == 1].tolist())
    assert sup == ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:3<|tool_call_argument_begin|>'
                   '{"city": "Lima"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>' if kimi else
                   '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call><|im_end|>')
    assert tok.decode(s.input_ids.tolist()).endswith(sup)


@pytest.mark.parametrize("thinking", POLICIES)
def test_kimi_style_agent_masks_match_the_oracle(kimi_tok, thinking):
    convs = kimi_convs()
    samples = fast(kimi_tok, convs, thinking, KIMI_TEMPLATE)
    expected = [x for c in convs for x in oracle(kimi_tok, c, thinking, KIMI_TEMPLATE)]
    assert len(samples) == len(expected) >= 3
    for s, (ids, mask) in zip(samples, expected):
        assert s.input_ids.tolist() == ids, s.id
        assert s.loss_mask.tolist() == mask, s.id
    s = samples[0]  # the parallel calls' conversation
    ids, mask = s.input_ids.tolist(), s.loss_mask.tolist()
    sections = marked(kimi_tok, ids, mask, "<|tool_calls_section_begin|>", "<|tool_calls_section_end|><|im_end|>")
    assert len(sections) == 1 and set(sections[0]) == {1}
    assert "functions.get_weather:1" in kimi_tok.decode(ids)
    assert set(marked(kimi_tok, ids, mask, "tool_declare", EOT)[0]) == {0}
    assert [set(v) for v in marked(kimi_tok, ids, mask, "## Return of", EOT)] == [{0}, {0}]


def test_a_template_without_tools_is_detected(qwen3, kimi_tok):
    assert ChatTemplate(qwen3).tool_rendering_problem() is None
    assert ChatTemplate(kimi_tok, KIMI_TEMPLATE).tool_rendering_problem() is None
    problem = ChatTemplate(qwen3, ROLE_CONTENT).tool_rendering_problem()
    assert problem is not None and "tool declarations" in problem and "arguments" in problem


# -- `dflashkit tokenize` on a run dir --------------------------------------------------------------------
def setup(tmp_path, target, rows, **cfg_target):
    run_dir = tmp_path / "run"
    write_jsonl(run_dir / "generate/conversations.jsonl", rows)
    cfg = {"run": {"run_dir": str(run_dir)}, "target": {"path": str(target), **cfg_target},
           "drafter": {"block_size": 4}, "tokenize": {"agreement_samples": 0, "min_supervised": 1}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    return run_dir


def tokenize(tmp_path, capsys, *extra):
    code = main(["tokenize", "-c", str(tmp_path / "run.yaml"), "--json", *extra])
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def served(tok, conv: Conversation) -> dict:
    """The record `generate` keeps for a regenerated conversation, with the prompt token counts a server
    that renders the tools (the target's template) reports per answer."""
    row = conv.to_dict()
    answers = [j for j, m in enumerate(conv.messages) if m["role"] == "assistant"]
    prompts = [tok.apply_chat_template(conv.messages[:j], tools=conv.tools, tokenize=False,
                                       add_generation_prompt=True) for j in answers]
    row["meta"] = {"finish_reasons": ["tool_calls" if conv.messages[j].get("tool_calls") else "stop"
                                      for j in answers],
                   "prompt_tokens": [len(tok.encode(p, add_special_tokens=False)) for p in prompts]}
    return row


@pytest.mark.parametrize("thinking", ["keep", "mask"])
def test_cli_tokenize_agent_conversations(tmp_path, capsys, tiny_qwen3, qwen3, thinking):
    from dflashkit.assets import asset_path

    convs = agent_convs()
    run_dir = setup(tmp_path, tiny_qwen3, [served(qwen3, c) for c in convs], tokenizer=str(asset_path("tokenizer-qwen3")))
    code, out = tokenize(tmp_path, capsys, f"tokenize.thinking={thinking}")
    assert code == 0, out
    expected = [x for c in convs for x in oracle(qwen3, c, thinking)]
    rows = tokenized_rows(run_dir)
    assert len(rows) == len(expected) == out["samples"]
    for r, (ids, mask) in zip(rows, expected):
        assert r["input_ids"].tolist() == ids and r["loss_mask"].tolist() == mask, r["id"]
    # the drift check compared the server's prompts with a local rendering that has the same tools
    n_answers = sum(m["role"] == "assistant" for c in convs for m in c.messages)
    assert out["prompt_checked"] == n_answers and out["prompt_mismatches"] == 0


@pytest.mark.parametrize("dry_run", [False, True])
def test_cli_refuses_tools_the_template_cannot_render(tmp_path, capsys, tiny_qwen3, dry_run):
    plain = Conversation.from_messages("chat", [{"role": "user", "content": "hi"},
                                                {"role": "assistant", "content": "Hello there, friend."}])
    agent = agent_convs()[0]
    run_dir = setup(tmp_path, tiny_qwen3, [plain.to_dict(), agent.to_dict()])
    before = (run_dir / "generate/conversations.jsonl").read_bytes()
    code, out = tokenize(tmp_path, capsys, *(["--dry-run"] if dry_run else []))
    assert code == 2
    err = out["error"]
    assert "generate/conversations.jsonl:2" in err and agent.id in err and "'agentic'" in err
    assert str(tiny_qwen3) in err and "does not render" in err and "tool declarations" in err
    assert "target.chat_template" in out["hint"] and "data.sources" in out["hint"]
    assert not (run_dir / "tokenize").exists()
    assert (run_dir / "generate/conversations.jsonl").read_bytes() == before
