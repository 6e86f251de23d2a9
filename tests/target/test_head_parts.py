"""Labels without the whole target: the final norm + LM head read by name give the full target's argmax.

Oracle: the full HF target (load_target) on the same ids. The head-only path gets only the last
decoder layer's output (what vLLM's aux id num_hidden_layers returns: before the final norm) and
must reproduce the target's last hidden state and its greedy next token at every position.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflashkit.target.head import load_head_parts
from dflashkit.target.load import load_target


def _shard(src, dst, *, prefix: str = "", per_file: int = 6):
    """Re-save `src`'s weights into several files + an index (names prefixed as wrapped checkpoints do)."""
    dst.mkdir()
    state = {prefix + k: v for k, v in load_file(src / "model.safetensors").items()}
    names, wmap = sorted(state), {}
    for i in range(0, len(names), per_file):
        fname = f"model-{i // per_file:05d}.safetensors"
        save_file({k: state[k].contiguous() for k in names[i:i + per_file]}, str(dst / fname), metadata={"format": "pt"})
        wmap.update({k: fname for k in names[i:i + per_file]})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


@pytest.mark.parametrize("arch,prefix", [("qwen3", ""), ("llama", ""), ("deepseek_v3", "language_model.")],
                         ids=["qwen3-sharded", "llama-tied", "kimi-style-prefix"])
def test_head_only_labels_equal_the_full_targets_argmax(tiny_targets, tmp_path, monkeypatch, arch, prefix):
    target_dir = _shard(tiny_targets[arch], tmp_path / "t", prefix=prefix)
    section = SimpleNamespace(path=str(target_dir), gguf_file=None, device="cpu", dtype="float32",
                              trust_remote_code=False, tokenizer=None, chat_template=None)
    full = load_target(section, with_tokenizer=False)
    ids = torch.randint(0, 259, (2, 23), generator=torch.Generator().manual_seed(0))
    last_layer = full.num_layers - 1
    with torch.no_grad():
        pre_norm, last = full.features(ids, layer_ids=[last_layer], need_last_hidden=True)
        want = full.next_token_ids(last)

    import safetensors

    read: list[str] = []
    real_open = safetensors.safe_open

    class Spy:
        def __init__(self, *a, **k):
            self.fh = real_open(*a, **k)

        def __enter__(self):
            self.fh.__enter__()
            return self

        def __exit__(self, *a):
            return self.fh.__exit__(*a)

        def keys(self):
            return self.fh.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.fh.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    parts = load_head_parts(target_dir)
    got_last = parts.final_norm(pre_norm)
    assert torch.allclose(got_last, last, atol=1e-5, rtol=1e-5), (got_last - last).abs().max()
    got = parts.next_token_ids(got_last)
    assert torch.equal(got, want), (got != want).float().mean()
    # only the embedding, the final norm and (untied) the head were read, by name through the index
    expect = {prefix + "model.embed_tokens.weight", prefix + "model.norm.weight"}
    if arch != "llama":
        expect.add(prefix + "lm_head.weight")
    assert set(read) == expect, read
    assert parts.vocab_size == full.vocab_size and parts.hidden_size == full.hidden_size
    assert torch.equal(parts.embed.weight, full.model.get_input_embeddings().weight)


def test_a_checkpoint_without_a_final_norm_is_named(tiny_qwen3, tmp_path):
    d = _shard(tiny_qwen3, tmp_path / "t")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"].pop("model.norm.weight")
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    from dflashkit.errors import UsageError

    with pytest.raises(UsageError, match="final norm"):
        load_head_parts(d)
