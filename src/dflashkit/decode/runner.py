"""What `eval` and `bench decode` share: find the drafter, read and render prompts, run a decoder.

Usage:
    drafter_dir = resolve_drafter_dir(cfg, rd, ctx.positionals)
    prompts = load_prompts(cfg, rd)                             # [EvalPrompt(id, messages, tools, source, where)]
    ids = render_eval_prompts(cfg, target.tokenizer, prompts)   # as tokenize renders each one's source
    load_prompt_messages(cfg, rd)                               # [(id, messages)]
    prompt_sources(cfg, rd)                                     # {id: data source} where the records say
    ids = render_prompts(target.tokenizer, prompts, cfg.tokenize.chat_template_kwargs)   # (id, messages) pairs
    results = run_interleaved({"base": base, "spec": spec}, ids, params_for(cfg, target), warmup=1)

Prompt files: JSONL in prepare's record format (`{"id", "source"?, "messages": [...], "tools"?: [...]}`)
or plain `{"prompt": "..."}` lines (one user turn). A chat conversation's prompt is its turns up to its
first assistant turn. An agent conversation's (tools, tool calls or tool results) is its turns up to its
last assistant turn (all of them when it ends on a user or tool turn), tool calls and results included,
rendered with its tools: the target answers after what it saw at serving time, earlier calls and results
and all. A prompt's source is the record's `source` (prepare writes it), else the prompt file's stem;
its template variables are that source's (`data.chat.kwargs_for_source`), so the eval renders thinking
and non-thinking sources as tokenize did.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from dflashkit.data.chat import ChatTemplate, source_template_kwargs
from dflashkit.data.records import AGENT_KEYS, prepared_file, read_jsonl, record_problem
from dflashkit.data.sources import RecordError, detect_format, to_record
from dflashkit.decode.api import Decoder, GenerationResult, SamplingParams, default_stop_ids
from dflashkit.decode.spec_decode import fast_draft_dtype
from dflashkit.errors import MissingArtifactError, UsageError
from dflashkit.progress import Progress
from dflashkit.train.checkpoint import trained_drafter_dir

if TYPE_CHECKING:
    from dflashkit.config import RunConfig
    from dflashkit.rundir import RunDir

log = logging.getLogger("dflashkit.decode")


def resolve_drafter_dir(cfg: RunConfig, rd: RunDir, positionals: list[str]) -> Path:
    """Positional DIR, else `eval.drafter`, else `<run_dir>/train/best` (the best held-out τ, when
    kept) or `<run_dir>/train/final`, else `<run_dir>/export`."""
    if positionals:
        p = Path(positionals[0])
        if not p.is_dir():
            raise UsageError(f"drafter dir {p} does not exist", hint="pass a dir with config.json + model.safetensors")
        return p
    if cfg.eval.drafter:
        p = Path(cfg.eval.drafter)
        if not p.is_dir():
            raise UsageError(f"eval.drafter {p} does not exist", hint="fix eval.drafter or pass the dir as DIR")
        return p

    for cand in (trained_drafter_dir(rd)[0], rd.export_dir):
        if (cand / "config.json").is_file():
            return cand
    raise MissingArtifactError("trained drafter", rd.final_dir, run="dflashkit train -c run.yaml")


class EvalPrompt(NamedTuple):
    """One eval prompt: the record's id, the turns the target answers after (a message keeps its agent keys:
    tool_calls, tool_call_id, name), the tools it may call, its data source and where it was read (file:line)."""

    id: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    source: str = ""
    where: str = ""

    @property
    def agentic(self) -> bool:
        """Whether it has tools, tool calls or tool results (a template must render them)."""
        return bool(self.tools) or any(m.get("tool_calls") or m["role"] == "tool" for m in self.messages)


def _prompt_of(obj: Any, where: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(prompt messages, tools) of one prompt-file record (see the module docstring)."""
    if isinstance(obj, dict) and isinstance(obj.get("prompt"), str) and detect_format(obj) == "prompt":
        return [{"role": "user", "content": obj["prompt"]}], None
    if isinstance(obj, dict) and not isinstance(obj.get("messages"), list):
        try:  # ShareGPT, alpaca, HumanEval: any format `prepare` reads
            converted, tools = to_record(obj)
            obj = {"messages": converted, **({"tools": tools} if tools else {})}
        except RecordError as e:
            raise UsageError(f"{where}: {e}",
                             hint="use one record per line in any `prepare` format (messages, ShareGPT, alpaca, "
                             "prompt, HumanEval)") from None
    msgs = obj.get("messages") if isinstance(obj, dict) else None
    if not isinstance(msgs, list) or not msgs:
        raise UsageError(f"{where}: expected {{\"messages\": [...]}} or {{\"prompt\": \"...\"}}",
                         hint="use prepare's heldout.jsonl format or one {\"prompt\": ...} per line")
    tools = obj.get("tools") or None
    if tools or any(isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool") for m in msgs):
        problem = record_problem(msgs, tools)
        if problem is not None:
            raise UsageError(f"{where}: not an agent conversation: {problem}",
                             hint="records are {\"messages\": [...], \"tools\"?: [...]} in OpenAI's chat shape "
                             "(docs/training-data.md, agent conversations)")
        end = max(i for i, m in enumerate(msgs) if m["role"] == "assistant") if msgs[-1]["role"] == "assistant" \
            else len(msgs)
        out = [{"role": m["role"], "content": m["content"], **{k: m[k] for k in AGENT_KEYS if k in m}}
               for m in msgs[:end]]
        what = "its last assistant turn"
    else:
        out = []
        for m in msgs:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise UsageError(f"{where}: each message needs `role` and `content`")
            if m["role"] == "assistant":
                break
            out.append({"role": m["role"], "content": m["content"]})
        what = "the first assistant turn"
    if not any(m["role"] == "user" for m in out):
        raise UsageError(f"{where}: no user turn before {what}")
    return out, tools


def _prompt_file(cfg: RunConfig, rd: RunDir) -> Path:
    if cfg.eval.prompts:
        path = Path(cfg.eval.prompts)
        if not path.is_file():
            what = "is a directory, not a JSONL file" if path.is_dir() else "does not exist"
            raise UsageError(f"eval.prompts {path} {what}", hint="set eval.prompts to a JSONL file")
        return path
    return prepared_file(rd, "heldout")  # held-out prompts: exit 3 naming prepare when missing


def first_per_source(prompts: list[EvalPrompt], n: int | None) -> list[EvalPrompt]:
    """The first `n` prompts taken in turn from each source (in the order sources first appear, each source's
    in file order), so that `eval.num_prompts` covers every source; all of them when `n` is None. With one
    source this is the file's first `n`."""
    if n is None or n >= len(prompts):
        return list(prompts)
    queues: dict[str, list[EvalPrompt]] = {}
    for p in prompts:
        queues.setdefault(p.source, []).append(p)
    picked: list[EvalPrompt] = []
    while len(picked) < n:
        for q in queues.values():
            if q and len(picked) < n:
                picked.append(q.pop(0))
    order = {id(p): i for i, p in enumerate(prompts)}
    return sorted(picked, key=lambda p: order[id(p)])


def load_prompts(cfg: RunConfig, rd: RunDir, limit: int | None = None) -> list[EvalPrompt]:
    """The eval prompts of `eval.prompts`, else of prepare's held-out split (see the module docstring);
    `limit`: at most that many, every source's in turn (`first_per_source`)."""
    path = _prompt_file(cfg, rd)
    stem = path.name.split(".")[0]
    bad: list[str] = []  # malformed lines follow data.on_malformed: skipped (and logged) or an error
    out = []
    for n, obj in read_jsonl(path, on_malformed=cfg.data.on_malformed, bad=bad):
        where = f"{path}:{n}"
        msgs, tools = _prompt_of(obj, where)
        rec = obj if isinstance(obj, dict) else {}
        out.append(EvalPrompt(str(rec.get("id", n)), msgs, tools, str(rec.get("source") or stem), where))
    for msg in bad:
        log.warning("skipped %s", msg)
    if not out:
        raise UsageError(f"{path} holds no prompts", hint="set data.heldout > 0 and re-run `dflashkit prepare`")
    return first_per_source(out, limit)


def load_prompt_messages(cfg: RunConfig, rd: RunDir, limit: int | None = None) -> list[tuple[str, list[dict[str, Any]]]]:
    """(id, chat messages) of `load_prompts` (without tools or sources)."""
    return [(p.id, p.messages) for p in load_prompts(cfg, rd, limit)]


def prompt_sources(cfg: RunConfig, rd: RunDir) -> dict[str, str]:
    """id → data source of the eval prompts whose record names one (prepare's records do)."""
    rows = read_jsonl(_prompt_file(cfg, rd), on_malformed="skip")
    return {str(obj.get("id", n)): str(obj["source"]) for n, obj in rows if isinstance(obj, dict) and obj.get("source")}


def prompt_chat(cfg: RunConfig, tokenizer: Any) -> Any:
    """The target's chat template as tokenize renders it (`data.chat.ChatTemplate`): `tokenizer`'s template (the
    target's, or `target.chat_template` applied by `load_target`), `tokenize.chat_template_kwargs`, each
    source's `data.sources[].chat_template_kwargs` over them."""
    origin = (f"target.chat_template {cfg.target.chat_template}" if cfg.target.chat_template else
              f"the chat template of {cfg.target.tokenizer or cfg.target.path}")
    return ChatTemplate(tokenizer, kwargs=cfg.tokenize.chat_template_kwargs, origin=origin,
                        source_kwargs=source_template_kwargs(cfg))


def refuse_unrendered_tools(chat: Any, prompts: list[EvalPrompt]) -> None:
    """Refuse (exit 2) agent prompts when the chat template does not render tools (`ChatTemplate.
    tool_rendering_problem`): the drafter would be measured on prompts that lost their tools."""
    first = next((p for p in prompts if p.agentic), None)
    if first is None:
        return
    problem = chat.for_source(first.source).tool_rendering_problem()
    if problem is None:
        return
    raise UsageError(f"{first.where}: prompt {first.id} of source {first.source!r} has tools or tool calls, but "
                     f"{chat.origin} does not render them ({problem}); the target would answer a prompt without them",
                     hint="set target.chat_template to a Jinja template that renders `tools` and `tool_calls` (the "
                     "target's own, as its server applies it), or leave agent conversations out of the eval prompts")


def render_eval_prompts(cfg: RunConfig, tokenizer: Any, prompts: list[EvalPrompt]) -> list[list[int]]:
    """Each prompt rendered as tokenize renders a conversation of its source (`prompt_chat`), with its tools and
    the generation prompt, encoded without extra specials. Agent prompts and a template that cannot render
    tools: exit 2 naming the prompt's file and line."""
    chat = prompt_chat(cfg, tokenizer)
    refuse_unrendered_tools(chat, prompts)
    return [tokenizer.encode(chat.for_source(p.source).render(p.messages, add_generation_prompt=True, tools=p.tools),
                             add_special_tokens=False) for p in prompts]


def render_prompts(tokenizer: Any, prompts: list[tuple[str, list[dict[str, str]]]],
                   template_kwargs: dict[str, Any] | None = None) -> list[list[int]]:
    """Chat-template each prompt (add_generation_prompt=True) and encode without extra specials."""
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError("the target tokenizer has no chat template", hint="set target.chat_template to a Jinja file")
    rendered = []
    for _, msgs in prompts:
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                             **(template_kwargs or {}))
        rendered.append(tokenizer.encode(text, add_special_tokens=False))
    return rendered


def params_for(cfg: RunConfig, target: Any, seed: int | None = None) -> SamplingParams:
    e = cfg.eval
    return SamplingParams(temperature=e.temperature, top_p=e.top_p, top_k=e.top_k, max_new_tokens=e.max_new_tokens,
                          seed=seed, stop_token_ids=default_stop_ids(target))


WARM_AGAIN_TOKENS = 16  # run_interleaved's second, short warm-up pass


def run_interleaved(decoders: dict[str, Decoder], prompts: list[list[int]], params: SamplingParams, *,
                    warmup: int = 0, base_seed: int = 0, desc: str = "decode") -> dict[str, list[GenerationResult]]:
    """Decode every prompt with every decoder, prompt by prompt, so load noise hits all alike.

    Each decoder first decodes `warmup` prompts untimed (discarded), round-robin (prompt by prompt, every decoder
    in turn), then once more the first of them cut to `WARM_AGAIN_TOKENS` tokens, again round-robin, so the first
    decoder timed is as warm as the last (no decoder's shapes went cold while the others warmed up). Prompt i
    uses seed base_seed + i. Progress (`dflashkit.progress`, named `desc`) counts generated tokens against the
    upper bound prompts × decoders × max_new_tokens (an early stop finishes below it).
    """
    for i in range(warmup):
        for dec in decoders.values():
            dec.generate(prompts[i % len(prompts)], replace(params, seed=base_seed))
    if warmup:
        short = replace(params, seed=base_seed, max_new_tokens=min(params.max_new_tokens, WARM_AGAIN_TOKENS))
        for dec in decoders.values():
            dec.generate(prompts[0], short)
    out: dict[str, list[GenerationResult]] = {name: [] for name in decoders}
    bound = len(prompts) * len(decoders) * int(getattr(params, "max_new_tokens", 0) or 0)
    with Progress(desc, total=bound or None, unit="tok") as bar:
        for i, p in enumerate(prompts):
            for name, dec in decoders.items():
                res = dec.generate(p, replace(params, seed=base_seed + i))
                out[name].append(res)
                bar.update(len(res.token_ids))
    return out


def draft_dtype_for(cfg: RunConfig, target: Any) -> Any:
    """`eval.draft_dtype` → a torch dtype (None = the target's), announced once per process (an explicit 16-bit
    one with a warning where the CPU only emulates it)."""
    from dflashkit.target.load import DtypeChoice, announce, compute_dtype, native_half

    choice = cfg.eval.draft_dtype
    if choice == "auto":
        dt = fast_draft_dtype(target)
        name = str(dt).removeprefix("torch.")
        why = (f"{name}: a float32 target on a CPU with native bf16 ({native_half('bfloat16', target.device)[1]})"
               if dt != target.dtype else f"{name}: the target's")
        announce(DtypeChoice("eval.draft_dtype", choice, dt, why))
        return dt
    if choice == "target":
        return None
    return announce(compute_dtype(choice, target.device, key="eval.draft_dtype", suggest="auto")).dtype


def first_difference(a: list[int], b: list[int]) -> int | None:
    """First index where two token lists differ (length difference counts), else None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
