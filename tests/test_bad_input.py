"""Bad input, one case per test id: `run_search.py` exits with code 2 and one line on stderr that names the problem,
before any model is loaded, and leaves the folder exactly as it was (no study, no round folder, no submission)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import optuna
import pyarrow
import pyarrow.parquet
import pytest
import yaml

import faultkit

ROOT = Path(__file__).resolve().parents[1]
# run_search.main, then the modules it imported written to a file: no model code may have been loaded.
RUNNER = """
import json, sys
sys.path.insert(0, {root!r})
import run_search
try:
    code = run_search.main(sys.argv[1:])
finally:
    heavy = [m for m in sys.modules if m.startswith(("transformers.models", "trainer.round", "trl", "peft"))]
    open({modules!r}, "w").write(json.dumps(heavy))
sys.exit(code)
"""


def write_budget(tmp: Path, **changes) -> Path:
    data = yaml.safe_load((ROOT / "budget.yaml").read_text())
    for key, value in changes.items():
        if value is _DELETE:
            del data[key]
        else:
            data[key] = value
    path = tmp / "budget.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


_DELETE = object()


def parquet_split(folder: Path, columns: dict) -> Path:
    folder.mkdir(parents=True)
    pyarrow.parquet.write_table(pyarrow.table(columns), folder / "part-0.parquet")
    return folder


def new_study(direction: str, *, deadline: bool) -> Callable[[Path], None]:
    def make(tmp: Path) -> None:
        storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(tmp / "study.db")))
        study = optuna.create_study(storage=storage, study_name="count-grpo", direction=direction)
        if deadline:
            study.set_user_attr("deadline", time.time() + 3600)
        else:  # another tool's study: a trial of its own (an empty one is taken for a set-up cut short, and finished)
            study.add_trial(optuna.trial.create_trial(value=1.0))

    return make


def image_cell() -> dict:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buffer, format="PNG")
    return {"bytes": buffer.getvalue(), "path": None}


# (id, command-line arguments, budget changes (a function of the box folder), setup(box), expected text)
CASES = [
    ("malformed_yaml", ["--budget", "{tmp}/broken.yaml"], None,
     lambda t: (t / "broken.yaml").write_text("hours: 7.5\nspace: [unclosed\n"), "budget: malformed YAML at"),
    ("budget_not_a_mapping", ["--budget", "{tmp}/list.yaml"], None,
     lambda t: (t / "list.yaml").write_text("- 1\n- 2\n"), "must hold a mapping of keys, got a list"),
    ("budget_file_missing", ["--budget", "{tmp}/absent.yaml"], None, None, "budget: cannot read"),
    ("unknown_key", [], lambda t: {"hourz": 3}, None, "hourz: unknown key"),
    ("missing_key", [], lambda t: {"seed": _DELETE}, None, "seed: missing in"),
    ("zero_hours", [], lambda t: {"hours": 0}, None, "hours: must be > 0, got 0"),
    ("negative_hours", ["--hours", "-3"], None, None, "hours: must be > 0, got -3"),
    ("non_numeric_hours", ["--hours", "soon"], None, None, "hours: must be a number of hours, got 'soon'"),
    ("non_numeric_hours_in_file", [], lambda t: {"hours": [7]}, None, "hours: must be a number, got [7]"),
    ("nan_hours", ["--hours", "nan"], None, None, "hours: must be a finite number, got nan"),
    ("inf_hours", ["--hours", "inf"], None, None, "hours: must be a finite number, got inf"),
    ("hours_too_short_for_one_round", ["--hours", "0.5"], None, None, "hours: 0.5 h leaves no room for one round"),
    ("round_max_below_round_min", [], lambda t: {"round_max_minutes": 10}, None, "round_max_minutes: must be >="),
    ("model_folder_missing", [], lambda t: {"model_path": str(t / "nowhere")}, None, "model_path: {tmp}/nowhere does not exist"),
    ("model_without_config", [], None, lambda t: (t / "model" / "config.json").unlink(), "(no config.json)"),
    ("model_config_not_json", [], None, lambda t: (t / "model" / "config.json").write_text("{oops"),
     "is not a readable JSON object"),
    ("model_not_qwen2_vl", [], None,
     lambda t: (t / "model" / "config.json").write_text(json.dumps({"model_type": "llava"})),
     "model_path: {tmp}/model is not a Qwen2-VL folder (config.json model_type 'llava')"),
    ("train_folder_missing", [], lambda t: {"train_path": str(t / "no-train")}, None, "train_path: {tmp}/no-train: no such folder"),
    ("data_folder_empty", [], lambda t: {"val_path": str(t / "empty")}, lambda t: (t / "empty").mkdir(),
     "val_path: {tmp}/empty: neither a save_to_disk folder nor a folder of *.parquet or *.arrow files"),
    ("data_without_solution_column", [], lambda t: {"ood_val_path": str(t / "no-solution")},
     lambda t: parquet_split(t / "no-solution", {"image": [image_cell()], "problem": ["How many?"]}),
     "ood_val_path: {tmp}/no-solution: missing column(s) solution"),
    ("solutions_without_an_integer", [], lambda t: {"train_path": str(t / "words")},
     lambda t: parquet_split(t / "words", {"image": [image_cell()] * 2, "problem": ["How many?"] * 2,
                                           "solution": ["<answer> 3 </answer>", "<answer> three </answer>"]}),
     "train_path: {tmp}/words: row 1: solution must hold one integer count"),
    ("unreachable_storage_url", ["--storage", "postgresql://search:secret@127.0.0.1:1/optuna"], None, None,
     "storage: cannot open postgresql://search:***@127.0.0.1:1/optuna"),
    ("storage_url_of_no_database", ["--storage", "nosuchdb://host/db"], None, None, "storage: cannot open nosuchdb://host/db"),
    ("submission_parent_is_a_file", [], lambda t: {"submission_path": str(t / "blocker" / "submission")},
     lambda t: (t / "blocker").write_text(""), "submission_path: {tmp}/blocker is not a folder"),
    ("submission_is_a_file", [], lambda t: {"submission_path": str(t / "file")}, lambda t: (t / "file").write_text("x"),
     "submission_path: {tmp}/file exists and is not a folder"),
    ("submission_not_writable", [], lambda t: {"submission_path": "/proc/submission"}, None,
     "submission_path: /proc is not writable"),
    ("runs_dir_not_writable", [], lambda t: {"runs_dir": "/proc/runs"}, None, "runs_dir: /proc is not writable"),
    ("study_of_another_direction", [], None, new_study("minimize", deadline=True),
     "study_name: the study 'count-grpo' in study.db optimizes ['minimize'], not maximize"),
    ("study_not_made_by_this_search", [], None, new_study("maximize", deadline=False),
     "was not created by this search (no deadline)"),
    ("gpus_per_trial_above_gpus", [], lambda t: {"gpus": 2, "gpus_per_trial": 4}, None,
     "gpus_per_trial: 4 is more than gpus (2)"),
    ("gpus_per_trial_not_dividing", [], lambda t: {"gpus": 3, "gpus_per_trial": 2}, None, "does not divide gpus (3)"),
    ("gpus_not_a_number", [], lambda t: {"gpus": "many"}, None, "gpus: must be an integer in [0, 64] or 'auto', got 'many'"),
    ("bad_sampler_name", [], lambda t: {"sampler": {"type": "cmaes-ish"}}, None, "sampler.type: must be one of"),
    ("bad_pruner_name", [], lambda t: {"pruner": {"type": "sometimes"}}, None, "pruner.type: must be one of"),
    ("bad_pruner_option", [], lambda t: {"pruner": {"type": "median", "n_startup": 3}}, None,
     "pruner.n_startup: not an option of MedianPruner"),
    ("space_bound_inverted", [], lambda t: {"space": {**_space(), "beta": {"low": 0.1, "high": 0.001}}}, None,
     "space.beta"),
    ("warm_start_outside_the_space", [],
     lambda t: {"warm_starts": [{"name": "wild", "params": {**_warm()[0]["params"], "beta": 5.0}}]}, None,
     "warm_starts[0].params.beta"),
    ("fixed_sets_a_searched_option", [], lambda t: {"fixed": {**_fixed(), "learning_rate": 1e-5}}, None,
     "fixed.learning_rate: set by the key 'space'"),
    ("simulate_with_demo", ["--simulate", "--demo"], None, None, "argument --demo: not allowed with argument --simulate"),
    ("unknown_argument", ["--frobnicate"], None, None, "unrecognized arguments: --frobnicate"),
    ("leaderboard_of_no_study", ["leaderboard"], None, None, "storage: study.db does not exist"),
]  # fmt: skip


def _budget_yaml() -> dict:
    return yaml.safe_load((ROOT / "budget.yaml").read_text())


def _space() -> dict:
    return _budget_yaml()["space"]


def _warm() -> list:
    return _budget_yaml()["warm_starts"]


def _fixed() -> dict:
    return _budget_yaml()["fixed"]


def snapshot(folder: Path) -> dict[str, str]:
    """Every entry under `folder` with a digest of each file's bytes."""
    entries = {}
    for path in sorted(folder.rglob("*")):
        key = str(path.relative_to(folder))
        entries[key] = hashlib.sha1(path.read_bytes()).hexdigest() if path.is_file() else "dir"
    return entries


@pytest.fixture()
def box(tmp_path, tiny_split_dir) -> Path:
    """A box in tmp_path whose model is a Qwen2-VL config and a tiny weights file (nothing may be loaded before the
    checks pass)."""
    faultkit.fake_model(tmp_path / "model")
    (tmp_path / "app").mkdir()
    return tmp_path


@pytest.mark.parametrize("args, changes, setup, expected", [case[1:] for case in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_refused_in_one_line_and_leaves_nothing(box, tiny_split_dir, tmp_path_factory, args, changes,
                                                             setup, expected):  # fmt: skip
    good = {"model_path": str(box / "model"), "train_path": str(tiny_split_dir), "val_path": str(tiny_split_dir),
            "ood_val_path": str(tiny_split_dir), "submission_path": str(box / "app" / "submission"),
            "gpus": 0}  # fmt: skip
    budget = write_budget(box, **{**good, **(changes(box) if changes else {})})
    if setup is not None:
        setup(box)
    if "--budget" not in args and "--simulate" not in args:
        args = ["--budget", str(budget), *args]
    args = [arg.format(tmp=box) for arg in args]
    before = snapshot(box)
    modules = tmp_path_factory.mktemp("modules") / "loaded.json"
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", RUNNER.format(root=str(ROOT), modules=str(modules)), *args],
                            cwd=box, capture_output=True, text=True, timeout=120)  # fmt: skip
    seconds = time.monotonic() - started
    assert result.returncode == 2, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("run_search.py: error: ") and expected.format(tmp=box) in lines[0], lines[0]
    assert result.stdout == ""
    assert snapshot(box) == before  # no study, no round folder, no submission, nothing else
    assert json.loads(modules.read_text()) == []  # no model code was even imported
    assert seconds < 30  # fails fast: nothing hangs (the storage URL has a connect timeout)
