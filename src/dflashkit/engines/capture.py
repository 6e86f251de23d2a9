"""Feature rows from a serving engine (`capture.engine: vllm`, `train.features: engine`): request, check, spool.

Usage:
    src = EngineSource(base_url, "target", layer_ids=[1, 15], num_layers=30, head=parts, dtype="bfloat16",
                       last_hidden=False)
    row = src.sample(ids)                                   # FeatureRow: features [T, n·H], next_ids [T], last_hidden?
    spool = Spool(spool_root(run_dir / "capture") / "shard-00000")
    spool.fill(src, rows, concurrency=4)                    # every missing row requested once, written atomically
    for i, row in spool.rows(len(rows)): ...                # back in tokenized order, for the shard writer

Each tokenized sample is one `/v1/completions` request with its token ids and `max_tokens: 1`;
the engine's file (`engines/hidden_states.py`) is checked (the ids it computed are the ids sent,
the layer count is the aux count), turned into our row — the contract layers concatenated in
contract order, the target's greedy next token from the final norm + LM head (`target/head.py`)
applied to the last layer's pre-norm output, optionally that final-norm output — and written to
`<spool>/<row>.safetensors` through a temp file + rename; the engine's file is then deleted.

Exactly once, kill −9 safe: a row's spool file is complete or absent, so a re-run requests only
the rows without one; the shard is assembled from exactly one file per row (by the stage, through
the one shard writer) and only then is the spool removed. Engine files a killed run left behind
(its requests in flight) are never read again: the storage dir is emptied at the start.
"""

from __future__ import annotations

import json
import logging
import shlex
import shutil
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from safetensors.torch import load_file, save_file

from dflashkit.engines import hidden_states as hs_io, vllm
from dflashkit.engines.launch import check_vllm_for_target, engine_dtype
from dflashkit.errors import EXIT_MISSING, DflashkitError, UsageError
from dflashkit.family.contract import REPROBE_HINT
from dflashkit.http1 import HttpError, excerpt, request_sync
from dflashkit.inspect.target import resolve_target_path
from dflashkit.target.head import load_head_parts
from dflashkit.target.load import text_config_dict
from dflashkit.redact import redact_url
from dflashkit.rundir import atomic_path

if TYPE_CHECKING:
    from dflashkit.config import RunConfig
    from dflashkit.family.contract import DrafterContract

log = logging.getLogger("dflashkit.capture")


def engine_storage(out_dir: Path) -> Path:
    """The dir the engine's hidden-states connector writes into (`<stage dir>/engine-files`)."""
    return out_dir / "engine-files"


def spool_root(capture_dir: Path) -> Path:
    """Where the engine path spools rows: `<capture dir>/engine-spool/<shard stem>/<row>.safetensors`."""
    return capture_dir / "engine-spool"


@dataclass
class FeatureRow:
    """One sample's target side: what a feature shard stores for it."""

    features: torch.Tensor                   # [T, n_feat·H]
    next_ids: torch.Tensor                   # [T] int64: argmax lm_head(final_norm(last layer))
    last_hidden: torch.Tensor | None = None  # [T, H] final-norm output (for KL)


@dataclass
class EngineSource:
    """Turns tokenized samples into FeatureRows through a vLLM server running `extract_hidden_states`."""

    base_url: str
    model: str
    layer_ids: list[int]
    num_layers: int
    head: Any                      # target.head.HeadParts
    dtype: str                     # stored dtype (capture.dtype)
    last_hidden: bool
    timeout_s: float = 600.0

    @property
    def aux(self) -> list[int]:
        return hs_io.aux_layer_ids(self.layer_ids, num_layers=self.num_layers, with_last=True)

    def sample(self, ids: list[int]) -> FeatureRow:
        """Request one sample and return its row (the engine's file is removed once read)."""
        path = hs_io.request(self.base_url, self.model, ids, timeout_s=self.timeout_s)
        try:
            got = hs_io.read(path, sent=ids, expect_layers=len(self.aux), timeout_s=self.timeout_s)
        finally:
            hs_io.remove(path)
        return self.row(got.hidden_states)

    def row(self, hidden: torch.Tensor) -> FeatureRow:
        """[T, aux, H] engine hidden states → our row (features in contract order, labels from the head)."""
        aux = self.aux
        feats = torch.cat([hidden[:, aux.index(i + 1)] for i in self.layer_ids], dim=-1)
        pre = hidden[:, aux.index(self.num_layers)].float()
        last = self.head.final_norm(pre.to(self.head.norm_weight.dtype))
        nxt = self.head.next_token_ids(last)
        out_dtype = getattr(torch, self.dtype)
        return FeatureRow(feats.to(out_dtype), nxt, last.to(out_dtype) if self.last_hidden else None)


class Spool:
    """`<dir>/<row:06d>.safetensors`: the finished rows of one shard (see the module docstring)."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def path(self, i: int) -> Path:
        return self.root / f"{i:06d}.safetensors"

    def done(self, n: int) -> list[int]:
        return [i for i in range(n) if self.path(i).is_file()]

    def write(self, i: int, row: FeatureRow, n_tokens: int) -> None:
        t = {"features": row.features.contiguous(), "next_ids": row.next_ids.to(torch.int32).contiguous()}
        if row.last_hidden is not None:
            t["last_hidden"] = row.last_hidden.contiguous()
        assert row.features.shape[0] == n_tokens, (row.features.shape, n_tokens)
        with atomic_path(self.path(i)) as tmp:
            save_file(t, str(tmp), metadata={"tokens": str(n_tokens)})

    def read(self, i: int) -> FeatureRow:
        t = load_file(str(self.path(i)))
        return FeatureRow(t["features"], t["next_ids"].long(), t.get("last_hidden"))

    def fill(self, src: EngineSource, rows: list[torch.Tensor], *, concurrency: int = 4,
             progress: Any = None) -> int:
        """Request every row without a spool file (at most `concurrency` in flight); returns how many."""
        self.root.mkdir(parents=True, exist_ok=True)
        have = set(self.done(len(rows)))
        todo = [i for i in range(len(rows)) if i not in have]

        def one(i: int) -> int:
            ids = rows[i].tolist()
            self.write(i, src.sample(ids), len(ids))
            return len(ids)

        with ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="dflashkit-engine") as pool:
            for n in pool.map(one, todo):
                if progress is not None:
                    progress(n)
        return len(todo)

    def rows(self, n: int) -> Iterator[tuple[int, FeatureRow]]:
        for i in range(n):
            yield i, self.read(i)

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def clear_storage(storage: Path) -> int:
    """Empty the engine's storage dir (ours: `<stage>/engine-files`): files a killed run left there."""
    n = 0
    if storage.is_dir():
        for p in storage.iterdir():
            if p.is_file() and (p.suffix in (".safetensors", ".lock", ".part") or p.name.endswith(".safetensors.part")):
                p.unlink()
                n += 1
    return n


def engine_facts(cfg: RunConfig) -> tuple[Path, dict[str, Any]]:
    """The target dir and its facts (layers, hidden, vocab) from config.json alone (no weights)."""
    model_dir, _ = resolve_target_path(cfg.target.path, cfg.target.gguf_file)
    tc = text_config_dict(model_dir)
    return model_dir, {"num_layers": int(tc["num_hidden_layers"]), "hidden_size": int(tc["hidden_size"]),
                       "vocab_size": int(tc["vocab_size"]), "model_dir": str(model_dir)}


def serve_command_for(cfg: RunConfig, layer_ids: list[int], storage: Path, *, cpu: bool = False) -> list[str]:
    """The `vllm serve` command for `capture.server_url` mode (what `dflashkit capture --dry-run` prints)."""
    model_dir, facts = engine_facts(cfg)
    aux = hs_io.aux_layer_ids(layer_ids, num_layers=facts["num_layers"], with_last=True)
    return ["vllm", "serve", str(model_dir), "--dtype", engine_dtype(cfg),
            "--served-model-name", cfg.server.model or "target", *hs_io.serve_args(aux, storage.resolve(), cpu=cpu)]


class EngineNotAnswering(DflashkitError):
    """Nothing answers at `capture.server_url` (exit 3): the vLLM it names is not running; the hint starts it."""

    exit_code = EXIT_MISSING


def served_model_at(cfg: RunConfig, url: str, start: list[str]) -> str:
    """The model name the vLLM at `capture.server_url` serves, read from its /v1/models before any request.

    Nothing answering is exit 3 (start it: `start` is the `vllm serve` command), something that is not an
    OpenAI server (an error status, a web page, no model list) exit 2 naming the key, the URL (redacted)
    and what answered. `server.model`, when set, must be one of the served names."""
    shown = redact_url(url)
    hint = ("start vLLM there with the flags `dflashkit capture --dry-run` prints:\n    " + shlex.join(start)
            + "\n  or set capture.server_url=null and dflashkit starts one for target.path")
    try:
        status, headers, body = request_sync("GET", url + "/models", timeout_s=30)
    except HttpError as e:
        raise EngineNotAnswering(f"capture.server_url: nothing answers at {shown} ({type(e).__name__}: {e})",
                                 hint=hint) from None
    try:
        ids = [str(m["id"]) for m in json.loads(body)["data"]] if status == 200 else None
    except (ValueError, KeyError, TypeError):
        ids = None
    if not ids:
        raise UsageError(f"capture.server_url: {shown} is not a vLLM server: GET {shown}/models answered HTTP "
                         f"{status} ({excerpt(headers, body)}), not a list of served models", hint=hint)
    if cfg.server.model and cfg.server.model not in ids:
        raise UsageError(f"server.model: {cfg.server.model!r} is not served at capture.server_url {shown} "
                         f"(it serves {ids})", hint=f"set server.model={ids[0]}, or null for the first")
    return cfg.server.model or ids[0]


def check_engine(cfg: RunConfig, contract: DrafterContract, out_dir: Path, *, what: str,
                 layer_ids: list[int] | None = None) -> str | None:
    """Every check `engine_source` makes before any work (stages call it in their checks, --dry-run too):
    the contract against the target's config.json, then either the vLLM at `capture.server_url` (its served
    model name, returned; `served_model_at`) or what starting one for target.path needs (vLLM installed,
    a HF dir: `launch.check_vllm_for_target`, under `what`, the key that asks for the engine; None)."""
    _, facts = engine_facts(cfg)
    contract.check(facts, where="contract.json", hint=REPROBE_HINT)
    if cfg.capture.server_url:
        layer_ids = list(contract.target_layer_ids if layer_ids is None else layer_ids)
        url = cfg.capture.server_url.rstrip("/")
        return served_model_at(cfg, url, serve_command_for(cfg, layer_ids, engine_storage(out_dir)))

    check_vllm_for_target(cfg, what)
    return None


@contextmanager
def engine_source(cfg: RunConfig, contract: DrafterContract, out_dir: Path, *, last_hidden: bool,
                  layer_ids: list[int] | None = None, what: str = "capture.engine=vllm") -> Iterator[EngineSource]:
    """An EngineSource on `capture.server_url`, or on a vLLM started here for target.path (stopped on exit).

    `check_engine` runs first. The started engine writes into `<out_dir>/engine-files` (emptied first), logs
    to `<out_dir>/engine.log`. `layer_ids`: the target layers to take (capture's, with
    `capture.extra_layer_ids`); default the contract's. `what`: the key that asks for the engine.
    """
    model = check_engine(cfg, contract, out_dir, what=what, layer_ids=layer_ids)
    model_dir, facts = engine_facts(cfg)
    head = load_head_parts(model_dir, dtype=torch.float32)
    storage = engine_storage(out_dir)
    storage.mkdir(parents=True, exist_ok=True)
    if clear_storage(storage):
        log.info("removed engine files an interrupted run left in %s", storage)
    layer_ids = list(contract.target_layer_ids if layer_ids is None else layer_ids)
    aux = hs_io.aux_layer_ids(layer_ids, num_layers=facts["num_layers"], with_last=True)
    kw: dict[str, Any] = dict(layer_ids=layer_ids, num_layers=facts["num_layers"], head=head,
                          dtype=cfg.capture.dtype, last_hidden=last_hidden, timeout_s=cfg.server.timeout_s)
    if model is not None:
        yield EngineSource(str(cfg.capture.server_url).rstrip("/"), model, **kw)
        return
    from dflashkit.engines.launch import start_vllm_for_target

    hs_io.install_connector(vllm.require(what))
    with start_vllm_for_target(cfg, log_path=out_dir / "engine.log", served_name="target", what=what,
                               extra_args=hs_io.serve_args(aux, storage.resolve(), cpu=True)) as eng:
        yield EngineSource(eng.base_url, eng.served_name, **kw)


def capture_shards(src: EngineSource, todo: list[tuple[Path, list[torch.Tensor], dict[str, str]]],
                   capture_dir: Path, write_shard: Callable[..., int], *, concurrency: int,
                   **shard_kw: Any) -> Iterator[tuple[Path, int]]:
    """For each (dest, rows, metadata): spool every row through the engine (under `spool_root(capture_dir)`),
    then write the shard with the stage's `write_shard` (the one writer of the format) and drop the spool;
    yields (dest, tokens)."""
    for dest, rows, meta in todo:
        spool = Spool(spool_root(capture_dir) / dest.stem)
        sent = spool.fill(src, rows, concurrency=concurrency)
        log.info("%s: %d samples requested from the engine, %d already spooled", dest.name, sent, len(rows) - sent)
        batches = ([(i, r.features, r.next_ids, r.last_hidden)] for i, r in spool.rows(len(rows)))
        n = write_shard(dest, [len(r) for r in rows], batches, metadata={**meta, "engine": "vllm"}, **shard_kw)
        spool.remove()
        yield dest, n


def drop_finished_spools(capture_dir: Path) -> int:
    """Remove the spools of shards already written to `capture_dir` (a kill between writing a shard and
    dropping its spool leaves one, and the re-run skips that shard), then the spool root itself if empty.
    The stage calls it once, after capture: before, a stale shard about to be rewritten may still own a
    live spool. Returns how many spools went (0 when there is no spool root: the local capture path)."""
    root = spool_root(capture_dir)
    if not root.is_dir():
        return 0
    n = 0
    for d in list(root.iterdir()):
        if d.is_dir() and (capture_dir / f"{d.name}.safetensors").is_file():
            Spool(d).remove()
            n += 1
    if not any(root.iterdir()):
        root.rmdir()
    return n
