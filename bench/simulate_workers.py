"""Two `run_search.py --simulate` workers started together on one Journal study, several times: both must exit 0, the
trial numbers be unique and gap-free, no trial be left RUNNING or WAITING, and every warm start have run exactly
once (round 0, which scores the base model, too). One JSON line per run, and a summary line.

    python bench/simulate_workers.py --runs 10 --out bench/results/<date>-simulate-two-workers.jsonl

Each worker has its own virtual clock (a 7.5-hour study in seconds), so the two run their schedules at different
paces against the same study: the case where a worker whose clock runs ahead used to fail the other's live trials as
orphans and crash it (`UpdateFinishedTrialError`). tests/test_simulate.py runs one of these runs.

Measured (2 CPU cores, budget.yaml, 7.5 h; bench/results/2026-12-04-simulate-two-workers.jsonl): ten runs, all
checks held in each, 70 to 97 trials a run, 33 to 51 rounds a worker, no trial failed as an orphan; 10 to 15 s a run.
Before the heartbeat was judged by whether it moves (commit 7d7999c), 4 runs of 4 crashed one worker.
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import optuna  # noqa: E402
import yaml  # noqa: E402
from optuna.trial import TrialState  # noqa: E402

from search.study import open_storage  # noqa: E402

WORKERS = 2
STUDY = "shared"


def run_once(folder: Path, *, hours: float = 7.5, timeout_s: float = 600) -> dict:
    """Start the workers together on folder/study.db; wait; check and describe the study they leave."""
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(ROOT / "run_search.py"), "--simulate", "--hours", str(hours),
               "--storage", str(folder / "study.db"), "--study-name", STUDY]  # fmt: skip
    started = time.monotonic()
    procs = [subprocess.Popen(command, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(WORKERS)]  # fmt: skip
    outputs = [p.communicate(timeout=timeout_s) for p in procs]
    seconds = time.monotonic() - started
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=STUDY, storage=open_storage(str(folder / "study.db"), create=False))
    trials = study.trials
    numbers = [t.number for t in trials]
    recipes = collections.Counter(t.user_attrs.get("recipe") for t in trials)
    # Round 0 (the base model scored) is queued like a warm start: it too runs once, on whichever worker asks first.
    warm_starts = ["base"] + [w["name"] for w in yaml.safe_load((ROOT / "budget.yaml").read_text())["warm_starts"]]
    ran_once = {name: sum(t.user_attrs.get("recipe") == name and "started_at" in t.user_attrs for t in trials) == 1
                for name in warm_starts}  # fmt: skip
    stderr = "".join(err for _, err in outputs)
    stdout = "".join(out for out, _ in outputs)
    checks = {
        "both_exit_0": all(p.returncode == 0 for p in procs),
        "trial_numbers_unique": numbers == list(range(len(trials))),
        "nothing_running": not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)],
        "every_warm_start_ran_once": all(ran_once.values()) and all(recipes[name] == 1 for name in warm_starts),
        "no_traceback": "Traceback" not in stderr,
    }
    return {
        "ok": all(checks.values()),
        **checks,
        "exit_codes": [p.returncode for p in procs],
        "trials": len(trials),
        "states": dict(collections.Counter(t.state.name for t in trials)),
        "rounds_per_worker": sorted(collections.Counter(t.user_attrs["worker"].split(":")[1] for t in trials
                                                        if "started_at" in t.user_attrs).values()),  # fmt: skip
        "orphaned": sum((t.user_attrs.get("reason") or "").startswith("orphaned") for t in trials),
        "rounds_ended_by_another_worker": stdout.count("another worker finished its trial"),
        "seconds": round(seconds, 1),
        "stderr_tail": stderr[-2000:] if not checks["both_exit_0"] or not checks["no_traceback"] else "",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="runs of two workers (default 10)")
    parser.add_argument("--hours", type=float, default=7.5, help="the simulated budget of each run (default 7.5)")
    parser.add_argument("--out", type=Path, help="append one JSON line per run, and the summary, to this file")
    parser.add_argument("--work", type=Path, help="folder of the runs' studies (default: a temporary folder)")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="simulate-workers-"))
    results = []
    for i in range(args.runs):
        result = {"run": i, **run_once(work / f"run-{i:02d}", hours=args.hours)}
        results.append(result)
        print(json.dumps(result), flush=True)
    summary = {"summary": True, "runs": len(results), "all_ok": all(r["ok"] for r in results),
               "failed_runs": [r["run"] for r in results if not r["ok"]],
               "trials": [r["trials"] for r in results], "orphaned": sum(r["orphaned"] for r in results)}  # fmt: skip
    print(json.dumps(summary), flush=True)
    if args.out:
        with args.out.open("a") as f:
            for line in [*results, summary]:
                f.write(json.dumps(line) + "\n")
    return 0 if summary["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
