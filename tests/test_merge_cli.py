"""`run_search.py merge`: the merge stage by hand on a finished study's rounds, with the real soup and evaluator."""

from __future__ import annotations

import csv
import shutil
import subprocess
import sys
import time
from pathlib import Path

import optuna
import torch
from optuna.trial import TrialState
from safetensors.torch import load_file, save_file

import faultkit
from search import selection
from search.settings import load_settings
from search.study import load_existing_study, open_study

ROOT = Path(__file__).resolve().parents[1]


def trained_copy(base: Path, folder: Path, seed: int, scale: float) -> Path:
    """The base model with every weight moved a little: a stand-in for a trained round's merged model."""
    shutil.copytree(base, folder)
    weights = load_file(str(folder / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    moved = {k: (v.float() + scale * torch.randn(v.shape, generator=generator)).to(v.dtype) for k, v in weights.items()}
    save_file(moved, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_merge_by_hand_on_a_finished_study_writes_a_merge_row(tmp_path, tiny_model_dir, tiny_split_dir):
    from evaluator.evaluation import evaluate

    (tmp_path / "app").mkdir()
    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    budget = faultkit.write_budget(
        tmp_path, model_path=str(model), train_path=str(tiny_split_dir), val_path=str(tiny_split_dir),
        ood_val_path=str(tiny_split_dir), gpus=0, val_rows=0, storage=str(tmp_path / "study.db"),
        runs_dir=str(tmp_path / "runs"), submission_path=str(tmp_path / "app" / "submission"), study_name="done",
        merge={"enabled": False, "top_k": 2, "etas": [1.25], "held_out_share": 0.5},
    )  # fmt: skip
    settings = load_settings(budget)
    study, _ = open_study(settings, now=time.time())
    rounds = []
    for seed, scale in ((1, 0.02), (2, 0.04)):
        number = len(study.trials)
        run_dir = Path(settings.rounds_dir) / f"round-{number:04d}"
        merged = trained_copy(model, run_dir / "merged", seed, scale)
        report = evaluate(merged, tiny_split_dir, seed=settings.seed, batch_size=8)
        study.add_trial(optuna.trial.create_trial(value=report["accuracy_pct"], user_attrs={
            "recipe": "sampled", "state": "completed", "run_dir": str(run_dir), "merged_dir": str(merged),
            "format_rate": report["format_rate"], "total_steps": 10 * seed,
            selection.OOD_ROWS: selection.rows_attr(report["per_row"]),
        }))  # fmt: skip
        rounds.append(number)

    result = subprocess.run([sys.executable, str(ROOT / "run_search.py"), "merge", "--budget", str(budget)],
                            cwd=tmp_path, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "merge stage chose round" in result.stdout

    study = load_existing_study(settings)
    candidates = [t for t in study.trials if t.user_attrs.get("recipe") == "merge"]
    assert candidates and all(t.state == TrialState.COMPLETE and t.value is not None for t in candidates)
    assert {n for t in candidates for n in t.user_attrs["ingredients"]} <= set(rounds)
    soup = [t for t in candidates if t.user_attrs["eta"] == 1.0]
    assert soup and sorted(soup[0].user_attrs["ingredients"]) == rounds
    assert (Path(soup[0].user_attrs["run_dir"]) / "status.json").is_file()
    assert soup[0].user_attrs["timings"]["build"] > 0 and soup[0].user_attrs["total_steps"] == 20
    assert not any(t.state == TrialState.RUNNING for t in study.trials)
    assert all(t.state == TrialState.WAITING for t in study.trials if t.user_attrs.get("recipe") == "base")

    with (tmp_path / "leaderboard.csv").open() as f:
        rows = [row for row in csv.DictReader(f) if row["recipe"] == "merge"]
    assert "+".join(map(str, rounds)) in {row["parent"] for row in rows}
    assert not (tmp_path / "app" / "submission").exists()  # nothing to compare with: nothing handed in


def test_merge_by_hand_needs_an_existing_study(tmp_path, tiny_split_dir):
    (tmp_path / "app").mkdir()
    budget = faultkit.write_budget(
        tmp_path, model_path=str(faultkit.fake_model(tmp_path / "model")), train_path=str(tiny_split_dir),
        val_path=str(tiny_split_dir), ood_val_path=str(tiny_split_dir), gpus=0,
        submission_path=str(tmp_path / "app" / "submission"), runs_dir=str(tmp_path / "runs"),
    )  # fmt: skip
    result = subprocess.run([sys.executable, str(ROOT / "run_search.py"), "merge", "--budget", str(budget),
                             "--storage", str(tmp_path / "none.db"), "--study-name", "missing"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "none.db does not exist" in result.stderr and not (tmp_path / "none.db").exists()
    assert not (tmp_path / "runs").exists()
