"""Build the `dflashkit serve` app (target, optional drafter, engine) from a config; the library half of `serve`.

Usage:
    check_serve_proposer(cfg)                                    # refusals before anything loads
    app = build_app(load_config("run.yaml"), "path/to/model")   # a started `serving.server.App`
    with serve_in_thread(app) as url: ...                        # or `stages/serve.py` binds a port

`serve.proposer` picks what drafts (default: the drafter when `serve.drafter` is set, else nothing:
batched plain decoding). lookup, suffix and hybrid decode one request at a time, as the drafter does;
suffix and hybrid share one `SuffixPool` across the server's requests, a pool per tenant (the request's
OpenAI `user` field or its X-Tenant header) unless `serve.suffix_share_tenants`.

Kept outside `serving/` so that `serving` stays the server alone and `testing.serving` can build an
app without importing a stage.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from dflashkit.decode.api import default_stop_ids
from dflashkit.decode.hybrid import HybridGate, HybridProposer
from dflashkit.decode.ngram import PromptLookupProposer
from dflashkit.decode.spec_decode import SpecDecoder, estimates_acceptance
from dflashkit.decode.suffix import SuffixPool, SuffixProposer
from dflashkit.errors import UsageError
from dflashkit.export.hf import load_drafter
from dflashkit.inspect.target import resolve_target_path
from dflashkit.serving.batching import BatchEngine
from dflashkit.serving.engine import SerialEngine
from dflashkit.serving.server import App

if TYPE_CHECKING:
    from dflashkit.config import RunConfig
    from dflashkit.config.schema import ServeSection
    from dflashkit.target.load import Target
    from dflashkit.serving.record import ServeRecording

log = logging.getLogger("dflashkit.serve")
DEFAULT_BLOCK = 8  # lookup / suffix: the block size B they draft for (B − 1 = 7 tokens a step at most)


def serve_proposer(cfg: RunConfig) -> str | None:
    """The proposer `serve` runs: serve.proposer, else "drafter" when serve.drafter is set, else None (no
    speculation)."""
    return cfg.serve.proposer or ("drafter" if cfg.serve.drafter else None)


def check_serve_proposer(cfg: RunConfig) -> None:
    """Refuse a proposer the config cannot run (before the model loads).

    Raises:
        UsageError: drafter / hybrid without serve.drafter, a drafter dir that is not a directory, a negative
            pool cap or gate, serve.confidence_truncation without serve.proposer=drafter or beside
            serve.adaptive_length.
    """
    s, proposer = cfg.serve, serve_proposer(cfg)
    if proposer in ("drafter", "hybrid") and not s.drafter:
        raise UsageError(f"serve.proposer={proposer} needs a drafter, and serve.drafter is not set",
                         hint="pass --drafter DIR (a trained or exported drafter), or serve.proposer=suffix / lookup "
                              "(no training needed)")
    if s.drafter and not Path(s.drafter).is_dir():
        raise UsageError(f"serve.drafter {s.drafter!r} is not a directory",
                         hint="pass a drafter dir with config.json + model.safetensors "
                              "(e.g. <run_dir>/train/final or <run_dir>/export)")
    if s.drafter and proposer in ("lookup", "suffix"):
        log.warning("serve.drafter is set but serve.proposer=%s does not use it", proposer)
    if s.suffix_pool_tokens < 0:
        raise UsageError(f"serve.suffix_pool_tokens must be >= 0 (0 = no pool), got {s.suffix_pool_tokens}")
    if s.record_features and not s.record_dir:
        raise UsageError("serve.record_features needs serve.record_dir", hint="set serve.record_dir=DIR")
    if s.record_features and proposer not in ("drafter", "hybrid"):
        raise UsageError(f"serve.record_features needs the drafter's target layers, and serve.proposer is {proposer}",
                         hint="serve with --drafter DIR (proposer drafter or hybrid), or set serve.record_features=false")
    if s.record_dir:
        from dflashkit.serving.record import RecordPolicy

        RecordPolicy.from_config(cfg).check()
    if s.confidence_truncation and proposer != "drafter":
        raise UsageError(f"serve.confidence_truncation reads the drafter's confidence, and serve.proposer is "
                         f"{proposer or 'none (no serve.drafter)'}",
                         hint="serve with --drafter DIR and serve.proposer=drafter (the suffix branch has no "
                              "confidence), or set serve.confidence_truncation=false")
    if s.confidence_truncation and s.adaptive_length:
        raise UsageError("serve.confidence_truncation and serve.adaptive_length are two draft-length rules: set one",
                         hint="eval measures both (eval.confidence_truncation, eval.adaptive_length) against fixed B")
    if s.hybrid_min_match < 0:
        raise UsageError(f"serve.hybrid_min_match must be >= 0, got {s.hybrid_min_match}",
                         hint="it counts matched tokens; 0 = the suffix branch drafts whenever it matches")
    if s.hybrid_drafter_block != 0 and s.hybrid_drafter_block < 2:
        raise UsageError(f"serve.hybrid_drafter_block must be 0 (the server's block size) or >= 2, got "
                         f"{s.hybrid_drafter_block}", hint="use the D of the hybrid-B@G/D decoder eval chose")


def _speculative_decoder(target: Target, s: ServeSection, proposer: str) -> SpecDecoder:
    """The one-request-at-a-time decoder for `proposer` (the pool, if any, lives as long as the server); with
    serve.record_features, one that keeps the committed tokens' features (`serving.feature_tap`)."""
    drafter = load_drafter(s.drafter) if s.drafter and proposer in ("drafter", "hybrid") else None
    spec: type[SpecDecoder] = SpecDecoder
    if s.record_dir and s.record_features and drafter is not None:
        from dflashkit.serving.feature_tap import TappedSpecDecoder

        spec = TappedSpecDecoder
    if proposer == "drafter":
        return spec(target, drafter, adaptive=s.adaptive_length, confidence_cut=_confidence_cut(s, drafter),
                    online_gate=s.online_gate)
    pool = SuffixPool(max_tokens=s.suffix_pool_tokens, share_tenants=s.suffix_share_tenants) \
        if s.suffix_pool_tokens > 0 else None
    if proposer == "hybrid":
        gate = HybridGate(min_match=s.hybrid_min_match, drafter_block=s.hybrid_drafter_block, online_gate=s.online_gate)
        hybrid = HybridProposer(SuffixProposer(pool=pool), gate=gate)
        return spec(target, drafter, hybrid=hybrid, adaptive=s.adaptive_length)
    chosen = PromptLookupProposer() if proposer == "lookup" else SuffixProposer(pool=pool)
    return SpecDecoder(target, None, block_size=DEFAULT_BLOCK, proposer=chosen)


def _confidence_cut(s: ServeSection, drafter) -> float | None:
    """serve.confidence_threshold when serve.confidence_truncation is on and the drafter's family estimates each
    draft's acceptance (`estimates_acceptance`, as eval decides its `confident` rows); else None (fixed B). A
    drafter without such an estimate is served at fixed B with a warning: truncating by its head's softmax is
    not the rule eval measured (a hot swap may bring in a drafter of another family)."""
    if not s.confidence_truncation or drafter is None:
        return None
    if estimates_acceptance(drafter):
        log.info("serve.confidence_truncation: each step verifies the leading drafts while the product of their "
                 "confidences is >= %g", s.confidence_threshold)
        return s.confidence_threshold
    log.warning("serve.confidence_truncation: drafter family %s has no confidence estimate (Decoding.confidence); "
                "serving it at fixed block size %d", drafter.contract.family.name, drafter.block_size)
    return None


def build_app(cfg: RunConfig, model_path: str | None = None) -> App:
    """Load the target (and drafter) named by `cfg`/`model_path`; return a started `App`.

    Raises:
        UsageError: bad model path, or a drafter that does not fit the target.
    """
    from dflashkit.target.load import load_target

    check_serve_proposer(cfg)
    section = dataclasses.replace(cfg.target, path=model_path) if model_path else cfg.target
    target = load_target(section)
    if target.tokenizer is None or not getattr(target.tokenizer, "chat_template", None):
        log.warning("%s has no chat template; /v1/chat/completions will fail (use /v1/completions "
                    "or set target.chat_template)", section.path)
    name = cfg.serve.model_name or resolve_target_path(section.path, section.gguf_file)[0].name
    s, proposer = cfg.serve, serve_proposer(cfg)
    if proposer is not None:
        engine: SerialEngine | BatchEngine = SerialEngine(_speculative_decoder(target, s, proposer),
                                                           target.tokenizer, default_stop_ids(target))
    else:
        engine = BatchEngine(target, max_batch=s.max_batch, batch_wait_ms=s.batch_wait_ms)
    engine.start()
    app = App(engine, target.tokenizer, model_name=name, max_new_tokens=s.max_new_tokens,
              speculative=proposer is not None)
    if s.record_dir:
        app.recording = _recording(cfg, section, name, engine)
    if isinstance(engine, SerialEngine) and proposer in ("drafter", "hybrid"):
        swap = DrafterSwap(app, engine, target, s, proposer)
        app.drafter_id, app.swap_drafter = f"serve.drafter:{Path(s.drafter or '').name}", swap.load
        if s.promoted:
            swap.watch(s.promoted, s.promoted_poll_s)
    elif s.promoted:
        log.warning("serve.promoted is set but this server decodes without a drafter: nothing will be swapped")
    return app


class DrafterSwap:
    """Hot swap of the serving drafter: the new decoder is built here, off the request path, then handed to the
    engine, which starts the next request on it (`SerialEngine.swap_decoder`); a request in flight finishes on
    the old one. The id in /v1/models and /health changes only once the swap is done, and a drafter that fails
    to load is logged and not served (the old one keeps serving)."""

    def __init__(self, app: App, engine: SerialEngine, target: Target, s: ServeSection, proposer: str):
        self.app, self.engine, self.target, self.s, self.proposer = app, engine, target, s, proposer
        self._lock = threading.Lock()  # one swap at a time

    def load(self, drafter_dir: str, drafter_id: str | None = None) -> str:
        """Swap `drafter_dir` in; returns the id now serving (UsageError for a dir that is not a drafter or does
        not fit the target: nothing changes)."""
        if not Path(drafter_dir).is_dir():
            raise UsageError(f"{drafter_dir} is not a drafter dir")
        with self._lock:
            old = self.app.drafter_id
            decoder = _speculative_decoder(self.target, dataclasses.replace(self.s, drafter=drafter_dir), self.proposer)
            self.engine.swap_decoder(decoder)
            self.app.drafter_id = drafter_id or f"dir:{Path(drafter_dir).resolve()}"
        log.info("hot swap: serving drafter %s (was %s) from %s", self.app.drafter_id, old, drafter_dir)
        return self.app.drafter_id

    def watch(self, promoted: str, poll_s: float) -> threading.Thread:
        """Poll the promotion pointer (`flywheel/pointer.py`; a path not ending in .json is a run dir: its
        learn/promoted.json) and swap in each newly promoted drafter, until the engine stops."""
        from dflashkit.flywheel.pointer import pointer_path, read_promoted

        path = Path(promoted) if promoted.endswith(".json") else pointer_path(promoted)
        seen: list[str | None] = [None]
        said: list[str | None] = [None]  # the last error logged (each one once)

        def check() -> None:
            try:
                p = read_promoted(path)
                if p is not None and p["id"] != seen[0]:
                    seen[0] = p["id"]
                    if p["id"] != self.app.drafter_id:
                        self.load(p["drafter"], p["id"])
            except Exception as e:  # noqa: BLE001 - a bad pointer or drafter never stops the server
                if str(e) != said[0]:
                    said[0] = str(e)
                    log.error("hot swap skipped (%s: %s); still serving drafter %s", type(e).__name__, e,
                              self.app.drafter_id)

        check()  # a pointer already there at start: serve the promoted drafter from the first request

        def loop() -> None:
            while not self.engine._stop.wait(poll_s):
                check()

        thread = threading.Thread(target=loop, name="dflashkit-drafter-watch", daemon=True)
        thread.start()
        log.info("watching %s for promoted drafters (every %.1f s)", path, poll_s)
        return thread


def _recording(cfg: RunConfig, section, name: str, engine) -> ServeRecording:
    """The open recorder of serve.record_dir (its fingerprint: the target's config.json + tokenizer files, or
    record.target_fingerprint), with the decoder's feature tap when serve.record_features."""
    from dflashkit.serving.feature_tap import TappedSpecDecoder
    from dflashkit.serving.record import Recorder, RecordPolicy, ServeRecording, section_fingerprint

    fp, how = section_fingerprint(section, cfg.record.target_fingerprint)
    tap = getattr(engine, "decoder", None)
    tap = tap if isinstance(tap, TappedSpecDecoder) else None
    meta = {"hidden_size": str(tap.target.hidden_size)} if tap is not None else {}
    rec = Recorder(cfg.serve.record_dir or "", fingerprint=fp, how=how,
                   policy=RecordPolicy.from_config(cfg), features_meta=meta).open()
    log.info("recording served requests into %s%s", cfg.serve.record_dir, " (with features)" if tap else "")
    return ServeRecording(rec, name, engine, cfg.capture.dtype if tap is not None else None)
