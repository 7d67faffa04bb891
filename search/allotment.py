"""A round's time: fitted into what is left before the deadline, or refused when no useful version of it fits.

The deadline is a promise, so time decides first: a round starts only if a useful version of it (at least the
duration model's `min_useful_steps`) fits in its allotment, the time left before the rounds end capped at
`round_max_minutes`. Its steps are cut to fit. A late round is stopped early enough to finish its longest step and
its predicted save and evaluation within the allotment, so the steps are fitted with that step and a safety share to
spare: a round predicted right never meets its stop. It is killed if even that overruns by GRACE_SHARE, and never
past the end of the rounds.
"""

from __future__ import annotations

from dataclasses import dataclass

from search.duration import DurationModel
from trainer.config import TrialConfig

SAFETY_SHARE = 0.05  # of an allotment, left free when fitting the steps: the prediction's error margin
GRACE_SHARE = 0.1  # a round may overrun its allotment by this share of it (never into the reserve) before a kill
# Round 0 may take this many times its predicted evaluation (and at least round_min_minutes) before it is killed: it
# is the fallback submission, and the first evaluation's prediction is the prior's.
BASE_ALLOTMENT_FACTOR = 4.0


@dataclass(frozen=True)
class Allotment:
    """When a started round must be done: saved and scored by `end_by`, asked to stop at `stop_at` if it still
    trains, killed at `kill_at`. `steps`: the round's steps, fitted (0 for a round that trains nothing)."""

    steps: int
    predicted_s: float
    end_by: float
    stop_at: float
    kill_at: float


def fit_round(config: TrialConfig, duration: DurationModel, now: float, allotted: float,
              end_of_rounds: float) -> Allotment | None:  # fmt: skip
    """The round of `config` fitted into `allotted` seconds from `now`; None when not even its shortest useful
    version fits."""
    step_s = duration.longest_step(config)
    steps = duration.fit_steps(config, allotted - step_s - SAFETY_SHARE * allotted)
    if steps is None:
        return None
    estimate = duration.estimate(config, steps=steps)
    end_by = now + allotted
    return Allotment(steps, estimate.total, end_by, stop_at=end_by - estimate.tail - step_s,
                     kill_at=min(end_by + GRACE_SHARE * allotted, end_of_rounds))  # fmt: skip


def base_round(duration: DurationModel, now: float, round_min_minutes: float, deadline: float) -> Allotment:
    """Round 0, scoring the base model: it may run into the reserve (it is the fallback submission), not past the
    deadline."""
    predicted = duration.eval_seconds()
    end_by = min(deadline, now + max(BASE_ALLOTMENT_FACTOR * predicted, 60.0 * round_min_minutes))
    return Allotment(0, predicted, end_by, stop_at=end_by, kill_at=end_by)
