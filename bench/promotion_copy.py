"""What a promotion's copy and flush cost for a model-sized folder, copied against hard-linked (`promotion.link_tree`),
on this machine's disk; the check is left out (bench/verify_cost.py measures it).

    python bench/promotion_copy.py --gb 4.4 --out bench/results/<date>-<machine>-promotion-copy.json

The folder holds random bytes in two shards, like the 2B model's safetensors, written and synced before each
promotion, so the flush measures the promoted files alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from search.promotion import link_tree, promote  # noqa: E402

SHARDS = 2
CHUNK = 4 << 20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=ROOT / "built" / "promotion-copy")
    parser.add_argument("--gb", type=float, default=4.4, help="size of the model folder")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    figures = measure(args.work, args.gb)
    print(json.dumps(figures, indent=2))
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


def measure(work: Path, gb: float) -> dict:
    """Seconds of each part of a promotion (copy, flush) of a `gb` folder, with a copy and with links, and whether the
    submission shares the round's files."""
    shutil.rmtree(work, ignore_errors=True)
    merged = work / "runs" / "round-0001" / "merged"
    merged.mkdir(parents=True)
    (merged / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    chunks = max(1, round(gb * (1 << 30) / CHUNK / SHARDS))
    shards = [merged / f"model-{shard + 1:05d}-of-{SHARDS:05d}.safetensors" for shard in range(SHARDS)]
    for shard in shards:
        with open(shard, "wb") as file:
            for _ in range(chunks):
                file.write(os.urandom(CHUNK))
    figures: dict = {"gb": SHARDS * chunks * CHUNK / (1 << 30)}
    for name, copy_tree in (("copied", shutil.copytree), ("linked", link_tree)):
        os.sync()  # the model as a finished round leaves it: saved, and flushed by then
        timings: dict = {}
        promote(merged, work / f"submission-{name}", min_format_rate=0.0, format_rate=0.0, accuracy=1.0,
                check=lambda path: None, copy_tree=copy_tree, timings=timings)  # fmt: skip
        # Whether the submission shares the round's files: a filesystem without hard links copies them all the same.
        timings["shares_files"] = os.path.samefile(work / f"submission-{name}" / shards[0].name, shards[0])
        figures[name] = timings
    shutil.rmtree(work)
    return figures


if __name__ == "__main__":
    sys.exit(main())
