"""The Berkeley Function Calling Leaderboard (PyPI `bfcl-eval`, the `bfcl` asset) as agent conversations.

Usage:
    check_categories("data.sources[0].bfcl_categories", ["simple_python", "parallel"])   # ConfigError
    for category in categories(src.bfcl_categories):          # [] = DEFAULT
        questions, truth = files(root, category)               # truth: None for a prompt-only category
        record = to_openai(question_obj, truths_by_id)         # {"messages", "tools"}; ValueError if bad

Layout (`bfcl_eval/data/` of the wheel, unpacked by `dflashkit.assets`): `BFCL_v4_<category>.json` holds
JSON lines `{"id", "question": [[messages of turn 0], ...], "function": [schemas]}`, and
`possible_answer/BFCL_v4_<category>.json` the ground truth, JSON lines `{"id", "ground_truth":
[{"<function>": {"<argument>": [possible values, ...]}}, ...]}` (a nested dict's values are lists of
possible values too; "" among them means the argument may be left out).

Conversion (`to_openai`): `tools` are the schemas in OpenAI's shape, their dialect's types mapped to JSON
schema (`TYPES`: dict → object, float → number, tuple → array, …; `any` and unknown types lose their
`type`), and "." in names becomes "_" (BFCL does the same for OpenAI-style models; calls are renamed
alike). `messages` are the first turn's messages and, when there is ground truth, one assistant turn
(content "") whose `tool_calls` are the ground-truth calls in order (ids `call_0`, …), each argument
its first possible value other than "" (optional arguments and ones without values may be left out).

Categories: `CALLS` have ground-truth calls (`DEFAULT`: the Python and live ones); `PROMPTS` have none (the
right answer is not to call, or any call): their records are prompts only; `UNREADABLE` need results of
executed calls or state the data does not hold (BFCL runs those APIs itself), and are refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflashkit.errors import ConfigError, UsageError

CALLS = ("simple_python", "simple_java", "simple_javascript", "multiple", "parallel", "parallel_multiple",
         "live_simple", "live_multiple", "live_parallel", "live_parallel_multiple")
DEFAULT = ("simple_python", "multiple", "parallel", "parallel_multiple",
           "live_simple", "live_multiple", "live_parallel", "live_parallel_multiple")
PROMPTS = ("irrelevance", "live_irrelevance", "live_relevance")
_MULTI_TURN = "each step needs the result of the previous call, which BFCL computes by running its APIs"
UNREADABLE = {"multi_turn_base": _MULTI_TURN, "multi_turn_long_context": _MULTI_TURN,
              "multi_turn_miss_func": _MULTI_TURN, "multi_turn_miss_param": _MULTI_TURN,
              "web_search": "its answers need live web search results", "memory": "it needs earlier sessions' memory"}
TYPES = {**dict.fromkeys(("dict", "object", "HashMap", "Hashtable"), "object"),
         **dict.fromkeys(("float", "double", "number"), "number"),
         **dict.fromkeys(("integer", "int", "long", "short", "byte", "Bigint"), "integer"),
         **dict.fromkeys(("string", "String", "char"), "string"),
         **dict.fromkeys(("boolean", "bool", "Boolean"), "boolean"),
         **dict.fromkeys(("array", "list", "tuple", "Array", "ArrayList", "Queue", "Stack", "Set"), "array"),
         "null": "null"}


def is_bfcl_dir(path: Path) -> bool:
    """Whether `path` is an unpacked `bfcl_eval/data/` (the `bfcl` asset or a copy of it)."""
    return path.is_dir() and (path / "possible_answer").is_dir() and any(path.glob("BFCL_v4_*.json"))


def categories(chosen: list[str]) -> list[str]:
    """The categories a source reads: `chosen`, or DEFAULT when it is empty."""
    return list(chosen) or list(DEFAULT)


def check_categories(key: str, chosen: list[str]) -> None:
    """Raises ConfigError (exit 2) naming `key` for an unknown or unreadable category."""
    for c in chosen:
        if c in UNREADABLE:
            raise ConfigError(f"{key}: BFCL category {c!r} cannot be read as training data: {UNREADABLE[c]}",
                              hint=f"choose among {', '.join(CALLS + PROMPTS)}")
        if c not in CALLS + PROMPTS:
            raise ConfigError(f"{key}: unknown BFCL category {c!r}",
                              hint=f"known categories: {', '.join(CALLS + PROMPTS)} (default: {', '.join(DEFAULT)}); "
                              f"not readable: {', '.join(UNREADABLE)}")


def files(root: Path, category: str) -> tuple[Path, Path | None]:
    """(questions file, ground-truth file or None for a prompt-only category) of `category` under `root`.

    Raises:
        UsageError: a file is missing (exit 2)."""
    questions = root / f"BFCL_v4_{category}.json"
    truth = root / "possible_answer" / questions.name if category in CALLS else None
    for p in (questions, truth):
        if p is not None and not p.is_file():
            raise UsageError(f"{p}: the BFCL {category!r} file is missing from {root}",
                             hint="re-fetch the asset (python -m dflashkit.assets bfcl) or fix data.sources[].path")
    return questions, truth


def _schema(s: Any) -> Any:
    """A copy of one schema with the dialect's types mapped (`TYPES`), nested schemas included."""
    if not isinstance(s, dict):
        return s
    out = dict(s)
    if isinstance(out.get("type"), str):
        mapped = TYPES.get(out["type"])
        if mapped is None:
            del out["type"]
        else:
            out["type"] = mapped
    if isinstance(out.get("properties"), dict):
        out["properties"] = {k: _schema(v) for k, v in out["properties"].items()}
    if isinstance(out.get("items"), (dict, list)):
        out["items"] = [_schema(v) for v in out["items"]] if isinstance(out["items"], list) else _schema(out["items"])
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = _schema(out["additionalProperties"])
    return out


def tool(fn: Any) -> dict[str, Any]:
    """One BFCL function schema as an OpenAI function tool."""
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError("a `function` entry is not {\"name\", \"description\", \"parameters\"}")
    out = {**fn, "name": fn["name"].replace(".", "_")}
    if "parameters" in out:
        out["parameters"] = _schema(out["parameters"])
    return {"type": "function", "function": out}


def _value(v: Any) -> Any:
    """A concrete value from a possible value: a nested dict of possible-value lists takes each key's first
    possible value ("" → key left out), lists are walked; anything else is itself."""
    if isinstance(v, dict) and v and all(isinstance(x, list) for x in v.values()):
        return {k: _value(x[0]) for k, x in v.items() if x and x[0] != ""}
    if isinstance(v, list):
        return [_value(x) for x in v]
    return v


def _arguments(args: dict[str, Any], params: Any) -> dict[str, Any]:
    """One call's arguments from their possible values (`arguments` in the module docstring)."""
    params = params if isinstance(params, dict) else {}
    required = set(params.get("required") or [])
    declared = params.get("properties") if isinstance(params.get("properties"), dict) else {}
    out = {}
    for k, values in args.items():
        given = [v for v in values if v != ""]
        optional = len(given) < len(values)
        if not given or (optional and k not in required and (values[0] == "" or k not in declared)):
            continue
        out[k] = _value(given[0])
    return out


def calls(truth: Any, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ground-truth calls of one record as OpenAI tool calls (ids call_0, call_1, …); `tools` are the
    record's (`tool`), whose schemas say which arguments are required and declared."""
    if not isinstance(truth, list) or not truth:
        raise ValueError("`ground_truth` is not a non-empty list of calls")
    params = {t["function"]["name"]: t["function"].get("parameters") for t in tools}
    out = []
    for i, c in enumerate(truth):
        if not isinstance(c, dict) or len(c) != 1 or not isinstance(next(iter(c.values())), dict):
            raise ValueError(f"ground_truth[{i}] is not {{\"<function>\": {{\"<argument>\": [values]}}}}")
        (name, args), = c.items()
        if not all(isinstance(v, list) for v in args.values()):
            raise ValueError(f"ground_truth[{i}] ({name}): an argument's possible values are not a list")
        name = name.replace(".", "_")
        picked = _arguments(args, params.get(name))
        out.append({"id": f"call_{i}", "type": "function",
                    "function": {"name": name,
                                 "arguments": json.dumps(picked, ensure_ascii=False, separators=(",", ":"))}})
    return out


def to_openai(obj: Any, truths: dict[str, Any] | None) -> dict[str, Any]:
    """One BFCL question record as `{"messages", "tools"}` (module docstring); `truths` maps ids to ground
    truth (None: a prompt-only category, no assistant turn).

    Raises:
        ValueError: the record is not in BFCL's layout, or its ground truth is missing or not in its layout."""
    q = obj.get("question") if isinstance(obj, dict) else None
    if not isinstance(q, list) or not q or not isinstance(q[0], list) or not isinstance(obj.get("function"), list):
        raise ValueError("not a BFCL record {\"id\", \"question\": [[messages]], \"function\": [...]}")
    messages: list[dict[str, Any]] = list(q[0])
    tools = [tool(fn) for fn in obj["function"]]
    if truths is not None:
        if obj.get("id") not in truths:
            raise ValueError(f"no ground truth for id {obj.get('id')!r} in possible_answer/")
        messages.append({"role": "assistant", "content": "", "tool_calls": calls(truths[obj["id"]], tools)})
    return {"messages": messages, "tools": tools}
