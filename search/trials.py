"""The study's trials as a scheduler writes them: attributes, telling, trials it creates itself, and its leftovers.

Several schedulers may share one study, so a write can meet a trial another worker finished: `tell` says so with
Optuna's UpdateFinishedTrialError (Optuna itself raises ValueError then).
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import optuna
from optuna.trial import TrialState

from common.validation import InvalidValue, is_number
from search import selection, space
from search.backends import TIMING_KEYS, RoundOutcome
from search.duration import DurationModel
from search.log import warn
from trainer.config import TrialConfig
from trainer.run_folder import FailureKind, RoundState

# Failures the configuration itself causes: told PRUNED, a bad point TPE learns to avoid, instead of FAIL, which TPE
# ignores (it models COMPLETE, PRUNED and RUNNING trials only) and so would keep sampling there. The trial's `state`
# attribute still says failed.
CONFIG_FAILURES = frozenset({FailureKind.NAN, FailureKind.OUT_OF_MEMORY})


def run_dir(rounds_dir: str, trial: optuna.Trial) -> Path:
    """A round's folder, inside the study's own rounds folder (several studies may share one runs folder)."""
    return Path(rounds_dir) / f"round-{trial.number:04d}"


def set_attrs(trial: optuna.Trial, attrs: dict) -> None:
    for key, value in attrs.items():
        trial.set_user_attr(key, value)


def tell(study: optuna.Study, trial: optuna.Trial, *args, **kwargs) -> None:
    """`study.tell`, raising UpdateFinishedTrialError when another worker finished the trial first."""
    try:
        study.tell(trial, *args, **kwargs)
    except ValueError:
        if study._storage.get_trial(trial._trial_id).state.is_finished():
            raise optuna.exceptions.UpdateFinishedTrialError(f"trial {trial.number} was finished") from None
        raise


def tell_outcome(study: optuna.Study, trial: optuna.Trial, outcome: RoundOutcome) -> None:
    """A finished round told: its OOD accuracy when scored; PRUNED when pruned or failed by its configuration
    (Optuna keeps the last reported value); FAIL otherwise."""
    if outcome.state.saved:
        tell(study, trial, outcome.ood_accuracy)
    elif outcome.state == RoundState.PRUNED or outcome.failure in CONFIG_FAILURES:
        tell(study, trial, state=TrialState.PRUNED)
    else:
        tell(study, trial, state=TrialState.FAIL)


def new_trial(study: optuna.Study, recipe: str) -> optuna.Trial:
    """A trial of `recipe` (round 0, a merge) claimed at once, ahead of the queue (enqueue_trial would put it behind
    any waiting warm start). Optuna's public API creates RUNNING trials only through ask(), which pops the queue
    first: hence its storage."""
    template = optuna.trial.create_trial(state=TrialState.RUNNING, user_attrs={"recipe": recipe})
    trial_id = study._storage.create_new_trial(study._study_id, template_trial=template)
    return optuna.trial.Trial(study, trial_id)


def fail(study: optuna.Study, trial: optuna.Trial, reason: str, *, state: RoundState | None = RoundState.FAILED,
         skip_if_finished: bool = False) -> None:  # fmt: skip
    """Record `reason` (and `state`, unless None) and tell the trial FAIL."""
    if state is not None:
        trial.set_user_attr("state", state)
    trial.set_user_attr("reason", reason)
    study.tell(trial, state=TrialState.FAIL, skip_if_finished=skip_if_finished)


def fail_leftovers(study: optuna.Study, worker: str, reason: str) -> None:
    """Fail the RUNNING trials stamped with `worker` (being launched, or ending in a promotion, when the scheduler
    stopped). Errors are swallowed: this runs while another error or an interrupt is on its way out."""
    with contextlib.suppress(Exception):
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if t.user_attrs.get("worker") == worker:
                fail(study, optuna.trial.Trial(study, t._trial_id), reason, skip_if_finished=True)


def outcome_attrs(outcome: RoundOutcome, started: float, now: float, total_steps: int) -> dict:
    """What a finished round or merge records on its trial from its outcome."""
    attrs = {
        "state": outcome.state,
        "reason": outcome.reason,
        "val_accuracy": outcome.val_accuracy,
        "format_rate": outcome.format_rate,
        "mean_completion_tokens": outcome.mean_completion_tokens,
        "steps_done": outcome.steps_done,
        "duration_s": round(now - started, 1),
        "ended_at": now,
        "timings": {key: round(float(value), 1) for key, value in outcome.timings.items()},
        "total_steps": total_steps,
    }
    if outcome.failure is not None:
        attrs["failure"] = outcome.failure
    if outcome.state.saved:
        attrs["merged_dir"] = outcome.merged_dir
        if outcome.ood_rows:
            attrs[selection.OOD_ROWS] = selection.rows_attr(outcome.ood_rows)
    return attrs


def recorded_round(attrs: dict) -> tuple[TrialConfig | None, int, dict[str, float]] | None:
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



def learn_from(study: optuna.Study, duration: DurationModel) -> tuple[bool, tuple[float, int] | None]:
    """What a resumed search keeps from earlier runs: their timings (into `duration`), and the best promoted trial
    the study records. Also whether round 0 is due: a study whose base model has no score and is not being scored
    (round 0 killed) queues it again."""
    live = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.RUNNING, TrialState.WAITING))
    base_due = not any(t.user_attrs.get("recipe") == space.BASE for t in live)
    best: tuple[float, int] | None = None
    unreadable = 0
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)):
        attrs = t.user_attrs
        if "timings" in attrs and ("config" in attrs or attrs.get("recipe") in (space.BASE, space.MERGE)):
            recorded = recorded_round(attrs)
            models = attrs.get("models_read", 0) if attrs.get("recipe") == space.MERGE else 0
            if recorded is None:
                unreadable += 1
            else:
                duration.observe(*recorded, models_read=models if isinstance(models, int) else 0)
        if attrs.get("promoted") and t.value is not None and (best is None or t.value > best[0]):
            best = (t.value, t.number)
    if unreadable:
        warn(f"warning: {unreadable} finished round(s) of the study have unreadable timings; not learnt from")
    return base_due, best
