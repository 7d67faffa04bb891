"""`status.json`: how a round ended, written whatever happened (atomically: a reader never sees half a file).

`{"state": "completed"|"stopped"|"failed", "reason", "steps_done", "timings": {"setup", "train", "save"}}`.

With several processes the main process writes it. A failing non-main process also leaves
`failure.rank<R>.json` (and `status.json` if none exists yet): under `accelerate launch`, once one worker dies the
launcher terminates the others, and the main process may be killed while blocked in a collective before it can
write anything. When the main process does write a failure, it reports the earliest failure of any process, since
the others usually only saw the collective break.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path
from typing import Any

import torch

STATUS_FILE = "status.json"
TRACEBACK_LINES = 8


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def write_status(output_dir: str | Path, state: str, reason: str | None, steps_done: int, timings: dict) -> dict:
    status = {
        "state": state,
        "reason": reason,
        "steps_done": steps_done,
        "timings": {key: round(float(timings.get(key, 0.0)), 3) for key in ("setup", "train", "save")},
    }
    write_json_atomic(Path(output_dir) / STATUS_FILE, status)
    return status


def describe_exception(exc: BaseException) -> str:
    """`<Type>: <message>` plus the last traceback lines; an out-of-memory error starts with "out of memory"."""
    tail = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).strip().splitlines()
    summary = f"{type(exc).__name__}: {exc}"
    if is_out_of_memory(exc):
        summary = f"out of memory: {summary}"
    return summary + "\n" + "\n".join(tail[-TRACEBACK_LINES:])


def is_out_of_memory(exc: BaseException) -> bool:
    # torch.OutOfMemoryError is torch.cuda.OutOfMemoryError; a CPU allocation failure is a RuntimeError/MemoryError.
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def record_rank_failure(output_dir: str | Path, rank: int, reason: str) -> None:
    folder = Path(output_dir)
    write_json_atomic(folder / f"failure.rank{rank}.json", {"rank": rank, "time": time.time(), "reason": reason})


def earliest_failure(output_dir: str | Path) -> dict[str, Any] | None:
    failures = []
    for path in Path(output_dir).glob("failure.rank*.json"):
        try:
            failures.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return min(failures, key=lambda failure: failure["time"]) if failures else None
