"""bench/round_evaluation.py on the CPU: a round's two splits scored in one evaluator process against one each."""

from __future__ import annotations

import pytest

from bench import round_evaluation


def test_both_ways_are_timed_and_give_the_same_answers(tiny_model_dir, tiny_split_dir, monkeypatch):
    commands = []
    real_timed = round_evaluation._timed
    monkeypatch.setattr(round_evaluation, "_timed", lambda command, env: commands.append(command) or
                        real_timed(command, env))  # fmt: skip
    figures = round_evaluation.measure(tiny_model_dir, tiny_split_dir, tiny_split_dir, val_rows=3, seed=1,
                                       batch_size=4, repeats=1)  # fmt: skip
    # The warm-up and the counted run score both splits in one process; the separate way runs one per split.
    assert [command.count(str(tiny_split_dir)) for command in commands] == [2, 1, 1, 2]
    assert figures["rows"] == {"ood": 8, "val": 3}
    separate, together = figures["runs"]["separate"], figures["runs"]["together"]
    assert len(separate) == len(together) == 1 and len(separate[0]) == 2 and len(together[0]) == 1
    assert figures["separate_s"] == pytest.approx(sum(separate[0]))
    assert figures["together_s"] == pytest.approx(together[0][0])
    assert figures["saved_s"] == pytest.approx(figures["separate_s"] - figures["together_s"])
    assert figures["together_speedup"] == pytest.approx(figures["separate_s"] / figures["together_s"])


def test_bad_counts_are_refused_before_anything_runs(monkeypatch, capsys):
    monkeypatch.setattr(round_evaluation, "measure", lambda *args: pytest.fail("it measured"))
    with pytest.raises(SystemExit) as exited:
        round_evaluation.main(["m", "o", "v", "--repeats", "0"])
    assert exited.value.code == 2 and "--repeats and --val-rows must be at least 1" in capsys.readouterr().err
