"""Eval on agent prompts: a prompt with tools and earlier tool turns is rendered by the target's template with
its tools, earlier calls and results (cut before the assistant turn the target regenerates), decoded losslessly
and reported per source; a template that cannot render tools is refused (exit 2 naming the prompt file) before
the target loads."""

from __future__ import annotations

import json

import pytest

from dflashkit.cli import main
from dflashkit.config import TargetSection, load_config
from dflashkit.target.load import load_target
from dflashkit.rundir import RunDir

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
AGENT = {"id": "agent-1", "source": "agentic", "tools": TOOLS, "messages": [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "Paris: 18 C, sunny"},
    {"role": "assistant", "content": "Paris is at 18 C and sunny."}]}
CHAT = {"id": "chat-1", "source": "chat", "messages": [{"role": "user", "content": "Name a color."},
                                                       {"role": "assistant", "content": "Blue."}]}


@pytest.fixture(scope="module")
def target(tiny_qwen3):
    return load_target(TargetSection(path=str(tiny_qwen3), device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def qwen3_template(tmp_path_factory):
    """The real Qwen3 chat template (it renders tools) as a target.chat_template file."""
    from dflashkit.assets import asset_path

    path = tmp_path_factory.mktemp("template") / "qwen3.jinja"
    config = json.loads((asset_path("tokenizer-qwen3") / "tokenizer_config.json").read_text())
    path.write_text(config["chat_template"])
    return path


def write_prompts(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def eval_args(rd, tiny_qwen3, *extra) -> list[str]:
    return ["eval", f"target.path={tiny_qwen3}", "eval.max_new_tokens=12", "eval.warmup=0", "eval.block_sizes=[2,4]",
            "eval.diagnostics=false", "--run-dir", str(rd), "--json", *extra]


def contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def test_an_agent_prompt_is_cut_at_its_last_answer_and_keeps_its_tool_turns(tmp_path):
    from dflashkit.decode.runner import load_prompts

    ends_on_result = {**AGENT, "id": "agent-2", "messages": AGENT["messages"][:3]}
    write_prompts(tmp_path / "p.jsonl", [AGENT, ends_on_result, CHAT, {"prompt": "plain"}])
    cfg = load_config(None, [f"eval.prompts={tmp_path / 'p.jsonl'}", "data.on_malformed=fail"])
    agent, result, chat, plain = load_prompts(cfg, RunDir(tmp_path))
    assert agent.messages == AGENT["messages"][:3] and agent.tools == TOOLS and agent.agentic
    assert result.messages == AGENT["messages"][:3]  # ends on a tool result: the whole conversation
    assert chat.messages == CHAT["messages"][:1] and chat.tools is None and not chat.agentic
    assert (agent.source, chat.source, plain.source) == ("agentic", "chat", "p")  # no source: the file's stem
    assert agent.where == f"{tmp_path / 'p.jsonl'}:1"


def test_eval_renders_the_tools_and_decodes_an_agent_prompt_losslessly(tmp_path, capsys, target, tiny_qwen3,
                                                                       qwen3_template):
    from dflashkit.decode.runner import load_prompts, render_eval_prompts
    from dflashkit.export.profile import prompts_digest
    from dflashkit.target.load import load_tokenizer
    from tests.helpers import run_dir_with_drafter

    rd = run_dir_with_drafter(tmp_path, target, block_size=4, prompts=1)
    prompts = tmp_path / "agent.jsonl"
    write_prompts(prompts, [AGENT, CHAT])
    extra = [f"eval.prompts={prompts}", f"target.chat_template={qwen3_template}"]
    assert main(eval_args(rd, tiny_qwen3, *extra)) == 0, capsys.readouterr()
    res = json.loads((rd / "eval" / "results.json").read_text())
    assert res["lossless"]["verdict"] == "exact" and res["summary"]["greedy_identical"] is True
    assert all(r["identical_to_baseline"] for g in ("speculative", "prompt_lookup") for r in res[g].values())
    assert set(res["by_source"]) == {"agentic", "chat"} and set(res["by_mode"]) == {"default"}
    assert sum(v["prompts"] for v in res["by_source"].values()) == res["prompts"] == 2
    # what eval decoded (the profile's digest of its prompt ids) is the rendering with the tools
    cfg = load_config(None, [f"run.run_dir={rd}", f"target.path={tiny_qwen3}", *extra])
    tok = load_tokenizer(tiny_qwen3)
    tok.chat_template = qwen3_template.read_text()
    ids = render_eval_prompts(cfg, tok, load_prompts(cfg, RunDir(rd)))
    profile = json.loads((rd / "eval" / "speculation_profile.json").read_text())
    assert profile["measurement_conditions"]["prompts"]["sha256"] == prompts_digest(ids)
    assert contains(ids[0], tok.encode("get_weather", add_special_tokens=False))
    text = tok.decode(ids[0])
    assert "<tools>" in text and '"city": "Paris"' in text and "Paris: 18 C, sunny" in text  # tools, call, result
    assert text.endswith("<|im_start|>assistant\n") and "Paris is at 18 C" not in text
    assert "get_weather" not in tok.decode(ids[1])


def test_eval_refuses_agent_prompts_the_template_cannot_render(tmp_path, capsys, target, tiny_qwen3, monkeypatch):
    """The tiny target's ChatML template renders role and content only: exit 2 naming the held-out file and
    line, before the target loads, nothing written."""
    import dflashkit.target.load as target_mod
    from tests.helpers import run_dir_with_drafter

    rd = run_dir_with_drafter(tmp_path, target, block_size=4, prompts=1)
    heldout = rd / "prepare" / "heldout.jsonl"
    write_prompts(heldout, [CHAT, AGENT])
    before = heldout.read_bytes()

    def no_load(*a, **k):
        raise AssertionError("the target loaded before the refusal")

    monkeypatch.setattr(target_mod, "load_target", no_load)
    assert main([*eval_args(rd, tiny_qwen3), "--dry-run"]) == 2  # the dry run refuses what the run refuses
    assert f"{heldout}:2" in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["error"]
    assert main(eval_args(rd, tiny_qwen3)) == 2
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert f"{heldout}:2" in out["error"] and "agent-1" in out["error"] and "'agentic'" in out["error"]
    assert "does not render" in out["error"] and "tool declarations" in out["error"]
    assert "target.chat_template" in out["hint"]
    assert not (rd / "eval").exists() and heldout.read_bytes() == before


def test_eval_takes_its_prompts_from_every_source_in_turn():
    from dflashkit.decode.runner import EvalPrompt, first_per_source

    prompts = [EvalPrompt(str(i), [{"role": "user", "content": str(i)}], None, s, f"f:{i}")
               for i, s in enumerate("aaaaabca")]
    assert [p.id for p in first_per_source(prompts, 4)] == ["0", "1", "5", "6"]  # a, a, b, c in file order
    assert [p.id for p in first_per_source(prompts, 2)] == ["0", "5"]
    assert first_per_source(prompts, None) == prompts == first_per_source(prompts, 99)
    one = [p for p in prompts if p.source == "a"]
    assert first_per_source(one, 3) == one[:3]  # one source: the file's first n
