"""What the scheduler calls to hand a round in, injected like its backend.

`SubmissionPromoter` is the real one: a checked promotion into `submission_path` (search.promotion.submission), the
submission's PROMOTED.json the record of what it holds, and its final check in the reserve. `RecordingPromoter`
copies nothing (`--simulate`, tests): the scheduler records its decision on the trial.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol

from search import space
from search.folders import inside
from search.promotion import submission, verification
from search.log import minutes

if TYPE_CHECKING:
    import optuna

    from search.backends import RoundOutcome
    from search.duration import DurationModel
    from search.settings import Settings


class Promoter(Protocol):
    def promote(self, outcome: RoundOutcome, trial: optuna.Trial) -> bool:
        """Hand in the scored round (it beats what is held); False when refused. An exception keeps what is held."""

    def check_in_reserve(self, seconds_left: float, gpus: list[int],
                         duration: DurationModel) -> tuple[bool, str] | None:  # fmt: skip
        """The submission checked as the verifier will use it on `gpus`, when `seconds_left` allow by `duration`'s
        prediction: (passed, the line to print); None: nothing to check."""

    def holds(self, study_best: tuple[float, int] | None) -> tuple[float, int | None] | None:
        """(accuracy, trial) of what the submission holds when the search starts, given the best promoted trial the
        study records; None: nothing."""


def promote_recorded(promoter: Promoter, outcome: RoundOutcome, trial: optuna.Trial) -> tuple[bool, str | None]:
    """`promoter.promote`, with what happened recorded on the trial (`promoted`, `promotion_s`, `promotion_error`):
    (promoted, None), or (False, the error) when it failed; a failed promotion keeps the previous submission."""
    began = time.monotonic()  # real seconds (not the clock's): what the check and copy cost, for the overhead
    try:
        promoted = promoter.promote(outcome, trial)
    except Exception as error:  # noqa: BLE001 - the search goes on with what the submission held
        trial.set_user_attr("promotion_error", f"{type(error).__name__}: {error}")
        return False, str(error)
    finally:
        trial.set_user_attr("promotion_s", round(time.monotonic() - began, 1))
    trial.set_user_attr("promoted", bool(promoted))
    return bool(promoted), None


class SubmissionPromoter:
    """Promotions into `settings.submission_path`, checked on the round's own GPUs (free until the next round starts
    there) against the answers its evaluation recorded. The base is promoted whatever its format rate: it is the
    fallback."""

    def __init__(self, settings: Settings):
        self.settings = settings

    def promote(self, outcome: RoundOutcome, trial: optuna.Trial) -> bool:
        s = self.settings
        expected = verification.expected_answers(outcome.ood_rows) if outcome.ood_rows else None
        gpus = trial.user_attrs.get("gpus", [])
        timings: dict[str, float] = {}

        def check(path: Path) -> None:
            checked = submission.check_submission(path, data=s.ood_val_path, expected=expected, gpus=gpus,
                                                  batch_size=s.eval_batch_size)  # fmt: skip
            timings.update({f"check_{part}": seconds for part, seconds in checked["seconds"].items()})

        base = trial.user_attrs.get("recipe") == space.BASE
        # A trained round's merged folder is this search's own: linked. The base model's folder is the user's: copied.
        own = outcome.merged_dir is not None and inside(outcome.merged_dir, s.rounds_dir)
        try:
            return submission.promote(
                outcome.merged_dir,
                s.submission_path,
                min_format_rate=0.0 if base else s.min_format_rate,
                format_rate=outcome.format_rate,
                accuracy=outcome.ood_accuracy,
                trial=trial.number,
                details={"recipe": trial.user_attrs.get("recipe"), "check_rows": expected},
                check=check,
                copy_tree=submission.link_tree if own else shutil.copytree,
                timings=timings,
                keep_dir=s.rounds_dir,  # what the submission held that no promotion wrote is kept, with the study
            )
        finally:
            if timings:  # where promotion_s went (nothing ran for a refused model)
                trial.set_user_attr("promotion_timings", timings)

    def check_in_reserve(self, seconds_left: float, gpus: list[int], duration: DurationModel) -> tuple[bool, str]:
        if duration.check_seconds(verification.CHECK_ROWS) > seconds_left:
            return False, f"FINAL CHECK SKIPPED: {minutes(seconds_left)} left, too little to check"
        result = submission.final_check(self.settings.submission_path, self.settings.ood_val_path, gpus=gpus,
                                        batch_size=self.settings.eval_batch_size)  # fmt: skip
        return result.passed, result.line

    def holds(self, study_best: tuple[float, int] | None) -> tuple[float, int | None] | None:
        # What this box's submission holds, not the study's best promoted trial: with several boxes on one study each
        # promotes into its own submission folder, and a box that joins late must still fill its own.
        marker = submission.promoted(self.settings.submission_path)
        if marker is not None and isinstance(marker.get("accuracy"), (int, float)):
            return float(marker["accuracy"]), marker.get("trial")
        return None


class RecordingPromoter:
    """A promotion that copies nothing: `decide(outcome, trial)` says whether it happened (default: always)."""

    def __init__(self, decide: Callable[[RoundOutcome, optuna.Trial], bool] | None = None):
        self._decide = decide

    def promote(self, outcome: RoundOutcome, trial: optuna.Trial) -> bool:
        return True if self._decide is None else self._decide(outcome, trial)

    def check_in_reserve(self, seconds_left: float, gpus: list[int], duration: DurationModel) -> None:
        return None  # nothing was handed in

    def holds(self, study_best: tuple[float, int] | None) -> tuple[float, int] | None:
        return study_best
