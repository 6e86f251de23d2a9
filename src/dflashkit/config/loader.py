"""The config loader: strict build from YAML/dicts, dotted overrides, dump, hashing, the docs reference.

Usage:
    cfg = load_config("run.yaml", ["train.lr=3e-4", "drafter.block_size=8"])
    cfg.train.lr                       # 0.0003
    dump_config(cfg)                   # resolved YAML text (written to <run_dir>/config.resolved.yaml)

Rules: dataclass defaults < YAML < overrides. Unknown keys are errors with a "did you mean";
all problems are reported at once, each naming its dotted key (the checks: `validate.problems`).
The schema itself (sections, fields, defaults, help) is `schema.py`.

A drafter family's knobs and weights are written as flat keys of their section (`drafter.selector_rank`,
`train.dspark_markov_loss_weight`): the registry names them (`family.setting_fields`). They are built into
the section's `flat` field as the settings class of `drafter.type`'s family; another family's key is
refused naming it (`family.foreign_setting`) unless it holds its default, which a dump leaves there: the
dump, `config_to_dict`, the section hash and docs/config.md list every registered family's keys, flat, in
registry order, as the schema did when it was built from the registry.
"""

from __future__ import annotations

import contextvars
import dataclasses
import difflib
import functools
import json
import types
import typing
from pathlib import Path
from typing import Any, Callable, Literal, get_args, get_origin

import yaml

from dflashkit import family
from dflashkit.config.schema import RunConfig
from dflashkit.config_hash import _hashed, section_hash  # noqa: F401 - re-exported (the config's API)
from dflashkit.config.validate import problems as validation_problems
from dflashkit.config.validate import raw_template_kwargs_problems
from dflashkit.errors import ConfigError, UsageError
from dflashkit.redact import redact_text, redact_url
from dflashkit.textfile import read_utf8

# --------------------------------------------------------------------------------------------
# Strict build
# --------------------------------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin is not None:
        return getattr(origin, "__name__", str(origin)) + "[" + ", ".join(_type_name(a) for a in get_args(tp)) + "]"
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str, problems: list[str]) -> Any:
    """Return `value` converted to `tp`, or append a problem naming `key`."""
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            problems.append(f"{key}: expected a mapping, got {type(value).__name__}")
            return None
        return _build(typing.cast(type, tp), value, key, problems)
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        trial: list[str] = []
        for arg in non_none:
            trial = []
            out = _coerce(value, arg, key, trial)
            if not trial:
                return out
        problems.append(trial[0] if len(non_none) == 1 else f"{key}: expected {_type_name(tp)}, got {value!r}")
        return None
    if origin is Literal:
        choices = get_args(tp)
        if value in choices and not (isinstance(value, bool) and True in choices):
            return value
        if isinstance(value, bool):  # YAML 1.1 reads `true`/`yes`/`on` and `false`/`no`/`off` as bools
            spelt = [w for w in (("true", "yes", "on") if value else ("false", "no", "off")) if w in choices]
            if len(spelt) == 1:
                return spelt[0]
        hint = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        problems.append(f"{key}: {value!r} is not one of {list(choices)}"
                        + (f" (did you mean {hint[0]!r}?)" if hint else ""))
        return None
    if origin is list:
        if not isinstance(value, list):
            problems.append(f"{key}: expected a list, got {value!r}")
            return None
        (item_tp,) = get_args(tp)
        return [_coerce(v, item_tp, f"{key}[{i}]", problems) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            problems.append(f"{key}: expected a mapping, got {value!r}")
            return None
        return dict(value)
    if tp is Any:
        return value
    if value is None:
        problems.append(f"{key}: must not be null (expected {_type_name(tp)})")
        return None
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    problems.append(f"{key}: expected {_type_name(tp)}, got {value!r}")
    return None


@functools.cache
def _fields(cls: type) -> tuple[dict[str, Any], list[str]]:
    """A section's resolved field types and names (resolved once: a list of sections builds many)."""
    return typing.get_type_hints(cls), [fl.name for fl in dataclasses.fields(cls)]


# the family whose settings the config being built holds (`drafter.type`'s; None: not a family)
_FAMILY: contextvars.ContextVar[family.Family | None] = contextvars.ContextVar("family", default=None)


def _flat_field(cls: type) -> tuple[str, str] | None:
    """(name, part) of the section's field holding a family's settings (`schema.settings_field`), if any."""
    return next(((fl.name, fl.metadata["flat"]) for fl in dataclasses.fields(cls) if fl.metadata.get("flat")), None)


def _build(cls: type, data: dict, prefix: str, problems: list[str]) -> Any:
    hints, names = _fields(cls)
    flat = _flat_field(cls)
    settings = family.setting_fields(flat[1]) if flat else {}
    shown = [n for n in names if not flat or n != flat[0]] + list(settings)
    fam, own = _FAMILY.get(), dict[str, Any]()
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if flat and key in settings:
            _setting(fam, flat[1], key, value, dotted, own, problems)
            continue
        if key not in names or (flat and key == flat[0]):
            close = difflib.get_close_matches(str(key), shown, n=1, cutoff=0.6)
            problems.append(f"{dotted}: unknown key" + (f" (did you mean {prefix + '.' if prefix else ''}"
                                                        f"{close[0]}?)" if close else
                                                        f"; valid keys: {', '.join(shown)}"))
            continue
        kwargs[key] = _coerce(value, hints[key], dotted, problems)
    if problems:
        # Still build so later checks can run; invalid values are replaced by defaults.
        kwargs = {k: v for k, v in kwargs.items() if v is not None or _allows_none(hints[k])}
    if flat:
        cls_of = getattr(fam or family.DEFAULT, flat[1])
        kwargs[flat[0]] = cls_of(**{k: v for k, v in own.items() if v is not None or _allows_none(_fields(cls_of)[0][k])})
    return cls(**kwargs)


def _setting(fam: family.Family | None, part: str, key: str, value: Any, dotted: str, own: dict[str, Any],
             problems: list[str]) -> None:
    """A flat family key of a section: into `own` when `fam` (the run's family) reads it, else checked against its
    declaring family's type and refused when set to other than its default (`family.foreign_setting`)."""
    mine = fam is not None and any(fl.name == key for fl in dataclasses.fields(getattr(fam, part)))
    declaring = getattr(fam, part) if fam is not None and mine else getattr(family.setting_fields(part)[key][0], part)
    trial: list[str] = []
    coerced = _coerce(value, _fields(declaring)[0][key], dotted, trial)
    problems += trial
    if mine:
        own[key] = coerced
    elif fam is not None and not trial:
        foreign = family.foreign_setting(fam, dotted.rsplit(".", 1)[0], key, coerced)
        if foreign:
            problems.append(foreign)


def _allows_none(tp: Any) -> bool:
    return get_origin(tp) in (typing.Union, types.UnionType) and type(None) in get_args(tp)


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b=value` → ("a.b", yaml-parsed value)."""
    if "=" not in text:
        raise UsageError(f"override {text!r} is not key=value", hint="e.g. train.lr=3e-4")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def _set_dotted(data: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        nxt = node.get(part)
        if not isinstance(nxt, dict):
            nxt = {}
            node[part] = nxt
        node = nxt
    node[parts[-1]] = value


def config_from_dict(data: dict, overrides: list[str] | None = None, *, source: str = "<dict>",
                     checks: Callable[[RunConfig], list[str]] | None = None) -> RunConfig:
    """Build and validate a RunConfig; raises ConfigError listing every problem.

    `checks`: more checks from the rooms above this one, listed with the config's own (the CLI hands the
    drafter families' `drafter.*` checks, `dflashkit.family.config_problems`)."""
    problems: list[str] = raw_template_kwargs_problems(data)  # before JSON turns a key 1 into "1"
    data = json.loads(json.dumps(data or {}, default=str))
    for ov in overrides or []:
        key, value = parse_override(ov)
        _set_dotted(data, key, value)
    for name in ("drafter", "train"):  # built even when absent: their settings are drafter.type's family's
        data.setdefault(name, {})
    drafter = data.get("drafter")
    kind = drafter.get("type", family.DEFAULT.name) if isinstance(drafter, dict) else family.DEFAULT.name
    token = _FAMILY.set(family.FAMILIES.get(kind) if isinstance(kind, str) else None)
    try:
        cfg = _build(RunConfig, data, "", problems)
    finally:
        _FAMILY.reset(token)
    if not problems:
        problems = validation_problems(cfg) + (checks(cfg) if checks is not None else [])
    if problems:  # a message may quote a bad value: a URL's secrets never reach it
        raise ConfigError([redact_text(p) for p in problems], hint=f"fix {source} or the key=value overrides; `docs/config.md` "
                          "lists every key")
    return cfg


def load_config(path: str | Path | None, overrides: list[str] | None = None, *,
                checks: Callable[[RunConfig], list[str]] | None = None) -> RunConfig:
    """Read YAML (or start from defaults when `path` is None) and apply dotted overrides (`checks`: as
    `config_from_dict`). A plugin drafter family that did not load is raised first (its keys would read as
    unknown ones)."""
    if family.PLUGIN_ERROR is not None:
        raise family.PLUGIN_ERROR
    data: dict = {}
    if path is not None:
        p = Path(path)
        if p.is_dir():
            raise UsageError(f"-c {p}: is a directory, not a YAML file", hint="pass -c path/to/run.yaml")
        if not p.is_file():
            raise UsageError(f"config file not found: {p}", hint="pass -c path/to/run.yaml")
        text = read_utf8(p, "config file")
        try:
            data = _load_yaml(text, p)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            if mark is not None:
                where = f"{p}:{mark.line + 1}:{mark.column + 1}"
            elif isinstance(e, yaml.reader.ReaderError):  # a character YAML refuses: its offset into the text
                line = text.count("\n", 0, e.position) + 1
                where = f"{p}:{line}:{e.position - (text.rfind(chr(10), 0, e.position) + 1) + 1}"
            else:
                where = str(p)
            what = getattr(e, "problem", None) or (e.reason if isinstance(e, yaml.reader.ReaderError) else e)
            raise UsageError(f"{where}: invalid YAML ({what})") from None
        if not isinstance(data, dict):
            raise UsageError(f"{p}: top level must be a mapping of sections, got {type(data).__name__}")
    cfg = config_from_dict(data, overrides, source=str(path) if path else "the overrides", checks=checks)
    keys = set(_leaf_keys(data))
    for ov in overrides or []:
        key, value = parse_override(ov)
        keys |= {key} | set(_leaf_keys(value, key))
    set_given_keys(cfg, keys)
    return cfg


def _load_yaml(text: str, path: Path) -> dict:
    """Parse `text` once (libyaml's parser where PyYAML has it), refuse duplicate keys, then build it."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return {}
        _refuse_duplicate_keys(node, path)
        return loader.construct_document(node) or {}
    finally:
        loader.dispose()


_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _refuse_duplicate_keys(node: Any, path: Path) -> None:
    """Exit 2 naming every key given twice in one mapping, at any depth (a second `train:` section
    included), with both lines: YAML would silently keep only the last. Walks PyYAML's node tree."""
    found: list[str] = []

    def walk(n: Any, prefix: str) -> None:
        if isinstance(n, yaml.MappingNode):
            seen: dict[str, int] = {}
            for k, v in n.value:
                if k.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` merges; it is not a key
                    continue
                name = str(k.value)
                key = f"{prefix}.{name}" if prefix else name
                line = k.start_mark.line + 1
                if name in seen:
                    found.append(f"{path}:{line}: `{key}` is given twice (first at line {seen[name]}); YAML "
                                 "would keep only this one")
                else:
                    seen[name] = line
                walk(v, key)
        elif isinstance(n, yaml.SequenceNode):
            for i, v in enumerate(n.value):
                walk(v, f"{prefix}[{i}]")

    walk(node, "")
    if found:
        raise ConfigError(found, hint=f"keep one of each in {path} (merge the two sections into one)")


def _leaf_keys(data: Any, prefix: str = "") -> list[str]:
    if not isinstance(data, dict):
        return [prefix] if prefix else []
    out = []
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        out += [key] + _leaf_keys(v, key)
    return out


def set_given_keys(cfg: RunConfig, keys: set[str] | frozenset[str]) -> None:
    """Record the dotted keys the user wrote (YAML and overrides), for checks that must tell a value
    the user gave from a default (`train/guards.py`)."""
    cfg.__dict__["_given_keys"] = frozenset(keys)


def given_keys(cfg: RunConfig) -> frozenset[str] | None:
    """The dotted keys given in the YAML and overrides (None: a config built in code)."""
    return cfg.__dict__.get("_given_keys")


def config_to_dict(cfg: Any) -> dict:
    """The config (or a section) as plain data, as the YAML writes it: a family's settings as flat keys."""
    return _plain(cfg, redact=False)


def flat_settings(part: str, value: object) -> dict[str, Any]:
    """Every registered family's `part` keys (`family.setting_fields`, in registry order) with the value `value`
    (the run's family's settings) holds, or the key's default: the flat keys a section lists."""
    return {key: json.loads(json.dumps(getattr(value, key) if hasattr(value, key) else fl.default))
            for key, (_, fl) in family.setting_fields(part).items()}


def redacted_dict(cfg: Any) -> Any:
    """`config_to_dict(cfg)` with every field marked `url=True` in the schema redacted (`dflashkit.redact`):
    what may be written to a file or shown (API keys live in env vars, never in the config)."""
    return _plain(cfg, redact=True)


def _plain(cfg: Any, *, redact: bool) -> Any:
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        out = {}
        for fl in dataclasses.fields(cfg):
            value = getattr(cfg, fl.name)
            if fl.metadata.get("flat"):
                out.update(flat_settings(fl.metadata["flat"], value))
            elif redact and fl.metadata.get("url") and value:
                out[fl.name] = [redact_url(u) for u in value] if isinstance(value, list) else redact_url(value)
            else:
                out[fl.name] = _plain(value, redact=redact)
        return out
    if isinstance(cfg, list):
        return [_plain(v, redact=redact) for v in cfg]
    return json.loads(json.dumps(cfg)) if isinstance(cfg, dict) else cfg


def dump_config(cfg: RunConfig) -> str:
    """Resolved YAML, every URL field redacted (`redacted_dict`)."""
    return yaml.safe_dump(redacted_dict(cfg), sort_keys=False)


def iter_fields(cls: type = RunConfig, prefix: str = ""):
    """Yield (dotted key, type name, default, help) for every leaf field (docs/config.md)."""
    hints = typing.get_type_hints(cls)
    for fl in dataclasses.fields(cls):
        key = f"{prefix}.{fl.name}" if prefix else fl.name
        tp = hints[fl.name]
        if fl.metadata.get("flat"):  # a family's settings: the flat keys of every registered family
            for name, (fam, sf) in family.setting_fields(fl.metadata["flat"]).items():
                tname = _type_name(_fields(getattr(fam, fl.metadata["flat"]))[0][name])
                yield f"{prefix}.{name}", tname, sf.default, sf.metadata.get("help", "")
            continue
        if dataclasses.is_dataclass(tp):
            yield from iter_fields(typing.cast(type, tp), key)
            continue
        if get_origin(tp) is list and dataclasses.is_dataclass(get_args(tp)[0]):
            yield key, "list", [], fl.metadata.get("help", "")
            yield from iter_fields(get_args(tp)[0], key + "[]")
            continue
        default = fl.default if fl.default is not dataclasses.MISSING else fl.default_factory()  # type: ignore[misc,operator]
        yield key, _type_name(tp), default, fl.metadata.get("help", "")


def config_reference_markdown() -> str:
    """docs/config.md, generated from the schema (a test keeps the file in sync)."""
    lines = ["# Config reference", "",
             "Generated from `src/dflashkit/config/schema.py` by `python -m dflashkit.config > docs/config.md`.",
             "Every key can be set in the run YAML or overridden on the command line as `section.key=value`.",
             "Unknown keys are errors. Defaults < YAML < command-line overrides.", ""]
    section = None
    for key, tname, default, help_text in iter_fields():
        top = key.split(".")[0]
        if top != section:
            section = top
            doc = RunConfig.__dataclass_fields__[top].metadata.get("help", "")
            lines += ["", f"## `{top}`", "", doc, "", "| key | type | default | meaning |", "|---|---|---|---|"]
        shown = json.dumps(default) if not isinstance(default, str) else repr(default)
        lines.append(f"| `{key}` | {tname.replace('|', '&#124;')} | `{shown}` | {help_text.replace('|', '&#124;')} |")
    return "\n".join(lines).strip() + "\n"
