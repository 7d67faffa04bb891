"""The search loop: ask Optuna for a round, fit it into the time left, run it on free GPUs, tell the result.

The deadline is a promise, so time decides first: a round starts only if a useful version of it fits before
`deadline - reserve` (its steps are cut to fit, by the DurationModel, which refits on every finished round); a
round that runs late is stopped early enough to be saved and scored within its allotment, and killed if it still
runs past it; no round runs into the reserve. Rounds run side by side on disjoint GPU slots (several on each slot
when `rounds_per_slot` says so); Optuna's TPE treats the RUNNING ones as bad points (constant liar), so parallel
rounds do not sample the same configuration.

Several schedulers may share one study (each on its own GPUs): each stamps its trials with a worker id and, from a
thread, a heartbeat (search/heartbeat.py), and a RUNNING trial is declared orphaned only when its worker is provably
dead (same host, no such process) or its heartbeat has not moved for ORPHAN_AFTER_S of the observer's own time: no
two clocks are compared, neither two boxes' nor two `--simulate` runs' virtual ones. A round whose trial another
worker finished meanwhile is ended, and this worker goes on. Optuna's own heartbeat runs only inside `optimize()`,
not with ask/tell.

Round 0 scores the base model (recipe `base`, queued first when the study is created): it is the first candidate
for the submission (the format floor does not apply to it), so that a search whose every round fails still hands in
a scored, loadable model, and the reference every round's lead is measured against. A round whose `init` is `best`
starts from the merged model of the best round so far that this box could promote (its weights still on disk, its
format above the floor; the base when there is none): it never waits for a round still being scored. Each trial
records its `parent` and its `total_steps` from the base. After the last round, the reserve is used to check the
submission as the verifier will use it (`final_check`).

Everything time-related goes through `clock`, so `--simulate` runs a 7.5-hour search in seconds.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import optuna
from optuna.trial import FrozenTrial, TrialState

from search import interrupts, merge_stage, selection, space
from search.backend import TIMING_KEYS, Backend, RoundHandle, RoundOutcome
from search.clock import Clock
from search.duration import DurationModel
from search.folders import inside
from search.heartbeat import HEARTBEAT_ATTR, Heartbeat
from search.log import say, warn
from search.soup import MergeSpec
from search.study import FINAL_CHECK_ATTR
from search.verification import CHECK_ROWS
from trainer.config import ConfigError, TrialConfig
from trainer.run_folder import FailureKind, Phase, RoundState
from trainer.validation import InvalidValue, is_number

if TYPE_CHECKING:  # the fit check imports torch; only its type is named here
    from search.fit import Fit

POLL_S = 5.0  # between two polls of the running rounds at most: a round's process that ends wakes it (Backend.wait)
HEARTBEAT_S = 60.0  # real seconds between two heartbeats of our running trials; scheduler-clock seconds between sweeps
# A RUNNING trial whose heartbeat has not moved for this many real seconds belongs to a dead worker. Generous: a
# database that is briefly unreachable skips beats; a dead worker on this host is known at once.
ORPHAN_AFTER_S = 15 * HEARTBEAT_S
STATUS_EVERY_S = 60.0  # a status line at least this often while nothing changes
SAFETY_SHARE = 0.05  # of an allotment, left free when fitting the steps: the prediction's error margin
GRACE_SHARE = 0.1  # a round may overrun its allotment by this share of it (never into the reserve) before a kill
MAX_CONSECUTIVE_FAILURES = 5  # then something systematic is broken: stop launching rather than burn the budget
MAX_CONSECUTIVE_MISFITS = 10  # sampled configurations in a row too slow for round_max or too big for the card
OOD_ROWS_GUESS = 1000  # the brief's ood_val size, for the duration prior when ood_rows is null (all rows)
# Failures the configuration itself causes: told PRUNED, a bad point TPE learns to avoid, instead of FAIL, which TPE
# ignores (it models COMPLETE, PRUNED and RUNNING trials only) and so would keep sampling there. The trial's `state`
# attribute still says failed.
CONFIG_FAILURES = frozenset({FailureKind.NAN, FailureKind.OUT_OF_MEMORY})
# Round 0 may take this many times its predicted evaluation (and at least round_min_minutes) before it is killed: it
# is the fallback submission, and the first evaluation's prediction is the prior's.
BASE_ALLOTMENT_FACTOR = 4.0

PromoteHook = Callable[[RoundOutcome, optuna.Trial], bool]
RoundEndHook = Callable[[FrozenTrial, RoundOutcome], None]
# The time against which other workers' heartbeats are watched: this process's own, never a clock they wrote.
_liveness_clock = time.monotonic
# Worker ids of the schedulers running in this process: one that stopped (an exception) left its RUNNING trials
# behind though its process lives on.
_LIVE_WORKERS: set[str] = set()
# final_check(gpus) -> (passed, line): the submission checked in the reserve (None: nothing to check).
FinalCheckHook = Callable[[list[int]], "tuple[bool, str]"]


@dataclass(frozen=True)
class _Parent:
    """The model a round starts from: a scored trial (None when the base has no trial yet) and its weights."""

    trial: int | None
    model_path: str
    total_steps: int


@dataclass
class _Round:
    trial: optuna.Trial
    config: TrialConfig | None  # None: round 0, which scores the base model and trains nothing
    gpus: list[int]
    handle: RoundHandle
    started: float
    end_by: float  # the allotment's end: saved and scored by then
    stop_at: float  # request a stop here if training still runs
    kill_at: float
    last_line_at: float  # for the hang check
    parent: _Parent | None = None  # what a training round started from
    latest: dict = field(default_factory=dict)  # last progress line
    latest_ood: float | None = None
    pruned: str | None = None  # the reason, once the pruner said so
    stopped: str | None = None  # the reason, once over the allotment
    killed: str | None = None
    merge: merge_stage.Candidate | None = None  # a merge stage's candidate (config None: it trains nothing)


class Scheduler:
    def __init__(
        self,
        settings,
        study: optuna.Study,
        deadline: float,
        backend: Backend,
        clock: Clock,
        on_round_end: RoundEndHook | None = None,
        promote: PromoteHook | None = None,
        on_round_scored: RoundEndHook | None = None,
        final_check: FinalCheckHook | None = None,
        merge_only: bool = False,
    ):
        """`promote(outcome, trial) -> bool` is called with a round that beats the best promoted score (None: the
        real promotion into `settings.submission_path`; a simulated search passes a recorder). `on_round_end(trial,
        outcome)` runs after each round is told (search.hooks writes the leaderboard there); `on_round_scored(trial,
        outcome)` just before, with the live trial (search.hooks attaches the round's plot to it: Optuna takes no
        artifact on a finished trial). `final_check(gpus) -> (passed, line)` checks the submission in the reserve
        (None: the real `search.promotion.final_check` with the real promotion, nothing with a recorder).
        `merge_only`: no round starts; the merge stage runs on the study's kept rounds (`run_search.py merge`), with
        the deadline moved out, if need be, to the stage's predicted time plus the reserve."""
        self.settings = settings
        self.study = study
        self.deadline = deadline
        self.backend = backend
        self.clock = clock
        self.on_round_end = on_round_end
        self.on_round_scored = on_round_scored
        self.promote = promote or self._promote_to_submission
        self._into_submission = promote is None  # the real promotion: the submission's PROMOTED.json is the best
        self.final_check = final_check or (self._check_submission if promote is None else None)
        self.final_check_result: tuple[bool, str] | None = None
        self.worker = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        eval_rows = (settings.ood_rows or OOD_ROWS_GUESS) + settings.val_rows
        self.duration = DurationModel(eval_rows=eval_rows, prior_scale=settings.duration_prior_scale)
        self._slots = settings.slots
        self._running: dict[int, _Round] = {}  # slot index -> round
        self._closed: str | None = None  # why no more rounds start
        self._failures = 0  # consecutive failed rounds
        self._base_due = False  # round 0 is to be scored next, ahead of the queue (a resumed study, a failed one)
        self._misfits = 0  # consecutive configurations too slow for any round or too big for the card
        self._best: tuple[float, int] | None = None  # (promoted ood accuracy, trial number)
        self._heartbeat = Heartbeat(study._storage, HEARTBEAT_S)
        self._beats: dict[int, tuple[object, float]] = {}  # others' RUNNING trials: (heartbeat, when it last moved)
        self._sweep_at = -math.inf
        self._status_at = -math.inf
        self._status_key: tuple = ()
        self._stage: merge_stage.MergeStage | None = None  # the merge stage, once planned
        self._merge_only = merge_only
        self._stage_over = not (settings.merge.enabled or merge_only)  # no stage, or it has decided
        self._stage_ingredients: dict[int, merge_stage.Ingredient] = {}
        # Scored candidates, RUNNING until the stage decides: the chosen one is promoted before it is told.
        self._pending: list[tuple[optuna.Trial, RoundOutcome, merge_stage.Candidate]] = []

    @property
    def end_of_stage(self) -> float:
        """Nothing runs past this but round 0: the deadline minus the reserve."""
        return self.deadline - 60.0 * self.settings.reserve_minutes

    @property
    def end_of_rounds(self) -> float:
        """No training round runs past this: the end of the stage minus the merge stage's predicted time."""
        return self.end_of_stage - (0.0 if self._stage_over and not self._pending else self.stage_seconds())

    def _rounds_end(self) -> str:
        return "the reserve" if self.end_of_rounds == self.end_of_stage else "the merge stage"

    def stage_seconds(self) -> float:
        """The merge stage's predicted seconds: its greedy soup's chain, one candidate after another, then its eta
        candidates side by side on the slots (and the uniform soup where there is no second slot for it)."""
        m = self.settings.merge
        etas = sum(eta != 1.0 for eta in m.etas)
        waves = (m.top_k - 1) + math.ceil(etas / len(self._slots)) + (m.top_k >= 3 and len(self._slots) == 1)
        return waves * self.duration.merge_seconds(m.top_k + 1)

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        self._learn_from_history()
        if self._merge_only:
            self._close("the merge stage was asked for by hand")
            ahead = self.clock.now() + 60.0 * self.settings.reserve_minutes + 2 * self.stage_seconds()
            self.deadline = max(self.deadline, ahead)
        _LIVE_WORKERS.add(self.worker)
        self._heartbeat.start()
        try:
            while True:
                now = self.clock.now()
                if now >= self._sweep_at:
                    self._sweep()
                    self._sweep_at = now + HEARTBEAT_S
                for slot, r in list(self._running.items()):
                    try:
                        if r.trial.number in self._heartbeat.lost():
                            raise optuna.exceptions.UpdateFinishedTrialError(f"trial {r.trial.number} was finished")
                        self._poll(slot, now)
                    except optuna.exceptions.UpdateFinishedTrialError:
                        self._end_lost_round(r)
                for slot in range(len(self._slots)):
                    if self._closed is None and slot not in self._running:
                        try:
                            self._launch(slot, now)
                        except optuna.exceptions.UpdateFinishedTrialError as error:  # finished before it started
                            self._say(f"a round was finished by another worker before it started: {error}")
                self._advance_stage(now)
                if self._closed is not None and not self._running and self._stage_over:
                    break
                self._status(now)
                self.backend.wait(POLL_S)
        finally:
            self._heartbeat.stop()
            self._abandon_running()
            _LIVE_WORKERS.discard(self.worker)
        self._say(f"search over: {self._closed}; {self._best_text()}")
        self._check_in_reserve()

    def _launch(self, slot: int, now: float) -> None:
        allotted = min(self.end_of_rounds - now, 60.0 * self.settings.round_max_minutes)
        no_time = allotted < 60.0 * self.settings.round_min_minutes
        base_fits = now + self.duration.eval_seconds() <= self.deadline  # it may use the reserve, not more
        if no_time and not (base_fits and (self._base_due or self._base_waiting())):
            left = _minutes(self.end_of_rounds - now)
            self._close(f"no time left for a useful round ({left} before {self._rounds_end()})")
            return
        with interrupts.deferred():  # a new trial is stamped ours before an interrupt, so _abandon_running finds it
            if self._base_due and base_fits:
                trial, self._base_due = self._new_trial(space.BASE), False
            else:
                trial = self.study.ask()
            trial.set_user_attr("worker", self.worker)
        trial.set_user_attr(HEARTBEAT_ATTR, time.time())
        if trial.user_attrs.get("recipe") == space.BASE:
            self._launch_base(trial, slot, now)
            return
        if no_time:  # another worker took the base a moment ago
            self._tell_failed(trial, "no time left for a useful round", count=False)
            self._close(f"no time left for a useful round ({_minutes(self.end_of_rounds - now)} before {self._rounds_end()})")
            return
        run_dir = self._run_dir(trial)
        try:
            config = space.sample_config(trial, self.settings, str(run_dir))
        except ConfigError as error:  # a sampled combination the trainer would refuse
            self._tell_failed(trial, f"invalid configuration: {error}")
            return
        fit = self.backend.fit(config, self._slots[slot])
        if fit is not None and not fit.fits:
            self._refuse_unfit(trial, fit)
            return
        init = space.sampled_init(trial)
        parent = self._parent(init)
        config = config.replace(model_path=parent.model_path)
        # A late round is stopped early enough to finish its longest step and its predicted save and evaluation
        # within the allotment, so the steps are fitted with that step and a safety share to spare: a round
        # predicted right never meets its stop. It is killed if even that overruns.
        sampled_steps = config.steps
        step_s = self.duration.longest_step(config)
        steps = self.duration.fit_steps(config, allotted - step_s - SAFETY_SHARE * allotted)
        if steps is None:
            self._misfit(trial, config, allotted)
            return
        self._misfits = 0
        if steps < sampled_steps:
            config = space.with_steps(config, steps)
        estimate = self.duration.estimate(config)
        gpus = self._slots[slot]
        _set_user_attrs(trial, {
            "config": config.to_dict(),
            "init": init,
            "parent": parent.trial,
            "parent_total_steps": parent.total_steps,
            "steps": config.steps,
            "predicted_s": round(estimate.total, 1),
            "allotted_s": round(allotted, 1),
            "run_dir": str(run_dir),
            "gpus": gpus,
            "started_at": now,
            **(fit.attrs() if fit is not None else {}),
        })  # fmt: skip
        try:
            handle = self.backend.start(config, gpus)
        except OSError as error:  # e.g. the run folder cannot be written, the launcher is missing
            self._tell_failed(trial, f"could not start the round: {error}")
            return
        end_by = now + allotted
        self._running[slot] = _Round(
            trial=trial,
            config=config,
            gpus=gpus,
            handle=handle,
            started=now,
            end_by=end_by,
            stop_at=end_by - estimate.tail - step_s,
            kill_at=min(end_by + GRACE_SHARE * allotted, self.end_of_rounds),
            last_line_at=now,
            parent=parent,
        )
        self._heartbeat.add(trial)
        cut = f" (cut from {sampled_steps})" if steps < sampled_steps else ""
        origin = "the base" if parent.model_path == self.settings.model_path else f"round {parent.trial}"
        self._say(
            f"round {trial.number} starts on {_gpus(gpus)} from {origin}: {_describe(config)}, {config.steps} "
            f"steps{cut}, predicted {_minutes(estimate.total)} of {_minutes(allotted)}",
        )

    def _launch_base(self, trial: optuna.Trial, slot: int, now: float) -> None:
        """Round 0: score the base model with the evaluations of every round. It may run into the reserve (it is the
        fallback submission) but not past the deadline."""
        run_dir = self._run_dir(trial)
        predicted = self.duration.eval_seconds()
        allotted = max(BASE_ALLOTMENT_FACTOR * predicted, 60.0 * self.settings.round_min_minutes)
        end_by = min(self.deadline, now + allotted)
        gpus = self._slots[slot]
        _set_user_attrs(trial, {
            "steps": 0,
            "total_steps": 0,
            "predicted_s": round(predicted, 1),
            "allotted_s": round(end_by - now, 1),
            "run_dir": str(run_dir),
            "gpus": gpus,
            "started_at": now,
        })  # fmt: skip
        try:
            handle = self.backend.score(self.settings.model_path, str(run_dir), gpus)
        except OSError as error:
            self._tell_failed(trial, f"could not start scoring the base model: {error}")
            self._requeue_base(trial.number)
            return
        self._running[slot] = _Round(trial, None, gpus, handle, now, end_by, stop_at=end_by, kill_at=end_by,
                                     last_line_at=now)  # fmt: skip
        self._heartbeat.add(trial)
        self._say(f"round {trial.number} starts on {_gpus(gpus)}: scoring the base model, predicted "
                       f"{_minutes(predicted)}")  # fmt: skip

    def _run_dir(self, trial: optuna.Trial) -> Path:
        # Per study: several studies (the demo, a renamed study) may share one runs folder.
        return Path(self.settings.rounds_dir) / f"round-{trial.number:04d}"

    def _parent(self, init: str) -> _Parent:
        """What a round of `init` starts from: the base, or the best promotable round whose weights are here."""
        trials = self.study.get_trials(deepcopy=False)
        bases = [t for t in trials if t.user_attrs.get("recipe") == space.BASE]
        scored_bases = [t for t in bases if t.state == TrialState.COMPLETE and t.value is not None]
        base_trial = (scored_bases or bases or [None])[0]
        base = _Parent(base_trial.number if base_trial else None, self.settings.model_path, 0)
        if init == "base":
            return base
        best: FrozenTrial | None = scored_bases[0] if scored_bases else None
        for t in trials:
            attrs = t.user_attrs
            if t.state != TrialState.COMPLETE or t.value is None or attrs.get("recipe") == space.BASE:
                continue
            promotable = (attrs.get("format_rate") or 0.0) >= self.settings.min_format_rate
            if not promotable or "promotion_error" in attrs or not attrs.get("merged_dir"):
                continue
            if attrs.get("recipe") == space.MERGE and not attrs.get("promoted"):
                continue  # the stage's guard kept it out: its score is not trusted as a starting point
            if (best is None or t.value > best.value) and self.backend.has_weights(attrs["merged_dir"]):
                best = t
        if best is None or best.user_attrs.get("recipe") == space.BASE:
            return base
        return _Parent(best.number, best.user_attrs["merged_dir"], int(best.user_attrs.get("total_steps", 0)))

    def _base_waiting(self) -> bool:
        waiting = self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
        return any(t.user_attrs.get("recipe") == space.BASE for t in waiting)

    def _new_trial(self, recipe: str) -> optuna.Trial:
        """A trial of `recipe` (round 0, a merge) claimed at once, ahead of the queue (enqueue_trial would put it behind
        any waiting warm start). Optuna's public API creates RUNNING trials only through ask(), which pops the queue
        first: hence its storage."""
        template = optuna.trial.create_trial(state=TrialState.RUNNING, user_attrs={"recipe": recipe})
        trial_id = self.study._storage.create_new_trial(self.study._study_id, template_trial=template)
        return optuna.trial.Trial(self.study, trial_id)

    def _misfit(self, trial: optuna.Trial, config: TrialConfig, allotted: float) -> None:
        """Not even the shortest useful version of the sampled round fits in its allotment. Near the end (the time
        left is the limit) the search is over; otherwise (round_max is) this configuration is too slow: told PRUNED
        without a value, which TPE ranks below every scored trial, so it samples elsewhere."""
        shortest = self.duration.min_useful_steps(config)
        needed = _minutes(self.duration.estimate(config, steps=shortest).total)
        trial.set_user_attr("steps", shortest)
        if allotted < 60.0 * self.settings.round_max_minutes:
            reason = f"no time left for a useful round: {shortest} steps need {needed}"
            self._tell_failed(trial, reason, count=False)
            self._close(f"no time left for a useful round ({_minutes(allotted)} before {self._rounds_end()})")
            return
        reason = f"too slow: its shortest useful round ({shortest} steps) needs {needed}, more than round_max_minutes"
        trial.set_user_attr("state", RoundState.PRUNED)
        trial.set_user_attr("reason", reason)
        self._tell(trial, state=TrialState.PRUNED)
        self._say(f"round {trial.number} not run: {reason}")
        self._count_misfit()

    def _refuse_unfit(self, trial: optuna.Trial, fit: Fit) -> None:
        """A round no memory plan fits on its card is not launched: told PRUNED without a value (a bad point TPE
        samples away from), in seconds instead of a model load and an out-of-memory error."""
        _set_user_attrs(trial, {"state": RoundState.PRUNED, "reason": fit.reason(), **fit.attrs()})
        self._tell(trial, state=TrialState.PRUNED)
        self._say(f"round {trial.number} not run: {fit.reason()}")
        self._count_misfit()

    def _count_misfit(self) -> None:
        self._misfits += 1
        if self._misfits >= MAX_CONSECUTIVE_MISFITS:
            self._close(f"{self._misfits} sampled configurations in a row do not fit their card or round_max_minutes")

    def _poll(self, slot: int, now: float) -> None:
        r = self._running[slot]
        for line in r.handle.progress():
            r.last_line_at, r.latest = now, line
            if line.get("ood_accuracy") is not None:
                r.latest_ood = float(line["ood_accuracy"])
                self._report(r, int(line["step"]), r.latest_ood)
        if r.handle.done():
            self._finish(slot, now)
            return
        hang_s = 60.0 * self.settings.hang_minutes
        if now >= r.kill_at:
            allotted = _minutes(r.end_by - r.started)
            r.killed = f"killed: still {r.handle.phase()} {_minutes(now - r.end_by)} past its allotment of {allotted}"
        elif r.config is not None and r.handle.phase() == Phase.TRAINING and now - r.last_line_at >= hang_s:
            r.killed = f"hung: no progress for {self.settings.hang_minutes:g} min"
        if r.killed:
            r.handle.kill()
            self._finish(slot, self.clock.now())
        elif now >= r.stop_at and r.stopped is None and r.pruned is None and self._still_stepping(r):
            r.stopped = "stopped: over its allotment"
            r.handle.request_stop()
            self._say(f"round {r.trial.number} {r.stopped} (step {r.latest.get('step', 0)}/{r.config.steps})")

    @staticmethod
    def _still_stepping(r: _Round) -> bool:
        """Training, and not yet at its last step (a STOP during the save changes nothing)."""
        return r.config is not None and r.handle.phase() == Phase.TRAINING and r.latest.get("step", 0) < r.config.steps

    def _report(self, r: _Round, step: int, value: float) -> None:
        if r.pruned:
            return
        r.trial.report(value, step)
        if r.trial.should_prune():
            r.pruned = f"pruned by {type(self.study.pruner).__name__} at step {step}: ood subset accuracy {value:.1f}"
            # Its model is not worth scoring: free the GPUs after the save the trainer does anyway.
            r.handle.request_stop(evaluate=False)
            self._say(f"round {r.trial.number} {r.pruned}")

    # ------------------------------------------------------------------ a round ends
    def _finish(self, slot: int, now: float) -> None:
        r = self._running.pop(slot)
        if r.merge is not None:
            self._finish_merge(r, now)
            return
        outcome = r.handle.outcome()
        state, reason = RoundState(outcome.state), outcome.reason
        failure = (outcome.failure or FailureKind.ERROR) if state == RoundState.FAILED else None
        if r.killed:
            state, reason, failure = RoundState.FAILED, r.killed, FailureKind.ERROR
        elif state != RoundState.FAILED and r.pruned:
            state, reason = RoundState.PRUNED, r.pruned
        elif state == RoundState.STOPPED and r.stopped:
            reason = r.stopped
        if state.saved and outcome.ood_accuracy is None:
            state, reason, failure = RoundState.FAILED, "the evaluation gave no OOD accuracy", FailureKind.ERROR
        outcome.state, outcome.reason, outcome.failure = state, reason, failure

        self.duration.observe(r.config, outcome.steps_done, outcome.timings)  # the backend reports what was measured
        scored = state.saved
        attrs = {
            "state": state,
            "reason": reason,
            "val_accuracy": outcome.val_accuracy,
            "format_rate": outcome.format_rate,
            "mean_completion_tokens": outcome.mean_completion_tokens,
            "steps_done": outcome.steps_done,
            "duration_s": round(now - r.started, 1),
            "ended_at": now,
            "timings": {key: round(float(value), 1) for key, value in outcome.timings.items()},
            "total_steps": (r.parent.total_steps if r.parent else 0) + outcome.steps_done,
        }
        if failure is not None:
            attrs["failure"] = failure
        if scored:
            attrs["merged_dir"] = outcome.merged_dir
            if outcome.ood_rows:
                attrs[selection.OOD_ROWS] = selection.rows_attr(outcome.ood_rows)
        _set_user_attrs(r.trial, attrs)
        if scored and (self._best is None or outcome.ood_accuracy > self._best[0]):
            self._promote(r.trial, outcome)
        if r.config is None and not scored:
            self._requeue_base(r.trial.number)

        if self.on_round_scored is not None:
            self.on_round_scored(r.trial, outcome)
        if scored:
            self._tell(r.trial, outcome.ood_accuracy)
        elif state == RoundState.PRUNED or failure in CONFIG_FAILURES:
            self._tell(r.trial, state=TrialState.PRUNED)  # Optuna keeps the last reported value
        else:
            self._tell(r.trial, state=TrialState.FAIL)
        self._heartbeat.remove(r.trial)  # only now: a promotion of minutes keeps the trial RUNNING, and stamped
        self._count(state)
        score = f"ood {outcome.ood_accuracy:.1f}%, " if outcome.ood_accuracy is not None else ""
        self._say(f"round {r.trial.number} {state}: {score}{reason or 'ok'} after {_minutes(now - r.started)}")
        self._round_ended(r.trial, outcome)

    def _promote(self, trial: optuna.Trial, outcome: RoundOutcome) -> None:
        began = time.monotonic()  # real seconds (not the clock's): what the check and copy cost, for the overhead
        try:
            promoted = self.promote(outcome, trial)
        except Exception as error:  # a failed promotion keeps the previous submission; the search goes on
            trial.set_user_attr("promotion_error", f"{type(error).__name__}: {error}")
            self._say(f"round {trial.number} not promoted: {error}")
            return
        finally:
            trial.set_user_attr("promotion_s", round(time.monotonic() - began, 1))
        trial.set_user_attr("promoted", bool(promoted))
        if promoted:
            self._best = (outcome.ood_accuracy, trial.number)
            self._say(f"round {trial.number} promoted: ood {outcome.ood_accuracy:.1f}%")

    def _promote_to_submission(self, outcome: RoundOutcome, trial: optuna.Trial) -> bool:
        """The real promotion, checked on the round's own GPUs (free until the next round starts there) against the
        answers its evaluation recorded. The base is promoted whatever its format rate: it is the fallback."""
        from search import promotion, verification

        s = self.settings
        expected = verification.expected_answers(outcome.ood_rows) if outcome.ood_rows else None
        gpus = trial.user_attrs.get("gpus", [])
        timings: dict[str, float] = {}

        def check(path: Path) -> None:
            checked = promotion.check_submission(path, data=s.ood_val_path, expected=expected, gpus=gpus,
                                                 batch_size=s.eval_batch_size)  # fmt: skip
            timings.update({f"check_{part}": seconds for part, seconds in checked["seconds"].items()})

        base = trial.user_attrs.get("recipe") == space.BASE
        # A trained round's merged folder is this search's own: linked. The base model's folder is the user's: copied.
        own = outcome.merged_dir is not None and inside(outcome.merged_dir, s.rounds_dir)
        try:
            return promotion.promote(
                outcome.merged_dir,
                s.submission_path,
                min_format_rate=0.0 if base else s.min_format_rate,
                format_rate=outcome.format_rate,
                accuracy=outcome.ood_accuracy,
                trial=trial.number,
                details={"recipe": trial.user_attrs.get("recipe"), "check_rows": expected},
                check=check,
                copy_tree=promotion.link_tree if own else shutil.copytree,
                timings=timings,
                keep_dir=s.rounds_dir,  # what the submission held that no promotion wrote is kept, with the study
            )
        finally:
            if timings:  # where promotion_s went (nothing ran for a refused model)
                trial.set_user_attr("promotion_timings", timings)

    def _check_submission(self, gpus: list[int]) -> tuple[bool, str]:
        from search.promotion import final_check

        result = final_check(self.settings.submission_path, self.settings.ood_val_path, gpus=gpus,
                             batch_size=self.settings.eval_batch_size)  # fmt: skip
        return result.passed, result.line

    def _check_in_reserve(self) -> None:
        """The reserve's use: the submission checked as the verifier will use it, when the time left allows."""
        if self.final_check is None:
            return
        now = self.clock.now()
        if now + self.duration.check_seconds(CHECK_ROWS) > self.deadline:
            passed, line = False, f"FINAL CHECK SKIPPED: {_minutes(self.deadline - now)} left, too little to check"
        else:
            passed, line = self.final_check(self._slots[0])
        self.final_check_result = (passed, line)
        with contextlib.suppress(Exception):  # the line is printed whatever the storage does
            self.study.set_user_attr(FINAL_CHECK_ATTR, {"passed": passed, "line": line, "worker": self.worker,
                                                        "time": self.clock.now()})  # fmt: skip
        self._say(line)

    def _requeue_base(self, number: int) -> None:
        """Round 0 did not give a score: score the base once more, next (it is the fallback submission); at most
        twice a study."""
        tried = [t for t in self.study.get_trials(deepcopy=False) if t.user_attrs.get("recipe") == space.BASE]
        if len(tried) < 2:
            self._base_due = True
            self._say(f"round {number} gave the base model no score: it is scored once more, next")

    def _tell(self, trial: optuna.Trial, *args, **kwargs) -> None:
        """`study.tell`, raising UpdateFinishedTrialError when another worker finished the trial first (Optuna says
        ValueError then)."""
        try:
            self.study.tell(trial, *args, **kwargs)
        except ValueError:
            if self.study._storage.get_trial(trial._trial_id).state.is_finished():
                raise optuna.exceptions.UpdateFinishedTrialError(f"trial {trial.number} was finished") from None
            raise

    def _end_lost_round(self, r: _Round) -> None:
        """Another worker finished this round's trial (it took this worker for dead, or wrote to the study by hand):
        the round's processes are ended, its result is not recorded, and the search goes on."""
        for slot, running in list(self._running.items()):
            if running is r:
                del self._running[slot]
        self._heartbeat.remove(r.trial)
        with contextlib.suppress(Exception):  # already over, or unkillable: nothing more to do about it here
            r.handle.kill()
        stored = self.study._storage.get_trial(r.trial._trial_id)
        why = f"{stored.state.name}: {stored.user_attrs.get('reason') or 'no reason recorded'}"
        self._say(f"round {r.trial.number} ended here: another worker finished its trial ({why})")

    def _tell_failed(self, trial: optuna.Trial, reason: str, *, count: bool = True) -> None:
        trial.set_user_attr("state", RoundState.FAILED)
        trial.set_user_attr("reason", reason)
        self._tell(trial, state=TrialState.FAIL)
        self._say(f"round {trial.number} failed: {reason}")
        if count:
            self._count(RoundState.FAILED)

    def _count(self, state: RoundState) -> None:
        self._failures = self._failures + 1 if state == RoundState.FAILED else 0
        if self._failures >= MAX_CONSECUTIVE_FAILURES:
            self._close(f"{self._failures} rounds in a row failed: see their reasons and train.log")

    def _close(self, why: str) -> None:
        if self._closed is None:
            self._closed = why
            waiting = f"; waiting for {len(self._running)} running round(s)" if self._running else ""
            self._say(f"no more rounds: {why}{waiting}")

    # ------------------------------------------------------------------ the merge stage
    def _advance_stage(self, now: float) -> None:
        """Once the rounds are over (no more start, none still trains): plan the stage, launch its candidates on the
        free slots while they fit before the reserve, and decide when nothing more runs or can be launched."""
        if self._closed is None or self._stage_over or any(r.config is not None for r in self._running.values()):
            return
        if self._stage is None:
            self._stage = self._plan_stage()
            if self._stage is None:
                self._stage_over = True
                return
        for slot in range(len(self._slots)):
            if slot not in self._running and not self._launch_merge(slot, now):
                break
        if not any(r.merge for r in self._running.values()):
            self._decide_stage()

    def _plan_stage(self) -> merge_stage.MergeStage | None:
        """The stage over the kept rounds this box could promote, scored on the same rows as the submission."""
        m, trials = self.settings.merge, self.study.get_trials(deepcopy=False)
        reference = self._submission_rows(trials)
        found = []
        for t in trials:
            attrs, rows = t.user_attrs, selection.read_rows_attr(t.user_attrs)
            if t.state != TrialState.COMPLETE or attrs.get("recipe") in (space.BASE, space.MERGE) or rows is None:
                continue
            if reference is not None and (rows[0] != reference[0] or len(rows[1]) != len(reference[1])):
                continue  # scored on other rows: no paired comparison
            promotable = (attrs.get("format_rate") or 0.0) >= self.settings.min_format_rate
            if promotable and "promotion_error" not in attrs and self.backend.has_weights(attrs.get("merged_dir", "")):
                found.append(merge_stage.Ingredient(t.number, attrs["merged_dir"], tuple(rows[1]),
                                                    int(attrs.get("total_steps", 0))))  # fmt: skip
        ranked = merge_stage.rank(found, top_k=m.top_k, seed=self.settings.seed, held_out_share=m.held_out_share)
        if not ranked:
            self._say("merge stage: no completed round to merge")
            return None
        self._stage_ingredients = {i.trial: i for i in ranked}
        self._say(f"merge stage over rounds {', '.join(str(i.trial) for i in ranked)}, predicted "
                  f"{_minutes(self.stage_seconds())} of {_minutes(self.end_of_stage - self.clock.now())}")  # fmt: skip
        return merge_stage.MergeStage(ranked, reference[1] if reference else None, m.etas, m.held_out_share,
                                      self.settings.seed)  # fmt: skip

    def _submission_rows(self, trials: list[FrozenTrial]) -> tuple[str, list[bool]] | None:
        number = self._best[1] if self._best else None
        held = [t for t in trials if t.number == number]
        return selection.read_rows_attr(held[0].user_attrs) if held else None

    def _launch_merge(self, slot: int, now: float) -> bool:
        """Start the stage's next candidate on `slot`; False when none is ready or it would not fit in time."""
        ready = self._stage.ready()
        if not ready:
            return False
        candidate = ready[0]
        ingredients = [self._stage_ingredients[n] for n in candidate.ingredients]
        spec = MergeSpec(tuple(i.merged_dir for i in ingredients), self.settings.model_path, candidate.eta)
        predicted = self.duration.merge_seconds(spec.models_read)
        if now + predicted > self.end_of_stage:
            return False
        trial = self._new_trial(space.MERGE)
        run_dir, gpus = self._run_dir(trial), self._slots[slot]
        _set_user_attrs(trial, {
            "worker": self.worker,
            HEARTBEAT_ATTR: time.time(),
            "parent": list(candidate.ingredients),
            "ingredients": list(candidate.ingredients),
            "eta": candidate.eta,
            "merge_kind": candidate.kind,
            "models_read": spec.models_read,
            "steps": 0,
            "predicted_s": round(predicted, 1),
            "allotted_s": round(self.end_of_stage - now, 1),
            "run_dir": str(run_dir),
            "gpus": gpus,
            "started_at": now,
        })  # fmt: skip
        self._stage.launched(candidate)
        try:
            handle = self.backend.merge(spec, str(run_dir), gpus)
        except OSError as error:
            self._stage.scored(candidate, None)
            self._tell_failed(trial, f"could not start the merge: {error}")
            return True
        self._running[slot] = _Round(trial, None, gpus, handle, now, self.end_of_stage, stop_at=math.inf,
                                     kill_at=self.end_of_stage, last_line_at=now, merge=candidate)  # fmt: skip
        self._heartbeat.add(trial)
        self._say(f"round {trial.number} starts on {_gpus(gpus)}: {_merge_text(candidate)}, predicted "
                  f"{_minutes(predicted)}")  # fmt: skip
        return True

    def _finish_merge(self, r: _Round, now: float) -> None:
        outcome = r.handle.outcome()
        if r.killed:
            outcome.state, outcome.reason, outcome.failure = RoundState.FAILED, r.killed, FailureKind.ERROR
        elif outcome.state.saved and outcome.ood_accuracy is None:
            outcome.state, outcome.reason = RoundState.FAILED, "the evaluation gave no OOD accuracy"
        self.duration.observe(None, 0, outcome.timings, models_read=r.trial.user_attrs.get("models_read", 0))
        scored = outcome.state.saved
        rows = selection.correctness(outcome.ood_rows) if scored and outcome.ood_rows else None
        comparable = rows is not None and len(rows) == len(self._stage.ingredients[0].correct)
        self._stage.scored(r.merge, rows if comparable else None)
        attrs = {
            "state": outcome.state,
            "reason": outcome.reason,
            "val_accuracy": outcome.val_accuracy,
            "format_rate": outcome.format_rate,
            "mean_completion_tokens": outcome.mean_completion_tokens,
            "steps_done": 0,
            "duration_s": round(now - r.started, 1),
            "ended_at": now,
            "timings": {key: round(float(value), 1) for key, value in outcome.timings.items()},
            "total_steps": max(i.total_steps for i in (self._stage_ingredients[n] for n in r.merge.ingredients)),
        }
        if scored:
            attrs["merged_dir"] = outcome.merged_dir
            if outcome.ood_rows:
                attrs[selection.OOD_ROWS] = selection.rows_attr(outcome.ood_rows)
        if comparable:
            attrs["selection_accuracy"] = round(self._stage.selection_accuracy(rows), 2)
            lead = self._stage.held_out_lead(rows)
            if lead is not None:
                attrs["held_out_lead"] = [round(lead.points, 2), round(lead.low, 2), round(lead.high, 2), lead.n]
        _set_user_attrs(r.trial, attrs)
        if not comparable:
            if scored:
                self._tell(r.trial, outcome.ood_accuracy)
            else:
                self._tell(r.trial, state=TrialState.FAIL)
            self._heartbeat.remove(r.trial)
            self._say(f"round {r.trial.number} (merge) {outcome.state}: {outcome.reason or 'no comparable rows'}")
            self._round_ended(r.trial, outcome)
            return
        self._pending.append((r.trial, outcome, r.merge))
        self._say(f"round {r.trial.number} (merge) scored: ood {outcome.ood_accuracy:.1f}%, selection rows "
                  f"{attrs['selection_accuracy']:.1f}% after {_minutes(now - r.started)}")  # fmt: skip
        self._drop_beaten_candidates()

    def _drop_beaten_candidates(self) -> None:
        """Delete the weights of scored candidates that are not the best on the selection rows: only the best can be
        chosen, and every later candidate is built from the rounds, so disk holds one candidate beside the rounds."""
        from search.promotion import delete_weights  # late: promotion loads the verifier's protocol

        best = max(self._pending, key=lambda p: p[0].user_attrs.get("selection_accuracy", -1.0))
        for trial, outcome, _ in self._pending:
            if trial is not best[0] and outcome.merged_dir and self.backend.has_weights(outcome.merged_dir):
                delete_weights(trial.user_attrs.get("run_dir"), self.settings.rounds_dir)

    def _decide_stage(self) -> None:
        """The stage's choice promoted when it passes the guard (search.merge_stage) and the format floor; every scored
        candidate told."""
        self._stage_over = True
        if self._stage is None:
            return
        decision = self._stage.decide()
        for trial, outcome, candidate in self._pending:
            chosen = decision.chosen is not None and candidate.key == decision.chosen.key
            trial.set_user_attr("merge_chosen", chosen)
            if chosen:
                promote = decision.promote and (outcome.format_rate or 0.0) >= self.settings.min_format_rate
                why = decision.why if promote or not decision.promote else "its format rate is below min_format_rate"
                trial.set_user_attr("merge_decision", ("promoted: " if promote else "kept out: ") + why)
                beats = self._best is None or outcome.ood_accuracy > self._best[0]
                if promote and beats:
                    self._promote(trial, outcome)
                self._say(f"merge stage chose round {trial.number} ({_merge_text(candidate)}): "
                          f"{trial.user_attrs['merge_decision']}")  # fmt: skip
        if decision.chosen is None:
            self._say(f"merge stage: {decision.why}")
        pending, self._pending = self._pending, []
        for trial, outcome, _ in pending:
            if self.on_round_scored is not None:
                self.on_round_scored(trial, outcome)
            self._tell(trial, outcome.ood_accuracy)
            self._heartbeat.remove(trial)
            self._round_ended(trial, outcome)

    def _round_ended(self, trial: optuna.Trial, outcome: RoundOutcome) -> None:
        if self.on_round_end is not None:
            self.on_round_end(self.study.get_trials(deepcopy=False)[trial.number], outcome)

    # ------------------------------------------------------------------ sharing the study, resuming
    def _learn_from_history(self) -> None:
        """A resumed search keeps what earlier runs learnt: their timings and their promoted best. A study whose base
        model has no score and is not being scored (a study of an older search, round 0 killed) queues it again."""
        finished = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
        live = (TrialState.COMPLETE, TrialState.RUNNING, TrialState.WAITING)
        trials = self.study.get_trials(deepcopy=False, states=live)
        self._base_due = not any(t.user_attrs.get("recipe") == space.BASE for t in trials)
        unreadable = 0
        for t in self.study.get_trials(deepcopy=False, states=finished):
            attrs = t.user_attrs
            if "timings" in attrs and ("config" in attrs or attrs.get("recipe") in (space.BASE, space.MERGE)):
                recorded = _recorded_round(attrs)
                if recorded is None:
                    unreadable += 1
                else:
                    models = attrs.get("models_read", 0) if attrs.get("recipe") == space.MERGE else 0
                    self.duration.observe(*recorded, models_read=models if isinstance(models, int) else 0)
            if self._into_submission:
                continue
            if attrs.get("promoted") and t.value is not None and (self._best is None or t.value > self._best[0]):
                self._best = (t.value, t.number)
        if unreadable:
            warn(f"warning: {unreadable} finished round(s) of the study have unreadable timings; not learnt from")
        if self._into_submission:
            # What this box's submission holds, not the study's best promoted trial: with several boxes on one study
            # each promotes into its own submission folder, and a box that joins late must still fill its own.
            from search.promotion import promoted  # late: see _promote_to_submission

            marker = promoted(self.settings.submission_path)
            if marker is not None and isinstance(marker.get("accuracy"), (int, float)):
                self._best = (float(marker["accuracy"]), marker.get("trial"))

    def _sweep(self) -> None:
        """Fail the RUNNING trials of dead workers: one on this host whose process (or scheduler) is gone, or any whose
        heartbeat has not moved for ORPHAN_AFTER_S of this process's own time."""
        seen_at = _liveness_clock()
        ours = {r.trial.number for r in self._running.values()}
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if t.number in ours:
                continue
            beat = t.user_attrs.get(HEARTBEAT_ATTR)
            last = self._beats.get(t.number)
            if last is None or last[0] != beat:
                self._beats[t.number] = last = (beat, seen_at)
            dead_here = _dead_worker(t.user_attrs.get("worker"))
            if dead_here or seen_at - last[1] >= ORPHAN_AFTER_S:
                self._fail_orphan(t, reap=dead_here)

    def _fail_orphan(self, t: FrozenTrial, *, reap: bool = False) -> None:
        reason = "orphaned: the scheduler stopped during this round"
        # Its processes run in their own sessions and outlive a scheduler killed with SIGKILL (their leader gets
        # SIGTERM then, see local_backend; a process deaf to it, or a straggler, would hold the GPUs): a worker
        # known dead on this host leaves its round's process groups to us.
        reap_orphan = getattr(self.backend, "reap_orphan", None)
        killed: list[int] = []
        if reap and reap_orphan is not None and isinstance(t.user_attrs.get("run_dir"), str):
            try:
                killed = reap_orphan(t.user_attrs["run_dir"])
            except Exception as error:  # noqa: BLE001 - the sweep goes on; the trial is still failed
                self._say(f"round {t.number}: could not end its processes: {type(error).__name__}: {error}")
        trial = optuna.trial.Trial(self.study, t._trial_id)  # the live handle of a stored trial
        try:
            trial.set_user_attr("state", RoundState.FAILED)
            trial.set_user_attr("reason", reason)
            if killed:
                trial.set_user_attr("reaped_process_groups", killed)
            self.study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)
        except optuna.exceptions.UpdateFinishedTrialError:
            return  # its worker was alive after all and told it meanwhile
        self._say(f"round {t.number} {reason} (worker {t.user_attrs.get('worker', 'unknown')})")

    def _abandon_running(self) -> None:
        """The loop is leaving with rounds still running (an exception, Ctrl-C): kill them, since they run in their
        own process groups and would hold the GPUs, and record why. Errors here must not hide the one that got us
        here."""
        for slot in list(self._running):
            r = self._running.pop(slot)
            self._heartbeat.remove(r.trial)
            with contextlib.suppress(Exception):
                r.handle.kill()
            with contextlib.suppress(Exception):
                r.trial.set_user_attr("state", RoundState.FAILED)
                r.trial.set_user_attr("reason", "interrupted: the scheduler stopped during this round")
                self.study.tell(r.trial, state=TrialState.FAIL)
        pending, self._pending = self._pending, []
        for trial, _, _ in pending:  # scored merges the stage had not decided on
            self._heartbeat.remove(trial)
            with contextlib.suppress(Exception):
                trial.set_user_attr("reason", "interrupted: the scheduler stopped before the merge stage decided")
                self.study.tell(trial, state=TrialState.FAIL)
        with contextlib.suppress(Exception):  # ours but in neither list: being launched, or ending (a promotion)
            for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
                if t.user_attrs.get("worker") == self.worker:
                    trial = optuna.trial.Trial(self.study, t._trial_id)
                    trial.set_user_attr("state", RoundState.FAILED)
                    trial.set_user_attr("reason", "interrupted: the scheduler stopped as this round started or ended")
                    self.study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)

    # ------------------------------------------------------------------ the display
    def _status(self, now: float) -> None:
        rounds = sorted(self._running.values(), key=lambda r: r.trial.number)
        key = tuple((r.trial.number, r.handle.phase(), r.pruned, r.stopped) for r in rounds)
        if key == self._status_key and now - self._status_at < STATUS_EVERY_S:
            return
        self._status_key, self._status_at = key, now
        parts = []
        for r in rounds:
            if r.merge is not None and r.handle.phase() == Phase.TRAINING:
                text = "building a merge"
            elif r.handle.phase() == Phase.TRAINING:
                line = r.latest
                text = f"step {line.get('step', 0)}/{r.config.steps}"
                if isinstance(line.get("reward"), (int, float)):
                    text += f" reward {line['reward']:.2f}"
                if r.latest_ood is not None:
                    text += f" ood {r.latest_ood:.1f}"
            else:
                text = Phase.EVALUATING
            parts.append(f"#{r.trial.number} {_gpus(r.gpus)} {text}")
        self._say(" | ".join(parts + [self._best_text()]))

    def _best_text(self) -> str:
        return f"best ood {self._best[0]:.1f}% (round {self._best[1]})" if self._best else "nothing promoted yet"

    def _say(self, message: str) -> None:
        # The clock is read here, not where the line was composed: a promotion's check can take minutes in between.
        say(f"[search {_minutes(self.deadline - self.clock.now())} left] {message}")


def _set_user_attrs(trial: optuna.Trial, attrs: dict) -> None:
    for key, value in attrs.items():
        trial.set_user_attr(key, value)


def _dead_worker(worker: object) -> bool:
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


def _recorded_round(attrs: dict) -> tuple[TrialConfig | None, int, dict[str, float]] | None:
    """A finished trial's configuration, steps and timings as the DurationModel takes them, or None when they are not
    what this search records (storage content: another version, another tool, or a hand may have written it)."""
    try:
        config = TrialConfig.from_dict(attrs["config"]) if "config" in attrs else None  # None: round 0 scored only
    except (InvalidValue, TypeError):
        return None
    steps, timings = attrs.get("steps_done", 0), attrs["timings"]
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0 or not isinstance(timings, dict):
        return None
    parts = {*TIMING_KEYS, *(f"{key}_at_least" for key in TIMING_KEYS)}
    if not all(key in parts and is_number(value) and math.isfinite(value) for key, value in timings.items()):
        return None
    return config, steps, timings


def _merge_text(candidate: merge_stage.Candidate) -> str:
    what = f"{candidate.kind} soup of rounds {'+'.join(map(str, candidate.ingredients))}"
    return what if candidate.eta == 1.0 else f"{what} at eta {candidate.eta:g} from the base"


def _describe(config: TrialConfig) -> str:
    kind = f"LoRA r{config.lora_rank}" if config.lora_rank else "full"
    rewards = "+".join(name for name, w in config.reward_weights.items() if w > 0)
    return f"{kind} lr {config.learning_rate:.2g} beta {config.beta:.2g} G{config.num_generations} [{rewards}]"


def _gpus(gpus: list[int]) -> str:
    return f"gpu {','.join(map(str, gpus))}" if gpus else "cpu"


def _minutes(seconds: float) -> str:
    seconds = max(0.0, seconds)
    hours, minutes = divmod(int(round(seconds / 60)), 60)
    return f"{hours}h{minutes:02d}" if hours else f"{minutes} min"
