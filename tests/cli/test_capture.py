"""`dflashkit capture`: streamed safetensors shards, resume, disk refusal, layer-id guard, online == cached."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from dflashkit.cli import main
from dflashkit.config import load_config
from dflashkit.target.load import load_target
from dflashkit.rundir import RunDir
from dflashkit.train.data import load_tokenized
from tests.helpers import make_run, overrides


def test_capture_features_equal_target_and_resume(tmp_path, tiny_qwen3, capsys):
    rd = make_run(tmp_path / "r", tiny_qwen3)
    ov = overrides(rd, tiny_qwen3) + ["capture.dtype=float32", "capture.batch_size=3"]
    assert main(["capture", *ov]) == 0
    out = capsys.readouterr().out
    assert "GB in total" in out.splitlines()[0]  # size printed before the work
    res = json.loads(out.strip().splitlines()[-1])
    # features + next ids + the greedy path of depth B − 1 = 3 (the held-out samples' rows)
    assert res["written"] == 2 and res["bytes_total"] == res["tokens"] * (2 * 64 * 4 + 4 + 3 * 4)
    assert res["path_ids"]["rows"] == "heldout" and res["path_ids"]["tokens"] > 0
    data = load_tokenized(RunDir(rd))
    target = load_target(load_config(None, ov).target)
    contract = json.loads((rd / "contract.json").read_text())
    with safe_open(str(rd / "capture" / "shard-00001.safetensors"), framework="pt") as fh:
        assert json.loads(fh.metadata()["target_layer_ids"]) == contract["target_layer_ids"]
        feats, offs = fh.get_tensor("features"), fh.get_tensor("offsets")
    i = data.where.index((1, 2))
    want = target.features(torch.from_numpy(data.input_ids[i])[None], layer_ids=contract["target_layer_ids"])[0]
    got = feats[int(offs[2]):int(offs[3])]
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    mtime = (rd / "capture" / "shard-00000.safetensors").stat().st_mtime_ns
    assert main(["capture", "--json", *ov]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["skipped"] == 2 and res["written"] == 0
    assert (rd / "capture" / "shard-00000.safetensors").stat().st_mtime_ns == mtime


def test_capture_refuses_when_disk_too_small(tmp_path, tiny_qwen3, capsys):
    rd = make_run(tmp_path / "r", tiny_qwen3)
    rc = main(["capture", "--json", *overrides(rd, tiny_qwen3), "capture.max_disk_fraction=1e-15"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 2 and "free" in out["error"]
    assert not list((rd / "capture").glob("*.safetensors"))


@pytest.mark.parametrize("extra", [[], ["drafter.draft_vocab_size=24"], ["train.labels=target"],
                                   ["train.labels=target", "drafter.draft_vocab_size=24"],
                                   ["train.labels=target", "train.loss=ce+kl"], ["train.loss=kl"],
                                   ["train.labels=target", "train.target_dtype=bfloat16"],
                                   ["train.labels=target", "drafter.init=target"],
                                   ["train.labels=target", "train.on_path=rollout"],
                                   ["train.labels=target", "train.on_path=mask", "train.position_weighting=dpace"]],
                         ids=["full-vocab", "draft-vocab", "target-labels", "target-labels-draft-vocab",
                              "target-labels-ce+kl", "kl", "bf16-target-forward",
                              "target-labels-init-from-target", "on-path-rollout", "on-path-mask-dpace"])  # the shards hold every output, the layers are still needed
def test_online_equals_cached_loss(tmp_path, tiny_qwen3, capsys, extra):
    rd_on = make_run(tmp_path / "on", tiny_qwen3)
    rd_ca = make_run(tmp_path / "ca", tiny_qwen3)
    assert main(["capture", "--json", *overrides(rd_ca, tiny_qwen3), "capture.dtype=float32", *extra]) == 0
    if "train.loss=kl" in extra or "train.loss=ce+kl" in extra:  # capture kept what cached KL needs
        from safetensors import safe_open

        with safe_open(str(rd_ca / "capture" / "shard-00000.safetensors"), "pt") as fh:
            assert {"features", "next_ids", "last_hidden", "offsets"} <= set(fh.keys()) <= \
                {"features", "next_ids", "last_hidden", "offsets", "path_ids"}  # path_ids: held-out samples
    assert main(["train", "--json", *overrides(rd_on, tiny_qwen3, train__max_steps=3), *extra]) == 0
    assert main(["train", "--json", *overrides(rd_ca, tiny_qwen3, train__max_steps=3, train__features="cached"),
                 *extra]) == 0
    on = [json.loads(x)["loss"] for x in (rd_on / "train" / "metrics.jsonl").read_text().splitlines()]
    ca = [json.loads(x)["loss"] for x in (rd_ca / "train" / "metrics.jsonl").read_text().splitlines()]
    assert len(on) == len(ca) == 4 and torch.allclose(torch.tensor(on), torch.tensor(ca), atol=1e-4), (on, ca)


def test_cached_features_with_other_layer_ids_are_refused(tmp_path, tiny_qwen3, capsys):
    rd = make_run(tmp_path / "r", tiny_qwen3)
    assert main(["capture", "--json", *overrides(rd, tiny_qwen3)]) == 0
    c = json.loads((rd / "contract.json").read_text())
    c["target_layer_ids"] = [0, 2]
    (rd / "contract.json").write_text(json.dumps(c))
    capsys.readouterr()
    rc = main(["train", "--json", *overrides(rd, tiny_qwen3, train__features="cached")])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 2 and "target_layer_ids" in out["error"] and "capture" in out["hint"]


def _losses(rd) -> list[float]:
    return [json.loads(x)["loss"] for x in (rd / "train" / "metrics.jsonl").read_text().splitlines()]


def test_extra_captured_layers_serve_any_subset_of_layers_as_if_captured_alone(tmp_path, tiny_qwen3, capsys):
    """capture.extra_layer_ids: one capture, several drafters' feature layers. The reader's selection of the
    contract's layers equals a capture of those layers alone (bit for bit), and a drafter on other layers
    (a subset of the captured ones, in another order than stored) trains on them exactly as online."""
    from dflashkit.data.features import FeatureStore

    plain, wide = make_run(tmp_path / "plain", tiny_qwen3), make_run(tmp_path / "wide", tiny_qwen3)
    ids = json.loads((plain / "contract.json").read_text())["target_layer_ids"]
    others = sorted(set(range(4)) - set(ids))
    assert main(["capture", "--json", *overrides(plain, tiny_qwen3), "capture.dtype=float32"]) == 0
    assert main(["capture", "--json", *overrides(wide, tiny_qwen3), "capture.dtype=float32",
                 f"capture.extra_layer_ids={json.dumps(others[::-1] + [ids[0]])}"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["target_layer_ids"] == ids + others  # the contract's first, then the extras ascending, once
    data = load_tokenized(RunDir(plain))
    a = FeatureStore(plain / "capture", data.shards, ids)
    b = FeatureStore(wide / "capture", data.shards, ids)
    for i, n in enumerate(len(x) for x in data.input_ids):
        assert torch.equal(a.get(data.where[i], n), b.get(data.where[i], n))
    for rd in (plain, wide):
        assert main(["train", "--json", *overrides(rd, tiny_qwen3, train__max_steps=2, train__features="cached")]) == 0
    assert _losses(plain) == _losses(wide)

    # another drafter on [others[1], ids[0]]: cached from `wide` ≡ online
    online = make_run(tmp_path / "online", tiny_qwen3)
    for rd in (wide, online):
        c = json.loads((rd / "contract.json").read_text())
        c["target_layer_ids"] = [others[1], ids[0]] if others[1] < ids[0] else [ids[0], others[1]]
        (rd / "contract.json").write_text(json.dumps(c))
    import shutil

    shutil.rmtree(wide / "train")
    capsys.readouterr()
    assert main(["capture", "--json", *overrides(wide, tiny_qwen3), "capture.dtype=float32"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["skipped"] == 2  # the shards hold them
    assert main(["train", "--json", *overrides(wide, tiny_qwen3, train__max_steps=3, train__features="cached")]) == 0
    assert main(["train", "--json", *overrides(online, tiny_qwen3, train__max_steps=3)]) == 0
    on, ca = _losses(online), _losses(wide)
    assert len(on) == 4 and torch.allclose(torch.tensor(on), torch.tensor(ca), atol=1e-4), (on, ca)


@pytest.mark.parametrize("extra,where", [("[99]", "outside the target"), ("[-1]", ">= 0"), ("[2, 2]", "duplicated")])
def test_bad_extra_layer_ids_are_refused_naming_the_key(tmp_path, tiny_qwen3, capsys, extra, where):
    rd = make_run(tmp_path / "r", tiny_qwen3)
    rc = main(["capture", "--json", *overrides(rd, tiny_qwen3), f"capture.extra_layer_ids={extra}"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 2 and "capture.extra_layer_ids" in out["error"] and where in out["error"], out
    assert not list((rd / "capture").glob("*.safetensors"))
