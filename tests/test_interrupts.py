"""Ctrl-C, SIGTERM and a closed stdout pipe at any point: one line, exit 130 / 143 / 141 (0 for a leaderboard), no
traceback, and no RUNNING trial of the interrupted process left in the study."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from search import interrupts, space

from test_scheduler import scheduler_for

ROOT = Path(__file__).resolve().parents[1]
# run_search.main with `stage` patched to send this process `signal` once it has run: the signal arrives "right
# after" that stage, as a user's Ctrl-C would.
RUNNER = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
import run_search
from search import run as search_run
from search import scheduler

def after(real):
    def patched(*args, **kwargs):
        result = real(*args, **kwargs)
        os.kill(os.getpid(), signal.{signal})
        time.sleep(30)  # the signal ends the wait
        return result
    return patched

{stage}
sys.exit(run_search.main(sys.argv[1:]))
"""
STAGES = {
    "the study is created": "search_run.open_study = after(search_run.open_study)",
    "the start line": "search_run.results_folder = after(search_run.results_folder)",
    "a round is launched": "scheduler.Scheduler._launch = after(scheduler.Scheduler._launch)",
    "a round ends": "scheduler.Scheduler._finish = after(scheduler.Scheduler._finish)",
}


def _journal(path: Path) -> optuna.storages.JournalStorage:
    return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(path)))


def _running(storage: Path) -> list[int]:
    studies = optuna.get_all_study_names(storage=_journal(storage))
    running = []
    for name in studies:
        study = optuna.load_study(study_name=name, storage=_journal(storage))
        running += [t.number for t in study.get_trials(states=(TrialState.RUNNING,))]
    return running


@pytest.mark.parametrize("stage", list(STAGES))
@pytest.mark.parametrize("signum, code, word", [("SIGINT", 130, "interrupted"), ("SIGTERM", 143, "terminated")])
def test_a_signal_at_any_stage_is_one_line_and_its_exit_code(tmp_path, stage, signum, code, word):
    runner = RUNNER.format(root=str(ROOT), signal=signum, stage=STAGES[stage])
    result = subprocess.run([sys.executable, "-c", runner, "--simulate", "--hours", "2", "--storage", "st/study.db"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == code, result.stderr[-3000:]
    lines = _ours(result.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"run_search.py: {word}: "), result.stderr[-3000:]
    assert "Traceback" not in result.stderr + result.stdout
    assert _running(tmp_path / "st" / "study.db") == []


def _ours(stderr: str) -> list[str]:
    """The lines of stderr but Optuna's own information lines ("[I 2026-...] A new study created ...")."""
    return [line for line in stderr.strip().splitlines() if not line.startswith("[I ")]


def _search(cwd: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ROOT / "run_search.py"), *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip


def test_a_search_piped_into_head_ends_quietly(tmp_path):
    search = _search(tmp_path, "--simulate", "--hours", "24", "--storage", "st/study.db")
    head = [search.stdout.readline() for _ in range(3)]  # what `| head -3` reads, then it exits
    search.stdout.close()
    _, err = search.communicate(timeout=120)
    err = err.decode()
    assert all(head) and search.returncode == 141, err[-3000:]
    assert "Traceback" not in err and "BrokenPipeError" not in err and len(_ours(err)) == 1, err
    assert "stdout was closed" in err
    assert _running(tmp_path / "st" / "study.db") == []


def test_a_leaderboard_piped_into_head_ends_quietly(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "run_search.py"), "--simulate", "--hours", "1", "--storage",
                           "st/study.db", "--study-name", "s"], cwd=tmp_path, capture_output=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    board = _search(tmp_path, "leaderboard", "--storage", "st/study.db", "--study-name", "s")
    board.stdout.close()  # the reader is gone before the first line
    _, err = board.communicate(timeout=120)
    assert board.returncode == 0 and err == b"", err.decode()[-3000:]


# ---------------------------------------------------------------------------------------------------------- in process
def test_a_trial_created_inside_launch_is_not_left_running(tmp_path, monkeypatch):
    scheduler = scheduler_for(tmp_path)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # Ctrl-C while the round's configuration is sampled: after ask(), before it runs

    monkeypatch.setattr(space, "sample_config", interrupted)
    with pytest.raises(KeyboardInterrupt), contextlib.redirect_stdout(io.StringIO()):
        scheduler.run()
    trials = scheduler.study.get_trials()
    assert not [t.number for t in trials if t.state == TrialState.RUNNING]
    assert [t for t in trials if "started or ended" in (t.user_attrs.get("reason") or "")]


def test_a_round_interrupted_while_it_ends_is_not_left_running(tmp_path):
    def interrupted(outcome, trial):
        raise KeyboardInterrupt  # Ctrl-C during a promotion: the round is out of the running list, not yet told

    scheduler = scheduler_for(tmp_path, promote=interrupted)
    with pytest.raises(KeyboardInterrupt), contextlib.redirect_stdout(io.StringIO()):
        scheduler.run()
    assert not [t.number for t in scheduler.study.get_trials() if t.state == TrialState.RUNNING]


def test_a_signal_inside_a_deferred_section_is_raised_when_it_ends():
    reached = []
    with pytest.raises(KeyboardInterrupt), interrupts.handled():
        with interrupts.deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the handler runs here, and holds it
            reached.append("end of the section")
    assert reached == ["end of the section"]


def test_a_second_signal_during_the_cleanup_is_ignored():
    cleaned = []
    # The handler before: Python's default, or SIG_IGN where a shell started the tests in the background.
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(interrupts.Terminated), interrupts.handled():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        finally:
            os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C while the first one's cleanup runs
            time.sleep(0.05)
            cleaned.append(True)
    assert cleaned == [True] and signal.getsignal(signal.SIGINT) is before


def test_exit_codes():
    assert interrupts.exit_code(KeyboardInterrupt()) == 130
    assert interrupts.exit_code(interrupts.Terminated()) == 143
    assert interrupts.exit_code(interrupts.OutputClosed()) == 141
    assert issubclass(interrupts.Terminated, KeyboardInterrupt)
    assert issubclass(interrupts.OutputClosed, KeyboardInterrupt)
