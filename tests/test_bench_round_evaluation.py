"""bench/round_evaluation.py on the CPU: a round's two splits scored in one evaluator process against one each, and
in one process started ahead."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench import round_evaluation


def test_every_way_is_timed_and_gives_the_same_answers(tiny_model_dir, tiny_split_dir, monkeypatch):
    commands, ahead = [], []
    real_timed, real_from_go = round_evaluation._timed, round_evaluation._timed_from_go
    monkeypatch.setattr(round_evaluation, "_timed", lambda command, env: commands.append(command) or
                        real_timed(command, env))  # fmt: skip
    monkeypatch.setattr(round_evaluation, "_timed_from_go", lambda command, env: ahead.append(command) or
                        real_from_go(command, env))  # fmt: skip
    figures = round_evaluation.measure(tiny_model_dir, tiny_split_dir, tiny_split_dir, val_rows=3, seed=1,
                                       batch_size=4, repeats=1)  # fmt: skip
    # The warm-up and the counted run score both splits in one process; the separate way runs one per split.
    assert [command.count(str(tiny_split_dir)) for command in commands] == [2, 1, 1, 2]
    assert ahead == [[*commands[-1], "--wait-for-input"]]  # the one process, started ahead
    assert figures["rows"] == {"ood": 8, "val": 3}
    runs = figures["runs"]
    assert [len(runs[way]) for way in ("separate", "together", "ahead")] == [1, 1, 1]
    assert [len(runs[way][0]) for way in ("separate", "together", "ahead")] == [2, 1, 1]
    assert figures["separate_s"] == pytest.approx(sum(runs["separate"][0]))
    assert figures["together_s"] == pytest.approx(runs["together"][0][0])
    assert figures["ahead_s"] == pytest.approx(runs["ahead"][0][0])
    assert figures["saved_s"] == pytest.approx(figures["separate_s"] - figures["together_s"])
    assert figures["together_speedup"] == pytest.approx(figures["separate_s"] / figures["together_s"])
    assert figures["ahead_saved_s"] == pytest.approx(figures["together_s"] - figures["ahead_s"])
    assert figures["rows_with_other_answers"] == 0


def test_an_evaluator_that_ends_before_it_is_ready_is_an_error(tmp_path):
    with pytest.raises(subprocess.CalledProcessError) as failed:
        round_evaluation.start_waiting([sys.executable, "-c", "import sys; sys.exit('no split')"], dict(os.environ),
                                       tmp_path / "stderr.log")  # fmt: skip
    assert failed.value.returncode == 1 and "no split" in failed.value.stderr


def test_bad_counts_are_refused_before_anything_runs(monkeypatch, capsys):
    monkeypatch.setattr(round_evaluation, "measure", lambda *args: pytest.fail("it measured"))
    with pytest.raises(SystemExit) as exited:
        round_evaluation.main(["m", "o", "v", "--repeats", "0"])
    assert exited.value.code == 2 and "--repeats and --val-rows must be at least 1" in capsys.readouterr().err
