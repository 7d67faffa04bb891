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


def test_gpu_bench_rejects_an_unknown_eval_1k_variant_before_building_anything(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpu.main(["--sections", "eval_1k", "--eval-1k-variants", "dynamic_cache,nope", "--out", str(tmp_path / "o")])
    assert exit_info.value.code == 2
    assert "unknown eval_1k variant 'nope'" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
