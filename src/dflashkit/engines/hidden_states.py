"""Target hidden states from a vLLM server: `extract_hidden_states` + a KV connector writing one file per request.

Usage:
    aux = aux_layer_ids([1, 15], num_layers=30, with_last=True)   # [2, 16, 30]: vLLM counts hidden_states
    args = serve_args(aux, storage_dir, cpu=True)                  # --speculative-config ... --kv-transfer-config ...
    install_connector(venv)                                        # our CPU-safe connector module, into the venv
    path = request(base_url, "target", ids)                        # POST /v1/completions, max_tokens 1
    hs = read(path, sent=ids)                                      # HiddenStates: [T, len(aux), H] + checks

vLLM serves the target with the speculative method
`extract_hidden_states` whose "draft" only caches the outputs of the decoder layers
`eagle_aux_hidden_state_layer_ids`, and a KV connector writes them per request as safetensors
(`hidden_states` [tokens, layers, hidden], `token_ids` [tokens]) under `shared_storage_path`; the
response's `kv_transfer_params.hidden_states_path` names the file, and `<file>.lock` is held
(flock) until the write ends. Aux id k is HF `hidden_states[k]` (the output of k decoder layers),
so our contract's layer id i is aux id i + 1; aux id `num_hidden_layers` is the last layer's output
*before* the final norm (`target/head.py` applies the norm).

The stock `ExampleHiddenStatesConnector` copies through pinned memory on a CUDA stream, which kills
vLLM's CPU engine (`pin_memory=True requires a CUDA or other accelerator backend`). dflashkit ships
`CONNECTOR_SOURCE`, a subclass that replaces only that write with a synchronous CPU copy + save
(to a temp name, then renamed), loaded through `kv_connector_module_path`; on GPU the stock one is
used. The write happens on the engine's next step (a server keeps stepping).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from dflashkit.errors import DflashkitError, ServerError, UsageError
from dflashkit.http1 import HttpConnectError, HttpDropped, HttpError, HttpStatusError, HttpTimeout, excerpt, post_json
from dflashkit.redact import redact_url

CONNECTOR_MODULE = "dflashkit_vllm_connector"
CONNECTOR_CLASS = "DflashkitHiddenStatesConnector"
STOCK_CLASS = "ExampleHiddenStatesConnector"

CONNECTOR_SOURCE = '''\
"""Written by dflashkit (engines/hidden_states.py): vLLM's hidden-states connector, CPU-safe.

The stock connector copies the cached hidden states through pinned memory on a CUDA stream; on a
CPU engine that raises. This subclass changes only the write: a synchronous copy and a safetensors
save to a temp name, renamed into place, then the request's lock is released.
"""
import fcntl
import os

import torch
from safetensors.torch import save_file

from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
)


class _Written:
    """Stands in for the stock connector's CUDA event: the copy is already done."""

    def query(self):
        return True

    def synchronize(self):
        return None


class DflashkitHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending):
        if not self._is_tp_rank_zero:
            return
        cache = self._kv_cache  # [blocks, layers, block_size, hidden] (layout LBNHC)
        size = self._block_size
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (blocks.view(-1, 1) * size + torch.arange(size, dtype=torch.long).view(1, -1)).flatten()
        slots = slots[: pending.token_ids.shape[0]]
        states = cache[slots // size, :, slots % size].to("cpu").contiguous().clone()
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            tmp = pending.filename + ".part"
            save_file({"hidden_states": states, "token_ids": pending.token_ids.clone().contiguous()}, tmp)
            os.replace(tmp, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)
        self._req_copy_events[pending.req_id] = _Written()
'''


def aux_layer_ids(layer_ids: list[int], *, num_layers: int, with_last: bool) -> list[int]:
    """vLLM's aux ids for contract layer ids (i + 1), plus `num_layers` (the last layer, pre-norm) if asked."""
    aux = [int(i) + 1 for i in layer_ids]
    if with_last and num_layers not in aux:
        aux.append(int(num_layers))
    return aux


def speculative_config(aux: list[int]) -> dict[str, Any]:
    return {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(aux)}}}


def kv_transfer_config(storage: str | Path, *, cpu: bool) -> dict[str, Any]:
    """The connector: ours (CPU-safe, `kv_connector_module_path`) or vLLM's stock one (GPU)."""
    cfg: dict[str, Any] = {"kv_connector": CONNECTOR_CLASS if cpu else STOCK_CLASS, "kv_role": "kv_producer",
                           "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
    if cpu:
        cfg["kv_connector_module_path"] = CONNECTOR_MODULE
    return cfg


def serve_args(aux: list[int], storage: str | Path, *, cpu: bool) -> list[str]:
    """The `vllm serve` flags that make the server write hidden states at `aux` into `storage`."""
    return ["--speculative-config", json.dumps(speculative_config(aux)),
            "--kv-transfer-config", json.dumps(kv_transfer_config(storage, cpu=cpu))]


def install_connector(venv: Path) -> Path:
    """Write CONNECTOR_SOURCE into the engine venv's site-packages (once; rewritten when it changed)."""
    sites = sorted((venv / "lib").glob("python3*/site-packages"))
    if not sites:
        raise DflashkitError(f"{venv}: no lib/python3*/site-packages", hint="`dflashkit engines install vllm`")
    path = sites[0] / f"{CONNECTOR_MODULE}.py"
    if not path.is_file() or path.read_text() != CONNECTOR_SOURCE:
        tmp = path.with_suffix(".py.tmp")
        tmp.write_text(CONNECTOR_SOURCE)
        os.replace(tmp, path)
    return path


def request(base_url: str, model: str, ids: list[int], *, timeout_s: float = 600.0) -> str:
    """Send one tokenized sample (`max_tokens: 1`); the path of the hidden-states file the server writes."""
    body = {"model": model, "prompt": [int(i) for i in ids], "max_tokens": 1, "temperature": 0.0}
    shown = redact_url(base_url.rstrip("/") + "/completions")
    flags = ("start vLLM with the flags `dflashkit capture --dry-run` prints (--speculative-config "
             "extract_hidden_states and --kv-transfer-config)")
    try:
        out = post_json(base_url.rstrip("/") + "/completions", body, timeout_s=timeout_s)
    except HttpStatusError as e:  # the server is up but refuses the request: a re-run repeats it
        raise UsageError(f"the engine at {shown} answered HTTP {e.status} to a tokenized completion "
                         f"({excerpt({}, e.body)}): not a vLLM serving the target with extract_hidden_states",
                         hint=flags) from None
    except (HttpConnectError, HttpTimeout, HttpDropped) as e:  # it stopped answering: a re-run goes on
        raise ServerError(f"the engine at {shown} stopped answering ({type(e).__name__}: {e}); finished rows "
                          "are kept", hint="restart the engine and re-run the same command") from None
    except HttpError as e:  # a reply that is not JSON
        raise UsageError(f"the engine at {shown} did not answer a completion in JSON ({e}): not a vLLM server?",
                         hint=flags) from None
    path = ((out or {}).get("kv_transfer_params") or {}).get("hidden_states_path") if isinstance(out, dict) else None
    if not path:
        raise UsageError(f"{shown}: the completion response has no kv_transfer_params.hidden_states_path: "
                         "not a vLLM started with extract_hidden_states", hint=flags)
    return str(path)


@dataclass
class HiddenStates:
    """One request's file: [T, layers, H] in the engine's dtype, the token ids it was computed for."""

    hidden_states: torch.Tensor
    token_ids: torch.Tensor


def read(path: str | Path, *, sent: list[int] | None = None, timeout_s: float = 300.0,
         expect_layers: int | None = None) -> HiddenStates:
    """Wait for the server's write (its `.lock`, then the file), load it and check it against `sent`.

    Raises:
        DflashkitError: not written in time, unreadable, the wrong layer count, or token ids that are
            not the ones sent (the message says which position differs).
    """
    p = Path(path)
    lock = Path(str(p) + ".lock")
    deadline = time.monotonic() + timeout_s
    while not p.is_file():
        if lock.is_file():
            with open(lock) as fh:
                fcntl.flock(fh, fcntl.LOCK_SH)  # sleeps until the writer releases it
            if p.is_file():
                break
        if time.monotonic() > deadline:
            raise DflashkitError(f"{p}: the engine did not write the hidden states within {timeout_s:.0f} s",
                                 hint="read the engine log; the connector writes on the engine's next step")
        time.sleep(0.01)
    if lock.is_file():
        with open(lock) as fh:
            fcntl.flock(fh, fcntl.LOCK_SH)
    try:
        data = load_file(str(p))
        hs, ids = data["hidden_states"], data["token_ids"]
    except Exception as e:  # noqa: BLE001 - safetensors raises several types
        raise DflashkitError(f"{p}: unreadable hidden-states file ({e})", hint="re-run; the engine file is torn") from None
    if hs.dim() != 3 or hs.shape[0] != ids.shape[0]:
        raise DflashkitError(f"{p}: hidden_states {tuple(hs.shape)} do not match token_ids {tuple(ids.shape)}")
    if expect_layers is not None and hs.shape[1] != expect_layers:
        raise DflashkitError(f"{p}: {hs.shape[1]} layers of hidden states, expected {expect_layers} (the aux ids)",
                             hint="the server's --speculative-config aux ids differ from this run's; restart it with "
                             "the flags `dflashkit capture --dry-run` prints")
    if sent is not None:
        got = ids.tolist()
        if got != [int(i) for i in sent]:
            at = next((k for k, (a, b) in enumerate(zip(got, sent)) if a != b), min(len(got), len(sent)))
            raise DflashkitError(f"{p}: the engine computed {len(got)} tokens that differ from the {len(sent)} sent "
                                 f"(first difference at position {at})",
                                 hint="the server must take prompt token ids as they are (no template, no BOS added)")
    return HiddenStates(hs, ids)


def remove(path: str | Path) -> None:
    """Delete a request's file and its lock (after it is ingested)."""
    for q in (Path(path), Path(str(path) + ".lock")):
        try:
            q.unlink()
        except FileNotFoundError:
            pass
