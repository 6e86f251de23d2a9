"""DSpark: vLLM's tensor names and config keys, the Markov bias and the confidence head, the loss terms, lossless
greedy and sampled speculative decoding through the Markov walk, and export → reload (ours and the shipped
dflash.py) with the same logits and confidences."""

from __future__ import annotations

import pytest
import torch

from dflashkit.config import TargetSection
from dflashkit.decode.api import SamplingParams
from dflashkit.decode.spec_decode import SpecDecoder
from dflashkit.errors import UsageError
from dflashkit.family import get, new_drafter
from dflashkit.family.base import DraftSampling
from dflashkit.family.contract import DrafterContract
from dflashkit.family.dflash import propose as dflash_propose
from dflashkit.model.dspark import Qwen3DSparkModel, init_from_dflash
from dflashkit.target.load import load_target
from dflashkit.testing import random_drafter
from dflashkit.train.loss import Heads, LossInputs
from tests.decode.test_sampling import N_SAMPLES, _chi2_z, _samples, small  # noqa: F401 - `small` is a fixture
from tests.helpers import random_case, record_proposals, tiny_contract, train_loss, with_fields

V, H, R = 50, 32, 6
PROMPT = [1, 60, 61, 62, 63, 64, 10, 65, 66, 67, 68, 2, 10]


def dspark_contract(**knobs) -> DrafterContract:
    return with_fields(tiny_contract(block_size=4, vocab=V, hidden=H), drafter_type="dspark", dspark_markov_rank=R,
                       **knobs)


def strong_markov(d: Qwen3DSparkModel, seed: int = 1, std: float = 1.0) -> Qwen3DSparkModel:
    """A Markov head that changes the drafts (the fresh one's bias is ~0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.markov_head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return d


def test_tensor_names_shapes_and_config_keys_are_vllms():
    c = dspark_contract(dspark_confidence_with_markov=True)
    m = new_drafter(c, draft_vocab=torch.tensor([1, 3, 4, 9, 20, 21, 30, 49]))
    assert isinstance(m, Qwen3DSparkModel)
    shapes = {k: tuple(v.shape) for k, v in m.state_dict().items() if "_head." in k}
    assert shapes == {"markov_head.markov_w1.weight": (V, R), "markov_head.markov_w2.weight": (8, R),
                      "confidence_head.proj.weight": (1, H + R), "confidence_head.proj.bias": (1,)}
    assert not any(k.startswith("lm_head") for k in m.state_dict())
    cfg = c.to_hf_config()
    assert cfg["architectures"] == ["Qwen3DSparkModel"]
    assert {k: cfg[k] for k in ("markov_rank", "markov_head_type", "enable_confidence_head",
                                "confidence_head_with_markov", "sample_from_anchor")} == \
        {"markov_rank": R, "markov_head_type": "vanilla", "enable_confidence_head": True,
         "confidence_head_with_markov": True, "sample_from_anchor": False}
    back = DrafterContract.from_hf_config(cfg)
    assert back.drafter_type == "dspark" and back.knobs == c.knobs
    no_conf = new_drafter(dspark_contract(dspark_confidence_head=False))
    assert no_conf.confidence_head is None and not any("confidence" in k for k in no_conf.state_dict())


def test_import_refuses_what_it_would_draft_differently():
    cfg = dspark_contract().to_hf_config()
    fam = get("dspark")
    for change, key in (({"sample_from_anchor": True}, "sample_from_anchor"),
                        ({"sample_from_anchor": None}, "sample_from_anchor"),
                        ({"markov_rank": None}, "markov_rank"),
                        ({"markov_head_type": "gated"}, "markov_head_type"),
                        ({"enable_confidence_head": "yes"}, "enable_confidence_head")):
        bad = {k: v for k, v in {**cfg, **change}.items() if v is not None}
        with pytest.raises(UsageError, match=key):
            fam.formats.read_knobs(bad, bad["dflash_config"], "x/config.json")


def test_the_markov_bias_is_the_previous_tokens_and_zero_w2_is_dflash():
    torch.manual_seed(0)
    m = strong_markov(new_drafter(dspark_contract())).eval()
    h = torch.randn(2, 3, H)
    base = torch.randn(2, 3, V)
    prev = torch.tensor([[4, 7, 7], [1, 2, 3]])
    logits, conf = m.heads(h, base, prev)
    w1, w2 = m.markov_head.markov_w1.weight, m.markov_head.markov_w2.weight
    assert torch.allclose(logits, base + w1[prev] @ w2.T, atol=1e-5)
    assert torch.allclose(logits[0, 1], logits[0, 2] - base[0, 2] + base[0, 1], atol=1e-5)  # same prev, same bias
    assert conf is not None and conf.shape == (2, 3) and bool(((conf > 0) & (conf < 1)).all())
    assert torch.allclose(conf, m.confidence(h, prev))
    assert torch.allclose(conf, torch.sigmoid(h @ m.confidence_head.proj.weight[0] + m.confidence_head.proj.bias))
    # the walk: some draft differs from the head's argmax; with markov_w2 = 0 it is DFlash's argmax
    row = base[0]
    walked, _ = m.draft(row, anchor=5)
    assert walked != row.argmax(-1).tolist() or m.draft(base[1], anchor=5)[0] != base[1].argmax(-1).tolist()
    tokens, law = get("dspark").decoding.propose(m, h[:1], row, 5, DraftSampling(), None, V)
    assert (tokens, law) == (walked, None)
    with torch.no_grad():
        m.markov_head.markov_w2.weight.zero_()
    assert torch.equal(m.heads(h, base, prev)[0], base)
    assert get("dspark").decoding.propose(m, h[:1], row, 5, DraftSampling(), None, V)[0] == \
        dflash_propose(m, h[:1], row, 5, DraftSampling(), None, V)[0]


def test_a_proposals_confidence_reads_the_anchor_then_the_proposed_tokens():
    torch.manual_seed(0)
    m = strong_markov(new_drafter(dspark_contract(dspark_confidence_with_markov=True))).eval()
    h = torch.randn(1, 3, H)
    p = m.proposal_confidence(h, 5, [8, 2, 11])
    assert torch.allclose(p, m.confidence(h[0], torch.tensor([5, 8, 2])))
    assert not torch.allclose(p, m.confidence(h[0], torch.tensor([8, 2, 11])))  # the embedding is read


def test_confidence_needs_the_head_and_its_term_is_empty_without_it():
    torch.manual_seed(0)
    m = new_drafter(dspark_contract(dspark_confidence_head=False))
    with pytest.raises(UsageError, match="dspark_confidence_head"):
        m.confidence(torch.randn(1, 2, H), torch.tensor([[1, 2]]))
    heads, x, a = _case()
    out = train_loss(m.contract, gamma=2.0)(m, heads, x, a)
    no_conf = train_loss(m.contract, gamma=2.0, dspark_confidence_loss_weight=0.0)(m, heads, x, a)
    assert out.extra["confidence_rows"] == 0 and out.extra["markov_loss"] > 0
    assert torch.equal(out.loss.detach(), no_conf.loss.detach())


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    embed = torch.nn.Embedding(V, H)
    lm_head = torch.nn.Linear(H, V, bias=False)
    lm, lens, a = random_case(seed, b=3, s=13, block=4, num_anchors=5)
    ids = torch.randint(0, V - 1, lm.shape, generator=g)
    feats = torch.randn(3, 13, 2 * H, generator=g)
    return Heads(embed, lm_head), LossInputs(feats, ids, lm, lens), a


def test_the_loss_has_markov_and_confidence_terms_and_steps_lower_it():
    torch.manual_seed(0)
    m = strong_markov(new_drafter(dspark_contract()), std=0.3)
    heads, x, a = _case()
    full = train_loss(m.contract, gamma=2.0)(m, heads, x, a)
    assert full.extra["markov_loss"] > 0 and full.extra["confidence_loss"] > 0 and full.extra["confidence_rows"] > 0
    no_conf = train_loss(m.contract, gamma=2.0, dspark_confidence_loss_weight=0.0)(m, heads, x, a)
    no_terms = train_loss(m.contract, gamma=2.0, dspark_confidence_loss_weight=0.0,
                          dspark_markov_loss_weight=0.0)(m, heads, x, a)
    assert float(full.loss.detach()) > float(no_conf.loss.detach()) > float(no_terms.loss.detach())
    full.loss.backward()
    assert m.markov_head.markov_w1.weight.grad.abs().sum() > 0 and m.markov_head.markov_w2.weight.grad.abs().sum() > 0
    assert m.confidence_head.proj.weight.grad.abs().sum() > 0
    m.zero_grad()
    loss = train_loss(m.contract, gamma=2.0)
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    first = None
    for _ in range(8):
        opt.zero_grad()
        out = loss(m, heads, x, a)
        out.loss.backward()
        opt.step()
        first = float(out.loss.detach()) if first is None else first
    assert float(loss(m, heads, x, a).loss.detach()) < first


@pytest.fixture(scope="module")
def target(tiny_targets):
    return load_target(TargetSection(path=str(tiny_targets["qwen3"]), device="cpu", dtype="float32"))


def test_greedy_speculative_equals_target_greedy(target, monkeypatch):
    drafter = random_drafter(target, drafter_type="dspark", dspark_markov_rank=8)
    strong_markov(drafter, std=2.0)
    params = SamplingParams(max_new_tokens=23)
    base = SpecDecoder(target, None, block_size=1).generate(PROMPT, params).token_ids
    calls = record_proposals(monkeypatch)
    for b in (2, 4):
        r = SpecDecoder(target, drafter, block_size=b).generate(PROMPT, params)
        assert r.token_ids == base, f"B={b}"
        assert sum(r.acceptance_lengths) == 22 and all(1 <= a <= b for a in r.acceptance_lengths)
    assert calls and any(tokens != logits.argmax(-1).tolist() for _, logits, _, tokens in calls)  # the Markov head changed some drafts


def dspark_like(drafter, std: float = 3.0):
    """A DSpark drafter with `drafter`'s DFlash weights and a strong random Markov head."""
    c = DrafterContract.from_dict({**drafter.contract.to_dict(), "drafter_type": "dspark", "dspark_markov_rank": 4})
    torch.manual_seed(6)
    d = Qwen3DSparkModel(c).eval()
    d.load_state_dict(init_from_dflash(d, drafter.state_dict()))
    return strong_markov(d, std=std)


def test_markov_walk_sampling_matches_the_target_law(small):  # noqa: F811 - the imported fixture
    """Position t draws from its law given the draw at t − 1; that law is the rule's q, so the output law is the
    target's (χ² against the exact law)."""
    target, drafter, prompt, law = small
    dec = SpecDecoder(target, dspark_like(drafter), block_size=4, draft_sampling="sample")
    z = _chi2_z(_samples(dec, prompt, N_SAMPLES, 1.0), law)
    assert abs(z) < 4.0, f"chi-square z = {z:.2f} (|z| < 4 expected for the target's law)"


def test_the_law_test_detects_a_draft_law_without_the_markov_bias(small, monkeypatch):  # noqa: F811
    """Handing the rule the head's softmax instead of the walk's q (the Markov bias ignored) is lossy."""
    target, drafter, prompt, law = small
    real = SpecDecoder._propose

    def wrong_q(self, h, logits, anchor, params, gen, block=None):
        tokens, _ = real(self, h, logits, anchor, params, gen, block)
        return tokens, torch.softmax(logits.float() / params.temperature, -1)

    monkeypatch.setattr(SpecDecoder, "_propose", wrong_q)
    dec = SpecDecoder(target, dspark_like(drafter), block_size=4, draft_sampling="sample")
    z = _chi2_z(_samples(dec, prompt, 200, 1.0), law)
    assert z > 4.0, f"the wrong draft law went undetected (z = {z:.2f})"


def test_confidence_truncated_sampling_keeps_the_target_law(small, monkeypatch):  # noqa: F811
    """Verification cut short by the confidence head (`confidence_cut`, serve.confidence_truncation) while drafts
    are sampled: fewer drafts are verified on some blocks and the output law is still the target's (χ²)."""
    from dflashkit.decode.draft_length import ConfidenceCut

    target, drafter, prompt, law = small
    d = dspark_like(drafter)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # estimates spread over (0, 1), so the cut lands at different lengths
        d.confidence_head.proj.weight.copy_(torch.randn(d.confidence_head.proj.weight.shape, generator=g) * 0.1)
    kept: list[int] = []
    real = ConfidenceCut.choose

    def choose(self, conf):
        kept.append(real(self, conf))
        return kept[-1]

    monkeypatch.setattr(ConfidenceCut, "choose", choose)
    dec = SpecDecoder(target, d, block_size=4, draft_sampling="sample", confidence_cut=0.5)
    z = _chi2_z(_samples(dec, prompt, N_SAMPLES, 1.0), law)
    assert kept and min(kept) < 3 and max(kept) > min(kept), f"the cut never changed a block's length: {set(kept)}"
    assert abs(z) < 4.0, f"chi-square z = {z:.2f} (|z| < 4 expected for the target's law)"


def test_the_sampled_law_is_the_drawn_rows():
    """The law propose returns at T > 0 is, row by row, the law of the draw after the previous draw."""
    from dflashkit.decode.sampling import sample, sampling_probs

    torch.manual_seed(0)
    m = strong_markov(new_drafter(dspark_contract())).eval()
    base = torch.randn(3, V)
    s = DraftSampling(temperature=1.0, law=lambda x: sampling_probs(x, 1.0), draw=sample,
                      generator=torch.Generator().manual_seed(3))
    tokens, q = get("dspark").decoding.propose(m, None, base, 7, s, None, V)
    prev = [7, *tokens[:-1]]
    want = torch.softmax(base + m.markov_bias(torch.tensor(prev)), dim=-1)
    assert q is not None and torch.allclose(q, want, atol=1e-5)


def test_a_reduced_draft_vocab_drafts_target_ids_and_its_law_is_zero_outside():
    from dflashkit.decode.sampling import sample, sampling_probs

    vocab = torch.tensor([1, 3, 4, 9, 20, 21, 30, 49])
    torch.manual_seed(0)
    m = strong_markov(new_drafter(dspark_contract(), draft_vocab=vocab)).eval()
    base = torch.randn(3, 8)
    tokens, law = get("dspark").decoding.propose(m, None, base, 7, DraftSampling(), vocab, V)
    want, prev = [], torch.tensor([7])
    for t in range(3):  # the oracle loop: the bias reads the previous target id, the argmax is a draft index
        prev = vocab[(base[t] + m.markov_head.markov_w2.weight @ m.markov_head.markov_w1.weight[prev[0]]).argmax()][None]
        want.append(int(prev))
    assert law is None and tokens == want and set(tokens) <= set(vocab.tolist())
    s = DraftSampling(temperature=1.0, law=lambda x: sampling_probs(x, 1.0), draw=sample,
                      generator=torch.Generator().manual_seed(3))
    tokens, q = get("dspark").decoding.propose(m, None, base, 7, s, vocab, V)
    outside = torch.ones(V, dtype=torch.bool)
    outside[vocab] = False
    assert q is not None and q.shape == (3, V) and bool((q[:, outside] == 0).all())
    assert torch.allclose(q.sum(-1), torch.ones(3)) and set(tokens) <= set(vocab.tolist())


def test_export_reload_gives_the_same_logits_and_confidences(tmp_path):
    from dflashkit.export.check import reload_check
    from dflashkit.export.hf import load_drafter, load_shipped_model, save_drafter, write_modeling_file

    torch.manual_seed(0)
    src = strong_markov(new_drafter(dspark_contract(dspark_confidence_with_markov=True))).eval()
    save_drafter(src, tmp_path, dtype="float32")
    write_modeling_file(tmp_path, get("dspark"))
    ours = load_drafter(tmp_path, dtype=torch.float32)
    shipped = load_shipped_model(tmp_path)
    assert isinstance(ours, Qwen3DSparkModel) and type(shipped).__name__ == "Qwen3DSparkModel"
    assert ours.contract.knobs == src.contract.knobs
    g = torch.Generator().manual_seed(1)
    noise, ctx = torch.randn(1, 4, H, generator=g), torch.randn(1, 6, 2 * H, generator=g)
    pos = torch.arange(10)[None]
    prev = torch.tensor([[3, 9, 9]])
    head = torch.randn(V, H, generator=g)
    with torch.inference_mode():
        outs = []
        for kind, model in (("src", src), ("ours", ours), ("shipped", shipped)):
            h = (model(noise, ctx, pos) if kind != "shipped" else
                 model(noise_embedding=noise, target_hidden=ctx, position_ids=pos))[:, 1:]
            base = h @ head.T
            logits = model.markov_logits(base, prev) if kind == "shipped" else model.heads(h, base, prev)[0]
            outs.append((logits, model.confidence(h, prev)))
    for logits, conf in outs[1:]:
        assert torch.allclose(logits, outs[0][0], atol=1e-5) and torch.allclose(conf, outs[0][1], atol=1e-6)
    check = reload_check(src, tmp_path, head, atol=1e-4)
    assert check["walk_agreement"] == 1.0 and check["walk_tokens"] == 3 * 3


@pytest.mark.slow  # probe, train (3 steps), eval and export of a tiny target, in-process
def test_the_cli_trains_evaluates_and_exports_a_dspark_drafter(tmp_path, tiny_qwen3):
    import json

    from safetensors.torch import load_file

    from dflashkit.cli import main
    from tests.helpers import tokenize_texts, write_shards

    rd = tmp_path / "run"
    yaml = tmp_path / "run.yaml"
    yaml.write_text(json.dumps({
        "run": {"run_dir": str(rd)}, "target": {"path": str(tiny_qwen3), "dtype": "float32"},
        "drafter": {"type": "dspark", "dspark_markov_rank": 8, "dspark_confidence_with_markov": True,
                    "block_size": 4, "num_draft_layers": 1, "num_target_features": 2},
        "train": {"dspark_confidence_loss_weight": 0.5, "batch_size": 2, "max_steps": 3, "heldout_samples": 2,
                  "lr": 3e-3, "warmup_ratio": 0.0, "log_every": 1, "eval_every": 0, "save_every": 0,
                  "num_anchors": 8},
        "eval": {"num_prompts": 1, "max_new_tokens": 8, "warmup": 0, "block_sizes": [4], "diagnostics": False,
                 "prompt_lookup": False, "adaptive_length": False},
        "export": {"dtype": "float32"}}))
    assert main(["train", "--dry-run", "-c", str(yaml), "drafter.type=dflash"]) == 2  # its knobs are DSpark's
    assert main(["probe", "-c", str(yaml)]) == 0
    contract = json.loads((rd / "contract.json").read_text())
    assert contract["drafter_type"] == "dspark" and contract["dspark_markov_rank"] == 8
    write_shards(rd, tokenize_texts(tiny_qwen3))
    rows = [{"id": f"p{i}", "source": "t", "messages": [{"role": "user", "content": f"tell me {i} things"},
                                                        {"role": "assistant", "content": "ok"}]} for i in range(2)]
    (rd / "prepare").mkdir()
    (rd / "prepare" / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["train", "-c", str(yaml)]) == 0
    steps = [json.loads(x) for x in (rd / "train" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "split" not in r]
    assert steps and all(r["markov_loss"] > 0 and r["confidence_loss"] > 0 for r in steps)
    assert all(0 <= r["confidence_mean"] <= 1 and 1 <= r["base_tau"] <= 4 for r in steps)
    assert main(["eval", "-c", str(yaml)]) == 0
    res = json.loads((rd / "eval" / "results.json").read_text())
    assert res["lossless"]["verdict"] == "exact"
    assert main(["export", "-c", str(yaml)]) == 0
    out = rd / "export"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["markov_rank"] == 8
    assert cfg["enable_confidence_head"] is True and cfg["sample_from_anchor"] is False
    assert "class Qwen3DSparkModel(DFlashDraftModel)" in (out / "dflash.py").read_text()
    check = json.loads((out / "manifest.json").read_text())["reload_check"]
    assert check["max_diff_vs_source"] == 0 and check["walk_agreement"] == 1.0
    final = load_file(rd / "train" / "final" / "model.safetensors")
    assert torch.equal(load_file(out / "model.safetensors")["markov_head.markov_w2.weight"],
                       final["markov_head.markov_w2.weight"])


@pytest.mark.parametrize("head", [True, False])
def test_the_draft_length_policy_reads_dsparks_own_confidence(target, monkeypatch, head):
    """Adaptive decoding weighs the confidence head's estimate (with a head) or the softmax of the Markov-biased
    logits (without one) — not the unbiased head logits' softmax — and stays the target's greedy output."""
    from dflashkit.decode.draft_length import DraftLength

    drafter = random_drafter(target, drafter_type="dspark", dspark_markov_rank=8, dspark_confidence_head=head)
    strong_markov(drafter, std=2.0)
    if head:
        with torch.no_grad():
            drafter.confidence_head.proj.weight.normal_(0, 1.0)
    params = SamplingParams(max_new_tokens=23)
    base = SpecDecoder(target, None, block_size=1).generate(PROMPT, params).token_ids
    proposed, chosen = record_proposals(monkeypatch), []
    real_choose = DraftLength.choose

    def choose(self, conf):
        chosen.append(list(conf))
        return real_choose(self, conf)

    monkeypatch.setattr(DraftLength, "choose", choose)
    r = SpecDecoder(target, drafter, block_size=4, adaptive=True).generate(PROMPT, params)
    assert r.token_ids == base
    assert chosen and len(chosen) == len(proposed)
    unbiased_differs = False
    with torch.no_grad():
        for (h, logits, anchor, tokens), conf in zip(proposed, chosen):
            prev = torch.tensor([anchor, *tokens[:-1]])
            hid = h.reshape(-1, h.shape[-1])[:len(tokens)]
            biased, est = drafter.heads(hid, logits[:len(tokens)], prev)
            idx = torch.tensor(tokens)[:, None]
            want = est if head else torch.softmax(biased.float(), -1).gather(-1, idx)[:, 0]
            assert conf == pytest.approx(want.tolist(), abs=1e-6)
            plain = torch.softmax(logits[:len(tokens)].float(), -1).gather(-1, idx)[:, 0]
            unbiased_differs |= not torch.allclose(plain, want, atol=1e-3)
    assert unbiased_differs  # the test tells the family's confidence from the decoder's default
