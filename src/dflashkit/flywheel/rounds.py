"""One `learn` round: the traffic since the cursor → fine-tune the serving drafter → paired score → promote or keep.

Usage:
    res = learn_round(cfg, rd, record_dir, budget_minutes=10, calibration=saved_calibration(cfg, rd))

Layout (`<run_dir>/learn/`): cursor.json (complete lines consumed per segment, and `since_promotion`, the same
after the round that promoted the serving drafter; written last, atomically, so a round that fails leaves it where
it was and the next round reads the same records again), promoted.json (the
pointer `serve` watches, `flywheel/pointer.py`), rounds/NNN/ (a run dir of its own: contract.json,
conversations.jsonl, tokenize/, train/, export/ when promoted, and round.json: cursor range, sample ids, steps,
both drafters' scores, the paired interval, the decision and the paths).

A round trains on the records since the serving drafter's promotion (`learn.window: since_promotion`: a kept
round's traffic trains the next round's candidate, so training evidence accumulates until one is shown better), on
every record learned so far (`all`: the training set grows across promotions too) or on its new records only
(`round`), starting from the serving drafter (`learn.warm_start: serving`) or the static one (`static`), for at
most `learn.max_epochs` passes over them. The held-out slice is the newest of the new records by time
(`traffic.split_newest`), and with `learn.heldout_pool: since_promotion` also every earlier held-out slice since the
serving drafter's promotion (cursor.json `heldout_since_promotion`): those records stay held out, so the rule's
evidence accumulates too (`round`: a kept round's slice trains the next candidate instead). Held-out samples never
train (the trainer's split is handed in: `train.loop.setup(split=...)`). Both drafters are scored on it the way the
held-out curve scores (teacher-forced simulated τ on the target's own tokens, `Trainer.micro_loss` with the
run's held-out labels) from every block of each sample (`learn.score_anchors`), one sample at a time, and compared
by a paired bootstrap over the samples of the pooled τ gain (new − serving). The rule (`decide`): promote only when
the 5th percentile of that gain exceeds `learn.min_gain` (default 0) and, with `learn.source_guard`, no source's
interval lies wholly below 0; otherwise keep the serving drafter. The promoted drafter is exported (float32,
z-lab layout) with a speculation profile measured by real speculative decoding of the slice's prompts; `dflashkit
serve` watching the pointer swaps it in, and the vLLM restart line is logged and kept in round.json (vLLM 0.32's
draft-weight transfer API needs a weight-transfer engine we do not drive: a restart is the honest route). Once a
round's drafter serves, later rounds also score it and the static drafter (the one before any promotion) on every
sample of the round's new traffic, its held-out slice and the rest: `serving_vs_static` is the flywheel's curve, τ on
traffic neither drafter trained on, over 1 / `learn.heldout_fraction` times the promotion rule's samples. Both comparisons
are also made per source (`by_source`: a record's own `source`, else `agent` when it offers tools, else `chat`),
each with its own paired interval over that source's samples. With `learn.compare_regenerate` a round also trains
the regenerate arm (`flywheel/regenerate.py`: the window's training prompts answered again offline at equal CPU) and
records the candidate against it (round.json `regenerate_arm`); the arm never decides anything.
Features come from the target online (a round has no capture pass: train.features=cached
becomes online). The round's training length: `--budget` minutes × `learn.train_fraction` over the saved calibration's step
time (`sizing/calibration.py`), capped by `learn.max_steps`; without a calibration, `learn.max_steps`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflashkit.data.chat import load_chat
from dflashkit.data.tokenizing import log_warnings, min_supervised, publish_shards, tokenize_shards
from dflashkit.decode.api import SamplingParams, default_stop_ids
from dflashkit.decode.spec_decode import SpecDecoder
from dflashkit.errors import MissingArtifactError, UsageError
from dflashkit.export.hf import load_drafter, save_drafter, write_modeling_file
from dflashkit.export.profile import Measurement, build_profile, method_for, profile_path, weights_digest, write_profile
from dflashkit.flywheel.pointer import pointer_path, read_promoted, write_promoted
from dflashkit.flywheel.regenerate import run_arm
from dflashkit.flywheel.traffic import read_window, run_fingerprint, split_newest, to_conversation
from dflashkit.generate.conversations import regenerated_file, write_conversations
from dflashkit.rundir import RunDir, atomic_dir, atomic_write_json, read_json, read_json_or_none
from dflashkit.train.checkpoint import drop_checkpoints, trained_drafter_dir
from dflashkit.train.loop import _fit, epoch_steps, preflight, setup
from dflashkit.train.objective import sample_anchors
from dflashkit.train.parallel import init_distributed
from dflashkit.train.target_side import heldout_paths

log = logging.getLogger("dflashkit.learn")


class EmptyWindow(UsageError):
    """No new record since the last round's cursor (exit 2; a loop waits for the next round instead)."""


def read_cursors(rd: RunDir) -> tuple[dict[str, int], dict[str, int], set[str]]:
    """(where the next round's new records start: complete lines consumed per segment, where the serving drafter's
    unlearned traffic starts: the cursor after the round that promoted it, the start of the record dir before any
    promotion, the ids of the records held out by the rounds since that promotion), from one read of cursor.json."""
    p = rd.learn_dir / "cursor.json"
    saved = read_json(p) if p.is_file() else {}
    return (dict(saved.get("segments", {})), dict(saved.get("since_promotion", {})),
            set(saved.get("heldout_since_promotion", [])))


def read_cursor(rd: RunDir) -> dict[str, int]:
    """Where the next round's new records start (`read_cursors`)."""
    return read_cursors(rd)[0]


def serving_drafter(cfg: Any, rd: RunDir) -> tuple[Path, str]:
    """(the drafter now serving, its id): the last promoted one (`promoted.json`), else the static one."""
    p = read_promoted(pointer_path(rd.root))
    if p is not None:
        return Path(p.get("warm_start") or p["drafter"]), p["id"]
    return static_drafter(cfg, rd)


def static_drafter(cfg: Any, rd: RunDir) -> tuple[Path, str]:
    """(the drafter before any promotion, "initial"): `learn.drafter`, else the run's train/best or train/final."""
    if cfg.learn.drafter:
        return Path(cfg.learn.drafter), "initial"
    try:
        src, _ = trained_drafter_dir(rd)
    except MissingArtifactError:
        raise MissingArtifactError("a drafter to start from", rd.final_dir, run="dflashkit train -c run.yaml "
                                   "(or set learn.drafter to a drafter dir)") from None
    return src, "initial"


def plan_steps(cfg: Any, budget_minutes: float | None, calibration: dict[str, Any] | None) -> tuple[int, str]:
    """(optimizer steps of this round, how they were chosen)."""
    cap = int(cfg.learn.max_steps)
    if budget_minutes is None:
        return cap, f"learn.max_steps={cap}"
    step_s = (calibration or {}).get("train_step_s")
    if not step_s:
        log.warning("--budget %s: no saved calibration for this machine and config (run `dflashkit plan` or a "
                    "`run --budget` once); training up to learn.max_steps=%d steps, stopped by the budget's CPU time",
                    budget_minutes, cap)
        return cap, f"learn.max_steps={cap} (no calibration), stopped by the CPU-time budget"
    steps = max(1, min(cap, int(budget_minutes * 60 * cfg.learn.train_fraction / float(step_s))))
    return steps, f"{budget_minutes} min × {cfg.learn.train_fraction} / {float(step_s):.3g} s a step (cap {cap})"


def cap_epochs(cfg: Any, steps: int, how: str, plan: Any) -> tuple[int, str]:
    """(`steps` capped at learn.max_epochs passes over the round's training samples (`plan`, the trainer's
    BatchPlan), how they were chosen)."""
    if cfg.learn.max_epochs is None:
        return steps, how
    cap = epoch_steps(float(cfg.learn.max_epochs), plan)
    if cap >= steps:
        return steps, how
    return cap, (f"learn.max_epochs={cfg.learn.max_epochs} × {len(plan.train_idx)} samples / batch "
                 f"{plan.global_batch} ({how})")


def cpu_budget_s(cfg: Any, budget_minutes: float | None) -> float | None:
    """The CPU seconds a round's training may use: --budget minutes × learn.train_fraction on every thread torch
    uses (the hard stop behind `plan_steps`, whose step time may come from another feature mode)."""
    if budget_minutes is None:
        return None
    return budget_minutes * 60 * float(cfg.learn.train_fraction) * torch.get_num_threads()


def _base_id(sid: str, ids: set[str]) -> str | None:
    if sid in ids:
        return sid
    head = sid.rsplit("-t", 1)[0]
    return head if head in ids else None


def paired_gain(new: list[tuple[float, int]], old: list[tuple[float, int]], *, reps: int = 2000,
                seed: int = 0) -> dict[str, Any]:
    """Pooled τ of each (Σ τ·blocks / Σ blocks over the samples), the gain new − old and its 90% paired-bootstrap
    interval (the same resampled samples for both)."""
    a = np.array([t for t, _ in new], dtype=np.float64)
    b = np.array([t for t, _ in old], dtype=np.float64)
    w = np.array([n for _, n in new], dtype=np.float64)
    n = len(a)
    if n == 0 or w.sum() <= 0:
        return {"samples": n, "tau_new": None, "tau_serving": None, "gain": None, "interval90": None}

    def pooled(x: np.ndarray, i: np.ndarray) -> np.ndarray:
        return (x[i] * w[i]).sum(-1) / np.maximum(w[i].sum(-1), 1e-9)

    all_i = np.arange(n)
    draws = np.random.default_rng(seed).integers(0, n, size=(reps, n))
    diff = pooled(a, draws) - pooled(b, draws)
    lo, hi = (float(x) for x in np.percentile(diff, [5, 95]))
    return {"samples": n, "tau_new": round(float(pooled(a, all_i)), 4), "tau_serving": round(float(pooled(b, all_i)), 4),
            "gain": round(float(pooled(a, all_i) - pooled(b, all_i)), 4), "interval90": [round(lo, 4), round(hi, 4)],
            "better_samples": int((a > b).sum()), "worse_samples": int((a < b).sum())}


@torch.no_grad()
def by_source(new: list[tuple[float, int]], old: list[tuple[float, int]], sources: list[str]) -> dict[str, Any]:
    """`paired_gain` over each source's samples alone (`sources[i]` is sample i's)."""
    return {s: paired_gain([new[i] for i, x in enumerate(sources) if x == s],
                           [old[i] for i, x in enumerate(sources) if x == s]) for s in sorted(set(sources))}


def sample_scores(tr: Any, samples: list[int] | None = None, *, anchors: int | None = None) -> list[tuple[float, int]]:
    """(simulated τ, blocks) of each of `samples` (default `tr.heldout`), in that order, for `tr.drafter`, scored
    as the held-out samples are (a sample outside `tr.heldout` needs its path: `add_scoring_paths`), from at most
    `anchors` blocks a sample (None: every block a sample has, so no draw of anchors adds noise to a comparison;
    the anchors are the same for every drafter scored)."""
    tr.drafter.eval()
    out = []
    for j in tr.heldout if samples is None else samples:
        b = tr.batch([(j, -1)], heldout=True)
        cap = int(b.loss_mask.sum()) if anchors is None else anchors
        a = sample_anchors(b.loss_mask, b.seq_lens, num_anchors=max(1, cap), block_size=tr.contract.block_size,
                           seeds=b.seeds, docs=b.docs)
        o = tr.micro_loss(b, a, None, tr.target_outputs(b, a), scoring=tr.heldout_labels)
        out.append((o.tau_sum / o.blocks if o.blocks else 1.0, int(o.blocks)))
    return out


def add_scoring_paths(tr: Any, samples: list[int]) -> None:
    """Make `samples` (training samples of `tr`) scoreable by `sample_scores`: where the held-out labels are greedy
    paths computed at setup (online features), compute theirs too."""
    if tr.heldout_paths is None or tr.heldout_labels != "target_path":
        return  # the paths come from the feature shards, or the labels are not paths
    extra = [j for j in samples if j not in tr.heldout_paths]
    if extra:
        pad = tr.target.tokenizer.pad_token_id if getattr(tr.target, "tokenizer", None) else 0
        tr.heldout_paths.update(heldout_paths(tr.train, tr.target, tr.data, extra, tr.recipe.path_depth,
                                              pad_id=pad or 0))


def _tokenize(cfg: Any, rrd: RunDir, conv_path: Path) -> dict[str, Any]:
    """Tokenize the round's conversations into `rrd`'s tokenize/ shards; tokenize's counts.

    A reply recorded with its `completion_token_ids` (`meta.completion_ids`) is trained on those ids, the target's
    own tokens, wherever they spell the reply as the chat template renders it (`ChatTemplate.ids_spell`); where
    they do not, its text is tokenized and the reply counted (`recorded_ids.disagree_text_used`, warned)."""
    chat = load_chat(cfg)
    out = rrd.stage_dir("tokenize")
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=out))
    try:
        tok = tokenize_shards(cfg, chat, [(conv_path, None)], min_supervised(cfg, rrd), staging)
        publish_shards(staging, out, tok.shards)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log_warnings(tok)
    return {"conversations": tok.conversations, **tok.totals, "dropped": dict(tok.events),
            "recorded_ids": {"used": tok.checks["server_turns"], "unlike_text_tokens": tok.checks["server_mismatches"],
                             "disagree_text_used": tok.events["recorded_ids_disagree"]}}


def _profile(cfg: Any, target: Any, drafter: torch.nn.Module, export_dir: Path, held: list[dict[str, Any]]) -> dict:
    """Measure the promoted drafter by speculative decoding of the slice's prompts; write its profile."""
    tok = target.tokenizer
    B = int(drafter.contract.block_size)
    dec = SpecDecoder(target, drafter)
    lengths, cuts, n = [], [], 0
    for rec in held[: cfg.learn.profile_prompts]:
        text = tok.apply_chat_template(rec["messages"][:-1], tools=rec.get("tools") or None, tokenize=False,
                                       add_generation_prompt=True, **(rec.get("chat_template_kwargs") or {}))
        ids = tok.encode(text, add_special_tokens=False)
        res = dec.generate(list(ids), SamplingParams(max_new_tokens=cfg.learn.profile_max_new_tokens,
                                                     stop_token_ids=default_stop_ids(target)))
        acc = list(res.acceptance_lengths)
        lengths.append(acc)
        cuts.append([False] * (len(acc) - 1) + [True] if acc else [])
        n += 1
    profile = build_profile([Measurement(B, lengths, cuts)], headline=B, method=method_for(drafter.contract),
                            draft_checkpoint={"path": str(export_dir), "sha256": weights_digest(export_dir)},
                            target_model={"path": str(cfg.target.path)}, block_size=B, max_supported_k=B - 1,
                            conditions={"prompts": n, "max_new_tokens": cfg.learn.profile_max_new_tokens,
                                        "temperature": 0.0, "source": "learn: the round's held-out traffic"})
    write_profile(profile_path(export_dir), profile)
    return {"path": str(profile_path(export_dir)), "mean_accept_length": profile["mean_accept_length"]}


def decide(cmp: dict[str, Any], *, min_gain: float, source_guard: bool) -> tuple[bool, str]:
    """(promote?, why) from the rule's comparison (`paired_gain` + `by_source`): promote when the pooled gain's
    interval lies above `min_gain` and, with `source_guard`, no source's interval lies wholly below 0 (a candidate
    better on the pool but worse on one kind of traffic is kept out)."""
    lo = (cmp["interval90"] or [None])[0]
    if lo is None:
        return False, "no held-out sample to score"
    worse = sorted(s for s, g in (cmp.get("by_source") or {}).items()
                   if g.get("interval90") and g["interval90"][1] < 0) if source_guard else []
    promote = lo > min_gain and not worse
    why = f"the paired interval's lower end {lo:+.4f} {'>' if lo > min_gain else '<='} learn.min_gain {min_gain}"
    if worse:
        why += "; worse on " + ", ".join(f"{s} (90% upper end {cmp['by_source'][s]['interval90'][1]:+.4f} < 0)"
                                         for s in worse) + " (learn.source_guard)"
    return promote, why


def _regenerate_arm(rcfg: Any, rdir: Path, tr: Any, train_recs: list[dict[str, Any]], *, budget_s: float | None,
                    summary: dict[str, Any], new_scores: list[tuple[float, int]], sources: list[str]) -> dict:
    """round.json's `regenerate_arm` (`flywheel/regenerate.py`): the arm trained on the window's training prompts
    regenerated offline, scored on the round's slice by the candidate's trainer `tr` (the same samples and labels),
    and the candidate compared with it (gain = candidate − arm). A failure is logged with its traceback and
    recorded; the round goes on."""
    trained = tr.drafter
    try:
        arm = run_arm(rcfg, rdir / "regenerate", rdir / "contract.json", tr.target, train_recs, budget_s=budget_s,
                      candidate_steps=int(summary["steps"]), tokenize=_tokenize)
        tr.drafter = arm.drafter
        arm_scores = sample_scores(tr, anchors=rcfg.learn.score_anchors)
    except Exception as e:  # noqa: BLE001 - the arm is a measurement beside the round, never its outcome
        log.exception("the regenerate arm failed; the round goes on without it")
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        tr.drafter = trained
    gain = _as_arm(paired_gain(new_scores, arm_scores))
    per = {s: _as_arm(g) for s, g in by_source(new_scores, arm_scores, sources).items()}
    log.info("regenerate arm: %d of %d prompts regenerated (%d of %d replies as recorded), %s steps, τ %s; "
             "candidate − arm %s, 90%% %s", arm.record["prompts"]["regenerated"], arm.record["prompts"]["available"],
             arm.record["replies"]["equal"], arm.record["replies"]["compared"], arm.record["steps"],
             gain["tau_regenerate"], gain["gain"], gain["interval90"])
    return {**arm.record, "candidate_train_cpu_s": summary.get("cpu_s"), "tau": gain["tau_regenerate"],
            "scores": arm_scores, "candidate_vs_regenerate": {**gain, "by_source": per}}


def _as_arm(gain: dict[str, Any]) -> dict[str, Any]:
    """`paired_gain`'s record of candidate (new) vs regenerate arm (old), its τ keys named for them."""
    names = {"tau_new": "tau_candidate", "tau_serving": "tau_regenerate"}
    return {names.get(k, k): v for k, v in gain.items()}


def _round_no(rd: RunDir) -> int:
    root = rd.learn_dir / "rounds"
    done = [int(p.parent.name) for p in root.glob("*/round.json") if p.parent.name.isdigit()]
    return max(done, default=0) + 1


def learn_round(cfg: Any, rd: RunDir, record_dir: str | Path, *, budget_minutes: float | None = None,
                calibration: dict[str, Any] | None = None, show_bar: bool = False) -> dict[str, Any]:
    """One round (module docstring); returns its record (also `rounds/NNN/round.json`)."""
    t0 = time.time()
    if not rd.contract_path.is_file():
        raise MissingArtifactError("the drafter contract", rd.contract_path, run="dflashkit probe -c run.yaml")
    cursor, base, held_since = read_cursors(rd)
    pool = held_since if cfg.learn.heldout_pool == "since_promotion" else set()
    whole = cfg.learn.window == "all"
    start = {} if whole else base  # where the earlier traffic read beside the new starts
    reads_earlier = cfg.learn.window != "round" or bool(pool)
    since = start if reads_earlier and start != cursor else None  # + earlier rounds' traffic
    win = read_window(record_dir, cursor, expected=run_fingerprint(cfg), on_corrupt=cfg.learn.on_corrupt, since=since)
    if not win.records:
        raise EmptyWindow(f"--records {record_dir}: no new record since the last round"
                          + (f" ({len(win.corrupt)} corrupt lines skipped)" if win.corrupt else ""),
                          hint="serve traffic with recording on (serve.record_dir) and run `dflashkit learn` again")
    train_recs, new_held = split_newest(win.records, fraction=cfg.learn.heldout_fraction,
                                        minimum=cfg.learn.heldout_min, maximum=cfg.learn.heldout_max)
    # earlier rounds' traffic, oldest first (empty unless `since`): their held-out slices stay held out when pooled
    earlier_held = [r for r in win.earlier if str(r["id"]) in pool]
    earlier = [r for r in win.earlier if str(r["id"]) not in pool] if cfg.learn.window != "round" else []
    train_recs = earlier + train_recs
    held_recs = earlier_held + new_held
    serving, serving_id = serving_drafter(cfg, rd)
    base_drafter = serving if cfg.learn.warm_start == "serving" else static_drafter(cfg, rd)[0]
    n = _round_no(rd)
    rdir = rd.learn_dir / "rounds" / f"{n:03d}"
    if rdir.exists():  # a round that failed before its round.json: its work is redone
        shutil.rmtree(rdir)
    rdir.mkdir(parents=True)
    rrd = RunDir(rdir)
    shutil.copyfile(rd.contract_path, rrd.contract_path)
    convs = [to_conversation(r) for r in train_recs + held_recs]
    held_ids = {str(r["id"]) for r in held_recs}
    new_ids = {str(r["id"]) for r in win.records}  # this round's traffic: no drafter that serves or served trained on it
    all_ids = set(held_ids) | {str(r["id"]) for r in train_recs}
    source_of = {c["id"]: c["source"] for c in convs}
    write_conversations(rrd.generate_dir, convs)
    steps, how = plan_steps(cfg, budget_minutes, calibration)
    rcfg = dataclasses.replace(
        cfg, run=dataclasses.replace(cfg.run, run_dir=str(rdir)),
        drafter=dataclasses.replace(cfg.drafter, init=str(base_drafter)),
        train=dataclasses.replace(cfg.train, max_steps=steps, keep_best=False, eval_every=0, save_every=0,
                                  train_samples=None, heldout_sources=[],
                                  features="online" if cfg.train.features == "cached" else cfg.train.features))
    tok = _tokenize(rcfg, rrd, regenerated_file(rrd))

    def split(data: Any) -> tuple[list[int], list[int]]:
        held = [i for i, sid in enumerate(data.ids) if _base_id(sid, held_ids) is not None]
        train = [i for i, sid in enumerate(data.ids) if _base_id(sid, held_ids) is None]
        if not train:
            raise UsageError(f"round {n}: no training sample left after tokenizing {len(train_recs)} records "
                             f"({tok['dropped']})", hint="serve more traffic, or lower tokenize.min_supervised")
        return train, held

    inputs = preflight(rcfg, rrd)
    dist = init_distributed(rcfg.train.parallel, rcfg.target.device)
    tr = setup(rcfg, rrd, dist, inputs, split=split)
    try:
        steps, how = cap_epochs(cfg, steps, how, tr.plan)
        rcfg = dataclasses.replace(rcfg, train=dataclasses.replace(rcfg.train, max_steps=steps))
        trained_ids = [tr.data.ids[i] for i in tr.plan.train_idx]
        heldout_ids = [tr.data.ids[j] for j in tr.heldout]
        summary = _fit(rcfg, rrd, tr, show_bar=show_bar, cpu_budget_s=cpu_budget_s(cfg, budget_minutes),
                       inputs=inputs)
        new_scores = sample_scores(tr, anchors=cfg.learn.score_anchors)
        trained = tr.drafter
        tr.drafter = load_drafter(serving, dtype=torch.float32).to(dist.device)
        static_scores = None
        if serving_id != "initial":  # the flywheel's baseline: the drafter that never learned from traffic
            # the curve's slice: every sample of this round's traffic (its held-out slice first), unseen by the
            # serving and the static drafter alike: 1 / learn.heldout_fraction times the round's held-out slice
            is_new = [_base_id(tr.data.ids[j], new_ids) is not None for j in tr.heldout]
            extra = [i for i in tr.plan.train_idx if _base_id(tr.data.ids[i], new_ids) is not None]
            add_scoring_paths(tr, extra)
            scored = list(tr.heldout) + extra
            serving_scores = sample_scores(tr, scored, anchors=cfg.learn.score_anchors)
            old_scores = serving_scores[:len(tr.heldout)]
            keep = [k for k, new in enumerate(is_new) if new] + list(range(len(tr.heldout), len(scored)))
            fresh = [scored[k] for k in keep]
            fresh_scores = [serving_scores[k] for k in keep]
            tr.drafter = load_drafter(static_drafter(cfg, rd)[0], dtype=torch.float32).to(dist.device)
            static_scores = sample_scores(tr, fresh, anchors=cfg.learn.score_anchors)
        else:
            old_scores = sample_scores(tr, anchors=cfg.learn.score_anchors)
        tr.drafter = trained

        def source(j: int) -> str:
            return source_of[_base_id(tr.data.ids[j], all_ids) or ""]

        sources = [source(j) for j in tr.heldout]
        cmp = {**paired_gain(new_scores, old_scores), "by_source": by_source(new_scores, old_scores, sources)}
        vs_static = None
        if static_scores is not None:
            fresh_sources = [source(j) for j in fresh]
            vs_static = {**paired_gain(fresh_scores, static_scores), "slice": "round_traffic",
                         "by_source": by_source(fresh_scores, static_scores, fresh_sources),
                         "scores": {"ids": [tr.data.ids[j] for j in fresh], "serving": fresh_scores,
                                    "static": static_scores, "sources": fresh_sources}}
        arm = None
        if cfg.learn.compare_regenerate:
            budget_s = cpu_budget_s(cfg, budget_minutes)  # equal CPU: what the candidate used (learn.max_epochs)
            budget_s = min(budget_s, float(summary.get("cpu_s") or budget_s)) if budget_s is not None else None
            arm = _regenerate_arm(rcfg, rdir, tr, train_recs, budget_s=budget_s,
                                  summary=summary, new_scores=new_scores, sources=sources)
        promote, reason = decide(cmp, min_gain=cfg.learn.min_gain, source_guard=cfg.learn.source_guard)
        export = profile = pointer = restart = None
        if promote:
            export_dir = rdir / "export"
            model = getattr(trained, "module", trained)
            with atomic_dir(export_dir) as tmp:
                save_drafter(model, tmp, dtype="float32")
                write_modeling_file(tmp, model.contract.family)
            export = str(export_dir)
            profile = _profile(rcfg, tr.target, model, export_dir, new_held)
            drafter_id = f"r{n:03d}-{weights_digest(export_dir)[:8]}"
            pointer = write_promoted(rd.root, drafter_dir=export_dir, round_no=n, drafter_id=drafter_id)
            restart = (f"vllm serve {cfg.target.path} --speculative-config '{{\"method\":\"dflash\",\"model\":"
                       f"\"{export_dir.resolve()}\",\"num_speculative_tokens\":{model.contract.block_size - 1}}}'")
            log.info("promoted %s → %s: `dflashkit serve` with serve.promoted=%s swaps it in between requests; a vLLM "
                     "server needs a restart: %s", drafter_id, export_dir, rd.root, restart)
    finally:
        tr.close()
    drop_checkpoints(rrd)  # resumable state of a finished round: train/final stays
    record = {"round": n, "records_dir": str(record_dir), "cursor_before": cursor, "cursor_after": win.cursor,
              "lines": win.span, "corrupt": win.corrupt,
              "window": {"rule": cfg.learn.window, "since": start, "earlier_records": len(earlier),
                         "heldout_pool": cfg.learn.heldout_pool, "earlier_heldout_records": len(earlier_held)},
              "samples": {"records": len(win.records), "train_records": len(train_recs),
                          "heldout_records": len(held_recs), "trained": len(trained_ids),
                          "heldout": len(heldout_ids)},
              "ids": {"train": trained_ids, "heldout": heldout_ids}, "tokenize": tok,
              "steps": steps, "steps_rule": how, "budget_minutes": budget_minutes,
              "serving": {"dir": str(serving), "id": serving_id}, "warm_start": str(base_drafter),
              "scores": {"new": new_scores, "serving": old_scores, "sources": sources}, "comparison": cmp,
              "serving_vs_static": vs_static,
              **({"regenerate_arm": arm} if arm is not None else {}),
              "decision": "promote" if promote else "keep", "reason": reason,
              "train": {k: summary.get(k) for k in ("steps", "train", "heldout", "warm_start")},
              "export": export, "profile": profile, "promoted": pointer, "vllm_restart": restart,
              "wall_s": round(time.time() - t0, 2)}
    atomic_write_json(rdir / "round.json", record)
    pooled = [] if promote else sorted(held_since | {str(r["id"]) for r in new_held})
    atomic_write_json(rd.learn_dir / "cursor.json", {"records_dir": str(record_dir), "segments": win.cursor,
                                                      "since_promotion": win.cursor if promote else base,
                                                      "heldout_since_promotion": pooled, "round": n})
    log.info("round %d: %d records (%d held out), τ new %s vs serving %s, gain %s, 90%% %s → %s", n,
             len(win.records), len(held_recs), cmp["tau_new"], cmp["tau_serving"], cmp["gain"], cmp["interval90"],
             record["decision"])
    return record


def resume_point(rd: RunDir, records: str | Path) -> tuple[int, list[dict[str, Any]]]:
    """(the rounds already learned, the flywheel's rows for them: `learn/flywheel.json`): where a flywheel run goes
    on. Records past the learn cursor that no round learned from (a flywheel stopped between its replay and its
    round) are refused (exit 2): replaying on top of them would learn from both."""
    start = _round_no(rd) - 1
    if start and read_window(records, read_cursor(rd), expected=None).records:
        raise UsageError(f"{records}: records past the learn cursor that no round learned from (a flywheel "
                         "stopped between its replay and its round)", hint=f"dflashkit learn -c <this config> "
                         f"--records {records}, then run the flywheel again")
    earlier = read_json_or_none(rd.flywheel_results, log) or {}
    return start, list(earlier.get("rounds", []))[:start]


def rounds_table(rd: RunDir) -> list[dict[str, Any]]:
    """Every round's headline, oldest first (the flywheel's curve: `learn/rounds/*/round.json`)."""
    rows = []
    for p in sorted((rd.learn_dir / "rounds").glob("*/round.json")):
        r = json.loads(p.read_text())
        vs = r.get("serving_vs_static") or {}
        rows.append({"round": r["round"], "records": r["samples"]["records"], **r["comparison"],
                     "decision": r["decision"], "serving": r["serving"]["id"],
                     "tau_static": vs.get("tau_serving", r["comparison"]["tau_serving"]),
                     "serving_vs_static": vs.get("gain", 0.0), "serving_vs_static_interval90": vs.get("interval90"),
                     "serving_vs_static_by_source": {k: {"gain": v["gain"], "interval90": v["interval90"],
                                                         "samples": v["samples"]}
                                                     for k, v in (vs.get("by_source") or {}).items()}})
    return rows
