"""Tokenizer facts from files only, then (only if importable) a real load with a one-line diagnosis.

Usage:
    tok = read_tokenizer_facts(Path("Qwen3-8B"))       # tokenizer_config.json, tokenizer.json, …
    tok.size, tok.eos_token, tok.chat_template_source, tok.required_packages
    tok.check_load(trust_remote_code=False)            # tok.loaded = {"ok": …, "diagnosis": …, "fix": …}

Files read: tokenizer_config.json (classes, specials, added_tokens_decoder, chat_template),
special_tokens_map.json, chat_template.jinja / chat_template.json, tokenizer.json (vocab + added
tokens), tiktoken.model / *.tiktoken (rank count), vocab.json, custom `tokenization_*.py` (their
imports). A failed real load is never a traceback: `loaded["diagnosis"]` names the missing package
or file and `loaded["fix"]` is the exact command or config key.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflashkit.errors import UsageError

SPECIALS = ("bos", "eos", "pad", "unk", "mask")
PIP_NAMES = {"google": "protobuf", "yaml": "pyyaml", "PIL": "pillow", "cv2": "opencv-python",
             "sklearn": "scikit-learn"}
IMPORT_NAMES = {"protobuf": "google.protobuf"}


def is_installed(pip_name: str) -> bool:
    """Whether a package (pip name) is importable, without importing it."""
    mod = IMPORT_NAMES.get(pip_name, pip_name)
    try:
        return importlib.util.find_spec(mod) is not None
    except (ImportError, ValueError):
        return False


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UsageError(f"{path}:{e.lineno}:{e.colno}: malformed JSON ({e.msg})",
                         hint="fix or re-download the tokenizer files") from None


def _content(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@dataclass
class TokenizerFacts:
    """Tokenizer facts; `to_dict()` drops the big internals (vocab ids, template text)."""

    source: str
    files: list[str] = field(default_factory=list)
    backend: str | None = None  # tokenizers | tiktoken | sentencepiece | bpe-files | gguf
    tokenizer_class: str | None = None
    custom_code: list[str] = field(default_factory=list)
    needs_remote_code: bool = False
    required_packages: list[str] = field(default_factory=list)
    special_tokens: dict[str, str | None] = field(default_factory=dict)
    special_ids: dict[str, int | None] = field(default_factory=dict)
    chat_template_source: str | None = None
    chat_template_chars: int = 0
    base_vocab_size: int | None = None
    num_added_tokens: int = 0
    size: int | None = None  # highest assigned id + 1
    loaded: dict[str, Any] = field(default_factory=lambda: {"ok": None, "diagnosis": "not attempted"})
    added: dict[int, tuple[str, bool]] = field(default_factory=dict, repr=False)  # id -> (text, special)
    assigned_ids: set[int] | None = field(default=None, repr=False)
    chat_template: str | None = field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        skip = {"added", "assigned_ids", "chat_template"}
        return {k: v for k, v in self.__dict__.items() if k not in skip}

    def id_of(self, text: str) -> int | None:
        for i, (t, _) in self.added.items():
            if t == text:
                return i
        return None

    def _finish(self) -> None:
        ids = set(self.assigned_ids or ()) | set(self.added)
        self.assigned_ids = ids or None
        self.size = (max(ids) + 1) if ids else None
        self.num_added_tokens = len(self.added)
        for s in SPECIALS:
            text = self.special_tokens.get(s)
            if self.special_ids.get(s) is None and text is not None:
                self.special_ids[s] = self.id_of(text)
        if self.chat_template:
            self.chat_template_chars = len(self.chat_template)

    def check_load(self, *, trust_remote_code: bool, model_dir: Path | None = None,
                   gguf_file: str | None = None) -> dict[str, Any]:
        """Load with transformers if everything needed is importable; record ok/diagnosis/fix."""
        missing = [p for p in ["transformers", *self.required_packages] if not is_installed(p)]
        problems, fixes = [], []
        if missing:
            problems.append(f"needs {', '.join(f'`{m}`' for m in missing)} (not installed)")
            fixes.append("pip install " + " ".join(missing))
        if self.needs_remote_code and not trust_remote_code:
            code = ", ".join(self.custom_code) or self.tokenizer_class or "custom code"
            problems.append(f"its class {self.tokenizer_class or '?'} is the model's own code ({code})")
            fixes.append("target.trust_remote_code=true")
        if problems:
            self.loaded = {"ok": False, "diagnosis": "tokenizer cannot load: " + "; ".join(problems),
                           "fix": " and ".join(fixes)}
            return self.loaded
        try:
            from transformers import AutoTokenizer

            src = Path(self.source) if model_dir is None else model_dir
            kw = {"gguf_file": gguf_file} if gguf_file else {}
            tok = AutoTokenizer.from_pretrained(src, trust_remote_code=trust_remote_code, **kw)
        except Exception as e:  # noqa: BLE001 - turned into a one-line diagnosis, never a traceback
            self.loaded = {"ok": False, **_diagnose(e)}
            return self.loaded
        self._absorb(tok)
        return self.loaded

    def _absorb(self, tok: Any) -> None:
        """Prefer what the real tokenizer says (size, vocab, specials, template)."""
        vocab = tok.get_vocab()
        self.assigned_ids = set(vocab.values())
        self.base_vocab_size = self.base_vocab_size or getattr(tok, "vocab_size", None)
        for i, t in getattr(tok, "added_tokens_decoder", {}).items():
            self.added[int(i)] = (str(t), bool(getattr(t, "special", True)))
        for s in SPECIALS:
            text = getattr(tok, f"{s}_token", None)
            if text is not None:
                self.special_tokens[s] = str(text)
                self.special_ids[s] = getattr(tok, f"{s}_token_id", None)
        if not self.chat_template and getattr(tok, "chat_template", None):
            self.chat_template, self.chat_template_source = str(tok.chat_template), "tokenizer"
        self._finish()
        self.loaded = {"ok": True, "class": type(tok).__name__, "len": len(tok), "diagnosis": None, "fix": None}


def _diagnose(e: Exception) -> dict[str, str]:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    name = getattr(e, "name", None)
    found = re.search(r"following packages that were not found in your environment: ([\w\-, ]+)", str(e))
    pkgs = [p.strip() for p in found.group(1).split(",")] if found else ([PIP_NAMES.get(name.split(".")[0],
                                                                           name.split(".")[0])] if name else [])
    if not pkgs:
        pkgs = [p for p in ("tiktoken", "sentencepiece", "protobuf") if p in msg.lower()]
    if pkgs:
        return {"diagnosis": f"tokenizer cannot load: needs {', '.join(pkgs)} ({msg[:200]})",
                "fix": "pip install " + " ".join(pkgs)}
    if "trust_remote_code" in msg:
        return {"diagnosis": f"tokenizer cannot load: custom code ({msg[:200]})",
                "fix": "target.trust_remote_code=true"}
    return {"diagnosis": f"tokenizer cannot load: {type(e).__name__}: {msg[:240]}",
            "fix": "check the tokenizer files (tokenizer.json / tokenizer_config.json) or set target.tokenizer"}


def _code_imports(path: Path) -> list[str]:
    """Top-level third-party imports of a custom tokenizer module (pip names)."""
    names = re.findall(r"^\s*(?:from|import)\s+([A-Za-z_]\w*)", path.read_text(errors="replace"), re.M)
    skip = set(sys.stdlib_module_names) | {"transformers", "torch", "tokenizers", "numpy", "__future__"}
    return sorted({PIP_NAMES.get(n, n) for n in names if n not in skip})


def _read_template(d: Path, tc: dict[str, Any]) -> tuple[str | None, str | None]:
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text(encoding="utf-8"), "chat_template.jinja"
    if (d / "chat_template.json").is_file():
        t = (_read_json(d / "chat_template.json") or {}).get("chat_template")
        if isinstance(t, str):
            return t, "chat_template.json"
    t = tc.get("chat_template")
    if isinstance(t, list):  # named templates: [{"name": "default", "template": ...}, ...]
        t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
    return (t, "tokenizer_config.json") if isinstance(t, str) else (None, None)


def read_tokenizer_facts(d: Path) -> TokenizerFacts:
    """Facts from the tokenizer files in dir `d` (json/text only; no transformers).

    Args:
        d: the tokenizer dir (usually the model dir).
    Returns:
        TokenizerFacts; `files` is empty when the dir holds no tokenizer files.
    Raises:
        UsageError: (exit 2) malformed tokenizer JSON, naming file:line:col.
    """
    f = TokenizerFacts(source=str(d))
    present = sorted(p.name for p in d.iterdir() if p.is_file()) if d.is_dir() else []
    tc = _read_json(d / "tokenizer_config.json") if "tokenizer_config.json" in present else {}
    stm = _read_json(d / "special_tokens_map.json") if "special_tokens_map.json" in present else {}
    f.files = [n for n in present if n in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                                           "chat_template.jinja", "chat_template.json", "tiktoken.model",
                                           "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")
               or n.endswith((".tiktoken", ".model")) or re.fullmatch(r"tokenization_\w+\.py", n)]
    f.tokenizer_class = tc.get("tokenizer_class")
    auto = (tc.get("auto_map") or {}).get("AutoTokenizer")
    f.custom_code = sorted(n for n in present if re.fullmatch(r"tokenization_\w+\.py", n))
    f.needs_remote_code = bool(auto)
    required: set[str] = set()
    ids: set[int] = set()
    if "tokenizer.json" in present:
        f.backend = "tokenizers"
        tj = _read_json(d / "tokenizer.json")
        vocab = (tj.get("model") or {}).get("vocab")
        if isinstance(vocab, dict):
            ids = {int(i) for i in vocab.values()}
        elif isinstance(vocab, list):
            ids = set(range(len(vocab)))
        f.base_vocab_size = len(ids) or None
        for a in tj.get("added_tokens") or []:
            f.added[int(a["id"])] = (a["content"], bool(a.get("special")))
    else:
        tk = [n for n in present if n == "tiktoken.model" or n.endswith(".tiktoken")]
        sp = [n for n in present if n.endswith(".model") and n not in tk]
        if tk:
            f.backend = "tiktoken"
            required.add("tiktoken")
            with open(d / tk[0], "rb") as fh:
                f.base_vocab_size = sum(1 for line in fh if line.strip())
            ids = set(range(f.base_vocab_size))
        elif sp:
            f.backend = "sentencepiece"  # transformers 5 converts it to a fast tokenizer via protobuf
            required.update(("sentencepiece", "protobuf"))
        elif "vocab.json" in present:
            f.backend = "bpe-files"
            ids = {int(i) for i in _read_json(d / "vocab.json").values()}
            f.base_vocab_size = len(ids)
    for code in f.custom_code:
        required.update(_code_imports(d / code))
    f.required_packages = sorted(required)
    for i, a in (tc.get("added_tokens_decoder") or {}).items():
        f.added[int(i)] = (_content(a) or "", bool(a.get("special", True)) if isinstance(a, dict) else True)
    for s in SPECIALS:
        f.special_tokens[s] = _content(tc.get(f"{s}_token")) or _content(stm.get(f"{s}_token"))
        f.special_ids[s] = None
    f.chat_template, f.chat_template_source = _read_template(d, tc)
    f.assigned_ids = ids
    f._finish()
    return f


def tokenizer_facts_from_gguf(path: Path, meta: dict[str, Any]) -> TokenizerFacts:
    """Facts from a GGUF header's `tokenizer.ggml.*` keys (UNUSED-type tokens count as free rows)."""
    f = TokenizerFacts(source=str(path), files=[path.name], backend="gguf",
                       tokenizer_class=f"gguf:{meta.get('model')}")
    tokens, types = meta.get("tokens") or [], meta.get("types") or []
    f.base_vocab_size = len(tokens) or None
    f.assigned_ids = {i for i in range(len(tokens)) if i >= len(types) or types[i] != 5}
    for i, t in enumerate(types):
        if t in (3, 4):  # CONTROL, USER_DEFINED
            f.added[i] = (tokens[i], t == 3)
    for s, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "pad_token_id")):
        sid = meta.get(key)
        f.special_ids[s] = sid
        f.special_tokens[s] = tokens[sid] if isinstance(sid, int) and 0 <= sid < len(tokens) else None
    f.chat_template = meta.get("chat_template")
    f.chat_template_source = "gguf" if f.chat_template else None
    f._finish()
    return f
