"""`dflashkit flywheel`: the flywheel demo — serve, record, learn, swap, round after round, and the curve it makes.

Inputs:  a trained run (contract.json, the drafter to start from: learn.drafter, else train/best or train/final),
         learn.traffic (prepared JSONL files replayed as traffic, interleaved), the target.
Outputs: `<run_dir>/learn/records/` (what `serve` recorded), every round of `dflashkit learn`
         (`learn/rounds/NNN/`), `learn/flywheel.json`: per round, τ on that round's traffic as the server
         measured it while serving (the drafter then serving), the candidate against the serving drafter on the
         round's newest traffic (the held-out slice, the promotion rule), and the serving drafter against the
         static one on all of the round's traffic (which neither trained on), with paired intervals; with learn.compare_regenerate, the
         round's candidate against the regenerate arm (the same prompts regenerated offline at equal CPU,
         `flywheel/regenerate.py`), printed under the round.
Example: dflashkit flywheel -c configs/flywheel-smollm2.yaml --budget 60      (docs/flywheel.md)

One process serves the target on 127.0.0.1 (`serve_app.build_app`, recording on, watching the promotion
pointer), replays learn.round_requests conversations with learn.replay_concurrency clients, runs a learn round on
what was recorded (`flywheel.rounds.learn_round`, its budget `--budget` / learn.rounds minutes), waits until the
server reports the promoted drafter, and goes on with the next requests. A replayed request that fails fails the
command (exit 4) after the rounds, with the count.

learn.rounds is the total: run again, the command goes on after the rounds already learned (`learn/rounds/`),
serving the drafter they promoted and replaying the traffic they did not, so a stopped flywheel resumes with the
same command and a longer one needs only a larger learn.rounds. Records that no round learned from (a flywheel
stopped between its replay and its round) are refused (exit 2): `dflashkit learn` learns from them first.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

from dflashkit.config import RunConfig
from dflashkit.context import StageContext
from dflashkit.errors import MissingArtifactError, PartialFailure, UsageError
from dflashkit.flywheel.pointer import pointer_path, read_promoted
from dflashkit.flywheel.replay import interleaved, live_tau, read_conversations, replay
from dflashkit.flywheel.regenerate import arm_line, arm_row
from dflashkit.flywheel.rounds import EmptyWindow, learn_round, resume_point, rounds_table, static_drafter
from dflashkit.rundir import RunDir, atomic_write_json
from dflashkit.serve_app import build_app
from dflashkit.serving.server import serve_in_thread
from dflashkit.sizing.calibration import saved_calibration

log = logging.getLogger("dflashkit.learn")


def run(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict[str, Any]:
    lc = cfg.learn
    if not lc.traffic:
        raise UsageError("`dflashkit flywheel` needs traffic to replay", hint="set learn.traffic to prepared JSONL "
                         "files (docs/flywheel.md: `dflashkit prepare` of the traffic config)")
    for i, path in enumerate(lc.traffic):
        if not Path(path).is_file():
            raise MissingArtifactError(f"learn.traffic[{i}], a prepared conversations file (JSONL) replayed as traffic",
                                       path, run="dflashkit prepare -c <the traffic's config> (the demo's: "
                                       "configs/flywheel-smollm2.yaml, docs/flywheel.md) and point learn.traffic at "
                                       "its prepare/train.jsonl")
    convs = interleaved([read_conversations(p) for p in lc.traffic])
    static, _ = static_drafter(cfg, rd)
    records = cfg.serve.record_dir or str(rd.learn_records)
    if ctx.dry_run:
        return {"dry_run": True, "traffic": len(convs), "rounds": lc.rounds, "static_drafter": str(static),
                "records": records}
    scfg = dataclasses.replace(cfg, serve=dataclasses.replace(
        cfg.serve, drafter=str(static), proposer="drafter", record_dir=records, promoted=str(rd.root), port=0,
        host="127.0.0.1"))
    start, rows = resume_point(rd, records)
    prior = len(rows)
    if start >= lc.rounds:  # the server is not even started
        log.info("%d rounds already ran (learn.rounds=%d): nothing to do; a larger learn.rounds goes on", start,
                 lc.rounds)
    else:
        if start:
            log.info("resuming after round %d: %d more rounds", start, lc.rounds - start)
        _serve_rounds(cfg, rd, scfg, convs, records, rows, start)
    table = rounds_table(rd)
    if not ctx.json:
        print("round  served by            live τ   τ on the round's traffic: serving vs static (gain, 90%)   decision")
        for row in rows:
            vs = row.get("serving_vs_static") or {}
            print(f"{row['round']:>5}  {str(row['served_by'])[:20]:<20} {row['live']['tau']!s:>7}   "
                  f"{vs.get('tau_new', (row.get('comparison') or {}).get('tau_serving'))!s:>7} vs "
                  f"{vs.get('tau_serving', (row.get('comparison') or {}).get('tau_serving'))!s:>7} "
                  f"({vs.get('gain', 0.0)}, {vs.get('interval90')})   {row.get('decision', row.get('learn'))}")
            for src, g in (vs.get("by_source") or {}).items():
                print(f"{'':>5}  {'':<20} {'':>7}   {src}: {g['tau_new']} vs {g['tau_serving']} ({g['gain']}, {g['interval90']}, "
                      f"{g['samples']} samples)")
            if row.get("regenerate_arm"):
                print(f"{'':>5}  {'':<20} {'':>7}   {arm_line(row['regenerate_arm'])}")
    failed = sum(row["live"]["failed"] for row in rows[prior:])  # this run's requests
    result = {"rounds": rows, "history": table, "records": records}
    if failed:
        raise PartialFailure(f"{failed} replayed requests failed", result=result)
    return result


def _await_promoted(app: Any, rd: RunDir, timeout_s: float = 120.0) -> None:
    """Wait until the server serves the last promoted drafter (its watcher swaps it in between requests)."""
    promoted = read_promoted(pointer_path(rd.root))
    deadline = time.time() + timeout_s
    while promoted is not None and app.drafter_id != promoted["id"] and time.time() < deadline:
        time.sleep(0.2)


def _serve_rounds(cfg: RunConfig, rd: RunDir, scfg: RunConfig, convs: list[dict[str, Any]], records: str,
                  rows: list[dict[str, Any]], start: int) -> None:
    """Rounds start+1 … learn.rounds: serve (recording), replay a round's traffic, learn, await the swap; each
    round's row is appended to `rows` and written to learn/flywheel.json as it ends."""
    lc = cfg.learn
    budget = cfg.run.budget_minutes / lc.rounds if cfg.run.budget_minutes else None  # a round's share of all rounds
    cal = saved_calibration(cfg, rd) if budget is not None else None
    app = build_app(scfg)
    try:
        with serve_in_thread(app) as url:
            _await_promoted(app, rd)
            for r in range(start, lc.rounds):
                chunk = convs[r * lc.round_requests:(r + 1) * lc.round_requests]
                if not chunk:
                    log.info("the traffic is used up after %d rounds", r)
                    break
                serving = app.drafter_id
                t0 = time.time()
                live = live_tau(replay(url, chunk, max_tokens=lc.replay_max_tokens, concurrency=lc.replay_concurrency))
                row: dict[str, Any] = {"round": r + 1, "served_by": serving, "live": live,
                                       "replay_s": round(time.time() - t0, 1)}
                log.info("round %d: %d requests served by %s, live τ %s (%s)", r + 1, len(chunk), serving,
                         live["tau"], live["by_source"])
                try:
                    rec = learn_round(cfg, rd, records, budget_minutes=budget, calibration=cal)
                    vs = rec["serving_vs_static"]
                    row.update(decision=rec["decision"], comparison=rec["comparison"],
                               serving_vs_static=vs and {k: v for k, v in vs.items() if k != "scores"})
                    if "regenerate_arm" in rec:
                        row["regenerate_arm"] = arm_row(rec["regenerate_arm"])
                except EmptyWindow as e:
                    row["learn"] = e.message
                rows.append(row)
                atomic_write_json(rd.flywheel_results, {"rounds": rows})
                _await_promoted(app, rd)
    finally:
        app.engine.stop()
        if app.recording is not None:
            app.recording.recorder.close()
