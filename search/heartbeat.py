"""A worker's sign of life on its running trials, stamped from a thread.

Workers that share a study fail each other's RUNNING trials once their stamp stops moving (search/scheduler.py). The
scheduler's loop may block for minutes (a promotion copies and load-checks gigabytes), so the stamps come from a
daemon thread: they stop when the worker's process does, not when its loop is busy. A stamp is the wall-clock time it
was written, for the dashboard to show; whether it moves is all that the other workers read from it.
"""

from __future__ import annotations

import threading
import time

import optuna

from search.log import warn

HEARTBEAT_ATTR = "heartbeat"


class Heartbeat:
    """Stamps `HEARTBEAT_ATTR` on the added trials every `interval_s` seconds, and remembers the trials it could not
    stamp because another worker had finished them (`lost()`)."""

    def __init__(self, storage: optuna.storages.BaseStorage, interval_s: float):
        self._storage = storage
        self._interval_s = interval_s
        self._trials: dict[int, int] = {}  # trial id -> trial number
        self._lost: set[int] = set()  # trial numbers
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self._interval_s)

    def add(self, trial: optuna.Trial) -> None:
        """Stamp `trial` at every beat from now on (the scheduler stamps it once when it asks for it)."""
        with self._lock:
            self._trials[trial._trial_id] = trial.number

    def remove(self, trial: optuna.Trial) -> None:
        with self._lock:
            self._trials.pop(trial._trial_id, None)
            self._lost.discard(trial.number)

    def lost(self) -> set[int]:
        """The numbers of the added trials that another worker finished (told FAIL as orphans, most likely)."""
        with self._lock:
            return set(self._lost)

    def beat(self) -> None:
        with self._lock:
            trials = list(self._trials.items())
        for trial_id, number in trials:
            try:
                self._storage.set_trial_user_attr(trial_id, HEARTBEAT_ATTR, time.time())
            except optuna.exceptions.UpdateFinishedTrialError:
                with self._lock:
                    if trial_id in self._trials:
                        self._lost.add(number)
            except Exception as error:  # noqa: BLE001 - a database hiccup: the next beat tries again
                warn(f"warning: heartbeat of round {number}: {type(error).__name__}: {error}")

    def _run(self) -> None:
        while not self._stopped.wait(self._interval_s):
            self.beat()
