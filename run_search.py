"""Search GRPO rounds with Optuna under a wall-clock budget and promote the best merged model into the submission.

    python run_search.py --hours 7.5                  # the box: budget.yaml, study.db, /app/submission
    python run_search.py --simulate                   # rehearse the schedule on a virtual clock: no model, data, GPU
    python run_search.py --demo                       # the whole loop on a tiny model and a synthetic box, minutes
    python run_search.py leaderboard                  # print the study's leaderboard
    python run_search.py merge                        # the merge stage on the study's kept rounds, now
    python run_search.py check                        # before the search: does a real round fit and train here?
    tail -f search.log                                # every line the search prints, with its time (next to the study)
    optuna-dashboard study.db --artifact-dir artifacts

Bad input (command line, budget file, box, storage) is reported on one line with exit code 2, before any model is
loaded and before anything is written (search.run).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from search.run import Request, run
from search.study import redact
from common.validation import one_line

PROG = "run_search.py"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit code 2, like every other bad input
        self.exit(2, f"{self.prog}: error: {redact(one_line(message))}\n")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    request = Request(
        leaderboard=args.command == "leaderboard",
        merge=args.command == "merge",
        check=args.command == "check",
        budget=args.budget,
        hours=args.hours,
        storage=args.storage,
        study_name=args.study_name,
        simulate=args.simulate,
        demo=args.demo,
    )
    return run(request, prog=PROG)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("command", nargs="?", choices=["leaderboard", "merge", "check"],
                        help="leaderboard: print it and exit; merge: run the merge stage on the study's kept rounds "
                             "(budget.yaml's merge options, even when the stage is off there), then exit; check: a "
                             "preflight of the box (a real 2-step round of the heaviest configuration on each slot, "
                             "scored on a few rows, the disk, the rounds the budget holds), then exit")  # fmt: skip
    parser.add_argument("--hours", help="wall-clock budget in hours (default: the budget file's)")
    parser.add_argument("--budget", type=Path, help="budget file (default: budget.yaml; demo_budget.yaml with --demo)")
    parser.add_argument("--storage", help="study storage: a journal file path or an SQLAlchemy URL")
    parser.add_argument("--study-name", help="study name (an existing study is resumed, keeping its deadline)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--simulate", action="store_true", help="virtual clock and simulated rounds: no model, data or GPU")
    mode.add_argument("--demo", action="store_true", help="build a tiny model and synthetic box under ./built and search")
    return parser


if __name__ == "__main__":
    sys.exit(main())
