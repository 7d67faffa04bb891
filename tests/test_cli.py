"""run_search.py: bad input is one line on stderr, exit code 2, and leaves nothing behind; --simulate runs end to end."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import yaml

import faultkit

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "run_search.py"


def run(cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def budget(folder: Path, **changes) -> Path:
    data = yaml.safe_load((ROOT / "budget.yaml").read_text())
    data.update(changes)
    path = folder / "my-budget.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture()
def box(tmp_path, tiny_split_dir) -> dict:
    """budget.yaml values for a box in tmp_path: a Qwen2-VL config and a tiny weights file (nothing is loaded before
    the checks pass)."""
    model = faultkit.fake_model(tmp_path / "model")
    (tmp_path / "app").mkdir()
    return {
        "gpus": 0, "model_path": str(model), "train_path": str(tiny_split_dir), "val_path": str(tiny_split_dir),
        "ood_val_path": str(tiny_split_dir), "submission_path": str(tmp_path / "app" / "submission"),
    }  # fmt: skip


def assert_refused(result: subprocess.CompletedProcess, cwd: Path, expected: str, *, before: set[str]) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("run_search.py: error: ") and expected in lines[0], lines[0]
    assert result.stdout == ""
    # No study, no round folder, no submission.
    assert {p.name for p in cwd.rglob("*")} == before


def _entries(folder: Path) -> set[str]:
    return {p.name for p in folder.rglob("*")}


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--hours", "0"], "hours: must be > 0"),
        (["--hours", "-3"], "hours: must be > 0"),
        (["--hours", "nan"], "hours: must be a finite number"),
        (["--hours", "soon"], "hours: must be a number of hours, got 'soon'"),
        (["--frobnicate"], "unrecognized arguments: --frobnicate"),
        (["--simulate", "--demo"], "not allowed with argument"),
        (["--budget", "absent.yaml"], "budget: cannot read absent.yaml"),
        ([], "model_path: /app/models/Qwen2-VL-2B-Instruct does not exist"),  # not on the box
        (["leaderboard"], "storage: study.db does not exist"),
    ],
)
def test_bad_arguments(tmp_path, args, expected):
    before = _entries(tmp_path)
    assert_refused(run(tmp_path, *args), tmp_path, expected, before=before)


def test_bad_budget_files(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("hours: 7.5\nspace: [unclosed\n")
    before = _entries(tmp_path)
    assert_refused(run(tmp_path, "--budget", str(path)), tmp_path, "malformed YAML at", before=before)
    unknown = budget(tmp_path, hourz=3)
    before = _entries(tmp_path)
    assert_refused(run(tmp_path, "--budget", str(unknown)), tmp_path, "hourz: unknown key", before=before)


def test_bad_boxes(tmp_path, box):
    Path(box["model_path"], "config.json").write_text(json.dumps({"model_type": "llava"}))
    path = budget(tmp_path, **box)
    before = _entries(tmp_path)
    assert_refused(run(tmp_path, "--budget", str(path)), tmp_path, "is not a Qwen2-VL folder", before=before)

    Path(box["model_path"], "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    path = budget(tmp_path, **{**box, "submission_path": str(blocker / "submission")})
    before = _entries(tmp_path)
    assert_refused(run(tmp_path, "--budget", str(path)), tmp_path, "submission_path: ", before=before)


def test_unreachable_storage_url(tmp_path, box):
    path = budget(tmp_path, **box)
    before = _entries(tmp_path)
    result = run(tmp_path, "--budget", str(path), "--storage", "postgresql://search:secret@127.0.0.1:1/optuna")
    assert_refused(result, tmp_path, "storage: cannot open postgresql://search:***@127.0.0.1:1/optuna", before=before)
    assert "secret" not in result.stderr


def test_an_existing_study_of_another_direction(tmp_path, box):
    path = budget(tmp_path, **box)
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(tmp_path / "study.db")))
    optuna.create_study(storage=storage, study_name="count-grpo", direction="minimize")
    before = _entries(tmp_path)
    result = run(tmp_path, "--budget", str(path))
    assert_refused(result, tmp_path, "optimizes ['minimize'], not maximize", before=before)


def test_simulate_runs_a_whole_search_without_a_box(tmp_path):
    result = run(tmp_path, "--simulate", "--hours", "7.5", "--study-name", "rehearsal")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "study rehearsal: Best: trial" in result.stdout
    assert {p.name for p in tmp_path.iterdir()} == {"simulated"}  # no runs/, no submission, no study.db here
    assert {p.name for p in (tmp_path / "simulated").iterdir()} >= {"study.db", "leaderboard.md", "leaderboard.csv"}
    journal = optuna.storages.journal.JournalFileBackend(str(tmp_path / "simulated" / "study.db"))
    study = optuna.load_study(study_name="rehearsal", storage=optuna.storages.JournalStorage(journal))
    recipes = [t.user_attrs.get("recipe") for t in study.trials]
    assert recipes[:3] == ["base", "strong", "baseline"] and "sampled" in recipes
    # The leaderboard has the base's row, the chain columns, and rounds that continued another round.
    with (tmp_path / "simulated" / "leaderboard.csv").open() as f:
        rows = list(csv.DictReader(f))
    [base] = [row for row in rows if row["recipe"] == "base"]
    assert base["trial"] == "0" and base["total_steps"] == "0" and float(base["ood_acc"]) > 0
    chained = [row for row in rows if row["parent"] not in ("", "0")]
    assert chained and all(int(row["total_steps"]) > int(row["steps"]) for row in chained if row["total_steps"])
    assert "| **base** |" in (tmp_path / "simulated" / "leaderboard.md").read_text()

    board = run(tmp_path, "leaderboard", "--storage", "simulated/study.db", "--study-name", "rehearsal")
    assert board.returncode == 0, board.stderr
    assert board.stdout.splitlines()[0].startswith("study rehearsal: Best: trial")
    assert "baseline*" in board.stdout


def test_the_demo_rerenders_a_box_of_other_sizes_or_seed(tmp_path, monkeypatch):
    """A box rendered by an older demo (other row counts, another seed, or no marker) is not reused."""
    monkeypatch.syspath_prepend(str(ROOT))
    from synthetic.demo import demo_box_is, render_demo_box
    from synthetic.splits import write_box
    from synthetic.teach import Recipe

    sizes = {"train": 3, "val": 2, "ood_val": 4, "test_compositional": 2, "test_other": 2}
    recipe = Recipe(image_size=(32, 32), count_range=(1, 3))
    assert not demo_box_is(tmp_path / "box", sizes, 1000)  # nothing rendered yet
    render_demo_box(tmp_path / "box", sizes, 1000, recipe)
    assert demo_box_is(tmp_path / "box", sizes, 1000)
    assert not demo_box_is(tmp_path / "box", {**sizes, "ood_val": 5}, 1000)
    assert not demo_box_is(tmp_path / "box", sizes, 0)
    write_box(tmp_path / "older", sizes, 1000, image_size=(32, 32), count_range=(1, 3))  # before the marker
    assert not demo_box_is(tmp_path / "older", sizes, 1000)


def test_two_rehearsals_started_in_the_same_second_get_two_studies(tmp_path, monkeypatch):
    import contextlib
    import io

    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.chdir(tmp_path)
    import run_search
    from search import run, scheduler
    from search.study import open_storage

    monkeypatch.setattr(scheduler.Scheduler, "run", lambda self: None)  # the names are the point, not the search
    monkeypatch.setattr(run.time, "strftime", lambda *args: "20270101-000000")  # one and the same second
    with contextlib.redirect_stdout(io.StringIO()):
        assert run_search.main(["--simulate"]) == 0
        assert run_search.main(["--simulate"]) == 0
    names = [s.study_name for s in open_storage("simulated/study.db", create=False).get_all_studies()]
    assert len(set(names)) == 2 and all(name.startswith("count-grpo-sim-20270101-000000-") for name in names)


def test_search_log_holds_every_printed_line_with_its_time(tmp_path):
    result = run(tmp_path, "--simulate", "--hours", "2", "--study-name", "logged")
    assert result.returncode == 0, result.stderr[-3000:]
    printed = result.stdout.splitlines()
    assert "; log: simulated/search.log;" in printed[0] and printed[-1] == "log: simulated/search.log"
    stamped = (tmp_path / "simulated" / "search.log").read_text().splitlines()
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d .*", line) for line in stamped), stamped[:3]
    logged = [line[len("2027-01-01 00:00:00 "):] for line in stamped]
    optuna_lines = [line for line in logged if line.startswith("A new study created")]  # Optuna's own, on stderr
    assert len(optuna_lines) == 1 and optuna_lines[0] in result.stderr
    assert [line for line in logged if line not in optuna_lines] == printed


def test_a_storage_refused_after_the_budget_was_read_leaves_no_log(tmp_path):
    (tmp_path / "sim").mkdir()
    (tmp_path / "sim" / "study.db").write_text("not a journal\n")
    before = _entries(tmp_path)
    result = run(tmp_path, "--simulate", "--storage", "sim/study.db")
    assert_refused(result, tmp_path, "storage: ", before=before)
    assert not list(tmp_path.rglob("search.log"))
