"""`speculation_profile.json`: a drafter's measured acceptance, shipped beside its weights (ModelOpt schema 1.0).

Usage:
    m = Measurement(block_size=4, lengths=[[4, 2, 1], [3]], cut=[[False, False, True], [True]])
    profile = build_profile([m], headline=4, method=method_for(contract), draft_checkpoint={...},
                            target_model={...}, block_size=4, max_supported_k=3, conditions={...})
    write_profile(rd.eval_profile, profile)            # atomic; refuses a profile that fails `validate`
    read_profile(profile_path(export_dir))             # None when absent; UsageError naming file and field
    conditional, marginal = accept_rates({1: 40, 2: 30, 3: 30}, k=3)   # [0.6, 0.5, 0.0], [0.6, 0.3, 0.0]

This module owns the file: writer, reader, path (`profile_path`, `RunDir.eval_profile`,
`RunDir.verify_engine_profile`) and self-checks; what stages do with a profile is
`export/profile_ship.py`. The schema is NVIDIA Model-Optimizer's specdec_bench one, written from our
own reading and compatible field by field; our additions are `measured_at`, `per_category`,
`measurement_conditions.steps`, the `engines` section (docs/architecture.md) and `proposers`: for each data
source (and thinking mode), which proposer pays (the drafter alone, the suffix proposer alone, or their hybrid)
and at which gate, as eval measured it (`decode/evaluation.py`'s hybrid row), and `draft_length`: for each data
source, which draft-length rule pays (fixed B, the adaptive length, or verification truncated by the drafter's
confidence at a threshold: `serve.confidence_truncation`), from eval's `draft_length` rows. The ModelOpt fields
always describe the drafter alone at fixed B.

Definitions (len = tokens one verify step commits, bonus included; K = B − 1):
`marginal_accept_rates[i]` = P(len ≥ i + 2); `conditional_accept_rates[i]` = P(len ≥ i + 2) /
P(len ≥ i + 1) (0 where the denominator is 0); `mean_accept_length` = 1 + Σ marginals exactly.
Invariant: rates, histogram and means count only uncut steps (`Measurement.cut`: fewer than K drafts,
or cut at a stop token or max_new_tokens: a lower bound, not an acceptance outcome), so every
self-check holds; the cut steps and the all-steps τ are in `measurement_conditions.steps`. A
measurement without an uncut step writes `measured: false` with zero rates and no mean.
"""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflashkit import __version__
from dflashkit.errors import UsageError
from dflashkit.rundir import atomic_write_json

if TYPE_CHECKING:
    from dflashkit.family.contract import DrafterContract

SCHEMA_VERSION = "1.0"
PROFILE_FILE = "speculation_profile.json"
MEAN_TOLERANCE = 0.02  # |1 + Σ marginal − mean_accept_length| (the schema's mean_consistency)
RATE_ATOL = 1e-5       # rates are written to 6 decimals; recomputations agree within this
VERIFICATION_METHODS = ("longest_prefix", "block")
LENGTH_MODELS = ("chain_analytic", "measured_per_k")
STEP_RULE = ("rates, histogram and means count uncut steps only: a step with fewer than K drafts or with "
             "its tokens cut at a stop token or max_new_tokens is a lower bound, not an acceptance outcome")


def profile_path(directory: str | Path) -> Path:
    """Where a drafter dir's (or a stage dir's) profile lives."""
    return Path(directory) / PROFILE_FILE


def method_for(contract: DrafterContract) -> str:
    """The profile's `method` for a drafter (dflash, dflash2, …): its family's name (`contract.family`)."""
    return contract.family.name


def checkpoint_id(path: str | Path | None) -> str | None:
    """A path reduced to its last two parts (`org/model`): a shipped file carries no local layout."""
    parts = [p for p in str(path or "").replace("\\", "/").split("/") if p]
    return "/".join(parts[-2:]) or None


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def dflashkit_source() -> dict[str, str | None]:
    """dflashkit's version and, in a git checkout of it, its commit (`+dirty` with uncommitted changes)."""
    here = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(here), *args], capture_output=True, text=True, timeout=10)
        return done.stdout.strip()

    try:
        top = git("rev-parse", "--show-toplevel")
        commit = git("rev-parse", "--short=12", "HEAD") if top and (Path(top) / "src" / "dflashkit").resolve() == here \
            else ""
        dirty = bool(commit and git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", False
    return {"version": __version__, "commit": (commit + ("+dirty" if dirty else "")) or None}


def prompts_digest(prompt_ids: list[list[int]]) -> str:
    """sha256 of the prompts' token ids: the same prompts rendered the same way give the same digest."""
    return hashlib.sha256(json.dumps(prompt_ids, separators=(",", ":")).encode()).hexdigest()


def weights_digest(drafter_dir: str | Path) -> str:
    """sha256 of a drafter dir's safetensors weights (every shard, in name order, whole files)."""
    d = Path(drafter_dir)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise UsageError(f"{d}: no .safetensors weights to digest", hint="point at a drafter dir")
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 24), b""):
                h.update(chunk)
    return h.hexdigest()


@dataclass
class Measurement:
    """One block size's decode: per request, the length of each verify step and whether it was cut."""

    block_size: int
    lengths: list[list[int]]
    cut: list[list[bool]]
    sources: list[str | None] | None = None  # per request: its data source (per_category), when known

    def counted(self, keep: set[int] | None = None) -> list[list[int]]:
        """Per request (or those in `keep`), the lengths of its uncut steps."""
        return [[n for n, c in zip(ls, cs) if not c] for i, (ls, cs) in enumerate(zip(self.lengths, self.cut))
                if keep is None or i in keep]


def histogram(lengths: list[int], k: int) -> dict[int, int]:
    """Steps per length, dense over 1 … max(K + 1, the longest seen)."""
    c = Counter(lengths)
    return {n: c.get(n, 0) for n in range(1, max([k + 1, *lengths]) + 1)}


def accept_rates(hist: dict[int, int], k: int) -> tuple[list[float], list[float]]:
    """(conditional, marginal) rates of K draft positions from a {length: steps} histogram."""
    total = sum(hist.values())
    marginal = [sum(v for n, v in hist.items() if n >= i + 2) / total if total else 0.0 for i in range(k)]
    return conditional_from(marginal), marginal


def conditional_from(marginal: list[float]) -> list[float]:
    out, prev = [], 1.0
    for m in marginal:
        out.append(m / prev if prev > 0 else 0.0)
        prev = m
    return out


def round6(x: float) -> float:
    return round(float(x), 6)


def self_checks(mean: float, marginal: list[float]) -> dict[str, Any]:
    """The schema's two checks: 1 + Σ marginals vs the mean (within 0.02), and marginals never rise."""
    implied = 1.0 + sum(marginal)
    rises = [{"position": i, "value": marginal[i], "previous": marginal[i - 1]}
             for i in range(1, len(marginal)) if marginal[i] > marginal[i - 1] + 1e-9]
    return {"mean_consistency": {"implied_mean_accept_length": round6(implied),
                                 "reported_mean_accept_length": round6(mean), "abs_delta": round6(abs(implied - mean)),
                                 "tolerance": MEAN_TOLERANCE, "passed": abs(implied - mean) <= MEAN_TOLERANCE},
            "marginal_monotonicity": {"passed": not rises, "violations": rises}}


def _summary(requests: list[list[int]], k: int) -> dict[str, Any]:
    """Rates, means and histogram of the uncut steps of some requests (mean None without a step)."""
    flat = [n for r in requests for n in r]
    hist = histogram(flat, k)
    conditional, marginal = accept_rates(hist, k)
    per_request = [sum(r) / len(r) for r in requests if r]
    return {"steps": len(flat), "requests": len(requests),
            "mean_accept_length": round6(sum(flat) / len(flat)) if flat else None,
            "mean_accept_length_per_request": round6(sum(per_request) / len(per_request)) if per_request else None,
            "conditional_accept_rates": [round6(x) for x in conditional],
            "marginal_accept_rates": [round6(x) for x in marginal], "histogram": hist}


def build_profile(measurements: list[Measurement], *, headline: int, method: str, draft_checkpoint: dict[str, Any],
                  target_model: dict[str, Any], block_size: int, max_supported_k: int,
                  conditions: dict[str, Any], proposers: dict[str, Any] | None = None,
                  draft_length: dict[str, Any] | None = None) -> dict[str, Any]:
    """The profile of `measurements` (one per block size); its vectors are those of block size `headline`.
    `proposers` (`proposers_block`): which proposer pays per source; `draft_length` (`draft_length_block`): which
    draft-length rule pays per source; each kept as given."""
    by_b = {m.block_size: m for m in measurements}
    m = by_b[headline]
    k = headline - 1
    s = _summary(m.counted(), k)
    all_steps = [n for r in m.lengths for n in r]
    measured = s["mean_accept_length"] is not None
    by_k = {}
    for b in sorted(by_b):
        mean = _summary(by_b[b].counted(), b - 1)["mean_accept_length"]
        if mean is not None:
            by_k[str(b - 1)] = mean
    return {
        "schema_version": SCHEMA_VERSION, "measured": measured, "measured_at": utc_now(), "method": method,
        "draft_checkpoint": draft_checkpoint, "target_model": target_model,
        "num_speculative_tokens": k, "block_size": block_size, "max_supported_k": max_supported_k,
        "verification_method": "longest_prefix",
        "conditional_accept_rates": s["conditional_accept_rates"], "marginal_accept_rates": s["marginal_accept_rates"],
        "mean_accept_length": s["mean_accept_length"],
        "mean_accept_length_per_request": s["mean_accept_length_per_request"],
        "accept_length_model": "measured_per_k", "accept_length_by_k": by_k,
        "acceptance_length_histogram": {str(n): v for n, v in s["histogram"].items()} if measured else None,
        "per_category": _per_category(m, k),
        "measurement_conditions": {**conditions, "steps": {
            "counted": s["steps"], "cut": len(all_steps) - s["steps"],
            "mean_accept_length_all_steps": round6(sum(all_steps) / len(all_steps)) if all_steps else None,
            "rule": STEP_RULE}},
        "validation": self_checks(s["mean_accept_length"], s["marginal_accept_rates"]) if measured else None,
        **({"proposers": proposers} if proposers is not None else {}),
        **({"draft_length": draft_length} if draft_length is not None else {}),
    }


def proposers_block(hybrid: dict[str, Any]) -> dict[str, Any]:
    """`proposers`: from eval's `summary.hybrid`, the decoder each data source and each thinking mode runs fastest
    on its prompts (`proposer`: drafter, suffix, hybrid or graft; `block_size`; `gate`: the suffix branch's
    minimum match length and whether it grafts, null for a single proposer; tokens/s), the same overall, and
    whether the measurement was flagged unreliable."""
    keep = ("proposer", "block_size", "gate", "tokens_per_s")
    return {"rule": "per source and mode, the proposer and gate with the highest measured tokens/s over their "
                    "prompts (eval's hybrid row scores each prompt with the choice made on the other prompts)",
            "by_source": {n: {k: g.get(k) for k in keep} for n, g in (hybrid.get("gates_by_source") or {}).items()},
            "by_mode": {n: {k: g.get(k) for k in keep} for n, g in (hybrid.get("gates_by_mode") or {}).items()},
            "hybrid": {k: hybrid.get(k) for k in ("tau", "speedup")},
            "versus_drafter": (hybrid.get("versus_drafter") or {}).get("ratio"),
            "versus_prompt_lookup": (hybrid.get("versus_prompt_lookup") or {}).get("ratio"),
            "unreliable": bool(hybrid.get("unreliable"))}


DRAFT_LENGTH_POLICIES = ("fixed", "adaptive", "confident")


def draft_length_block(rows: dict[str, Any], block_size: int, threshold: float | None) -> dict[str, Any] | None:
    """`draft_length`: from eval's `draft_length.<B>` rows (`decode/evaluation.length_policies`) at the profile's
    block size, the rule each data source is best served with: `confident` (verification truncated by the drafter's
    confidence at `confidence_threshold`: `serve.confidence_truncation`) or `adaptive` (`serve.adaptive_length`)
    where eval measured it clearly faster than fixed B (its paired 90 % interval above 1, neither entry flagged;
    the faster of the two when both are), else `fixed`; with each policy's paired speed ratio over fixed B. The
    ModelOpt rates stay those of fixed B. None when eval measured no policy beside fixed B at that block size."""
    row = rows.get(str(block_size))
    if not row:
        return None

    def pick(g: dict[str, Any]) -> dict[str, Any]:
        over = {n: g[f"{n}_vs_fixed"] for n in DRAFT_LENGTH_POLICIES[1:] if f"{n}_vs_fixed" in g}
        faster = [(r["ratio"], n) for n, r in over.items() if r.get("faster")]
        return {"policy": max(faster)[1] if faster else "fixed",
                "versus_fixed": {n: {"ratio": r.get("ratio"), "interval90": r.get("interval90")}
                                 for n, r in over.items()}}

    return {"rule": "per source, the draft-length policy whose paired speed over fixed B has its 90 % interval above 1 "
                    "(the faster one where two do), else fixed", "block_size": block_size,
            "confidence_threshold": threshold if "confident" in row.get("decoders", {}) else None, **pick(row),
            "by_source": {src: pick(g) for src, g in (row.get("by_source") or {}).items()}}


def _per_category(m: Measurement, k: int) -> dict[str, Any] | None:
    if not m.sources or any(not src for src in m.sources):
        return None
    out = {}
    for src in sorted({str(x) for x in m.sources}):
        s = _summary(m.counted({i for i, x in enumerate(m.sources) if x == src}), k)
        out[src] = {key: s[key] for key in ("requests", "steps", "mean_accept_length",
                                            "conditional_accept_rates", "marginal_accept_rates")}
    return out


class _Checker:
    """Type checks that raise one UsageError naming the file and the field."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, field: str, what: str) -> UsageError:
        return UsageError(f"{self.source}: `{field}` {what}",
                          hint="re-measure it (`dflashkit eval`, then `dflashkit export`), or move the file away: "
                          "the drafter works without it")

    def num(self, p: dict[str, Any], field: str, lo: float | None = None, hi: float | None = None) -> float:
        v = p.get(field)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self.fail(field, f"is {v!r}, expected a number")
        if (lo is not None and v < lo - RATE_ATOL) or (hi is not None and v > hi + RATE_ATOL):
            raise self.fail(field, f"is {v!r}, outside [{lo}, {hi if hi is not None else '∞'}]")
        return float(v)

    def rates(self, p: dict[str, Any], field: str, k: int) -> list[float]:
        v = p.get(field)
        if not isinstance(v, list) or len(v) != k:
            raise self.fail(field, f"is {v!r}, expected a list of num_speculative_tokens = {k} rates")
        return [self.num({f"{field}[{i}]": x}, f"{field}[{i}]", 0.0, 1.0) for i, x in enumerate(v)]

    def int_keyed(self, p: dict[str, Any], field: str) -> dict[int, float] | None:
        v = p.get(field)
        if v is None:
            return None
        if not isinstance(v, dict) or not all(isinstance(x, str) and x.isdigit() for x in v):
            raise self.fail(field, "must map integer keys (as strings) to numbers")
        return {int(x): self.num({f"{field}.{x}": y}, f"{field}.{x}", 0.0) for x, y in v.items()}


def validate(p: Any, source: str) -> None:
    """Raise UsageError naming `source` and the field when the profile is malformed or contradicts itself.

    Recomputes the self-checks from the file's own numbers: 1 + Σ marginals = the mean (0.02), marginals
    never rise, each conditional is its marginal over the previous one, and the histogram gives the same
    marginals and mean. A profile measured by another producer (ModelOpt) passes when it holds together.
    """
    ck = _Checker(source)
    if not isinstance(p, dict):
        raise ck.fail("(top level)", "is not a JSON object")
    if p.get("schema_version") != SCHEMA_VERSION:
        raise ck.fail("schema_version", f"is {p.get('schema_version')!r}; dflashkit reads {SCHEMA_VERSION!r}")
    if not isinstance(p.get("measured"), bool):
        raise ck.fail("measured", f"is {p.get('measured')!r}, expected true or false")
    k = p.get("num_speculative_tokens")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ck.fail("num_speculative_tokens", f"is {k!r}, expected an integer >= 0")
    for field, allowed in (("verification_method", VERIFICATION_METHODS), ("accept_length_model", LENGTH_MODELS)):
        if p.get(field) not in allowed:
            raise ck.fail(field, f"is {p.get(field)!r}, expected one of {list(allowed)}")
    for field in ("block_size", "max_supported_k"):
        if p.get(field) is not None and (isinstance(p[field], bool) or not isinstance(p[field], int)):
            raise ck.fail(field, f"is {p[field]!r}, expected an integer or null")
    if p.get("max_supported_k") is not None and p["max_supported_k"] < k:
        raise ck.fail("max_supported_k", f"is {p['max_supported_k']}, below num_speculative_tokens {k}")
    conditional, marginal = ck.rates(p, "conditional_accept_rates", k), ck.rates(p, "marginal_accept_rates", k)
    ck.int_keyed(p, "accept_length_by_k")
    hist = ck.int_keyed(p, "acceptance_length_histogram")
    props = p.get("proposers")
    if props is not None and (not isinstance(props, dict) or not isinstance(props.get("by_source", {}), dict)):
        raise ck.fail("proposers", "must be an object whose `by_source` maps a source to its proposer")
    dl = p.get("draft_length")
    if dl is not None and (not isinstance(dl, dict) or dl.get("policy") not in DRAFT_LENGTH_POLICIES
                           or not isinstance(dl.get("by_source", {}), dict)):
        raise ck.fail("draft_length", f"must be an object whose `policy` is one of {list(DRAFT_LENGTH_POLICIES)}")
    engines = p.get("engines", [])
    if not isinstance(engines, list) or not all(isinstance(e, dict) and isinstance(e.get("engine"), str)
                                                for e in engines):
        raise ck.fail("engines", "must be a list of objects with an `engine` name")
    if not p["measured"] or p["verification_method"] != "longest_prefix":
        return  # a placeholder, or block verification: the longest-prefix identities do not apply
    mean = ck.num(p, "mean_accept_length", 1.0, k + 1.0)
    checks = self_checks(mean, marginal)
    if not checks["mean_consistency"]["passed"]:
        raise ck.fail("mean_accept_length", f"is {mean} but 1 + Σ marginal_accept_rates = "
                      f"{checks['mean_consistency']['implied_mean_accept_length']} (validation.mean_consistency, "
                      f"tolerance {MEAN_TOLERANCE})")
    rises = checks["marginal_monotonicity"]["violations"]
    if rises:
        v = rises[0]
        raise ck.fail(f"marginal_accept_rates[{v['position']}]", f"is {v['value']}, above the position before it "
                      f"({v['previous']}): marginals never rise (validation.marginal_monotonicity)")
    prev = 1.0
    for i, (c, m) in enumerate(zip(conditional, marginal)):
        if abs(c * prev - m) > RATE_ATOL and prev > 0:
            raise ck.fail(f"conditional_accept_rates[{i}]", f"is {c} but marginal[{i}] / marginal[{i - 1}] = "
                          f"{m / prev:.6f}")
        prev = m
    if hist:
        if not all(float(v).is_integer() for v in hist.values()):
            raise ck.fail("acceptance_length_histogram", "must count steps (integers)")
        counts = {n: int(v) for n, v in hist.items()}
        total = sum(counts.values())
        _, want = accept_rates(counts, k)
        bad = next((i for i, (a, b) in enumerate(zip(marginal, want)) if abs(a - b) > RATE_ATOL), None)
        if bad is not None or not total or abs(sum(n * v for n, v in counts.items()) / total - mean) > RATE_ATOL:
            where = f"marginal_accept_rates[{bad}] {marginal[bad]} vs {want[bad]:.6f}" if bad is not None else \
                f"mean {mean}"
            raise ck.fail("acceptance_length_histogram", f"does not give the recorded rates ({where})")
    recorded = p.get("validation")
    for name in ("mean_consistency", "marginal_monotonicity"):
        said = (recorded or {}).get(name, {}).get("passed") if isinstance(recorded, dict) else None
        if said is not None and said != checks[name]["passed"]:
            raise ck.fail(f"validation.{name}.passed",
                          f"is {said}, but the file's numbers give {checks[name]['passed']}")


def read_profile(path: str | Path) -> dict[str, Any] | None:
    """The profile at `path`, validated; None when there is none. UsageError (exit 2) naming file and field."""
    p = Path(path)
    if not p.is_file():
        return None
    try:
        profile = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"{p}: not readable JSON ({e})", hint="re-measure it or move the file away") from None
    validate(profile, str(p))
    return profile


def write_profile(path: str | Path, profile: dict[str, Any]) -> Path:
    """Write a profile atomically after `validate` (a profile that contradicts itself is never written)."""
    validate(profile, str(path))
    atomic_write_json(path, profile)
    return Path(path)


def headline(profile: dict[str, Any]) -> dict[str, Any]:
    """The numbers a command prints about a profile."""
    steps = (profile.get("measurement_conditions") or {}).get("steps") or {}
    return {"measured": profile["measured"], "measured_at": profile.get("measured_at"), "method": profile.get("method"),
            "num_speculative_tokens": profile["num_speculative_tokens"],
            "mean_accept_length": profile.get("mean_accept_length"),
            "marginal_accept_rates": profile["marginal_accept_rates"], "steps": steps.get("counted"),
            "engines": [{k: e.get(k) for k in ("engine", "version", "mean_accept_length", "passed")}
                        for e in profile.get("engines", [])]}

