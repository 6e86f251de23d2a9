"""All checks of a built config in one place: `problems(cfg)` lists every problem, each naming its key.

Usage:
    problems(cfg)                      # [] or ["train.lr: must be > 0, got 0", ...]

`loader.config_from_dict` runs it on every config it builds and raises one ConfigError listing them
all (exit 2), so a config with several mistakes is reported at once, before any stage runs. A field's range
is declared where the field is (`schema.f(..., ge=, gt=, le=, lt=)`, as a family declares its knobs' and
weights'), and one walk checks them all (`declared_range_problems`, after every number is known to be
finite); what is written here are the rules no single field's range says: between fields (train.on_path
against the labels and features, a block longer than the context), the shape of a list (sorted, no
duplicates), names (parsers, recipe variants, URLs) and files (a chat template). A check that needs an
artifact on disk (the probe contract, the tokenizer, a drafter dir) stays where the artifact is read. No
family key is named here: `drafter.type` and a family's knobs are the family's to check
(`dflashkit.family.config_problems`: the CLI runs it right after the config loads).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Iterator

from dflashkit.config.schema import RunConfig, url_fields
from dflashkit.family.contract import layer_type_problems
from dflashkit.family.knobs import range_problems
from dflashkit.redact import redact_url


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
            + _stage_option_problems(cfg) + _range_problems(cfg))


def _drafter_problems(cfg: RunConfig) -> list[str]:
    """The `drafter.*` checks the families do not own."""
    p: list[str] = []
    d = cfg.drafter
    if 2 <= d.block_size and d.block_size > cfg.tokenize.max_length:
        p.append(f"drafter.block_size: {d.block_size} is longer than the training context "
                 f"tokenize.max_length={cfg.tokenize.max_length}")
    ids = d.target_layer_ids
    if ids is not None and len(ids) == 0:
        p.append("drafter.target_layer_ids: must not be empty (use null for the default)")
    elif ids is not None:
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
    return p


def _train_problems(cfg: RunConfig) -> list[str]:
    """The `train.*` rules between fields (every field's range is declared in the schema)."""
    p: list[str] = []
    t = cfg.train
    if len(t.betas) != 2:
        p.append(f"train.betas: expected two numbers, got {t.betas}")
    p.extend(_on_path_problems(cfg))
    return p


def _capture_generate_problems(cfg: RunConfig) -> list[str]:
    """The `capture.*` and `generate.*` checks."""
    p: list[str] = []
    t = cfg.train
    if t.features == "engine" and cfg.capture.engine != "vllm":
        p.append("train.features: engine needs capture.engine=vllm (train starts vLLM for target.path) or "
                 "capture.server_url (a vLLM you run; set capture.engine=vllm too)")
    extra = cfg.capture.extra_layer_ids
    if len(set(extra)) != len(extra):
        p.append(f"capture.extra_layer_ids: duplicated ids in {extra}")
    if cfg.capture.server_url:
        if cfg.capture.engine != "vllm":
            p.append("capture.server_url: set, but capture.engine is local (set capture.engine=vllm)")
    return p


def _run_server_problems(cfg: RunConfig) -> list[str]:
    """The `run.*`, `server.*` and URL checks."""
    p: list[str] = []
    if cfg.run.budget_minutes is not None and cfg.run.budget_minutes > 0 and cfg.run.scale != 1.0:  # the budget sizes the run; scale multiplies sizes
        p.append(f"run.scale={cfg.run.scale:g} with run.budget_minutes={cfg.run.budget_minutes:g}: choose one")
    for key, url in url_fields(cfg):  # every field marked url=True in the schema, by one rule
        problem = url_problem(url, key_env=API_KEY_ENVS.get(key.split("[")[0]))
        if problem:
            p.append(f"{key}: {problem}")
    return p


def _eval_serve_bench_problems(cfg: RunConfig) -> list[str]:
    """The `eval.*`, `serve.*` and `bench.*` checks."""
    p: list[str] = []
    b = cfg.bench
    for i, m in enumerate(b.engine_methods):
        if m not in ("dflashkit", "ar", "ngram", "dflash"):
            p.append(f"bench.engine_methods[{i}]: {m!r} is not one of dflashkit, ar, ngram, dflash")
    p += recipe_variant_problems(b.recipe_variants)
    for i, block in enumerate(cfg.eval.hybrid_drafter_blocks):
        if block != 0 and block < 2:
            p.append(f"eval.hybrid_drafter_blocks[{i}]: must be 0 (the grid's block size) or >= 2, got {block}")
    return p


def _tokenize_target_data_problems(cfg: RunConfig) -> list[str]:
    """The `tokenize.*`, `target.*` and `data.*` checks."""
    p: list[str] = []
    if cfg.target.chat_template:
        problem = chat_template_problem(cfg.target.chat_template)
        if problem:
            p.append(f"target.chat_template: {problem}")
    for i, s in enumerate(cfg.data.sources):
        if not s.path:
            p.append(f"data.sources[{i}].path: required")
    return p


def _sections(section: Any, prefix: str = "", flat: str | None = None) -> Iterator[tuple[Any, str, str | None]]:
    """(section, its key prefix, the family settings part it holds or None) of `section` and of every section
    under it: nested sections, the sections of a list (`data.sources[i].`), and a family's knobs / weights under
    their section's own prefix (their fields are the flat `drafter.*` / `train.*` keys users write)."""
    yield section, prefix, flat
    for fl in dataclasses.fields(section):
        value = getattr(section, fl.name)
        if dataclasses.is_dataclass(value):
            part = fl.metadata.get("flat")
            yield from _sections(value, prefix if part else f"{prefix}{fl.name}.", part)
        elif isinstance(value, list):
            for i, v in enumerate(value):
                if dataclasses.is_dataclass(v):
                    yield from _sections(v, f"{prefix}{fl.name}[{i}].")


def _values(cfg: Any) -> list[tuple[str, Any]]:
    """(dotted key, value) of every leaf of a config, list items as `key[i]` (`_sections` walked)."""
    out: list[tuple[str, Any]] = []
    for section, prefix, _ in _sections(cfg):
        for fl in dataclasses.fields(section):
            key, value = f"{prefix}{fl.name}", getattr(section, fl.name)
            if isinstance(value, list):
                out += [(f"{key}[{i}]", v) for i, v in enumerate(value) if not dataclasses.is_dataclass(v)]
            elif not dataclasses.is_dataclass(value):
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
    return declared_range_problems(cfg)


def declared_range_problems(cfg: Any) -> list[str]:
    """Every field outside the range the schema declares for it (`schema.f`'s `ge`/`gt`/`le`/`lt`), in every
    section `_sections` walks, the family's `train.*` weights included; the family's `drafter.*` knobs are its own
    to check (`family.config_problems`)."""
    return [problem for section, prefix, part in _sections(cfg) if part != "knobs"
            for problem in range_problems(section, prefix=prefix)]


def _stage_option_problems(cfg: RunConfig) -> list[str]:
    """The recipe, tokenize and data options once checked only when their stage ran (train, tokenize,
    prepare), so a config with mistakes in several of them was reported one stage at a time."""
    p: list[str] = []
    for key in ("tool_call_parser", "reasoning_parser"):  # a name vLLM knows, never a flag or a path
        name = getattr(cfg.server, key)
        if name is not None and not re.fullmatch(r"[A-Za-z0-9_]+", name):
            p.append(f"server.{key}: {name!r} is not a parser name (letters, digits and _, e.g. hermes, kimi_k2)")
    t = cfg.train
    if t.pack and t.features == "engine":
        p.append("train.pack supports train.features=cached or online (got engine): run `dflashkit capture` and "
                 "set train.features=cached, or drop train.pack")
    if t.optimizer == "muon" and t.parallel.mode == "fsdp":
        p.append("train.optimizer=muon does not support train.parallel.mode=fsdp (use ddp or none)")
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
