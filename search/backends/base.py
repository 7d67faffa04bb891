"""What a backend does for the scheduler: run one round (train, then evaluate) and report how it went.

The split follows Syne Tune: the scheduler decides what runs, where and until when; a backend only runs a round
and answers polls. `LocalBackend` runs the real trainer and evaluator as processes; `SimulatedBackend` fakes both
on a virtual clock. Nothing here blocks: the scheduler polls `done()` and stops or kills rounds itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from search.merge import MergeSpec
from trainer.config import TrialConfig
from trainer.run_folder import FailureKind, Phase, RoundState

if TYPE_CHECKING:  # the fit check imports torch; only its type is named here
    from search.backends.fit import Fit

# Keys of `RoundOutcome.timings`, all measured wall-clock seconds. `DurationModel.observe` fits on these.
#   setup: launch of the trainer process until its first step (imports and model loading included),
#   train: the trainer's own training time (in-round evaluations included), save: saving and merging,
#   eval:  the evaluation (OOD, then the val health check, from one load of the model), from the moment its
#          process is told the model is saved (it starts beside the trainer) to its end,
#   build: a merge candidate's weights averaged and written (search.merge.soup); a merge has no setup, train or save.
# A part is absent when it did not run or failed. A part cut short by a kill is reported as `<part>_at_least`: a
# lower bound that still corrects a model that under-predicts (otherwise every late round would be killed again).
TIMING_KEYS = ("setup", "train", "save", "eval", "build")


@dataclass
class RoundOutcome:
    state: RoundState
    reason: str | None
    ood_accuracy: float | None  # the objective: the OOD report's accuracy_pct
    val_accuracy: float | None  # the health check on a val subset
    format_rate: float | None  # on OOD: percent of completions the verifier could parse (the evaluator's report)
    mean_completion_tokens: float | None
    steps_done: int
    timings: dict[str, float] = field(default_factory=dict)
    merged_dir: str | None = None  # the saved, merged model (None when nothing usable was saved)
    # The OOD report's `per_row` (split index, gold and extracted answer of every scored row): paired comparisons
    # between rounds, and the answers a promoted copy of the model must give again (search.promotion.verification).
    ood_rows: dict | None = None
    failure: FailureKind | None = None  # why a FAILED round failed


class RoundHandle(Protocol):
    def progress(self) -> list[dict]:
        """New complete progress.jsonl lines since the last call."""

    def phase(self) -> Phase:
        """Where the round is."""

    def done(self) -> bool:
        """True once training and evaluation are over (or the round was killed); advances the round."""

    def request_stop(self, *, evaluate: bool = True) -> None:
        """End training after the current step (the trainer's STOP file); the model is saved. With
        `evaluate=False` (a pruned round) the evaluation is skipped to free the GPUs sooner."""

    def kill(self) -> None:
        """End the round now, whatever it is doing (the process group, then no evaluation)."""

    def outcome(self) -> RoundOutcome:
        """After `done()`: what the round achieved, read from its status and evaluation reports."""


class Backend(Protocol):
    def start(self, config: TrialConfig, gpus: list[int]) -> RoundHandle:
        """Start a round of `config` on `gpus` ([] = CPU); returns at once."""

    def score(self, model_dir: str, run_dir: str, gpus: list[int]) -> RoundHandle:
        """Start a round without training: the evaluations of the model in `model_dir` (the base model, round 0),
        reported in `run_dir`; its outcome is COMPLETED with 0 steps and `merged_dir` = `model_dir`."""

    def merge(self, spec: MergeSpec, run_dir: str, gpus: list[int]) -> RoundHandle:
        """Start a merge candidate: `spec`'s model built into `run_dir`/merged (search.merge.soup), then the evaluations
        of every round; its outcome is COMPLETED with 0 steps and timings `build` and `eval`."""

    def fit(self, config: TrialConfig, gpus: list[int]) -> Fit | None:
        """The memory plan of a round of `config` on the card of `gpus` (search.backends.fit), before it is started;
        None when there is nothing to check (the CPU, a card of unknown memory)."""

    def has_weights(self, merged_dir: str) -> bool:
        """Whether a round's merged model is still there to start another round from."""

    def wait(self, seconds: float) -> None:
        """Return after `seconds`, or sooner once a process of a running round has ended: the scheduler's pause
        between polls, so that it moves a round on (its evaluation, its promotion, the next round) at once."""
