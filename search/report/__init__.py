"""What a search shows: the leaderboard, each round's plot, the status lines, and what runs after each round."""

from search.report.hooks import RoundEnd, RoundPlot
from search.report.leaderboard import (
    BASELINE, COLUMNS, final_check_line, format_leaderboard, leaderboard_rows, why_it_won, write_leaderboard,
)  # fmt: skip
from search.report.plots import artifact_dir, plot_round, upload_plot
from search.report.status import StatusLine, describe, describe_merge, gpus_text

__all__ = [
    "BASELINE", "COLUMNS", "RoundEnd", "RoundPlot", "StatusLine", "artifact_dir", "describe", "describe_merge",
    "final_check_line", "format_leaderboard", "gpus_text", "leaderboard_rows", "plot_round", "upload_plot",
    "why_it_won", "write_leaderboard",
]  # fmt: skip
