"""The leaderboard ranks rounds by ood accuracy, marks the base and the baseline, explains the winner (its chain, its
lead over the base and the runner-up against the noise of ood_val's rows) and shows why rounds ended."""

from __future__ import annotations

import csv

import optuna
import pytest
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState, create_trial

from search import selection
from search.report.leaderboard import COLUMNS, format_leaderboard, leaderboard_rows, why_it_won, write_leaderboard
from search.study import FINAL_CHECK_ATTR

ROWS = 200

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _config(**changes):
    config = {"reward_weights": {"accuracy": 1.0, "think_format": 1.0, "brevity": 0.0}, "beta": 0.04,
              "num_generations": 8, "lora_rank": 0, "learning_rate": 1e-6, "temperature": 1.0, "loss_type": "grpo",
              "phrasing": "inherited", "max_pixels": 401408, "steps": 100}  # fmt: skip
    config.update(changes)
    return config


def _attrs(recipe, state, config, **extra):
    return {"recipe": recipe, "state": state, "config": config, **extra}


def _rows(right: int, first: int = 0, n: int = ROWS) -> dict:
    """The `ood_rows` attribute of a round answering rows first .. first + right - 1 (cyclically) right."""
    correct = [(i - first) % n < right for i in range(n)]
    per_row = {"index": list(range(n)), "gold": [1] * n, "answer": [1 if c else None for c in correct]}
    return selection.rows_attr(per_row)


@pytest.fixture()
def study():
    study = optuna.create_study(direction="maximize", study_name="board")
    lr = {"lr": FloatDistribution(1e-7, 1e-3, log=True)}
    study.add_trial(create_trial(  # 0: the baseline
        value=60.0, params={"lr": 1e-6}, distributions=lr,
        user_attrs=_attrs("baseline", "completed", _config(), val_accuracy=90.0, format_rate=80.0,
                          mean_completion_tokens=140.0, duration_s=1800.0, steps=100, parent=5, total_steps=100,
                          ood_rows=_rows(120)),
    ))  # fmt: skip
    study.add_trial(create_trial(  # 1: the winner, stopped early by the deadline
        value=75.5, params={"lr": 2e-5}, distributions=lr,
        user_attrs=_attrs("strong", "stopped",
                          _config(reward_weights={"accuracy": 1.0, "answer_format": 0.5, "brevity": 0.25},
                                  beta=0.01, lora_rank=64, learning_rate=2e-5, loss_type="dapo", phrasing="eval"),
                          reason="the deadline", val_accuracy=95.0, format_rate=99.0, mean_completion_tokens=9.0,
                          duration_s=2400.0, steps=120, parent=4, total_steps=220, ood_rows=_rows(151)),
    ))  # fmt: skip
    study.add_trial(create_trial(  # 2: pruned
        state=TrialState.PRUNED, params={"lr": 3e-4}, distributions=lr, intermediate_values={50: 40.0, 100: 38.5},
        user_attrs=_attrs("sampled", "pruned", _config(learning_rate=3e-4, lora_rank=16)),
    ))  # fmt: skip
    study.add_trial(create_trial(  # 3: failed
        state=TrialState.FAIL, params={"lr": 1e-3}, distributions=lr,
        user_attrs=_attrs("sampled", "failed", _config(), reason="the trainer exited with code 1: CUDA OOM"),
    ))  # fmt: skip
    study.add_trial(create_trial(  # 4: a worse completed round, the winner's parent
        value=61.0, params={"lr": 1e-6}, distributions=lr,
        user_attrs=_attrs("sampled", "completed", _config(num_generations=4), steps=100, parent=5, total_steps=100,
                          ood_rows=_rows(122)),
    ))  # fmt: skip
    study.add_trial(create_trial(  # 5: the base model, scored (round 0 of a real search)
        value=50.0, user_attrs={"recipe": "base", "state": "completed", "steps": 0, "total_steps": 0,
                                "format_rate": 78.0, "ood_rows": _rows(100)},
    ))  # fmt: skip
    return study


def test_rows_are_ranked_by_the_objective(study):
    rows = leaderboard_rows(study)
    assert [(r["rank"], r["trial"]) for r in rows] == [(1, 1), (2, 4), (3, 0), (4, 5), (None, 2), (None, 3)]
    assert rows[0]["state"] == "stopped" and rows[0]["reason"] == "the deadline"
    assert rows[4]["reason"] == "pruned at step 100 (ood subset 38.5%)"
    assert rows[5]["state"] == "failed" and "CUDA OOM" in rows[5]["reason"]
    assert [(r["parent"], r["total_steps"]) for r in rows[:4]] == [(4, 220), (5, 100), (5, 100), (None, 0)]


def test_each_round_shows_its_paired_lead_over_the_base_and_the_best(study):
    rows = {row["trial"]: row for row in leaderboard_rows(study)}
    winner, runner_up, base = rows[1], rows[4], rows[5]
    # The winner answers rows 0-150 right, the runner-up 0-121, the base 0-99: every row one gets right and the
    # other wrong goes one way, so the paired interval is tight.
    assert round(winner["vs_base"].points, 1) == 25.5 and winner["vs_base"].beyond_noise
    assert winner["vs_best"] is None and base["vs_base"] is None  # a round is not compared with itself
    assert round(runner_up["vs_best"].points, 1) == -14.5 and runner_up["vs_best"].high < 0
    assert round(base["vs_best"].points, 1) == -25.5
    assert rows[2]["vs_base"] is None and rows[2]["vs_best"] is None  # pruned: no score


def test_markdown_marks_the_base_and_the_baseline_and_explains_the_winner(study, tmp_path):
    md, csv_path = write_leaderboard(study, tmp_path / "out")
    text = md.read_text()
    lines = text.splitlines()
    assert lines[0] == "# Leaderboard of study `board`"
    why = lines[2]
    assert why.startswith("Best: trial 1 (strong), ood_val accuracy 75.5%, chain 5 -> 4 -> 1 (220 steps); ")
    assert "over the base (trial 5, 50.0%) +25.5 [" in why and "over the runner-up (trial 4, 61.0%) +14.5 [" in why
    assert why.count("beyond noise") == 2
    assert "+15.5 points over the baseline (trial 0, 60.0%)" in why
    for difference in ("lora_rank 64 vs 0", "lr 2e-05 vs 1e-06", "beta 0.01 vs 0.04", "loss dapo vs grpo",
                       "phrasing eval vs inherited", "rewards acc1 fmt0.5 brev0.25 vs acc1 think1", "steps 120 vs 100"):
        assert difference in why  # fmt: skip
    assert "max_pixels" not in why and "temperature" not in why  # equal options are not listed
    table = [line for line in lines if line.startswith("| ")]
    assert table[0] == "| " + " | ".join(COLUMNS) + " |"
    baseline_row = next(line for line in table if "**baseline**" in line)
    assert baseline_row.startswith("| 3 | 0 | **baseline** | completed | 60.0 | +10.0 [")
    assert "| 90.0 | 80.0 | 140 | 30 | 100 | 5 | 100 |" in baseline_row
    base_row = next(line for line in table if "**base**" in line)
    assert base_row.startswith("| 4 | 5 | **base** | completed | 50.0 | - | -25.5 [")
    assert "pruned at step 100" in text and "CUDA OOM" in text


def test_a_lead_within_the_noise_of_ood_val_is_called_so():
    study = optuna.create_study(direction="maximize")
    study.add_trial(create_trial(value=50.0, user_attrs={"recipe": "base", "ood_rows": _rows(100)}))
    # 102 of 200 against 100 of 200, on rows that overlap: a 1-point lead that the choice of rows explains.
    study.add_trial(create_trial(value=51.0, user_attrs={"recipe": "sampled", "parent": 0, "ood_rows": _rows(102, 30)}))
    why = why_it_won(study)
    assert why.startswith("Best: trial 1 (sampled), ood_val accuracy 51.0%, chain 0 -> 1; ")
    assert "over the base (trial 0, 50.0%) +1.0 [" in why and why.count("within noise") == 1
    assert "runner-up" not in why  # the base is the only other round


def test_rounds_scored_on_other_rows_are_not_compared():
    study = optuna.create_study(direction="maximize")
    other_rows = selection.rows_attr({"index": list(range(1, ROWS + 1)), "gold": [1] * ROWS, "answer": [1] * ROWS})
    study.add_trial(create_trial(value=50.0, user_attrs={"recipe": "base", "ood_rows": _rows(100)}))
    study.add_trial(create_trial(value=60.0, user_attrs={"recipe": "sampled", "ood_rows": other_rows}))
    assert leaderboard_rows(study)[0]["vs_base"] is None
    assert "+10.0 points (no per-row scores to tell noise)" in why_it_won(study)


def test_a_failed_final_check_is_a_loud_line_of_the_leaderboard(study, tmp_path):
    line = "FINAL CHECK FAILED: the submission (trial 1) does not load; restored the previous submission (trial 4)"
    study.set_user_attr(FINAL_CHECK_ATTR, {"passed": False, "line": line})
    md, _ = write_leaderboard(study, tmp_path)
    assert md.read_text().splitlines()[4] == f"**{line}**"
    assert format_leaderboard(study).splitlines()[1] == line


def test_csv_parses_with_one_row_per_trial(study, tmp_path):
    _, csv_path = write_leaderboard(study, tmp_path)
    with csv_path.open() as f:
        rows = list(csv.DictReader(f))
    assert [row["trial"] for row in rows] == ["1", "4", "0", "5", "2", "3"]
    assert rows[0]["rank"] == "1" and float(rows[0]["ood_acc"]) == 75.5 and rows[0]["lr"] == "2e-05"
    assert rows[0]["vs_base"].startswith("+25.5 [") and rows[0]["vs_best"] == ""
    assert rows[2]["recipe"] == "baseline" and rows[4]["ood_acc"] == "" and rows[4]["rank"] == ""
    assert rows[5]["reason"] == "the trainer exited with code 1: CUDA OOM"
    assert set(rows[0]) == set(COLUMNS)


def test_text_table_for_the_terminal(study):
    text = format_leaderboard(study)
    lines = text.splitlines()
    assert lines[0].startswith("study board: Best: trial 1")
    assert lines[1].split()[:4] == ["rank", "trial", "recipe", "state"]
    assert "baseline*" in text and "base*" in text and len(lines) == 2 + 6


def test_why_line_without_scores_or_baseline():
    study = optuna.create_study(direction="maximize")
    assert why_it_won(study) == "No round has finished with a score yet."
    study.add_trial(create_trial(value=50.0, user_attrs={"recipe": "strong"}))
    assert why_it_won(study).endswith("the baseline has no score yet.")
    study.add_trial(create_trial(value=70.0, user_attrs={"recipe": "baseline"}))
    assert why_it_won(study).endswith("the baseline itself leads.")
    assert format_leaderboard(study)  # rows without config render as dashes


# ---------------------------------------------------------------------------------------------------------- odd trials
ODD = {"duration_s": "12s", "format_rate": "high", "val_accuracy": [1, 2], "config": ["not", "a", "mapping"],
       "mean_completion_tokens": {"n": 3}, "eta": "x", "selection_accuracy": "?", "state": "done\nreally"}  # fmt: skip


def _with_odd_trial(study, **attrs):
    study.add_trial(create_trial(value=50.0, user_attrs={"recipe": "sampled", **attrs}))  # another program wrote it
    return study.trials[-1].number


def test_an_odd_trial_is_shown_as_far_as_it_can_be_with_a_note(study, tmp_path):
    odd = _with_odd_trial(study, **ODD)
    md, csv_path = write_leaderboard(study, tmp_path)  # never raises
    text = md.read_text()
    [row] = [line for line in text.splitlines() if line.startswith(f"| ") and f"| {odd} |" in line]
    assert "'12s'?" in row and "'high'?" in row and "50.0" in row and "done really" in row
    assert f"trial {odd} duration_min" in text and f"trial {odd} format_rate" in text and "marked ?" in text
    assert sum(1 for line in text.splitlines() if line.startswith("| ")) == len(study.trials) + 1  # every row
    assert len(list(csv.DictReader(csv_path.open()))) == len(study.trials)
    terminal = format_leaderboard(study)
    assert "Best: trial 1" in terminal and f"trial {odd} duration_min" in terminal


def test_an_odd_reward_mapping_or_parent_does_not_hide_the_table(study, tmp_path):
    odd = _with_odd_trial(study, config={"reward_weights": {"accuracy": "one"}, "beta": "b"}, parent={"x": 1},
                          total_steps="many", duration_s=float("nan"))
    write_leaderboard(study, tmp_path)
    rows = {row["trial"]: row for row in leaderboard_rows(study)}
    assert rows[odd]["ood_acc"] == 50.0 and rows[odd]["beta"] == "b"


def test_a_trial_whose_row_cannot_be_built_still_has_a_row(study, tmp_path, monkeypatch):
    from search.report import leaderboard

    real_row = leaderboard._row
    odd = _with_odd_trial(study)

    def breaking(trial, *args):
        if trial.number == odd:
            raise KeyError("what a newer version records")
        return real_row(trial, *args)

    monkeypatch.setattr(leaderboard, "_row", breaking)
    rows = {row["trial"]: row for row in leaderboard_rows(study)}
    assert len(rows) == len(study.trials) and rows[odd]["ood_acc"] == 50.0
    assert rows[odd]["reason"].startswith("unreadable attributes (KeyError")
    write_leaderboard(study, tmp_path)


def test_an_odd_best_trial_keeps_the_table(tmp_path):
    study = optuna.create_study(direction="maximize")
    study.add_trial(create_trial(value=90.0, user_attrs={"recipe": "sampled", "eta": "fast", "parent": [1, "x"],
                                                         "total_steps": {"a": 1}, "duration_s": "1h"}))  # fmt: skip
    study.add_trial(create_trial(value=10.0, user_attrs={"recipe": "baseline", "config": "text"}))
    assert "Best: trial 0" in why_it_won(study)
    md, _ = write_leaderboard(study, tmp_path)
    assert "'1h'?" in md.read_text()


def _journal_study(path, name):
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(path)))
    return optuna.create_study(storage=storage, study_name=name, direction="maximize")


def test_the_leaderboard_command_shows_a_study_with_an_odd_trial(tmp_path, monkeypatch, capsys):
    import run_search

    study = _journal_study(tmp_path / "study.db", "shared")
    study.add_trial(create_trial(value=70.0, user_attrs={"recipe": "base", "duration_s": 60.0}))
    study.add_trial(create_trial(value=80.0, user_attrs={"recipe": "sampled", "duration_s": "12s"}))
    monkeypatch.chdir(tmp_path)
    assert run_search.main(["leaderboard", "--storage", "study.db", "--study-name", "shared"]) == 0
    out = capsys.readouterr().out
    assert "Best: trial 1" in out and "'12s'?" in out and "trial 1 duration_min" in out


def test_a_failing_last_leaderboard_write_does_not_lose_the_summary(tmp_path, monkeypatch, capsys):
    import run_search
    from search import report

    def full_disk(study, folder):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report, "write_leaderboard", full_disk)  # the search's last write, after its rounds
    monkeypatch.chdir(tmp_path)
    assert run_search.main(["--simulate", "--hours", "1", "--storage", "st/study.db"]) == 0
    captured = capsys.readouterr()
    assert "warning: the leaderboard could not be written into st: OSError" in captured.err
    assert "Traceback" not in captured.err and "\nlog: " in captured.out and "Best: trial" in captured.out
