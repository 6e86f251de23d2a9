"""All checks of a built config in one place: `problems(cfg)` lists every problem, each naming its key.

Usage:
    problems(cfg)                      # [] or ["train.lr: must be > 0, got 0", ...]

`loader.config_from_dict` runs it on every config it builds and raises one ConfigError listing them
all (exit 2), so a config with several mistakes is reported at once, before any stage runs. Pure
config checks belong here (ranges, cross-field rules, the recipe, tokenize and data options,
run.scale); a check that needs an artifact on disk (the probe contract, the tokenizer, a drafter
dir) stays where the artifact is read. No family key is named here: the `train.*` weights of the
run's family (`cfg.train.weights`) are checked by their declared ranges, and `drafter.type` and a family's knobs are the
family's to check (`dflashkit.family.config_problems`: the CLI runs it right after the config loads).
"""

from __future__ import annotations

import re

from pathlib import Path
from typing import Any

from dflashkit.config.schema import RunConfig, url_fields
from dflashkit.family.contract import layer_type_problems
from dflashkit.family.knobs import range_problems
from dflashkit.redact import redact_url


def _at_least(problems: list[str], prefix: str, section: Any, low: int, *names: str) -> None:
    """One problem `<prefix>.<name>: must be >= low, got v` per field `name` of `section` below `low`."""
    for name in names:
        value = getattr(section, name)
        if value < low:
            problems.append(f"{prefix}.{name}: must be >= {low}, got {value}")


def _on_path_problems(cfg: RunConfig) -> list[str]:
    """`train.on_path`: only with target labels; rollout needs the target's own decoder (not an engine's rows)."""
    t, p = cfg.train, []  # type: Any, list[str]
    if t.on_path == "off":
        return p
    if t.labels != "target":
        p.append(f"train.on_path: {t.on_path} needs train.labels=target (it corrects the target's labels on raw "
                 f"text), got train.labels={t.labels}")
    if t.on_path != "rollout":
        return p
    if t.features == "engine":
        p.append("train.on_path: rollout needs the target's greedy path, which train.features=engine does not "
                 "give (the engine returns next-token ids only); use train.on_path=mask")
    elif t.features == "cached" and cfg.capture.engine == "vllm":
        p.append("train.on_path: rollout needs path_ids in the feature shards, which capture.engine=vllm does not "
                 "write; use train.on_path=mask (or capture.engine=local)")
    if t.loss != "ce":
        p.append(f"train.on_path: rollout gives hard labels on the target's path, but train.loss={t.loss} also "
                 "distils the target's distribution after the raw tokens; use train.loss=ce or train.on_path=mask")
    if t.features == "online" and t.parallel.target == "shard":
        p.append("train.on_path: rollout online with train.parallel.target=shard is not supported (each rank "
                 "would decode a different number of path tokens through the sharded target); capture the "
                 "path first (train.features=cached) or use train.on_path=mask")
    return p


def problems(cfg: RunConfig) -> list[str]:
    """Cross-field checks; each message names its dotted key."""
    return (_drafter_problems(cfg) + _train_problems(cfg) + _capture_generate_problems(cfg)
            + _run_server_problems(cfg) + _eval_serve_bench_problems(cfg) + _tokenize_target_data_problems(cfg)
            + _stage_option_problems(cfg) + _range_problems(cfg) + _learn_problems(cfg))


def _learn_problems(cfg: RunConfig) -> list[str]:
    """`learn.*`: caps that would silently train or score a single step or block."""
    lc, p = cfg.learn, []
    if lc.max_epochs is not None and lc.max_epochs <= 0:
        p.append(f"learn.max_epochs: must be > 0 (null = no cap), got {lc.max_epochs}")
    if lc.score_anchors is not None and lc.score_anchors < 1:
        p.append(f"learn.score_anchors: must be >= 1 (null = every block of a sample), got {lc.score_anchors}")
    return p


def _drafter_problems(cfg: RunConfig) -> list[str]:
    """The `drafter.*` checks the families do not own."""
    p: list[str] = []
    d = cfg.drafter
    if d.block_size < 2:
        p.append(f"drafter.block_size: must be >= 2 (an anchor plus at least one drafted position), "
                 f"got {d.block_size}")
    elif d.block_size > cfg.tokenize.max_length:
        p.append(f"drafter.block_size: {d.block_size} is longer than the training context "
                 f"tokenize.max_length={cfg.tokenize.max_length}")
    if d.num_draft_layers < 1:
        p.append(f"drafter.num_draft_layers: must be >= 1, got {d.num_draft_layers}")
    if d.num_target_features is not None and d.num_target_features < 1:
        p.append(f"drafter.num_target_features: must be >= 1, got {d.num_target_features}")
    ids = d.target_layer_ids
    if ids is not None and len(ids) == 0:
        p.append("drafter.target_layer_ids: must not be empty (use null for the default)")
    elif ids is not None:
        if any(i < 0 for i in ids):
            p.append(f"drafter.target_layer_ids: layer ids are 0-based and >= 0, got {ids}")
        if len(set(ids)) != len(ids):
            p.append(f"drafter.target_layer_ids: duplicated ids in {ids}")
        elif list(ids) != sorted(ids):
            p.append(f"drafter.target_layer_ids: must be sorted ascending, got {ids} (did you mean "
                     f"{sorted(ids)}?)")
        if d.num_target_features is not None and len(ids) != d.num_target_features:
            p.append(f"drafter.target_layer_ids: {len(ids)} ids but drafter.num_target_features="
                     f"{d.num_target_features}; give one id per feature (or leave one of them null)")
    p.extend(layer_type_problems(d.layer_types, d.sliding_window, d.num_draft_layers, key="drafter.layer_types",
                                 window_key="drafter.sliding_window"))
    if d.init in ("", "none", "null"):
        p.append(f"drafter.init: {d.init!r} is not random, target or a drafter dir")
    if d.mask_token_id is not None and d.mask_token_id < 0:
        p.append(f"drafter.mask_token_id: must be >= 0, got {d.mask_token_id}")
    if d.draft_vocab_size is not None and d.draft_vocab_size < 0:
        p.append(f"drafter.draft_vocab_size: must be > 0 (null or 0 = the full target vocab), got "
                 f"{d.draft_vocab_size}")
    return p


def _train_problems(cfg: RunConfig) -> list[str]:
    """The `train.*` checks (the families' weights by their declared ranges)."""
    p: list[str] = []
    t = cfg.train
    p.extend(range_problems(t.weights, prefix="train."))  # the family's weights, by their declared ranges
    for name in ("lr", "batch_size", "grad_accum", "num_anchors", "loss_chunk_blocks"):
        if getattr(t, name) <= 0:
            p.append(f"train.{name}: must be > 0, got {getattr(t, name)}")
    if not 0 <= t.warmup_ratio < 1:
        p.append(f"train.warmup_ratio: must be in [0, 1), got {t.warmup_ratio}")
    if t.max_steps is not None and t.max_steps <= 0:
        p.append(f"train.max_steps: must be > 0, got {t.max_steps}")
    if t.train_samples is not None and t.train_samples <= 0:
        p.append(f"train.train_samples: must be > 0 (null = all), got {t.train_samples}")
    if len(t.betas) != 2:
        p.append(f"train.betas: expected two numbers, got {t.betas}")
    _at_least(p, "train", t, 0, "keep_checkpoints")
    _at_least(p, "train", t, 1, "engine_prefetch")
    p.extend(_on_path_problems(cfg))
    return p


def _capture_generate_problems(cfg: RunConfig) -> list[str]:
    """The `capture.*` and `generate.*` checks."""
    p: list[str] = []
    t = cfg.train
    if t.features == "engine" and cfg.capture.engine != "vllm":
        p.append("train.features: engine needs capture.engine=vllm (train starts vLLM for target.path) or "
                 "capture.server_url (a vLLM you run; set capture.engine=vllm too)")
    if not 0 < cfg.capture.max_disk_fraction <= 1:
        p.append(f"capture.max_disk_fraction: must be in (0, 1], got {cfg.capture.max_disk_fraction}")
    _at_least(p, "capture", cfg.capture, 1, "batch_size", "concurrency")
    extra = cfg.capture.extra_layer_ids
    if any(not isinstance(i, int) or i < 0 for i in extra):
        p.append(f"capture.extra_layer_ids: layer ids are 0-based and >= 0, got {extra}")
    elif len(set(extra)) != len(extra):
        p.append(f"capture.extra_layer_ids: duplicated ids in {extra}")
    if cfg.capture.server_url:
        if cfg.capture.engine != "vllm":
            p.append("capture.server_url: set, but capture.engine is local (set capture.engine=vllm)")
    g = cfg.generate
    _at_least(p, "generate", g, 1, "concurrency")
    _at_least(p, "generate", g, 0, "temperature")
    if not 0 < g.top_p <= 1:
        p.append(f"generate.top_p: must be in (0, 1], got {g.top_p}")
    _at_least(p, "generate", g, 1, "max_tokens", "shard_size")
    _at_least(p, "generate", g, 0, "max_retries", "backoff_s")
    return p


def _run_server_problems(cfg: RunConfig) -> list[str]:
    """The `run.*`, `server.*` and URL checks."""
    p: list[str] = []
    if not cfg.run.scale > 0:
        p.append(f"run.scale: must be > 0, got {cfg.run.scale}")
    if cfg.run.budget_minutes is not None and not 0 < cfg.run.budget_minutes < float("inf"):
        p.append(f"run.budget_minutes: must be a number of minutes > 0 (or null: no budget), got {cfg.run.budget_minutes}")
    elif cfg.run.budget_minutes is not None and cfg.run.scale != 1.0:  # the budget sizes the run; scale multiplies sizes
        p.append(f"run.scale={cfg.run.scale:g} with run.budget_minutes={cfg.run.budget_minutes:g}: choose one")
    for name in ("timeout_s", "startup_timeout_s"):
        if not getattr(cfg.server, name) > 0:
            p.append(f"server.{name}: must be > 0, got {getattr(cfg.server, name)}")
    for key, url in url_fields(cfg):  # every field marked url=True in the schema, by one rule
        problem = url_problem(url, key_env=API_KEY_ENVS.get(key.split("[")[0]))
        if problem:
            p.append(f"{key}: {problem}")
    return p


def _eval_serve_bench_problems(cfg: RunConfig) -> list[str]:
    """The `eval.*`, `serve.*` and `bench.*` checks."""
    p: list[str] = []
    if cfg.eval.top_k < 0:
        p.append(f"eval.top_k: must be >= 0 (0 = off), got {cfg.eval.top_k}")
    _at_least(p, "eval", cfg.eval, 1, "num_prompts", "max_new_tokens")
    _at_least(p, "eval", cfg.eval, 0, "warmup")
    sv = cfg.serve
    if not 0 <= sv.port <= 65535:
        p.append(f"serve.port: must be in 0..65535 (0 = any free port), got {sv.port}")
    _at_least(p, "serve", sv, 1, "max_batch", "max_new_tokens")
    _at_least(p, "serve", sv, 0, "batch_wait_ms")
    b = cfg.bench
    _at_least(p, "bench", b, 1, "requests", "max_tokens", "generate_requests", "generate_concurrency")
    if b.cpu_minutes is not None and not b.cpu_minutes > 0:
        p.append(f"bench.cpu_minutes: must be > 0 (or null), got {b.cpu_minutes}")
    _at_least(p, "bench", b, 1, "recipe_steps")
    for i, m in enumerate(b.engine_methods):
        if m not in ("dflashkit", "ar", "ngram", "dflash"):
            p.append(f"bench.engine_methods[{i}]: {m!r} is not one of dflashkit, ar, ngram, dflash")
    for i, c in enumerate(b.concurrency):
        if c < 1:
            p.append(f"bench.concurrency[{i}]: must be >= 1, got {c}")
    p += recipe_variant_problems(b.recipe_variants)
    _at_least(p, "eval", cfg.eval, 0, "temperature")
    if not 0 < cfg.eval.top_p <= 1:
        p.append(f"eval.top_p: must be in (0, 1], got {cfg.eval.top_p}")
    if not 0 <= cfg.eval.confidence_threshold <= 1:
        p.append(f"eval.confidence_threshold: must be in [0, 1], got {cfg.eval.confidence_threshold}")
    if not 0 <= cfg.serve.confidence_threshold <= 1:
        p.append(f"serve.confidence_threshold: must be in [0, 1], got {cfg.serve.confidence_threshold}")
    _at_least(p, "eval", cfg.eval, 1, "prompt_lookup_ngram")
    if cfg.eval.tie_tolerance is not None and cfg.eval.tie_tolerance < 0:
        p.append(f"eval.tie_tolerance: must be >= 0 (or null), got {cfg.eval.tie_tolerance}")
    for i, size in enumerate(cfg.eval.block_sizes):
        if size < 1:
            p.append(f"eval.block_sizes[{i}]: must be >= 1, got {size}")
    for i, gate in enumerate(cfg.eval.hybrid_gates):
        if gate < 0:
            p.append(f"eval.hybrid_gates[{i}]: must be >= 0 (a match length in tokens; 0 = any match), got {gate}")
    for i, block in enumerate(cfg.eval.hybrid_drafter_blocks):
        if block != 0 and block < 2:
            p.append(f"eval.hybrid_drafter_blocks[{i}]: must be 0 (the grid's block size) or >= 2, got {block}")
    return p


def _tokenize_target_data_problems(cfg: RunConfig) -> list[str]:
    """The `tokenize.*`, `target.*` and `data.*` checks."""
    p: list[str] = []
    _at_least(p, "tokenize", cfg.tokenize, 0, "agreement_samples")
    for name in ("min_agreement", "max_prompt_mismatch"):
        if not 0 <= getattr(cfg.tokenize, name) <= 1:
            p.append(f"tokenize.{name}: must be in [0, 1], got {getattr(cfg.tokenize, name)}")
    _at_least(p, "tokenize", cfg.tokenize, 8, "max_length")
    if cfg.target.chat_template:
        problem = chat_template_problem(cfg.target.chat_template)
        if problem:
            p.append(f"target.chat_template: {problem}")
    for i, s in enumerate(cfg.data.sources):
        if not s.path:
            p.append(f"data.sources[{i}].path: required")
        if s.weight <= 0:
            p.append(f"data.sources[{i}].weight: must be > 0, got {s.weight}")
    return p


def _values(cfg: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of every leaf of a config, list items as `key[i]` (sections and lists walked)."""
    import dataclasses

    out: list[tuple[str, Any]] = []
    for fl in dataclasses.fields(cfg):
        key, value = f"{prefix}{fl.name}", getattr(cfg, fl.name)
        if dataclasses.is_dataclass(value):
            out += _values(value, key + ".")
        elif isinstance(value, list):
            for i, v in enumerate(value):
                out += _values(v, f"{key}[{i}].") if dataclasses.is_dataclass(v) else [(f"{key}[{i}]", v)]
        else:
            out.append((key, value))
    return out


def template_kwargs_problems(key: str, kwargs: dict) -> list[str]:
    """A `chat_template_kwargs` mapping's keys that are not strings (YAML reads an unquoted `1`, `true` or
    `null` key as a number, bool or null): template variables are names, and a key turned into one by the
    config's JSON round trip ("1", "true") names no variable the template reads."""
    return [f"{key}: the key {k!r} is {type(k).__name__}, not a template variable's name (YAML reads the "
            f"unquoted key that way); write the variable's name, quoted if it must be {str(k)!r}"
            for k in kwargs if not isinstance(k, str)]


def raw_template_kwargs_problems(data: Any, prefix: str = "") -> list[str]:
    """`template_kwargs_problems` of every `chat_template_kwargs` in a config's raw YAML data (sections, lists
    and `data.sources[i]` walked), before anything turns its keys into strings."""
    out: list[str] = []
    if isinstance(data, dict):
        for k, v in data.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            if k == "chat_template_kwargs" and isinstance(v, dict):
                out += template_kwargs_problems(key, v)
            else:
                out += raw_template_kwargs_problems(v, key)
    elif isinstance(data, list):
        for i, v in enumerate(data):
            out += raw_template_kwargs_problems(v, f"{prefix}[{i}]")
    return out


def _range_problems(cfg: RunConfig) -> list[str]:
    """The rules every field obeys (no number is nan or inf, no string holds a NUL byte: no path or name
    can), then the ranges the other checks do not cover."""
    import math

    p: list[str] = []
    for key, v in _values(cfg):
        if isinstance(v, float) and not math.isfinite(v):
            p.append(f"{key}: must be a finite number, got {v}")
        elif isinstance(v, str) and "\x00" in v:
            p.append(f"{key}: contains a NUL byte (\\x00), which no path or name can hold: {v!r}")
        elif key.endswith("chat_template_kwargs") and isinstance(v, dict):  # an override's, kept as parsed
            p += template_kwargs_problems(key, v)
    if p:
        return p
    t = cfg.train
    if not 0 <= t.muon_momentum < 1:
        p.append(f"train.muon_momentum: must be in [0, 1) (the share of the last update kept), got {t.muon_momentum}")
    if not t.forecast_tau > 1:
        p.append(f"train.forecast_tau: must be > 1 (τ counts the bonus token: τ 1 is decoding without a drafter), "
                 f"got {t.forecast_tau}")
    if not 0 <= t.min_lr_ratio <= 1:
        p.append(f"train.min_lr_ratio: must be in [0, 1], got {t.min_lr_ratio}")
    if len(t.betas) == 2 and not all(0 <= b < 1 for b in t.betas):
        p.append(f"train.betas: each must be in [0, 1), got {t.betas}")
    for name in ("weight_decay", "grad_clip", "kl_weight"):
        if getattr(t, name) < 0:
            p.append(f"train.{name}: must be >= 0, got {getattr(t, name)}")
    if t.gamma is not None and not t.gamma > 0:
        p.append(f"train.gamma: must be > 0 (or null), got {t.gamma}")
    if cfg.drafter.rms_norm_eps is not None and not cfg.drafter.rms_norm_eps > 0:
        p.append(f"drafter.rms_norm_eps: must be > 0 (or null), got {cfg.drafter.rms_norm_eps}")
    if not cfg.export.check_atol > 0:
        p.append(f"export.check_atol: must be > 0, got {cfg.export.check_atol}")
    return p


def _stage_option_problems(cfg: RunConfig) -> list[str]:
    """The recipe, tokenize and data options once checked only when their stage ran (train, tokenize,
    prepare), so a config with mistakes in several of them was reported one stage at a time."""
    p: list[str] = []
    for key in ("tool_call_parser", "reasoning_parser"):  # a name vLLM knows, never a flag or a path
        name = getattr(cfg.server, key)
        if name is not None and not re.fullmatch(r"[A-Za-z0-9_]+", name):
            p.append(f"server.{key}: {name!r} is not a parser name (letters, digits and _, e.g. hermes, kimi_k2)")
    t = cfg.train
    if not 0 < t.dpace_alpha <= 1:
        p.append(f"train.dpace_alpha {t.dpace_alpha} is outside (0, 1]")
    if not t.kl_temperature > 0:
        p.append(f"train.kl_temperature {t.kl_temperature} must be > 0")
    if t.anchor_coverage is not None and not 0 < t.anchor_coverage <= 1:
        p.append(f"train.anchor_coverage {t.anchor_coverage} is outside (0, 1]")
    if t.pack_length is not None and t.pack_length < 2:
        p.append(f"train.pack_length {t.pack_length} must be >= 2 tokens (or null = tokenize.max_length)")
    if t.pack and t.features == "engine":
        p.append("train.pack supports train.features=cached or online (got engine): run `dflashkit capture` and "
                 "set train.features=cached, or drop train.pack")
    if t.optimizer == "muon" and t.parallel.mode == "fsdp":
        p.append("train.optimizer=muon does not support train.parallel.mode=fsdp (use ddp or none)")
    if not t.feature_noise >= 0:
        p.append(f"train.feature_noise {t.feature_noise} is negative")
    if not 0 <= t.suffix_complement_weight < 1:
        p.append(f"train.suffix_complement_weight {t.suffix_complement_weight} is outside [0, 1) "
                 "(1 would change nothing: set train.suffix_complement=off)")
    if t.suffix_complement_min_match < 1:
        p.append(f"train.suffix_complement_min_match {t.suffix_complement_min_match} must be >= 1")
    _at_least(p, "tokenize", cfg.tokenize, 1, "shard_size", "batch_size")
    d = cfg.data
    if d.num_prompts is not None and d.num_prompts <= 0:
        p.append(f"data.num_prompts: must be > 0 or null, got {d.num_prompts}")
    _at_least(p, "data", d, 0, "heldout")
    _at_least(p, "data", d, 1, "max_turns", "max_prompt_chars")
    return p


VARIANT_NAME = r"[A-Za-z0-9][A-Za-z0-9._=+,-]{0,63}"  # one path component under bench/recipe/, never `..`


def recipe_variant_problems(variants: dict[str, Any]) -> list[str]:
    """`bench.recipe_variants`: each name a plain folder name (it becomes `bench/recipe/<name>/`), each
    value a list of `key=value` strings (a bare string would be read character by character)."""
    import re

    p = []
    for name, over in variants.items():
        key = f"bench.recipe_variants.{name}"
        if not isinstance(name, str):  # YAML reads off/on/yes/no/true as booleans, 1e-3 as a number
            p.append(f"{key}: YAML read this variant name as {type(name).__name__} {name!r}, not as the name you "
                     f"wrote (off, on, yes, no and true are booleans there); quote it, e.g. {{'off': [...]}}")
        elif not re.fullmatch(VARIANT_NAME, name) or ".." in name:
            p.append(f"{key}: the variant name becomes the folder bench/recipe/<name>/ and must be a plain name "
                     f"(letters, digits, . _ = + , -; no '/', no '..'), got {name!r}")
        if isinstance(over, str):
            p.append(f"{key}: expected a list of key=value overrides, got the string {over!r} "
                     f"(write [{over}])")
        elif not isinstance(over, list):
            p.append(f"{key}: expected a list of key=value overrides, got {over!r}")
        else:
            for i, o in enumerate(over):
                if not isinstance(o, str) or "=" not in o:
                    p.append(f"{key}[{i}]: expected a key=value override such as train.lr=1e-3, got {o!r}")
    return p


def chat_template_problem(path: str) -> str | None:
    """Why the Jinja chat template file at `path` cannot be used (missing, not UTF-8, a syntax error
    named `file:line`), or None. Parsed the way transformers compiles templates (loop controls and
    its `{% generation %}` tag allowed); nothing is rendered."""
    import jinja2
    from jinja2.ext import Extension

    class _Generation(Extension):  # transformers' assistant-mask tag: parse its body, ignore the tag
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    p = Path(path).expanduser()
    if not p.is_file():
        return f"file not found: {p}"
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        return f"{p}: not UTF-8 (byte at offset {e.start})"
    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols", _Generation]).compile(text)
    except jinja2.TemplateSyntaxError as e:  # TemplateAssertionError (an unknown filter or test) is one too
        kind = "syntax error" if type(e) is jinja2.TemplateSyntaxError else "error"
        return f"{p}:{e.lineno}: Jinja {kind}: {e.message}"
    return None


API_KEY_ENVS = {"server.urls": "server.api_key_env", "record.upstream": "record.api_key_env"}
"""The key naming the variable whose API key goes to the servers of a URL key (the others send none)."""


def url_problem(url: str, *, key_env: str | None = "server.api_key_env") -> str | None:
    """Why `url` cannot be an OpenAI-compatible base URL, or None (scheme http/https, a host, a valid port, no
    query or fragment); the URL is shown redacted. `key_env`: the key naming the API key's variable for this URL
    (None: its requests carry no API key), named when the URL carries a query."""
    from urllib.parse import urlsplit

    if "://" not in url:
        shown = redact_url(url)
        return (f"{shown!r} has no scheme (it would not reach the port you meant); write "
                f"'http://{shown}'")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        return f"{redact_url(url)!r}: {e}"
    if parts.scheme not in ("http", "https"):
        return f"{redact_url(url)!r}: scheme {parts.scheme!r} is not http or https"
    if not parts.hostname:
        return f"{redact_url(url)!r} has no host"
    if port is not None and port == 0:
        return f"{redact_url(url)!r}: port 0 is not a server port"
    if parts.query or parts.fragment:  # `?api_key=…`: the API paths would land after it
        return (f"{redact_url(url)!r}: a base URL cannot carry a query or fragment (dflashkit appends /models, "
                "/chat/completions … to it); "
                + (f"give the API key through the variable {key_env} names (sent as a Bearer token), or "
                   if key_env else "these requests send no API key; give ")
                + "user:password@ for HTTP Basic auth")
    return None
