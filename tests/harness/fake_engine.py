"""A stand-in for vLLM with `extract_hidden_states`: a tiny HF target behind /v1/completions that writes
the hidden-states file the way vLLM's connector does (the unit tests of engine capture use it).

Usage:
    with FakeHiddenStatesEngine(target_dir, aux=[2, 4, 6], storage=tmp / "hs") as eng:
        eng.url                      # http://127.0.0.1:P/v1; POST /completions {"prompt": [ids], "max_tokens": 1}
        eng.requests                 # how many completions it answered

Aux id k < num_layers is HF `hidden_states[k]`; k = num_layers is the last decoder layer's output
before the final norm (as vLLM). The file (`hidden_states` [T, len(aux), H], `token_ids` [T]) is
written to a temp name and renamed, and `kv_transfer_params.hidden_states_path` names it.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


class FakeHiddenStatesEngine:
    def __init__(self, target_dir: str | Path, *, aux: list[int], storage: str | Path, name: str = "fake",
                 token_offset: int = 0):
        self.target_dir, self.aux, self.storage, self.name = Path(target_dir), list(aux), Path(storage), name
        self.token_offset = token_offset  # != 0: report other token ids than were sent (a drift test)
        self.requests = 0
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    def _hidden(self, ids: list[int]):
        import torch

        layers = self.model.model.layers
        captured: dict[int, Any] = {}
        hook = layers[-1].register_forward_hook(lambda _m, _i, out: captured.__setitem__(
            0, out[0] if isinstance(out, tuple) else out))
        try:
            with torch.no_grad():
                out = self.model(torch.tensor([ids]), output_hidden_states=True)
        finally:
            hook.remove()
        n = len(layers)
        rows = [captured[0][0] if k == n else out.hidden_states[k][0] for k in self.aux]
        return torch.stack(rows, dim=1).contiguous()  # [T, aux, H]

    def _complete(self, body: dict) -> dict:
        import os

        import torch
        from safetensors.torch import save_file

        ids = [int(i) for i in body["prompt"]]
        with self._lock:
            self.requests += 1
            k = self.requests
            hs = self._hidden(ids)
        self.storage.mkdir(parents=True, exist_ok=True)
        path = self.storage / f"cmpl-fake-{k}.safetensors"
        tmp = Path(str(path) + ".part")
        save_file({"hidden_states": hs, "token_ids": torch.tensor(ids) + self.token_offset}, str(tmp))
        os.replace(tmp, path)
        return {"id": f"cmpl-fake-{k}", "object": "text_completion", "model": self.name,
                "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                "kv_transfer_params": {"hidden_states_path": str(path)}}

    def __enter__(self) -> FakeHiddenStatesEngine:
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(self.target_dir, dtype=torch.float32).eval()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_a):
                return

            def _send(self, code: int, obj: dict) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802
                self._send(200, {"data": [{"id": engine.name}]})

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                self._send(200, engine._complete(body))

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def __exit__(self, *exc: Any) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
