"""How long `run_search.py check` takes on a box at the real model's size: the 2B architecture with random weights
(no real weights exist on these machines) and a synthetic box of CLEVR-sized images (480 x 320), checked with
budget.yaml's space and settings, the box's paths put in, every visible GPU, each capped to `--cap-gb`.

    python bench/check_time.py --work /tmp/check-time --cap-gb 48 --out bench/results/DATE-h100-check-time.json

Writes the seconds to build the box, the check's exit code, its seconds and its table. `--size tiny` builds the small
architecture instead, to rehearse the script on a CPU (slow there: the space's heaviest round samples 32 completions
of 256 tokens a step).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Rows per folder: val and ood_val as large as budget.yaml's `val_rows` asks, the rest a few.
BOX_SIZES = {"train": 64, "val": 500, "ood_val": 500, "test_compositional": 8, "test_other": 8}


def box_budget(budget_text: str, work: Path, cap_gb: float | None) -> str:
    """budget.yaml's text with the box under `work`: its model, data, submission, runs and study, every visible GPU,
    and the cap."""
    from bench.search_vs_baseline import with_top_level_keys

    values = {
        "model_path": work / "model", "train_path": work / "data" / "train", "val_path": work / "data" / "val",
        "ood_val_path": work / "data" / "ood_val", "submission_path": work / "submission", "runs_dir": work / "runs",
        "storage": work / "study.db", "gpus": "auto", "gpu_memory_gb": "null" if cap_gb is None else cap_gb,
    }  # fmt: skip
    return with_top_level_keys(budget_text, values, "budget.yaml")


def build_box(work: Path, size: str) -> float:
    """The model and the data under `work` (kept when already built); the seconds it took."""
    from synthetic.models import build_model
    from synthetic.splits import write_box

    began = time.perf_counter()
    if not (work / "model" / "config.json").is_file():
        build_model(work / "model", size=size, seed=0)
    if not (work / "data").is_dir():
        write_box(work / "data", BOX_SIZES, seed=0)
    return round(time.perf_counter() - began, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--size", default="2b", help="the architecture: 2b (the real model's) or tiny")
    parser.add_argument("--cap-gb", type=float, default=48.0, help="gpu_memory_gb of the check (0: each card's own)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    figures = {"size": args.size, "cap_gb": args.cap_gb or None, "build_s": build_box(args.work, args.size)}
    budget = args.work / "budget.yaml"
    budget.write_text(box_budget((ROOT / "budget.yaml").read_text(), args.work, args.cap_gb or None))
    began = time.perf_counter()
    check = subprocess.run([sys.executable, str(ROOT / "run_search.py"), "check", "--budget", str(budget)],
                           capture_output=True, text=True, cwd=args.work)  # fmt: skip
    figures.update(check_rc=check.returncode, check_s=round(time.perf_counter() - began, 1),
                   table=check.stdout.strip().splitlines()[-12:], stderr_tail=check.stderr.strip().splitlines()[-5:])
    text = json.dumps(figures, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
