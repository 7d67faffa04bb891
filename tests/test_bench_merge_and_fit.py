"""The benches of the merge stage and the fit check build what they say, before any long run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from search.settings import load_settings


def test_merge_vs_best_budget_keeps_every_round_turns_the_stage_off_and_seeds_the_sampler(tmp_path):
    from bench.merge_vs_best import seeded_budget

    settings = load_settings(seeded_budget(tmp_path, 7))
    assert settings.sampler["seed"] == 7 and settings.merge.enabled is False
    assert settings.keep_rounds >= 1000 and settings.storage == str(tmp_path / "study.db")
    assert settings.runs_dir == str(tmp_path / "runs") and settings.submission_path == str(tmp_path / "submission")


def test_memory_fit_rounds_are_the_space_s_heaviest_and_its_refused_one(tmp_path):
    """The bench's `heaviest_admitted` is the round `run_search.py check` would run on budget.yaml's space at 48 GB
    (the heaviest the fit check admits over every corner of the space), and no round of the bench that the check
    admits is predicted heavier."""
    from bench import memory_fit
    from search import preflight
    from search.backends.fit import FitCheck
    from search.settings import load_settings
    from synthetic.models import build_config

    check = FitCheck(lambda: build_config("2b"), lambda gpus: 48e9)
    configs, fits = {}, {}
    for name in memory_fit.CONFIGS:
        config = configs[name] = memory_fit.trial_config(name, tmp_path / "m", tmp_path / "t", tmp_path, 20, 48.0)
        assert config.gpu_memory_gb == 48.0 and config.output_dir == str(tmp_path / name)
        assert config.prompts_per_step == 2 and config.max_completion_length == 256  # budget.yaml's fixed
        fits[name] = check(config, [0])
    assert not fits["refused_vision_tower"].fits and not fits["refused_full_kl_group_16"].fits
    admitted = [f.plan.peak_bytes for name, f in fits.items() if f.fits]
    assert max(admitted) == fits["heaviest_admitted"].plan.peak_bytes

    box = load_settings(memory_fit.ROOT / "budget.yaml")
    chosen = preflight.heaviest_admitted(box, check)
    keys = ("lora_rank", "num_generations", "max_pixels", "beta", "train_vision_tower")
    assert [getattr(chosen, key) for key in keys] == [getattr(configs["heaviest_admitted"], key) for key in keys]
    assert check(chosen, box.slots[0]).plan.peak_bytes == fits["heaviest_admitted"].plan.peak_bytes


def test_soup_cost_times_a_build_in_a_child_and_reads_its_peak(tmp_path, tiny_model_dir):
    import shutil

    from bench import soup_cost

    base = shutil.copytree(tiny_model_dir, tmp_path / "model-0")
    other = shutil.copytree(tiny_model_dir, tmp_path / "model-1")
    figures = soup_cost.timed_build(base, [other], 1.5, tmp_path / "soup")
    assert figures["models_read"] == 2 and figures["wall_s"] >= figures["build_s"] > 0
    assert figures["peak_rss_gb"] > 0 and figures["peak_anon_gb"] > 0
    assert (tmp_path / "soup" / "merged" / "config.json").is_file()
    assert json.loads((tmp_path / "soup" / "status.json").read_text())["state"] == "completed"


def test_kill_loop_kills_a_search_runs_it_again_and_reads_the_journal_with_plain_optuna(tmp_path):
    import random

    from bench import kill_loop

    journal = tmp_path / "study.db"
    assert kill_loop.journal_state(journal, "none") == {"readable": True, "trials": 0, "running": 0}
    result = kill_loop.one_run(journal, 0, random.Random(1), max_delay=3.0, hours=1.0, timeout=300)
    assert result["signal"] in ("SIGINT", "SIGTERM", "SIGKILL") and result["second_rc"] == 0
    assert not result["first_traceback"] and not result["second_traceback"]
    assert result["after_rerun"]["readable"] and result["after_rerun"]["running"] == 0
    assert result["after_rerun"]["trials"] >= result["after_kill"].get("trials", 0)


def test_check_time_budget_points_the_check_at_the_box_it_builds(tmp_path):
    """bench/check_time.py checks budget.yaml's space and settings on its own box: every path under its folder, every
    visible GPU, the cap; a budget without one of those keys is refused rather than checked with the user's paths."""
    from bench.check_time import box_budget

    root = Path(__file__).resolve().parents[1]
    budget = tmp_path / "budget.yaml"
    budget.write_text(box_budget((root / "budget.yaml").read_text(), tmp_path, 48.0))
    settings, plain = load_settings(budget), load_settings(root / "budget.yaml")
    assert settings.model_path == str(tmp_path / "model")
    assert settings.ood_val_path == str(tmp_path / "data" / "ood_val")
    assert settings.submission_path == str(tmp_path / "submission") and settings.storage == str(tmp_path / "study.db")
    assert settings.gpu_memory_gb == 48.0 and settings.space == plain.space and settings.hours == plain.hours
    with pytest.raises(ValueError, match="0 top-level 'train_path' keys"):
        box_budget("model_path: /app/models/x\n", tmp_path, None)
