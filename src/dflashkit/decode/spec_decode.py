"""Reference DFlash speculative decoding over a HF target (dflash-spec §4); block_size=1 is plain AR.

Usage:
    target = load_target(cfg.target)
    drafter = load_drafter("runs/x/train/final")
    spec = SpecDecoder(target, drafter, block_size=16)
    base = SpecDecoder(target, None, block_size=1)             # same loop, no drafter
    params = SamplingParams(max_new_tokens=128, stop_token_ids=(eos,))
    r = spec.generate(prompt_ids, params)                      # r.token_ids, r.acceptance_lengths

One step (batch size 1), the committed sequence ending with x_start whose features are not known yet:
1. Draft: the drafter sees the target features of the committed tokens it has not seen yet (its
   `DraftKVCache` keeps earlier context K/V) and the block `[x_start, MASK × (B−1)]`; the family's
   proposal step (`Decoding.propose`) turns its hidden states and head logits into drafts d_1..d_{B−1}.
   Plain DFlash layers run through `decode/fast_draft.py`; other drafters keep the module forward.
2. Verify: one target forward over `[x_start, d_1..d_{B−1}]`, features captured by hooks.
3. Accept (`sampling.verify_greedy` / `verify_sampled`, lossless): a drafts plus the target's own
   token, τ = a + 1; the target cache is rolled back to the committed length (`decode/rollback.py`).
With `block_size=1` step 1 is skipped, so the AR baseline runs through exactly the same code.

Invariants: greedy output = the target's greedy output; sampling is lossless, including with a
reduced draft vocabulary (q is zero outside it). A `Proposer` (`decode/ngram.py`, test stubs) may
replace the drafter and propose fewer than B−1 tokens. A `HybridProposer` (`decode/hybrid.py`) sits beside
the drafter: on the steps its gate gives to the suffix match the drafter does not run, and the target features
of the tokens those steps commit reach it at its next call. `record_top=k` (greedy) records the target's
k best logits per emitted token so `decode/lossless.py` can tell a numerical tie from a divergence.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from dflashkit.decode.api import GenerationResult, SamplingParams
from dflashkit.decode.draft_length import ConfidenceCut, DraftLength
from dflashkit.decode.hybrid import HybridProposer, label
from dflashkit.decode.online_gate import DrafterSwitch, OnlineGate
from dflashkit.decode.rollback import arm, recurrent_layers, rollback
from dflashkit.decode.sampling import sample, sampling_probs, verify_greedy, verify_sampled
from dflashkit.decode.fast_draft import DraftState, FastDraft
from dflashkit.errors import UsageError
from dflashkit.family.base import DraftBlock, DraftSampling
from dflashkit.model.draft_vocab import restricted_head
from dflashkit.model.drafter import DFlashDraftModel, DraftKVCache
from dflashkit.target.kv_cache import decode_cache
from dflashkit.timing import fastest_each
from dflashkit.target.load import Target, cache_kwarg, fast_bf16


def estimates_acceptance(drafter: DFlashDraftModel) -> bool:
    """Whether the drafter's family estimates each draft's chance of acceptance (`Decoding.confidence`: DSpark's
    confidence head, or its Markov-biased softmax without one): what confidence truncation reads (eval's
    `confident` rows, serve.confidence_truncation). Without one, `confidence_cut` would read the head's softmax,
    a rule eval does not measure."""
    return drafter.contract.family.decoding.confidence is not None


class Proposer(Protocol):
    def propose(self, sequence: list[int], num_tokens: int) -> list[int]:
        """Given prompt + committed tokens (ending with x_start), propose up to `num_tokens` next ones."""
        ...


@dataclass
class _Draft:
    """One step's draft: tokens, their draft law (None: point masses), confidences (None: no length policy reads
    them), the branch and the policy that chose its length, each token's origin, and whether the drafter ran (and
    so read the pending target features)."""

    tokens: list[int] = field(default_factory=list)
    law: torch.Tensor | None = None
    conf: list[float] | None = None
    branch: str = "none"
    policy: DraftLength | None = None
    origin: list[str] = field(default_factory=list)
    fed: bool = True

    def cut(self, k: int) -> None:
        self.tokens = self.tokens[:k]
        self.origin = self.origin[:k]
        self.conf = None if self.conf is None else self.conf[:k]
        self.law = None if self.law is None else self.law[:k]

    def _named(self) -> _Draft:
        """The branch is "none" where nothing is left to verify."""
        if not self.tokens:
            self.branch = "none"
        return self


class SpecDecoder:
    """Speculative decoder implementing the `Decoder` protocol (batch size 1).

    Args:
        target: the frozen target.
        drafter: a DFlash drafter (None: no speculation unless `proposer` is given).
        block_size: inference block size B (may differ from the training block size); default
            the drafter's, or 1 without a drafter/proposer.
        proposer: replaces the drafter (point-mass proposals from the committed sequence).
        draft_sampling: at temperature > 0, propose the draft argmax ("greedy", as SGLang) or a
            sample from the draft law ("sample", as the z-lab reference). Both are lossless.
        max_context: refuse prompt + max_new_tokens beyond this (default: the target's
            max_position_embeddings).
        draft_dtype: dtype of the drafter and of the lm_head copy used for drafting (default: the
            target's). Drafts only steer acceptance, never the output, so a cheaper dtype (bf16 on
            CPUs with AMX/AVX512-BF16, see `fast_draft_dtype`) stays lossless; the verify pass
            always uses the target's own head and dtype.
        record_top: at temperature 0, fill `GenerationResult.top_logits` with this many (0 = off).
        adaptive: pick each step's draft length from the drafter's own confidence and the measured cost t(n) of a
            target step over n tokens (`decode/draft_length.py`; a drafter only, not a proposer). Lossless: the
            verify rule is the same, only the number of drafts verified changes, and that number never depends on
            a sampled draft's draw (with `draft_sampling="sample"` the confidence is the head's peak probability).
        lean: draft through `decode/fast_draft.py` where the drafter qualifies (the same proposals, less time);
            False = the module forward (what `bench decode` compares it with).
        hybrid: a `HybridProposer` beside the drafter (`decode/hybrid.py`); `GenerationResult.branch` and
            `draft_origin` say which branch drafted each step and token. With `adaptive`, each branch ("drafter",
            "suffix", "graft") has its own draft-length policy: the suffix branch's confidences are its scores
            and its draft cost its own measured time.
        confidence_cut: instead of `adaptive`, verify the leading drafts while the product of their confidences
            (the family's `Decoding.confidence`: DSpark's confidence head; else the head's softmax) stays ≥ this
            threshold (`decode/draft_length.ConfidenceCut`, a static threshold; no t(n) is measured). Lossless
            as `adaptive` is.
        online_gate: per request, switch the drafter off while its steps commit tokens slower than plain target
            steps, and re-probe it after a back-off (`decode/online_gate.py`; True = `OnlineGate()`'s knobs; a
            hybrid whose `HybridGate.online_gate` is set gets it too). `GenerationResult.drafter_off` counts the
            steps it kept the drafter from running; a hybrid labels them "plain". Lossless: only which proposal
            is verified changes.
    """

    def __init__(self, target: Target, drafter: DFlashDraftModel | None = None, block_size: int | None = None,
                 *, proposer: Proposer | None = None, draft_sampling: Literal["greedy", "sample"] = "greedy",
                 max_context: int | None = None, draft_dtype: torch.dtype | None = None,
                 record_top: int = 0, adaptive: bool = False, lean: bool = True,
                 hybrid: HybridProposer | None = None, confidence_cut: float | None = None,
                 online_gate: bool | OnlineGate = False):
        self.target, self.drafter, self.proposer, self.hybrid = target, drafter, proposer, hybrid
        if hybrid is not None and (drafter is None or proposer is not None):
            raise UsageError("a hybrid proposer needs a drafter beside it, and no other proposer",
                             hint="pass the drafter, or use the suffix proposer alone as `proposer`")
        self.record_top = record_top
        if block_size is None:
            block_size = drafter.block_size if drafter is not None else 1
        if block_size < 1:
            raise UsageError(f"block_size must be >= 1, got {block_size}", hint="set eval.block_sizes")
        if block_size > 1 and drafter is None and proposer is None:
            raise UsageError(f"block_size {block_size} needs a drafter", hint="pass a drafter dir or use block_size 1")
        self.block_size = block_size
        self.draft_sampling = draft_sampling
        self.max_context = int(max_context or getattr(target.config, "max_position_embeddings", 0) or 1 << 30)
        self.layer_ids: list[int] | None = None
        self._fast: FastDraft | None = None
        if drafter is not None and proposer is None and block_size > 1:
            drafter.contract.check(target, where="drafter")
            self.layer_ids = list(drafter.target_layer_ids)
            dev = target.device
            self._draft_dtype = draft_dtype or target.dtype
            p = next(drafter.parameters())
            if p.device != dev or p.dtype != self._draft_dtype:  # e.g. a bf16 export next to an fp32 target
                drafter.to(device=dev, dtype=self._draft_dtype)
            with torch.inference_mode():
                mask = torch.tensor([[drafter.mask_token_id]], device=dev)
                self._mask_emb = target.embed(mask).to(self._draft_dtype)  # [1, 1, H]
                head = target.lm_head
                self._full_vocab = int(head.weight.shape[0])
                self._vocab = drafter.draft_vocab
                if self._vocab is not None:  # the V' rows of the reduced draft vocab, copied once

                    self._vocab = self._vocab.to(head.weight.device)
                    head = restricted_head(head, self._vocab)
                b = getattr(head, "bias", None)
                self._head_w = head.weight.detach().to(self._draft_dtype)  # [V or V', H]
                self._head_b = None if b is None else b.detach().to(self._draft_dtype)
            self._step = drafter.contract.family.decoding.propose  # the family's proposal step
            self._family_conf = drafter.contract.family.decoding.confidence  # None: the head's softmax
            self._fast = (FastDraft(drafter, self._head_w, self._head_b, self._mask_emb,
                                    max_len=self.max_context if self.max_context < 1 << 20 else 4096,
                                    causal=drafter.causal)
                          if lean and FastDraft.supports(drafter) else None)  # the lean DFlash forward (decode/fast_draft.py)
        self._cuda = target.device.type == "cuda"
        self._cache_kw = cache_kwarg(target.model)  # `cache` or `past_key_values`, by transformers version
        self.policy: DraftLength | None = None
        if adaptive and confidence_cut is not None:
            raise UsageError("adaptive and confidence_cut are two draft-length policies: pass one",
                             hint="decode once with each")
        if adaptive and self.layer_ids is not None:
            self.policy = DraftLength(max_drafts=block_size - 1)
        elif confidence_cut is not None and self.layer_ids is not None:
            self.policy = ConfidenceCut(max_drafts=block_size - 1, threshold=float(confidence_cut))
        if online_gate is True or (online_gate is False and hybrid is not None and hybrid.gate.online_gate):
            online_gate = OnlineGate()
        # the online drafter gate's knobs (None: the drafter runs whenever it drafts); its state is per request
        self.online: OnlineGate | None = online_gate if isinstance(online_gate, OnlineGate) and self.layer_ids else None
        self._switch: DrafterSwitch | None = None
        # the hybrid's per-branch draft-length policies ("drafter" is `policy`; the others share its cost table)
        self.policies: dict[str, DraftLength] = {}
        if self.policy is not None and hybrid is not None:
            self.policies = {"drafter": self.policy, "suffix": DraftLength(max_drafts=block_size - 1),
                             "graft": DraftLength(max_drafts=block_size - 1)}

    # -- helpers ------------------------------------------------------------------------------
    def _now(self) -> float:
        if self._cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _forward(self, ids: torch.Tensor, cache, last_only: bool = False, start: int | None = None):
        """Target forward with KV cache → (features [1, t, nF·H] or None, logits [t', V]).

        `start`: the position of ids[0], passed as explicit position ids (hybrid targets: some, e.g. Bamba, count
        positions from 0 at every call without them); None lets the model count from its cache."""
        kw = {self._cache_kw: cache, "use_cache": True}
        if start is not None:
            kw["position_ids"] = torch.arange(start, start + ids.shape[1], device=ids.device)[None]
        if last_only:
            kw["logits_to_keep"] = 1
        if self.layer_ids:
            feats, out = self.target.features(ids, layer_ids=self.layer_ids, need_logits=True, **kw)
            return feats, out.logits[0]
        return None, self.target.model(input_ids=ids, **kw).logits[0]

    def _pick(self, logits: torch.Tensor, params: SamplingParams, gen) -> int:
        if params.temperature <= 0:
            return int(logits.argmax())
        return int(sample(sampling_probs(logits, params.temperature, params.top_p, params.top_k), gen))

    def _draft(self, seq: list[int], start: int, k: int, ctx: torch.Tensor, dcache: DraftKVCache | DraftState,
               positions: torch.Tensor, params: SamplingParams, gen, confidence: bool = False):
        """Propose k tokens after seq[start] → (tokens, draft law [k, V] or None for point mass, confidences).

        `ctx`: the target features of the committed tokens the drafter has not read yet (positions start − t …
        start − 1; more than one step's worth after steps the hybrid's suffix branch drafted). The confidences
        (with `adaptive` or `confidence`; else None) are the draft head's softmax probability of each proposed
        token, what the draft-length policy weighs against t(n) and a graft keeps a prefix by."""
        if self.proposer is not None:
            return list(self.proposer.propose(seq[: start + 1], k))[:k], None, None
        assert self.drafter is not None  # no proposer and block_size > 1: __init__ required a drafter
        x = self.target.embed(positions.new_tensor([[seq[start]]])).to(self._draft_dtype)
        if isinstance(dcache, DraftState):  # the lean forward (decode/fast_draft.py): the module's numbers
            assert self._fast is not None
            h, logits = self._fast.forward(dcache, ctx.to(self._draft_dtype), x, start, k)
            h = h[None]
        else:
            block = torch.cat([x, self._mask_emb.expand(1, k, -1)], dim=1)  # [1, k+1, H]
            t = ctx.shape[1]
            h = self.drafter(block, ctx.to(self._draft_dtype), positions[:, start - t: start + k + 1], cache=dcache)
            h = h[:, 1:]
            logits = F.linear(h[0], self._head_w, self._head_b)  # [k, V] (or [k, V'] over the draft vocab)
        tokens, law = self._propose(h, logits, seq[start], params, gen, DraftBlock(self.target.embed, ctx[0, -1:]))
        if self.policy is None and not confidence:
            return tokens, law, None
        # sampled drafts (a law): the length must not depend on what was drawn, or the verified drafts lean towards
        # likely draws and the rule no longer emits the target's law; the head's own peak does not
        if law is None and self._family_conf is not None:
            return tokens, law, self._family_conf(self.drafter, h, logits, seq[start], tokens)
        return tokens, law, self._confidence(logits, tokens if law is None else None)

    def _next_draft(self, seq: list[int], start: int, k: int, ctx: torch.Tensor, dcache: DraftKVCache | DraftState,
                    positions: torch.Tensor, params: SamplingParams, gen, t0: float) -> _Draft:
        """This step's draft of up to k tokens after seq[start] (`t0`: when the step began, for the draft cost)."""
        if self.hybrid is not None:
            return self._hybrid_draft(seq, start, k, ctx, dcache, positions, params, gen, t0)
        if self._switch is not None and not self._switch.runs():
            return _Draft(branch="plain", fed=False)
        tokens, law, conf = self._draft(seq, start, k, ctx, dcache, positions, params, gen)
        d = _Draft(tokens, law, conf, policy=self.policy)
        if self.policy is not None and conf is not None:  # verify only what is likely accepted
            self.policy.observe_draft(self._now() - t0)  # this step's draft counts (the first one too)
            d.cut(self.policy.choose(conf))
        return d

    def _hybrid_draft(self, seq: list[int], start: int, k: int, ctx: torch.Tensor,
                      dcache: DraftKVCache | DraftState, positions: torch.Tensor, params: SamplingParams, gen,
                      t0: float) -> _Draft:
        """The hybrid's step (`decode/hybrid.py`): the suffix draft where the gate opens (the drafter does not run,
        its pending features wait), else the drafter's block, grafted where the gate says so.

        Lengths under `adaptive`: a block whose drafter tokens are draws from its law has its length chosen before
        the graft, from the head's peak probabilities, so no draw decides whether a drawn token is verified (the
        graft itself only depends on the kept prefix, which is committed whenever a grafted row is verified)."""
        assert self.hybrid is not None
        hyb, committed = self.hybrid, seq if len(seq) == start + 1 else seq[: start + 1]  # no O(context) copy
        sd = hyb.suffix_draft(committed, k)
        if hyb.opens(sd):
            n = min(k, len(sd.tokens))
            d = _Draft(list(sd.tokens[:n]), None, list(sd.scores[:n]), "suffix", self.policies.get("suffix"),
                       ["suffix"] * n, fed=False)
            if d.policy is not None:
                d.policy.observe_draft(self._now() - t0)
                d.cut(d.policy.choose(d.conf or []))
            return d._named()
        if self._switch is not None and not self._switch.runs():  # the drafter is off: a plain step
            return _Draft(branch="plain", fed=False)
        tokens, law, conf = self._draft(seq, start, hyb.drafter_drafts(k), ctx, dcache, positions, params, gen,
                                        confidence=hyb.gate.graft)
        d = _Draft(tokens, law, conf, "drafter", self.policies.get("drafter"), label(tokens, sd.tokens, "drafter"))
        chosen = law is not None and d.policy is not None and conf is not None
        if chosen:
            assert d.policy is not None and conf is not None
            d.policy.observe_draft(self._now() - t0)
            d.cut(d.policy.choose(conf))
        if hyb.gate.graft and d.tokens and d.conf is not None:
            g = hyb.graft(committed, d.tokens, d.conf, list(sd.tokens), size=None if chosen else k)
            if g is not None:
                d.tokens, d.conf, d.origin, d.branch = g.tokens, g.conf, g.origin, "graft"
                if d.law is not None:  # suffix rows are point masses: one-hot draft law
                    extra = len(g.tokens) - d.law.shape[0]  # rows the graft added past a short drafter block
                    d.law = torch.cat([d.law, d.law.new_zeros(extra, d.law.shape[1])]) if extra > 0 else d.law.clone()
                    rows = torch.tensor(g.suffix_rows, device=d.law.device)
                    d.law[rows] = 0.0
                    d.law[rows, torch.tensor(g.tokens, device=d.law.device)[rows]] = 1.0
                if not chosen and self.policies:
                    d.policy = self.policies["graft"]
        if not chosen and d.policy is not None and d.conf is not None:
            d.policy.observe_draft(self._now() - t0)
            d.cut(d.policy.choose(d.conf))
        return d._named()

    def _confidence(self, logits: torch.Tensor, tokens: list[int] | None) -> list[float]:
        """softmax(logits)[token] per draft position (over the draft vocab when it is reduced); with no tokens
        (sampled drafts) the head's largest probability per position, which no draw changes."""
        probs = torch.softmax(logits.float(), dim=-1)
        if tokens is None:
            return probs.max(-1).values.tolist()
        idx = torch.tensor(tokens, device=logits.device)
        if self._vocab is not None:  # target ids → draft indices (the vocab is sorted)
            idx = torch.searchsorted(self._vocab, idx).clamp(max=self._vocab.numel() - 1)
        return probs.gather(-1, idx[:, None])[:, 0].tolist()

    def _calibrate(self, prompt_ids: list[int], reps: int = 3) -> None:
        """t(n) for n = 1 … B: target steps over n tokens after a short context (a throwaway cache; once per
        decoder, before any timed work), every n warmed up once and then timed in turns, the fastest of `reps`
        each (`timing.fastest_each`: the first n is not timed cold)."""
        assert self.policy is not None
        dev = self.target.device
        ctx = prompt_ids[: min(len(prompt_ids), 64)]
        cache = DynamicCache(config=self.target.config)
        at = 0 if recurrent_layers(cache) else None  # explicit positions for hybrid targets (`_forward`)
        self._forward(torch.tensor([ctx], device=dev), cache, last_only=True, start=at)
        arm(cache, self.block_size)
        start = None if at is None else len(ctx)
        sizes = range(1, self.block_size + 1)
        steps = {n: partial(self._forward, torch.tensor([[ctx[-1]] * n], device=dev), cache, start=start)
                 for n in sizes}
        self.policy.calibrate(fastest_each(steps, dev, reps, after={n: partial(rollback, cache, n) for n in sizes},
                                           clock=self._now))

    def _propose(self, h: torch.Tensor, logits: torch.Tensor, anchor: int, params: SamplingParams, gen,
                 block: DraftBlock | None = None):
        """The drafter family's proposal step (`Decoding.propose`): h [1, k, H] and head logits [k, V'] of block
        positions 1 … k → (k tokens, their draft law [k, V] or None for point masses). `block`: the target's
        embedding and the features of the token before the anchor (the last row of the new context)."""
        return self._step(self.drafter, h, logits, anchor, self._sampling(params, gen), self._vocab, self._full_vocab,
                          block=block)

    def _sampling(self, params: SamplingParams, gen) -> DraftSampling:
        """Point-mass drafts at temperature 0 or with draft_sampling "greedy"; else draws from the draft law."""
        if params.temperature <= 0 or self.draft_sampling == "greedy":
            return DraftSampling(generator=gen)
        return DraftSampling(temperature=params.temperature, generator=gen, draw=sample,
                             law=partial(sampling_probs, temperature=params.temperature, top_p=params.top_p,
                                         top_k=params.top_k))

    def check_prompt(self, num_prompt_tokens: int, max_new_tokens: int, what: str = "prompt") -> None:
        """Raise UsageError if the prompt plus the generation does not fit the context."""
        if num_prompt_tokens < 1:
            raise UsageError(f"{what} is empty", hint="give at least one prompt token")
        if num_prompt_tokens + max_new_tokens > self.max_context:
            raise UsageError(
                f"{what} has {num_prompt_tokens} tokens; with max_new_tokens {max_new_tokens} it exceeds the "
                f"context of {self.max_context} tokens",
                hint="shorten the prompt, lower eval.max_new_tokens, or raise eval.max_context")

    # -- the loop -----------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        n_prompt, max_new = len(prompt_ids), int(params.max_new_tokens)
        self.check_prompt(n_prompt, max_new)
        if max_new <= 0:
            return GenerationResult(token_ids=[], finish_reason="length")
        dev, greedy = self.target.device, params.temperature <= 0
        gen = None
        if not greedy:
            gen = torch.Generator(device=dev)
            gen.manual_seed(params.seed if params.seed is not None else int.from_bytes(os.urandom(7), "little"))
        stops = set(params.stop_token_ids)
        max_len = n_prompt + max_new
        if self.policy is not None and self.policy.needs_cost and not self.policy.cost:
            self._calibrate(prompt_ids)
        for policy in self.policies.values():  # the hybrid's branches: the same target, the same t(n)
            if not policy.cost and self.policy is not None and self.policy.cost:
                policy.calibrate(dict(self.policy.cost))
        hooks = self.hybrid if self.hybrid is not None else self.proposer
        begin = getattr(hooks, "begin", None)
        if begin is not None:  # a new request (suffix proposers index its prompt, read its tenant's pool)
            begin(list(prompt_ids), params.tenant)
        cache = decode_cache(self.target.config, capacity=max_len + self.block_size)
        positions = torch.arange(max_len + self.block_size, device=dev)[None]
        dcache: DraftKVCache | DraftState = (self._fast.new_state(max_len + self.block_size) if self._fast is not None
                                             else DraftKVCache())

        self._switch = DrafterSwitch(self.online) if self.online is not None else None
        t0 = self._now()
        at = 0 if recurrent_layers(cache) else None  # explicit positions for hybrid targets (`_forward`)
        feats, logits = self._forward(torch.tensor([prompt_ids], device=dev), cache, last_only=True, start=at)
        arm(cache, self.block_size)  # exact rollback of recurrent layers too (decode/rollback.py)
        seq = list(prompt_ids)
        seq.append(self._pick(logits[-1], params, gen))
        t_first = self._now()
        res = GenerationResult(token_ids=[], finish_reason="length", prefill_s=t_first - t0)
        top = self.record_top if greedy else 0
        if top:
            self._record_top(res, logits[-1:], top)
        start, stopped = n_prompt, seq[-1] in stops
        while start + 1 < max_len and not stopped:
            ts = self._now()
            size = min(self.block_size, max_len - start)
            d, asked = _Draft(), size > 1
            if asked:
                d = self._next_draft(seq, start, size - 1, feats, dcache, positions, params, gen, ts)
                size = 1 + len(d.tokens)  # a proposer may return fewer than asked
            drafts, dprobs, conf = d.tokens, d.law, d.conf
            tv = self._now()
            res.verified_drafts += len(drafts)
            fresh, logits = self._forward(torch.tensor([[seq[start], *drafts]], device=dev), cache,
                                          start=None if at is None else start)
            if greedy:
                a, nxt = verify_greedy(drafts, logits.argmax(-1).tolist())
            else:
                probs = sampling_probs(logits, params.temperature, params.top_p, params.top_k)
                a, nxt = verify_sampled(drafts, probs, dprobs, gen)
            te = self._now()
            if d.policy is not None and conf is not None:
                d.policy.observe(conf, a)
                for policy in self.policies.values() or [d.policy]:
                    policy.observe_cost(size, te - tv)
            new = (drafts[:a] + [nxt])[: max_len - start - 1]
            for i, tok in enumerate(new):
                if tok in stops:
                    new, stopped = new[: i + 1], True
                    break
            produced = len(new)
            if top:
                self._record_top(res, logits[:produced], top)
            seq.extend(new)
            rollback(cache, size - produced)  # forget the verified positions beyond the committed ones
            if fresh is not None:  # the committed tokens' features: the drafter's next context
                fresh = fresh[:, :produced]
                feats = fresh if d.fed or feats is None else torch.cat([feats, fresh], dim=1)
            if self.hybrid is not None:
                res.branch.append(d.branch)
                res.draft_origin.append(list(d.origin))
            start += produced
            res.acceptance_lengths.append(produced)
            res.acceptance_cut.append(size < self.block_size or produced < a + 1)
            res.draft_s.append(tv - ts)
            res.verify_s.append(te - tv)
            res.step_s.append(self._now() - ts)
            if d.branch == "plain":
                res.drafter_off += 1
            if self._switch is not None and asked:
                self._switch.observe(d.fed, len(drafts), produced, res.step_s[-1])
        res.decode_s = self._now() - t_first
        res.token_ids = seq[n_prompt:]
        res.finish_reason = "stop" if stopped else "length"
        finish = getattr(hooks, "finish", None)
        if finish is not None:  # the request ended: its prompt + output (a suffix pool keeps them)
            finish(seq)
        return res


    @staticmethod
    def _record_top(res: GenerationResult, rows: torch.Tensor, k: int) -> None:
        """Append the k best (id, logit) of each logits row [n, V] that emitted one of n tokens."""
        top = torch.topk(rows.float(), min(k, rows.shape[-1]), dim=-1)
        res.top_logits.extend([list(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())])


def fast_draft_dtype(target: Target) -> torch.dtype:
    """bf16 for drafting when the target is fp32 on a CPU with AMX/AVX512-BF16 matmuls, else the target's."""
    if target.device.type == "cpu" and target.dtype == torch.float32 and fast_bf16(target.device):
        return torch.bfloat16
    return target.dtype
