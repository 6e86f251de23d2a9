"""Function tools for `dflashkit serve`'s chat route: Hermes-style tool calls read back from the generated text.

Usage:
    renders_tools(tokenizer)                       # does its chat template write `tools` at all?
    parsed = parse_tool_calls(text, first=2)       # None, or (content, [OpenAI tool calls with ids call_2, …])

The target's chat template declares the tools (`apply_chat_template(messages, tools=…)`); a model
trained on that template (Qwen2.5/Qwen3, Hermes, SmolLM2 with configs/templates/smollm2-tools.jinja)
calls a function by writing

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block a call. `parse_tool_calls` turns every such block into an OpenAI tool call (`arguments`
serialised back to a JSON string) with the id `call_<n>`, n counting on from `first` (the calls the
conversation already holds, so ids stay unique in it); the content is the text before the first block,
stripped. When any block is not a JSON object with a string `name` and object `arguments`, or a block
is left open (the answer was cut), nothing is parsed: the whole text stays the content, as vLLM's
`hermes` parser does.
"""

from __future__ import annotations

import json
import re
from typing import Any

from dflashkit.data.chat import PROBE_TOOLS

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
OPEN, CLOSE = "<tool_call>", "</tool_call>"


def parse_tool_calls(text: str, first: int = 0) -> tuple[str, list[dict[str, Any]]] | None:
    """(content, tool calls) of a generated text with Hermes-style `<tool_call>` blocks, or None when it has
    none, or when a block is not a valid call (module docstring)."""
    at = text.find(OPEN)
    if at < 0:
        return None
    blocks = TOOL_CALL.findall(text, at)
    if len(blocks) != text.count(OPEN) or text.count(CLOSE) != len(blocks):
        return None  # an unclosed (cut) or malformed block
    calls = []
    for k, block in enumerate(blocks):
        try:
            obj = json.loads(block)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        args = obj.get("arguments", {})
        if not isinstance(args, dict):
            return None
        calls.append({"id": f"call_{first + k}", "type": "function",
                      "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}})
    return text[:at].strip(), calls


def renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template writes function tools: a probe rendered with a tool differs from
    the same probe without (False too when the template fails on it, or there is none)."""
    probe = [{"role": "user", "content": "probe"}]
    try:
        bare = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
        with_tools = tokenizer.apply_chat_template(probe, tools=PROBE_TOOLS, tokenize=False,
                                                   add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - no template, or one that refuses the probe
        return False
    return bare != with_tools
