"""Kill a search at a random moment, run the same command again, and check that nothing is lost: the loop of issue 34.

    python bench/kill_loop.py --runs 30 --work /tmp/kill-loop --out bench/results/DATE-cpu-kill-loop.jsonl

Each run is `run_search.py --simulate --hours 168` on one journal file shared by every run (its own study name),
sent SIGINT, SIGTERM or SIGKILL (seeded choice) after a seeded random delay, then the same command again, let run to
its end. Recorded per run: the signal, when, the exit code of each command, whether either printed a traceback, the
RUNNING trials left after the second (plain Optuna reading the journal), and whether plain Optuna reads the journal
at all after each command.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)


def command(journal: Path, name: str, hours: float) -> list[str]:
    return [sys.executable, str(ROOT / "run_search.py"), "--simulate", "--hours", str(hours), "--storage",
            str(journal), "--study-name", name]  # fmt: skip


def journal_state(journal: Path, name: str) -> dict:
    """What plain Optuna reads of the journal: readable, and the study's RUNNING trials."""
    import optuna
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    try:
        storage = JournalStorage(JournalFileBackend(str(journal)))
        study = optuna.load_study(study_name=name, storage=storage)
        running = len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)))
        return {"readable": True, "trials": len(study.trials), "running": running}
    except KeyError:
        return {"readable": True, "trials": 0, "running": 0}  # killed before the study was created
    except Exception as error:  # noqa: BLE001 - the figure is whether it reads at all
        return {"readable": False, "error": f"{type(error).__name__}: {error}"[:300]}


def one_run(journal: Path, index: int, rng: random.Random, max_delay: float, hours: float, timeout: float) -> dict:
    name = f"kill-{index:03d}"
    chosen, delay = rng.choice(SIGNALS), rng.uniform(0.5, max_delay)
    # Its output goes to files, not pipes: nobody reads a pipe until the kill, and a search that filled one would
    # block on its next line, so every later signal would find it there.
    out_path, err_path = journal.parent / f"{name}.first.out", journal.parent / f"{name}.first.err"
    with out_path.open("w") as out_file, err_path.open("w") as err_file:
        first = subprocess.Popen(command(journal, name, hours), cwd=journal.parent, stdout=out_file, stderr=err_file)
        time.sleep(delay)
        first.send_signal(chosen)
        first.wait(timeout=timeout)
    out1, err1 = out_path.read_text(errors="replace"), err_path.read_text(errors="replace")
    after_kill = journal_state(journal, name)
    began = time.monotonic()
    second = subprocess.run(command(journal, name, hours), cwd=journal.parent, capture_output=True, text=True,
                            timeout=timeout)  # fmt: skip
    return {
        "run": index, "signal": signal.Signals(chosen).name, "after_s": round(delay, 2),
        "first_rc": first.returncode, "first_traceback": "Traceback" in out1 + err1,
        "first_stderr_tail": err1.strip().splitlines()[-1:] if err1.strip() else [],
        "after_kill": after_kill,
        "second_rc": second.returncode, "second_s": round(time.monotonic() - began, 1),
        "second_traceback": "Traceback" in second.stdout + second.stderr,
        "second_stderr_tail": second.stderr.strip().splitlines()[-2:],
        "after_rerun": journal_state(journal, name),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--hours", type=float, default=168)
    parser.add_argument("--max-delay", type=float, default=20.0, help="the signal's latest second after the start")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds a command may take")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    journal = args.work / "study.db"
    rng = random.Random(args.seed)
    results = []
    for index in range(args.runs):
        result = one_run(journal, index, rng, args.max_delay, args.hours, args.timeout)
        results.append(result)
        print(json.dumps(result), flush=True)
        if args.out:
            with args.out.open("a") as handle:
                handle.write(json.dumps(result) + "\n")
    clean = [r for r in results if not r["first_traceback"] and not r["second_traceback"] and r["second_rc"] == 0
             and r["after_rerun"].get("readable") and r["after_rerun"].get("running") == 0
             and r["after_kill"].get("readable")]  # fmt: skip
    codes = sorted({(r["signal"], r["first_rc"]) for r in results})
    print(f"{len(clean)} of {len(results)} runs clean; (signal, exit code) seen: {codes}")
    return 0 if len(clean) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
