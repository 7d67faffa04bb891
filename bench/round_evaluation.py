"""A round's evaluation (all of OOD, then the val health check) as the search runs it, one `python -m evaluator`
process scoring both splits, against one process per split: the wall seconds of each way and whether they answer
the same.

    python bench/round_evaluation.py MODEL OOD_DIR VAL_DIR [--val-rows 500] [--batch-size B] [--repeats 2] > out.json

Every run is a fresh process, timed from outside from its start to its end. One run scoring both splits comes first
and is not counted: it fills the page cache and, on a GPU, inductor's cache (in a temporary folder shared by every
run), as an earlier round of the search has. Then the ways alternate, `--repeats` runs each. `saved_s`: the
mean seconds of the separate processes less those of the one; `together_speedup`: their ratio.
`rows_with_other_answers`: rows whose extracted answer differs between the ways (scored together, a batch may hold
rows of both splits).

The third way, `ahead`, is the one process as the search starts it: beside the trainer, with --wait-for-input, so
it has imported its libraries and read the splits by the time the model is saved. It is timed from the line that
tells it to go to its end; `ahead_saved_s` is what that takes off the one process started after training.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.search_vs_baseline import machine  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("ood_dir", type=Path)
    parser.add_argument("val_dir", type=Path)
    parser.add_argument("--val-rows", type=int, default=500, help="val rows scored (budget.yaml's val_rows)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the val subset (budget.yaml's seed)")
    parser.add_argument("--batch-size", type=int, help="the evaluator's --batch-size (default: its own)")
    parser.add_argument("--repeats", type=int, default=2, help="counted runs of each way")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.val_rows < 1:
        parser.error("--repeats and --val-rows must be at least 1")
    figures = measure(args.model_dir, args.ood_dir, args.val_dir, args.val_rows, args.seed, args.batch_size,
                      args.repeats)  # fmt: skip
    command = " ".join(["python", "bench/round_evaluation.py", *sys.argv[1:]])
    print(json.dumps({"command": command, **figures}, indent=1))
    return 0


def measure(model_dir: Path, ood_dir: Path, val_dir: Path, val_rows: int, seed: int, batch_size: int | None,
            repeats: int) -> dict[str, Any]:  # fmt: skip
    import torch

    common = ["--seed", str(seed)] + (["--batch-size", str(batch_size)] if batch_size else [])
    evaluator = [sys.executable, "-m", "evaluator", str(model_dir)]
    with tempfile.TemporaryDirectory() as scratch:
        reports = {name: Path(scratch, f"{name}.json") for name in ("ood", "val")}
        together = [*evaluator, str(ood_dir), str(val_dir), "--limit", "all", str(val_rows),
                    "--out", str(reports["ood"]), str(reports["val"]), *common]  # fmt: skip
        separate = [
            [*evaluator, str(ood_dir), "--out", str(reports["ood"]), *common],
            [*evaluator, str(val_dir), "--limit", str(val_rows), "--out", str(reports["val"]), *common],
        ]
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(Path(scratch, "inductor"))}
        _timed(together, env)  # the warm-up
        ways = {"separate": (_timed, separate), "together": (_timed, [together]),
                "ahead": (_timed_from_go, [[*together, "--wait-for-input"]])}  # fmt: skip
        runs: dict[str, list[list[float]]] = {way: [] for way in ways}
        answers: dict[str, list[Any]] = {}
        for _ in range(repeats):
            for way, (timed, commands) in ways.items():
                runs[way].append([timed(command, env) for command in commands])
                answers[way] = [json.loads(reports[name].read_text())["per_row"]["answer"] for name in ("ood", "val")]
    seconds = {way: statistics.mean(sum(run) for run in way_runs) for way, way_runs in runs.items()}
    ood_answers, val_answers = zip(*answers.values())
    return {
        "machine": machine("cuda" if torch.cuda.is_available() else "cpu"),
        "rows": {"ood": len(ood_answers[0]), "val": len(val_answers[0])},
        "batch_size": batch_size,
        "repeats": repeats,
        "runs": runs,  # seconds of each run's processes: [ood, val] separately, [both] together or ahead
        "separate_s": seconds["separate"],
        "together_s": seconds["together"],
        "ahead_s": seconds["ahead"],
        "saved_s": seconds["separate"] - seconds["together"],
        "together_speedup": seconds["separate"] / seconds["together"],
        "ahead_saved_s": seconds["together"] - seconds["ahead"],
        # answers of every way against the separate processes'
        "rows_with_other_answers": sum(a != b for split in (ood_answers, val_answers) for way in split[1:]
                                       for a, b in zip(split[0], way)),  # fmt: skip
    }


def _timed(command: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def _timed_from_go(command: list[str], env: dict[str, str]) -> float:
    """`command` (with --wait-for-input) started and let get ready, then timed from its go line to its end."""
    with tempfile.TemporaryDirectory() as scratch:
        process = start_waiting(command, env, Path(scratch, "stderr.log"))
        start = time.perf_counter()
        process.communicate("go\n")
    if process.returncode != 0:
        raise subprocess.CalledProcessError(process.returncode, command)
    return time.perf_counter() - start


def start_waiting(command: list[str], env: dict[str, str], stderr: Path) -> subprocess.Popen:
    """`command`, an evaluator with --wait-for-input, started with its stderr in the file `stderr` and returned once
    it has written `READY_LINE` there: what a round's evaluator has done by the time its trainer saves the model."""
    from evaluator.__main__ import READY_LINE

    with stderr.open("w") as err:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                   stderr=err, text=True)  # fmt: skip
    while READY_LINE not in stderr.read_text():
        if process.poll() is not None:
            raise subprocess.CalledProcessError(process.returncode, command, stderr=stderr.read_text())
        time.sleep(0.05)
    return process


if __name__ == "__main__":
    sys.exit(main())
