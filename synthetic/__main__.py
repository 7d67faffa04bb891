"""Build stand-ins for the box's data and model.

    python -m synthetic data OUT_DIR [--seed S] [--train N --val N --ood-val N --test N]
                                     [--image-size WxH] [--count-range LO-HI]
    python -m synthetic model OUT_DIR [--size tiny|small|counting|2b] [--seed S]
    python -m synthetic teach OUT_DIR [--seed S] [--steps N]    # the demo's SFT-taught counting model (synthetic.teach)

Bad arguments exit with status 2 and a message naming the problem.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

_IMAGE_SIZE = re.compile(r"^(\d+)[xX](\d+)$")
_COUNT_RANGE = re.compile(r"^(\d+)-(\d+)$")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _image_size(text: str) -> tuple[int, int]:
    match = _IMAGE_SIZE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT such as 480x320, got {text!r}")
    return int(match.group(1)), int(match.group(2))


def _count_range(text: str) -> tuple[int, int]:
    match = _COUNT_RANGE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"expected LOW-HIGH such as 1-10, got {text!r}")
    return int(match.group(1)), int(match.group(2))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m synthetic", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    data = commands.add_parser("data", help="render train/ val/ ood_val/ test_compositional/ test_other/")
    data.add_argument("out_dir", type=Path)
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--train", type=_positive_int, help="rows in train/ (default 2000)")
    data.add_argument("--val", type=_positive_int, help="rows in val/ (default 200)")
    data.add_argument("--ood-val", type=_positive_int, help="rows in ood_val/ (default 200)")
    data.add_argument("--test", type=_positive_int, help="rows in each of the two test folders (default 500)")
    data.add_argument("--image-size", type=_image_size, default=(480, 320), metavar="WxH")
    data.add_argument("--count-range", type=_count_range, default=(1, 10), metavar="LO-HI")

    model = commands.add_parser("model", help="write a random-weight Qwen2-VL folder")
    model.add_argument("out_dir", type=Path)
    model.add_argument("--size", default="tiny", help="tiny | small | 2b (synthetic.models.SIZES)")
    model.add_argument("--seed", type=int, default=0)

    teach = commands.add_parser("teach", help="build the counting model taught by SFT (reused when built)")
    teach.add_argument("out_dir", type=Path)
    teach.add_argument("--seed", type=int, default=0)
    teach.add_argument("--steps", type=_positive_int, help="SFT steps (default: synthetic.teach.DEMO_RECIPE's)")
    return parser


def _write_data(args: argparse.Namespace) -> None:
    from synthetic.splits import write_box  # imports datasets: only when data is asked for

    asked = {
        "train": args.train,
        "val": args.val,
        "ood_val": args.ood_val,
        "test_compositional": args.test,
        "test_other": args.test,
    }
    sizes = {folder: n for folder, n in asked.items() if n is not None}
    paths = write_box(args.out_dir, sizes, args.seed, args.image_size, args.count_range)
    for folder, path in paths.items():
        print(f"{folder}: {path}")


def _write_model(args: argparse.Namespace) -> None:
    from synthetic.models import build_model  # imports torch and transformers: only when a model is asked for

    print(build_model(args.out_dir, size=args.size, seed=args.seed))


def _write_taught(args: argparse.Namespace) -> None:
    import dataclasses

    from synthetic.teach import DEMO_RECIPE, build_counting_model  # imports torch and transformers

    recipe = DEMO_RECIPE if args.steps is None else dataclasses.replace(DEMO_RECIPE, steps=args.steps)
    print(build_counting_model(args.out_dir, seed=args.seed, recipe=recipe))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    write = {"data": _write_data, "model": _write_model, "teach": _write_taught}[args.command]
    try:
        write(args)
    except (ValueError, FileExistsError) as error:  # the writers' argument checks (sizes, size names, folders)
        parser.error(str(error))
    return 0


if __name__ == "__main__":
    sys.exit(main())
