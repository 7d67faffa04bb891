"""The leaderboard ranks rounds by ood accuracy, marks the baseline, explains the winner and shows why rounds ended."""

from __future__ import annotations

import csv

import optuna
import pytest
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState, create_trial

from search.leaderboard import COLUMNS, format_leaderboard, leaderboard_rows, why_it_won, write_leaderboard

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _config(**changes):
    config = {"reward_weights": {"accuracy": 1.0, "think_format": 1.0, "brevity": 0.0}, "beta": 0.04,
              "num_generations": 8, "lora_rank": 0, "learning_rate": 1e-6, "temperature": 1.0, "loss_type": "grpo",
              "phrasing": "inherited", "max_pixels": 401408, "steps": 100}  # fmt: skip
    config.update(changes)
    return config


def _attrs(recipe, state, config, **extra):
    return {"recipe": recipe, "state": state, "config": config, **extra}


@pytest.fixture()
def study():
    study = optuna.create_study(direction="maximize", study_name="board")
    lr = {"lr": FloatDistribution(1e-7, 1e-3, log=True)}
    study.add_trial(create_trial(  # 0: the baseline
        value=60.0, params={"lr": 1e-6}, distributions=lr,
        user_attrs=_attrs("baseline", "completed", _config(), val_accuracy=90.0, format_rate=80.0,
                          mean_completion_tokens=140.0, duration_s=1800.0, steps=100),
    ))  # fmt: skip
    study.add_trial(create_trial(  # 1: the winner, stopped early by the deadline
        value=75.5, params={"lr": 2e-5}, distributions=lr,
        user_attrs=_attrs("strong", "stopped",
                          _config(reward_weights={"accuracy": 1.0, "answer_format": 0.5, "brevity": 0.25},
                                  beta=0.01, lora_rank=64, learning_rate=2e-5, loss_type="dapo", phrasing="eval"),
                          reason="the deadline", val_accuracy=95.0, format_rate=99.0, mean_completion_tokens=9.0,
                          duration_s=2400.0, steps=120),
    ))  # fmt: skip
    study.add_trial(create_trial(  # 2: pruned
        state=TrialState.PRUNED, params={"lr": 3e-4}, distributions=lr, intermediate_values={50: 40.0, 100: 38.5},
        user_attrs=_attrs("sampled", "pruned", _config(learning_rate=3e-4, lora_rank=16)),
    ))  # fmt: skip
    study.add_trial(create_trial(  # 3: failed
        state=TrialState.FAIL, params={"lr": 1e-3}, distributions=lr,
        user_attrs=_attrs("sampled", "failed", _config(), reason="the trainer exited with code 1: CUDA OOM"),
    ))  # fmt: skip
    study.add_trial(create_trial(  # 4: a worse completed round
        value=61.0, params={"lr": 1e-6}, distributions=lr,
        user_attrs=_attrs("sampled", "completed", _config(num_generations=4), steps=100),
    ))  # fmt: skip
    return study


def test_rows_are_ranked_by_the_objective(study):
    rows = leaderboard_rows(study)
    assert [(r["rank"], r["trial"]) for r in rows] == [(1, 1), (2, 4), (3, 0), (None, 2), (None, 3)]
    assert rows[0]["state"] == "stopped" and rows[0]["reason"] == "the deadline"
    assert rows[3]["reason"] == "pruned at step 100 (ood subset 38.5%)"
    assert rows[4]["state"] == "failed" and "CUDA OOM" in rows[4]["reason"]


def test_markdown_marks_the_baseline_and_explains_the_winner(study, tmp_path):
    md, csv_path = write_leaderboard(study, tmp_path / "out")
    text = md.read_text()
    lines = text.splitlines()
    assert lines[0] == "# Leaderboard of study `board`"
    why = lines[2]
    assert why.startswith("Best: trial 1 (strong), ood_val accuracy 75.5%, +15.5 points over the baseline (trial 0")
    for difference in ("lora_rank 64 vs 0", "lr 2e-05 vs 1e-06", "beta 0.01 vs 0.04", "loss dapo vs grpo",
                       "phrasing eval vs inherited", "rewards acc1 fmt0.5 brev0.25 vs acc1 think1", "steps 120 vs 100"):
        assert difference in why  # fmt: skip
    assert "max_pixels" not in why and "temperature" not in why  # equal options are not listed
    table = [line for line in lines if line.startswith("| ")]
    assert table[0] == "| " + " | ".join(COLUMNS) + " |"
    baseline_row = next(line for line in table if "**baseline**" in line)
    assert baseline_row.startswith("| 3 | 0 | **baseline** | completed | 60.0 | 90.0 | 80.0 | 140 | 30 | 100 |")
    assert "pruned at step 100" in text and "CUDA OOM" in text


def test_csv_parses_with_one_row_per_trial(study, tmp_path):
    _, csv_path = write_leaderboard(study, tmp_path)
    with csv_path.open() as f:
        rows = list(csv.DictReader(f))
    assert [row["trial"] for row in rows] == ["1", "4", "0", "2", "3"]
    assert rows[0]["rank"] == "1" and float(rows[0]["ood_acc"]) == 75.5 and rows[0]["lr"] == "2e-05"
    assert rows[2]["recipe"] == "baseline" and rows[3]["ood_acc"] == "" and rows[3]["rank"] == ""
    assert rows[4]["reason"] == "the trainer exited with code 1: CUDA OOM"
    assert set(rows[0]) == set(COLUMNS)


def test_text_table_for_the_terminal(study):
    text = format_leaderboard(study)
    lines = text.splitlines()
    assert lines[0].startswith("study board: Best: trial 1")
    assert lines[1].split()[:4] == ["rank", "trial", "recipe", "state"]
    assert "baseline*" in text and len(lines) == 2 + 5


def test_why_line_without_scores_or_baseline():
    study = optuna.create_study(direction="maximize")
    assert why_it_won(study) == "No round has finished with a score yet."
    study.add_trial(create_trial(value=50.0, user_attrs={"recipe": "strong"}))
    assert why_it_won(study).endswith("the baseline has no score yet.")
    study.add_trial(create_trial(value=70.0, user_attrs={"recipe": "baseline"}))
    assert why_it_won(study).endswith("the baseline itself leads.")
    assert format_leaderboard(study)  # rows without config render as dashes
