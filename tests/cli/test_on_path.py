"""`train.on_path`: training labels on the target's own greedy path (rollout) or only where it is kept (mask),
the held-out yardstick scored on that path, path_ids in the capture shards, and the refusals."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from dflashkit.cli import main
from dflashkit.config import load_config
from dflashkit.rundir import RunDir
from dflashkit.train.heldout import evaluate_heldout
from dflashkit.train.loop import setup
from dflashkit.train.objective import labels_and_weights
from dflashkit.train.parallel import init_distributed
from tests.helpers import make_run, overrides

NEAR_TIE = 1e-4


def _trainer(rd, target_dir, *extra: str, **train):
    cfg = load_config(None, overrides(rd, target_dir, **train) + list(extra))
    return setup(cfg, RunDir(rd), init_distributed(cfg.train.parallel, "cpu"))


def _oracle_path(model, prefix: list[int], depth: int) -> list[int | None]:
    """Greedy decode after `prefix` by full forwards; None from the first near-tie on (it may flip)."""
    seq, out = list(prefix), []
    with torch.no_grad():
        for _ in range(depth):
            logits = model(torch.tensor([seq]), logits_to_keep=1).logits[0, -1]
            top = logits.topk(2).values
            if float(top[0] - top[1]) < NEAR_TIE:
                return out + [None] * (depth - len(out))
            out.append(int(logits.argmax()))
            seq.append(out[-1])
    return out


@pytest.mark.parametrize("features", ["online", "cached"])
def test_rollout_trains_every_label_on_the_targets_own_path(tmp_path, tiny_qwen3, capsys, features):
    rd = make_run(tmp_path / "r", tiny_qwen3)
    kw = dict(train__labels="target", train__on_path="rollout", train__features=features)
    if features == "cached":
        assert main(["capture", "--json", *overrides(rd, tiny_qwen3, **kw)]) == 0
        meta = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["path_ids"]
        assert meta["rows"] == "all" and meta["depth"] == 3 and meta["rolled_tokens"] > 0
    tr = _trainer(rd, tiny_qwen3, **kw)
    model = tr.target.model if features == "online" else _trainer(rd, tiny_qwen3, "train.features=online",
                                                                   **{**kw, "train__features": "online"}).target.model
    B = tr.contract.block_size
    checked = off_raw = 0
    for items in tr.plan.micro_batches(0, 0) + tr.plan.micro_batches(1, 0):
        b = tr.batch(items)
        a = tr.anchors(b)
        tout = tr.target_outputs(b, a)
        assert tout.path_ids is not None and not tout.on_path_only
        labels, w = labels_and_weights(b.input_ids, b.loss_mask, b.seq_lens, a, block_size=B, gamma=2.0,
                                       label_ids=tout.label_ids, path_ids=tout.path_ids)
        raw, _ = labels_and_weights(b.input_ids, b.loss_mask, b.seq_lens, a, block_size=B, gamma=2.0,
                                    label_ids=tout.label_ids)
        labels, w, raw = labels.view(*a.anchors.shape, B), w.view(*a.anchors.shape, B), raw.view(*a.anchors.shape, B)
        for i in range(a.anchors.shape[0]):
            for j in range(a.anchors.shape[1]):
                if not a.keep[i, j]:
                    continue
                anc = int(a.anchors[i, j])
                want = _oracle_path(model, b.input_ids[i, :anc + 1].tolist(), B - 1)
                for k in range(1, B):
                    if w[i, j, k] > 0 and want[k - 1] is not None:
                        assert int(labels[i, j, k]) == want[k - 1], (i, anc, k, labels[i, j], want)
                        checked += 1
                        off_raw += int(raw[i, j, k]) != want[k - 1]
    assert checked >= 40 and off_raw >= 5, (checked, off_raw)  # raw-argmax labels left the path: the test bites


class PathOracle(torch.nn.Module):
    """A drafter stub whose every prediction is the target's greedy path label of its block position
    (one-hot over the vocab; read through an identity head), from the paths `batch_paths` holds."""

    def __init__(self, block_size: int, vocab: int):
        super().__init__()
        self.block_size, self.vocab = block_size, vocab
        self.contract = SimpleNamespace(is_dflash2=False)
        self.paths: torch.Tensor | None = None   # [b, S, D], set per batch

    def forward(self, noise, ctx, pos, attention_mask=None):
        assert self.paths is not None
        b, nb = noise.shape[:2]
        k = torch.arange(nb) % self.block_size
        anchor = pos[:, ctx.shape[1]:] - k                                  # [b, N·B]
        lv = (k - 1).clamp(min=0).expand(b, nb)
        tok = self.paths[torch.arange(b)[:, None], anchor.clamp(min=0), lv].clamp(min=0)
        return torch.nn.functional.one_hot(tok, self.vocab).float()


@pytest.mark.parametrize("case", ["online", "cached", "cached-without-paths"])
def test_heldout_tau_is_scored_on_the_targets_path(tmp_path, tiny_qwen3, capsys, case):
    """A drafter that always drafts the target's own greedy path is right at every held-out position scored
    on that path, and wrong against the raw-argmax labels wherever the raw text left the path."""
    rd = make_run(tmp_path / "r", tiny_qwen3)
    kw = dict(train__labels="target")
    if case != "online":
        kw["train__features"] = "cached"
        held = "train.heldout_samples=0" if case == "cached-without-paths" else "train.heldout_samples=2"
        assert main(["capture", "--json", *overrides(rd, tiny_qwen3, **kw), held]) == 0  # paths of no / 2 samples
    tr = _trainer(rd, tiny_qwen3, **kw)
    assert tr.heldout_labels == ("on_path_positions" if case == "cached-without-paths" else "target_path")
    ev = _eval_with_oracle(tr, rd, tiny_qwen3)
    B = tr.contract.block_size
    assert ev["heldout_labels"] == tr.heldout_labels
    assert ev["acc_raw"][0] == 1.0 and min(a for a in ev["acc_raw"][1:] if a is not None) < 1.0, ev
    if case == "cached-without-paths":  # scored on the positions still on the path only: there it is right
        assert ev["acc"][0] == 1.0 and all(a in (1.0, None) for a in ev["acc"]), ev
        assert ev["tau"] <= ev["tau_raw"], ev  # a position on the path has its raw-argmax label = its path label
    else:
        assert ev["acc"] == [1.0] * (B - 1) and ev["tau_raw"] < ev["tau"], ev


def _eval_with_oracle(tr, rd, target_dir):
    """`evaluate_heldout` with the PathOracle drafter (its paths from the full target: cached runs load the
    head only)."""
    from dflashkit.model.path_labels import greedy_path_ids, path_depth

    full = tr if hasattr(tr.target, "model") else _trainer(rd, target_dir, train__labels="target")
    V = tr.target.vocab_size
    stub = PathOracle(tr.contract.block_size, V)
    head = torch.nn.Linear(V, V, bias=False)
    head.weight.data = torch.eye(V)
    tr.drafter, tr.head = stub, head
    real = tr.batch

    def batch(items, **kw):
        b = real(items, **kw)
        stub.paths = greedy_path_ids(full.target, b.input_ids, b.seq_lens, path_depth(tr.contract.block_size),
                                     attention_mask=b.attention_mask).path_ids
        return b

    tr.batch = batch
    return evaluate_heldout(tr, 0)


@pytest.mark.parametrize("extra,key", [
    (["train.on_path=mask"], "train.labels=target"),
    (["train.labels=target", "train.on_path=rollout", "train.features=engine", "capture.engine=vllm"],
     "train.features=engine"),
    (["train.labels=target", "train.on_path=rollout", "train.features=cached", "capture.engine=vllm"],
     "capture.engine=vllm"),
    (["train.labels=target", "train.on_path=rollout", "train.loss=ce+kl"], "train.loss=ce+kl"),
    (["train.labels=target", "train.on_path=rollout", "train.parallel.target=shard"], "train.parallel.target=shard"),
], ids=["needs-target-labels", "engine-features", "engine-capture", "kl", "sharded-online"])
def test_on_path_combinations_that_cannot_work_are_refused_naming_the_key(tmp_path, tiny_qwen3, capsys, extra, key):
    rd = make_run(tmp_path / "r", tiny_qwen3)
    assert main(["train", "--json", *overrides(rd, tiny_qwen3), *extra]) == 2
    err = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["error"]
    assert "train.on_path" in err and key in err, err
    assert not (rd / "train").exists()


def test_cached_rollout_without_paths_in_the_shards_says_to_recapture(tmp_path, tiny_qwen3, capsys):
    rd = make_run(tmp_path / "r", tiny_qwen3)
    assert main(["capture", "--json", *overrides(rd, tiny_qwen3, train__labels="target")]) == 0  # held-out paths only
    capsys.readouterr()
    ov = overrides(rd, tiny_qwen3, train__labels="target", train__on_path="rollout", train__features="cached")
    outs = []
    for dry in (["--dry-run"], []):  # the dry run refuses what the run refuses (`train.loop.preflight`)
        rc = main(["train", "--json", *dry, *ov])
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert rc == 2 and "path_ids" in out["error"] and "dflashkit capture" in out["hint"], out
        outs.append(out["error"])
    assert outs[0] == outs[1]
    assert not (rd / "train" / "final").exists()


def test_capture_adds_missing_paths_without_recomputing_the_features(tmp_path, tiny_qwen3, capsys):
    rd = make_run(tmp_path / "r", tiny_qwen3)
    base = overrides(rd, tiny_qwen3, train__labels="target")
    assert main(["capture", "--json", *base]) == 0
    capsys.readouterr()
    shard = rd / "capture" / "shard-00000.safetensors"
    with safe_open(str(shard), "pt") as fh:
        before = {k: fh.get_tensor(k) for k in ("features", "next_ids", "offsets")}
    assert main(["capture", *base, "train.on_path=rollout"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    res = json.loads(out[-1])
    assert "2 more to add greedy paths to" in out[0] and res["to_write"] == 2, out
    assert res["path_ids"]["rows"] == "all" and res["path_ids"]["extra_per_token"] > 0
    assert any(line.startswith("capture: greedy paths (depth 3)") for line in out), out
    with safe_open(str(shard), "pt") as fh:
        assert fh.metadata()["path_rows"] == "all" and fh.metadata()["path_depth"] == "3"
        for k, v in before.items():
            assert torch.equal(fh.get_tensor(k), v), k  # the features were kept, not recomputed
        path = fh.get_tensor("path_ids")
    assert torch.equal(path[:, 0], before["next_ids"])  # level 0 of the path is the argmax after the prefix
    manifest = json.loads((rd / "capture" / "manifest.json").read_text())
    assert manifest["counts"]["path_ids"]["rolled_tokens"] == res["path_ids"]["rolled_tokens"] > 0
    assert main(["capture", "--json", *base, "train.on_path=rollout"]) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["skipped"] == 2 and again["written"] == 0
    assert again["path_ids"]["rolled_tokens"] == res["path_ids"]["rolled_tokens"]  # the cost of the one that ran


def test_capture_is_stale_when_the_heldout_split_or_rollout_changes(tiny_qwen3):
    from dflashkit.stage_table import stage_hash

    def h(*extra: str) -> str:
        return stage_hash("capture", load_config(None, [f"target.path={tiny_qwen3}", *extra]))

    base = h()
    assert h("train.heldout_samples=3") != base and h("run.seed=5") != base
    assert h("train.heldout_sources=[x]") != base
    assert h("train.labels=target", "train.on_path=rollout") != base
    assert h("train.labels=target", "train.on_path=mask") == h("train.labels=target") == base  # nothing to capture


def test_a_resume_under_another_on_path_is_refused(tmp_path, tiny_qwen3, capsys):
    from dflashkit.train.guards import TRAJECTORY_KEYS

    assert "on_path" in TRAJECTORY_KEYS
    rd = make_run(tmp_path / "r", tiny_qwen3)
    ov = overrides(rd, tiny_qwen3, train__labels="target", train__max_steps=2, train__save_every=1)
    assert main(["train", "--json", *ov]) == 0
    capsys.readouterr()
    assert main(["train", "--json", *ov, "train.max_steps=3", "train.on_path=mask"]) == 2
    err = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["error"]
    assert "train.on_path: 'off' in the checkpoint, now 'mask'" in err, err


def test_curve_and_eval_rows_say_how_heldout_was_scored(tmp_path, tiny_qwen3, capsys):
    rd = make_run(tmp_path / "r", tiny_qwen3)
    assert main(["train", "--json", *overrides(rd, tiny_qwen3, train__labels="target", train__max_steps=2,
                                               train__on_path="mask")]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["heldout"]["heldout_labels"] == "target_path" and "tau_raw" in res["heldout"]
    curve = json.loads((rd / "train" / "curve.json").read_text())
    assert curve["heldout_labels"] == "target_path"
    point = curve["points"][-1]["heldout"]
    assert point["labels"] == "target_path" and point["tau_raw"] is not None and point["acc1_raw"] is not None
    rows = [json.loads(x) for x in (rd / "train" / "metrics.jsonl").read_text().splitlines()]
    held = [r for r in rows if r.get("split") == "heldout"]
    assert held and held[-1]["heldout_labels"] == "target_path" and len(held[-1]["acc_raw"]) == 3
