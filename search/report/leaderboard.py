"""The leaderboard of a study: its rounds ranked by the objective (ood_val accuracy), as Markdown, CSV and text.

It reads only the study: the objective value, the user attrs the scheduler records per trial (`recipe`, `config`,
`state`, `reason`, `val_accuracy`, `format_rate`, `mean_completion_tokens`, `duration_s`, `steps_done`, `parent`,
`total_steps`, the per-row correctness `ood_rows`), the pruned trials' intermediate values and the study's last final
check. Completed rounds are ranked; pruned, failed and running ones follow, by trial number.

A study is storage content that other programs (or another version of this one) may have written: a value of a type
this search does not record is shown as stored, marked `?`, and named in a note; a trial whose row cannot be built at
all gets a row of what is readable. No trial hides the table.

`vs_base` and `vs_best` are a round's lead over the base model (round 0) and over the best round, in accuracy points
on the same ood_val rows, with the paired 95% interval (search.selection): an interval that contains 0 is a lead the
choice of rows could explain.
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

from search import selection
from search.space import BASE, MERGE, SAMPLED
from search.study import FINAL_CHECK_ATTR
from common.validation import is_number, one_line, show

BASELINE = "baseline"  # the warm start every other round is compared against
_MARKED = (BASE, BASELINE)  # recipes the tables mark: the zero point and the inherited recipe
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
    "rank", "trial", "recipe", "state", "ood_acc", "vs_base", "vs_best", "val_acc", "format_rate", "mean_tokens",
    "duration_min", "steps", "parent", "total_steps", "eta", "sel_acc", "held_out",
    *(column for column, _ in _CONFIG_COLUMNS), "reason",
)  # fmt: skip


def write_leaderboard(study: optuna.Study, folder: str | Path) -> tuple[Path, Path]:
    """Write `leaderboard.md` and `leaderboard.csv` into `folder`; returns their paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rows = leaderboard_rows(study)
    md_path, csv_path = folder / "leaderboard.md", folder / "leaderboard.csv"
    lines = [f"# Leaderboard of study `{study.study_name}`", "", why_it_won(study), ""]
    check = final_check_line(study)
    if check:
        lines += [f"**{check}**" if check.startswith("FINAL CHECK") else check, ""]
    note = odd_values_note(rows)
    if note:
        lines += [note, ""]
    lines.append("| " + " | ".join(COLUMNS) + " |")
    lines.append("|" + "|".join("---:" if _is_numeric_column(c) else "---" for c in COLUMNS) + "|")
    for row in rows:
        cells = [_cell(column, row[column]) for column in COLUMNS]
        if row["recipe"] in _MARKED:
            cells[COLUMNS.index("recipe")] = f"**{row['recipe']}**"
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
        if row["recipe"] in _MARKED:
            cells[COLUMNS.index("recipe")] = f"{row['recipe']}*"
        table.append(cells)
    widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS))]
    text = [
        "  ".join(cell.rjust(w) if _is_numeric_column(c) else cell.ljust(w) for c, cell, w in zip(COLUMNS, line, widths))
        for line in table
    ]
    check, note = final_check_line(study), odd_values_note(rows)
    head = [f"study {study.study_name}: {why_it_won(study)}", *([check] if check else []), *([note] if note else [])]
    return "\n".join([*head, *(line.rstrip() for line in text)])


def leaderboard_rows(study: optuna.Study) -> list[dict[str, Any]]:
    """One dict per trial, keyed by COLUMNS, best first."""
    trials = study.get_trials(deepcopy=False)
    ranked = sorted((t for t in trials if _score(t) is not None), key=lambda t: (-_score(t), t.number))
    others = sorted((t for t in trials if _score(t) is None), key=lambda t: t.number)
    base, best = _base(trials), _best(ranked)
    rows = [_readable_row(trial, rank, base, best) for rank, trial in enumerate(ranked, start=1)]
    return rows + [_readable_row(trial, None, base, best) for trial in others]


def odd_values_note(rows: list[dict[str, Any]]) -> str | None:
    """One line naming the values the tables show as stored (`?`): of a type this search does not record."""
    odd = [f"trial {row['trial']} {column}" for row in rows for column in COLUMNS if _odd(column, row[column])]
    if not odd:
        return None
    shown = ", ".join(odd[:10]) + (f" and {len(odd) - 10} more" if len(odd) > 10 else "")
    return f"note: values this search does not record, shown as stored and marked ?: {shown}"


def why_it_won(study: optuna.Study) -> str:
    """One line: the best round, its chain of parents, whether its lead over the base and over the runner-up is
    beyond the noise of ood_val's rows, and against the inherited baseline, the options that differ."""
    try:
        return _why_it_won(study)
    except Exception as error:  # noqa: BLE001 - an odd trial's attributes: the table below still shows every row
        return one_line(f"The best round's story is unreadable ({type(error).__name__}: {error}); see the table.")


def _why_it_won(study: optuna.Study) -> str:
    trials = study.get_trials(deepcopy=False)
    scored = sorted((t for t in trials if _score(t) is not None), key=lambda t: (-_score(t), t.number))
    if not scored:
        return "No round has finished with a score yet."
    best = _best(scored)
    parts = [f"Best: trial {best.number} ({_recipe(best)}), ood_val accuracy {_score(best):.1f}%"]
    chain = _chain(best, {t.number: t for t in trials})
    if isinstance(best.user_attrs.get("parent"), list):
        parts[0] += f", a merge of trials {_cell('parent', best.user_attrs['parent'])}"
        parts[0] += f" at eta {best.user_attrs['eta']:g}" if is_number(best.user_attrs.get("eta")) else ""
    elif len(chain) > 1:
        steps = best.user_attrs.get("total_steps")
        parts[0] += f", chain {' -> '.join(map(str, chain))}" + (f" ({steps} steps)" if steps is not None else "")
    base = _base(trials)
    runner_up = next((t for t in scored if t.number != best.number and _eligible(t)), None)
    for name, other in (("the base", base), ("the runner-up", runner_up)):
        if other is None or other.number == best.number or _score(other) is None:
            continue
        if name == "the runner-up" and base is not None and other.number == base.number:
            continue  # said already
        parts.append(f"over {name} (trial {other.number}, {_score(other):.1f}%) {_lead_text(best, other)}")
    return "; ".join(parts + _merge_stage(trials)) + "; " + _against_baseline(best, scored)


def _eligible(trial: FrozenTrial) -> bool:
    """Whether a scored trial may be called the best: a merge candidate only once the merge stage handed it in (its
    score chose it among its stage's candidates, so it is optimistic)."""
    return _recipe(trial) != MERGE or trial.user_attrs.get("promoted") is True


def _best(ranked: list[FrozenTrial]) -> FrozenTrial | None:
    return next((t for t in ranked if _eligible(t)), ranked[0] if ranked else None)


def _merge_stage(trials: list[FrozenTrial]) -> list[str]:
    """The merge stage's choice and why it was handed in or kept out, one part per stage run."""
    return [f"the merge stage chose trial {t.number} (selection rows {t.user_attrs.get('selection_accuracy', '-')}%"
            f", held-back lead {_held_out_lead(t.user_attrs) or '-'}): {t.user_attrs.get('merge_decision', '-')}"
            for t in trials if t.user_attrs.get("merge_chosen") is True]  # fmt: skip


def final_check_line(study: optuna.Study) -> str | None:
    """The last final check of a submission (search.promotion.final_check), as it was printed."""
    check = study.user_attrs.get(FINAL_CHECK_ATTR)
    line = check.get("line") if isinstance(check, dict) else None
    return None if line is None else one_line(line)


def _against_baseline(best: FrozenTrial, scored: list[FrozenTrial]) -> str:
    baselines = [t for t in scored if _recipe(t) == BASELINE]
    if not baselines:
        return "the baseline has no score yet."
    baseline = baselines[0]
    if baseline.number == best.number:
        return "the baseline itself leads."
    differences = [
        f"{column} {_cell(column, _config_value(best, field))} vs {_cell(column, _config_value(baseline, field))}"
        for column, field in (*_CONFIG_COLUMNS, ("steps", "steps"))
        if _config_value(best, field) != _config_value(baseline, field)
    ]
    return (
        f"{_score(best) - _score(baseline):+.1f} points over the baseline (trial {baseline.number}, "
        f"{_score(baseline):.1f}%); it differs in: {'; '.join(differences) or 'nothing searched'}."
    )


def _lead_text(trial: FrozenTrial, other: FrozenTrial) -> str:
    lead = _lead(trial, other)
    if lead is None:
        return f"{_score(trial) - _score(other):+.1f} points (no per-row scores to tell noise)"
    return f"{lead}, {'beyond' if lead.beyond_noise else 'within'} noise"


def _lead(trial: FrozenTrial, other: FrozenTrial | None) -> selection.Lead | None:
    """The paired lead of `trial` over `other` on the same ood_val rows; None without comparable per-row scores."""
    if other is None or other.number == trial.number:
        return None
    return selection.lead_between(trial.user_attrs, other.user_attrs)


def _chain(trial: FrozenTrial, by_number: dict[int, FrozenTrial]) -> list[int]:
    """Trial numbers from the base to `trial`, following `parent`."""
    chain = [trial.number]
    parent = trial.user_attrs.get("parent")
    while isinstance(parent, int) and parent in by_number and parent not in chain:
        chain.append(parent)
        parent = by_number[parent].user_attrs.get("parent")
    return chain[::-1]


def _base(trials: list[FrozenTrial]) -> FrozenTrial | None:
    """Round 0: the scored base model (the first one, should it have been scored twice)."""
    bases = [t for t in trials if _recipe(t) == BASE]
    scored = [t for t in bases if _score(t) is not None]
    return (scored or bases or [None])[0]


# ---------------------------------------------------------------------------------------------------------- rows
def _score(trial: FrozenTrial) -> float | None:
    if trial.state != TrialState.COMPLETE or trial.value is None or math.isnan(trial.value):
        return None
    return trial.value


def _recipe(trial: FrozenTrial) -> str:
    return trial.user_attrs.get("recipe", SAMPLED)


def _config_value(trial: FrozenTrial, field: str) -> Any:
    if field == "steps":  # the steps trained, else the steps planned (after the scheduler's cut), else configured
        for key in ("steps_done", "steps"):
            if trial.user_attrs.get(key) is not None:
                return trial.user_attrs[key]
    config = trial.user_attrs.get("config")
    return config.get(field) if isinstance(config, dict) else None


def _row(trial: FrozenTrial, rank: int | None, base: FrozenTrial | None, best: FrozenTrial | None) -> dict[str, Any]:
    attrs = trial.user_attrs
    scored = _score(trial) is not None
    row = {
        "rank": rank,
        "trial": trial.number,
        "recipe": _recipe(trial),
        "state": attrs.get("state") or trial.state.name.lower(),
        "ood_acc": _score(trial),
        "vs_base": _lead(trial, base) if scored else None,
        "vs_best": _lead(trial, best) if scored else None,
        "parent": attrs.get("parent"),
        "total_steps": attrs.get("total_steps"),
        "eta": attrs.get("eta"),
        "sel_acc": attrs.get("selection_accuracy"),
        "held_out": _held_out_lead(attrs),
        "val_acc": attrs.get("val_accuracy"),
        "format_rate": attrs.get("format_rate"),
        "mean_tokens": attrs.get("mean_completion_tokens"),
        "duration_min": attrs["duration_s"] / 60 if is_number(attrs.get("duration_s")) else attrs.get("duration_s"),
        "steps": _config_value(trial, "steps"),
        "reason": _reason(trial),
    }
    row.update({column: _config_value(trial, field) for column, field in _CONFIG_COLUMNS})
    return row


def _readable_row(trial: FrozenTrial, rank: int | None, base: FrozenTrial | None,
                  best: FrozenTrial | None) -> dict[str, Any]:
    """`_row`, or for a trial whose attributes break it, its number, state, score and why the rest is missing."""
    try:
        return _row(trial, rank, base, best)
    except Exception as error:  # noqa: BLE001 - see the module docstring
        row = dict.fromkeys(COLUMNS)
        row.update(rank=rank, trial=trial.number, recipe=show(trial.user_attrs.get("recipe", SAMPLED)),
                   state=trial.state.name.lower(), ood_acc=_score(trial),
                   reason=one_line(f"unreadable attributes ({type(error).__name__}: {error})"))  # fmt: skip
        return row


def _held_out_lead(attrs: dict) -> selection.Lead | None:
    """A merge candidate's lead over the submission on the rows its stage held back from every choice."""
    value = attrs.get("held_out_lead")
    try:
        points, low, high, n = value
        return selection.Lead(float(points), float(low), float(high), int(n))
    except (TypeError, ValueError):
        return None


def _reason(trial: FrozenTrial) -> str | None:
    if trial.user_attrs.get("merge_decision"):  # the stage's chosen candidate: why it was handed in or kept out
        return trial.user_attrs["merge_decision"]
    reason = trial.user_attrs.get("reason")
    if reason is None and trial.state == TrialState.PRUNED and trial.intermediate_values:
        step = max(trial.intermediate_values)
        return f"pruned at step {step} (ood subset {trial.intermediate_values[step]:.1f}%)"
    return reason


# ---------------------------------------------------------------------------------------------------------- cells
def _is_numeric_column(column: str) -> bool:
    return column in {"rank", "trial", "ood_acc", "vs_base", "vs_best", "val_acc", "format_rate", "mean_tokens",
                      "duration_min", "steps", "parent", "total_steps", "eta", "sel_acc", "held_out", "beta", "G",
                      "lora_rank", "lr", "temperature", "max_pixels"}  # fmt: skip


def _cell(column: str, value: Any) -> str:
    """A value as the Markdown and text tables show it; one of a type this search does not record as stored, `?`."""
    try:
        text = _formatted(column, value)
    except (TypeError, ValueError, AttributeError):
        return f"{show(value)}?"
    return text if text.isprintable() else " ".join(text.split())  # a row of the tables is one line


def _odd(column: str, value: Any) -> bool:
    try:
        _formatted(column, value)
    except (TypeError, ValueError, AttributeError):
        return True
    return False


def _formatted(column: str, value: Any) -> str:
    if value is None:
        return "-"
    if column == "rewards":
        return _rewards(value)
    if column == "parent" and isinstance(value, list):  # a merge's ingredients
        return "+".join(map(str, value))
    if column == "eta":
        return f"{value:g}"
    if column in {"ood_acc", "val_acc", "format_rate", "sel_acc"}:  # percents
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
    if isinstance(value, list):  # a merge's ingredients
        return "+".join(map(str, value))
    if isinstance(value, dict):
        try:
            return _rewards(value)
        except (TypeError, ValueError):
            return show(value)
    if isinstance(value, selection.Lead):
        return str(value)
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
