"""How a compute budget becomes a run: the sizes `dflashkit run` chooses for `run.budget_minutes`.

Usage:
    rates = Rates(capture_tok_s=665, train_step_s=0.35, decode_s={1: 0.05, 2: 0.06, 4: 0.07}, load_s=3)
    p = plan_run(cfg, rates, budget_minutes=20, fixed=given_keys(cfg) or ())
    p["sizes"]        # {"data.num_prompts": 900, "train.max_steps": 940, "train.eval_every": 156, ...}
    p["stages"]       # planned seconds per stage ("calibrate", "probe", …, "report")
    t = replan_train(p, rates, cfg, fixed, train_samples=712, elapsed_s=610.0)   # before train: from actuals
    e = replan_eval(p, rates, cfg, fixed, elapsed_s=1010.0)                      # before eval: from time left
    check_plan(p)                             # PlanError unless every number is finite and in range (plan_run does)
    print("\n".join(plan_lines(record)))      # pipeline.json's "budget" record as a table (plan vs actual)

Pure arithmetic (no torch, no files). The plan spends `SAFETY` of the budget: fixed seconds per stage
(`FIXED_S`) plus a target load per stage in `LOADS` and per-prompt prepare/tokenize time; data from
the prior `SAMPLES_PER_PROMPT` × `TOKENS_PER_SAMPLE` (scaled by tokenize.max_length, replaced by
`data.mean_tokens`); capture at `Rates.capture_tok_s` (× `ROLLOUT_CAPTURE` for on-path rollout);
train at `Rates.train_step_s` plus `CURVE_POINTS` + 1 held-out evaluations; at most `EPOCHS` epochs,
so with both free it buys samples rather than steps; eval an `EVAL_SHARE` of the budget
(`EVAL_MAX_SHARE` when re-planned), a prompt costing max_new_tokens × (t(1) + Σ_B passes · t(B) /
`EVAL_TAU`) plus prefills. A key the user set (`fixed`) keeps its value; the others are sized around it.

Invariants (tests/sizing/test_sizing_plan.py): planned seconds ≤ the usable budget unless the minimum
run does not fit (then `warnings` says so); more budget never gives fewer prompts, steps or eval
prompts; epochs ≤ EPOCHS; fixed keys untouched; re-plans use only the time left; data.num_prompts ≤ the
prompts there are when the caller knows them (`available_prompts`). `Rates` refuses a rate or time that is not
finite and positive, and `check_plan` (run on every plan and re-plan) refuses a plan with a size < 1, a
non-finite or negative number, or stage seconds that do not add up to its total: no plan can buy more than its
own time estimate. Constants: docs/budget.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, TypeGuard

from dflashkit import family
from dflashkit.decode.evaluation import hybrid_keys
from dflashkit.errors import UsageError
from dflashkit.family.recipe import config_recipe

SAFETY = 0.9
EPOCHS = 10.0
CURVE_POINTS = 6
HELDOUT_STEP_SHARE = 0.7
EVAL_SHARE = 0.2
EVAL_MAX_SHARE = 0.3
EVAL_TAU = 1.25                       # a weak drafter's τ (the demo's: 1.23–1.27): eval is not under-planned
EVAL_PROMPT_TOKENS = 200
MIN_NEW_TOKENS = 16
ROLLOUT_CAPTURE = 1.75                # train.on_path=rollout: capture also decodes the greedy paths (~+75 %)
EVAL_NEW_TOKENS = 96                  # eval.max_new_tokens when the budget sizes it: at most this, more prompts first
SAMPLES_PER_PROMPT = 1150 / 1376      # the demo: 1400 prompts, 24 held out for eval
TOKENS_PER_SAMPLE = 383_000 / 1150
PRIOR_MAX_LENGTH = 512
PRIOR = (f"{SAMPLES_PER_PROMPT:.2f} samples per prompt of {TOKENS_PER_SAMPLE:.0f} tokens (the demo's data at "
         f"tokenize.max_length {PRIOR_MAX_LENGTH})")
FIXED_S = {"probe": 5.0, "prepare": 15.0, "generate": 0.0, "tokenize": 10.0, "capture": 5.0, "train": 10.0,
           "eval": 10.0, "export": 10.0, "report": 10.0}
LOADS = {"capture": 1, "train": 1, "eval": 1, "export": 1}
PER_PROMPT_S = {"prepare": 0.005, "tokenize": 0.01}
MAX_PROMPTS = 10_000_000            # the search's upper end (a prompt costs prepare + tokenize time: never reached)
STAGES = ("calibrate", "probe", "prepare", "generate", "tokenize", "capture", "train", "eval", "export", "report")
SIZED = ("data.num_prompts", "train.max_steps", "train.eval_every", "train.save_every", "eval.num_prompts",
         "eval.max_new_tokens")


def _finite(v: Any) -> TypeGuard[float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class PlanError(UsageError):
    """A plan (or the rates it is made from) with a number that cannot be: what `Rates` and `check_plan` refuse."""


@dataclass(frozen=True)
class Rates:
    """This machine's measured speeds (`sizing/calibration.py` measures them).

    capture_tok_s: target tokens per second through capture's forward (its dtype / autocast);
    train_step_s: seconds per optimizer step on a batch of the configured shape (features given);
    decode_s: {n: seconds of one target forward over n tokens} (n = 1 and eval's block sizes);
    load_s: seconds to load the target; calibrate_s: what the calibration itself took."""

    capture_tok_s: float
    train_step_s: float
    decode_s: dict[int, float] = field(default_factory=dict)
    load_s: float = 5.0
    calibrate_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("capture_tok_s", "train_step_s"):
            if not (_finite(v := getattr(self, name)) and v > 0):
                raise PlanError(f"Rates.{name} = {v!r}: must be a finite number > 0")
        for name in ("load_s", "calibrate_s"):
            if not (_finite(v := getattr(self, name)) and v >= 0):
                raise PlanError(f"Rates.{name} = {v!r}: must be a finite number >= 0")
        for n, t in self.decode_s.items():
            if int(n) < 1 or not (_finite(t) and t > 0):
                raise PlanError(f"Rates.decode_s t({n}) = {t!r}: must be a finite number > 0 for n >= 1")

    def t(self, n: int) -> float:
        """t(n): measured, else interpolated linearly between the nearest measured n (flat beyond them)."""
        d = {int(k): float(v) for k, v in self.decode_s.items()}
        if not d:
            return 0.0
        if n in d:
            return d[n]
        lo = max((k for k in d if k < n), default=None)
        hi = min((k for k in d if k > n), default=None)
        if lo is None or hi is None:
            return d[lo if hi is None else hi]  # type: ignore[index]
        return d[lo] + (d[hi] - d[lo]) * (n - lo) / (hi - lo)


def tokens_per_sample(cfg: Any, fixed: Iterable[str]) -> float:
    if "data.mean_tokens" in set(fixed):
        return float(cfg.data.mean_tokens)
    return TOKENS_PER_SAMPLE * min(1.0, cfg.tokenize.max_length / PRIOR_MAX_LENGTH)


def overhead_s(stage: str, rates: Rates, cfg: Any = None) -> float:
    """A stage's fixed seconds: start-up and its target loads (not its per-prompt or per-token work); with `cfg`,
    tokenize's teacher-forced agreement check (tokenize.agreement_samples per source through the target)."""
    s = FIXED_S.get(stage, 0.0) + LOADS.get(stage, 0) * rates.load_s
    if stage == "tokenize" and cfg is not None and cfg.tokenize.agreement_samples > 0:
        tokens = cfg.tokenize.agreement_samples * len(cfg.data.sources) * tokens_per_sample(cfg, ())
        s += rates.load_s + tokens / rates.capture_tok_s
    return s


def step_s(cfg: Any, rates: Rates, fixed: Iterable[str]) -> float:
    """Seconds per optimizer step (features not cached: plus the batch's target forward, here or in the engine)."""
    s = rates.train_step_s
    if not config_recipe(cfg).cached:
        s += cfg.train.batch_size * tokens_per_sample(cfg, fixed) / rates.capture_tok_s
    return s


def heldout_s(cfg: Any, rates: Rates, fixed: Iterable[str]) -> float:
    """The held-out curve: CURVE_POINTS + 1 evaluations of the held-out samples (0 without any)."""
    n = cfg.train.heldout_samples
    if n <= 0:
        return 0.0
    batches = math.ceil(n / cfg.train.batch_size) + 1
    return (CURVE_POINTS + 1) * batches * HELDOUT_STEP_SHARE * step_s(cfg, rates, fixed)


def cadence(steps: int) -> int:
    """eval_every / save_every: at most CURVE_POINTS held-out points over `steps` (plus the one at the end), and at
    least 4 in all once steps ≥ 4 (the data-budget forecast's minimum)."""
    return max(1, math.ceil(steps / CURVE_POINTS))


def _block_sizes(cfg: Any) -> list[int]:
    return [b for b in dict.fromkeys(cfg.eval.block_sizes or [cfg.drafter.block_size]) if b != 1]


def eval_prompt_s(cfg: Any, rates: Rates, max_new: int, *, hybrid_grid: bool = True) -> float:
    """Seconds to decode one eval prompt: the baseline and every proposer at every block size (the drafter, the
    adaptive length, the confidence truncation where the drafter's family has a confidence, prompt lookup), and with
    eval.hybrid (`hybrid_grid`: eval has the prompts it needs) the suffix proposer and each hybrid gate and graft at
    the largest (`decode.evaluation.hybrid_keys`), with prefills."""
    e = cfg.eval
    truncated = bool(e.confidence_truncation) and family.get(cfg.drafter.type).decoding.confidence is not None
    passes = 1 + int(bool(e.adaptive_length)) + int(truncated) + int(bool(e.prompt_lookup))
    hybrid = len(hybrid_keys(cfg, max(_block_sizes(cfg)))) if e.hybrid and hybrid_grid and _block_sizes(cfg) else 0
    per_token = (rates.t(1) + sum(passes * rates.t(b) / EVAL_TAU for b in _block_sizes(cfg))
                 + (hybrid * rates.t(max(_block_sizes(cfg))) / EVAL_TAU if hybrid else 0.0))
    prefills = 1 + passes * len(_block_sizes(cfg)) + hybrid
    return max_new * per_token + prefills * EVAL_PROMPT_TOKENS / rates.capture_tok_s


def eval_s(cfg: Any, rates: Rates, prompts: int, max_new: int, *, hybrid_grid: bool | None = None) -> float:
    """Eval's seconds for `prompts` prompts of `max_new` tokens (warm-up and eval.dtype=auto's probes included).
    The hybrid grid runs from 2 prompts on (`hybrid_grid` None; one chooses the gate the other is scored with:
    decode.evaluation.MIN_HYBRID_PROMPTS)."""
    extra = cfg.eval.warmup + (2 if cfg.eval.dtype == "auto" else 0)
    grid = prompts >= 2 if hybrid_grid is None else hybrid_grid
    return overhead_s("eval", rates) + (prompts + extra) * eval_prompt_s(cfg, rates, max_new, hybrid_grid=grid)


def size_eval(cfg: Any, rates: Rates, fixed: Iterable[str], seconds: float) -> tuple[int, int, float]:
    """(eval.num_prompts, eval.max_new_tokens, planned seconds) that fit `seconds`: prompts first (up to the
    prompts there are: data.heldout when eval reads prepare's split) at max_new_tokens ≤ EVAL_NEW_TOKENS, then
    max_new_tokens cut down to MIN_NEW_TOKENS if one prompt does not fit; never below 1 prompt."""
    fx = set(fixed)
    max_new = cfg.eval.max_new_tokens if "eval.max_new_tokens" in fx else min(cfg.eval.max_new_tokens, EVAL_NEW_TOKENS)
    cap = cfg.data.heldout if cfg.eval.prompts is None else 10_000
    if "eval.num_prompts" in fx:
        k = cfg.eval.num_prompts
    else:
        per = eval_prompt_s(cfg, rates, max_new)
        left = seconds - eval_s(cfg, rates, 0, max_new, hybrid_grid=True)
        k = max(1, min(max(1, cap), int(left // per) if per > 0 else cap))
    if "eval.max_new_tokens" not in fx:
        while max_new > MIN_NEW_TOKENS and eval_s(cfg, rates, k, max_new) > seconds:
            max_new = max(MIN_NEW_TOKENS, int(max_new * 0.8))
    return k, max_new, eval_s(cfg, rates, k, max_new)


@dataclass(frozen=True)
class _Data:
    """The data arithmetic of one plan: prompts → samples → steps → seconds."""

    cfg: Any
    rates: Rates
    fixed: frozenset[str]

    def samples(self, prompts: int) -> float:
        return max(0.0, SAMPLES_PER_PROMPT * (prompts - self.cfg.data.heldout))

    def train_samples(self, prompts: int) -> float:
        return max(0.0, self.samples(prompts) - self.cfg.train.heldout_samples)

    def epoch_steps(self, prompts: int, epochs: float = EPOCHS) -> int:
        return max(1, int(epochs * self.train_samples(prompts) / self.cfg.train.batch_size))

    def capture_s(self, prompts: int) -> float:
        recipe = config_recipe(self.cfg)
        if not recipe.cached:
            return 0.0
        paths = ROLLOUT_CAPTURE if recipe.rollout else 1.0  # greedy paths decoded too
        return paths * self.samples(prompts) * tokens_per_sample(self.cfg, self.fixed) / self.rates.capture_tok_s

    def prep_s(self, prompts: int) -> float:
        return prompts * (PER_PROMPT_S["prepare"] + PER_PROMPT_S["tokenize"])

    def train_s(self, steps: int) -> float:
        return steps * step_s(self.cfg, self.rates, self.fixed) + heldout_s(self.cfg, self.rates, self.fixed)

    def min_prompts(self) -> int:
        c = self.cfg
        return c.data.heldout + math.ceil((c.train.heldout_samples + c.train.batch_size) / SAMPLES_PER_PROMPT)


def _largest(fits, lo: int, hi: int) -> int:
    """The largest n in [lo, hi] with fits(n) (fits is monotone: true then false); lo when none fits."""
    if not fits(lo):
        return lo
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def plan_run(cfg: Any, rates: Rates, *, budget_minutes: float, fixed: Iterable[str] = (),
             active: Iterable[str] | None = None, available_prompts: int | None = None) -> dict[str, Any]:
    """The plan for a budget: sizes (`SIZED`, the fixed ones as given), planned seconds per stage, epochs,
    the prior it assumed and warnings. `active`: the pipeline's stages (default: all but generate);
    `available_prompts`: the prompts the sources hold, when known (data.num_prompts is never planned above it)."""
    if not (_finite(budget_minutes) and budget_minutes > 0):
        raise PlanError(f"budget_minutes = {budget_minutes!r}: must be a finite number > 0")
    fx = frozenset(fixed)
    stages = [s for s in STAGES if s == "calibrate" or s in set(active or (x for x in STAGES if x != "generate"))]
    total = budget_minutes * 60.0
    usable = total * SAFETY
    d = _Data(cfg, rates, fx)
    warnings: list[str] = []
    k, max_new, ev = size_eval(cfg, rates, fx, EVAL_SHARE * total)
    if not {"eval.num_prompts", "eval.max_new_tokens"} <= fx:  # reserve the share (monotone in the budget):
        ev = max(ev, EVAL_SHARE * total)                        # what eval leaves, its re-plan takes back
    static = rates.calibrate_s + sum(overhead_s(s, rates, cfg) for s in stages if s not in ("calibrate", "eval")) + ev
    avail = usable - static
    if "generate" in stages:
        warnings.append("generate (answer regeneration) is not in the budget model: its time comes out of "
                        "training and eval, which are re-planned from the time left")

    def cost(prompts: int, steps: int) -> float:
        return d.prep_s(prompts) + d.capture_s(prompts) + d.train_s(steps)

    lo, hi = d.min_prompts(), MAX_PROMPTS
    if available_prompts is not None and available_prompts >= 1:
        if available_prompts < lo and "data.num_prompts" not in fx:
            warnings.append(f"the sources hold {available_prompts} prompts, fewer than the smallest run's {lo} "
                            "(data.heldout, train.heldout_samples and one batch): add data or lower those")
        lo = min(lo, available_prompts)
        hi = max(lo, min(hi, available_prompts))
    if "data.num_prompts" in fx and cfg.data.num_prompts:
        prompts = int(cfg.data.num_prompts)
    elif "train.max_steps" in fx and cfg.train.max_steps:  # more data than one epoch of the steps buys nothing
        steps_f = int(cfg.train.max_steps)
        hi = max(lo, min(hi, d.min_prompts() + math.ceil(steps_f * cfg.train.batch_size / SAMPLES_PER_PROMPT)))
        prompts = _largest(lambda n: cost(n, steps_f) <= avail, lo, hi)
    else:
        prompts = _largest(lambda n: cost(n, d.epoch_steps(n)) <= avail, lo, hi)
    if "train.max_steps" in fx and cfg.train.max_steps:
        steps = int(cfg.train.max_steps)
    else:
        room = avail - d.prep_s(prompts) - d.capture_s(prompts) - heldout_s(cfg, rates, fx)
        steps = max(1, min(d.epoch_steps(prompts), int(room // step_s(cfg, rates, fx))))
    sizes = {"data.num_prompts": prompts, "train.max_steps": steps,
             "train.eval_every": cfg.train.eval_every if "train.eval_every" in fx else cadence(steps),
             "train.save_every": cfg.train.save_every if "train.save_every" in fx else cadence(steps),
             "eval.num_prompts": k, "eval.max_new_tokens": max_new}
    per = {s: overhead_s(s, rates, cfg) for s in stages}
    per["calibrate"] = rates.calibrate_s
    per["prepare"] += prompts * PER_PROMPT_S["prepare"]
    per["tokenize"] += prompts * PER_PROMPT_S["tokenize"]
    if "capture" in per:
        per["capture"] += d.capture_s(prompts)
    per["train"] += d.train_s(steps)
    per["eval"] = ev
    planned = sum(per.values())
    if planned > usable:
        warnings.append(f"the smallest run ({planned / 60:.1f} min planned) does not fit {SAFETY:.0%} of "
                        f"{budget_minutes:g} min: a larger run.budget_minutes, or fewer fixed sizes")
    ts = d.train_samples(prompts)
    return check_plan({"budget_minutes": budget_minutes, "budget_s": round(total, 1), "usable_s": round(usable, 1),
            "safety": SAFETY, "prior": PRIOR if "data.mean_tokens" not in fx else
            f"{SAMPLES_PER_PROMPT:.2f} samples per prompt of data.mean_tokens = {cfg.data.mean_tokens} tokens",
            "samples": round(d.samples(prompts)), "tokens": round(d.samples(prompts) * tokens_per_sample(cfg, fx)),
            "epochs": round(steps * cfg.train.batch_size / ts, 2) if ts else None,
            "sizes": sizes, "fixed": [k for k in SIZED if k in fx],
            "stages": {s: round(v, 1) for s, v in per.items()}, "planned_s": round(planned, 1),
            "warnings": warnings})


def check_plan(plan: dict[str, Any]) -> dict[str, Any]:
    """`plan` (a `plan_run` record) when every number in it can be: sizes whole numbers ≥ 1, stage seconds,
    samples and tokens finite and ≥ 0, the budget and planned total finite and > 0, the stages adding up to the
    total, and the total within the usable budget unless a warning says the smallest run does not fit.
    PlanError naming the first number that cannot be."""
    def fail(what: str) -> PlanError:
        return PlanError(f"budget plan: {what}", hint="the calibration it was made from cannot be right: delete "
                         "<run_dir>/calibration.json and the cache's calibration/ entry, then run again")

    for key in ("budget_s", "usable_s", "planned_s"):
        if not (_finite(v := plan.get(key)) and v > 0):
            raise fail(f"{key} is {v!r}, not a finite number > 0")
    for key, v in (plan.get("sizes") or {}).items():
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            raise fail(f"{key} is {v!r}, not a whole number >= 1")
    for key in ("samples", "tokens"):
        if not (_finite(v := plan.get(key)) and v >= 0):
            raise fail(f"{key} is {v!r}, not a finite number >= 0")
    if (e := plan.get("epochs")) is not None and not (_finite(e) and e > 0):
        raise fail(f"epochs is {e!r}, not a finite number > 0")
    stages = plan.get("stages") or {}
    for stage, v in stages.items():
        if not (_finite(v) and v >= 0):
            raise fail(f"the {stage} stage's planned seconds are {v!r}, not a finite number >= 0")
    if abs(sum(stages.values()) - plan["planned_s"]) > 0.1 * len(stages) + 1e-6:
        raise fail(f"the stages' planned seconds add up to {sum(stages.values()):.1f}, not planned_s "
                   f"{plan['planned_s']}")
    if plan["planned_s"] > plan["usable_s"] + 0.1 and not any("does not fit" in w for w in plan.get("warnings", ())):
        raise fail(f"planned {plan['planned_s']} s over the usable {plan['usable_s']} s with no warning")
    return plan


def replan_train(plan: dict[str, Any], rates: Rates, cfg: Any, fixed: Iterable[str], *, train_samples: int,
                 elapsed_s: float, slowdown: float = 1.0) -> dict[str, Any]:
    """Before train: train.max_steps (and the cadence) from the real sample count and the time left after
    eval, export and report's planned seconds; at most EPOCHS epochs. `slowdown` scales the step time (capture's
    measured rate against the calibration's). Returns {"sizes": {...}, "planned_s": train's seconds}."""
    fx = frozenset(fixed)
    after = sum(plan["stages"].get(s, 0.0) for s in ("eval", "export", "report"))
    step = step_s(cfg, rates, fx) * slowdown
    left = plan["usable_s"] - elapsed_s - after - overhead_s("train", rates) - heldout_s(cfg, rates, fx) * slowdown
    if "train.max_steps" in fx and cfg.train.max_steps:
        steps = int(cfg.train.max_steps)
    else:
        cap = max(1, int(EPOCHS * train_samples / cfg.train.batch_size))
        steps = max(1, min(cap, int(max(0.0, left) // step)))
    sizes = {"train.max_steps": steps,
             "train.eval_every": cfg.train.eval_every if "train.eval_every" in fx else cadence(steps),
             "train.save_every": cfg.train.save_every if "train.save_every" in fx else cadence(steps)}
    return check_replan({"sizes": sizes, "time_left_s": round(left, 1),
                         "planned_s": round(overhead_s("train", rates) + (steps * step + heldout_s(cfg, rates, fx)
                                                                          * slowdown), 1)})


def replan_eval(plan: dict[str, Any], rates: Rates, cfg: Any, fixed: Iterable[str], *,
                elapsed_s: float) -> dict[str, Any]:
    """Before eval: eval.num_prompts (then eval.max_new_tokens) for the time left after export and report's
    planned seconds, at most EVAL_MAX_SHARE of the budget. Returns {"sizes": {...}, "planned_s": eval's seconds}."""
    after = sum(plan["stages"].get(s, 0.0) for s in ("export", "report"))
    left = plan["usable_s"] - elapsed_s - after
    seconds = min(max(0.0, left), EVAL_MAX_SHARE * plan["budget_s"])
    k, max_new, ev = size_eval(cfg, rates, fixed, seconds)
    return check_replan({"sizes": {"eval.num_prompts": k, "eval.max_new_tokens": max_new},
                         "time_left_s": round(left, 1), "planned_s": round(ev, 1)})


def check_replan(r: dict[str, Any]) -> dict[str, Any]:
    """`r` (a re-plan) when its sizes are whole numbers ≥ 1 and its planned seconds finite and > 0 (its time left
    may be below 0: the run is late); PlanError otherwise."""
    for key, v in r["sizes"].items():
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            raise PlanError(f"budget re-plan: {key} is {v!r}, not a whole number >= 1")
    if not (_finite(r["planned_s"]) and r["planned_s"] > 0) or not _finite(r["time_left_s"]):
        raise PlanError(f"budget re-plan: planned {r['planned_s']!r} s with {r['time_left_s']!r} s left")
    return r


def _min(s: float | None) -> str:
    return "" if s is None else f"{s / 60:6.1f} min"


def plan_lines(record: dict[str, Any]) -> list[str]:
    """The plan (and the actuals so far) as a table: budget, calibration, stages with planned and actual minutes
    and sizes, the keys the user fixed."""
    p, c = record["plan"], record.get("calibration") or {}
    sizes = record.get("sizes") or p["sizes"]
    actual = record.get("actual") or {}
    act = actual.get("stages") or {}
    m = c.get("machine") or {}
    dec = ", ".join(f"t({n}) {float(t) * 1000:.1f} ms" for n, t in sorted((c.get("decode_s") or {}).items(),
                                                                           key=lambda x: int(x[0])))
    lines = [f"budget {p['budget_minutes']:g} min, planned to {p['safety']:.0%} ({p['usable_s'] / 60:.1f} min) on "
             f"{m.get('name') or m.get('kind', '?')}"
             + (f" ({m['threads']} threads)" if m.get("threads") else ""),
             f"  calibration ({c.get('source')}): capture {c.get('capture_tok_s')} tok/s ({c.get('capture_dtype')}), "
             f"train step {c.get('train_step_s')} s, decode ({c.get('verify_dtype')}) {dec}",
             f"  prior: {p['prior']}",
             f"  {'stage':10s} {'planned':>10s} {'actual':>10s}  sizes"]
    got = f"; actual {actual['samples']} samples, {actual['tokens']} tokens" if actual.get("samples") else ""
    what = {"prepare": f"data.num_prompts {sizes['data.num_prompts']}"
                       + (f" ({actual['prompts']} prepared for training)" if actual.get("prompts") is not None else ""),
            "capture": f"planned ~{p['samples']} samples, ~{p['tokens']} tokens{got}",
            "train": f"train.max_steps {sizes['train.max_steps']} (≤ {EPOCHS:g} epochs; planned {p['epochs']}), "
                     f"eval_every {sizes['train.eval_every']}, save_every {sizes['train.save_every']}",
            "eval": f"eval.num_prompts {sizes['eval.num_prompts']} × eval.max_new_tokens {sizes['eval.max_new_tokens']}"}
    re = record.get("replanned") or {}
    planned = {s: (re[s]["planned_s"] if s in re else v) for s, v in p["stages"].items()}
    for s in STAGES:
        if s in planned:
            note = f"{what.get(s, '')}{' (re-planned from the time left)' if s in re else ''}"
            lines.append(f"  {s:10s} {_min(planned[s]):>10s} {_min(act.get(s)):>10s}  {note}".rstrip())
    done = sum(v for v in act.values() if isinstance(v, (int, float)))
    lines.append(f"  {'total':10s} {_min(sum(planned.values())):>10s} {_min(done) if act else '':>10s}")
    fixed = p.get("fixed") or []
    lines.append("  fixed by you (kept): " + (", ".join(fixed) if fixed else "none"))
    return lines
