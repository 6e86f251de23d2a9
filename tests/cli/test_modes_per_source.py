"""Thinking modes per source (`data.sources[].chat_template_kwargs`): tokenize renders each source's
conversations with its own template variables (the real Qwen3 template: `enable_thinking: false` ends the
generation prompt with an empty think block), eval renders its prompts the same way, and the held-out
curve, eval/results.json and the report break τ down per source and per mode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dflashkit.cli import main
from dflashkit.data.records import Conversation, write_jsonl

EMPTY_THINK = "<think>\n\n</think>\n\n"
KWARGS = {"chat": {"enable_thinking": False}, "reason": {"enable_thinking": True}}
MODES = {"chat": "no-thinking", "reason": "thinking", "mix": "default"}
BLOCK = 4


def conversations(source: str, n: int, start: int = 0) -> list[dict]:
    """`n` one-turn conversations of `source`: thinking answers for "reason", plain ones otherwise."""
    out = []
    for i in range(start, start + n):
        answer = f"The answer to question {i} is {i * 7}, and that is all there is to it."
        if source == "reason":
            answer = f"<think>\nQuestion {i} asks for {i} times seven.\n</think>\n\n{answer}"
        conv = Conversation.from_messages(source, [{"role": "user", "content": f"Question {i} from {source}?"},
                                                   {"role": "assistant", "content": answer}])
        out.append(conv.to_dict())
    return out


def write_config(tmp_path: Path, target: Path, run_dir: Path, sources: list[dict], **target_extra) -> Path:
    cfg = {"run": {"run_dir": str(run_dir)}, "target": {"path": str(target), **target_extra},
           "drafter": {"block_size": BLOCK}, "data": {"sources": sources},
           "tokenize": {"source": "prepare", "agreement_samples": 0, "workers": 1}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def mode_sources(names=("chat", "reason")) -> list[dict]:
    return [{"path": f"{n}.jsonl", "name": n, **({"chat_template_kwargs": KWARGS[n]} if n in KWARGS else {})}
            for n in names]


def last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def qwen3_dir():
    from dflashkit.assets import asset_path

    return asset_path("tokenizer-qwen3")


def test_tokenize_renders_each_source_with_its_thinking_mode(tmp_path, capsys, tiny_qwen3, qwen3_dir):
    from transformers import AutoTokenizer

    from dflashkit.data.shards import load_tokenized
    from dflashkit.rundir import RunDir

    run_dir = tmp_path / "run"
    write_jsonl(run_dir / "prepare" / "train.jsonl", conversations("chat", 3) + conversations("reason", 3))
    cfg = write_config(tmp_path, tiny_qwen3, run_dir, mode_sources(), tokenizer=str(qwen3_dir))
    assert main(["tokenize", "-c", str(cfg), "--json"]) == 0
    out = last_json(capsys)
    tok = AutoTokenizer.from_pretrained(qwen3_dir)
    data = load_tokenized(RunDir(run_dir))
    assert sorted(set(data.source)) == ["chat", "reason"]
    for src, ids, mask in zip(data.source, data.input_ids, data.loss_mask):
        first = int(mask.tolist().index(1))
        prompt, answer = tok.decode(ids[:first].tolist()), tok.decode(ids[first:].tolist())
        assert prompt.endswith("<|im_start|>assistant\n" + (EMPTY_THINK if src == "chat" else "")), (src, prompt)
        if src == "chat":  # the template wrote the empty think block: the answer follows it, unsupervised
            assert answer.startswith("The answer to question")
        else:  # the model's own think block is its answer
            assert "<think>" not in prompt and answer.startswith("<think>\nQuestion")
    stats = json.loads((run_dir / "tokenize" / "stats.json").read_text())
    assert stats["settings"]["source_chat_template_kwargs"] == KWARGS
    assert {m: v["sources"] for m, v in stats["by_mode"].items()} == {"no-thinking": ["chat"], "thinking": ["reason"]}
    for k in ("samples", "tokens", "supervised"):
        assert sum(v[k] for v in stats["by_mode"].values()) == stats[k] == out[k]
        for mode, v in stats["by_mode"].items():
            assert v[k] == sum(stats["by_source"][s][k] for s in v["sources"])
    assert out["by_mode"] == stats["by_mode"]


@pytest.mark.parametrize("bad", ["enable_thinking=false", ["enable_thinking"], 3])
def test_source_kwargs_that_are_not_a_mapping_are_exit_2(tmp_path, capsys, tiny_qwen3, bad):
    run_dir = tmp_path / "run"
    write_jsonl(run_dir / "prepare" / "train.jsonl", conversations("chat", 2))
    sources = [{"path": "chat.jsonl", "name": "chat"}, {"path": "reason.jsonl", "chat_template_kwargs": bad}]
    cfg = write_config(tmp_path, tiny_qwen3, run_dir, sources)
    before = (run_dir / "prepare" / "train.jsonl").read_bytes()
    assert main(["tokenize", "-c", str(cfg), "--json"]) == 2
    err = last_json(capsys)["error"]
    assert "data.sources[1].chat_template_kwargs" in err and "mapping" in err
    assert not (run_dir / "tokenize").exists()
    assert (run_dir / "prepare" / "train.jsonl").read_bytes() == before


def test_held_out_curve_eval_and_report_break_tau_down_per_source_and_mode(tmp_path, capsys, tiny_qwen3,
                                                                          qwen3_dir):
    """Tiny target with the real Qwen3 template (byte tokens): "mix" trains, "chat" (no thinking) and "reason"
    (thinking) are held out and evaluated; every breakdown names both sources and both modes, and adds up."""
    from tests.helpers import make_contract

    template = tmp_path / "qwen3.jinja"
    template.write_text(json.loads((qwen3_dir / "tokenizer_config.json").read_text())["chat_template"])
    run_dir = tmp_path / "run"
    write_jsonl(run_dir / "prepare" / "train.jsonl",
                conversations("mix", 8) + conversations("chat", 3) + conversations("reason", 3))
    write_jsonl(run_dir / "prepare" / "heldout.jsonl", conversations("chat", 2, 10) + conversations("reason", 2, 10))
    (run_dir / "contract.json").write_text(json.dumps(make_contract(tiny_qwen3, block_size=BLOCK).to_dict()))
    cfg_path = write_config(tmp_path, tiny_qwen3, run_dir, mode_sources(("mix", "chat", "reason")),
                            chat_template=str(template))
    c = ["-c", str(cfg_path), "--json"]
    assert main(["tokenize", *c]) == 0
    capsys.readouterr()
    train = ["train.max_steps=2", "train.batch_size=2", "train.heldout_samples=2", "train.heldout_sources=[chat,reason]",
             "train.eval_every=0", "train.save_every=0", "train.num_anchors=4", "train.keep_best=false"]
    assert main(["train", *c, *train]) == 0, capsys.readouterr()
    capsys.readouterr()
    curve = json.loads((run_dir / "train" / "curve.json").read_text())
    assert curve["modes"] == MODES
    last = curve["points"][-1]
    held = {m: v for m, v in last["by_mode"].items() if "tau" in v}
    assert set(held) == {"no-thinking", "thinking"} and held["no-thinking"]["sources"] == ["chat"]
    assert sum(v["samples"] for v in held.values()) == 4  # up to heldout_samples of each held-out source
    assert sum(v["tokens"] for v in last["by_mode"].values()) == last["tokens"] > 0
    for v in (*held.values(), last["by_source"]["chat"], last["by_source"]["reason"]):
        assert 1 <= v["tau"] <= BLOCK

    evalargs = ["eval.max_new_tokens=12", "eval.warmup=0", f"eval.block_sizes=[2,{BLOCK}]", "eval.diagnostics=false"]
    assert main(["eval", *c, *evalargs]) == 0, capsys.readouterr()
    capsys.readouterr()
    res = json.loads((run_dir / "eval" / "results.json").read_text())
    assert {s: v["mode"] for s, v in res["by_source"].items()} == {"chat": "no-thinking", "reason": "thinking"}
    assert {m: v["sources"] for m, v in res["by_mode"].items()} == {"no-thinking": ["chat"], "thinking": ["reason"]}
    for key in ("by_source", "by_mode"):
        assert sum(v["prompts"] for v in res[key].values()) == res["prompts"] == 4
        for group in ("speculative", "adaptive", "prompt_lookup"):
            for bs, whole in res[group].items():
                parts = [v[group][bs] for v in res[key].values()]
                assert sum(p["steps"] for p in parts) == whole["steps"]
                assert all(1 <= p["tau"] <= int(bs) and len(p["per_position_acceptance"]) == int(bs) - 1
                           for p in parts)
    assert res["lossless"]["verdict"] == "exact"
    # eval decoded exactly the prompts rendered per source: the no-thinking one after the empty think block
    from dflashkit.config import load_config
    from dflashkit.decode.runner import load_prompts, render_eval_prompts
    from dflashkit.export.profile import prompts_digest
    from dflashkit.target.load import load_tokenizer
    from dflashkit.rundir import RunDir

    cfg = load_config(cfg_path, [])
    tok = load_tokenizer(tiny_qwen3)
    tok.chat_template = template.read_text()
    prompts = load_prompts(cfg, RunDir(run_dir))
    ids = render_eval_prompts(cfg, tok, prompts)
    for p, x in zip(prompts, ids):
        assert tok.decode(x).endswith("<|im_start|>assistant\n" + (EMPTY_THINK if p.source == "chat" else ""))
    profile = json.loads((run_dir / "eval" / "speculation_profile.json").read_text())
    assert profile["measurement_conditions"]["prompts"]["sha256"] == prompts_digest(ids)

    assert main(["report", *c]) == 0
    page = (run_dir / "report" / "index.html").read_text()
    bs, lk = str(res["summary"]["block_size"]), str(res["summary"]["prompt_lookup"]["block_size"])

    def cells(*values) -> str:
        return "<tr>" + "".join(f"<td>{v}</td>" for v in values) + "</tr>"

    for key, name, second in (("by_source", "chat", "no-thinking"), ("by_source", "reason", "thinking"),
                              ("by_mode", "no-thinking", "chat"), ("by_mode", "thinking", "reason")):
        g = res[key][name]
        d, lookup = g["speculative"][bs], g["prompt_lookup"][lk]
        # the hybrid row beside them: its τ and speedup over these prompts, the decoder this source / mode runs
        h, gate = g["hybrid_composite"], res["summary"]["hybrid"]["gates_" + key][name]
        assert cells(name, second, f"{last[key][name]['tau']:.3f}", g["prompts"], f"{d['tau']:.2f}",
                     f"{d['per_position_acceptance'][0]:.2f}", f"{lookup['tau']:.2f}",
                     f"{lookup['per_position_acceptance'][0]:.2f}", f"{h['tau']:.2f}",
                     f"{h['speedup']:.2f}" + (" (unreliable)" if h.get("unreliable") else ""),
                     gate["decoder"]) in page, (key, name)
