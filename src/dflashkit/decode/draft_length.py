"""Verify only what is likely accepted: each step's draft length from the drafter's own confidence and t(n).

Usage:
    policy = DraftLength(max_drafts=B - 1)
    policy.calibrate({1: 0.037, 2: 0.040, 4: 0.042})          # t(n): seconds of a target step over n tokens
    k = policy.choose(conf)                                    # conf[i]: draft probability of proposal i+1
    policy.observe(conf[:k], accepted)                         # after the verify: how many of the k were kept

The rule. With k drafts a step commits 1 + a tokens, a = the leading drafts the target accepts, and costs
draft + t(k + 1) seconds (the draft forward proposes all B − 1 at once, so its cost does not depend on k).
If draft i is accepted with probability p_i given that drafts 1 … i − 1 were, the expected commit is
E(k) = 1 + Σ_{j ≤ k} Π_{i ≤ j} p_i, and the policy takes the k that maximises E(k) / (draft + t(k + 1)).
p_i is the drafter's probability of its own proposal at position i (softmax over the draft vocab), times
a per-position calibration factor c_i learned online: c_i = (accepted at i) / (Σ confidence at i) over the
steps that verified position i after accepting 1 … i − 1 (a prior of `prior_steps` steps at c = 1), capped
so that p_i ≤ 1. The verify rule is untouched, so greedy output stays the target's own (lossless); only
the block's length changes, and with it the cost of the step.

`fixed` lengths (every step k = B − 1) are what an engine runs; this policy is dflashkit's decoder's own
option (`eval.adaptive_length`, `serve.adaptive_length`, `bench decode`), reported beside fixed B.

`ConfidenceCut(max_drafts, threshold)` truncates verification by the drafter's confidence at a static threshold:
verify the leading drafts while the product of their confidences, the estimated chance that all of them are
accepted, stays ≥ `threshold`; no cost table, no calibration (`eval.confidence_truncation`,
`serve.confidence_truncation`). vLLM 0.32's DSpark adaptive verification (`enable_adaptive_verification`) is
cost-aware instead: it admits the batch's draft slots by survival product (the running product of the previous
step's confidences) up to the budget that maximises expected accepted tokens per profiled step cost — this
module's `DraftLength` rule on the raw confidences, batch-wide. Both are lossless for the same reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DraftLength:
    """The draft-length policy of one decoder (state: the cost table and the calibration)."""

    needs_cost = True  # the decoder measures t(n) before its first step (`SpecDecoder._calibrate`)

    max_drafts: int
    prior_steps: float = 8.0
    cost: dict[int, float] = field(default_factory=dict)      # n tokens → seconds of a target step
    draft_s: float = 0.0                                      # seconds of one draft forward (EMA)
    _hits: list[float] = field(default_factory=list)          # per position: accepted count
    _conf: list[float] = field(default_factory=list)          # per position: Σ confidence

    def __post_init__(self) -> None:
        self._hits = [0.0] * self.max_drafts
        self._conf = [0.0] * self.max_drafts

    def calibrate(self, cost: dict[int, float]) -> None:
        """Set t(n) for n = 1 … max_drafts + 1 (missing sizes are interpolated linearly between known ones)."""
        known = sorted((int(n), float(s)) for n, s in cost.items() if s > 0)
        if not known:
            raise ValueError("the cost table needs at least one positive t(n)")
        table = {}
        for n in range(1, self.max_drafts + 2):
            lo = max((p for p in known if p[0] <= n), default=known[0])
            hi = min((p for p in known if p[0] >= n), default=known[-1])
            if hi[0] == lo[0]:
                table[n] = lo[1]
            else:
                table[n] = lo[1] + (hi[1] - lo[1]) * (n - lo[0]) / (hi[0] - lo[0])
        self.cost = table

    def observe_draft(self, seconds: float, weight: float = 0.2) -> None:
        """The measured cost of a draft forward (an exponential moving average)."""
        self.draft_s = seconds if self.draft_s == 0 else (1 - weight) * self.draft_s + weight * seconds

    def observe_cost(self, n: int, seconds: float, weight: float = 0.1) -> None:
        """A measured target step over n tokens: t(n) follows it (an exponential moving average), and every other
        size moves by the same factor, so the whole table tracks the context's growth while keeping the ratios
        t(k)/t(n) the calibration measured (a size the policy stops choosing would otherwise keep its cost from
        a shorter context, and look ever cheaper or dearer against the sizes it does run)."""
        if n not in self.cost:  # calibrate keeps positive times only, and the EMA of positive times stays positive
            return
        ratio = ((1 - weight) * self.cost[n] + weight * seconds) / self.cost[n]
        for m in self.cost:
            self.cost[m] *= ratio

    def factor(self, i: int) -> float:
        """The calibration factor c_i of position i (0-based), with its prior of c = 1."""
        return (self._hits[i] + self.prior_steps) / (self._conf[i] + self.prior_steps)

    def accept_probs(self, conf: list[float]) -> list[float]:
        return [min(1.0, max(0.0, c * self.factor(i))) for i, c in enumerate(conf[: self.max_drafts])]

    def expected(self, conf: list[float]) -> list[float]:
        """E(k) for k = 0 … len(conf): the expected tokens a step commits with k drafts verified."""
        out, run, total = [1.0], 1.0, 1.0
        for p in self.accept_probs(conf):
            run *= p
            total += run
            out.append(total)
        return out

    def choose(self, conf: list[float]) -> int:
        """The number of drafts to verify (0 … len(conf)); all of them until a cost table is set."""
        k_max = min(len(conf), self.max_drafts)
        if not self.cost:
            return k_max
        e = self.expected(conf)
        best, best_rate = k_max, -1.0
        for k in range(k_max + 1):
            rate = e[k] / (self.draft_s + self.cost[k + 1])
            if rate > best_rate + 1e-12:  # ties: the shorter block (the cheaper step)
                best, best_rate = k, rate
        return best

    def observe(self, conf: list[float], accepted: int) -> None:
        """After a verify of len(conf) drafts of which the leading `accepted` were kept."""
        for i, c in enumerate(conf[: self.max_drafts]):
            if i > accepted:  # position i was verified only if 0 … i − 1 were accepted
                break
            self._conf[i] += c
            self._hits[i] += 1.0 if i < accepted else 0.0


@dataclass
class ConfidenceCut(DraftLength):
    """Verify the leading k drafts whose running product of confidences is ≥ `threshold` (module docstring):
    the raw confidences (DSpark's confidence head where the drafter has one), no cost table, no calibration."""

    threshold: float = 0.5
    needs_cost = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"confidence threshold {self.threshold!r} must be in [0, 1]")

    def choose(self, conf: list[float]) -> int:
        run, k = 1.0, 0
        for c in conf[: self.max_drafts]:
            run *= min(1.0, max(0.0, c))
            if run < self.threshold:
                break
            k += 1
        return k
