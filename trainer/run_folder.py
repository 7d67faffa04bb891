"""A round's folder: everything that passes between the search and a round's processes.

The search creates the folder and writes `trial.json`; the trainer (`python -m trainer --config trial.json`) appends
`progress.jsonl` as it steps, obeys a `STOP` file, and leaves `status.json` and `merged/`; the evaluator writes one
report per split; the search's local backend sends each process's output to a log and lists the process groups it
started. The names, the states and the failure kinds live here, with the readers and writers of the files both
sides parse. A reader takes what a crash leaves (a torn last line, no file, an older file) without raising.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

TRIAL_FILE = "trial.json"  # the round's TrialConfig
PROGRESS_FILE = "progress.jsonl"  # one JSON line per optimizer step (trainer.progress writes the fields)
STATUS_FILE = "status.json"  # how the trainer ended: `Status`
STOP_FILE = "STOP"  # present: the trainer ends after its current step and saves
MERGED_DIR = "merged"  # the trained model, LoRA merged in, loadable as the verifier loads it
TRAIN_LOG = "train.log"  # the trainer's stdout and stderr
EVAL_LOG = "eval.log"  # every evaluation's stdout and stderr
# The process groups the search started for the round, one JSON line each (`pgid`, `start`, `host`): what a later
# search kills when the one that started them died.
PROCESSES_FILE = "processes.jsonl"
# The parts status.json times, in seconds: a trainer's setup, train and save; a merge's build (search.merge.soup).
TIMED_PARTS = ("setup", "train", "save", "build")
_RANK_FAILURE = "failure.rank{}.json"  # a failing process of a multi-process round: `RankFailure`


class _Word(str, Enum):
    """A member that is its value wherever a string goes: JSON, f-strings, comparisons with the value (what
    enum.StrEnum does from Python 3.11; the project supports 3.10)."""

    __str__ = str.__str__
    __format__ = str.__format__


def eval_report(split: str) -> str:
    """The evaluator's report on `split` ("ood", "val")."""
    return f"{split}_eval.json"


class RoundState(_Word):
    """How a round ended: `status.json`'s `state` (the trainer's first three), a RoundOutcome's and a trial's."""

    COMPLETED = "completed"
    STOPPED = "stopped"  # ended early on request (STOP, SIGTERM, over its allotment), saved
    FAILED = "failed"
    PRUNED = "pruned"  # the search's verdict: not worth finishing or too slow to run

    @property
    def saved(self) -> bool:
        """The round left a model to score."""
        return self in (RoundState.COMPLETED, RoundState.STOPPED)


class Phase(_Word):
    """Where a running round is (the search's hang check watches only training)."""

    TRAINING = "training"
    EVALUATING = "evaluating"
    DONE = "done"


class FailureKind(_Word):
    """Why a failed round failed, as `status.json`'s `kind`: the search tells the configuration's own failures
    (NAN, OUT_OF_MEMORY) from the rest."""

    NAN = "nan"  # a non-finite loss, gradient norm or reward
    OUT_OF_MEMORY = "out_of_memory"
    ERROR = "error"  # anything else


@dataclass(frozen=True)
class Status:
    state: RoundState
    reason: str | None
    steps_done: int
    timings: dict[str, float] = field(default_factory=dict)  # seconds of the TIMED_PARTS that ran
    kind: FailureKind | None = None  # set when the state is FAILED


def write_status(folder: str | Path, status: Status) -> None:
    _write_json(Path(folder) / STATUS_FILE, {
        "state": status.state,
        "kind": status.kind,
        "reason": status.reason,
        "steps_done": status.steps_done,
        "timings": {key: round(float(status.timings[key]), 3) for key in TIMED_PARTS if key in status.timings},
    })  # fmt: skip


def read_status(folder: str | Path) -> Status | None:
    """The round's status, None when there is none (the trainer died first) or it is not one. A failed status
    without a `kind` (written before there were kinds) reads as ERROR."""
    data = _read_json(Path(folder) / STATUS_FILE)
    if data is None or data.get("state") not in tuple(RoundState):
        return None
    state = RoundState(data["state"])
    kind = _failure_kind(data.get("kind")) if state == RoundState.FAILED else None
    reason, steps, timings = data.get("reason"), data.get("steps_done"), data.get("timings")
    return Status(
        state=state,
        reason=reason if isinstance(reason, str) else None,
        steps_done=steps if isinstance(steps, int) and not isinstance(steps, bool) and steps >= 0 else 0,
        timings={k: float(v) for k, v in timings.items() if _is_number(v)} if isinstance(timings, dict) else {},
        kind=kind,
    )


@dataclass(frozen=True)
class RankFailure:
    rank: int
    time: float  # time.time() when it failed: the earliest is the cause, the others saw a collective break
    kind: FailureKind
    reason: str


def write_rank_failure(folder: str | Path, rank: int, kind: FailureKind, reason: str) -> None:
    data = {"rank": rank, "time": time.time(), "kind": kind, "reason": reason}
    _write_json(Path(folder) / _RANK_FAILURE.format(rank), data)


def rank_failure_files(folder: str | Path) -> list[Path]:
    return sorted(Path(folder).glob(_RANK_FAILURE.format("*")))


def earliest_rank_failure(folder: str | Path) -> RankFailure | None:
    failures = []
    for path in rank_failure_files(folder):
        data = _read_json(path)
        if data is None:
            continue  # torn: its process died while writing it
        try:
            failures.append(RankFailure(int(data["rank"]), float(data["time"]), _failure_kind(data.get("kind")),
                                        str(data["reason"])))  # fmt: skip
        except (TypeError, KeyError, ValueError):
            continue
    return min(failures, key=lambda failure: failure.time, default=None)


class ProgressReader:
    """Reads `progress.jsonl` as it grows: each call returns the complete lines written since the last one. A line
    still being written waits for the next call; one that is not a step's JSON object (a torn write) is skipped."""

    def __init__(self, folder: str | Path):
        self.path = Path(folder) / PROGRESS_FILE
        self._offset = 0

    def new_lines(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self._offset += len(complete)
        lines = []
        for raw in complete.splitlines():
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            if isinstance(line, dict) and isinstance(line.get("step"), int):
                lines.append(line)
        return lines


def read_progress(folder: str | Path) -> list[dict[str, Any]]:
    """Every complete step line of the round so far."""
    return ProgressReader(folder).new_lines()


def read_report(folder: str | Path, split: str) -> dict[str, Any] | None:
    """The evaluator's report on `split` (evaluator.report has its fields), None when there is none."""
    return _read_json(Path(folder) / eval_report(split))


def _failure_kind(value: Any) -> FailureKind:
    """The kind as written; ERROR when there is none (an older file) or it is not one."""
    return FailureKind(value) if value in tuple(FailureKind) else FailureKind.ERROR


def _write_json(path: Path, data: dict[str, Any]) -> None:
    # Through a temporary file and a rename: a reader never sees half a file.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
