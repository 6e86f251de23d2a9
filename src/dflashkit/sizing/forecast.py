"""The data-budget forecast: how many supervised tokens until held-out τ reaches a target?

Usage:
    fc = forecast_from_curve(json.loads(Path("runs/x/train/curve.json").read_text()), target_tau=2.0)
    fc.text()   # "held-out τ 2.0 at ≈ 3.1M supervised tokens (1σ 1.9M–5.0M) ≈ 12,000 samples ≈ 2.3 h ..."
    fc.tokens   # None (with fc.warning saying why) when the curve cannot answer

The law: held-out τ against supervised tokens seen n, τ(n) = τ∞ − a·n^(−b) with a, b > 0 (it
levels off at τ∞; a log-linear law would always promise the target eventually). Least squares:
for each b on a log grid the model is linear in (τ∞, a); the b with the smallest residual wins. The
covariance is Gauss-Newton's, s²·(JᵀJ)⁻¹ with s² = SSE / (points − 3): at least `MIN_POINTS` points.

Inverting the law gives the tokens for a target τ*: n* = (a / (τ∞ − τ*))^(1/b). Its uncertainty is
the delta method on log n* (1σ band n*·exp(∓σ)). No number is given, only a warning, when the
curve is too short, the curve does not rise, τ* is at or above the fitted asymptote τ∞, or τ*
is within one standard error of τ∞ (the band would be unbounded). A number far beyond the
curve (more than `FAR` × its last point) comes with a warning.

Tokens → samples and hours use the run's own rates, recorded in `curve.json`
(`supervised_per_sample`, `train_s` per point): samples = n* / supervised tokens per training
sample; hours = n* × (training seconds / supervised tokens so far) — the training loop's
cost on this machine (capture, evaluation and any new data not included).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from dflashkit.errors import MissingArtifactError, UsageError
from dflashkit.train.logging import read_curve

MIN_POINTS = 4
FAR = 20.0
_B_GRID = np.exp(np.linspace(math.log(0.02), math.log(3.0), 600))


@dataclass
class CurveFit:
    """τ(n) = tau_inf − a·n^(−b) with standard errors and the covariance of (tau_inf, a, b)."""

    tau_inf: float
    a: float
    b: float
    cov: list[list[float]]
    rmse: float
    points: int

    def predict(self, n: float | np.ndarray) -> float | np.ndarray:
        return self.tau_inf - self.a * np.power(n, -self.b)

    @property
    def stderr(self) -> list[float]:
        return [math.sqrt(max(0.0, self.cov[i][i])) for i in range(3)]


@dataclass
class Forecast:
    """The answer for one target τ; `tokens` is None when there is no trustworthy number."""

    target_tau: float
    tokens: float | None = None
    tokens_low: float | None = None      # 1σ band
    tokens_high: float | None = None
    samples: float | None = None
    hours: float | None = None
    last_tokens: float | None = None
    last_tau: float | None = None
    fit: CurveFit | None = None
    warning: str | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["fit"] = None if self.fit is None else {**asdict(self.fit), "stderr": self.fit.stderr}
        return d

    def text(self) -> str:
        """One human line ("τ 2.0 at ≈ N tokens ≈ M samples ≈ H hours", or the warning)."""
        if self.tokens is None:
            return f"forecast for held-out τ {self.target_tau:g}: no number — {self.warning}"
        band = (f" (1σ {_si(self.tokens_low)}–{_si(self.tokens_high)})" if self.tokens_low is not None
                and self.tokens_high is not None else "")
        out = f"held-out τ {self.target_tau:g} at ≈ {_si(self.tokens)} supervised tokens seen{band}"
        if self.samples is not None:
            out += f" ≈ {_si(self.samples)} samples of this data"
        if self.hours is not None:
            out += f" ≈ {self.hours:.3g} h of training on this machine"
        if self.fit is not None:
            se = self.fit.stderr
            out += (f"; fit τ∞ {self.fit.tau_inf:.3f} ± {se[0]:.3f}, b {self.fit.b:.2f} ± {se[2]:.2f} over "
                    f"{self.fit.points} points")
        if self.notes:
            out += "; " + "; ".join(self.notes)
        if self.warning:
            out += f" — warning: {self.warning}"
        return out


def _si(x: float | None) -> str:
    if x is None:
        return "?"
    for div, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.3g}"


def fit_power_law(tokens: Sequence[float], tau: Sequence[float]) -> CurveFit | str:
    """Least-squares fit of τ∞ − a·n^(−b); the fit, or a string saying why there is none."""
    n = np.asarray(tokens, dtype=np.float64)
    y = np.asarray(tau, dtype=np.float64)
    ok = np.isfinite(n) & np.isfinite(y) & (n > 0)
    n, y = n[ok], y[ok]
    if np.unique(n).size < MIN_POINTS:
        return (f"the curve has {np.unique(n).size} usable point(s); a saturating fit needs at least "
                f"{MIN_POINTS} (evaluate more often: lower train.eval_every)")
    if y[np.argmax(n)] <= y[np.argmin(n)]:
        return "held-out τ does not rise along the curve (nothing to extrapolate)"
    scale = float(n.max())
    x = n / scale                                       # fit in units of the last point: well conditioned
    best: tuple[float, float, float, float] | None = None
    for b in _B_GRID:
        z = np.power(x, -b)
        A = np.stack([np.ones_like(z), -z], 1)
        coef, *_ = np.linalg.lstsq(A, y, rcond=None)
        if coef[1] <= 0:
            continue
        sse = float(np.sum((A @ coef - y) ** 2))
        if best is None or sse < best[0]:
            best = (sse, float(coef[0]), float(coef[1]), float(b))
    if best is None:
        return "no rising saturating law fits the curve"
    sse, tau_inf, a_s, b = best
    m = y.size
    z = np.power(x, -b)
    J = np.stack([np.ones_like(z), -z, a_s * z * np.log(x)], 1)   # ∂τ/∂(τ∞, a_s, b)
    s2 = sse / (m - 3)
    try:
        cov_s = s2 * np.linalg.inv(J.T @ J)
    except np.linalg.LinAlgError:
        cov_s = np.full((3, 3), np.inf)
    # back to raw units: a = a_s·scale^b (so τ = τ∞ − a·n^(−b)); propagate (τ∞, a_s, b) → (τ∞, a, b)
    a = a_s * scale ** b
    G = np.array([[1, 0, 0], [0, scale ** b, a * math.log(scale)], [0, 0, 1]], dtype=np.float64)
    cov = G @ cov_s @ G.T
    return CurveFit(tau_inf, a, b, cov.tolist(), math.sqrt(sse / m), int(m))


def tokens_for(fit: CurveFit, target_tau: float) -> tuple[float, float] | str:
    """(n*, σ of log n*) for `target_tau`, or why there is no number."""
    gap = fit.tau_inf - target_tau
    se = fit.stderr
    if gap <= 0:
        return (f"τ {target_tau:g} is at or beyond the fitted asymptote τ∞ = {fit.tau_inf:.3f}: this recipe and "
                f"data are not expected to reach it by more tokens alone")
    if not math.isfinite(se[0]) or gap <= se[0]:
        return (f"τ {target_tau:g} is within one standard error of the fitted asymptote τ∞ = {fit.tau_inf:.3f} "
                f"± {se[0]:.3f}: the curve cannot tell whether it is reachable")
    log_n = (math.log(fit.a) - math.log(gap)) / fit.b
    g = np.array([-1 / (fit.b * gap), 1 / (fit.a * fit.b), -log_n / fit.b])
    var = float(g @ np.asarray(fit.cov) @ g)
    return math.exp(log_n), math.sqrt(max(var, 0.0)) if math.isfinite(var) else float("inf")


def forecast(tokens: Sequence[float], tau: Sequence[float], target_tau: float, *,
             supervised_per_sample: float | None = None, seconds_per_token: float | None = None) -> Forecast:
    """The forecast for `target_tau` from curve points (supervised tokens seen, held-out τ)."""
    fc = Forecast(target_tau)
    if len(tokens):
        i = int(np.argmax(np.asarray(tokens, dtype=np.float64)))
        fc.last_tokens, fc.last_tau = float(tokens[i]), float(tau[i])
    reached = [float(n) for n, t in sorted(zip(tokens, tau)) if t >= target_tau]
    if reached:  # measured, not forecast: the first point at or above the target
        fc.tokens = reached[0]
        fc.notes.append(f"the curve reached τ {target_tau:g} at {_si(reached[0])} tokens (measured)")
    fit = fit_power_law(tokens, tau)
    if isinstance(fit, str):
        if fc.tokens is None:
            fc.warning = fit
        return _rates(fc, supervised_per_sample, seconds_per_token)
    fc.fit = fit
    if fc.tokens is not None:
        return _rates(fc, supervised_per_sample, seconds_per_token)
    got = tokens_for(fit, target_tau)
    if isinstance(got, str):
        fc.warning = got
        return fc
    n_star, sigma = got
    fc.tokens = n_star
    if math.isfinite(sigma):
        fc.tokens_low, fc.tokens_high = n_star * math.exp(-sigma), n_star * math.exp(sigma)
    if fc.last_tokens and n_star > FAR * fc.last_tokens:
        fc.warning = (f"{n_star / fc.last_tokens:.0f}× beyond the last point of the curve "
                      f"({_si(fc.last_tokens)} tokens): a long extrapolation, treat it as an order of magnitude")
    return _rates(fc, supervised_per_sample, seconds_per_token)


def _rates(fc: Forecast, per_sample: float | None, s_per_token: float | None) -> Forecast:
    if fc.tokens is not None:
        if per_sample:
            fc.samples = fc.tokens / per_sample
        if s_per_token:
            fc.hours = fc.tokens * s_per_token / 3600
    return fc


def forecast_from_curve(curve: dict, target_tau: float, *, source: str | None = None,
                        seconds_per_token: float | None = None) -> Forecast:
    """`forecast` on a `train/curve.json` dict (overall held-out τ, or one data source's).

    `seconds_per_token` overrides the run's own training rate (`plan` passes its estimate at scale)."""
    pts = [p for p in curve.get("points", []) if isinstance(p, dict)]
    tokens, tau = [], []
    for p in pts:
        row = (p.get("by_source") or {}).get(source) if source else p.get("heldout")
        n = (row or {}).get("tokens", p.get("tokens")) if source else p.get("tokens")
        t = (row or {}).get("tau")
        if n is not None and t is not None:
            tokens.append(float(n))
            tau.append(float(t))
    if seconds_per_token is None and pts:
        last = max(pts, key=lambda p: p.get("tokens") or 0)
        if last.get("train_s") and last.get("tokens"):
            seconds_per_token = float(last["train_s"]) / float(last["tokens"])
    return forecast(tokens, tau, target_tau, supervised_per_sample=curve.get("supervised_per_sample"),
                    seconds_per_token=seconds_per_token)


def read_curve_forecast(path, target_tau: float, *, seconds_per_token: float | None = None) -> Forecast | None:
    """`forecast_from_curve` on the curve file at `path`, or a run dir's (`train/logging.read_curve`); None
    when the file is missing or unreadable."""
    curve = read_curve(path)
    if curve is None:
        return None
    return forecast_from_curve(curve, target_tau, seconds_per_token=seconds_per_token)


def forecast_at_rate(curve: dict, target_tau: float, *, hours_per_epoch: float | None,
                     epoch_tokens: float | None) -> Forecast:
    """`forecast_from_curve` with hours at another speed (`plan`'s estimate at scale): `hours_per_epoch`
    for an epoch of `epoch_tokens` tokens (all tokens), turned into seconds per supervised token by the
    curve's supervised share (`supervised_per_sample / tokens_per_sample`)."""
    share = ((curve.get("supervised_per_sample") or 0) / curve["tokens_per_sample"]
             if curve.get("tokens_per_sample") else None)
    rate = hours_per_epoch * 3600 / (epoch_tokens * share) if hours_per_epoch and epoch_tokens and share else None
    fc = forecast_from_curve(curve, target_tau, seconds_per_token=rate)
    if rate is None:
        fc.hours = None
    return fc


def curve_file_forecast(path, target_tau: float, *, hours_per_epoch: float | None,
                        epoch_tokens: float | None) -> dict:
    """`plan`'s forecast: `forecast_at_rate` on the curve file at `path`, as a dict with its `text`.

    Raises MissingArtifactError (exit 3) when the file is missing, UsageError (exit 2) when it is not a
    learning curve."""
    p = Path(path)
    if not p.is_file():
        raise MissingArtifactError("learning curve", p, run="dflashkit train -c run.yaml (it writes train/curve.json)")
    try:
        curve = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise UsageError(f"{p}:{e.lineno}: not JSON ({e.msg})", hint="pass a train/curve.json") from None
    if not isinstance(curve, dict) or not isinstance(curve.get("points"), list):
        raise UsageError(f"{p}: not a learning curve (no `points` list)", hint="pass a train/curve.json")
    fc = forecast_at_rate(curve, target_tau, hours_per_epoch=hours_per_epoch, epoch_tokens=epoch_tokens)
    out = fc.to_dict()
    out["text"] = fc.text().replace("on this machine", "at this plan's throughput")
    out["curve"] = str(p)
    return out
