"""bench/eval_speed.py's end-to-end run on the CPU: a fresh evaluator process timed from outside, with a variant."""

from __future__ import annotations

import pytest

from bench import eval_speed, gpu


def test_an_end_to_end_run_times_the_process_and_its_exit_with_the_variants_arguments(
    tiny_model_dir, tiny_split_dir, tmp_path, monkeypatch
):
    # A variant whose argument shows in the report: on a CPU the real ones' effects (compiling) do not.
    monkeypatch.setitem(eval_speed.END_TO_END_VARIANTS, "three_rows", {"arguments": ["--limit", "3"]})
    run = eval_speed._end_to_end(tiny_model_dir, tiny_split_dir, str(tmp_path / "inductor"), batch_size=4,
                                 variant="three_rows", batched_vision_attention=False)  # fmt: skip
    assert run["n"] == 3 and run["variant"] == "three_rows" and run["batched_vision_attention"] is False
    assert 0 < run["inside_seconds"] < run["seconds"]
    assert 0 <= run["exit_seconds"] < run["seconds"] - run["inside_seconds"]
    assert run["examples_per_s"] == 3 / run["seconds"]


def test_the_started_ahead_variant_is_timed_from_its_go_line(tiny_model_dir, tiny_split_dir, tmp_path, monkeypatch):
    from bench import round_evaluation

    started = []
    real_start = round_evaluation.start_waiting
    monkeypatch.setattr(round_evaluation, "start_waiting",
                        lambda command, env, stderr: started.append(command) or real_start(command, env, stderr))
    run = eval_speed._end_to_end(tiny_model_dir, tiny_split_dir, str(tmp_path / "inductor"), batch_size=4,
                                 variant="started_ahead")  # fmt: skip
    assert len(started) == 1 and started[0][-1] == "--wait-for-input"
    assert run["n"] == 8 and run["variant"] == "started_ahead" and 0 < run["inside_seconds"] < run["seconds"]


def test_gpu_bench_rejects_an_unknown_eval_1k_variant_before_building_anything(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpu.main(["--sections", "eval_1k", "--eval-1k-variants", "dynamic_cache,nope", "--out", str(tmp_path / "o")])
    assert exit_info.value.code == 2
    assert "unknown eval_1k variant 'nope'" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_eval_1k_runs_a_saving_variant_twice_and_compares_every_run_s_answers_with_the_warm_one(monkeypatch):
    monkeypatch.setitem(eval_speed.END_TO_END_VARIANTS, "saving", {"environment": {"X": "1"}, "runs": 2})
    caches, answers = [], {None: [1, 2, 3], "saving": [1, 2, 4], "dynamic_cache": [1, 2, 3]}

    def end_to_end(model, split, inductor_cache, variant=None, **settings):  # the fresh process, without one
        caches.append(inductor_cache)
        return {"n": 3, "variant": variant, "answers": list(answers[variant])}

    monkeypatch.setattr(eval_speed, "_end_to_end", end_to_end)
    recorded = []
    figures = gpu.eval_end_to_end("model", "split", {"batch_size": 4}, recorded.append, ["saving", "dynamic_cache"])
    assert list(figures) == ["rows", "settings", "end_to_end_cold", "end_to_end_warm", "end_to_end_warm_saving_first",
                             "end_to_end_warm_saving", "end_to_end_warm_dynamic_cache"]  # fmt: skip
    assert len(set(caches)) == 1 and len(recorded) == 5  # one inductor cache for all, recorded after each run
    assert "rows_with_other_answers" not in figures["end_to_end_warm"]
    assert [figures[f"end_to_end_warm_{name}"]["rows_with_other_answers"]
            for name in ("saving_first", "saving", "dynamic_cache")] == [1, 1, 0]  # fmt: skip
    assert not any("answers" in run for run in figures.values() if isinstance(run, dict))
