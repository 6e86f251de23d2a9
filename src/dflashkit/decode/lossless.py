"""The greedy lossless check, exact in fp32 and tie-aware in bf16.

Usage:
    base = SpecDecoder(target, None, 1, record_margins=True).generate(prompt, params)
    spec = SpecDecoder(target, drafter, 8, record_margins=True).generate(prompt, params)
    d = first_divergence(spec, base)              # None, or where / at which margin they part
    v = lossless_verdict([d, ...], tolerance=tie_tolerance(torch.bfloat16, None))
    v["verdict"]                                  # "exact" | "ties-only" | "not lossless"

Why ties: a greedy speculative decoder must emit exactly the baseline's tokens. In fp32 it does
(the B-token verify pass and the one-token step agree far below any logit gap). In bf16 (fp16) a
B-token pass rounds differently from a one-token pass, so where the target's two best tokens are
within rounding noise the argmax can flip, and from there the outputs differ although neither run
is wrong. A real bug (a verify rule accepting a wrong token, a stale cache) diverges where the
target clearly preferred its token.

Rule: at the first position where a speculative output differs from the baseline, look up the
baseline's top-1 − top-2 logit margin at that position (recorded by the baseline decoder). The
divergence is a numerical tie iff the margin ≤ `tolerance` and the speculative token is the
baseline's top-2 token. A run is "exact" without divergences, "ties-only" when every divergence is
a tie, else "not lossless". After the first divergence the two outputs continue from different
prefixes, so only first divergences are judged.

Default tolerances, in logit units (`eval.tie_tolerance` overrides): bf16 0.25 — SmolLM2-135M's
logits run up to ~30, where one bf16 ulp is 0.125, and a B-token pass moves a logit by up to
~0.2 from the one-token value (measured; `docs/architecture.md`); fp16 1/8 of that; fp32 1e-3,
far above fp32 noise (~1e-5) and far below real gaps (a wrong token is typically whole logits off).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dflashkit.decode.api import GenerationResult

TIE_TOLERANCE = {"bfloat16": 0.25, "float16": 0.03, "float32": 1e-3}


def tie_tolerance(dtype, configured: float | None = None) -> float:
    """`configured` if set, else the default for the verify dtype (a torch dtype or its name)."""
    if configured is not None:
        return float(configured)
    name = str(dtype).removeprefix("torch.")
    return TIE_TOLERANCE.get(name, TIE_TOLERANCE["float32"])


@dataclass
class Divergence:
    """Where a speculative output first differs from the baseline, and how close the baseline's call was."""

    position: int                 # index into the generated tokens
    margin: float | None          # baseline's top-1 − top-2 logit margin there (None: not recorded)
    runner_up: bool               # the speculative token is the baseline's top-2 token
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
    margin = base.margins[pos] if pos < len(base.margins) else None
    runner = s_tok is not None and pos < len(base.runner_up) and base.runner_up[pos] == s_tok
    return Divergence(pos, margin, runner, b_tok, s_tok)


def is_tie(d: Divergence, tolerance: float) -> bool:
    return d.margin is not None and d.runner_up and d.margin <= tolerance


def lossless_verdict(divergences: list[Divergence | None], tolerance: float) -> dict:
    """Judge the first divergences of every (prompt, decoder) pair; None entries are identical outputs.

    Returns {"verdict", "compared", "divergences", "ties", "max_tie_margin", "min_non_tie_margin",
    "tolerance"}: verdict "exact" (no divergence), "ties-only" (every divergence a tie) or
    "not lossless".
    """
    divs = [d for d in divergences if d is not None]
    ties = [d for d in divs if is_tie(d, tolerance)]
    others = [d for d in divs if not is_tie(d, tolerance)]
    verdict = "exact" if not divs else "ties-only" if not others else "not lossless"
    known = [d.margin for d in others if d.margin is not None]
    return {"verdict": verdict, "compared": len(divergences), "divergences": len(divs), "ties": len(ties),
            "max_tie_margin": round(max(d.margin for d in ties), 6) if ties else None,
            "min_non_tie_margin": round(min(known), 6) if known else None, "tolerance": tolerance}


def divergence_record(d: Divergence, **where) -> dict:
    """A JSON-ready row for results.json (`where`: block size, proposer, prompt index and id)."""
    row = {**where, **asdict(d)}
    if row["margin"] is not None:
        row["margin"] = round(row["margin"], 6)
    return row
