"""Agent records in the shapes `prepare` reads (OpenAI `messages` + `tools`, ShareGPT `function_call` /
`observation`) become conversation records: tools kept, calls with ids, results paired, thinking inline; each
malformed one is a RecordError naming what is wrong and its kind. BFCL's layout converts to calls on a
fixture written here, and every record of the real asset's default categories converts."""

from __future__ import annotations

import json

import pytest

from dflashkit.data import bfcl
from dflashkit.data.mixing import normalise
from dflashkit.data.records import Conversation, record_problem
from dflashkit.data.sources import RecordError, SourceReport, detect_format, iter_source, to_record
from dflashkit.errors import ConfigError

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": SCHEMA}}


def _args(call: dict) -> dict:
    return json.loads(call["function"]["arguments"])


def test_openai_shape_keeps_tools_ids_results_and_inlines_reasoning():
    obj = {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "reasoning_content": "Two cities.",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                        {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
        {"role": "tool", "name": "get_weather", "content": "24 C"},  # older data: a name, no id
        {"role": "assistant", "content": "Paris 18 C, Rome 24 C.", "reasoning": "Both known."}],
        "tools": [TOOL]}
    assert detect_format(obj) == "messages"
    msgs, tools = to_record(obj)
    assert tools == [TOOL]
    calls = msgs[2]["tool_calls"]
    assert [c["id"] for c in calls] == ["c1", "call_0"]  # a call without an id gets the first free call_<n>
    assert calls[0]["function"]["arguments"] == '{"city":"Paris"}'  # a dict: dumped compactly
    assert calls[1]["function"]["arguments"] == '{"city": "Rome"}'  # a string: kept as the data has it
    assert msgs[2]["content"] == "<think>\nTwo cities.\n</think>\n\n"
    assert msgs[3]["tool_call_id"] == "c1" and msgs[4]["tool_call_id"] == "call_0"
    assert msgs[4]["name"] == "get_weather" and msgs[3]["name"] == "get_weather"
    assert msgs[5]["content"] == "<think>\nBoth known.\n</think>\n\nParis 18 C, Rome 24 C."
    conv = normalise("a", msgs, max_turns=8, max_prompt_chars=10_000, tools=tools)
    assert record_problem(conv.messages, conv.tools) is None and conv.tools == [TOOL]
    assert conv.messages[2]["content"] == msgs[2]["content"]  # a calling turn's content is not stripped
    assert Conversation.from_dict(json.loads(json.dumps(conv.to_dict()))) == conv


def test_legacy_function_call_and_function_role():
    obj = {"messages": [{"role": "user", "content": "Paris?"},
                        {"role": "assistant", "content": None,
                         "function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                        {"role": "function", "name": "get_weather", "content": {"temp": 18}}],
           "functions": [TOOL["function"]]}
    msgs, tools = to_record(obj)
    assert tools == [TOOL]  # bare schemas are wrapped as function tools
    assert msgs[1]["tool_calls"][0]["id"] == "call_0" and msgs[1]["content"] == ""
    assert msgs[2] == {"role": "tool", "content": '{"temp":18}', "tool_call_id": "call_0", "name": "get_weather"}


def test_sharegpt_function_call_and_observation():
    obj = {"conversations": [
        {"from": "human", "value": "Weather in Rome and Oslo?"},
        {"from": "gpt", "value": "Checking both."},
        {"from": "function_call", "value": json.dumps([{"name": "get_weather", "arguments": {"city": "Rome"}},
                                                       {"name": "get_weather", "arguments": {"city": "Oslo"}}])},
        {"from": "observation", "value": json.dumps(["24 C", {"temp": 5}])},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Bergen"}})},
        {"from": "observation", "value": "9 C"},
        {"from": "gpt", "value": "Rome 24, Oslo 5, Bergen 9."}],
        "tools": json.dumps([TOOL["function"]])}
    assert detect_format(obj) == "sharegpt"
    msgs, tools = to_record(obj)
    assert tools == [TOOL]
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "tool", "assistant", "tool", "assistant"]
    # the calls join the gpt turn right before them: one reply's text and calls are one turn
    assert msgs[1]["content"] == "Checking both." and [_args(c)["city"] for c in msgs[1]["tool_calls"]] == ["Rome", "Oslo"]
    assert [(m["tool_call_id"], m["content"]) for m in msgs[2:4]] == [("call_0", "24 C"), ("call_1", '{"temp":5}')]
    assert msgs[4]["content"] == "" and msgs[4]["tool_calls"][0]["id"] == "call_2"  # after a result: a new turn
    assert msgs[5]["tool_call_id"] == "call_2"
    assert record_problem(msgs, tools) is None


def test_a_chat_record_is_read_as_before():
    msgs, tools = to_record({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]})
    assert msgs == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}] and tools is None


def _openai(**over) -> dict:
    base = {"messages": [{"role": "user", "content": "Paris?"},
                         {"role": "assistant", "content": "",
                          "tool_calls": [{"id": "c1", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
                         {"role": "user", "content": "Thanks"}], "tools": [TOOL]}
    return {**base, **over}


@pytest.mark.parametrize("mutate, kind, needle", [
    (lambda o: o["messages"].pop(2), "call_without_result", "tool call 'c1' has no result"),
    (lambda o: o["messages"][2].update(tool_call_id="zz"), "result_without_call", "'zz', which no earlier"),
    (lambda o: o["messages"][1]["tool_calls"][0]["function"].update(arguments="{city: Paris"), "arguments_not_json",
     "arguments are not a JSON object"),
    (lambda o: o.update(tools={"type": "function"}), "tools_not_a_list", "`tools` must be a list"),
    (lambda o: o.update(tools="[{not json"), "tools_not_a_list", "`tools` is a string that is not JSON"),
    (lambda o: o["messages"].insert(1, {"role": "tool", "content": "orphan"}), "result_without_call",
     "a tool turn needs the `tool_call_id`"),
    (lambda o: o["messages"][1]["tool_calls"][0].update(function={"arguments": "{}"}), "bad_tool_call",
     "is not a call"),
])
def test_each_malformed_agent_record_is_named_with_its_kind(mutate, kind, needle):
    obj = json.loads(json.dumps(_openai()))
    mutate(obj)
    with pytest.raises(RecordError) as e:
        to_record(obj)
    assert e.value.reason == "malformed" and e.value.kind == kind and needle in str(e.value)


def test_sharegpt_observation_without_a_call_is_malformed():
    obj = {"conversations": [{"from": "human", "value": "x"}, {"from": "observation", "value": "r"}]}
    with pytest.raises(RecordError) as e:
        to_record(obj)
    assert e.value.kind == "result_without_call"
    bad = {"conversations": [{"from": "human", "value": "x"}, {"from": "function_call", "value": "{oops"}]}
    with pytest.raises(RecordError, match="function_call value is not JSON"):
        to_record(bad)


def test_normalise_keeps_agent_turns_whole_and_cuts_between_user_turns():
    msgs, tools = to_record(_openai())
    msgs.append({"role": "assistant", "content": "You're welcome."})
    conv = normalise("a", msgs, max_turns=1, max_prompt_chars=10_000, tools=tools)
    assert [m["role"] for m in conv.messages] == ["user", "assistant", "tool"]  # the call and its result stay
    assert record_problem(conv.messages, conv.tools) is None
    empty_result = _openai()
    empty_result["messages"][2]["content"] = ""  # an empty tool result does not cut the conversation
    msgs, tools = to_record(empty_result)
    conv = normalise("a", msgs, max_turns=8, max_prompt_chars=10_000, tools=tools)
    assert [m["role"] for m in conv.messages] == ["user", "assistant", "tool", "user"]


# -- BFCL ----------------------------------------------------------------------------------------------
# Lines in the layout of bfcl-eval's data/BFCL_v4_<category>.json and possible_answer/ (made-up content).
QUESTIONS = {
    "simple_python": [
        {"id": "simple_python_0", "question": [[{"role": "user", "content": "Area of a 3 by 4 box?"}]],
         "function": [{"name": "geo.box_area", "description": "Area.", "parameters": {
             "type": "dict", "properties": {
                 "w": {"type": "float", "description": "width"}, "h": {"type": "integer", "description": "height"},
                 "unit": {"type": "string", "description": "unit", "default": "m"},
                 "size": {"type": "tuple", "items": {"type": "float"}, "description": "w, h"},
                 "extra": {"type": "any", "description": "anything"},
                 "opts": {"type": "dict", "properties": {"round": {"type": "boolean"}, "digits": {"type": "integer"}},
                          "description": "options"}},
             "required": ["w", "h"]}}]}],
    "parallel": [
        {"id": "parallel_0", "question": [[{"role": "user", "content": "Play A for 20 and B for 15 minutes."}]],
         "function": [{"name": "spotify.play", "description": "Play.", "parameters": {
             "type": "dict", "properties": {"artist": {"type": "string"}, "duration": {"type": "integer"}},
             "required": ["artist", "duration"]}}]}],
    "irrelevance": [
        {"id": "irrelevance_0", "question": [[{"role": "user", "content": "Who won in 1998?"}]],
         "function": [{"name": "bmi", "description": "BMI.", "parameters": {
             "type": "dict", "properties": {"weight": {"type": "float"}}, "required": ["weight"]}}]}],
}
ANSWERS = {
    "simple_python": [{"id": "simple_python_0", "ground_truth": [{"geo.box_area": {
        "w": [3.0, 3], "h": ["", 4], "unit": ["", "m"], "size": [[3.0, 4.0]], "extra": [""],
        "opts": [{"round": [True, ""], "digits": ["", 2]}]}}]}],
    "parallel": [{"id": "parallel_0", "ground_truth": [{"spotify.play": {"artist": ["A"], "duration": [20]}},
                                                       {"spotify.play": {"artist": ["B"], "duration": [15]}}]}],
}


def write_bfcl(root, questions=QUESTIONS, answers=ANSWERS):
    (root / "possible_answer").mkdir(parents=True)
    for cat, rows in questions.items():
        (root / f"BFCL_v4_{cat}.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for cat, rows in answers.items():
        (root / "possible_answer" / f"BFCL_v4_{cat}.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def read_bfcl(root, answers="original", **src):
    from dflashkit.config import SourceSection

    report = SourceReport("bfcl", str(root))
    recs = [to_record(obj) for _, obj in iter_source(SourceSection(path=str(root), answers=answers, **src), report)]
    return recs, report


def test_bfcl_records_become_tools_and_ground_truth_calls(tmp_path):
    root = write_bfcl(tmp_path / "bfcl")
    (msgs, tools), = read_bfcl(root, bfcl_categories=["simple_python"])[0]
    fn = tools[0]["function"]
    assert fn["name"] == "geo_box_area"  # "." → "_", as BFCL names them for OpenAI-style models
    props = fn["parameters"]["properties"]
    assert fn["parameters"]["type"] == "object" and props["w"]["type"] == "number"
    assert props["size"] == {"type": "array", "items": {"type": "number"}, "description": "w, h"}
    assert "type" not in props["extra"] and props["opts"]["type"] == "object"
    assert props["opts"]["properties"]["round"]["type"] == "boolean"
    assert msgs[0] == {"role": "user", "content": "Area of a 3 by 4 box?"}
    (call,) = msgs[1]["tool_calls"]
    assert msgs[1]["content"] == "" and call["id"] == "call_0" and call["function"]["name"] == "geo_box_area"
    # first possible values; "" first = optional, left out unless required (h); nested dicts alike
    assert _args(call) == {"w": 3.0, "h": 4, "size": [3.0, 4.0], "opts": {"round": True}}
    (msgs, tools), = read_bfcl(root, bfcl_categories=["parallel"])[0]
    assert [(c["id"], _args(c)) for c in msgs[1]["tool_calls"]] == [
        ("call_0", {"artist": "A", "duration": 20}), ("call_1", {"artist": "B", "duration": 15})]


def test_bfcl_prompt_only_category_is_skipped_under_original_and_a_prompt_otherwise(tmp_path):
    root = write_bfcl(tmp_path / "bfcl")
    recs, report = read_bfcl(root, bfcl_categories=["irrelevance"])
    assert recs == [] and report.skipped == {"no_ground_truth:irrelevance": 1} and report.read == 0
    recs, _ = read_bfcl(root, answers="regenerate", bfcl_categories=["irrelevance"])
    (msgs, tools), = recs
    assert [m["role"] for m in msgs] == ["user"] and tools[0]["function"]["name"] == "bmi"


def test_bfcl_record_without_ground_truth_is_malformed(tmp_path):
    answers = {**ANSWERS, "parallel": []}
    root = write_bfcl(tmp_path / "bfcl", answers=answers)
    recs, report = read_bfcl(root, bfcl_categories=["parallel"])
    assert recs == [] and report.malformed_by == {"bad_bfcl_record": 1}
    assert "BFCL_v4_parallel.json:1: not a BFCL record: no ground truth for id 'parallel_0'" in report.examples[0]


@pytest.mark.parametrize("chosen, needle", [(["simple_pythn"], "unknown BFCL category 'simple_pythn'"),
                                            (["multi_turn_base"], "cannot be read as training data")])
def test_bfcl_categories_are_checked(chosen, needle):
    with pytest.raises(ConfigError, match=needle) as e:
        bfcl.check_categories("data.sources[0].bfcl_categories", chosen)
    assert "data.sources[0].bfcl_categories" in str(e.value) and "simple_python" in str(e.value)


def test_real_bfcl_default_categories_all_convert():
    """Every record of the real asset's default categories converts to a valid conversation whose calls
    are JSON objects naming one of its tools."""
    from dflashkit.assets import asset_path
    from dflashkit.config import SourceSection

    root = asset_path("bfcl")
    report = SourceReport("bfcl", str(root))
    n = 0
    for where, obj in iter_source(SourceSection(path="bfcl", answers="original"), report, on_malformed="fail"):
        msgs, tools = to_record(obj)
        names = {t["function"]["name"] for t in tools}
        calls = msgs[-1]["tool_calls"]
        assert calls and all(c["function"]["name"] in names for c in calls), where
        assert all(isinstance(json.loads(c["function"]["arguments"]), dict) for c in calls), where
        n += 1
    expected = sum(1 for c in bfcl.DEFAULT for line in (root / f"BFCL_v4_{c}.json").open() if line.strip())
    assert n == expected == report.read and not report.malformed_by
