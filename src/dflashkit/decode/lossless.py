"""The greedy lossless check, exact in fp32 and tie-aware in bf16.

Usage:
    base = SpecDecoder(target, None, 1, record_top=TOP_K).generate(prompt, params)
    spec = SpecDecoder(target, drafter, 8, record_top=TOP_K).generate(prompt, params)
    d = first_divergence(spec, base)              # None, or where / at which logit gap they part
    v = lossless_verdict([d, ...], tie_rule(torch.bfloat16, cfg.eval.tie_tolerance))
    v["verdict"]                                  # "exact" | "ties-only" | "not lossless"

Why ties: a greedy speculative decoder must emit exactly the baseline's tokens. In fp32 it does; in
bf16 (fp16) a B-token verify pass rounds differently from a one-token pass, so where the target's
best tokens are within rounding noise (or hold the very same bf16 logit) the argmax can flip
although neither run is wrong. A real bug (a wrong accept, a stale cache) diverges where the target
clearly preferred its token.

Rule: at the first position where a speculative output differs from the baseline, take the
baseline's recorded TOP_K logits there: margin = top-1 − top-2, gap = top-1 − the baseline's logit of
the token the speculative run emitted (unknown when it is not among the TOP_K). The divergence is a
tie iff the gap is known and within the tolerance (`TieRule`). Verdict: "exact" without divergences,
"ties-only" when every divergence is a tie, else "not lossless". Only first divergences are judged
(after one the prefixes differ). The default tolerance is a share of the baseline's largest |logit|
among its top-k, per dtype, since bf16 rounding is relative; `eval.tie_tolerance` sets a fixed one.
The measurements behind the shares: docs/architecture.md, "Verify dtype and the tie-aware lossless check".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dflashkit.decode.api import GenerationResult

TOP_K = 8  # logits recorded per emitted token by the baseline (the tie test needs the diverging token's)
RELATIVE_TIE_TOLERANCE = {"bfloat16": 0.04, "float16": 0.005, "float32": 1e-4}


@dataclass(frozen=True)
class TieRule:
    """A divergence is a tie when its gap ≤ `absolute` (if set) else ≤ `relative` × its logit scale."""

    relative: float
    absolute: float | None = None

    def limit(self, d: "Divergence") -> float:
        if self.absolute is not None:
            return self.absolute
        return self.relative * (d.scale or 0.0)

    def describe(self) -> str:
        if self.absolute is not None:
            return f"{self.absolute:g} logits"
        return f"{self.relative:.2%} of the baseline's largest |logit|"


def tie_rule(dtype, configured: float | None = None) -> TieRule:
    """`configured` (logits) if set, else the relative default of the verify dtype (torch dtype or name)."""
    name = str(dtype).removeprefix("torch.")
    rel = RELATIVE_TIE_TOLERANCE.get(name, RELATIVE_TIE_TOLERANCE["float32"])
    return TieRule(rel, None if configured is None else float(configured))


@dataclass
class Divergence:
    """Where a speculative output first differs from the baseline, and how close the baseline's call was."""

    position: int                 # index into the generated tokens
    margin: float | None          # baseline's top-1 − top-2 logit there (None: not recorded)
    gap: float | None             # baseline's top-1 − its logit of the speculative token (None: not in its top-k)
    scale: float | None           # the baseline's largest |logit| among its recorded top-k there
    baseline_token: int | None
    speculative_token: int | None


def first_divergence(spec: GenerationResult, base: GenerationResult) -> Divergence | None:
    """The first position where `spec` and `base` differ (None when identical)."""
    a, b = spec.token_ids, base.token_ids
    pos = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if pos is None:
        if len(a) == len(b):
            return None
        pos = min(len(a), len(b))
    s_tok = a[pos] if pos < len(a) else None
    b_tok = b[pos] if pos < len(b) else None
    top = base.top_logits[pos] if pos < len(base.top_logits) else []
    margin = top[0][1] - top[1][1] if len(top) > 1 else None
    gap = next((top[0][1] - v for i, v in top if i == s_tok), None) if top and s_tok is not None else None
    scale = max(abs(v) for _, v in top) if top else None
    return Divergence(pos, margin, gap, scale, b_tok, s_tok)


def is_tie(d: Divergence, rule: TieRule) -> bool:
    return d.gap is not None and d.gap <= rule.limit(d)


def lossless_verdict(divergences: list[Divergence | None], rule: TieRule) -> dict:
    """Judge the first divergences of every (prompt, decoder) pair; None entries are identical outputs.

    Returns {"verdict", "compared", "divergences", "ties", "max_tie_gap", "max_tie_margin",
    "min_non_tie_gap", "tolerance"}: verdict "exact" (no divergence), "ties-only" (every divergence a
    tie) or "not lossless". min_non_tie_gap is a lower bound when a token was outside the top-k.
    """
    divs = [d for d in divergences if d is not None]
    ties = [d for d in divs if is_tie(d, rule)]
    others = [d for d in divs if not is_tie(d, rule)]
    verdict = "exact" if not divs else "ties-only" if not others else "not lossless"
    # a token outside the recorded top-k is at least (top-1 − k-th best) behind; the margin bounds that below
    lower = [d.gap if d.gap is not None else d.margin for d in others]
    bounds = [x for x in lower if x is not None]
    gaps = [d.gap for d in ties if d.gap is not None]  # every tie has a gap (is_tie)
    margins = [d.margin for d in ties if d.margin is not None]  # None: not recorded (a top-1 only record)
    return {"verdict": verdict, "compared": len(divergences), "divergences": len(divs), "ties": len(ties),
            "max_tie_gap": round(max(gaps), 6) if gaps else None,
            "max_tie_margin": round(max(margins), 6) if margins else None,
            "min_non_tie_gap": round(min(bounds), 6) if bounds else None, "tolerance": rule.describe()}


def divergence_record(d: Divergence, rule: TieRule, **where) -> dict:
    """A JSON-ready row for results.json (`where`: block size, proposer, prompt index and id)."""
    row = {**where, **asdict(d), "tolerance": rule.limit(d), "tie": is_tie(d, rule)}
    for k in ("margin", "gap", "scale", "tolerance"):
        if row[k] is not None:
            row[k] = round(row[k], 6)
    return row
