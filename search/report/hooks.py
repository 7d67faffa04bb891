"""What a search does around each round besides running it: its plot, deleting old weights, the leaderboard.

A failure in a hook is reported and the search goes on: hours of rounds outweigh a plot or a leaderboard.
"""

from __future__ import annotations

from pathlib import Path

from search.log import warn
from search.promotion import promoted, prune_run_dirs
from search.report.leaderboard import write_leaderboard
from search.report.plots import artifact_dir, plot_round, upload_plot
from search.settings import Settings


class RoundPlot:
    """Before a round is told: its plot (rewards, completion length, intermediate accuracy) attached to its trial,
    where the dashboard shows it (Optuna takes no artifact on a finished trial)."""

    def __init__(self, settings: Settings):
        self.settings = settings

    def __call__(self, trial, outcome) -> None:
        try:
            run_dir = Path(trial.user_attrs["run_dir"])
            png = plot_round(run_dir, run_dir / f"round-{trial.number:04d}.png",
                             title=f"round {trial.number}: {outcome.state}")  # fmt: skip
            if png is not None:
                upload_plot(trial, png, artifact_dir(self.settings.storage))
        except Exception as exc:  # noqa: BLE001 - see the module docstring
            warn(f"warning: plot of round {trial.number}: {type(exc).__name__}: {exc}")


class RoundEnd:
    """After each round is told: old weights deleted (`prune`), the leaderboard rewritten into `folder`."""

    def __init__(self, settings: Settings, study, folder: Path, *, prune: bool):
        self.settings, self.study, self.folder, self.prune = settings, study, folder, prune

    def __call__(self, trial, outcome) -> None:
        try:
            if self.prune:
                held = (promoted(self.settings.submission_path) or {}).get("trial")
                keep = {held} if isinstance(held, int) else set()  # the current best, whatever the study ranks
                merge = self.settings.merge
                prune_run_dirs(self.study, self.settings.keep_rounds, self.settings.rounds_dir, keep=keep,
                               merge_top_k=merge.top_k if merge.enabled else 0)  # fmt: skip
            write_leaderboard(self.study, self.folder)
        except Exception as exc:  # noqa: BLE001 - see the module docstring
            warn(f"warning: after round {trial.number}: {type(exc).__name__}: {exc}")
