"""`python -m evaluator MODEL_DIR DATA_DIR [DATA_DIR ...] [--limit N|all ...] [--seed S] [--batch-size B]
[--out REPORT ...] [--wait-for-input]`.

Scores the model on each split, all of them from one load of the model (`evaluation.evaluate_splits`). Prints a
one-line summary per split and writes each split's JSON report with --out. Bad input (a missing or malformed split,
a folder that is not a Qwen2-VL model, a count of --limit or --out values that does not match the splits) is an error
message on stderr and exit code 2, before any weights are loaded.

With --wait-for-input the process can be started before its model exists: it imports its libraries and reads the
splits, prints `READY_LINE` on stderr, and waits for a line on its standard input before it reads the model folder.
The search starts each round's evaluator this way while the round trains, so that its imports are done by the time the
model is. Standard input ending without a line: exit code 3, nothing scored.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import datasets
import transformers

from evaluator.data import DataError
from evaluator.evaluation import DEFAULT_CPU_BATCH_SIZE, DEFAULT_GPU_BATCH_SIZE, ModelError, Split, evaluate_splits
from common.process_exit import exit_now

EXIT_BAD_INPUT = 2
EXIT_NOT_ASKED = 3
READY_LINE = "evaluator: the splits are read; waiting for a line on standard input to load the model"


class NotAsked(Exception):
    """Standard input ended before the line that starts the evaluation (--wait-for-input)."""


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    splits = len(args.data_dirs)
    if args.limit is not None and len(args.limit) not in (1, splits):
        parser.error(f"--limit: one value, or one per split ({splits}), got {len(args.limit)}")
    if args.out is not None and len(args.out) != splits:
        parser.error(f"--out: one path per split ({splits}), got {len(args.out)}")
    limits = args.limit if args.limit is not None and len(args.limit) == splits else (args.limit or [None]) * splits
    # Keep the output to the summary lines.
    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    try:
        reports = evaluate_splits(
            args.model_dir,
            [Split(data, limit, args.seed) for data, limit in zip(args.data_dirs, limits)],
            batch_size=args.batch_size,
            static_cache=not args.dynamic_cache,
            repeated_kv_cache=args.repeated_kv_cache,
            batched_vision_attention=args.batched_vision_attention,
            folded_gqa_attention=args.folded_gqa_attention,
            wait_for_model=_wait_for_a_line if args.wait_for_input else None,
            gpu_memory_gb=args.gpu_memory_gb,
        )
    except (DataError, ModelError) as error:
        print(f"evaluator: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except NotAsked:
        print("evaluator: standard input ended before a line asked for the evaluation; nothing scored", file=sys.stderr)
        return EXIT_NOT_ASKED
    for report, out in zip(reports, args.out or [None] * splits):
        if out is not None:
            write_report(report, out)
        print(summary(report) if splits == 1 else f"{report['data']}: {summary(report)}")
    return 0


def _wait_for_a_line() -> None:
    print(READY_LINE, file=sys.stderr, flush=True)
    if not sys.stdin.readline():
        raise NotAsked


def summary(report: dict[str, Any]) -> str:
    return (
        f"accuracy {report['accuracy_pct']:.2f}% ({report['correct']}/{report['n']}), "
        f"format {report['format_rate']:.2f}%, {report['examples_per_s']:.2f} examples/s, "
        f"{report['seconds']:.1f} s on {', '.join(report['devices'])}"
    )


def write_report(report: dict[str, Any], path: Path) -> None:
    """Written to a temporary name, then renamed, so a reader never sees half a report."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    os.replace(partial, path)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _positive_number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def _limit(text: str) -> int | None:
    """A positive number of rows, or `all` (None)."""
    if text == "all":
        return None
    if not text.lstrip("-").isdigit():
        raise argparse.ArgumentTypeError(f"must be a positive integer or 'all', got {text!r}")
    return _positive_int(text)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m evaluator",
        description="Score a Qwen2-VL model on one counting split or several with the verifier's exact protocol.",
    )
    parser.add_argument("model_dir", type=Path, help="save_pretrained folder of a Qwen2-VL model and its processor")
    parser.add_argument("data_dirs", type=Path, nargs="+", metavar="data_dir",
                        help="split folder: save_to_disk output, or parquet/arrow files; several are scored from "
                        "one load of the model, each with its own report")  # fmt: skip
    parser.add_argument("--limit", type=_limit, nargs="+", metavar="N",
                        help="score only this many rows of each split: one value for every split or one per split; "
                        "'all' for every row (default: all)")  # fmt: skip
    parser.add_argument("--seed", type=int, help="with --limit: a seeded random subset instead of the first rows")
    parser.add_argument(
        "--batch-size",
        type=_positive_int,
        help=f"rows per generate call on each device (default {DEFAULT_GPU_BATCH_SIZE} on a GPU, "
        f"{DEFAULT_CPU_BATCH_SIZE} on a CPU)",
    )
    parser.add_argument(
        "--dynamic-cache",
        action="store_true",
        help="on a GPU, decode with the dynamic KV cache instead of the static one with a compiled decode step "
        "(which compiles for about a minute in a fresh machine, inductor's disk cache shortening later runs)",
    )
    parser.add_argument(
        "--repeated-kv-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with the static cache, store each key/value head once per query head so that decode steps read the "
        "cache in place instead of copying it; attention gets the same inputs (default: on; not with "
        "--folded-gqa-attention)",
    )
    parser.add_argument(
        "--batched-vision-attention",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="the vision tower attends to all the images of a batch in one call instead of once per image and layer "
        "(default: off, the verifier's per-image path)",
    )
    parser.add_argument(
        "--folded-gqa-attention",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="the language model's query heads attend as rows of their shared key/value head instead of over a "
        "copy of the cache per query head (default: off, transformers' sdpa as the verifier runs it)",
    )
    parser.add_argument("--gpu-memory-gb", type=_positive_number, metavar="GB",
                        help="cap each GPU's memory for this process to GB (10^9 bytes), so that a larger card "
                        "rehearses a smaller one (default: the whole card)")  # fmt: skip
    parser.add_argument("--out", type=Path, nargs="+", metavar="REPORT",
                        help="write each split's JSON report here: one path per split, in their order")  # fmt: skip
    parser.add_argument("--wait-for-input", action="store_true",
                        help="read the splits, then wait for a line on standard input before reading the model "
                        "folder, which may not exist until then (exit code 3 if the input ends first)")  # fmt: skip
    return parser


if __name__ == "__main__":
    exit_now(main())
