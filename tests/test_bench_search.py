"""bench/gpu.py's search section on the CPU: the overhead figures from a study's rounds, and the budget it runs."""

from __future__ import annotations

import pytest

from bench import gpu
from search.settings import load_settings
from synthetic.models import build_model
from synthetic.splits import write_box


def _round(number, *, timings, promotion_s=0.0, duration_s=None, promotion_timings=None):
    return {"number": number, "state": "completed", "steps_done": 10, "duration_s": duration_s, "timings": timings,
            "promotion_s": promotion_s, "promotion_timings": promotion_timings or {}, "ood_accuracy": 0.0}  # fmt: skip


def test_overhead_counts_a_promotion_for_the_trained_rounds_that_were_not_promoted():
    parts = {"copy": 5.0, "flush": 3.0, "check": 32.0}
    base = _round(0, timings={"eval": 60.0}, promotion_s=40.0, duration_s=60.0, promotion_timings=parts)
    trained = _round(1, timings={"setup": 20.0, "train": 100.0, "save": 6.0, "eval": 60.0}, duration_s=186.0)
    figures = gpu.overhead_figures([base, trained])
    assert figures["promotion_seconds"] == 40.0 and figures["promotion_parts"] == parts
    assert figures["overhead_seconds_per_round"] == 26.0  # as run: round 1 was not promoted
    assert figures["overhead_fraction_as_run"] == pytest.approx(26.0 / 1800)
    assert figures["overhead_share_of_these_rounds"] == pytest.approx(26.0 / 186.0)
    assert figures["overhead_seconds_promoted_round"] == 66.0
    assert figures["overhead_fraction"] == pytest.approx(66.0 / 1800)


def test_the_check_s_own_parts_are_averaged_where_every_promotion_recorded_them():
    check = {"check_start": 0.5, "check_load": 6.0, "check_answers": 20.0, "check_exit": 0.1}
    first = _round(0, timings={"eval": 60.0}, promotion_s=40.0, promotion_timings={"copy": 4.0, "flush": 2.0,
                                                                                   "check": 30.0, **check})
    second = _round(3, timings={"eval": 60.0}, promotion_s=20.0, promotion_timings={
        "copy": 0.0, "flush": 0.0, "check": 20.0, **{name: 2 * seconds for name, seconds in check.items()}})
    parts = gpu.overhead_figures([first, second])["promotion_parts"]
    assert parts == pytest.approx({"copy": 2.0, "flush": 1.0, "check": 25.0, "check_start": 0.75, "check_load": 9.0,
                                   "check_answers": 30.0, "check_exit": 0.15})  # fmt: skip
    older = _round(4, timings={"eval": 60.0}, promotion_s=36.0, promotion_timings={"copy": 0, "flush": 0, "check": 36})
    assert set(gpu.overhead_figures([first, older])["promotion_parts"]) == {"copy", "flush", "check"}


def test_overhead_without_a_trained_round_has_only_the_promotion():
    base = _round(0, timings={"eval": 60.0}, promotion_s=40.0, duration_s=60.0)
    killed = _round(1, timings={"setup": 20.0, "train": 50.0})
    assert gpu.overhead_figures([base, killed]) == {"promotion_seconds": 40.0}
    assert gpu.overhead_figures([killed]) == {}


def test_the_bench_budget_is_a_valid_search_without_compiling(tmp_path):
    model = build_model(tmp_path / "model")
    box = tmp_path / "box"
    write_box(box, {"train": 8, "val": 4, "ood_val": 4, "test_compositional": 2, "test_other": 2})
    settings = load_settings(gpu._bench_budget(model, box, tmp_path / "work", minutes=7.5))
    assert settings.hours == pytest.approx(7.5 / 60)
    assert settings.fixed["compile_rollouts"] is False and settings.fixed["compile_training"] is False
    assert settings.eval_static_cache is False and settings.val_rows == 0 and settings.prune_every == 0
    assert settings.ood_val_path == str(box / "ood_val")
