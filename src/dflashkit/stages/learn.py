"""`dflashkit learn`: fine-tune the serving drafter on the traffic it served; promote it only when it scores better.

Inputs:  the record dir (`--records DIR`, learn.records: JSONL segments written by `serve` with recording on or
         by `dflashkit record`), contract.json (probe), the serving drafter (the last promoted one, else
         learn.drafter, else train/best or train/final), the target.
Outputs: `<run_dir>/learn/rounds/NNN/` per round (round.json: cursor range, sample ids, steps, both drafters'
         held-out scores, the paired interval, the decision; tokenize/, train/, export/ + its
         speculation_profile.json when promoted; with learn.compare_regenerate, `regenerate_arm` and regenerate/:
         the same prompts regenerated offline at equal CPU, `flywheel/regenerate.py`), `learn/cursor.json`,
         `learn/promoted.json` (the pointer `dflashkit serve` watches).
Example: dflashkit learn -c run.yaml --records runs/x/records --budget 10
         dflashkit learn -c run.yaml --records runs/x/records --rounds 5 --every 30

One round reads the records since the cursor, holds out the newest (never trained on), fine-tunes the serving
drafter for the steps the budget affords and promotes it when the paired held-out τ interval says it is better
(`dflashkit.flywheel.rounds`; docs/flywheel.md). Exit codes: 2 for traffic of another target or tokenizer (the
file and line are named), for an empty window on a single round (`--rounds 1` without `--every`; in a loop an
empty window waits for the next round), and for a corrupt record with learn.on_corrupt=fail; 3 without a
contract or a drafter to start from. Nothing in the record dir is written.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from dflashkit.config import RunConfig
from dflashkit.context import StageContext
from dflashkit.errors import MissingArtifactError, UsageError
from dflashkit.flywheel.regenerate import arm_line, arm_row
from dflashkit.flywheel.rounds import EmptyWindow, learn_round, rounds_table
from dflashkit.flywheel.traffic import read_window, run_fingerprint
from dflashkit.flywheel.rounds import read_cursor, serving_drafter
from dflashkit.rundir import RunDir
from dflashkit.sizing.calibration import saved_calibration

log = logging.getLogger("dflashkit.learn")


def run(cfg: RunConfig, rd: RunDir, ctx: StageContext) -> dict[str, Any]:
    lc = cfg.learn
    records = ctx.positionals[0] if ctx.positionals else lc.records
    if not records:
        raise UsageError("`dflashkit learn` needs a record dir", hint="pass --records DIR (or set learn.records)")
    if lc.rounds < 1:
        raise UsageError(f"learn.rounds must be >= 1, got {lc.rounds}")
    if ctx.dry_run:  # the checks of a round (`learn_round`), in its order, without its work
        if not rd.contract_path.is_file():
            raise MissingArtifactError("the drafter contract", rd.contract_path, run="dflashkit probe -c run.yaml")
        win = read_window(records, read_cursor(rd), expected=run_fingerprint(cfg), on_corrupt=lc.on_corrupt)
        serving, serving_id = serving_drafter(cfg, rd)
        return {"dry_run": True, "records": records, "new_records": len(win.records), "corrupt": len(win.corrupt),
                "serving_drafter": str(serving), "serving_id": serving_id}
    budget = cfg.run.budget_minutes
    cal = saved_calibration(cfg, rd) if budget is not None else None
    done: list[dict[str, Any]] = []
    waited = 0
    for i in range(lc.rounds):
        start = time.time()
        try:
            rec = learn_round(cfg, rd, records, budget_minutes=budget, calibration=cal, show_bar=not ctx.json)
            done.append({k: rec[k] for k in ("round", "decision", "reason", "comparison", "export", "promoted")})
            if "regenerate_arm" in rec:
                done[-1]["regenerate_arm"] = arm_row(rec["regenerate_arm"])
        except EmptyWindow as e:
            if lc.every_minutes is None and not done:
                raise
            if lc.every_minutes is None:
                log.info("%s; stopping after %d rounds", e.message, len(done))
                break
            log.info("%s; waiting for the next round", e.message)
            waited += 1
        if lc.every_minutes is not None and i + 1 < lc.rounds:
            time.sleep(max(0.0, lc.every_minutes * 60 - (time.time() - start)))
    table = rounds_table(rd)
    if not ctx.json:
        for r in table:
            print(f"round {r['round']:>3}  {r['records']:>5} records  τ new {r['tau_new']}  serving {r['tau_serving']}  "
                  f"gain {r['gain']} (90% {r['interval90']})  {r['decision']}")
        for d in done:
            if d.get("regenerate_arm"):
                print(f"round {d['round']:>3}  {arm_line(d['regenerate_arm'])}")
    return {"rounds": done, "empty_windows": waited, "history": table}
