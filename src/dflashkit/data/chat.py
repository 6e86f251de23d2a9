"""Render conversations with the target's chat template and derive loss masks from the template.

Usage:
    chat = ChatTemplate(tokenizer, template=None, kwargs={"enable_thinking": False})
    plans, counts = chat.plan(conv, thinking="keep", system_prompt="keep")
    samples, checks = build_samples(tokenizer, plans, max_length=2048)
    samples[0].input_ids, samples[0].loss_mask            # int32 / int8 arrays
    chat = load_chat(cfg)                                  # the target's template, per-source variables
    chat.for_source(conv.source).plan(conv)               # rendered with that source's variables
    kwargs_for_source(cfg, "chat")                        # {**tokenize.chat_template_kwargs, **the source's}
    mode_of(kwargs_for_source(cfg, "chat"))               # "thinking" | "no-thinking" | "default"

The answer span of assistant turn j, for any template: with P_j = render(messages[:j],
add_generation_prompt=True) and F_j = render(messages[:j+1]), it is F_j[len(P_j):] up to and
including the end-of-turn token; headers and generation prompts lie in P_j and are never supervised.
Agent conversations render with their tools as a server would; tool-call tokens are supervised like
content (`tool_rendering_problem()` says when a template drops tools). Templates that rewrite earlier
turns are detected, not assumed: such turns get their own sample (or none, `rewritten_turns="drop"`).

Invariant: every supervised token is exactly what the model produced after exactly the prompt it
saw at inference; context and answer are tokenized separately, so no token straddles a mask boundary.
Policies: `thinking` keep | mask | strip; `system_prompt` keep | drop; a turn cut by max_tokens is
supervised without the end-of-turn token. Per-source variables (`data.sources[].chat_template_kwargs`)
merge over the run's; a source's mode (`mode_of`) comes from `enable_thinking`, else `thinking`.
The target's own answer ids replace the re-tokenized text: `meta.token_ids` (generate's, one list per answer) as
they are; `meta.completion_ids` (recorded traffic's last reply) only where they spell the rendered answer
(`ChatTemplate.ids_spell`), else the text is tokenized and the reply counted (`recorded_ids_disagree`).
"""

from __future__ import annotations

import copy
import json
import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dflashkit.data.drift import add_prompt_check, compare_prompt, is_regenerated, new_checks
from dflashkit.data.mixing import source_names
from dflashkit.data.records import Conversation
from dflashkit.errors import ConfigError, UsageError
from dflashkit.inspect.target import resolve_target_path
from dflashkit.target.load import load_tokenizer
from dflashkit.textfile import read_utf8

if TYPE_CHECKING:
    from dflashkit.config import RunConfig

log = logging.getLogger("dflashkit.tokenize")

THINK_BLOCK = re.compile(r"<think>.*?</think>\s*", re.S)
THINK_END = re.compile(r"</think>\s*")
PROBE_ANSWER = "dflashkit-probe-answer"
PROBE_TOOL, PROBE_VALUE, PROBE_RESULT = "dflashkit_probe_tool", "dflashkit-probe-value", "dflashkit-probe-result"
PROBE_TOOLS = [{"type": "function", "function": {
    "name": PROBE_TOOL, "description": "A probe.",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]
PROBE_CALL = {"id": "call_0", "type": "function",
              "function": {"name": PROBE_TOOL, "arguments": json.dumps({"q": PROBE_VALUE})}}
PROBE_AGENT: list[dict[str, Any]] = [
    {"role": "user", "content": "probe"},
    {"role": "assistant", "content": "", "tool_calls": [PROBE_CALL]},
    {"role": "tool", "tool_call_id": "call_0", "name": PROBE_TOOL, "content": PROBE_RESULT}]


@dataclass
class SamplePlan:
    """One training sample as text pieces: flag 1 = supervised; `turn` = answer ordinal or -1."""

    id: str
    texts: list[str] = field(default_factory=list)
    flags: list[int] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    server_ids: dict[int, list[int]] = field(default_factory=dict)
    # answer ordinal -> (prompt text rendered here, server's usage.prompt_tokens, server's prompt ids summary)
    server_prompts: dict[int, tuple[str, Any, Any]] = field(default_factory=dict)
    missing_ids: int = 0  # regenerated turns without server answer ids
    source: str = ""
    regenerated: bool = False

    def add(self, text: str, flag: int, turn: int = -1) -> None:
        if text:
            self.texts.append(text)
            self.flags.append(flag)
            self.turns.append(turn)

    @property
    def text(self) -> str:
        return "".join(self.texts)


@dataclass
class Sample:
    id: str
    input_ids: np.ndarray  # [T] int32
    loss_mask: np.ndarray  # [T] int8
    truncated: bool = False
    source: str = ""
    regenerated: bool = False  # answers written by the target (generate), not the dataset's own


def strip_thinking(content: str) -> str:
    """Remove `<think>…</think>` blocks (and an unopened leading `…</think>`)."""
    content = THINK_BLOCK.sub("", content)
    if "</think>" in content:
        content = content.split("</think>", 1)[1].lstrip()
    return content


class ChatTemplate:
    """A tokenizer's (or an override) chat template, compiled once and rendered to text."""

    def __init__(self, tokenizer: Any, template: str | None = None, kwargs: dict[str, Any] | None = None,
                 origin: str = "the tokenizer's chat template",
                 source_kwargs: dict[str, dict[str, Any]] | None = None):
        self.tokenizer = tokenizer
        self.source_kwargs = dict(source_kwargs or {})  # source name -> variables merged over `kwargs`
        self._variants: dict[str, ChatTemplate] = {}
        self.origin = origin  # named in errors: `target.chat_template <file>` or the tokenizer's dir
        self.template = template or getattr(tokenizer, "chat_template", None)
        if not self.template or not isinstance(self.template, str):
            raise UsageError("the tokenizer has no chat template",
                             hint="set target.chat_template to a Jinja template file")
        self.kwargs = {**{k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)},
                       **(kwargs or {})}
        specials = sorted({t.content for t in tokenizer.added_tokens_decoder.values() if t.special},
                          key=len, reverse=True)
        self.special_re = re.compile("|".join(map(re.escape, specials))) if specials else None
        self.first_error: str | None = None  # first template rendering error (e.g. roles rejected)
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            self._compiled = _compile_jinja_template(self.template)
        except ImportError:  # pragma: no cover - older/newer transformers: slower public path
            self._compiled = None
        except Exception as e:  # noqa: BLE001 - jinja2.TemplateError: unknown filter/test, syntax
            line = getattr(e, "lineno", None)
            raise UsageError(f"{self.origin}{f':{line}' if line else ''}: the chat template does not compile "
                             f"({type(e).__name__}: {e})",
                             hint="fix the template (or set target.chat_template to a working Jinja file)") from None
        self.end_token = self._end_token()

    def for_source(self, source: str) -> ChatTemplate:
        """The template that renders the conversations of data source `source`: this one, or, for a source
        with its own variables (`source_kwargs`), a copy whose variables are those merged over this one's
        (made once per source; it shares the compiled template)."""
        extra = self.source_kwargs.get(source)
        if not extra:
            return self
        variant = self._variants.get(source)
        if variant is None:
            variant = copy.copy(self)
            variant.kwargs, variant.source_kwargs, variant._variants = {**self.kwargs, **extra}, {}, {}
            variant.first_error = None
            variant.end_token = variant._end_token()
            self._variants[source] = variant
        return variant

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False,
               tools: list[dict[str, Any]] | None = None) -> str:
        """The template's text for `messages` (and the function `tools` they may call)."""
        if self._compiled is not None:
            return self._compiled.render(messages=messages, tools=tools, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self.kwargs)
        return self.tokenizer.apply_chat_template(messages, tokenize=False, chat_template=self.template,
                                                  add_generation_prompt=add_generation_prompt, tools=tools,
                                                  **self.kwargs)

    def _end_token(self) -> str | None:
        """The special token the template closes an assistant turn with (the first one after the answer
        of a probe conversation), or None (no special tokens, or the probe did not render)."""
        if self.special_re is None:
            return None
        try:
            text = self.render([{"role": "user", "content": "probe"},
                                {"role": "assistant", "content": PROBE_ANSWER}])
        except Exception:  # noqa: BLE001 - a template may refuse the probe: cut at the first special token
            return None
        at = text.rfind(PROBE_ANSWER)
        m = self.special_re.search(text, at + len(PROBE_ANSWER)) if at >= 0 else None
        return m.group() if m else None

    def tool_rendering_problem(self) -> str | None:
        """What of an agent conversation this template leaves out of its rendering — the tool
        declarations, the call's arguments, the tool result — or None when it renders all three."""
        try:
            declared = self.render(PROBE_AGENT[:1], add_generation_prompt=True, tools=PROBE_TOOLS)
            called = self.render(PROBE_AGENT[:2], tools=PROBE_TOOLS)
            answered = self.render(PROBE_AGENT, tools=PROBE_TOOLS)
        except Exception as e:  # noqa: BLE001 - templates raise their own errors (raise_exception)
            return f"it raises on a conversation with tools ({type(e).__name__}: {e})"
        missing = [what for what, ok in (("the tool declarations", PROBE_TOOL in declared),
                                         ("the tool calls' arguments", PROBE_VALUE in called),
                                         ("the tool results", PROBE_RESULT in answered)) if not ok]
        return f"it renders without {' and '.join(missing)}" if missing else None

    def answer_span(self, answer: str, message: dict[str, Any]) -> tuple[str, bool]:
        """Cut the rendered answer just after the end-of-turn token (`end_token`; else the first special
        token) following the content of `message`, the assistant turn rendered in `answer`: its tool calls,
        special tokens and all (Kimi's `<|tool_call_end|>`), lie before it.

        Returns (supervised text, whether an end-of-turn special token was found).
        """
        tail = message["content"].strip()[-32:]
        start = answer.rfind(tail) + len(tail) if tail and tail in answer else 0
        eot = self.end_token  # not the first special token: tool-call syntax may have its own
        end = answer.find(eot, start) if eot else -1
        if eot and end >= 0:
            return answer[:end + len(eot)], True
        m = self.special_re.search(answer, start) if self.special_re else None
        if m is None:
            return answer.rstrip(), False
        return answer[:m.end()], True

    def plan(self, conv: Conversation, *, thinking: str = "keep", system_prompt: str = "keep",
             rewritten_turns: str = "split") -> tuple[list[SamplePlan], Counter]:
        """Sample plans for one conversation (see the module docstring) and event counts."""
        counts: Counter[str] = Counter()
        msgs = [dict(m) for m in conv.messages if not (system_prompt == "drop" and m["role"] == "system")]
        meta = conv.meta or {}
        reasons = list(meta.get("finish_reasons") or [])
        server = list(meta.get("token_ids") or [])
        recorded = list(meta.get("completion_ids") or [])  # recorded traffic: the last reply's committed ids
        regenerated = is_regenerated(meta)
        # prompts rendered here differ from what was sent by design when turns are dropped/rewritten
        check_prompts = regenerated and thinking != "strip" and system_prompt != "drop"
        p_tokens, p_ids = list(meta.get("prompt_tokens") or []), list(meta.get("prompt_ids") or [])
        answers = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        if thinking == "strip":
            for i in answers:
                msgs[i]["content"] = strip_thinking(msgs[i]["content"])
            if any(server) or recorded:
                counts["server_ids_ignored_strip"] += 1
            server, recorded = [], []
        spans: dict[int, tuple[str, str, str, int]] = {}  # msg index -> (P, answer, F, ordinal)
        for ordinal, j in enumerate(answers):
            try:
                prompt = self.render(msgs[:j], add_generation_prompt=True, tools=conv.tools)
                full = self.render(msgs[:j + 1], tools=conv.tools)
            except Exception as e:  # noqa: BLE001 - templates raise their own errors (raise_exception)
                counts["template_errors"] += 1
                self.first_error = self.first_error or f"{conv.id}: {type(e).__name__}: {e}"
                return [], counts
            if not full.startswith(prompt):
                counts["turns_unaligned"] += 1
                continue
            answer, found = self.answer_span(full[len(prompt):], msgs[j])
            counts["turns_without_end_token"] += not found
            spans[j] = (prompt, answer, full, ordinal)
            if recorded and j == answers[-1]:
                if self.ids_spell(recorded, answer):
                    server = (server + [None] * len(answers))[:len(answers)]
                    server[ordinal] = recorded
                else:
                    counts["recorded_ids_disagree"] += 1
        plans: list[SamplePlan] = []
        remaining = sorted(spans)
        while remaining:
            last = remaining[-1]
            text = spans[last][2]
            plan = SamplePlan(id=conv.id if last == answers[-1] else f"{conv.id}-t{last}", source=conv.source,
                              regenerated=regenerated)
            cursor, done = 0, []
            for j in remaining:
                prompt, answer, _, ordinal = spans[j]
                if len(prompt) < cursor or not text.startswith(prompt) \
                        or not text.startswith(answer, len(prompt)):
                    continue
                plan.add(text[cursor:len(prompt)], 0)
                cut = reasons[ordinal] == "length" if ordinal < len(reasons) else False
                self._add_answer(plan, answer, ordinal, thinking, cut)
                if ordinal < len(server) and server[ordinal]:
                    plan.server_ids[ordinal] = list(server[ordinal])
                elif regenerated and thinking != "strip":  # strip ignores server ids on purpose
                    plan.missing_ids += 1
                if check_prompts:
                    plan.server_prompts[ordinal] = (prompt, p_tokens[ordinal] if ordinal < len(p_tokens) else None,
                                                    p_ids[ordinal] if ordinal < len(p_ids) else None)
                cursor = len(prompt) + len(answer)
                done.append(j)
            if len(done) < len(remaining):
                counts["turns_rewritten"] += len(remaining) - len(done)
            remaining = [j for j in remaining if j not in done] if rewritten_turns == "split" else []
            plans.append(plan)
        plans.reverse()
        counts["samples"] += len(plans)
        return plans, counts

    def ids_spell(self, ids: list[int], answer: str) -> bool:
        """Do token ids decode to the rendered answer span `answer`, trailing whitespace and end/special tokens
        aside? Recorded completion ids (`meta.completion_ids`) are trained on only then: ids that spell another
        text (another chat template or tool-call serialisation than this rendering's) would not follow its prompt."""
        said = self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return self._bare(said) == self._bare(answer)

    def _bare(self, text: str) -> str:
        """`text` without its trailing whitespace and special tokens."""
        while True:
            text = text.rstrip()
            m = re.search(f"(?:{self.special_re.pattern})$", text) if self.special_re is not None else None
            if m is None or m.start() == len(text):
                return text
            text = text[:m.start()]

    def _add_answer(self, plan: SamplePlan, answer: str, ordinal: int, thinking: str, cut: bool) -> None:
        end = ""
        if cut and self.special_re is not None:
            m = re.search(f"(?:{self.special_re.pattern})$", answer)
            if m:
                answer, end = answer[:m.start()], answer[m.start():]
        if thinking == "mask" and "</think>" in answer:
            m = THINK_END.search(answer)
            assert m is not None  # "</think>" is in the answer
            start = answer.find("<think>")
            start = start if 0 <= start < m.start() else 0
            plan.add(answer[:start], 1, ordinal)
            plan.add(answer[start:m.end()], 0, ordinal)
            plan.add(answer[m.end():], 1, ordinal)
        else:
            plan.add(answer, 1, ordinal)
        plan.add(end, 0, ordinal)


def encode_pieces(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Batched tokenization of text pieces without adding BOS/EOS (special-token text is parsed)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and hasattr(backend, "encode_batch_fast"):
        return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
    if backend is not None and hasattr(backend, "encode_batch"):
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def build_samples(tokenizer: Any, plans: list[SamplePlan], *, max_length: int,
                  thinking: str = "keep") -> tuple[list[Sample], dict[str, Any]]:
    """Tokenize every piece of every plan in one batch and build the masks vectorised.

    Answer pieces with server token ids (from `generate`) are compared with our tokens; on a
    mismatch the server's ids replace ours for that answer (they are what the model produced).
    Prompts the server reported on (`usage.prompt_tokens`, prompt ids) are compared with the
    prompt rendered and tokenized here (`dflashkit.data.drift`).

    Returns:
        (samples truncated to `max_length`, {"server_turns", "server_mismatches", "first_mismatch",
        "server_turns_without_ids", "prompt": drift.new_checks() counters}).
    """
    flat = [t for p in plans for t in p.texts]
    ids = encode_pieces(tokenizer, flat) if flat else []
    lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    all_ids = np.fromiter(chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum()))
    all_flags = np.repeat(np.fromiter((f for p in plans for f in p.flags), dtype=np.int8,
                                      count=len(ids)), lengths)
    piece_end = np.cumsum([len(p.texts) for p in plans])
    tok_end = np.concatenate([[0], np.cumsum(lengths)])
    checks: dict[str, Any] = {"server_turns": 0, "server_mismatches": 0, "first_mismatch": None,
                              "server_turns_without_ids": sum(p.missing_ids for p in plans),
                              "prompt": _check_prompts(tokenizer, plans)}
    samples: list[Sample] = []
    for n, plan in enumerate(plans):
        p0, p1 = (piece_end[n - 1] if n else 0), piece_end[n]
        a, b = tok_end[p0], tok_end[p1]
        sample_ids, sample_mask = all_ids[a:b], all_flags[a:b]
        if plan.server_ids:
            sample_ids, sample_mask = _apply_server_ids(tokenizer, plan, ids[p0:p1], checks, thinking)
        samples.append(Sample(plan.id, sample_ids[:max_length].copy(), sample_mask[:max_length].copy(),
                              truncated=len(sample_ids) > max_length, source=plan.source,
                              regenerated=plan.regenerated))
    return samples, checks


def _check_prompts(tokenizer: Any, plans: list[SamplePlan]) -> dict[str, Any]:
    """The server's prompt (per turn, as `generate` recorded it) vs the same prompt tokenized here."""
    checks = new_checks()
    items = [(plan.id, ordinal, *info) for plan in plans for ordinal, info in sorted(plan.server_prompts.items())]
    if not items:
        return checks
    local = encode_pieces(tokenizer, [text for _, _, text, _, _ in items])
    for (pid, ordinal, _, n, ids), loc in zip(items, local):
        check = compare_prompt(loc, server_tokens=n, server_ids=ids) if n is not None or ids else None
        add_prompt_check(checks, check, where=f"{pid} turn {ordinal}", tokenizer=tokenizer)
    return checks


def _special_ids(tokenizer: Any) -> set[int]:
    return {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}


def _apply_server_ids(tokenizer: Any, plan: SamplePlan, ids: list[list[int]], checks: dict[str, Any],
                      thinking: str) -> tuple[np.ndarray, np.ndarray]:
    out_ids: list[int] = []
    out_mask: list[int] = []
    i = 0
    while i < len(plan.texts):
        turn = plan.turns[i]
        if turn < 0 or turn not in plan.server_ids:
            out_ids += ids[i]
            out_mask += [plan.flags[i]] * len(ids[i])
            i += 1
            continue
        group = [k for k in range(i, len(plan.texts)) if plan.turns[k] == turn]
        ours = [t for k in group for t in ids[k]]
        theirs = plan.server_ids[turn]
        checks["server_turns"] += 1
        end = ids[group[-1]] if plan.flags[group[-1]] == 0 else []  # unsupervised trailing end token
        eot = ours[-1:] if plan.flags[group[-1]] and ours and ours[-1] in _special_ids(tokenizer) else []
        if ours == theirs or ours[:-1] == theirs:
            for k in group:
                out_ids += ids[k]
                out_mask += [plan.flags[k]] * len(ids[k])
        else:
            checks["server_mismatches"] += 1
            if checks["first_mismatch"] is None:
                at = next((x for x, (u, v) in enumerate(zip(ours, theirs)) if u != v),
                          min(len(ours), len(theirs)))
                checks["first_mismatch"] = {
                    "id": plan.id, "turn": turn, "token": at,
                    "ours": tokenizer.decode(ours[max(0, at - 4):at + 8]),
                    "server": tokenizer.decode(theirs[max(0, at - 4):at + 8])}
            body = list(theirs) + ([] if theirs[-1:] == eot else eot)
            mask = [1] * len(body)
            if thinking == "mask":
                text = ""
                for x, tok in enumerate(body):
                    text += tokenizer.decode([tok])
                    if "</think>" in text:
                        mask[:x + 1] = [0] * (x + 1)
                        break
            out_ids += body + end
            out_mask += mask + [0] * len(end)
        i = group[-1] + 1
    return np.asarray(out_ids, dtype=np.int32), np.asarray(out_mask, dtype=np.int8)


def tokenize_batch(chat: ChatTemplate, convs: list[Conversation], *, max_length: int, thinking: str = "keep",
                   system_prompt: str = "keep", rewritten_turns: str = "split",
                   ) -> tuple[list[Sample], Counter, dict[str, Any]]:
    """Plan + build a batch of conversations: (samples, event counts, server-token checks). Each
    conversation is rendered by `chat.for_source(conv.source)` (its source's template variables).

    Conversations that yield no sample are counted as `no_assistant_turn`, `no_aligned_turn`
    (answers present, none aligned with the template) or `template_error`.
    """
    events: Counter[str] = Counter()
    plans: list[SamplePlan] = []
    for conv in convs:
        source_chat = chat.for_source(conv.source)
        conv_plans, counts = source_chat.plan(conv, thinking=thinking, system_prompt=system_prompt,
                                              rewritten_turns=rewritten_turns)
        chat.first_error = chat.first_error or source_chat.first_error
        events.update(counts)
        if not conv_plans:
            has_answer = any(m["role"] == "assistant" for m in conv.messages)
            events["template_error" if counts["template_errors"] else
                   "no_aligned_turn" if has_answer else "no_assistant_turn"] += 1
        plans.extend(conv_plans)
    samples, checks = build_samples(chat.tokenizer, plans, max_length=max_length, thinking=thinking)
    events["truncated"] += sum(s.truncated for s in samples)
    return samples, events, checks


THINKING_KEYS = ("enable_thinking", "thinking")  # the template variables a source's mode is read from


def source_template_kwargs(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    """`data.sources[].chat_template_kwargs` by source name (`data.mixing.source_names`), for the sources that
    set any."""
    return {name: dict(src.chat_template_kwargs) for name, src in zip(source_names(cfg.data.sources), cfg.data.sources)
            if src.chat_template_kwargs}


def kwargs_for_source(cfg: RunConfig, source: str, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The chat-template variables of a conversation of data source `source` (its `data.sources[].name` or
    path-derived name, the record's `source`): `base` (default `tokenize.chat_template_kwargs`; generate passes
    `generate.chat_template_kwargs`) with the source's `data.sources[].chat_template_kwargs` merged over it.
    A source the config does not name gets `base`."""
    base = cfg.tokenize.chat_template_kwargs if base is None else base
    return {**base, **source_template_kwargs(cfg).get(source, {})}


def mode_of(kwargs: dict[str, Any]) -> str:
    """The thinking mode reports label a source with, from its merged template variables: `enable_thinking`,
    else `thinking`, true → "thinking", false → "no-thinking"; neither set → "default"."""
    for key in THINKING_KEYS:
        if key in kwargs:
            return "thinking" if kwargs[key] else "no-thinking"
    return "default"


def source_modes(cfg: RunConfig, sources: Any) -> dict[str, str]:
    """{source: mode} for each name in `sources` (`mode_of(kwargs_for_source(cfg, source))`), sorted."""
    return {s: mode_of(kwargs_for_source(cfg, s)) for s in sorted(set(sources))}


def load_chat(cfg: RunConfig, kwargs: dict[str, Any] | None = None) -> ChatTemplate:
    """The target tokenizer (no model) and its chat template or the `target.chat_template` file.

    `kwargs` are the template variables (default `tokenize.chat_template_kwargs`); each source's
    `data.sources[].chat_template_kwargs` are merged over them by `ChatTemplate.for_source`.
    """
    t = cfg.target
    if t.tokenizer:
        model_dir, gguf = Path(t.tokenizer), None
    else:
        model_dir, gguf = resolve_target_path(t.path, t.gguf_file)
    tok = load_tokenizer(model_dir, gguf_file=gguf, trust_remote_code=t.trust_remote_code,
                         tokenizer_dir=t.tokenizer)
    template = None
    origin = f"the chat template of {t.tokenizer or model_dir} (tokenizer_config.json or chat_template.jinja)"
    if t.chat_template:
        p = Path(t.chat_template).expanduser()
        if not p.is_file():
            raise ConfigError(f"target.chat_template: file not found: {p}")
        template = read_utf8(p, "target.chat_template")
        origin = f"target.chat_template {p}"
    return ChatTemplate(tok, template, cfg.tokenize.chat_template_kwargs if kwargs is None else kwargs,
                        origin=origin, source_kwargs=source_template_kwargs(cfg))
