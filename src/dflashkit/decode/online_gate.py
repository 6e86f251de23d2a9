"""Run the drafter only while it pays: a per-request online gate on the drafter, from the decoder's own clock.

Usage:
    spec = SpecDecoder(target, drafter, block_size=4, online_gate=True)          # or OnlineGate(min_steps=8, ...)
    hybrid = HybridProposer(SuffixProposer(), HybridGate(min_match=2, online_gate=True))
    r = spec.generate(prompt_ids, params)
    r.drafter_off       # steps the gate kept the drafter from running (each a plain target step)
    r.branch            # hybrid only: "plain" at those steps

The rule, per request (`DrafterSwitch` holds its state; the decoder asks it before each step the drafter would
run, and reports every step's outcome to it):
- Drafter steps (the drafter's forward, then the verify of its block): exponential moving averages of the tokens
  they commit and of their wall seconds; their ratio is the drafter's rate.
- The alternative is a plain target step: 1 token (verify only the next one) in t(1) seconds, measured on the
  steps that already ran without the drafter and verified nothing (a hybrid suffix step cut to no drafts, or a
  plain step while the drafter is off). Until one exists, a hybrid's suffix steps bound t(1) from above (they
  verify more tokens than a plain step, beside the same suffix lookup): a drafter slower than that bound is
  switched off at once; one faster than it gets one plain step as a probe for the exact figure. The adaptive
  length's cost table is not used: it times the target's forward alone (the fastest of a few), a whole step
  costs more, and comparing a whole drafter step with a bare forward would favour the plain step.
- After `min_steps` measured drafter steps, whenever the drafter's rate falls below (1 − `margin`) / t(1), the
  drafter is switched off: the steps it would have drafted become plain steps (a hybrid's suffix branch still
  drafts where its gate opens). The drafter's pending target features wait, as on a suffix step, and it reads
  them all at its next run, so its proposals stay those of a drafter fed every step.
- Re-probe: after `backoff` steps off (counted over the steps the drafter sat out), the drafter runs again for
  `probe_steps` measured steps (its first run, which catches up on every feature it missed, is not measured:
  its cost is the probe's, not the drafter's steady rate) with its averages restarted. Still slower: off again
  for twice as long (at most `max_backoff`). Faster: it stays on, and the back-off returns to `backoff`.

Lossless whatever it decides: the verify rule is unchanged, and a step's proposal depends only on the request's
past (committed tokens, earlier draws and clock readings), never on the step's own draws, so greedy output stays
the target's and sampling the target's law.

What it can cost (why eval measures it as separate candidates and no default turns it on): a plain probe per
request, the first drafter run of each re-probe, and — where the drafter pays by less than a noisy clock can
tell — plain steps until the next re-probe; with a clear margin it can only lose the probes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dflashkit.errors import UsageError


@dataclass(frozen=True)
class OnlineGate:
    """The online drafter gate's knobs (module docstring).

    Args:
        min_steps: measured drafter steps before the first decision.
        margin: the drafter is switched off when its rate is below (1 − margin) × the plain step's.
        backoff: steps off before the first re-probe; doubled after each re-probe the drafter loses.
        max_backoff: the longest back-off.
        probe_steps: measured drafter steps a re-probe runs before deciding again.
        weight: the moving averages' weight of the newest step.
    """

    min_steps: int = 6
    margin: float = 0.1
    backoff: int = 8
    max_backoff: int = 64
    probe_steps: int = 3
    weight: float = 0.25

    def __post_init__(self) -> None:
        problems = [f"{name} must be >= 1, got {getattr(self, name)}"
                    for name in ("min_steps", "backoff", "max_backoff", "probe_steps") if getattr(self, name) < 1]
        if not 0.0 <= self.margin < 1.0:
            problems.append(f"margin must lie in [0, 1), got {self.margin}")
        if not 0.0 < self.weight <= 1.0:
            problems.append(f"weight must lie in (0, 1], got {self.weight}")
        if problems:
            raise UsageError("online drafter gate: " + "; ".join(problems),
                             hint="steps count decode steps; margin and weight are fractions")


class DrafterSwitch:
    """One request's state of the online gate: `runs()` before a step the drafter would draft, `observe(...)`
    after every step."""

    def __init__(self, rule: OnlineGate):
        self.rule = rule
        self.mode: Literal["on", "off", "probe"] = "on"
        self.backoff = rule.backoff
        self.off_left = 0          # steps still to sit out before the re-probe
        self.probe_left = 0        # measured drafter steps the re-probe still runs
        self.catch_up = False      # the next drafter run reads the features of the steps it missed: not measured
        self.want_plain = False    # run one plain step: the alternative has no exact measurement yet
        self.measured = 0          # measured drafter steps (since the last re-probe began)
        self.tokens = self.seconds = 0.0   # drafter steps: moving averages
        self.plain_s: float | None = None  # a plain step's seconds (moving average)
        self.bound_s: float | None = None  # suffix steps' seconds: an upper bound on a plain step's

    def runs(self) -> bool:
        """Whether the drafter runs at this step (asked only where it would otherwise draft)."""
        if self.mode == "off":
            if self.off_left > 0:
                self.off_left -= 1
                return False
            self.mode, self.probe_left, self.catch_up = "probe", self.rule.probe_steps, True
            self.measured, self.tokens, self.seconds = 0, 0.0, 0.0
            return True
        if self.want_plain and self.mode == "on":
            self.want_plain = False
            return False
        return True

    def _ema(self, old: float | None, new: float) -> float:
        return new if not old else (1 - self.rule.weight) * old + self.rule.weight * new

    def observe(self, drafter_ran: bool, drafts: int, tokens: int, seconds: float) -> None:
        """A finished step: whether the drafter ran, how many drafts were verified, tokens committed, seconds."""
        if drafter_ran:
            if self.catch_up:
                self.catch_up = False
                return
            self.tokens, self.seconds = self._ema(self.tokens, tokens), self._ema(self.seconds, seconds)
            self.measured += 1
            if self.mode == "probe":
                self.probe_left -= 1
                if self.probe_left <= 0:
                    self._decide(probe=True)
            elif self.measured >= self.rule.min_steps:
                self._decide()
            return
        if drafts == 0:
            self.plain_s = self._ema(self.plain_s, seconds)
            if self.mode == "on" and self.measured >= self.rule.min_steps:
                self._decide()
        else:
            self.bound_s = self._ema(self.bound_s, seconds)

    def _decide(self, probe: bool = False) -> None:
        alt = self.plain_s if self.plain_s is not None else self.bound_s
        if alt is None or self.seconds <= 0:
            self.mode, self.want_plain = "on", True
            return
        if self.tokens / self.seconds < (1 - self.rule.margin) / alt:
            self.mode, self.off_left = "off", self.backoff
            self.backoff = min(2 * self.backoff, self.rule.max_backoff)
            return
        self.mode, self.want_plain = "on", self.plain_s is None  # a win over the bound only: measure t(1) once
        if probe:
            self.backoff = self.rule.backoff
