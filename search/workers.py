"""Several schedulers on one study: each one's sign of life on its running trials, and the sweep over the others'.

Each scheduler is a worker with an id (host, process, a random tail) stamped on its trials, and a heartbeat stamped on
its RUNNING trials from a daemon thread: the scheduler's loop may block for minutes (a promotion copies and
load-checks gigabytes), so the stamps stop when the worker's process does, not when its loop is busy. A stamp is the
wall-clock time it was written, for the dashboard to show; whether it moves is all the other workers read from it.

A RUNNING trial of another worker is failed as orphaned only when that worker is provably dead (same host, no such
process, or a stopped scheduler of this process) or its heartbeat has not moved for ORPHAN_AFTER_S of the observer's
own time: no two clocks are compared, neither two boxes' nor two `--simulate` runs' virtual ones. Optuna's own
heartbeat runs only inside `optimize()`, not with ask/tell.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from typing import Callable

import optuna
from optuna.trial import FrozenTrial, TrialState

from search.log import warn
from trainer.run_folder import RoundState

HEARTBEAT_ATTR = "heartbeat"
HEARTBEAT_S = 60.0  # real seconds between two heartbeats of our running trials; scheduler-clock seconds between sweeps
# A RUNNING trial whose heartbeat has not moved for this many real seconds belongs to a dead worker. Generous: a
# database that is briefly unreachable skips beats; a dead worker on this host is known at once.
ORPHAN_AFTER_S = 15 * HEARTBEAT_S
# The time against which other workers' heartbeats are watched: this process's own, never a clock they wrote.
_liveness_clock = time.monotonic
# Worker ids of the schedulers running in this process: one that stopped (an exception) left its RUNNING trials
# behind though its process lives on.
_LIVE_WORKERS: set[str] = set()


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


class Workers:
    """This worker's id and heartbeat, and the sweep that fails the RUNNING trials of dead workers.

    `reap(run_dir) -> [process group ids]` ends the processes of a round whose worker died on this host (the
    backend's; None: nothing to end); `say` prints a line."""

    def __init__(self, study: optuna.Study, say: Callable[[str], None],
                 reap: Callable[[str], list[int]] | None = None):  # fmt: skip
        self.id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.heartbeat = Heartbeat(study._storage, HEARTBEAT_S)
        self._study = study
        self._say = say
        self._reap = reap
        self._beats: dict[int, tuple[object, float]] = {}  # others' RUNNING trials: (heartbeat, when it last moved)

    def start(self) -> None:
        _LIVE_WORKERS.add(self.id)
        self.heartbeat.start()

    def stop(self) -> None:
        self.heartbeat.stop()
        _LIVE_WORKERS.discard(self.id)

    def claim(self, trial: optuna.Trial) -> None:
        """Stamp a trial this worker just asked for as its own, and keep its heartbeat from now on."""
        trial.set_user_attr("worker", self.id)
        trial.set_user_attr(HEARTBEAT_ATTR, time.time())

    def sweep(self, ours: set[int]) -> None:
        """Fail the RUNNING trials (not in `ours`) of dead workers: one on this host whose process (or scheduler) is
        gone, or any whose heartbeat has not moved for ORPHAN_AFTER_S of this process's own time."""
        seen_at = _liveness_clock()
        for t in self._study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if t.number in ours:
                continue
            beat = t.user_attrs.get(HEARTBEAT_ATTR)
            last = self._beats.get(t.number)
            if last is None or last[0] != beat:
                self._beats[t.number] = last = (beat, seen_at)
            dead_here = dead_worker(t.user_attrs.get("worker"))
            if dead_here or seen_at - last[1] >= ORPHAN_AFTER_S:
                self._fail_orphan(t, reap=dead_here)

    def _fail_orphan(self, t: FrozenTrial, *, reap: bool) -> None:
        reason = "orphaned: the scheduler stopped during this round"
        # Its processes run in their own sessions and outlive a scheduler killed with SIGKILL (their leader gets
        # SIGTERM then, see search.backends.local; a process deaf to it, or a straggler, would hold the GPUs): a
        # worker known dead on this host leaves its round's process groups to us.
        killed: list[int] = []
        if reap and self._reap is not None and isinstance(t.user_attrs.get("run_dir"), str):
            try:
                killed = self._reap(t.user_attrs["run_dir"])
            except Exception as error:  # noqa: BLE001 - the sweep goes on; the trial is still failed
                self._say(f"round {t.number}: could not end its processes: {type(error).__name__}: {error}")
        trial = optuna.trial.Trial(self._study, t._trial_id)  # the live handle of a stored trial
        try:
            trial.set_user_attr("state", RoundState.FAILED)
            trial.set_user_attr("reason", reason)
            if killed:
                trial.set_user_attr("reaped_process_groups", killed)
            self._study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)
        except optuna.exceptions.UpdateFinishedTrialError:
            return  # its worker was alive after all and told it meanwhile
        self._say(f"round {t.number} {reason} (worker {t.user_attrs.get('worker', 'unknown')})")


def dead_worker(worker: object) -> bool:
    """True when `worker` ran on this host in a process that no longer exists, or in this process in a scheduler
    that has stopped (a restarted search on one box need not wait for the heartbeat to stop moving)."""
    if not isinstance(worker, str):
        return False
    host, _, rest = worker.partition(":")
    pid = rest.partition(":")[0]
    if host != socket.gethostname() or not pid.isdigit() or int(pid) < 1:
        return False
    if int(pid) == os.getpid():
        return worker not in _LIVE_WORKERS
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):  # alive and someone else's; or no process id at all
        return False
    return False
