"""Per-round plots from the round's progress.jsonl, attached to its trial as an Optuna artifact.

`optuna-dashboard study.db --artifact-dir artifacts` then shows each round's plot on its trial's page.
"""

from __future__ import annotations

import math
from pathlib import Path

import optuna

from trainer.run_folder import read_progress

ARTIFACT_DIR = "artifacts"


def artifact_dir(storage: str) -> Path:
    """Where a study's artifacts go: next to a journal file, else in the current folder."""
    return Path(storage).parent / ARTIFACT_DIR if "://" not in storage else Path(ARTIFACT_DIR)


def plot_round(run_dir: str | Path, png_path: str | Path, *, title: str = "") -> Path | None:
    """The round's rewards, completion length and intermediate ood accuracy against the step, in one PNG; None
    without progress."""
    records = read_progress(run_dir)
    if not records:
        return None
    import matplotlib  # late: only rounds with progress need it

    matplotlib.use("Agg")  # no display on the box
    import matplotlib.pyplot as plt

    fig, (rewards, length, accuracy) = plt.subplots(1, 3, figsize=(15, 4))
    names = sorted({name for record in records for name in record.get("rewards", {})})
    for name in names:
        _line(rewards, records, lambda r, n=name: r.get("rewards", {}).get(n), name)
    _line(rewards, records, lambda r: r.get("reward"), "total", color="black", linewidth=2)
    rewards.set_title("rewards (mean per step)")
    rewards.legend(fontsize="small")
    _line(length, records, lambda r: r.get("completion_length"), "completion length")
    length.set_title("completion length (tokens)")
    _line(accuracy, records, lambda r: r.get("ood_accuracy"), "ood subset", marker="o")
    accuracy.set_title("ood subset accuracy (%)")
    for axes in (rewards, length, accuracy):
        axes.set_xlabel("step")
        axes.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    png_path = Path(png_path)
    fig.savefig(png_path, dpi=90)
    plt.close(fig)
    return png_path


def upload_plot(trial: optuna.Trial, png_path: str | Path, folder: str | Path) -> str:
    """Attach `png_path` to the running `trial` in the artifact store at `folder`; returns the artifact id.

    Called before the trial is told: Optuna takes no new attribute, artifacts included, on a finished trial.
    """
    store = optuna.artifacts.FileSystemArtifactStore(_made(Path(folder)))
    return optuna.artifacts.upload_artifact(artifact_store=store, file_path=str(png_path), study_or_trial=trial)


def _line(axes, records: list[dict], value, label: str, **style) -> None:
    points = [(r["step"], value(r)) for r in records]
    points = [(step, y) for step, y in points if isinstance(y, (int, float)) and math.isfinite(y)]
    if points:
        axes.plot(*zip(*points), label=label, **style)


def _made(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return folder
