"""A round while it runs: its trial, its process handle, its allotment, and what ended it.

The scheduler polls each running round: its progress lines (the in-round OOD score goes to the pruner), then whether
it is done, past its kill time, hung, or due to be asked to stop. When it ends, what the scheduler saw (a kill, a
prune, a stop over its allotment) overrides what the round's own status says.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import optuna

from search import trials
from search.allotment import Allotment
from search.backends import RoundHandle, RoundOutcome
from search.lineage import Parent
from search.workers import Workers
from search.merge import Candidate
from search.log import minutes
from trainer.config import TrialConfig
from trainer.run_folder import FailureKind, Phase, RoundState


@dataclass
class RunningRound:
    trial: optuna.Trial
    config: TrialConfig | None  # None: round 0 or a merge, which train nothing
    gpus: list[int]
    handle: RoundHandle
    started: float
    allotment: Allotment
    parent: Parent | None = None  # what a training round started from
    merge: Candidate | None = None  # a merge stage's candidate
    last_line_at: float = 0.0  # for the hang check
    latest: dict = field(default_factory=dict)  # last progress line
    latest_ood: float | None = None
    pruned: str | None = None  # the reason, once the pruner said so
    stopped: str | None = None  # the reason, once over the allotment
    killed: str | None = None

    def __post_init__(self) -> None:
        self.last_line_at = self.started

    def read_progress(self, now: float) -> list[tuple[int, float]]:
        """Take in the round's new progress lines; the in-round OOD scores among them, (step, accuracy), for the
        pruner."""
        scores = []
        for line in self.handle.progress():
            self.last_line_at, self.latest = now, line
            if line.get("ood_accuracy") is not None:
                self.latest_ood = float(line["ood_accuracy"])
                scores.append((int(line["step"]), self.latest_ood))
        return scores

    def overdue(self, now: float, hang_minutes: float) -> bool:
        """Past its kill time, or a training round silent for `hang_minutes`: records why in `killed`."""
        if now >= self.allotment.kill_at:
            allotted = minutes(self.allotment.end_by - self.started)
            self.killed = f"killed: still {self.handle.phase()} {minutes(now - self.allotment.end_by)} past its " \
                          f"allotment of {allotted}"  # fmt: skip
        elif self.config is not None and self.handle.phase() == Phase.TRAINING and \
                now - self.last_line_at >= 60.0 * hang_minutes:  # fmt: skip
            self.killed = f"hung: no progress for {hang_minutes:g} min"
        return self.killed is not None

    def due_to_stop(self, now: float) -> bool:
        """Past its stop time while still stepping (a STOP during the save changes nothing), not yet asked."""
        stepping = self.config is not None and self.handle.phase() == Phase.TRAINING and \
            self.latest.get("step", 0) < self.config.steps  # fmt: skip
        return now >= self.allotment.stop_at and self.stopped is None and self.pruned is None and stepping

    def outcome(self) -> RoundOutcome:
        """The handle's outcome, with what the scheduler saw put over the round's own account."""
        outcome = self.handle.outcome()
        state, reason = RoundState(outcome.state), outcome.reason
        failure = (outcome.failure or FailureKind.ERROR) if state == RoundState.FAILED else None
        if self.killed:
            state, reason, failure = RoundState.FAILED, self.killed, FailureKind.ERROR
        elif state != RoundState.FAILED and self.pruned:
            state, reason = RoundState.PRUNED, self.pruned
        elif state == RoundState.STOPPED and self.stopped:
            reason = self.stopped
        if state.saved and outcome.ood_accuracy is None:
            state, reason, failure = RoundState.FAILED, "the evaluation gave no OOD accuracy", FailureKind.ERROR
        outcome.state, outcome.reason, outcome.failure = state, reason, failure
        return outcome


def end_lost(study: optuna.Study, r: RunningRound, workers: Workers) -> str:
    """Another worker finished this round's trial (it took this worker for dead, or wrote to the study by hand): the
    round's processes are ended and its result is not recorded; the line that says so."""
    workers.heartbeat.remove(r.trial)
    with contextlib.suppress(Exception):  # already over, or unkillable: nothing more to do about it here
        r.handle.kill()
    stored = study._storage.get_trial(r.trial._trial_id)
    why = f"{stored.state.name}: {stored.user_attrs.get('reason') or 'no reason recorded'}"
    return f"round {r.trial.number} ended here: another worker finished its trial ({why})"


def abandon(study: optuna.Study, rounds: list[RunningRound], pending: list[optuna.Trial], workers: Workers) -> None:
    """The scheduler is leaving with rounds still running (an exception, Ctrl-C): kill them, since they run in their
    own process groups and would hold the GPUs, and record why; so for the scored merges the stage had not decided
    on (`pending`), and for this worker's trials in neither list (being launched, or ending in a promotion). Errors
    here must not hide the one that got us here."""
    for r in rounds:
        workers.heartbeat.remove(r.trial)
        with contextlib.suppress(Exception):
            r.handle.kill()
        with contextlib.suppress(Exception):
            trials.fail(study, r.trial, "interrupted: the scheduler stopped during this round")
    for trial in pending:
        workers.heartbeat.remove(trial)
        with contextlib.suppress(Exception):
            trials.fail(study, trial, "interrupted: the scheduler stopped before the merge stage decided", state=None)
    trials.fail_leftovers(study, workers.id, "interrupted: the scheduler stopped as this round started or ended")
