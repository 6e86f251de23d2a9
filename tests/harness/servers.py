"""Our `dflashkit serve` app on 127.0.0.1 (a free port) in a thread, for tests.

Usage:
    with serving({"target": {"path": "/tmp/t"}}) as (app, url): ...          # the real app
    with penalty_serving("/tmp/t", default_penalty=1.5) as (app, url): ...   # a server with its own defaults
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Literal


@contextmanager
def serving(config: dict):
    """Build `dflashkit serve`'s app from a config dict and serve it on 127.0.0.1 (a free port).

    Yields (app, base_url ending in /v1). Torch runs one intra-op thread meanwhile (the engine
    thread shares a small box with the client), and the engine is stopped on exit.
    """
    import torch

    from dflashkit.config import config_from_dict
    from dflashkit.serve_app import build_app
    from dflashkit.serving.server import serve_in_thread

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    app = build_app(config_from_dict(config))
    try:
        with serve_in_thread(app) as url:
            yield app, url
    finally:
        app.engine.stop()
        torch.set_num_threads(threads)


@contextmanager
def penalty_serving(target_path: str | Path, default_penalty: float = 1.5):
    """`dflashkit serve`'s HTTP front over a greedy engine with a server-side repetition penalty.

    It emulates servers that apply their own sampling defaults (llama.cpp's `repeat_penalty` 1.1):
    a request without `repetition_penalty` is decoded with `default_penalty`, one that names it
    gets its value. Requests are decoded one at a time with HF `generate`. Yields (app, base_url).
    """
    import torch

    from dflashkit.config import TargetSection
    from dflashkit.target.load import load_target
    from dflashkit.decode.api import GenerationResult, default_stop_ids
    from dflashkit.serving.engine import _EngineBase
    from dflashkit.serving.server import App, serve_in_thread

    target = load_target(TargetSection(path=str(target_path)))
    stop_ids = default_stop_ids(target)

    class PenaltyEngine(_EngineBase):
        def _loop(self) -> None:
            import queue

            while not self._stop.is_set():
                try:
                    r = self.queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                penalty = getattr(r.params, "repetition_penalty", None) or default_penalty
                with torch.no_grad():
                    out = target.model.generate(
                        torch.tensor([r.prompt_ids]), attention_mask=torch.ones(1, len(r.prompt_ids), dtype=torch.long),
                        max_new_tokens=r.params.max_new_tokens, do_sample=False, repetition_penalty=penalty,
                        eos_token_id=list(stop_ids), pad_token_id=stop_ids[0])
                ids = out[0, len(r.prompt_ids):].tolist()
                reason: Literal["stop", "length"] = "stop" if ids and ids[-1] in stop_ids else "length"
                done = GenerationResult(text=self.tokenizer.decode(ids, skip_special_tokens=True), token_ids=ids,
                                        finish_reason=reason, prompt_tokens=len(r.prompt_ids))
                self._count(r, done)
                r._finish(done)

    class PenaltyApp(App):
        def params(self, body):
            p = super().params(body)
            value = body.get("repetition_penalty")
            p.repetition_penalty = float(value) if value is not None else None  # type: ignore[attr-defined]  # a field this fake server adds
            return p

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = PenaltyEngine(target.tokenizer, stop_ids).start()
    app = PenaltyApp(engine, target.tokenizer, model_name="penalty-server")
    try:
        with serve_in_thread(app) as url:
            yield app, url
    finally:
        engine.stop()
        torch.set_num_threads(threads)
