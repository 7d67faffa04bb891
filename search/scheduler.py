"""The search loop: ask Optuna for a round, fit it into the time left, run it on free GPUs, tell the result.

Rounds run side by side on disjoint GPU slots (several on each slot when `rounds_per_slot` says so); Optuna's TPE
treats the RUNNING ones as bad points (constant liar), so parallel rounds do not sample the same configuration. Time
decides first (search.allotment): no round runs into the reserve, nor into the time kept for the merge stage
(search.stage_runner), which runs once the rounds are over. After it, the reserve checks the submission as the
verifier will use it.

Round 0 scores the base model (recipe `base`, queued first): the first promotion whatever its format rate, so that
a search whose every round fails still hands in a scored, loadable model, and the zero point of every round's lead.
The scheduler decides; its collaborators act: the backend runs rounds (search.backends), the promoter hands models
in (search.promotion), the workers' heartbeats let several schedulers share a study (search.workers), the lineage
says where a round starts from. Everything time-related goes through `clock`: `--simulate` runs 7.5 hours in seconds.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import optuna
from optuna.trial import FrozenTrial, TrialState

from search import allotment, interrupts, lineage, space, trials, workers
from search.backends import Backend, Clock, Fit, RoundOutcome
from search.duration import DurationModel
from search.log import minutes, say
from search.promotion import Promoter, SubmissionPromoter, promote_recorded
from search.report import StatusLine, describe, describe_merge, gpus_text
from search.rounds import RunningRound, abandon, end_lost
from search.settings import Settings
from search.stage_runner import StageRunner
from search.study import FINAL_CHECK_ATTR
from trainer.config import ConfigError, TrialConfig
from trainer.run_folder import RoundState

POLL_S = 5.0  # between two polls of the running rounds at most: a round's process that ends wakes it (Backend.wait)
MAX_CONSECUTIVE_FAILURES = 5  # then something systematic is broken: stop launching rather than burn the budget
MAX_CONSECUTIVE_MISFITS = 10  # sampled configurations in a row too slow for round_max or too big for the card
OOD_ROWS_GUESS = 1000  # the brief's ood_val size, for the duration prior when ood_rows is null (all rows)

RoundEndHook = Callable[[FrozenTrial, RoundOutcome], None]


class Scheduler:
    def __init__(self, settings: Settings, study: optuna.Study, deadline: float, backend: Backend, clock: Clock, *,
                 promoter: Promoter | None = None, on_round_end: RoundEndHook | None = None,
                 on_round_scored: RoundEndHook | None = None, merge_only: bool = False):  # fmt: skip
        """`promoter` hands in a round that beats what the submission holds (None: into `submission_path`).
        `on_round_end(trial, outcome)` runs after each round is told (the leaderboard), `on_round_scored` just before,
        with the live trial (its plot: Optuna takes no artifact on a finished trial). `merge_only`: no round starts;
        the merge stage runs on the study's kept rounds, the deadline moved out to its time plus the reserve."""
        self.settings, self.study, self.deadline, self.backend, self.clock = settings, study, deadline, backend, clock
        self.promoter = promoter or SubmissionPromoter(settings)
        self.on_round_end, self.on_round_scored = on_round_end, on_round_scored
        self.final_check_result: tuple[bool, str] | None = None
        self.workers = workers.Workers(study, self._say, self._reap)
        self.duration = DurationModel(eval_rows=(settings.ood_rows or OOD_ROWS_GUESS) + settings.val_rows,
                                      prior_scale=settings.duration_prior_scale)  # fmt: skip
        self.stage = StageRunner(settings, by_hand=merge_only)
        self._merge_only = merge_only
        self._slots = settings.slots
        self._running: dict[int, RunningRound] = {}  # slot index -> round
        self._closed: str | None = None  # why no more rounds start
        self._failures = 0  # consecutive failed rounds
        self._misfits = 0  # consecutive configurations too slow for any round or too big for the card
        self._base_due = False  # round 0 is to be scored next, ahead of the queue (a resumed study, a failed one)
        self._best: tuple[float, int | None] | None = None  # (promoted ood accuracy, trial number)
        self._status = StatusLine()

    @property
    def end_of_stage(self) -> float:
        """Nothing runs past this but round 0: the deadline minus the reserve."""
        return self.deadline - 60.0 * self.settings.reserve_minutes

    @property
    def end_of_rounds(self) -> float:
        """No training round runs past this: the end of the stage minus the merge stage's predicted time."""
        over = self.stage.over and not self.stage.pending
        return self.end_of_stage - (0.0 if over else self.stage.seconds(self.duration, len(self._slots)))

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        self._base_due, study_best = trials.learn_from(self.study, self.duration)
        self._best = self.promoter.holds(study_best)  # a resumed search keeps what the submission holds
        if self._merge_only:
            self._close("the merge stage was asked for by hand")
            ahead = 60.0 * self.settings.reserve_minutes + 2 * self.stage.seconds(self.duration, len(self._slots))
            self.deadline = max(self.deadline, self.clock.now() + ahead)
        self.workers.start()
        sweep_at = -math.inf
        try:
            while True:
                now = self.clock.now()
                if now >= sweep_at:
                    self.workers.sweep({r.trial.number for r in self._running.values()})
                    sweep_at = now + workers.HEARTBEAT_S
                for slot, r in list(self._running.items()):
                    try:
                        if r.trial.number in self.workers.heartbeat.lost():
                            raise optuna.exceptions.UpdateFinishedTrialError(f"trial {r.trial.number} was finished")
                        self._poll(slot, now)
                    except optuna.exceptions.UpdateFinishedTrialError:
                        del self._running[slot]
                        self._say(end_lost(self.study, r, self.workers))
                for slot in range(len(self._slots)):
                    if self._closed is None and slot not in self._running:
                        try:
                            self._launch(slot, now)
                        except optuna.exceptions.UpdateFinishedTrialError as error:  # finished before it started
                            self._say(f"a round was finished by another worker before it started: {error}")
                self.stage.advance(self, now)
                if self._closed is not None and not self._running and self.stage.over:
                    break
                line = self._status.due(sorted(self._running.values(), key=lambda r: r.trial.number), now)
                if line is not None:
                    self._say(" | ".join(filter(None, [line, self._best_text()])))
                self.backend.wait(POLL_S)
        finally:
            self.workers.stop()
            rounds, self._running = list(self._running.values()), {}
            pending, self.stage.pending = [p[0] for p in self.stage.pending], []
            abandon(self.study, rounds, pending, self.workers)
        self._say(f"search over: {self._closed}; {self._best_text()}")
        self._check_in_reserve()

    def _launch(self, slot: int, now: float) -> None:
        allotted = min(self.end_of_rounds - now, 60.0 * self.settings.round_max_minutes)
        no_time = allotted < 60.0 * self.settings.round_min_minutes
        base_fits = now + self.duration.eval_seconds() <= self.deadline  # it may use the reserve, not more
        if no_time and not (base_fits and (self._base_due or lineage.base_waiting(self.study))):
            self._close(f"no time left for a useful round ({self._left_text(now)})")
            return
        with interrupts.deferred():  # a new trial is stamped ours before an interrupt, so `abandon` finds it
            if self._base_due and base_fits:
                trial, self._base_due = trials.new_trial(self.study, space.BASE), False
            else:
                trial = self.study.ask()
            self.workers.claim(trial)
        if trial.user_attrs.get("recipe") == space.BASE:
            self._launch_base(trial, slot, now)
            return
        if no_time:  # another worker took the base a moment ago
            self._tell_failed(trial, "no time left for a useful round", count=False)
            self._close(f"no time left for a useful round ({self._left_text(now)})")
            return
        run_dir, gpus = trials.run_dir(self.settings.rounds_dir, trial), self._slots[slot]
        try:
            config = space.sample_config(trial, self.settings, str(run_dir))
        except ConfigError as error:  # a sampled combination the trainer would refuse
            self._tell_failed(trial, f"invalid configuration: {error}")
            return
        fit = self.backend.fit(config, gpus)
        if fit is not None and not fit.fits:
            self._refuse(trial, fit.reason(), fit)
            return
        init = space.sampled_init(trial)
        parent = self.parent_of(init)
        config = config.replace(model_path=parent.model_path)
        allotted_round = allotment.fit_round(config, self.duration, now, allotted, self.end_of_rounds)
        if allotted_round is None:
            self._misfit(trial, config, allotted)
            return
        self._misfits = 0
        sampled_steps = config.steps
        if allotted_round.steps < sampled_steps:
            config = space.with_steps(config, allotted_round.steps)
        trials.set_attrs(trial, {
            "config": config.to_dict(), "init": init, "parent": parent.trial, "parent_total_steps": parent.total_steps,
            "steps": config.steps, "predicted_s": round(allotted_round.predicted_s, 1),
            "allotted_s": round(allotted, 1), "run_dir": str(run_dir), "gpus": gpus, "started_at": now,
            **(fit.attrs() if fit is not None else {}),
        })  # fmt: skip
        try:
            handle = self.backend.start(config, gpus)
        except OSError as error:  # e.g. the run folder cannot be written, the launcher is missing
            self._tell_failed(trial, f"could not start the round: {error}")
            return
        self._start(slot, RunningRound(trial, config, gpus, handle, now, allotted_round, parent=parent))
        cut = f" (cut from {sampled_steps})" if config.steps < sampled_steps else ""
        origin = "the base" if parent.model_path == self.settings.model_path else f"round {parent.trial}"
        self._say(f"round {trial.number} starts on {gpus_text(gpus)} from {origin}: {describe(config)}, "
                  f"{config.steps} steps{cut}, predicted {minutes(allotted_round.predicted_s)} of {minutes(allotted)}")

    def _launch_base(self, trial: optuna.Trial, slot: int, now: float) -> None:
        """Round 0: score the base model with the evaluations of every round."""
        run_dir, gpus = trials.run_dir(self.settings.rounds_dir, trial), self._slots[slot]
        allotted = allotment.base_round(self.duration, now, self.settings.round_min_minutes, self.deadline)
        trials.set_attrs(trial, {"steps": 0, "total_steps": 0, "predicted_s": round(allotted.predicted_s, 1),
                                 "allotted_s": round(allotted.end_by - now, 1), "run_dir": str(run_dir), "gpus": gpus,
                                 "started_at": now})  # fmt: skip
        try:
            handle = self.backend.score(self.settings.model_path, str(run_dir), gpus)
        except OSError as error:
            self._tell_failed(trial, f"could not start scoring the base model: {error}")
            self._requeue_base(trial.number)
            return
        self._start(slot, RunningRound(trial, None, gpus, handle, now, allotted))
        self._say(f"round {trial.number} starts on {gpus_text(gpus)}: scoring the base model, predicted "
                  f"{minutes(allotted.predicted_s)}")  # fmt: skip

    def _reap(self, run_dir: str) -> list[int]:  # the backend's, read at sweep time (a test may swap the backend)
        return getattr(self.backend, "reap_orphan", lambda _: [])(run_dir)

    def _start(self, slot: int, r: RunningRound) -> None:
        self._running[slot] = r
        self.workers.heartbeat.add(r.trial)

    def parent_of(self, init: str) -> lineage.Parent:
        """What a round of `init` starts from (search.lineage)."""
        return lineage.parent_of(init, self.study.get_trials(deepcopy=False), self.settings.model_path,
                                 self.settings.min_format_rate, self.backend.has_weights)  # fmt: skip

    def _misfit(self, trial: optuna.Trial, config: TrialConfig, allotted: float) -> None:
        """Not even the shortest useful version of the sampled round fits in its allotment. Near the end (the time
        left is the limit) the search is over; otherwise (round_max is) this configuration is too slow."""
        shortest = self.duration.min_useful_steps(config)
        needed = minutes(self.duration.estimate(config, steps=shortest).total)
        trial.set_user_attr("steps", shortest)
        if allotted < 60.0 * self.settings.round_max_minutes:
            self._tell_failed(trial, f"no time left for a useful round: {shortest} steps need {needed}", count=False)
            self._close(f"no time left for a useful round ({minutes(allotted)} before {self._rounds_end()})")
            return
        self._refuse(trial, f"too slow: its shortest useful round ({shortest} steps) needs {needed}, more than "
                            "round_max_minutes")  # fmt: skip

    def _refuse(self, trial: optuna.Trial, reason: str, fit: Fit | None = None) -> None:
        """A configuration too slow for round_max or too big for its card is not run: told PRUNED without a value,
        which TPE ranks below every scored trial, so it samples elsewhere; in seconds, not a round's minutes."""
        trials.set_attrs(trial, {"state": RoundState.PRUNED, "reason": reason, **(fit.attrs() if fit else {})})
        trials.tell(self.study, trial, state=TrialState.PRUNED)
        self._say(f"round {trial.number} not run: {reason}")
        self._misfits += 1
        if self._misfits >= MAX_CONSECUTIVE_MISFITS:
            self._close(f"{self._misfits} sampled configurations in a row do not fit their card or round_max_minutes")

    def _poll(self, slot: int, now: float) -> None:
        r = self._running[slot]
        for step, accuracy in r.read_progress(now):
            self._report(r, step, accuracy)
        if r.handle.done():
            self._finish(slot, now)
        elif r.overdue(now, self.settings.hang_minutes):
            r.handle.kill()
            self._finish(slot, self.clock.now())
        elif r.due_to_stop(now):
            r.stopped = "stopped: over its allotment"
            r.handle.request_stop()
            self._say(f"round {r.trial.number} {r.stopped} (step {r.latest.get('step', 0)}/{r.config.steps})")

    def _report(self, r: RunningRound, step: int, value: float) -> None:
        if r.pruned:
            return
        r.trial.report(value, step)
        if r.trial.should_prune():
            r.pruned = f"pruned by {type(self.study.pruner).__name__} at step {step}: ood subset accuracy {value:.1f}"
            r.handle.request_stop(evaluate=False)  # its model is not worth scoring: the GPUs free after the save
            self._say(f"round {r.trial.number} {r.pruned}")

    # ------------------------------------------------------------------ a round ends
    def _finish(self, slot: int, now: float) -> None:
        r = self._running.pop(slot)
        if r.merge is not None:
            self.stage.finish(self, r, now)
            return
        outcome = r.outcome()
        state = outcome.state
        self.duration.observe(r.config, outcome.steps_done, outcome.timings)  # the backend reports what was measured
        total = (r.parent.total_steps if r.parent else 0) + outcome.steps_done
        trials.set_attrs(r.trial, trials.outcome_attrs(outcome, r.started, now, total))
        if state.saved and self._beats_best(outcome):
            self._promote(r.trial, outcome)
        if r.config is None and not state.saved:
            self._requeue_base(r.trial.number)
        if self.on_round_scored is not None:
            self.on_round_scored(r.trial, outcome)
        trials.tell_outcome(self.study, r.trial, outcome)
        self.workers.heartbeat.remove(r.trial)  # only now: a promotion of minutes keeps the trial RUNNING, stamped
        self._count(state)
        score = f"ood {outcome.ood_accuracy:.1f}%, " if outcome.ood_accuracy is not None else ""
        self._say(f"round {r.trial.number} {state}: {score}{outcome.reason or 'ok'} after {minutes(now - r.started)}")
        self._round_ended(r.trial, outcome)

    def _beats_best(self, outcome: RoundOutcome) -> bool:
        return self._best is None or outcome.ood_accuracy > self._best[0]

    def _promote(self, trial: optuna.Trial, outcome: RoundOutcome) -> None:
        promoted, error = promote_recorded(self.promoter, outcome, trial)
        if error is not None:
            self._say(f"round {trial.number} not promoted: {error}")
        elif promoted:
            self._best = (outcome.ood_accuracy, trial.number)
            self._say(f"round {trial.number} promoted: ood {outcome.ood_accuracy:.1f}%")

    def _check_in_reserve(self) -> None:
        """The reserve's use: the submission checked as the verifier will use it, when the time left allows."""
        checked = self.promoter.check_in_reserve(self.deadline - self.clock.now(), self._slots[0], self.duration)
        if checked is None:
            return
        self.final_check_result = checked
        with contextlib.suppress(Exception):  # the line is printed whatever the storage does
            record = {"passed": checked[0], "line": checked[1], "worker": self.workers.id, "time": self.clock.now()}
            self.study.set_user_attr(FINAL_CHECK_ATTR, record)
        self._say(checked[1])

    def _requeue_base(self, number: int) -> None:
        """Round 0 gave no score: the base is scored once more, next (it is the fallback); at most twice a study."""
        tried = [t for t in self.study.get_trials(deepcopy=False) if t.user_attrs.get("recipe") == space.BASE]
        if len(tried) < 2:
            self._base_due = True
            self._say(f"round {number} gave the base model no score: it is scored once more, next")

    def _tell_failed(self, trial: optuna.Trial, reason: str, *, count: bool = True) -> None:
        trials.set_attrs(trial, {"state": RoundState.FAILED, "reason": reason})
        trials.tell(self.study, trial, state=TrialState.FAIL)
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

    def _round_ended(self, trial: optuna.Trial, outcome: RoundOutcome) -> None:
        if self.on_round_end is not None:
            self.on_round_end(self.study.get_trials(deepcopy=False)[trial.number], outcome)

    # ------------------------------------------------------------------ the display
    def _left_text(self, now: float) -> str:
        return f"{minutes(self.end_of_rounds - now)} before {self._rounds_end()}"

    def _rounds_end(self) -> str:
        return "the reserve" if self.end_of_rounds == self.end_of_stage else "the merge stage"

    def _best_text(self) -> str:
        return f"best ood {self._best[0]:.1f}% (round {self._best[1]})" if self._best else "nothing promoted yet"

    def _say(self, message: str) -> None:
        # The clock is read here, not where the line was composed: a promotion's check can take minutes in between.
        say(f"[search {minutes(self.deadline - self.clock.now())} left] {message}")
