"""What a promotion's check costs with the real 2B architecture (random weights): the seconds of
`search.verification.verify` (a fresh process loading the model as the verifier does, then 50 recorded ood_val rows
generated again), against the load check alone, on the GPU a finished round leaves free.

    python bench/verify_cost.py --work built/verify-cost --out bench/results/<date>-h200-verify.json

Random weights never stop before the 256-token cap, so the generation part is an upper bound: a trained model
answers in about 10 tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=ROOT / "built" / "verify-cost")
    parser.add_argument("--rows", type=int, default=50)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    import torch

    from evaluator.evaluation import evaluate
    from search.verification import expected_answers, verify
    from synthetic.models import build_model
    from synthetic.splits import write_split

    model, split = args.work / "model-2b", args.work / "ood"
    if not (model / "config.json").is_file():
        build_model(model, size="2b", seed=0)
    if not split.is_dir():
        write_split(split, "other", args.rows, seed=0, image_size=(480, 320), count_range=(1, 10))
    began = time.perf_counter()
    report = evaluate(model, split, batch_size=64, static_cache=True)  # as a round is scored on the box
    record_s = time.perf_counter() - began
    expected = expected_answers(report["per_row"], rows=args.rows)
    gpus = [0] if torch.cuda.is_available() else []
    began = time.perf_counter()
    load_only = verify(model, gpus=gpus)
    load_s = time.perf_counter() - began
    began = time.perf_counter()
    checked = verify(model, split, expected, gpus=gpus, batch_size=64)
    check_s = time.perf_counter() - began
    result = {
        "machine": torch.cuda.get_device_name() if gpus else "cpu",
        "rows": args.rows,
        "record_s": round(record_s, 1),
        "verify_load_only_s": round(load_s, 1),
        "verify_s": round(check_s, 1),
        "differ": checked["differ"],
        "mean_completion_tokens": report["mean_completion_tokens"],
        "torch": torch.__version__,
    }
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if load_only["rows"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
