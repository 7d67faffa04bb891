"""The leaderboard of a study: its rounds ranked by the objective (ood_val accuracy), as Markdown, CSV and text.

It reads only the study: the objective value, the user attrs the scheduler records per trial (`recipe`, `config`,
`state`, `reason`, `val_accuracy`, `format_rate`, `mean_completion_tokens`, `duration_s`, `steps_done`) and the pruned
trials' intermediate values. Completed rounds are ranked; pruned, failed and running ones follow, by trial number.
"""

from __future__ import annotations

import csv
import io
import math
import os
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

BASELINE = "baseline"  # the warm start every other round is compared against
# Short names of the rewards, for one compact column.
_REWARD_ABBREVIATIONS = {
    "accuracy": "acc",
    "answer_format": "fmt",
    "think_format": "think",
    "count_closeness": "close",
    "brevity": "brev",
    "reasoning_agreement": "agree",
}
# Config columns: (column, TrialConfig field).
_CONFIG_COLUMNS = (
    ("rewards", "reward_weights"),
    ("beta", "beta"),
    ("G", "num_generations"),
    ("lora_rank", "lora_rank"),
    ("lr", "learning_rate"),
    ("temperature", "temperature"),
    ("loss", "loss_type"),
    ("phrasing", "phrasing"),
    ("max_pixels", "max_pixels"),
)
COLUMNS = (
    "rank", "trial", "recipe", "state", "ood_acc", "val_acc", "format_rate", "mean_tokens", "duration_min", "steps",
    *(column for column, _ in _CONFIG_COLUMNS), "reason",
)  # fmt: skip


def write_leaderboard(study: optuna.Study, folder: str | Path) -> tuple[Path, Path]:
    """Write `leaderboard.md` and `leaderboard.csv` into `folder`; returns their paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rows = leaderboard_rows(study)
    md_path, csv_path = folder / "leaderboard.md", folder / "leaderboard.csv"
    lines = [f"# Leaderboard of study `{study.study_name}`", "", why_it_won(study), ""]
    lines.append("| " + " | ".join(COLUMNS) + " |")
    lines.append("|" + "|".join("---:" if _is_numeric_column(c) else "---" for c in COLUMNS) + "|")
    for row in rows:
        cells = [_cell(column, row[column]) for column in COLUMNS]
        if row["recipe"] == BASELINE:
            cells[COLUMNS.index("recipe")] = f"**{BASELINE}**"
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    _write_atomically(md_path, "\n".join(lines) + "\n")
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({column: _csv_value(row[column]) for column in COLUMNS})
    _write_atomically(csv_path, buffer.getvalue())
    return md_path, csv_path


def format_leaderboard(study: optuna.Study) -> str:
    """The leaderboard as an aligned text table, for a terminal."""
    rows = leaderboard_rows(study)
    table = [list(COLUMNS)]
    for row in rows:
        cells = [_cell(column, row[column]) for column in COLUMNS]
        if row["recipe"] == BASELINE:
            cells[COLUMNS.index("recipe")] = f"{BASELINE}*"
        table.append(cells)
    widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS))]
    text = [
        "  ".join(cell.rjust(w) if _is_numeric_column(c) else cell.ljust(w) for c, cell, w in zip(COLUMNS, line, widths))
        for line in table
    ]
    return "\n".join([f"study {study.study_name}: {why_it_won(study)}", *(line.rstrip() for line in text)])


def leaderboard_rows(study: optuna.Study) -> list[dict[str, Any]]:
    """One dict per trial, keyed by COLUMNS, best first."""
    trials = study.get_trials(deepcopy=False)
    ranked = sorted((t for t in trials if _score(t) is not None), key=lambda t: (-_score(t), t.number))
    others = sorted((t for t in trials if _score(t) is None), key=lambda t: t.number)
    rows = [_row(trial, rank) for rank, trial in enumerate(ranked, start=1)]
    return rows + [_row(trial, None) for trial in others]


def why_it_won(study: optuna.Study) -> str:
    """One line: the best round against the baseline (accuracy delta and the options that differ)."""
    trials = study.get_trials(deepcopy=False)
    scored = [t for t in trials if _score(t) is not None]
    if not scored:
        return "No round has finished with a score yet."
    best = max(scored, key=lambda t: (_score(t), -t.number))
    head = f"Best: trial {best.number} ({_recipe(best)}), ood_val accuracy {_score(best):.1f}%"
    baselines = [t for t in scored if _recipe(t) == BASELINE]
    if not baselines:
        return head + "; the baseline has no score yet."
    baseline = baselines[0]
    if baseline.number == best.number:
        return head + ": the baseline itself leads."
    delta = _score(best) - _score(baseline)
    differences = [
        f"{column} {_cell(column, _config_value(best, field))} vs {_cell(column, _config_value(baseline, field))}"
        for column, field in (*_CONFIG_COLUMNS, ("steps", "steps"))
        if _config_value(best, field) != _config_value(baseline, field)
    ]
    return (
        f"{head}, {delta:+.1f} points over the baseline (trial {baseline.number}, {_score(baseline):.1f}%); "
        f"it differs in: {'; '.join(differences) or 'nothing searched'}."
    )


# ---------------------------------------------------------------------------------------------------------- rows
def _score(trial: FrozenTrial) -> float | None:
    if trial.state != TrialState.COMPLETE or trial.value is None or math.isnan(trial.value):
        return None
    return trial.value


def _recipe(trial: FrozenTrial) -> str:
    return trial.user_attrs.get("recipe", "sampled")


def _config_value(trial: FrozenTrial, field: str) -> Any:
    if field == "steps":  # the steps trained, else the steps planned (after the scheduler's cut), else configured
        for key in ("steps_done", "steps"):
            if trial.user_attrs.get(key) is not None:
                return trial.user_attrs[key]
    return trial.user_attrs.get("config", {}).get(field)


def _row(trial: FrozenTrial, rank: int | None) -> dict[str, Any]:
    attrs = trial.user_attrs
    row = {
        "rank": rank,
        "trial": trial.number,
        "recipe": _recipe(trial),
        "state": attrs.get("state") or trial.state.name.lower(),
        "ood_acc": _score(trial),
        "val_acc": attrs.get("val_accuracy"),
        "format_rate": attrs.get("format_rate"),
        "mean_tokens": attrs.get("mean_completion_tokens"),
        "duration_min": attrs["duration_s"] / 60 if attrs.get("duration_s") is not None else None,
        "steps": _config_value(trial, "steps"),
        "reason": _reason(trial),
    }
    row.update({column: _config_value(trial, field) for column, field in _CONFIG_COLUMNS})
    return row


def _reason(trial: FrozenTrial) -> str | None:
    reason = trial.user_attrs.get("reason")
    if reason is None and trial.state == TrialState.PRUNED and trial.intermediate_values:
        step = max(trial.intermediate_values)
        return f"pruned at step {step} (ood subset {trial.intermediate_values[step]:.1f}%)"
    return reason


# ---------------------------------------------------------------------------------------------------------- cells
def _is_numeric_column(column: str) -> bool:
    return column in {"rank", "trial", "ood_acc", "val_acc", "format_rate", "mean_tokens", "duration_min", "steps",
                      "beta", "G", "lora_rank", "lr", "temperature", "max_pixels"}  # fmt: skip


def _cell(column: str, value: Any) -> str:
    """A value as the Markdown and text tables show it."""
    if value is None:
        return "-"
    if column == "rewards":
        return _rewards(value)
    if column in {"ood_acc", "val_acc", "format_rate"}:  # percents
        return f"{value:.1f}"
    if column in {"mean_tokens", "duration_min"}:
        return f"{value:.0f}"
    if column in {"beta", "lr"}:
        return "0" if value == 0 else f"{value:.2g}"
    if column == "temperature":
        return f"{value:.2f}"
    return str(value)


def _csv_value(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, dict):
        return _rewards(value)
    return value


def _rewards(weights: dict[str, float]) -> str:
    """Nonzero reward weights, compactly: `acc1 fmt0.5 brev0.25`."""
    parts = [f"{_REWARD_ABBREVIATIONS.get(name, name)}{weight:g}" for name, weight in weights.items() if weight]
    return " ".join(parts) or "none"


def _write_atomically(path: Path, text: str) -> None:
    # Readers (a user's editor, a second worker) never see half a table; workers sharing the folder each write their
    # own partial file, so that one's rename never takes the other's away.
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text(text)
    partial.replace(path)
