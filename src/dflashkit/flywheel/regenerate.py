"""The regenerate arm of a `learn` round (`learn.compare_regenerate`): what the same prompts and the same CPU time
buy without recording.

Usage (`rounds.learn_round` does this after scoring its candidate; it scores the arm's drafter on its own slice):
    arm = run_arm(rcfg, rdir / "regenerate", rdir / "contract.json", target, train_records,
                  budget_s=cpu_budget_s(cfg, minutes), candidate_steps=summary["steps"], tokenize=_tokenize)
    arm.drafter, arm.record          # the trained drafter; round.json's `regenerate_arm` (scores added by the round)
    print(arm_line(arm_row(record))) # a round's line in `dflashkit flywheel` / `learn` (its row: no per-sample data)

A team that does not record can still regenerate: answer the prompts it saw again with the target, offline, and
fine-tune on those answers. The arm does that with the round's own window: the training records' prompts (the
conversation up to the target's reply), oldest first, each rendered by the round's chat template
(`data.chat.ChatTemplate`, as tokenize renders it) and answered greedily by the round's target with the project's
decoder (`SpecDecoder(target, None, 1)`: plain decoding), up to the reply's `sampling.max_tokens` as sent, capped by
the length of its recorded `completion_token_ids` (else the recorded reply's length in tokens). Tool calls are read
back from the text as `serve` reads them (`serving.tools.parse_tool_calls`).

Equal CPU: regeneration is charged in process CPU seconds (`time.process_time`, every thread, as the round's
training budget is). With a budget (`rounds.cpu_budget_s`) prompts are regenerated until all are done or
regeneration has used half of it; the arm then trains the serving drafter (warm start, the round's recipe) on the
regenerated replies only, for the rest (budget − regeneration CPU). Training stops at the first step that reaches
its share, as the candidate's does, so regeneration + training CPU = the candidate's training budget up to one
step (`train_cpu_s` is what the budget charged, the optimizer steps, as the candidate's `cpu_s`). Without a budget
every prompt is regenerated and the arm trains the candidate's number of steps: the
comparison is then at equal steps, not equal CPU (`basis: "steps"`). The held-out slice never reaches the arm.

A served reply is the target's greedy output, so a regenerated reply should equal the recorded one token for token:
`replies.equal` of `replies.compared` (the replies recorded with their ids) checks that. The arm never promotes and
never moves the cursor.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from dflashkit.data.chat import encode_pieces, load_chat
from dflashkit.decode.api import SamplingParams, default_stop_ids
from dflashkit.decode.spec_decode import SpecDecoder
from dflashkit.errors import UsageError
from dflashkit.flywheel.traffic import to_conversation
from dflashkit.generate.conversations import regenerated_file, write_conversations
from dflashkit.rundir import RunDir
from dflashkit.serving.tools import parse_tool_calls
from dflashkit.train.checkpoint import drop_checkpoints
from dflashkit.train.loop import _fit, preflight, setup
from dflashkit.train.parallel import init_distributed

Tokenize = Callable[[Any, RunDir, Path], dict[str, Any]]


@dataclass
class Regeneration:
    """The window's training prompts answered again: the conversations (prepare format, oldest first) and what
    it cost."""

    convs: list[dict[str, Any]] = field(default_factory=list)
    available: int = 0
    cpu_s: float = 0.0
    tokens: int = 0
    compared: int = 0   # replies recorded with their completion_token_ids
    equal: int = 0      # of those, regenerated token for token


@dataclass
class Arm:
    """The trained arm (`drafter`) and its round.json record (without the scores the round adds)."""

    drafter: Any
    record: dict[str, Any]


def reply_budget(rec: dict[str, Any], tokenizer: Any) -> int:
    """The new tokens a regenerated reply may have: the request's max_tokens as sent, capped by the recorded
    completion's length (stop token included); without either, the recorded reply's length in tokens + 1."""
    sent = (rec.get("sampling") or {}).get("max_tokens")
    recorded = rec.get("completion_token_ids")
    caps = [int(n) for n in (sent, len(recorded) if recorded is not None else None) if n is not None]
    if caps:
        return max(1, min(caps))
    reply = rec["messages"][-1]
    return len(tokenizer.encode(reply.get("content") or "", add_special_tokens=False)) + 1


def answered(rec: dict[str, Any], ids: list[int], tokenizer: Any, stops: tuple[int, ...]) -> dict[str, Any]:
    """The conversation of `rec` with its reply replaced by the target's regenerated `ids` (the text `serve`
    would have answered; the ids kept in `meta.completion_ids`, so tokenize trains on them where they spell it)."""
    prompt = [dict(m) for m in rec["messages"][:-1]]
    body = ids[:-1] if ids and ids[-1] in stops else ids
    text = tokenizer.decode(body, skip_special_tokens=True)
    turn: dict[str, Any] = {"role": "assistant", "content": text}
    if rec.get("tools"):
        first = sum(len(m.get("tool_calls") or []) for m in prompt)
        parsed = parse_tool_calls(text, first=first)
        if parsed is not None:
            turn = {"role": "assistant", "content": parsed[0], "tool_calls": parsed[1]}
    again = {k: v for k, v in rec.items() if k not in ("messages", "completion_token_ids")}
    return to_conversation({**again, "messages": prompt + [turn], "completion_token_ids": list(ids)})


def regenerate(chat: Any, target: Any, records: list[dict[str, Any]], *,
               cpu_limit_s: float | None) -> Regeneration:
    """Answer `records`' prompts again, oldest first, greedily, until all are done or `cpu_limit_s` process CPU
    seconds are used (checked before each prompt, so the first always runs)."""
    tok = chat.tokenizer
    decoder, stops = SpecDecoder(target, None, 1), default_stop_ids(target)
    out = Regeneration(available=len(records))
    t0, used = time.process_time(), 0.0
    for rec in records:
        if cpu_limit_s is not None and used >= cpu_limit_s:
            break
        conv = to_conversation(rec)
        text = chat.for_source(conv["source"]).render(conv["messages"][:-1], add_generation_prompt=True,
                                                      tools=conv.get("tools"))
        res = decoder.generate(list(encode_pieces(tok, [text])[0]),
                               SamplingParams(max_new_tokens=reply_budget(rec, tok), stop_token_ids=stops))
        ids = list(res.token_ids)
        recorded = rec.get("completion_token_ids")
        if recorded is not None:
            out.compared += 1
            out.equal += ids == list(recorded)
        out.convs.append(answered(rec, ids, tok, stops))
        out.tokens += len(ids)
        used = time.process_time() - t0
    out.cpu_s = used
    return out


def train_arm(acfg: Any, ard: RunDir, target: Any, convs: list[dict[str, Any]], *, tokenize: Tokenize,
              cpu_budget_s: float | None) -> tuple[Any, dict[str, Any], dict[str, Any], list[str]]:
    """Fine-tune `acfg.drafter.init` on `convs` alone in run dir `ard` (every sample trains; nothing is held out):
    (the trained drafter, fit's summary, tokenize's counts, the trained sample ids)."""
    write_conversations(ard.generate_dir, convs)
    tok = tokenize(acfg, ard, regenerated_file(ard))

    def split(data: Any) -> tuple[list[int], list[int]]:
        if not data.ids:
            raise UsageError(f"no training sample left after tokenizing {len(convs)} regenerated replies "
                             f"({tok['dropped']})")
        return list(range(len(data.ids))), []

    inputs = preflight(acfg, ard)
    dist = init_distributed(acfg.train.parallel, acfg.target.device)
    tr = setup(acfg, ard, dist, inputs, target=target, split=split)
    try:
        ids = [tr.data.ids[i] for i in tr.plan.train_idx]
        t0 = time.process_time()
        summary = _fit(acfg, ard, tr, show_bar=False, cpu_budget_s=cpu_budget_s, inputs=inputs)
        summary.setdefault("cpu_s", round(time.process_time() - t0, 2))  # no budget: the whole fit, measured
        drafter = tr.drafter
    finally:
        tr.close()
    drop_checkpoints(ard)
    return drafter, summary, tok, ids


def run_arm(rcfg: Any, arm_dir: Path, contract_path: Path, target: Any, records: list[dict[str, Any]], *,
            budget_s: float | None, candidate_steps: int, tokenize: Tokenize) -> Arm:
    """Regenerate `records` (the window's training records, oldest first) and train the arm on them (module
    docstring) in `arm_dir`, a run dir of its own under the round's."""
    if arm_dir.exists():
        shutil.rmtree(arm_dir)
    arm_dir.mkdir(parents=True)
    ard = RunDir(arm_dir)
    shutil.copyfile(contract_path, ard.contract_path)
    regen = regenerate(load_chat(rcfg), target, records, cpu_limit_s=budget_s / 2 if budget_s else None)
    train_budget = budget_s - regen.cpu_s if budget_s else None
    if train_budget is not None and train_budget <= 0:
        raise UsageError(f"regenerating {len(regen.convs)} prompts used {regen.cpu_s:.1f} CPU-s, the whole "
                         f"budget of {budget_s:.1f}: nothing is left to train the arm")
    steps = int(rcfg.train.max_steps) if budget_s else int(candidate_steps)
    acfg = dataclasses.replace(rcfg, run=dataclasses.replace(rcfg.run, run_dir=str(arm_dir)),
                               train=dataclasses.replace(rcfg.train, max_steps=steps))
    drafter, summary, tok, ids = train_arm(acfg, ard, target, regen.convs, tokenize=tokenize,
                                           cpu_budget_s=train_budget)
    train_cpu = float(summary["cpu_s"])
    record = {"basis": "cpu" if budget_s else "steps",
              "prompts": {"regenerated": len(regen.convs), "available": regen.available, "tokens": regen.tokens},
              "replies": {"compared": regen.compared, "equal": regen.equal},
              "regen_cpu_s": round(regen.cpu_s, 3), "budget_cpu_s": budget_s,
              "train_budget_cpu_s": None if train_budget is None else round(train_budget, 3),
              "steps": summary.get("steps"), "steps_planned": steps, "train_cpu_s": train_cpu,
              "total_cpu_s": round(regen.cpu_s + train_cpu, 3),
              "ids": {"train": ids}, "tokenize": tok, "dir": str(arm_dir)}
    return Arm(drafter=drafter, record=record)


def arm_row(arm: dict[str, Any]) -> dict[str, Any]:
    """round.json's `regenerate_arm` without its per-sample scores and sample ids (a `learn/flywheel.json` row's)."""
    return {k: v for k, v in arm.items() if k not in ("scores", "ids", "tokenize")}


def arm_line(arm: dict[str, Any]) -> str:
    """One printed line of a round's regenerate arm: the candidate against it, or why there is none."""
    if "error" in arm:
        return f"regenerate arm failed: {arm['error']}"
    c = arm["candidate_vs_regenerate"]
    return (f"vs regenerating {arm['prompts']['regenerated']}/{arm['prompts']['available']} prompts offline "
            f"(equal {arm['basis']}; {arm['replies']['equal']}/{arm['replies']['compared']} replies as recorded): "
            f"candidate {c['tau_candidate']} vs arm {c['tau_regenerate']} ({c['gain']}, {c['interval90']})")
