"""A round fits its card before it is launched (search.backends.fit): predicted from the model's config, refused in seconds,
the layouts of every group size checked at load, the card capped to `gpu_memory_gb` on a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from search.backends.fit import FitCheck, card_bytes_of
from search.report.leaderboard import format_leaderboard
from search.settings import SettingsError
from synthetic.models import build_config
from test_scheduler import make_settings, run, scheduler_for
from trainer import memory
from trainer.config import TrialConfig

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9


def config(**values) -> TrialConfig:
    base = dict(model_path="-", train_path="-", output_dir="-", prompts_per_step=2, max_pixels=401408,
                max_completion_length=256)  # fmt: skip
    return TrialConfig(**{**base, **values})


@pytest.fixture(scope="module")
def check_2b():
    return FitCheck(lambda: build_config("2b"), lambda gpus: 48 * GB)


def test_on_a_48_gb_card_the_space_s_heaviest_round_is_refused_and_the_baseline_s_shape_fits(check_2b):
    """Full fine-tuning, group 16, two prompts, the KL reference ran out of memory under a 48 GB cap in two passes and
    in eight: refused whatever the split. At group 8 (the inherited baseline's shape) it fits in two passes, every
    layer checkpointed; LoRA at group 16 fits too, its passes held under MAX_PASS_TOKENS."""
    heaviest = check_2b(config(lora_rank=0, num_generations=16, beta=0.04), [0])
    assert not heaviest.fits and heaviest.predicted_gb > heaviest.usable_gb == pytest.approx(memory.HEADROOM * 48)
    fit = check_2b(config(lora_rank=0, num_generations=8, beta=0.04), [0])
    assert fit.fits and (fit.plan.micro_batches, fit.plan.checkpoint_every) == (2, 1)
    lora = check_2b(config(lora_rank=64, num_generations=16, beta=0.04), [0])
    assert lora.fits and lora.predicted_gb < fit.predicted_gb
    assert 2 * 16 * 832 / lora.plan.micro_batches <= memory.MAX_PASS_TOKENS


def test_a_round_over_every_plan_is_reported_with_its_prediction(check_2b):
    fit = check_2b(config(lora_rank=0, num_generations=16, beta=0.04, train_vision_tower=True), [0])
    assert not fit.fits and fit.predicted_gb > fit.usable_gb
    assert fit.reason() == f"does not fit: predicted {fit.predicted_gb:.1f} GB of {memory.HEADROOM * 48:.1f} GB"


def test_more_gpus_a_round_share_its_completions_and_lower_its_peak(check_2b):
    one = check_2b(config(lora_rank=0, num_generations=8), [0])
    two = check_2b(config(lora_rank=0, num_generations=8), [0, 1])
    assert two.plan.peak_bytes < one.plan.peak_bytes or two.plan.checkpoint_every < one.plan.checkpoint_every


def test_nothing_is_checked_on_a_cpu_or_a_card_of_unknown_memory():
    assert FitCheck(lambda: build_config("2b"), lambda gpus: 48 * GB)(config(lora_rank=0), []) is None
    assert FitCheck(lambda: build_config("2b"), lambda gpus: None)(config(lora_rank=0), [0]) is None


def test_the_card_is_gpu_memory_gb_when_set_else_the_smallest_the_driver_shows(monkeypatch):
    from search.backends import fit

    assert card_bytes_of(40.0)([0, 1]) == 40 * GB
    monkeypatch.setattr(fit, "_driver_totals", lambda: {0: 80 * 2**30, 1: 48 * 2**30})
    card = card_bytes_of(None)
    assert card([0, 1]) == 48 * 2**30 and card([0]) == 80 * 2**30 and card([2]) is None


def test_driver_totals_follow_cuda_visible_devices(monkeypatch, tmp_path):
    from search.backends import fit

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf '0, 81559\\n1, 49140\\n2, 49140\\n'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert fit._driver_totals() == {0: 49140 * 2**20, 1: 81559 * 2**20}
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert fit._driver_totals() == {}


def test_a_configuration_predicted_over_its_card_is_never_launched_and_says_why(tmp_path):
    """A 30 GB card: every full fine-tuning round of the space is over it (its float32 masters, gradients and
    AdamW state alone are ~30 GB); LoRA rounds fit. The refused ones are PRUNED in no time, never started."""
    usable = round(memory.HEADROOM * 30, 1)
    scheduler = scheduler_for(tmp_path, gpu_memory_gb=30.0)
    run(scheduler)
    refused = [t for t in scheduler.study.trials if str(t.user_attrs.get("reason", "")).startswith("does not fit")]
    assert refused, "no sampled full fine-tuning round was refused"
    for t in refused:
        assert t.state == TrialState.PRUNED and t.params["lora_rank"] == 0
        assert "started_at" not in t.user_attrs and t.user_attrs["predicted_peak_gb"] > t.user_attrs["usable_gb"] == usable
        assert t.user_attrs["reason"] == (f"does not fit: predicted {t.user_attrs['predicted_peak_gb']:.1f} GB "
                                          f"of {usable:.1f} GB")  # fmt: skip
    started = [t for t in scheduler.study.trials if "started_at" in t.user_attrs and "config" in t.user_attrs]
    assert started and all(t.user_attrs["config"]["lora_rank"] > 0 for t in started)
    assert all(t.user_attrs["predicted_peak_gb"] <= usable for t in started)
    board = format_leaderboard(scheduler.study)
    assert f"does not fit: predicted {refused[0].user_attrs['predicted_peak_gb']:.1f} GB of {usable:.1f} GB" in board


def test_a_simulated_round_on_two_gpus_steps_faster_by_the_documented_factor(tmp_path):
    from search.backends.simulated import MULTI_GPU_EFFICIENCY, true_duration

    def step_s(settings) -> float:
        short, long = (true_duration(config(lora_rank=64, num_generations=8, steps=n), settings) for n in (1, 101))
        return (long - short) / 100

    one = step_s(make_settings(tmp_path, gpus=2, gpus_per_trial=1))
    two = step_s(make_settings(tmp_path, gpus=2, gpus_per_trial=2))
    assert two == pytest.approx(one / (1 + MULTI_GPU_EFFICIENCY))


@pytest.mark.parametrize("per_trial, ok", [(1, True), (2, True), (3, False), (4, True)])
def test_gpus_per_trial_must_lay_out_every_group_size_of_the_space(tmp_path, per_trial, ok):
    """budget.yaml: 2 prompts a step, groups 4, 8 and 16: 3 processes cannot share 8 completions."""
    from search.settings import load_settings

    data = yaml.safe_load((ROOT / "budget.yaml").read_text())
    data.update(gpus=12, gpus_per_trial=per_trial)
    path = tmp_path / "budget.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    if ok:
        assert load_settings(path).gpus_per_trial == per_trial
    else:
        with pytest.raises(SettingsError) as error:
            load_settings(path)
        assert error.value.key == "gpus_per_trial" and "cannot share a step's 8 completions" in str(error.value)


def test_gpus_per_trial_three_is_one_line_at_load_before_anything_runs(tmp_path):
    data = yaml.safe_load((ROOT / "budget.yaml").read_text())
    data.update(gpus=3, gpus_per_trial=3, storage=str(tmp_path / "study.db"))
    (tmp_path / "budget.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    result = subprocess.run([sys.executable, str(ROOT / "run_search.py"), "--simulate", "--budget", "budget.yaml"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "gpus_per_trial" in lines[0] and "cannot share" in lines[0]
    assert not (tmp_path / "simulated").exists()


def test_gpu_memory_gb_is_a_positive_number_or_null(tmp_path):
    from search.settings import load_settings

    for bad in (0, -1, "48", True, 20000):
        data = yaml.safe_load((ROOT / "budget.yaml").read_text())
        data["gpu_memory_gb"] = bad
        path = tmp_path / "budget.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        with pytest.raises(SettingsError) as error:
            load_settings(path)
        assert error.value.key == "gpu_memory_gb"


def test_the_search_passes_the_cap_to_the_rounds_and_their_evaluation(tmp_path):
    from search import space
    from search.backends.local import LocalBackend

    settings = make_settings(tmp_path, gpu_memory_gb=48.0)
    study = optuna.create_study()
    trial = study.ask()
    assert space.sample_config(trial, settings, str(tmp_path / "r")).gpu_memory_gb == 48.0
    command, _ = LocalBackend(settings).eval_command(tmp_path / "m", tmp_path / "r")
    assert command[command.index("--gpu-memory-gb") + 1] == "48.0"


@pytest.mark.skipif("not __import__('torch').cuda.is_available()")
def test_the_cap_makes_an_allocation_above_it_fail_on_a_gpu():
    import torch

    from evaluator.gpu_memory import cap_gpu_memory

    device = torch.device("cuda:0")
    cap_gpu_memory(torch.device("cuda"), 2.0)  # as accelerate names the trainer's device: no index
    try:
        small = torch.empty(int(1e9), dtype=torch.uint8, device=device)  # 1 GB: under the cap
        del small
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(int(3e9), dtype=torch.uint8, device=device)  # 3 GB: over it, on a card of far more
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.empty_cache()


def test_the_evaluator_takes_the_cap_on_its_command_line():
    from evaluator.__main__ import _parser

    assert _parser().parse_args(["m", "d", "--gpu-memory-gb", "48"]).gpu_memory_gb == 48.0
    with pytest.raises(SystemExit):
        _parser().parse_args(["m", "d", "--gpu-memory-gb", "0"])


def test_memory_plans_agree_between_the_search_and_the_trainer(check_2b):
    """The trainer plans from its loaded model what the search predicted from the meta model: the same footprint."""
    from trainer.policy import meta_policy

    c = config(lora_rank=16, num_generations=8, beta=0.04)
    trainer_side = memory.plan(memory.round_footprint(c, meta_policy(build_config("2b"), c), 16), 48 * GB)
    assert check_2b(c, [0]).plan == trainer_side
