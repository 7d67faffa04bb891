"""Bad input, one case per test id: `run_search.py` exits with code 2 and exactly one line on stderr that names the
problem, with no traceback, before any model is loaded, and leaves the folder exactly as it was (no study, no round
folder, no submission; the storage file byte for byte).

Most cases run `run_search.main` in this process (a subprocess per case would cost seconds each); a few run the real
program in a subprocess, which also checks that no model code was imported and that nothing hangs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Callable

import optuna
import pyarrow
import pyarrow.parquet
import pytest
import yaml

import faultkit

ROOT = Path(__file__).resolve().parents[1]
# run_search.main, then the modules it imported written to a file: no model code may have been loaded. Its memory is
# capped, so that a YAML alias bomb that expands fails the test instead of taking the machine, and a search that
# starts is an error.
RUNNER = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))
sys.path.insert(0, {root!r})
import run_search
from search import scheduler

def started(self):
    raise SystemExit("bad input reached the search")

scheduler.Scheduler.run = started
try:
    code = run_search.main(sys.argv[1:])
finally:
    heavy = [m for m in sys.modules if m.startswith(("transformers.models", "trainer.round", "trl", "peft"))]
    open({modules!r}, "w").write(json.dumps(heavy))
sys.exit(code)
"""
DELETE = object()  # a budget change that removes the key
SECRET = "hunter2secret"


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    expected: str  # found in the one stderr line; {tmp} is the box folder
    args: tuple[str, ...] = ()
    budget: dict | None = None  # dotted key path ("space.beta.low") -> value, applied to the good budget
    text: Callable[[str], str | bytes] | None = None  # the budget file's content, from the good budget's text
    setup: Callable[[Path], None] | None = None  # changes to the box, before the run
    subprocess: bool = False  # run the real program: also checks the imports and that it does not hang


def value(id: str, changes: dict, expected: str) -> Case:
    return Case(id, expected, budget=changes)


def text(id: str, content: Callable[[str], str | bytes], expected: str) -> Case:
    return Case(id, expected, text=content)


def cli(id: str, args: tuple[str, ...], expected: str, **kwargs) -> Case:
    return Case(id, expected, args=args, **kwargs)


def box_case(id: str, setup: Callable[[Path], None] | None, expected: str, **kwargs) -> Case:
    return Case(id, expected, setup=setup, **kwargs)


# ---------------------------------------------------------------------------------------------------------- builders
def good_budget(box: Path, split: Path) -> dict:
    data = yaml.safe_load((ROOT / "budget.yaml").read_text())
    data.update(model_path=str(box / "model"), train_path=str(split), val_path=str(split), ood_val_path=str(split),
                submission_path=str(box / "app" / "submission"), gpus=0)  # fmt: skip
    return data


def apply(data: dict, changes: dict, box: Path) -> dict:
    for path, new in changes.items():
        *parents, last = path.split(".")
        node = data
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        new = new(box) if callable(new) else new
        if new is DELETE:
            del node[last]
        elif isinstance(node, list):
            node[int(last)] = new
        else:
            node[last] = new
    return data


def replace_line(key: str, line: str) -> Callable[[str], str]:
    """The good budget's text with the top-level `key: ...` line replaced."""
    return lambda good: "\n".join(line if row.startswith(f"{key}:") else row for row in good.splitlines()) + "\n"


def copy_split(name: str, change: Callable[[Path], None]) -> Callable[[Path], None]:
    """A copy of the tiny split (its folder is named in the box's `.split`), changed."""

    def setup(box: Path) -> None:
        folder = box / name
        shutil.copytree(Path((box / ".split").read_text()), folder)
        change(folder)

    return setup


def split_case(id: str, key: str, change: Callable[[Path], None], expected: str) -> Case:
    """The split under `key` is a copy of the tiny split, changed."""
    return Case(id, expected, budget={key: lambda t: str(t / "split")}, setup=copy_split("split", change))


def new_split(id: str, key: str, make: Callable[[Path], None], expected: str) -> Case:
    return Case(id, expected, budget={key: lambda t: str(t / "split")}, setup=lambda t: make(t / "split"))


def parquet(folder: Path, columns: dict) -> None:
    folder.mkdir(parents=True)
    pyarrow.parquet.write_table(pyarrow.table(columns), folder / "part-0.parquet")


def image_cell() -> dict:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buffer, format="PNG")
    return {"bytes": buffer.getvalue(), "path": None}


def empty_saved_split(folder: Path) -> None:
    import datasets

    datasets.Dataset.from_dict({"image": [], "problem": [], "solution": []}).save_to_disk(str(folder))


def two_split_dict(folder: Path) -> None:
    import datasets

    rows = {"image": [image_cell()], "problem": ["How many?"], "solution": ["<answer> 1 </answer>"]}
    part = datasets.Dataset.from_dict(rows)
    datasets.DatasetDict({"a": part, "b": part}).save_to_disk(str(folder))


def truncate_arrow(folder: Path) -> None:
    [shard] = folder.glob("*.arrow")
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def journal(path: Path) -> optuna.storages.JournalStorage:
    return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(path)))


def existing_study(**kwargs) -> Callable[[Path], None]:
    """A study named count-grpo in the box's study.db, as `kwargs` describe it."""

    def make(box: Path) -> None:
        directions = kwargs.get("directions", ["maximize"])
        study = optuna.create_study(storage=journal(box / "study.db"), study_name="count-grpo", directions=directions)
        for key, attr in kwargs.get("attrs", {}).items():
            study.set_user_attr(key, attr)
        if kwargs.get("foreign_trial"):
            study.add_trial(optuna.trial.create_trial(value=1.0, params={"x": 1.0},
                                                      distributions={"x": optuna.distributions.FloatDistribution(0, 2)}))

    return make


def sampled_study(**choices: list) -> Callable[[Path], None]:
    """A study of this search (a deadline) whose one finished round sampled each parameter from `choices`."""

    def make(box: Path) -> None:
        study = optuna.create_study(storage=journal(box / "study.db"), study_name="count-grpo", direction="maximize")
        distributions = {name: optuna.distributions.CategoricalDistribution(c) for name, c in choices.items()}
        study.add_trial(optuna.trial.create_trial(value=1.0, params={name: c[0] for name, c in choices.items()},
                                                  distributions=distributions, user_attrs={"recipe": "sampled"}))
        study.set_user_attr("deadline", 4e9)

    return make


def write(path: str, content: str | bytes) -> Callable[[Path], None]:
    def make(box: Path) -> None:
        target = box / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content if isinstance(content, bytes) else content.encode())

    return make


def model_change(change: Callable[[Path], None]) -> Callable[[Path], None]:
    return lambda box: change(box / "model")


def fifo(name: str) -> Callable[[Path], None]:
    return lambda box: os.mkfifo(box / name)


def alias_bomb(good: str) -> str:
    """study_name: nine levels of ten aliases each, a billion strings once expanded."""
    levels = ["&a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]
    return replace_line("study_name", "study_name: [" + ", ".join(levels) + "]")(good)


def sqlite_file(path: Path) -> None:
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute("create table t (x integer)")
        db.commit()


def append_line(line: bytes) -> Callable[[Path], None]:
    def make(box: Path) -> None:
        with (box / "study.db").open("ab") as f:
            f.write(line)

    return make


def lock_symlink(box: Path) -> None:
    (box / "outside.txt").write_text("not ours\n")
    (box / "app" / ".submission.lock").symlink_to(box / "outside.txt")


LONG = "x" * 300

# ---------------------------------------------------------------------------------------------------------- the cases
CASES = [
    # --- the command line
    cli("unknown_argument", ("--frobnicate",), "unrecognized arguments: --frobnicate"),
    cli("simulate_with_demo", ("--simulate", "--demo"), "argument --demo: not allowed with argument --simulate"),
    cli("hours_without_a_value", ("--hours",), "argument --hours: expected one argument"),
    cli("unknown_command", ("leaderbord",), "invalid choice: 'leaderbord'"),
    cli("command_with_a_newline", ("leader\nboard",), "invalid choice"),
    cli("two_commands", ("leaderboard", "again"), "unrecognized arguments: again"),
    cli("password_in_a_stray_argument", (f"postgresql://u:{SECRET}@db/optuna",), "invalid choice"),
    cli("hours_text", ("--hours", "soon"), "hours: must be a number of hours, got 'soon'"),
    cli("hours_empty", ("--hours", ""), "hours: must be a number of hours, got ''"),
    cli("hours_sexagesimal", ("--hours", "7:30"), "hours: must be a number of hours, got '7:30'"),
    cli("hours_hexadecimal", ("--hours", "0x10"), "hours: must be a number of hours, got '0x10'"),
    cli("hours_zero", ("--hours", "0"), "hours: must be > 0, got 0"),
    cli("hours_negative", ("--hours", "-3"), "hours: must be > 0, got -3"),
    cli("hours_nan", ("--hours", "nan"), "hours: must be a finite number, got nan"),
    cli("hours_inf", ("--hours", "inf"), "hours: must be a finite number, got inf"),
    cli("hours_1e300", ("--hours", "1e300"), "hours: must be <= 168 (a week), got 1e+300", subprocess=True),
    cli("hours_1e9", ("--hours", "1e9"), "hours: must be <= 168 (a week), got 1000000000.0"),
    cli("hours_above_a_week", ("--hours", "169"), "hours: must be <= 168 (a week), got 169"),
    cli("hours_too_short_for_one_round", ("--hours", "0.5"), "hours: 0.5 h leaves no room for one round"),
    cli("study_name_empty", ("--study-name", ""), "study_name: must be a non-empty string"),
    cli("study_name_blank", ("--study-name", "   "), "study_name: must be a non-empty string"),
    cli("study_name_too_long", ("--study-name", LONG), "study_name: must be at most 128 characters, got 300"),
    cli("study_name_with_a_newline", ("--study-name", "a\nb"), "study_name: must not hold control characters"),
    cli("study_name_with_a_nul", ("--study-name", "a\0b"), "study_name: must not hold control characters"),
    cli("study_name_with_a_nel", ("--study-name", "a\x85b"), "study_name: must not hold control characters"),
    cli("study_name_with_a_csi", ("--study-name", "a\x9b31mb"), "study_name: must not hold control characters"),
    cli("study_name_with_a_line_separator", ("--study-name", "a\u2028b"), "study_name: must not hold control characters"),  # noqa: E501
    cli("study_name_with_an_escape", ("--study-name", "a\x1b[2Jb"), "study_name: must not hold control characters"),
    cli("study_name_not_utf8", ("--study-name", "comptage-\udce9t\udce9"), "study_name: must be UTF-8 text", subprocess=True),  # noqa: E501
    cli("storage_not_utf8", ("--storage", "st\udcffudy.db"), "storage: must be UTF-8 text", subprocess=True),
    cli("budget_under_the_home_folder_missing", ("--budget", "~/no-such-budget-file.yaml"), f"budget: cannot read {Path('~/no-such-budget-file.yaml').expanduser()}: no such file"),  # noqa: E501
    value("study_name_in_the_budget_with_a_c1_control", {"study_name": "count\x9fgrpo"}, "study_name: must not hold control characters"),  # noqa: E501
    value("warm_start_name_with_a_csi", {"warm_starts.0.name": "strong\x9b"}, "warm_starts[0].name: must not hold control characters"),  # noqa: E501
    cli("storage_empty", ("--storage", ""), "storage: must be a non-empty string"),
    cli("storage_with_a_nul", ("--storage", "st\0udy.db"), "storage: must not hold control characters"),
    cli("budget_empty_path", ("--budget", ""), "budget: . is not a file"),
    cli("budget_is_a_folder", ("--budget", "{tmp}/app"), "budget: {tmp}/app is not a file"),
    cli("budget_is_a_device", ("--budget", "/dev/null"), "budget: /dev/null is not a file"),
    cli("budget_is_a_fifo", ("--budget", "{tmp}/pipe.yaml"), "budget: {tmp}/pipe.yaml is not a file",
        setup=fifo("pipe.yaml"), subprocess=True),
    cli("budget_file_missing", ("--budget", "{tmp}/absent.yaml"), "budget: cannot read {tmp}/absent.yaml"),
    cli("leaderboard_with_simulate", ("leaderboard", "--simulate"), "leaderboard: --simulate is for a search"),
    cli("leaderboard_of_no_storage", ("leaderboard", "--storage", "{tmp}/none.db"), "storage: {tmp}/none.db does not exist"),
    cli("leaderboard_of_no_such_study", ("leaderboard", "--study-name", "absent"), "no study 'absent' in study.db"),
    cli("leaderboard_of_a_sqlite_file", ("leaderboard", "--storage", "{tmp}/other.db"),
        "storage: {tmp}/other.db is not an Optuna journal file", setup=lambda t: sqlite_file(t / "other.db")),  # noqa: E501
    # --- reading the budget file
    text("budget_utf16", lambda good: good.encode("utf-16"), "is not UTF-8 text", ),
    text("budget_utf16_without_bom", lambda good: good.encode("utf-16-le"), "is not UTF-8 text (a NUL character"),
    text("budget_latin1", lambda good: good.replace("count-grpo", "comptage-\u00e9t\u00e9").encode("latin-1"),
         "is not UTF-8 text (byte 0xe9"),
    text("budget_random_bytes", lambda good: bytes(range(256)) * 4, "is not UTF-8 text"),
    text("budget_nul_bytes", lambda good: good + "\0\0\0\n", "is not UTF-8 text (a NUL character at offset"),
    text("budget_empty", lambda good: "", "holds no keys"),
    text("budget_only_comments", lambda good: "# nothing\n# here\n", "holds no keys"),
    text("budget_a_list", lambda good: "- 1\n- 2\n", "must hold a mapping of keys, got a list"),
    text("budget_a_scalar", lambda good: "7.5\n", "must hold a mapping of keys, got a float"),
    text("budget_malformed", lambda good: "hours: 7.5\nspace: [unclosed\n", "budget: malformed YAML at"),
    text("budget_bad_indentation", lambda good: good.replace("  seed: 0", "    seed: 0", 1), "budget: malformed YAML"),
    text("budget_tab_indentation", lambda good: good.replace("  seed: 0", "\tseed: 0", 1), "budget: malformed YAML"),
    text("budget_duplicate_key", lambda good: good + "hours: 3\n", "duplicate key 'hours'"),
    text("budget_duplicate_nested_key", lambda good: good.replace("  seed: 0\n", "  seed: 0\n  seed: 1\n", 1),
         "duplicate key 'seed'"),
    text("budget_sexagesimal_hours", replace_line("hours", "hours: 7:30"), "hours: must be a number, got '7:30'"),
    text("budget_sexagesimal_minutes", replace_line("reserve_minutes", "reserve_minutes: 1:00"),
         "reserve_minutes: must be a number, got '1:00'"),
    Case("budget_alias_bomb", "expands to more than", text=alias_bomb, subprocess=True),
    text("budget_octal_minutes", replace_line("reserve_minutes", "reserve_minutes: 020"), "reserve_minutes: must be a number, got '020'"),  # noqa: E501
    text("budget_octal_hours", replace_line("hours", "hours: 07"), "hours: must be a number, got '07'"),
    text("budget_octal_gpus", replace_line("gpus", "gpus: 00"), "gpus: must be an integer in [0, 64] or 'auto', got '00'"),  # noqa: E501
    text("budget_octal_nested_seed", lambda good: good.replace("  seed: 0\n", "  seed: 010\n", 1), "sampler.seed: must be an integer, got '010'"),  # noqa: E501
    text("budget_merge_key_overriding_hours", lambda good: good + "<<: {hours: 3}\n", "a merge key (<<) is not allowed"),  # noqa: E501
    text("budget_merge_key_from_an_anchor", lambda good: good.replace("  seed: 0\n", "  seed: 0\n  <<: &more {n_startup_trials: 1}\n", 1), "a merge key (<<) is not allowed"),  # noqa: E501
    text("budget_merge_key_of_a_list", lambda good: good + "<<: [{hours: 3}, {gpus: 1}]\n", "a merge key (<<) is not allowed"),  # noqa: E501
    text("budget_recursive_alias", replace_line("study_name", "study_name: &loop [*loop]"), "recursive alias"),
    text("budget_nested_too_deeply", replace_line("study_name", "study_name: " + "[" * 5000 + "]" * 5000),
         "nested too deeply"),
    text("budget_python_tag", lambda good: good + "x-run: !!python/object/apply:os.system [echo]\n",
         "budget: malformed YAML"),
    text("budget_two_documents", lambda good: good + "---\nhours: 3\n", "budget: malformed YAML"),
    text("budget_too_large", lambda good: good + ("# padding\n" * 120_000), "a budget is a few KB"),
    text("budget_integer_key", lambda good: good + "1: 2\n", "1: unknown key"),
    text("budget_null_key", lambda good: good + "~: 2\n", "None: unknown key"),
    text("budget_unhashable_key", lambda good: good + "? [a, b]\n: 2\n", "budget: malformed YAML"),
    text("budget_very_long_key", lambda good: good + "k" * 1000 + ": 1\n", "kkk: unknown key in"),  # cut: the line stays short
    text("study_name_binary", replace_line("study_name", "study_name: !!binary aGVsbG8="),
         "study_name: must be a non-empty string, got b'hello'"),
    text("study_name_a_date", replace_line("study_name", "study_name: 2024-01-01"), "study_name: must be a non-empty string, got datetime.date(2024, 1, 1)"),
    text("warm_starts_a_set", lambda good: good.split("warm_starts:")[0] + "warm_starts: !!set {a, b}\n",
         "warm_starts: must be a list"),
    # --- the budget's keys and values
    value("unknown_key", {"hourz": 3}, "hourz: unknown key"),
    value("missing_key", {"seed": DELETE}, "seed: missing in"),
    value("hours_zero_in_the_file", {"hours": 0}, "hours: must be > 0, got 0"),
    value("hours_text_in_the_file", {"hours": "7.5"}, "hours: must be a number, got '7.5'"),
    value("hours_a_list", {"hours": [7]}, "hours: must be a number, got [7]"),
    value("hours_a_boolean", {"hours": True}, "hours: must be a number, got True"),
    value("hours_null", {"hours": None}, "hours: must be a number, got None"),
    value("hours_nan_in_the_file", {"hours": float("nan")}, "hours: must be a finite number, got nan"),
    value("hours_inf_in_the_file", {"hours": float("inf")}, "hours: must be a finite number, got inf"),
    value("hours_1e300_in_the_file", {"hours": 1e300}, "hours: must be <= 168 (a week)"),
    value("reserve_negative", {"reserve_minutes": -1}, "reserve_minutes: must be in [0, 10080], got -1"),
    value("reserve_text", {"reserve_minutes": "20"}, "reserve_minutes: must be a number, got '20'"),
    value("reserve_huge", {"reserve_minutes": 1e308}, "reserve_minutes: must be in [0, 10080], got 1e+308"),
    value("round_min_zero", {"round_min_minutes": 0}, "round_min_minutes: must be in (0, 10080], got 0"),
    value("round_max_below_round_min", {"round_max_minutes": 10}, "round_max_minutes: must be >= round_min_minutes"),
    value("round_max_huge", {"round_max_minutes": 1e308}, "round_max_minutes: must be in (0, 10080], got 1e+308"),
    value("hang_zero", {"hang_minutes": 0}, "hang_minutes: must be in (0, 10080], got 0"),
    value("hang_text", {"hang_minutes": "soon"}, "hang_minutes: must be a number, got 'soon'"),
    value("prior_scale_zero", {"duration_prior_scale": 0}, "duration_prior_scale: must be in (0, 1000], got 0"),
    value("prior_scale_huge", {"duration_prior_scale": 1e300}, "duration_prior_scale: must be in (0, 1000], got 1e+300"),
    value("prior_scale_text", {"duration_prior_scale": "fast"}, "duration_prior_scale: must be a number"),
    value("prior_scale_half_a_mapping", {"duration_prior_scale": {"gpu": 1.0}},
          "duration_prior_scale: a mapping must have exactly the keys gpu and cpu"),
    value("prior_scale_negative_cpu", {"duration_prior_scale": {"gpu": 1.0, "cpu": -2}},
          "duration_prior_scale.cpu: must be in (0, 1000], got -2"),
    value("prior_scale_text_gpu", {"duration_prior_scale": {"gpu": "x", "cpu": 1}},
          "duration_prior_scale.gpu: must be a number"),
    value("gpus_negative", {"gpus": -1}, "gpus: must be an integer in [0, 64] or 'auto', got -1"),
    value("gpus_text", {"gpus": "many"}, "gpus: must be an integer in [0, 64] or 'auto', got 'many'"),
    value("gpus_fractional", {"gpus": 2.5}, "gpus: must be an integer in [0, 64] or 'auto', got 2.5"),
    value("gpus_a_boolean", {"gpus": True}, "gpus: must be an integer in [0, 64] or 'auto', got True"),
    value("gpus_thousands", {"gpus": 1000}, "gpus: must be an integer in [0, 64] or 'auto', got 1000"),
    value("gpus_more_than_visible", {"gpus": 2}, "gpus: 2, but this machine shows 0 GPUs"),
    value("gpus_per_trial_zero", {"gpus_per_trial": 0}, "gpus_per_trial: must be an integer >= 1, got 0"),
    value("gpus_per_trial_above_gpus", {"gpus": 2, "gpus_per_trial": 4}, "gpus_per_trial: 4 is more than gpus (2)"),
    value("gpus_per_trial_not_dividing", {"gpus": 3, "gpus_per_trial": 2}, "does not divide gpus (3)"),
    value("gpus_per_trial_text", {"gpus_per_trial": "1"}, "gpus_per_trial: must be an integer"),
    value("rounds_per_slot_zero", {"rounds_per_slot": 0}, "rounds_per_slot: must be an integer in [1, 64], got 0"),
    value("rounds_per_slot_thousands", {"rounds_per_slot": 1000}, "rounds_per_slot: must be an integer in [1, 64]"),
    value("model_path_empty", {"model_path": ""}, "model_path: must be a non-empty string"),
    value("model_path_null", {"model_path": None}, "model_path: must be a non-empty string, got None"),
    value("model_path_a_number", {"model_path": 5}, "model_path: must be a non-empty string, got 5"),
    value("model_path_a_list", {"model_path": ["a"]}, "model_path: must be a non-empty string, got ['a']"),
    value("model_path_with_a_nul", {"model_path": "mo\0del"}, "model_path: must not hold control characters"),
    value("model_path_too_long", {"model_path": "/" + "m" * 5000}, "model_path: must be at most 4096 characters"),
    value("train_path_a_number", {"train_path": 5}, "train_path: must be a non-empty string, got 5"),
    value("val_path_a_mapping", {"val_path": {}}, "val_path: must be a non-empty string, got {{}}"),
    value("submission_path_empty", {"submission_path": ""}, "submission_path: must be a non-empty string"),
    value("runs_dir_a_number", {"runs_dir": 5}, "runs_dir: must be a non-empty string, got 5"),
    value("study_name_null", {"study_name": None}, "study_name: must be a non-empty string, got None"),
    value("study_name_a_number", {"study_name": 5}, "study_name: must be a non-empty string, got 5"),
    value("study_name_too_long_in_the_file", {"study_name": LONG}, "study_name: must be at most 128 characters"),
    value("storage_a_number", {"storage": 5}, "storage: must be a non-empty string, got 5"),
    value("ood_rows_zero", {"ood_rows": 0}, "ood_rows: must be an integer >= 1, got 0"),
    value("ood_rows_text", {"ood_rows": "all"}, "ood_rows: must be an integer"),
    value("ood_rows_a_boolean", {"ood_rows": True}, "ood_rows: must be an integer"),
    value("prune_rows_fractional", {"prune_rows": 2.5}, "prune_rows: must be an integer"),
    value("prune_rows_too_many", {"prune_rows": 10**7}, "prune_rows: must be an integer in [1, 1000000], got 10000000"),
    value("prune_every_negative", {"prune_every": -1}, "prune_every: must be an integer in [0, 1000000], got -1"),
    value("prune_every_text", {"prune_every": "50"}, "prune_every: must be an integer"),
    value("val_rows_negative", {"val_rows": -1}, "val_rows: must be an integer >= 0, got -1"),
    value("eval_batch_size_zero", {"eval_batch_size": 0}, "eval_batch_size: must be an integer in [1, 65536], got 0"),
    value("eval_batch_size_text", {"eval_batch_size": "64"}, "eval_batch_size: must be an integer"),
    value("eval_static_cache_text", {"eval_static_cache": "yes"}, "eval_static_cache: must be true or false, got 'yes'"),
    value("eval_static_cache_a_number", {"eval_static_cache": 1}, "eval_static_cache: must be true or false, got 1"),
    value("seed_negative", {"seed": -1}, "seed: must be an integer in [0, 4294967295], got -1"),
    value("seed_too_large", {"seed": 2**40}, "seed: must be an integer in [0, 4294967295], got 1099511627776"),
    value("seed_fractional", {"seed": 1.5}, "seed: must be an integer, got 1.5"),
    value("min_format_rate_above_100", {"min_format_rate": 150}, "min_format_rate: must be in [0, 100], got 150"),
    value("min_format_rate_text", {"min_format_rate": "90"}, "min_format_rate: must be a number"),
    value("keep_rounds_negative", {"keep_rounds": -1}, "keep_rounds: must be an integer >= 0, got -1"),
    value("keep_rounds_fractional", {"keep_rounds": 1.5}, "keep_rounds: must be an integer, got 1.5"),
    # --- sampler and pruner
    value("sampler_a_list", {"sampler": ["tpe"]}, "sampler: must be a mapping"),
    value("sampler_without_type", {"sampler": {"seed": 0}}, "sampler.type: must be one of ['random', 'tpe'], got None"),
    value("sampler_type_a_list", {"sampler": {"type": ["tpe"]}}, "sampler.type: must be one of ['random', 'tpe']"),
    value("sampler_unknown", {"sampler": {"type": "cmaes-ish"}}, "sampler.type: must be one of"),
    value("sampler_unknown_option", {"sampler.n_startup": 3}, "sampler.n_startup: not an option of TPESampler"),
    value("sampler_startup_text", {"sampler.n_startup_trials": "six"}, "sampler.n_startup_trials: must be an integer, got 'six'"),  # noqa: E501
    value("sampler_startup_negative", {"sampler.n_startup_trials": -1}, "sampler.n_startup_trials: must be an integer in"),
    value("sampler_seed_text", {"sampler.seed": "x"}, "sampler.seed: must be an integer"),
    value("sampler_seed_negative", {"sampler.seed": -1}, "sampler.seed: must be an integer in [0, 4294967295]"),
    value("sampler_seed_too_large", {"sampler.seed": 2**40}, "sampler.seed: must be an integer in [0, 4294967295]"),
    value("sampler_multivariate_text", {"sampler.multivariate": "yes"}, "sampler.multivariate: must be true or false"),
    value("sampler_constant_liar_a_number", {"sampler.constant_liar": 1}, "sampler.constant_liar: must be true or false"),
    value("sampler_gamma", {"sampler.gamma": "x"}, "sampler.gamma: not an option a budget can set"),
    value("sampler_huge_candidates", {"sampler.n_ei_candidates": 10**9}, "sampler.n_ei_candidates: must be an integer in"),
    value("sampler_prior_weight_text", {"sampler.prior_weight": "heavy"}, "sampler.prior_weight: not an option a budget can set"),
    value("pruner_unknown", {"pruner": {"type": "sometimes"}}, "pruner.type: must be one of"),
    value("pruner_unknown_option", {"pruner.n_startup": 3}, "pruner.n_startup: not an option of MedianPruner"),
    value("pruner_warmup_negative", {"pruner.n_warmup_steps": -1}, "pruner.n_warmup_steps: must be an integer in"),
    value("pruner_startup_text", {"pruner.n_startup_trials": "four"}, "pruner.n_startup_trials: must be an integer"),
    value("pruner_interval_zero", {"pruner.interval_steps": 0}, "pruner.interval_steps: must be an integer in"),
    value("pruner_percentile_missing", {"pruner": {"type": "percentile"}}, "pruner.percentile: missing"),
    value("pruner_percentile_above_100", {"pruner": {"type": "percentile", "percentile": 150}},
          "pruner.percentile: must be in [0, 100], got 150"),
    value("pruner_hyperband_fractional_factor", {"pruner": {"type": "hyperband", "reduction_factor": 1.5}},
          "pruner.reduction_factor: must be an integer"),
    value("pruner_hyperband_min_resource_above_max", {"pruner": {"type": "hyperband", "min_resource": 100, "max_resource": 10}}, "pruner.min_resource: must be <= max_resource (10), got 100: Hyperband would never prune"),  # noqa: E501
    value("pruner_hyperband_min_resource_one_above_max", {"pruner": {"type": "hyperband", "min_resource": 2, "max_resource": 1}}, "pruner.min_resource: must be <= max_resource (1), got 2"),  # noqa: E501
    value("pruner_hyperband_max_resource_text", {"pruner": {"type": "hyperband", "max_resource": "lots"}},
          "pruner.max_resource: must be an integer"),
    # --- the space
    value("space_a_list", {"space": ["beta"]}, "space: must be a mapping of option -> bounds"),
    value("space_unknown_option", {"space.momentum": [0.9]}, "space.momentum: unknown option"),
    value("space_missing_option", {"space.steps": DELETE}, "space.steps: missing"),
    value("space_rewards_a_list", {"space.reward_weights": [1.0]}, "space.reward_weights: must map reward names"),
    value("space_unknown_reward", {"space.reward_weights.bogus": [0.0]}, "space.reward_weights.bogus: unknown reward"),
    value("space_reward_integer_key", {"space.reward_weights": lambda t: {**_space()["reward_weights"], 5: [0.0]}},
          "space.reward_weights.5: unknown reward"),
    value("space_weights_text", {"space.reward_weights.brevity": "0.5"}, "space.reward_weights.brevity: must be a non-empty list"),  # noqa: E501
    value("space_weight_nan", {"space.reward_weights.brevity": [float("nan")]},
          "space.reward_weights.brevity[0]: must be a finite number, got nan"),
    value("space_weight_repeated", {"space.reward_weights.brevity": [0.5, 0.5]}, "space.reward_weights.brevity: has a repeated weight"),  # noqa: E501
    value("space_weight_negative", {"space.reward_weights.brevity": [-1.0]}, "space.reward_weights.brevity[0]: must be in [0, 1000]"),  # noqa: E501
    value("space_accuracy_missing", {"space.reward_weights.accuracy": DELETE}, "space.reward_weights.accuracy: missing"),
    value("space_format_never_positive", {"space.reward_weights.answer_format": [0.0]},
          "space.reward_weights.answer_format: needs a weight > 0"),
    value("space_bound_inverted", {"space.beta": {"low": 0.1, "high": 0.001}}, "space.beta.high: must be >= low"),
    value("space_log_low_zero", {"space.learning_rate_lora.low": 0}, "space.learning_rate_lora.low: must be > 0"),
    value("space_bound_missing", {"space.beta": {"low": 0.001}}, "space.beta.high: missing"),
    value("space_bound_unknown_key", {"space.beta.mid": 0.01}, "space.beta.mid: unknown key"),
    value("space_steps_fractional", {"space.steps.low": 10.5}, "space.steps.low: must be an integer"),
    value("space_steps_step_zero", {"space.steps.step": 0}, "space.steps.step: must be >= 1"),
    value("space_steps_text", {"space.steps.low": "50"}, "space.steps.low: must be a number"),
    value("space_temperature_too_high", {"space.temperature.high": 3.0}, "space.temperature.high: must be in"),
    value("space_group_of_one", {"space.num_generations": [1]}, "space.num_generations[0]: must be an integer in [2, 256], got 1"),
    value("space_no_choices", {"space.num_generations": []}, "space.num_generations: must be a non-empty list"),
    value("space_choices_text", {"space.num_generations": "8"}, "space.num_generations: must be a non-empty list"),
    value("space_choice_repeated", {"space.lora_rank": [0, 16, 16]}, "space.lora_rank: has a repeated choice"),
    value("space_choice_a_boolean", {"space.lora_rank": [True]}, "space.lora_rank[0]: must be an integer, got True"),
    value("space_loss_unknown", {"space.loss_type": ["ppo"]}, "space.loss_type[0]: must be one of"),
    value("space_pixels_tiny", {"space.max_pixels": [10]}, "space.max_pixels[0]: must be an integer in [3136, 12845056], got 10"),
    value("space_phrasing_a_number", {"space.phrasing": ["eval", 5]}, "space.phrasing[1]: must be one of"),
    # --- fixed
    value("fixed_a_list", {"fixed": ["x"]}, "fixed: must be a mapping of TrialConfig options"),
    value("fixed_unknown_option", {"fixed.bogus": 1}, "fixed.bogus: not a TrialConfig option"),
    value("fixed_integer_key", {"fixed": lambda t: {**_fixed(), 5: 1}}, "fixed.5: not a TrialConfig option"),
    value("fixed_sets_a_searched_option", {"fixed.learning_rate": 1e-5}, "fixed.learning_rate: set by the key 'space'"),
    value("fixed_sets_eval_rows", {"fixed.eval_rows": 64}, "fixed.eval_rows: set by the key 'prune_rows'"),
    value("fixed_sets_output_dir", {"fixed.output_dir": "x"}, "fixed.output_dir: set by the key 'runs_dir'"),
    value("fixed_lora_targets_a_number", {"fixed.lora_targets": 5}, "fixed.lora_targets: must be a non-empty list of module names"),  # noqa: E501
    value("fixed_lora_targets_a_string", {"fixed.lora_targets": "q_proj"}, "fixed.lora_targets: must be a non-empty list of module names"),  # noqa: E501
    value("fixed_lora_targets_numbers", {"fixed.lora_targets": [5]}, "fixed.lora_targets: must be a non-empty list of module names"),  # noqa: E501
    value("fixed_lora_targets_empty", {"fixed.lora_targets": []}, "fixed.lora_targets: must be a non-empty list"),
    value("fixed_prompts_zero", {"fixed.prompts_per_step": 0}, "fixed.prompts_per_step: must be an integer in [1, 1024], got 0"),
    value("fixed_prompts_text", {"fixed.prompts_per_step": "2"}, "fixed.prompts_per_step: must be an integer, got '2'"),
    value("fixed_epsilon_above_one", {"fixed.epsilon": 1.5}, "fixed.epsilon: must be in (0.0, 1.0)"),
    value("fixed_epsilon_high_below_epsilon", {"fixed.epsilon_high": 0.1}, "fixed.epsilon_high: must be in [0.2, 1.0)"),
    value("fixed_dropout_one", {"fixed.lora_dropout": 1.0}, "fixed.lora_dropout: must be in [0.0, 1.0)"),
    value("fixed_checkpointing_text", {"fixed.gradient_checkpointing": "yes"}, "fixed.gradient_checkpointing: must be true, false, null or a layer interval"),  # noqa: E501
    value("fixed_vision_tower_a_number", {"fixed.train_vision_tower": 1}, "fixed.train_vision_tower: must be true or false"),  # noqa: E501
    value("fixed_train_rows_zero", {"fixed.train_rows": 0}, "fixed.train_rows: must be an integer in [1, 100000000], got 0"),
    value("fixed_completion_too_long", {"fixed.max_completion_length": 4096}, "fixed.max_completion_length: must be an integer in [8, 2048], got 4096"),  # noqa: E501
    value("fixed_schedule_unknown", {"fixed.lr_schedule": "step"}, "fixed.lr_schedule: must be one of"),
    value("fixed_scale_rewards_unknown", {"fixed.scale_rewards": "weird"}, "fixed.scale_rewards: must be one of"),
    value("fixed_warmup_too_long", {"fixed.warmup_ratio": 0.9}, "fixed.warmup_ratio: must be in [0.0, 0.5]"),
    value("fixed_compile_text", {"fixed.compile_rollouts": "no"}, "fixed.compile_rollouts: must be true or false"),
    value("fixed_batched_vision_text", {"fixed.batched_vision_attention": "on"}, "fixed.batched_vision_attention: must be true or false"),  # noqa: E501
    # --- warm starts
    value("warm_starts_a_mapping", {"warm_starts": {"strong": {}}}, "warm_starts: must be a list of {{name, params}}"),
    value("warm_start_a_number", {"warm_starts": [5]}, "warm_starts[0]: must have exactly the keys name and params"),
    value("warm_start_without_params", {"warm_starts.1": {"name": "x"}}, "warm_starts[1]: must have exactly the keys name and params"),  # noqa: E501
    value("warm_start_name_empty", {"warm_starts.0.name": ""}, "warm_starts[0].name: must be a non-empty string"),
    value("warm_start_name_taken", {"warm_starts.1.name": "strong"}, "warm_starts[1].name: 'strong' is taken"),
    value("warm_start_name_sampled", {"warm_starts.0.name": "sampled"}, "warm_starts[0].name: 'sampled' is taken"),
    value("warm_start_name_a_number", {"warm_starts.0.name": 5}, "warm_starts[0].name: must be a non-empty string, got 5"),
    value("warm_start_params_a_list", {"warm_starts.0.params": ["beta"]}, "warm_starts[0].params: must be a mapping"),
    value("warm_start_unknown_option", {"warm_starts.1.params.optimizer": "sgd"}, "warm_starts[1].params.optimizer: not a searched option"),  # noqa: E501
    value("warm_start_rate_without_rank", {"warm_starts.0.params.lora_rank": DELETE}, "warm_starts[0].params.learning_rate: needs lora_rank"),  # noqa: E501
    value("warm_start_outside_the_space", {"warm_starts.0.params.beta": 5.0}, "warm_starts[0].params.beta: 5.0 is outside space.beta"),  # noqa: E501
    value("warm_start_rank_not_a_choice", {"warm_starts.0.params.lora_rank": 32}, "warm_starts[0].params.lora_rank: 32 is not one of"),  # noqa: E501
    value("warm_start_rank_text", {"warm_starts.0.params.lora_rank": "64"}, "warm_starts[0].params.lora_rank: '64' is not one of"),  # noqa: E501
    value("warm_start_steps_off_the_grid", {"warm_starts.1.params.steps": 105}, "warm_starts[1].params.steps: 105 is not on the grid"),  # noqa: E501
    value("warm_start_rewards_a_list", {"warm_starts.0.params.reward_weights": [1.0]}, "warm_starts[0].params.reward_weights: must map reward names"),  # noqa: E501
    value("warm_start_unknown_reward", {"warm_starts.0.params.reward_weights.bogus": 1.0}, "warm_starts[0].params.reward_weights.bogus: not in space.reward_weights"),  # noqa: E501
    value("warm_start_without_core_reward", {"warm_starts.1.params.reward_weights": {"brevity": 0.5}}, "warm_starts[1].params.reward_weights: accuracy and answer_format must not both be 0"),  # noqa: E501
    value("warm_start_weight_text", {"warm_starts.0.params.reward_weights.accuracy": "1"}, "warm_starts[0].params.reward_weights.accuracy: must be a number"),  # noqa: E501
    # --- the box: the model
    box_case("model_folder_missing", None, "model_path: {tmp}/nowhere does not exist", budget={"model_path": lambda t: str(t / "nowhere")}),  # noqa: E501
    box_case("model_folder_is_a_file", write("model-file", "x"), "model_path: {tmp}/model-file is not a folder", budget={"model_path": lambda t: str(t / "model-file")}),  # noqa: E501
    box_case("model_without_config", model_change(lambda m: (m / "config.json").unlink()), "(no config.json)"),
    box_case("model_config_not_json", model_change(lambda m: (m / "config.json").write_text("{oops")), "is not a readable JSON object"),  # noqa: E501
    box_case("model_config_a_list", model_change(lambda m: (m / "config.json").write_text("[1]")), "is not a readable JSON object"),  # noqa: E501
    box_case("model_config_a_folder", model_change(lambda m: ((m / "config.json").unlink(), (m / "config.json").mkdir())), "(no config.json)"),  # noqa: E501
    box_case("model_not_qwen2_vl", model_change(lambda m: (m / "config.json").write_text(json.dumps({"model_type": "llava"}))), "model_path: {tmp}/model is not a Qwen2-VL folder (config.json model_type 'llava')"),  # noqa: E501
    box_case("model_without_weights", model_change(lambda m: (m / "model.safetensors").unlink()), "model_path: {tmp}/model holds no weights", subprocess=True),  # noqa: E501
    box_case("model_weights_empty", model_change(lambda m: (m / "model.safetensors").write_bytes(b"")), "model.safetensors is not a whole safetensors file"),  # noqa: E501
    box_case("model_weights_truncated", model_change(lambda m: (m / "model.safetensors").write_bytes((m / "model.safetensors").read_bytes()[:-2])), "model.safetensors is not a whole safetensors file"),  # noqa: E501
    box_case("model_index_names_a_missing_shard", model_change(lambda m: ((m / "model.safetensors").rename(m / "model-00001-of-00002.safetensors"), (m / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})))), "model-00002-of-00002.safetensors is missing"),  # noqa: E501
    box_case("model_index_not_json", model_change(lambda m: ((m / "model.safetensors").unlink(), (m / "model.safetensors.index.json").write_text("{"))), "model.safetensors.index.json is not a readable JSON object"),  # noqa: E501
    # --- the box: the data
    box_case("train_folder_missing", None, "train_path: {tmp}/no-train: no such folder", budget={"train_path": lambda t: str(t / "no-train")}),  # noqa: E501
    box_case("train_path_is_a_file", write("train-file", "x"), "train_path: {tmp}/train-file: not a folder", budget={"train_path": lambda t: str(t / "train-file")}),  # noqa: E501
    box_case("data_folder_empty", lambda t: (t / "empty").mkdir(), "val_path: {tmp}/empty: neither a save_to_disk folder nor a folder of *.parquet or *.arrow files", budget={"val_path": lambda t: str(t / "empty")}),  # noqa: E501
    new_split("split_saved_empty", "train_path", empty_saved_split, "train_path: {tmp}/split: zero rows"),
    new_split("val_split_saved_empty", "val_path", empty_saved_split, "val_path: {tmp}/split: zero rows"),
    split_case("split_state_json_corrupt", "train_path", lambda f: (f / "state.json").write_text("{oops"), "train_path: {tmp}/split: state.json is not a readable JSON object"),  # noqa: E501
    split_case("split_state_json_a_list", "ood_val_path", lambda f: (f / "state.json").write_text("[]"), "ood_val_path: {tmp}/split: state.json is not a readable JSON object"),  # noqa: E501
    split_case("split_shard_missing", "train_path", lambda f: next(f.glob("*.arrow")).unlink(), "train_path: {tmp}/split: data-00000-of-00001.arrow is missing"),  # noqa: E501
    split_case("split_shard_truncated", "ood_val_path", truncate_arrow, "ood_val_path: {tmp}/split: cannot read"),
    split_case("split_dataset_info_missing", "val_path", lambda f: (f / "dataset_info.json").unlink(), "val_path: {tmp}/split: cannot read"),  # noqa: E501
    new_split("split_dict_of_two", "train_path", two_split_dict, "a DatasetDict with splits a, b"),
    new_split("parquet_without_rows", "train_path", lambda f: parquet(f, {"image": pyarrow.array([], pyarrow.struct([("bytes", pyarrow.binary()), ("path", pyarrow.string())])), "problem": pyarrow.array([], pyarrow.string()), "solution": pyarrow.array([], pyarrow.string())}), "train_path: {tmp}/split: zero rows"),  # noqa: E501
    new_split("parquet_corrupt", "val_path", lambda f: (f.mkdir(), (f / "part-0.parquet").write_bytes(b"PAR1 not really")), "val_path: {tmp}/split: cannot read"),  # noqa: E501
    new_split("parquet_and_arrow", "val_path", lambda f: (f.mkdir(), (f / "a.parquet").write_bytes(b""), (f / "b.arrow").write_bytes(b"")), "holds both parquet and arrow files"),  # noqa: E501
    new_split("data_without_solution_column", "ood_val_path", lambda f: parquet(f, {"image": [image_cell()], "problem": ["How many?"]}), "ood_val_path: {tmp}/split: missing column(s) solution"),  # noqa: E501
    new_split("solutions_without_an_integer", "train_path", lambda f: parquet(f, {"image": [image_cell()] * 2, "problem": ["How many?"] * 2, "solution": ["<answer> 3 </answer>", "<answer> three </answer>"]}), "train_path: {tmp}/split: row 1: solution must hold one integer count"),  # noqa: E501
    new_split("image_column_of_text", "train_path", lambda f: parquet(f, {"image": ["a.png"], "problem": ["How many?"], "solution": ["<answer> 1 </answer>"]}), "column image holds"),  # noqa: E501
    # --- the box: where results go
    box_case("submission_parent_is_a_file", write("blocker", ""), "submission_path: {tmp}/blocker is not a folder", budget={"submission_path": lambda t: str(t / "blocker" / "submission")}),  # noqa: E501
    box_case("submission_is_a_file", write("file", "x"), "submission_path: {tmp}/file exists and is not a folder", budget={"submission_path": lambda t: str(t / "file")}),  # noqa: E501
    box_case("submission_not_writable", None, "submission_path: /proc is not writable", budget={"submission_path": "/proc/submission"}),  # noqa: E501
    box_case("submission_lock_is_a_symlink", lock_symlink, "submission_path: {tmp}/app/.submission.lock is a symlink"),
    box_case("runs_dir_not_writable", None, "runs_dir: /proc is not writable", budget={"runs_dir": "/proc/runs"}),
    box_case("runs_dir_under_a_file", write("blocker", ""), "runs_dir: {tmp}/blocker is not a folder", budget={"runs_dir": lambda t: str(t / "blocker" / "runs")}),  # noqa: E501
    # --- the box: no two paths in one place
    box_case("submission_is_the_root", None, "submission_path: is the filesystem root", budget={"submission_path": "/"}),  # noqa: E501
    box_case("submission_is_the_runs_dir", None, "submission_path: {tmp}/app/submission is the same as runs_dir ({tmp}/app/submission)", budget={"runs_dir": lambda t: str(t / "app" / "submission")}),  # noqa: E501
    box_case("submission_inside_the_runs_dir", None, "submission_path: {tmp}/app/submission is inside runs_dir ({tmp}/app)", budget={"runs_dir": lambda t: str(t / "app")}),  # noqa: E501
    box_case("submission_holds_the_runs_dir", None, "submission_path: {tmp}/app/submission holds runs_dir ({tmp}/app/submission/runs)", budget={"runs_dir": lambda t: str(t / "app" / "submission" / "runs")}),  # noqa: E501
    box_case("submission_is_the_model", None, "submission_path: {tmp}/model is the same as model_path ({tmp}/model)", budget={"submission_path": lambda t: str(t / "model")}),  # noqa: E501
    box_case("submission_holds_the_model", None, "submission_path: {tmp} holds model_path ({tmp}/model)", budget={"submission_path": lambda t: str(t), "runs_dir": lambda t: f"{t}-runs"}),  # noqa: E501
    box_case("submission_a_symlink_to_the_model", lambda t: (t / "link").symlink_to(t / "model"), "submission_path: {tmp}/link is the same as model_path", budget={"submission_path": lambda t: str(t / "link")}),  # noqa: E501
    box_case("submission_holds_the_data", None, "submission_path: {tmp}/app holds train_path ({tmp}/app/train)", budget={"submission_path": lambda t: str(t / "app"), "train_path": lambda t: str(t / "app" / "train")}),  # noqa: E501
    box_case("submission_is_the_ood_data", None, "submission_path: {tmp}/app/submission is the same as ood_val_path", budget={"ood_val_path": lambda t: str(t / "app" / "submission")}),  # noqa: E501
    box_case("submission_holds_the_storage", None, "submission_path: {tmp}/app/submission holds storage ({tmp}/app/submission/study.db)", args=("--storage", "{tmp}/app/submission/study.db")),  # noqa: E501
    box_case("runs_dir_is_the_model", None, "runs_dir: {tmp}/model is the same as model_path", budget={"runs_dir": lambda t: str(t / "model")}),  # noqa: E501
    box_case("runs_dir_holds_the_model", None, "runs_dir: {tmp} holds model_path ({tmp}/model)", budget={"runs_dir": lambda t: str(t), "submission_path": lambda t: f"{t}-submission"}),  # noqa: E501
    box_case("runs_dir_inside_the_model", None, "runs_dir: {tmp}/model/runs is inside model_path ({tmp}/model)", budget={"runs_dir": lambda t: str(t / "model" / "runs")}),  # noqa: E501
    box_case("runs_dir_holds_the_data", None, "runs_dir: {tmp}/r holds val_path ({tmp}/r/val)", budget={"runs_dir": lambda t: str(t / "r"), "val_path": lambda t: str(t / "r" / "val")}),  # noqa: E501
    box_case("runs_dir_holds_the_storage", None, "runs_dir: {tmp}/r holds storage ({tmp}/r/study.db)", budget={"runs_dir": lambda t: str(t / "r")}, args=("--storage", "{tmp}/r/study.db")),  # noqa: E501
    box_case("model_holds_the_data", None, "model_path: {tmp}/model holds train_path ({tmp}/model/train)", budget={"train_path": lambda t: str(t / "model" / "train")}),  # noqa: E501
    box_case("model_holds_the_storage", None, "model_path: {tmp}/model holds storage ({tmp}/model/study.db)", args=("--storage", "{tmp}/model/study.db")),  # noqa: E501
    box_case("data_holds_the_storage", None, "train_path: {tmp}/d holds storage ({tmp}/d/study.db)", budget={"train_path": lambda t: str(t / "d")}, args=("--storage", "{tmp}/d/study.db")),  # noqa: E501
    box_case("submission_through_dot_dot_is_the_runs_dir", None, "submission_path: {tmp}/runs is the same as runs_dir", budget={"submission_path": lambda t: str(t / "app" / ".." / "runs"), "runs_dir": lambda t: str(t / "runs")}),  # noqa: E501
    # --- the storage
    box_case("storage_random_bytes", write("study.db", bytes(range(256)) * 8), "storage: study.db is not an Optuna journal file"),  # noqa: E501
    box_case("storage_sqlite_file", lambda t: ((t / "study.db").unlink(), sqlite_file(t / "study.db")), "storage: study.db is not an Optuna journal file (it is an SQLite database: use --storage sqlite:///study.db)"),  # noqa: E501
    box_case("storage_is_a_folder", lambda t: (t / "folder").mkdir(), "storage: {tmp}/folder is not a file", args=("--storage", "{tmp}/folder")),  # noqa: E501
    box_case("storage_is_the_submissions_parent", None, "submission_path: {tmp}/app/submission is inside storage ({tmp}/app)", args=("--storage", "{tmp}/app")),  # noqa: E501
    box_case("storage_is_a_fifo", fifo("pipe.db"), "storage: {tmp}/pipe.db is not a file", args=("--storage", "{tmp}/pipe.db"), subprocess=True),  # noqa: E501
    box_case("storage_unknown_operation", append_line(b'{"op_code": 99, "worker_id": "w"}\n'), "storage: study.db is not an Optuna journal file"),  # noqa: E501
    box_case("storage_line_not_an_operation", append_line(b"[1, 2]\n"), "storage: study.db is not an Optuna journal file"),  # noqa: E501
    box_case("storage_line_not_utf8", append_line(b'{"op_code": "\xff"}\n'), "storage: study.db is not an Optuna journal file"),  # noqa: E501
    box_case("storage_under_a_file", write("blocker", ""), "storage: {tmp}/blocker is not a folder", args=("--storage", "{tmp}/blocker/study.db")),  # noqa: E501
    box_case("storage_not_writable", None, "storage: /proc is not writable", args=("--storage", "/proc/study.db")),
    box_case("storage_unreachable_url", None, "storage: cannot open postgresql://search:***@127.0.0.1:1/optuna", args=("--storage", f"postgresql://search:{SECRET}@127.0.0.1:1/optuna"), subprocess=True),  # noqa: E501
    box_case("storage_password_in_the_query", None, "storage: cannot open postgresql://search@127.0.0.1:1/optuna?password=***", args=("--storage", f"postgresql://search@127.0.0.1:1/optuna?password={SECRET}")),  # noqa: E501
    box_case("storage_password_with_an_at_sign", None, "storage: postgresql://search:***@127.0.0.1:1/optuna: the password holds an unencoded '@'", args=("--storage", f"postgresql://search:{SECRET}@x@127.0.0.1:1/optuna")),  # noqa: E501
    box_case("storage_port_not_a_number", None, "storage: cannot open postgresql://search:***@127.0.0.1:port/optuna", args=("--storage", f"postgresql://search:{SECRET}@127.0.0.1:port/optuna")),  # noqa: E501
    box_case("storage_password_with_a_slash", None, "storage: cannot open postgresql://search:***@127.0.0.1:1/optuna", args=("--storage", f"postgresql://search:{SECRET}/x@127.0.0.1:1/optuna")),  # noqa: E501
    box_case("storage_password_with_a_hash", None, "storage: cannot open postgresql://search:***@127.0.0.1:1/optuna", args=("--storage", f"postgresql://search:x#{SECRET}@127.0.0.1:1/optuna")),  # noqa: E501
    box_case("storage_password_with_a_question_mark", None, "storage: cannot open postgresql://search:***@127.0.0.1:1/optuna", args=("--storage", f"postgresql://search:{SECRET}?x=1@127.0.0.1:1/optuna")),  # noqa: E501
    box_case("storage_password_with_a_space", None, "storage: cannot open postgresql://search:***@127.0.0.1:1/optuna", args=("--storage", f"postgresql://search:{SECRET} x@127.0.0.1:1/optuna")),  # noqa: E501
    box_case("storage_password_of_slashes_only_in_mysql", None, "storage: cannot open mysql://search:***@127.0.0.1:1/optuna", args=("--storage", f"mysql://search:/{SECRET}/#@127.0.0.1:1/optuna")),  # noqa: E501
    box_case("storage_query_password_with_a_space", None, "storage: cannot open postgresql://search@127.0.0.1:1/optuna?password=***", args=("--storage", f"postgresql://search@127.0.0.1:1/optuna?password={SECRET} x")),  # noqa: E501
    box_case("storage_url_of_no_database", None, "storage: cannot open nosuchdb://host/db", args=("--storage", "nosuchdb://host/db")),  # noqa: E501
    box_case("storage_mysql_without_a_driver", None, "storage: cannot open mysql://search:***@127.0.0.1:1/optuna", args=("--storage", f"mysql://search:{SECRET}@127.0.0.1:1/optuna")),  # noqa: E501
    box_case("storage_sqlite_in_no_folder", None, "storage: cannot open sqlite:///{tmp}/no/such/x.db", args=("--storage", "sqlite:///{tmp}/no/such/x.db")),  # noqa: E501
    box_case("storage_sqlite_of_random_bytes", write("garbage.db", bytes(range(256)) * 8), "storage: cannot open sqlite:///{tmp}/garbage.db", args=("--storage", "sqlite:///{tmp}/garbage.db")),  # noqa: E501
    # --- the study in the storage
    box_case("study_of_another_direction", existing_study(directions=["minimize"], attrs={"deadline": 4e9}), "study_name: the study 'count-grpo' in study.db optimizes ['minimize'], not maximize"),  # noqa: E501
    box_case("study_of_two_objectives", existing_study(directions=["maximize", "maximize"], attrs={"deadline": 4e9}), "optimizes ['maximize', 'maximize']"),  # noqa: E501
    box_case("study_not_made_by_this_search", existing_study(foreign_trial=True), "was not created by this search (no deadline)"),  # noqa: E501
    box_case("study_deadline_text", existing_study(attrs={"deadline": "tomorrow"}), "study_name: the study 'count-grpo' has a deadline this search cannot have set ('tomorrow')"),  # noqa: E501
    box_case("study_deadline_1e300", existing_study(attrs={"deadline": 1e300}), "has a deadline this search cannot have set (1e+300)"),  # noqa: E501
    box_case("space_choice_removed_since_the_study_sampled", sampled_study(lora_rank=[0, 16, 64]), "space.lora_rank: the study 'count-grpo' sampled lora_rank from [0, 16, 64], the budget now gives [0, 16]", budget={"space.lora_rank": [0, 16], "warm_starts.0.params.lora_rank": 16}),  # noqa: E501
    box_case("space_choice_added_since_the_study_sampled", sampled_study(phrasing=["eval", "inherited"]), "space.phrasing: the study 'count-grpo' sampled phrasing from ['eval', 'inherited']"),  # noqa: E501
    box_case("space_reward_weights_edited_since_the_study_sampled", sampled_study(w_think_format=[0.0, 1.0]), "space.reward_weights.think_format: the study 'count-grpo' sampled w_think_format from [0.0, 1.0]"),  # noqa: E501
    box_case("space_answer_format_alone_edited", sampled_study(w_answer_format_alone=[0.5, 1.0]), "space.reward_weights.answer_format: the study 'count-grpo' sampled w_answer_format_alone from [0.5, 1.0]"),  # noqa: E501
    box_case("space_init_pinned_since_the_study_sampled", sampled_study(init=["base", "best"]), "space.init: the study 'count-grpo' sampled init from ['base', 'best'], the budget now gives ['base']", budget={"space.init": ["base"]}),  # noqa: E501
    box_case("study_deadline_nan", existing_study(attrs={"deadline": float("nan")}), "has a deadline this search cannot have set (nan)"),  # noqa: E501
]  # fmt: skip


def _budget_yaml() -> dict:
    return yaml.safe_load((ROOT / "budget.yaml").read_text())


def _space() -> dict:
    return _budget_yaml()["space"]


def _fixed() -> dict:
    return _budget_yaml()["fixed"]


# ---------------------------------------------------------------------------------------------------------- running
def snapshot(folder: Path) -> dict[str, str]:
    """Every entry under `folder`: a digest of each file's bytes, a symlink's target, 'dir' or 'other'."""
    entries = {}
    for path in sorted(folder.rglob("*")):
        key = str(path.relative_to(folder))
        if path.is_symlink():
            entries[key] = f"-> {os.readlink(path)}"
        elif path.is_dir():
            entries[key] = "dir"
        elif path.is_file():
            entries[key] = hashlib.sha1(path.read_bytes()).hexdigest()
        else:
            entries[key] = "other"
    return entries


@pytest.fixture()
def box(tmp_path, tiny_split_dir) -> Path:
    """A box whose model is a Qwen2-VL config and a tiny weights file (nothing may be loaded before the checks pass),
    and whose study.db holds another study (the storage must stay byte for byte as it was)."""
    faultkit.fake_model(tmp_path / "model")
    (tmp_path / "app").mkdir()
    (tmp_path / ".split").write_text(str(tiny_split_dir))
    study = optuna.create_study(storage=journal(tmp_path / "study.db"), study_name="earlier", direction="maximize")
    study.add_trial(optuna.trial.create_trial(value=1.0))
    return tmp_path


def prepare(case: Case, box: Path, split: Path) -> list[str]:
    """Write the case's budget and box; its command-line arguments."""
    budget = box / "budget.yaml"
    good = good_budget(box, split)
    if case.text is not None:
        content = case.text(yaml.safe_dump(good, sort_keys=False))
        budget.write_bytes(content if isinstance(content, bytes) else content.encode())
    else:
        budget.write_text(yaml.safe_dump(apply(good, case.budget or {}, box), sort_keys=False))
    if case.setup is not None:
        case.setup(box)
    args = [arg.format(tmp=box) for arg in case.args]
    if "--budget" not in args:
        args = ["--budget", str(budget), *args]
    return args


def _search_started(self) -> None:
    raise AssertionError("bad input reached the search")


def run_in_process(box: Path, args: list[str]) -> tuple[int, str, str]:
    import run_search

    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(box), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            warnings.catch_warnings(record=True) as caught:  # fmt: skip
        warnings.simplefilter("always")
        try:
            code = run_search.main(args)
        except SystemExit as exit:
            code = exit.code
    # A warning would be one more stderr line in a real run.
    assert not [str(w.message) for w in caught if not issubclass(w.category, ResourceWarning)], caught
    return code, out.getvalue(), err.getvalue()


def run_in_subprocess(box: Path, args: list[str], modules: Path) -> tuple[int, str, str]:
    result = subprocess.run([sys.executable, "-c", RUNNER.format(root=str(ROOT), modules=str(modules)), *args],
                            cwd=box, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert json.loads(modules.read_text()) == []  # no model code was even imported
    return result.returncode, result.stdout, result.stderr


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_input_is_refused_in_one_line_and_leaves_nothing(case, box, tiny_split_dir, tmp_path_factory, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.setattr("search.study.DEADLINE_WAIT_S", 0.2, raising=False)  # a study without a deadline: no 5 s wait
    monkeypatch.setattr("search.scheduler.Scheduler.run", _search_started)
    args = prepare(case, box, tiny_split_dir)
    before = snapshot(box)
    storage = (box / "study.db").read_bytes()
    if case.subprocess:
        code, out, err = run_in_subprocess(box, args, tmp_path_factory.mktemp("modules") / "loaded.json")
    else:
        code, out, err = run_in_process(box, args)
    assert code == 2, (code, out[-2000:], err[-2000:])
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("run_search.py: error: ") and case.expected.format(tmp=box) in lines[0], lines[0]
    assert len(lines[0]) <= 500
    assert out == ""
    assert SECRET not in err
    assert (box / "study.db").read_bytes() == storage
    assert snapshot(box) == before  # no study, no round folder, no submission, nothing else


def test_there_are_at_least_120_cases_and_their_ids_are_unique():
    assert len(CASES) >= 120 and len({case.id for case in CASES}) == len(CASES)


def test_the_good_box_is_accepted(box, tiny_split_dir, monkeypatch):
    """Each case is refused for its own change: the box they all start from passes every check."""
    monkeypatch.syspath_prepend(str(ROOT))
    from search.settings import check_box, load_settings
    from search.study import open_storage

    args = prepare(Case("good", ""), box, tiny_split_dir)
    with contextlib.chdir(box):
        settings = load_settings(args[1])
        check_box(settings)
        assert [s.study_name for s in open_storage(settings.storage).get_all_studies()] == ["earlier"]
