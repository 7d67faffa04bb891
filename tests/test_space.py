"""The search space: its constraints hold on every sample, and warm starts come out first with their params."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import optuna
import pytest

from search.settings import load_settings
from search.space import SpaceError, check_space, sample_config, sampled_init, warm_start_params, with_steps
from search.study import open_study
from trainer.config import ConfigError, TrialConfig

BUDGET = Path(__file__).resolve().parents[1] / "budget.yaml"

optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.fixture()
def settings(tmp_path):
    return load_settings(BUDGET, storage=str(tmp_path / "study.db"))


def test_constraints_hold_over_500_random_samples(settings, tmp_path):
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    space = settings.space
    seen = {"accuracy_off": 0, "kl_off": 0, "kl_on": 0, "lora": 0, "full": 0}
    for i in range(500):
        trial = study.ask()
        config = sample_config(trial, settings, str(tmp_path / f"round-{i}"))
        weights = config.reward_weights
        assert weights["accuracy"] > 0 or weights["answer_format"] > 0
        assert set(weights) == set(space["reward_weights"])
        for name, weight in weights.items():
            assert weight in space["reward_weights"][name]
        if config.lora_rank > 0:
            bounds, param, other = space["learning_rate_lora"], "lr_lora", "lr_full"
            seen["lora"] += 1
        else:
            bounds, param, other = space["learning_rate_full"], "lr_full", "lr_lora"
            seen["full"] += 1
        assert bounds["low"] <= config.learning_rate <= bounds["high"]
        assert trial.params[param] == config.learning_rate and other not in trial.params
        if config.beta == 0:
            seen["kl_off"] += 1
            assert trial.params["use_kl"] is False and "beta" not in trial.params
        else:
            seen["kl_on"] += 1
            assert space["beta"]["low"] <= config.beta <= space["beta"]["high"]
        seen["accuracy_off"] += weights["accuracy"] == 0
        steps = space["steps"]
        assert steps["low"] <= config.steps <= steps["high"] and (config.steps - steps["low"]) % steps["step"] == 0
        assert space["temperature"]["low"] <= config.temperature <= space["temperature"]["high"]
        for option in ("num_generations", "lora_rank", "loss_type", "max_pixels", "phrasing"):
            assert getattr(config, option) in space[option]
        assert trial.user_attrs["recipe"] == "sampled"
        study.tell(trial, float(i % 7))
    assert all(count > 50 for count in seen.values()), seen  # every branch was explored


def test_config_takes_paths_fixed_options_and_prune_settings(settings, tmp_path):
    trial = optuna.create_study().ask()
    config = sample_config(trial, settings, str(tmp_path / "round"))
    assert (config.model_path, config.train_path, config.ood_path) == (
        settings.model_path, settings.train_path, settings.ood_val_path
    )  # fmt: skip
    assert config.output_dir == str(tmp_path / "round")
    assert (config.eval_every, config.eval_rows) == (settings.prune_every, settings.prune_rows)
    assert config.seed == config.eval_seed == settings.seed
    for name, value in settings.fixed.items():
        assert getattr(config, name) == value
    assert TrialConfig.from_dict(config.to_dict()) == config


def test_with_steps(settings, tmp_path):
    config = sample_config(optuna.create_study().ask(), settings, str(tmp_path))
    shorter = with_steps(config, 7)
    assert shorter.steps == 7 and dataclasses.replace(shorter, steps=config.steps) == config
    with pytest.raises(ConfigError, match="^steps"):
        with_steps(config, 0)


def test_the_base_then_the_warm_starts_come_out_first_with_their_params(settings, tmp_path):
    study, _ = open_study(settings, now=0.0)
    round_zero = study.ask()
    assert round_zero.number == 0 and round_zero.user_attrs["recipe"] == "base" and round_zero.params == {}
    configs = []
    for _ in range(3):
        trial = study.ask()
        configs.append((trial, sample_config(trial, settings, str(tmp_path / str(trial.number)))))
    (strong_trial, strong), (base_trial, base), (third, _) = configs
    assert strong_trial.user_attrs["recipe"] == "strong"
    assert base_trial.user_attrs["recipe"] == "baseline"
    assert third.user_attrs["recipe"] == "sampled"
    for trial, config, recipe in ((strong_trial, strong, settings.warm_starts[0]),
                                  (base_trial, base, settings.warm_starts[1])):  # fmt: skip
        params = recipe["params"]
        assert trial.params == warm_start_params(params, settings.space)
        for option in ("beta", "lora_rank", "learning_rate", "num_generations", "temperature", "loss_type",
                       "max_pixels", "phrasing", "steps"):  # fmt: skip
            assert getattr(config, option) == params[option], option
        expected = {name: params["reward_weights"].get(name, 0.0) for name in settings.space["reward_weights"]}
        assert config.reward_weights == expected
    assert strong.lora_rank > 0 and "lr_lora" in strong_trial.params
    assert base.lora_rank == 0 and base_trial.params["lr_full"] == 1e-6


def test_init_is_searched_and_a_warm_start_may_set_it(settings, tmp_path):
    assert settings.space["init"] == ["base", "best"]
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen = set()
    for _ in range(20):
        trial = study.ask()
        config = sample_config(trial, settings, str(tmp_path))
        seen.add(sampled_init(trial))
        assert config.model_path == settings.model_path  # the scheduler moves it to the parent's weights
    assert seen == {"base", "best"}
    study.enqueue_trial(warm_start_params({"init": "best", "lora_rank": 16}, settings.space))
    trial = study.ask()
    sample_config(trial, settings, str(tmp_path))
    assert sampled_init(trial) == "best" and trial.params["lora_rank"] == 16
    with pytest.raises(SpaceError, match=r"^init: 'parent' is not one of space.init"):
        warm_start_params({"init": "parent"}, settings.space)
    with pytest.raises(SpaceError, match=r"^init: must be a non-empty list of \['base', 'best'\]"):
        check_space({**settings.space, "init": ["base", "latest"]})


def test_warm_start_translation():
    space = load_settings(BUDGET).space
    params = warm_start_params({"reward_weights": {"answer_format": 1, "brevity": 0.5}, "beta": 0}, space)
    assert params["w_accuracy"] == 0.0 and params["w_answer_format_alone"] == 1.0 and "w_answer_format" not in params
    assert params["use_kl"] is False and "beta" not in params
    assert warm_start_params({}, space) == {}  # a recipe may leave options out; they are sampled
    with pytest.raises(SpaceError, match="^learning_rate: needs lora_rank"):
        warm_start_params({"learning_rate": 1e-5}, space)
    with pytest.raises(SpaceError, match="^beta: must be a number, got 'small'"):
        warm_start_params({"beta": "small"}, space)
    with pytest.raises(SpaceError, match=r"^beta: -0.1 is outside space.beta"):
        warm_start_params({"beta": -0.1}, space)


def test_enqueued_partial_recipe_samples_the_rest(settings, tmp_path):
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    study.enqueue_trial(warm_start_params({"lora_rank": 0, "learning_rate": 2e-6}, settings.space))
    trial = study.ask()
    config = sample_config(trial, settings, str(tmp_path))
    assert config.lora_rank == 0 and math.isclose(config.learning_rate, 2e-6)
    assert config.reward_weights["accuracy"] > 0 or config.reward_weights["answer_format"] > 0
