"""The run schema users read: one typed section per stage, each field with its default and help.

Usage:
    from dflashkit.config import RunConfig
    RunConfig().train.lr               # 0.0006, the default
    cfg.train.lr                       # a loaded config (`dflashkit.config.load_config`)

Only the dataclasses live here; building them strictly from YAML and overrides, the cross-field
validation, dumping, hashing and the docs/config.md rendering are `loader.py` and `validate.py`.
Every section is a static dataclass, so a misspelt `cfg.<section>.<key>` is a type error. A drafter
family's own settings are its own frozen dataclasses (declared once, with help and range, in
`dflashkit/family/`): `cfg.drafter.knobs` holds the knobs and `cfg.train.weights` the loss weights of
`drafter.type`'s family, resolved when the config is built. Their field names stay flat keys
(`drafter.dspark_markov_rank`, `train.selector_loss_weight`) in the YAML, the overrides, the dump, the
section hash and docs/config.md: `loader.py` maps them (fields marked `flat`). Code reads them typed, as
the family's class: `family.own_knobs(cfg.drafter.knobs)`, `knobs.settings(DSparkKnobs, cfg.drafter.knobs)`.
Fields left `null` that can be derived (layer ids, mask id, draft dims) are filled by the `probe`
contract, never here.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from dflashkit import family
from dflashkit.family.knobs import declared_range


def f(default: Any, help: str, *, hash_default: bool = True, url: bool = False,  # noqa: A002
      ge: float | None = None, gt: float | None = None, le: float | None = None, lt: float | None = None,
      note: str | None = None) -> Any:
    """A field with a default, a one-line help text (docs/config.md is built from these) and its range.

    `hash_default=False`: `section_hash` leaves the field out while it holds its default, so adding
    an optional key does not make existing run dirs look out of date to `dflashkit run`.
    `url=True`: the field holds a server URL (or a list of them): it is checked by `url_problem` and
    redacted (`dflashkit.redact`) wherever the config is dumped (`url_fields` below finds every one).
    `ge` / `gt` / `le` / `lt`: the range a number (or each number of a list) must lie in, as a family's knobs
    declare theirs (`family.knobs.knob`); one check reads both (`family.knobs.range_problems`), so
    config/validate.py keeps only the rules between fields. `note` follows "must be …" in the refusal (what a
    special value means); a field whose default is None may be null.
    """
    meta: dict[str, object] = {"help": help}
    bounds = declared_range(ge=ge, gt=gt, le=le, lt=lt)
    if bounds:
        meta["range"] = bounds
    if note is not None:
        meta["note"] = note
    if not hash_default:
        meta["hash_default"] = False
    if url:
        meta["url"] = True
    if isinstance(default, (list, dict)):
        def fresh(d: Any = default) -> Any:  # a new copy per instance
            return json.loads(json.dumps(d))

        return field(default_factory=fresh, metadata=meta)
    return field(default=default, metadata=meta)


def sub(cls: type, help: str) -> Any:  # noqa: A002
    return field(default_factory=cls, metadata={"help": help})


def settings_field(part: str, help: str) -> Any:  # noqa: A002
    """The field of a section holding a family's `part` ("knobs" or "weights"): the default family's by default.
    `flat`: its fields are the section's own keys wherever the config is read or written (`config/loader.py`,
    the section hash)."""
    return field(default_factory=lambda: getattr(family.DEFAULT, part)(), metadata={"help": help, "flat": part})


def url_fields(cfg: Any, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted key, URL) of every value of every field marked `url=True` in `cfg` (a config or a section),
    list items as `key[i]`, sections and lists of sections walked: what `url_problem` checks and what
    every dump of the config redacts."""
    out: list[tuple[str, str]] = []
    for fl in dataclasses.fields(cfg):
        key, value = f"{prefix}{fl.name}", getattr(cfg, fl.name)
        if fl.metadata.get("url"):
            if isinstance(value, list):
                out += [(f"{key}[{i}]", str(v)) for i, v in enumerate(value)]
            elif value:
                out.append((key, str(value)))
        elif dataclasses.is_dataclass(value):
            out += url_fields(value, key + ".")
        elif isinstance(value, list):
            for i, v in enumerate(value):
                if dataclasses.is_dataclass(v):
                    out += url_fields(v, f"{key}[{i}].")
    return out


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class RunSection:
    name: str = f("dflash", "Run name, used in reports and exported model cards.")
    run_dir: str = f("runs/dflash", "Directory holding every stage's outputs and manifests.")
    seed: int = f(0, "Global seed (sampling, anchors, data order, init).")
    log_level: Literal["debug", "info", "warning", "error"] = f("info", "Logging level (stderr).")
    scale: float = f(1.0, "Multiplies data.num_prompts, train.max_steps and eval.num_prompts (a fixed-size "
                     "run; not with run.budget_minutes).", gt=0)
    budget_minutes: float | None = f(
        None, "`dflashkit run` sized to this many minutes of this machine (CLI: `run --budget M`): it calibrates "
        "first, then chooses data.num_prompts, train.max_steps, train.eval_every/save_every, eval.num_prompts and "
        "eval.max_new_tokens (keys you set are kept); null = no budget. docs/budget.md.", hash_default=False, gt=0, note=" minutes (or null: no budget)")


@dataclass(kw_only=True)
class TargetSection:
    path: str = f("", "Target model: a HF model dir (safetensors), a .gguf file, or an asset name "
                  "such as `smollm2-135m-instruct` (fetched into the cache).")
    gguf_file: str | None = f(None, "GGUF file name inside `path` when `path` is a directory.")
    dtype: Literal["auto", "native", "float32", "bfloat16", "float16"] = f(
        "auto", "Target dtype (what `serve` computes in, and eval's with eval.dtype: target); auto = bfloat16 on "
        "CUDA, float32 on CPU; native = bfloat16 where the device computes it natively (CUDA; CPUs with "
        "AVX512-BF16 or AMX-BF16), else float32. A 16-bit dtype the CPU only emulates is kept, with a warning.")
    device: str = f("auto", "auto | cpu | cuda | cuda:N.")
    trust_remote_code: bool = f(False, "Allow the model dir's own Python code (off unless you ask).")
    tokenizer: str | None = f(None, "Tokenizer dir if it differs from the model dir.")
    chat_template: str | None = f(None, "Path to a Jinja chat template overriding the tokenizer's.")


@dataclass(kw_only=True)
class DrafterSection:
    """The drafter.* keys every family reads, and the knobs of `drafter.type`'s family (`knobs`)."""

    block_size: int = f(16, "Block size B (anchor + B-1 masked positions).", ge=2, note=" (an anchor plus at least one drafted position)")
    num_draft_layers: int = f(5, "Number of draft decoder layers.", ge=1)
    num_target_features: int | None = f(
        None, "How many target layers feed the drafter; null = num_draft_layers.", ge=1)
    target_layer_ids: list[int] | None = f(
        None, "0-based target decoder layers whose outputs feed the drafter (HF hidden_states[id+1]); "
        "null = the reference formula.", ge=0, note=" (layer ids are 0-based)")
    mask_token_id: int | None = f(None, "Mask token id inside the target embedding; null = choose an "
                                  "unused/reserved row (never resizes).", ge=0)
    hidden_size: int | None = f(None, "Must equal the target hidden size; null = the target's.")
    num_attention_heads: int | None = f(None, "null = the target's (MLA targets: derived).")
    num_key_value_heads: int | None = f(None, "null = the target's.")
    head_dim: int | None = f(None, "null = the target's.")
    intermediate_size: int | None = f(None, "null = the target's (dense MLP size).")
    rms_norm_eps: float | None = f(None, "null = the target's.", gt=0)
    init: str = f("random", "random | target | a drafter dir. random: random draft layers; target: copied from "
                  "target layers (when the shapes allow); a dir: warm start from a drafter you have (z-lab or "
                  "speculators format: train/final, an export, an imported or published drafter) whose target "
                  "hidden size, vocab, target_layer_ids, mask id and draft architecture match this run's (each "
                  "mismatch named, exit 2); its block size may differ; a reduced vocab's d2t is kept when "
                  "draft_vocab_size equals it, else rebuilt (refused, exit 2, where its weights have a row per "
                  "draft-vocab entry: DSpark's Markov head).")
    init_layer_ids: list[int] | None = f(None, "Target layers to copy when init=target; null = the last "
                                         "num_draft_layers layers.")
    attention: Literal["sdpa", "flex"] = f("sdpa", "sdpa (dense mask; CPU and GPU) or flex (GPU).")
    sliding_window: int | None = f(
        None, "Sliding window W (>= 1) of the draft layers that slide: a block query at position p attends to the "
        "context positions p - W < k only (its own block as always), in training, decoding and the exports "
        "(config.json `layer_types` + `sliding_window`; speculators: the same inside transformer_layer_config). "
        "With drafter.layer_types null every draft layer slides; null = full attention.", hash_default=False)
    layer_types: list[str] | None = f(
        None, "Per draft layer full_attention or sliding_attention (one per drafter.num_draft_layers; a sliding "
        "layer needs drafter.sliding_window); null = every layer sliding when drafter.sliding_window is set, "
        "else every layer full.", hash_default=False)
    feature_scale: Literal["none", "rms"] = f(
        "none", "Per-channel scale of the target features before `fc`: none; or rms = each channel divided by its "
        "RMS over training samples and multiplied by the median RMS of its target layer (tames massive "
        "activations: SmolLM2 has one channel at RMS ~1,650 vs a median of 5). Folded into fc.weight in every "
        "saved drafter dir (model/feature_scale.py), so exports are unchanged in format.", hash_default=False)
    draft_vocab_size: int | None = f(
        None, "Reduced draft vocabulary V': the drafter predicts only the V' most frequent supervised "
        "tokens of the training data (+ eos), projecting onto those rows of the target head; the "
        "checkpoint gains `d2t` (+ `lm_head.weight` rows and `t2d` on export, for vLLM). null or 0 = "
        "the full target vocab. Must be <= the target vocab.", hash_default=False, ge=0, note=" (null or 0 = the full target vocab)")
    type: str = f(
        "dflash", "Drafter family, one of the registry's (dflashkit/family/, docs/architecture.md \"Drafter "
        "families\"): dflash (each block position predicted on its own), dflash2 (DFlash plus a grouped dynamic "
        "convolution around every attention and MLP sublayer, and a candidate selector that walks one coherent "
        "path through each position's top-K tokens; checkpoints declare DFlash2DraftModel) or lilicorr (a DFlash "
        "backbone plus a small transformer over the lattice of every position's top-K candidates whose factor "
        "scores the same walk follows; checkpoints declare LiLiCorrDraftModel). dflash2 and lilicorr need the full "
        "target vocab (no draft_vocab_size). The keys below marked with a family's name are that family's knobs.",
        hash_default=False)
    knobs: object = settings_field("knobs", "The knobs of drafter.type's family (its `knobs` dataclass); written "
                                   "as flat drafter.* keys.")



@dataclass(kw_only=True)
class SourceSection:
    path: str = f("", "File or dir: .json/.jsonl(.gz)/.parquet, a HF datasets dir, or an asset name "
                  "(`sharegpt`, `humaneval`, `bfcl`).")
    format: Literal["auto", "sharegpt", "messages", "alpaca", "prompt", "humaneval"] = f(
        "auto", "Record format; auto detects per record. Agent records (tools, tool calls and results) are read "
        "in the sharegpt and messages formats.")
    weight: float = f(1.0, "Relative weight when mixing sources.", gt=0)
    max_records: int | None = f(None, "Read at most this many records from this source.")
    name: str | None = f(None, "Name in reports; default = file stem.")
    answers: Literal["regenerate", "original"] = f(
        "regenerate", "regenerate: the target re-answers these prompts (`generate`); original: train on the "
        "source's own answers as they are (raw text, no regeneration, prefill speed) — pair it with "
        "train.labels=target so the drafter still learns the target's own predictions.")
    bfcl_categories: list[str] = f(
        [], "path: bfcl only: the BFCL categories to read; [] = simple_python, multiple, parallel, "
        "parallel_multiple and the live_ ones of those four (the single-turn ones with ground-truth calls). "
        "Also: simple_java, simple_javascript; prompt-only (no calls): irrelevance, live_irrelevance, "
        "live_relevance. multi_turn_*, web_search and memory are refused (docs/training-data.md).",
        hash_default=False)
    tool_choice: Literal["auto", "none", "required"] | None = f(
        None, "`generate`: the tool_choice sent with this source's agent conversations (null = none sent: the "
        "server's default, auto). required makes the server call a tool on every turn (vLLM constrains the "
        "decoding to a call; dflashkit serve refuses it).", hash_default=False)
    chat_template_kwargs: dict[str, Any] = f(
        {}, "Chat-template variables for this source's conversations, merged over tokenize.chat_template_kwargs "
        "wherever they are rendered (tokenize, so held-out scoring; eval's prompts), e.g. {enable_thinking: false}: "
        "one run mixes thinking modes. Reports label the source's mode from the merged variables: thinking / "
        "no-thinking (enable_thinking, else thinking), default without either (docs/training-data.md).",
        hash_default=False)


@dataclass(kw_only=True)
class DataSection:
    sources: list[SourceSection] = f([], "Prompt sources (see SourceSection keys).")
    num_prompts: int | None = f(None, "Total prompts after mixing; null = all.", gt=0)
    heldout: int = f(32, "Prompts held out for eval (taken before training data).", ge=0)
    max_prompt_chars: int = f(16000, "Drop conversations whose user text is longer.", ge=1)
    max_turns: int = f(8, "Keep at most this many user turns per conversation.", ge=1)
    dedupe: bool = f(True, "Drop conversations with the same content hash.")
    on_malformed: Literal["skip", "fail"] = f("skip", "Malformed input line: skip and count, or fail.")
    mean_tokens: int = f(1024, "`plan` only: assumed mean tokens per conversation (prompt + answer) when "
                         "tokenize/stats.json does not exist yet.")


@dataclass(kw_only=True)
class ServerSection:
    urls: list[str] = f([], "OpenAI-compatible base URLs (…/v1). Empty = start `server.engine` on "
                        "127.0.0.1 for target.path. `user:password@` is sent as HTTP Basic auth and never "
                        "shown; a query string is refused (the API key goes in server.api_key_env).", url=True)
    model: str | None = f(None, "Model name sent to the server; null = the first of /v1/models.")
    api_key_env: str = f("OPENAI_API_KEY", "Environment variable holding the API key (never logged).")
    timeout_s: float = f(600.0, "Per-request timeout.", gt=0)
    startup_timeout_s: float = f(300.0, "When `urls` is empty: seconds to wait for the local "
                                 "`dflashkit serve` to answer /health.", gt=0)
    engine: Literal["dflashkit", "vllm"] = f(
        "dflashkit", "When `urls` is empty: the server `generate` and `bench serve` start for target.path: "
        "`dflashkit serve`, or vLLM (the CPU build, installed once into the cache by "
        "`dflashkit engines install vllm`; without it the stage refuses, exit 3, unless "
        "DFLASHKIT_VLLM_AUTO_INSTALL=1 lets it install; logs in <stage dir>/engine.log).",
        hash_default=False)
    tool_call_parser: str | None = f(
        None, "When `urls` is empty and server.engine=vllm: vLLM's tool-call parser, started with "
        "--enable-auto-tool-choice --tool-call-parser NAME so replies carry `tool_calls` (hermes for templates "
        "that write <tool_call> JSON blocks: Qwen3, configs/templates/smollm2-tools.jinja; kimi_k2 for Kimi K2.x). "
        "Needed to regenerate agent conversations through that vLLM (without it they are refused before it "
        "starts); a server of your own (`urls`) must be started with it.", hash_default=False)
    reasoning_parser: str | None = f(
        None, "When `urls` is empty and server.engine=vllm: vLLM's --reasoning-parser NAME (qwen3, kimi_k2, "
        "deepseek_r1): replies carry the thinking as reasoning_content (generate.reasoning keeps or drops it).",
        hash_default=False)


@dataclass(kw_only=True)
class GenerateSection:
    concurrency: int = f(32, "Requests in flight.", ge=1)
    max_retries: int = f(5, "Retries on 429/5xx/timeouts/connection errors.", ge=0)
    backoff_s: float = f(0.5, "Initial backoff (exponential, with jitter).", ge=0)
    temperature: float = f(0.0, "Sampling temperature (0 = greedy; match how you will serve).", ge=0)
    top_p: float = f(1.0, "Nucleus sampling.", gt=0, le=1)
    max_tokens: int = f(1024, "Max new tokens per assistant turn.", ge=1)
    seed: int | None = f(None, "Per-request seed (null = run.seed).")
    stop: list[str] = f([], "Extra stop strings.")
    chat_template_kwargs: dict[str, Any] = f({}, "Passed to the server's chat template, e.g. "
                                            "{enable_thinking: false}.")
    reasoning: Literal["keep", "drop"] = f("keep", "Keep `reasoning_content` as a <think> block in the "
                                           "answer, or drop it.")
    on_length: Literal["keep", "drop", "flag"] = f("keep", "Turns cut by max_tokens: keep, drop the "
                                                   "conversation, or keep and flag.")
    shard_size: int = f(1000, "Records per output shard.", ge=1)
    request_token_ids: bool = f(True, "Send `return_token_ids: true` (vLLM, `dflashkit serve`) and keep "
                                "the returned ids in meta.token_ids; turn off for strict APIs.")
    extra_body: dict[str, Any] = f({}, "Extra JSON fields merged into every request body.")
    progress: bool = f(True, "Show a progress bar on stderr.")
    http_client: Literal["fast", "httpx"] = f("fast", "Kept for old configs: both values use the one built-in "
                                             "keep-alive HTTP/1.1 client (faster than httpx and aiohttp; no "
                                             "proxies, no HTTP/2).")
    endpoint: Literal["chat", "completions"] = f(
        "chat", "chat: send messages to /v1/chat/completions (the server renders them with its chat "
        "template); completions: render them here with the target's template (target.chat_template, "
        "generate.chat_template_kwargs) and send the text to /v1/completions, so the server's template "
        "is out of the loop (reasoning is then not split off).", hash_default=False)
    neutral_sampling: bool = f(
        True, "Send the sampling knobs servers default differently, each set to off: repetition_penalty 1 "
        "(and llama.cpp's repeat_penalty), presence/frequency_penalty 0, min_p 0, top_k -1. A field the "
        "server rejects (HTTP 400 naming it) is dropped with a warning; extra_body overrides any of them.",
        hash_default=False)
    preflight: Literal["fail", "warn", "off"] = f(
        "fail", "Before generating, send one request and compare the server's prompt (usage.prompt_tokens, "
        "and prompt ids where returned) with the target's chat template rendered here; on a difference "
        "fail (exit 2) or warn. Needs target.path or target.tokenizer (skipped without).", hash_default=False)


@dataclass(kw_only=True)
class TokenizeSection:
    max_length: int = f(2048, "Truncate rendered conversations to this many tokens.", ge=8)
    min_supervised: int | None = f(None, "Drop samples with fewer supervised tokens; null = 2·block_size.")
    system_prompt: Literal["keep", "drop"] = f("keep", "Keep or drop system turns from the source.")
    thinking: Literal["keep", "mask", "strip"] = f(
        "keep", "Think blocks in answers: train on them, exclude them from the loss, or remove them.")
    chat_template_kwargs: dict[str, Any] = f({}, "Passed to apply_chat_template (e.g. enable_thinking).")
    shard_size: int = f(2000, "Samples per Parquet shard.", ge=1)
    source: Literal["generate", "prepare"] = f(
        "generate", "Conversations to tokenize: the target's regenerated answers "
        "(generate/conversations.jsonl) or the dataset's own answers (prepare/train.jsonl).")
    batch_size: int = f(256, "Conversations rendered and tokenized per batch.", ge=1)
    rewritten_turns: Literal["split", "drop"] = f(
        "split", "Answers the template renders differently once later turns follow (Qwen3 drops earlier "
        "<think> blocks): give each its own sample (exact, more tokens) or leave them unsupervised.")
    workers: int = f(1, "Processes rendering and tokenizing batches in parallel (0 = one per CPU); "
                     "output is identical for any value.")
    agreement_samples: int = f(
        16, "Teacher-forced check after tokenizing: this many samples per source are run through the target "
        "(target.path; loaded in tokenize) and the share of supervised labels that are the target's own "
        "argmax is reported per source (~1.0 for greedy regeneration). 0 = off.", hash_default=False, ge=0)
    min_agreement: float = f(
        0.9, "Fail (exit 2, shards left unchanged) when a source regenerated greedily has a teacher-forced "
        "agreement below this. Sources not regenerated by the target, or generated at temperature > 0, "
        "are reported only.", hash_default=False, ge=0, le=1)
    max_prompt_mismatch: float = f(
        0.01, "Fail (exit 2) when more than this share of the regenerated turns were answered to a prompt "
        "that differs from the local rendering (generate's usage.prompt_tokens / prompt ids vs the target's "
        "chat template here). 1 = report only.", hash_default=False, ge=0, le=1)


@dataclass(kw_only=True)
class CaptureSection:
    dtype: Literal["bfloat16", "float16", "float32"] = f("bfloat16", "Stored feature dtype.")
    batch_size: int = f(4, "Sequences per target forward.", ge=1)
    max_disk_fraction: float = f(0.9, "Refuse if the features need more than this share of free disk.", gt=0, le=1)
    last_hidden: Literal["auto", "true", "false"] = f(
        "auto", "Also store the target's final-norm hidden state per token (H values), from which cached "
        "training recomputes the target's distribution for KL; auto = when train.loss is kl or ce+kl.",
        hash_default=False)
    engine: Literal["local", "vllm"] = f(
        "local", "Who computes the features: local = the target loaded here (transformers); vllm = a vLLM server "
        "with `extract_hidden_states` (started here for target.path with dflashkit's CPU-safe connector, or "
        "`capture.server_url`), one /v1/completions request per sample (max_tokens 1, ids checked); labels and "
        "KL from the target's final norm + LM head only (read by name). Same shards, same reader.",
        hash_default=False)
    server_url: str | None = f(
        None, "capture.engine=vllm: base URL (…/v1) of a vLLM you already run with the flags "
        "`dflashkit capture --dry-run` prints; its hidden-states files must be readable here. null = start one.",
        hash_default=False, url=True)
    concurrency: int = f(4, "capture.engine=vllm: requests in flight.", hash_default=False, ge=1)
    extra_layer_ids: list[int] = f(
        [], "Target layers captured beside the contract's target_layer_ids (same numbering), so a drafter with "
        "other feature layers (drafter.target_layer_ids=…, e.g. `bench recipe` variants) trains on cached "
        "features without a second capture: the reader takes any subset of the captured layers. Each extra "
        "layer costs hidden_size × dtype bytes per token on disk; the target forward costs the same.", ge=0, note=" (layer ids are 0-based)")


@dataclass(kw_only=True)
class ParallelSection:
    mode: Literal["auto", "none", "ddp", "fsdp"] = f("auto", "Drafter parallelism under torchrun.")
    target: Literal["replicate", "shard"] = f("replicate", "Target weights: a copy per rank, or sharded "
                                             "across ranks (targets larger than one GPU).")
    backend: Literal["auto", "nccl", "gloo"] = f("auto", "torch.distributed backend.")


@dataclass(kw_only=True)
class TrainSection:
    """The train.* keys every family reads, and the loss weights of `drafter.type`'s family (`weights`)."""

    features: Literal["online", "cached", "engine"] = f(
        "online", "Target features computed in the loop, read from `capture` shards, or engine = requested "
        "from a vLLM (`capture.engine=vllm`: started here, or `capture.server_url`) as training consumes them, "
        "through a bounded on-disk queue (train.engine_prefetch micro-batches; no cache; docs/engines.md).")
    engine_prefetch: int = f(2, "train.features=engine: micro-batches requested ahead of training; the queue "
                             "(train/engine-queue/) never holds more than this many micro-batches of feature rows.",
                             hash_default=False, ge=1)
    epochs: float = f(1.0, "Passes over the training data (ignored if max_steps is set).")
    max_steps: int | None = f(None, "Optimizer steps; overrides epochs.", gt=0)
    batch_size: int = f(4, "Sequences per micro-batch (per rank).", gt=0)
    grad_accum: int = f(1, "Micro-batches per optimizer step.", gt=0)
    lr: float = f(6e-4, "Peak learning rate (AdamW).", gt=0)
    optimizer: Literal["adamw", "muon"] = f(
        "adamw", "adamw; or muon: torch.optim.Muon (Newton-Schulz orthogonalised momentum, its update matched to "
        "AdamW's RMS so train.lr carries over) for every 2-D weight, AdamW for the rest (norms). Muon under "
        "train.parallel.mode=fsdp is not supported.", hash_default=False)
    muon_momentum: float = f(0.95, "Muon momentum (train.optimizer=muon).", hash_default=False, ge=0, lt=1, note=" (the share of the last update kept)")
    min_lr_ratio: float = f(0.0, "Final lr as a fraction of lr (cosine).", ge=0, le=1)
    warmup_ratio: float = f(0.04, "Linear warmup as a fraction of steps.", ge=0, lt=1)
    weight_decay: float = f(0.0, "AdamW weight decay.", ge=0)
    betas: list[float] = f([0.9, 0.95], "AdamW betas.", ge=0, lt=1)
    grad_clip: float = f(1.0, "Max grad norm (0 = off).", ge=0)
    num_anchors: int = f(512, "Max anchors (blocks) per sequence.", gt=0)
    anchor_coverage: float | None = f(
        None, "Anchors per document in proportion to its length: each sample draws ceil(x · its anchor candidates) "
        "(capped by num_anchors); null = num_anchors per sample whatever its length. Per document, also in "
        "packed rows (train.pack; speculators #1071's per-document coverage).", hash_default=False, gt=0, le=1)
    pack: bool = f(
        False, "Document-aware sequence packing: a micro-batch's samples are concatenated into rows of up to "
        "train.pack_length tokens; a document never attends across its boundary (the drafter's mask and "
        "positions are per document, anchors and their labels stay inside it; cached features are each "
        "sample's own, an online target runs per document). train.features cached or online, drafter.type=dflash. docs/recipe.md \"Long samples and packing\".", hash_default=False)
    pack_length: int | None = f(
        None, "train.pack: tokens per packed row; null = tokenize.max_length.", hash_default=False, ge=2, note=" tokens (or null = tokenize.max_length)")
    gamma: float | None = f(None, "Loss decay over block positions; null = 7 for B=16, 5 for B=10, 4 for "
                            "B=8, else B/2.", gt=0)
    loss: Literal["ce", "kl", "ce+kl"] = f("ce", "Hard CE on the data, KL to target logits, or both.")
    kl_weight: float = f(1.0, "Weight of the KL term in ce+kl.", ge=0)
    kl_temperature: float = f(
        1.0, "Temperature T of the KL term (loss kl, ce+kl): forward KL(softmax(target/T) || softmax(draft/T)), "
        "scaled by T^2 (as NeMo Automodel distils JetSpec drafters; T = 1 is the plain KL).", hash_default=False, gt=0)
    ablate_features: bool = f(False, "The no-features ablation (does the drafter use the target at all? see "
                              "`dflashkit bench recipe`): the blocks attend to themselves only, with no target "
                              "context, in training and held-out scoring (zeroed features would not do: their "
                              "zero keys still soak up attention).", hash_default=False)
    labels: Literal["data", "target"] = f(
        "data", "Hard labels: data = the token in the training text at a+k; target = the target's own greedy "
        "prediction there (its argmax at a+k-1, from the same forward that gives the features). `target` "
        "makes raw, non-regenerated text (data.sources[].answers=original) train on-policy at slot 1; on "
        "greedy regenerated data both agree up to numerical near-ties.", hash_default=False)
    on_path: Literal["off", "mask", "rollout"] = f(
        "off", "train.labels=target on raw text: slot k learns the target's argmax after the RAW tokens up to a+k-1, "
        "which is off the target's own greedy path (the one verification checks) once a raw token inside the "
        "block differs from the target's argmax. rollout = learn the target's greedy continuation of x[..a] "
        "instead (exact; capture stores it as path_ids [tokens, B-1] int32, 4·(B-1) B/token, and the target "
        "decodes (B-2) extra tokens per raw token where the text disagrees with it: ≈ (B-2) × the disagreement "
        "rate per raw token, computed in capture or online; not with train.features=engine or "
        "capture.engine=vllm); mask = keep today's labels but give weight 0 to every position past the first "
        "disagreement in its block (free); off = today's labels everywhere. Held-out τ is scored on the "
        "target's path whatever this says where that path is known (a local target or capture; else on its argmax "
        "labels at the positions on the path: engine features, a sliding window the samples outgrow; "
        "docs/training-data.md).", hash_default=False)
    position_weighting: Literal["decay", "uniform", "dpace"] = f(
        "decay", "Loss weight per block position: the fixed decay exp(-(k-1)/gamma); uniform = 1 at every position "
        "1 … B-1 (train.gamma unused; JetSpec's KL recipe); or D-PACE (weights from the drafter's own confidence, "
        "arXiv 2605.18810). Under uniform and dpace the loss is divided by the supervised-position count.")
    dpace_alpha: float = f(0.5, "D-PACE confidence smoothing: q~ = (1-alpha)·q + alpha, in (0, 1].", gt=0, le=1)
    suffix_complement: Literal["off", "drop", "downweight"] = f(
        "off", "Train the drafter to complement the suffix proposer (the hybrid, `decode/suffix.py`): the block "
        "positions the suffix proposer already gets right in context (its proposal from the sample's own tokens up "
        "to the anchor, a match of at least train.suffix_complement_min_match tokens, compared with the loss's "
        "labels: the leading run of correct tokens) weigh train.suffix_complement_weight (downweight) or 0 (drop) "
        "in the training loss; held-out scoring is unchanged. The metric suffix_covered is their share of the "
        "supervised positions. docs/recipe.md \"Training to complement the suffix proposer\".", hash_default=False)
    suffix_complement_weight: float = f(
        0.25, "train.suffix_complement=downweight: the weight a position the suffix proposer already gets right "
        "keeps (a factor on its usual weight), in [0, 1).", hash_default=False, ge=0, lt=1, note=" (1 would change nothing: set train.suffix_complement=off)")
    suffix_complement_min_match: int = f(
        4, "train.suffix_complement: the shortest in-context match whose proposal counts (the hybrid's default "
        "gate, so positions the hybrid would still draft with the drafter keep their weight; 1 = any match).",
        hash_default=False, ge=1)
    feature_noise: float = f(0.0, "Uniform noise on the target features in training only, U(-x, x) times the "
                             "RMS of each token's feature vector per target layer (0 = off).", ge=0)
    forecast_tau: float = f(2.0, "The data-budget forecast's target: `train`, `report`, the run summary and `plan` "
                            "say how many supervised tokens (samples, hours) the learning curve train/curve.json "
                            "predicts for this held-out τ (sizing/forecast.py).", hash_default=False, gt=1, note=" (τ counts the bonus token: τ 1 is decoding without a drafter)")
    keep_best: bool = f(True, "Keep the drafter with the best held-out simulated τ in train/best/ (eval and "
                        "export then use it by default).")
    loss_chunk_blocks: int = f(64, "Blocks per loss chunk (bounds the [blocks·B, vocab] logits).", gt=0)
    dtype: Literal["auto", "native", "float32", "bfloat16"] = f(
        "auto", "The drafter's autocast dtype; auto = bf16 on CUDA; native = bf16 where the device computes it "
        "natively (CUDA; CPUs with AVX512-BF16 or AMX-BF16), else float32.")
    target_dtype: Literal["float32", "auto", "bfloat16"] = f(
        "float32", "Autocast dtype of the online target forward (features, target logits) when the target "
        "is loaded in float32: float32 = none; bfloat16; auto = bfloat16 on CUDA and on CPUs with AMX-BF16 or "
        "AVX512-BF16. "
        "`dflashkit bench train` times both.")
    eval_every: int = f(50, "Held-out simulated-τ evaluation every N steps (0 = only at the end).")
    save_every: int = f(100, "Checkpoint every N steps (and at the end).")
    keep_checkpoints: int = f(3, "Keep the newest N step checkpoints (older ones are deleted; 0 = keep all).", ge=0)
    log_every: int = f(10, "Log metrics every N steps.")
    heldout_samples: int = f(16, "Tokenized samples kept for held-out simulated τ.")
    train_samples: int | None = f(
        None, "Train on this many of the training samples only (a seeded choice; the smaller set is always a "
        "subset of the larger one, and the held-out samples do not change): data-vs-epochs and data-budget "
        "studies on one captured run dir (`bench recipe`). null = all of them.", gt=0, note=" (null = all)")
    heldout_sources: list[str] = f([], "Data sources (data.sources[].name) never trained on: up to heldout_samples "
                                   "samples of each join the held-out set, so held-out τ is also measured on a "
                                   "source of another kind (curve.json and `bench recipe` report it per source).",
                                   hash_default=False)
    compile: bool = f(False, "torch.compile the drafter.")
    tensorboard: bool = f(False, "Write TensorBoard logs (needs the tensorboard extra).")
    wandb: bool = f(False, "Log to Weights & Biases (needs the wandb extra).")
    parallel: ParallelSection = sub(ParallelSection, "Distributed settings (torchrun).")
    weights: object = settings_field("weights", "The loss weights of drafter.type's family (its `weights` "
                                     "dataclass); written as flat train.* keys.")


@dataclass(kw_only=True)
class EvalSection:
    prompts: str | None = f(None, "Prompt file (JSONL, any `prepare` format); null = prepare's held-out split.")
    num_prompts: int = f(16, "Prompts to decode.", ge=1)
    max_new_tokens: int = f(128, "Tokens per prompt.", ge=1)
    block_sizes: list[int] = f([], "Inference block sizes to measure; empty = drafter.block_size.", ge=1)
    temperature: float = f(0.0, "0 = greedy (output must equal the baseline token for token).", ge=0)
    top_p: float = f(1.0, "Nucleus sampling.", gt=0, le=1)
    top_k: int = f(0, "Top-k sampling (0 = off).", ge=0, note=" (0 = off)")
    max_context: int | None = f(None, "Refuse prompts longer than this; null = the target's context.")
    warmup: int = f(1, "Prompts decoded first and not timed.", ge=0)
    drafter: str | None = f(None, "Drafter dir (config.json + model.safetensors); null = <run_dir>/train/best (the "
                            "best held-out τ, train.keep_best), else <run_dir>/train/final, else <run_dir>/export. "
                            "A positional DIR overrides it.")
    draft_sampling: Literal["greedy", "sample"] = f("greedy", "At temperature > 0: propose the draft argmax "
                                                   "(as SGLang) or a sample of the draft law (as z-lab); "
                                                   "both lossless.")
    draft_dtype: Literal["auto", "target", "float32", "bfloat16", "float16"] = f(
        "auto", "dtype of the drafter and its lm_head copy (drafts never change the output): auto = "
        "bfloat16 for fp32 targets on CPUs with AMX/AVX512-BF16, else the target's; target = the target's.")
    dtype: Literal["target", "native", "float32", "bfloat16", "auto"] = f(
        "target", "Verify dtype: the dtype the target runs in for the baseline and every verify pass (also "
        "`bench decode`'s). target = target.dtype; native = bfloat16 where the device computes it natively (CUDA; "
        "CPUs with AVX512-BF16 or AMX-BF16: read from the CPU flags, instantly), else float32; auto = decode the "
        "first prompts in float32 and in bfloat16 and keep the one whose best block size has the higher speedup "
        "over its own baseline (costs minutes). results.json's dtype_reason says why. bfloat16 on a CPU that only "
        "emulates it is kept, with a warning. In bfloat16 the lossless check is tie-aware (eval.tie_tolerance).",
        hash_default=False)
    packed_weights: Literal["auto", "off"] = f(
        "auto", "auto = on a CPU (float32, or bfloat16 where native), the target's linear layers multiply weights "
        "pre-packed once for oneDNN, so a verify step over B tokens costs about one token's (target/packed.py); "
        "the baseline uses the same layers. off = transformers' layers as loaded.", hash_default=False)
    tie_tolerance: float | None = f(
        None, "Lossless check: a greedy divergence from the baseline is a numerical tie when the baseline's "
        "top-1 logit exceeds its logit of the speculative token by at most this many logits there; null = "
        "a share of the baseline's largest |logit| there by verify dtype (bfloat16 4%, float16 0.5%, "
        "float32 0.01%; see decode/lossless.py).", hash_default=False, ge=0)
    adaptive_length: bool = f(True, "Also decode every block size with the adaptive draft length: each step "
                              "verifies only the drafts the drafter's own confidence and the measured cost t(n) of a "
                              "target step over n tokens say pay (decode/draft_length.py; lossless). Reported beside "
                              "fixed B, which stays the figure that predicts an engine.", hash_default=False)
    confidence_truncation: bool = f(
        True, "With a drafter whose family estimates each draft's acceptance (Decoding.confidence: DSpark's "
        "confidence head), also decode every block size with verification truncated by that confidence (a "
        "static threshold: the leading drafts whose product of confidences is >= eval.confidence_threshold; "
        "decode/draft_length.py ConfidenceCut; lossless), reported as `confident` beside fixed B and the adaptive "
        "length, with paired speed ratios per source (`draft_length` in results.json).", hash_default=False)
    confidence_threshold: float = f(
        0.5, "eval.confidence_truncation: the threshold on the product of the leading drafts' confidences "
        "(0 verifies every draft: fixed B; in [0, 1]).", hash_default=False, ge=0, le=1)
    prompt_lookup: bool = f(True, "Also decode every block size with the training-free prompt-lookup "
                            "(n-gram) proposer: the floor a drafter must beat.", hash_default=False)
    prompt_lookup_ngram: int = f(3, "Prompt lookup: longest n-gram matched (falls back to shorter, down "
                                 "to 1).", hash_default=False, ge=1)
    hybrid: bool = f(True, "Also decode the largest block size with the suffix proposer alone (decode/suffix.py) "
                     "and the hybrid of it and the drafter (decode/hybrid.py) at each gate of eval.hybrid_gates "
                     "(from 2 prompts on); the `hybrid` row decodes each prompt with the decoder fastest on the other "
                     "prompts of its data source (lossless).", hash_default=False)
    hybrid_gates: list[int] = f([2, 4], "Hybrid gates measured: the suffix draft replaces the drafter's block when "
                                "its match is at least this many tokens long.", hash_default=False, ge=0, note=" (a match length in tokens; 0 = any match)")
    hybrid_graft: bool = f(True, "Also measure the graft (the drafter's confident prefix continued by the suffix "
                           "match) at the largest gate.", hash_default=False)
    hybrid_drafter_blocks: list[int] = f([0], "The drafter branch's block sizes in the hybrid grid, each measured at "
                                         "every gate (key hybrid-B@G/D): D < B drafts D - 1 tokens with the drafter "
                                         "beside suffix drafts up to B - 1; 0 = the grid's block size B.",
                                         hash_default=False)
    hybrid_online_gate: Literal["off", "on", "both"] = f(
        "off", "The hybrid grid's online drafter gate (decode/online_gate.py: per request, the drafter is switched "
        "off while its steps commit tokens slower than plain target steps, and re-probed after a back-off; "
        "lossless): off, on (every grid point with it, key hybrid-B@G+online), or both (each grid point without "
        "and with it, all candidates of the hybrid row).", hash_default=False)
    diagnostics: bool = f(True, "Bigram baseline (fit on the tokenized training answers) and the "
                          "target-context ablations (teacher-forced τ with no target context and with another "
                          "prompt's: decode/diagnostics.py).",
                          hash_default=False)


@dataclass(kw_only=True)
class ExportSection:
    out_dir: str | None = f(None, "Output dir; null = <run_dir>/export.")
    format: Literal["zlab", "speculators"] = f(
        "zlab", "Checkpoint format: zlab (config.json with dflash_config + dflash.py; read by SGLang, vLLM, "
        "transformers remote code, and dflashkit) or speculators (vLLM's own format: `vllm serve DIR` "
        "finds the target and draft length in it; holds the target's embedding and head). `dflashkit "
        "import` reads both. CLI: `dflashkit export --format speculators`.", hash_default=False)
    dtype: Literal["bfloat16", "float16", "float32"] = f("bfloat16", "Stored weight dtype.")
    check_atol: float = f(5e-2, "Reload check: max |logits difference| between the export and the source "
                          "drafter, relative to the largest |logit| (bf16 rounding gives ~1e-2).", gt=0)


@dataclass(kw_only=True)
class ServeSection:
    host: str = f("127.0.0.1", "Bind address.")
    port: int = f(8000, "Port (0 = any free port).", ge=0, le=65535, note=" (0 = any free port)")
    max_batch: int = f(8, "Requests decoded together.", ge=1)
    drafter: str | None = f(None, "Exported drafter dir: decode with DFlash speculation.")
    model_name: str | None = f(None, "Name reported by /v1/models; null = the dir name.")
    batch_wait_ms: float = f(5.0, "How long the batcher waits for more requests before decoding.", ge=0)
    max_new_tokens: int = f(4096, "Upper bound on a request's max_tokens.", ge=1)
    cpu_threads: int | None = f(None, "torch CPU threads for the server process; null = torch's default.")
    adaptive_length: bool = f(False, "With a drafter: pick each step's draft length from the drafter's confidence "
                              "and the measured verify cost (lossless; eval.adaptive_length reports what it buys).")
    confidence_truncation: bool = f(
        False, "With serve.proposer=drafter and a drafter whose family estimates each draft's acceptance "
        "(Decoding.confidence: DSpark's confidence head): each step verifies only the leading drafts whose product of "
        "confidences is >= serve.confidence_threshold (decode/draft_length.py ConfidenceCut, the rule of eval's "
        "`confident` rows; lossless). A drafter without such a head is served at fixed B, with a warning. Not with "
        "serve.adaptive_length (one draft-length rule). eval.confidence_truncation reports what it buys.",
        hash_default=False)
    confidence_threshold: float = f(
        0.5, "serve.confidence_truncation: the threshold on the product of the leading drafts' confidences "
        "(0 verifies every draft: fixed B; in [0, 1]).", hash_default=False, ge=0, le=1)
    proposer: Literal["drafter", "lookup", "suffix", "hybrid"] | None = f(
        None, "What drafts for the speculative decoder: drafter (serve.drafter), lookup (prompt lookup), suffix (the "
              "suffix proposer with the tenant pool), hybrid (suffix where its match clears serve.hybrid_min_match, "
              "else the drafter); null = drafter when serve.drafter is set, else none (batched plain decoding).",
        hash_default=False)
    suffix_pool_tokens: int = f(1 << 20, "suffix / hybrid: memory cap of the pool of recent requests, in tokens over "
                                "all tenants (oldest evicted first); 0 = no pool (each request matches only itself).",
                                hash_default=False)
    suffix_share_tenants: bool = f(False, "suffix / hybrid: one pool for all tenants; by default a request only "
                                   "matches its own tenant's earlier requests (OpenAI `user`, or header X-Tenant).",
                                   hash_default=False)
    promoted: str | None = f(None, "With a drafter: a promotion pointer to watch (`<run_dir>/learn/promoted.json`, "
                             "or that run dir: a path not ending in .json): each drafter `dflashkit learn` promotes is loaded and swapped in "
                             "between requests.", hash_default=False)
    promoted_poll_s: float = f(2.0, "How often serve.promoted is checked, in seconds.", hash_default=False)
    hybrid_min_match: int = f(4, "hybrid: the suffix branch drafts alone when its match is at least this many tokens "
                              "(eval measures the gate per source; TensorRT-LLM's sa_config threshold plays this role).",
                              hash_default=False)
    hybrid_drafter_block: int = f(0, "hybrid: the drafter branch's block size (0 = the server's): the D of the "
                                  "gate eval chose (hybrid-B@G/D).", hash_default=False)
    online_gate: bool = f(False, "drafter / hybrid: per request, switch the drafter off while its steps commit tokens "
                          "slower than plain target steps, re-probing it after a back-off (decode/online_gate.py; "
                          "lossless; eval measures it as hybrid-B@G+online with eval.hybrid_online_gate).",
                          hash_default=False)
    record_dir: str | None = f(None, "Record every served request into this dir (`serving.record`: one JSONL record per "
                               "request, rotation and redaction by the record.* keys); null = no recording.",
                               hash_default=False)
    record_features: bool = f(False, "With serve.record_dir and a drafter: also store the target's features at the "
                              "drafter's layers for the committed tokens (computed by prefill and verify anyway), a "
                              "safetensors file per segment, so training on the traffic needs no capture pass.",
                              hash_default=False)


@dataclass(kw_only=True)
class RecordSection:
    dir: str | None = f(None, "`dflashkit record`: where the proxy writes its records (serve uses serve.record_dir).",
                        hash_default=False)
    upstream: str | None = f(None, "`dflashkit record`: base URL (…/v1) of the OpenAI-compatible server to record "
                             "(--upstream).", hash_default=False, url=True)
    host: str = f("127.0.0.1", "`dflashkit record`: bind address of the proxy.", hash_default=False)
    port: int = f(8001, "`dflashkit record`: port of the proxy (0 = any free port; --port).", hash_default=False)
    api_key_env: str | None = f(None, "`dflashkit record`: env var holding a key sent upstream as a Bearer token "
                                "when the client sends no Authorization (never recorded).", hash_default=False)
    target_fingerprint: str | None = f(
        None, "The fingerprint written into every record (what `learn` matches): null = sha256 of target.path's "
              "config.json + tokenizer files when target.path is set, else `upstream:<served model id>`.",
        hash_default=False)
    max_bytes: int = f(4 << 30, "Disk cap of a record dir: the oldest closed segments are deleted past it.",
                       hash_default=False)
    max_age_days: float = f(30.0, "Closed segments older than this are deleted.", hash_default=False)
    segment_bytes: int = f(64 << 20, "A segment is closed and a new one started past this size (at most "
                           "record.max_bytes / 4).", hash_default=False)
    segment_minutes: float = f(60.0, "… or past this age.", hash_default=False)
    redact: list[str] = f([], "Regexes whose matches in recorded text become *** (API keys and URL credentials "
                          "are masked always).", hash_default=False)
    timeout_s: float = f(600.0, "`dflashkit record`: upstream read timeout.", hash_default=False)


@dataclass(kw_only=True)
class BenchSection:
    urls: list[str] = f([], "Endpoints to compare (e.g. without and with speculation).", url=True)
    concurrency: list[int] = f([1, 2, 4, 8], "Concurrency sweep.", ge=1)
    requests: int = f(32, "Requests per concurrency level.", ge=1)
    max_tokens: int = f(128, "Tokens per request.", ge=1)
    warmup: int = f(2, "Requests sent first and not timed.")
    engine_methods: list[str] = f(["dflashkit", "ar", "ngram", "dflash"], "`bench serve` with server.engine=vllm "
                                  "and no bench.urls: served in turn and swept — dflashkit (`dflashkit serve`), ar "
                                  "(vLLM), ngram (vLLM prompt lookup, k=7), dflash (vLLM + the exported drafter).",
                                  hash_default=False)
    generate_requests: int = f(4000, "`bench generate`: requests sent to the zero-latency server.", ge=1)
    generate_concurrency: int = f(64, "`bench generate`: requests in flight.", ge=1)
    recipe_steps: int = f(200, "`bench recipe`: training steps per variant (the cap when bench.cpu_minutes is set).", ge=1)
    recipe_variants: dict[str, Any] = f({}, "`bench recipe`: variant name → list of dotted overrides; "
                                        "empty (and no recipe_grid) = base, labels=data, no-features.")
    recipe_grid: dict[str, Any] = f({}, "`bench recipe`: dotted key → list of values; one variant `key=value` per "
                                    "value (one lever at a time), added to recipe_variants.", hash_default=False)
    cpu_minutes: float | None = f(None, "`bench recipe`: per-variant budget of process CPU-minutes for the optimizer "
                                  "steps (all threads; evaluation not charged): variants compare at equal CPU cost, "
                                  "not equal steps. null = bench.recipe_steps steps each.", hash_default=False, gt=0)
    recipe_eval_every: int = f(0, "`bench recipe`: a held-out evaluation every N steps of each variant (not charged "
                               "to bench.cpu_minutes), so every row carries its learning curve (`curve`: step, "
                               "supervised tokens, optimizer seconds, held-out τ, position-1); 0 = at the end only.",
                               hash_default=False)


@dataclass(kw_only=True)
class LearnSection:
    records: str | None = f(None, "`dflashkit learn`: the record dir to learn from (--records overrides).",
                            hash_default=False)
    rounds: int = f(1, "`dflashkit learn`: rounds to run (--rounds).", hash_default=False)
    every_minutes: float | None = f(None, "Start a round every this many minutes (--every); an empty window then "
                                    "waits for the next one instead of failing. null = back to back.",
                                    hash_default=False)
    drafter: str | None = f(None, "The drafter the first round fine-tunes (what serves before any promotion); "
                            "null = the run's train/best, else train/final.", hash_default=False)
    heldout_fraction: float = f(0.2, "Share of a round's records held out for scoring: the newest by time, never "
                                "trained on.", hash_default=False)
    heldout_min: int = f(2, "At least this many held-out records a round (one record always trains).",
                         hash_default=False)
    heldout_max: int = f(64, "At most this many held-out records a round.", hash_default=False)
    window: Literal["since_promotion", "round", "all"] = f(
        "since_promotion", "What a round trains on: `since_promotion` = every record since the serving drafter "
        "was promoted (a round that keeps the serving drafter leaves its traffic to the next one, so evidence "
        "accumulates until a candidate is shown better), earlier held-out slices included unless learn.heldout_pool "
        "pools them; `all` = every record learned so far, before and after promotions (the training set grows "
        "round by round), less the pooled held-out slices; `round` = only the records new since the last round. A "
        "round's own held-out slice is always the newest of its new records.",
        hash_default=False)
    warm_start: Literal["serving", "static"] = f(
        "serving", "What a round's candidate is fine-tuned from: `serving` = the drafter now serving (learning "
        "compounds round on round); `static` = the drafter before any promotion (learn.drafter), so each candidate "
        "is the static drafter plus the window's traffic, with no fine-tune stacked on another (pair with "
        "learn.window=all).", hash_default=False)
    max_epochs: float | None = f(
        None, "A round's passes over its training samples at most: its steps are min(the budget's or "
        "learn.max_steps, ceil(max_epochs × training samples / batch)); null = no cap. A small window trained for a "
        "whole budget repeats each sample tens of times and overfits it.", hash_default=False, gt=0, note=" (null = no cap)")
    heldout_pool: Literal["since_promotion", "round"] = f(
        "since_promotion", "What the promotion rule scores: `since_promotion` = this round's held-out slice and every "
        "held-out slice since the serving drafter was promoted (those records stay held out, never trained on, so "
        "the rule's evidence accumulates until a candidate is shown better); `round` = this round's slice only (a "
        "kept round's slice then trains later candidates under learn.window=since_promotion).", hash_default=False)
    score_anchors: int | None = f(
        None, "Blocks scored a sample when both comparisons (the promotion rule's and the curve's) score a drafter: "
        "null = every block the sample has; an int draws at most that many, as training does (train.num_anchors).",
        hash_default=False, ge=1, note=" (null = every block of a sample)")
    max_steps: int = f(50, "A round's optimizer steps at most (all of them without --budget or a saved "
                       "calibration).", hash_default=False)
    train_fraction: float = f(0.6, "With --budget: the share of the round's minutes given to training steps (the "
                              "saved calibration's step time sets the count).", hash_default=False)
    min_gain: float = f(0.0, "Promote only when the 5th percentile of the paired held-out τ gain (new − serving) "
                        "exceeds this.", hash_default=False)
    source_guard: bool = f(True, "Keep out a candidate whose paired held-out interval on any one source (the "
                           "record's `source`, else agent / chat) lies wholly below 0, however it scores pooled.",
                           hash_default=False)
    on_corrupt: Literal["skip", "fail"] = f("skip", "A corrupt record line: skip it (named file:line in the log "
                                            "and counted in round.json) or refuse the round (exit 2).",
                                            hash_default=False)
    compare_regenerate: bool = f(False, "Each round also trains a regenerate arm (never promoted): the window's "
                                 "training prompts answered again by the target offline, greedily, within half the "
                                 "round's CPU budget, then the serving drafter fine-tuned on those answers for the "
                                 "rest, and scored against the round's candidate on its held-out slice "
                                 "(round.json `regenerate_arm`; docs/flywheel.md).", hash_default=False)
    profile_prompts: int = f(4, "Held-out prompts decoded for the promoted drafter's speculation profile.",
                             hash_default=False)
    profile_max_new_tokens: int = f(32, "Tokens a profile prompt decodes.", hash_default=False)
    traffic: list[str] = f([], "`dflashkit flywheel`: prepared conversation files (prepare's JSONL) replayed as "
                           "traffic, interleaved file by file, learn.round_requests a round.", hash_default=False)
    round_requests: int = f(64, "`dflashkit flywheel`: requests replayed before each round.", hash_default=False)
    replay_max_tokens: int = f(96, "`dflashkit flywheel`: max_tokens of a replayed request.", hash_default=False)
    replay_concurrency: int = f(4, "`dflashkit flywheel`: replayed requests in flight.", hash_default=False)


@dataclass(kw_only=True)
class RunConfig:
    run: RunSection = sub(RunSection, "Run identity and directory.")
    target: TargetSection = sub(TargetSection, "The target model.")
    drafter: DrafterSection = sub(DrafterSection, "The drafter contract and architecture.")
    data: DataSection = sub(DataSection, "Prompt sources for `prepare`.")
    server: ServerSection = sub(ServerSection, "OpenAI-compatible server(s) for `generate`.")
    generate: GenerateSection = sub(GenerateSection, "Answer regeneration by the target.")
    tokenize: TokenizeSection = sub(TokenizeSection, "Chat-template rendering and loss masks.")
    capture: CaptureSection = sub(CaptureSection, "Offline target-feature shards.")
    train: TrainSection = sub(TrainSection, "Drafter training.")
    eval: EvalSection = sub(EvalSection, "Speculative-decoding evaluation.")
    export: ExportSection = sub(ExportSection, "Export of the trained drafter (z-lab or vLLM speculators format).")
    serve: ServeSection = sub(ServeSection, "`dflashkit serve`.")
    record: RecordSection = sub(RecordSection, "Recording served traffic (`serve.record_dir`, `dflashkit record`).")
    bench: BenchSection = sub(BenchSection, "`dflashkit bench`.")
    learn: LearnSection = sub(LearnSection, "`dflashkit learn`: rounds of fine-tuning on recorded traffic.")


family.reserve("knobs", DrafterSection)  # a family's knob or weight never takes over a common key
family.reserve("weights", TrainSection)
