"""The DurationModel: priors in line with the brief's H200 figures, a fit that recovers known coefficients from a
few noisy rounds, and a step fit that is monotone in the time available."""

from __future__ import annotations

import math
import random

import pytest

from search.duration import DurationModel
from trainer.config import TrialConfig


def config(**changes) -> TrialConfig:
    base = dict(model_path="m", train_path="t", output_dir="o", steps=200, prompts_per_step=2, generation_steps=4)
    return TrialConfig(**{**base, **changes})


def test_prior_matches_the_measured_h200_step_times():
    model = DurationModel(eval_rows=288, prior_scale=1.0)
    # bench/results/2026-12-03-h200.json: 8 completions per step, 8 steps per generation, 256-token completions.
    full = config(lora_rank=0, prompts_per_step=1, generation_steps=8, steps=100)
    lora = full.replace(lora_rank=64)

    def seconds_per_step(c: TrialConfig) -> float:  # steady state: what 100 more steps add
        return (model.estimate(c, steps=200).train - model.estimate(c, steps=100).train) / 100

    assert 0.87 * 0.9 < seconds_per_step(full) < 1.14 * 1.1  # two machines measured 0.87 and 1.14 s
    assert 0.85 * 0.9 < seconds_per_step(lora) < 1.03 * 1.1  # 0.85 (and 1.03 with gradient checkpointing)
    # A real 20-step LoRA round of the search (2 prompts per step, 4 steps per generation, 64 rows scored during
    # training, 288 after it): 240 s, of which setup 21.5, train 107, save 6.2, eval 105.
    searched = config(lora_rank=64, steps=20, eval_every=10, eval_rows=32, ood_path="ood")
    assert model.predict(searched) == pytest.approx(240, rel=0.25)
    assert model.predict(searched.replace(compile_rollouts=False)) < model.predict(searched) - 30


# The "box" the synthetic rounds are timed on: coefficients unlike the prior's, 2-4x the H200's per term.
TRUE = {
    "decode_full": 0.025, "decode_lora": 0.03, "token": 0.0009, "row": 0.5, "compile": 90.0, "setup": 210.0,
    "save": 95.0, "eval": 500.0,
}  # fmt: skip


def true_timings(c: TrialConfig, rng: random.Random, noise: float = 0.05) -> dict[str, float]:
    decode = math.ceil(c.steps / c.generation_steps) * c.max_completion_length
    tokens = c.steps * c.prompts_per_step * c.num_generations * c.max_completion_length
    rows = (c.steps // c.eval_every) * c.eval_rows if c.eval_every else 0
    train = decode * (TRUE["decode_lora"] if c.lora_rank else TRUE["decode_full"]) + tokens * TRUE["token"]
    train += rows * TRUE["row"] + (TRUE["compile"] if c.compile_rollouts else 0.0)
    jitter = lambda: math.exp(rng.gauss(0, noise))  # noqa: E731
    return {
        "setup": TRUE["setup"] * jitter(),
        "train": train * jitter(),
        "save": TRUE["save"] * jitter(),
        "eval": TRUE["eval"] * jitter(),
    }


def random_config(rng: random.Random) -> TrialConfig:
    return config(
        steps=rng.randrange(50, 301, 10),
        lora_rank=rng.choice([0, 16, 64]),
        num_generations=rng.choice([4, 8, 16]),
        generation_steps=rng.choice([1, 2, 4]),
        max_completion_length=rng.choice([128, 256, 512]),
        compile_rollouts=rng.random() < 0.8,
        eval_every=rng.choice([0, 50]),
        ood_path="ood",
    )


def noiseless_total(c: TrialConfig) -> float:
    return sum(true_timings(c, random.Random(0), noise=0.0).values())


def relative_errors(model: DurationModel, configs: list[TrialConfig]) -> list[float]:
    return [abs(model.predict(c) - noiseless_total(c)) / noiseless_total(c) for c in configs]


@pytest.mark.parametrize("rounds, mean_tolerance, worst_tolerance", [(3, 0.2, 0.6), (12, 0.06, 0.1)])
def test_fit_recovers_known_timings_from_few_noisy_rounds(rounds, mean_tolerance, worst_tolerance):
    rng = random.Random(rounds)
    model = DurationModel(eval_rows=1500, prior_scale=1.0)  # H200 priors on a slower box
    held_out = [random_config(rng) for _ in range(30)]
    before = relative_errors(model, held_out)
    for _ in range(rounds):
        c = random_config(rng)
        model.observe(c, c.steps, true_timings(c, rng))
    after = relative_errors(model, held_out)
    assert model.n_observed == rounds
    assert sum(before) / len(before) > 0.4  # the prior is far off this box
    assert sum(after) / len(after) < mean_tolerance
    assert max(after) < worst_tolerance


def test_a_part_not_measured_teaches_nothing():
    model = DurationModel(eval_rows=1000)
    c = config()
    prior_eval = model.estimate(c).eval
    timings = true_timings(c, random.Random(0))
    del timings["eval"]  # a pruned round is not scored
    model.observe(c, 120, timings)
    assert model.estimate(c).eval == prior_eval
    assert model.estimate(c).setup == pytest.approx(timings["setup"], rel=1e-6)


def test_a_round_that_only_scored_teaches_the_evaluation_and_the_check():
    model = DurationModel(eval_rows=1000, prior_scale=1.0)
    c = config()
    prior_eval, prior_check = model.eval_seconds(), model.check_seconds(50)
    assert prior_eval == pytest.approx(model.estimate(c).eval) and prior_check < prior_eval
    model.observe(None, 0, {"eval": 3 * prior_eval})  # round 0: the base model scored, no config
    assert model.eval_seconds() == pytest.approx(3 * prior_eval, rel=0.01) and model.n_observed == 0
    assert model.estimate(c).train == pytest.approx(DurationModel(eval_rows=1000, prior_scale=1.0).estimate(c).train)
    # A submission's check (one load, 50 rows) is measured at the evaluations' pace: three times its prior too.
    assert model.check_seconds(50) == pytest.approx(3 * prior_check, rel=0.01)


def test_observations_use_the_steps_that_ran():
    rng = random.Random(1)
    model = DurationModel(eval_rows=1000)
    for _ in range(6):
        c = random_config(rng)
        done = max(1, c.steps // 3)  # stopped early: the timings are those of `done` steps
        model.observe(c, done, true_timings(c.replace(steps=done), rng, noise=0.0))
    c = config(lora_rank=64)
    assert model.predict(c) == pytest.approx(noiseless_total(c), rel=0.1)


def test_fit_steps_is_monotone_and_bounded():
    model = DurationModel(eval_rows=1000, min_step_fraction=0.25)
    c = config(steps=240, lora_rank=64)
    fitted = [model.fit_steps(c, seconds) for seconds in range(0, 8000, 50)]
    useful = [s for s in fitted if s is not None]
    assert fitted[0] is None and useful  # nothing fits in no time, something does later
    assert useful == sorted(useful)  # more time never means fewer steps
    assert min(useful) >= 60 and max(useful) == 240  # at least a quarter of the sampled steps, at most all
    assert fitted.index(useful[0]) == sum(s is None for s in fitted)  # None only below the first fit
    for seconds, steps in zip(range(0, 8000, 50), fitted):
        if steps is not None and steps < 240:
            assert model.estimate(c, steps=steps).total <= seconds < model.estimate(c, steps=steps + 1).total


def test_fit_steps_none_when_the_fixed_costs_alone_do_not_fit():
    model = DurationModel(eval_rows=1000)
    c = config(steps=10)
    fixed = model.estimate(c, steps=0).total
    assert model.fit_steps(c, fixed) is None
    assert model.fit_steps(c, model.predict(c)) == 10


def test_the_longest_step_generates_a_batch_and_scores_the_inround_subset():
    model = DurationModel(eval_rows=1000)
    plain = config(generation_steps=4, eval_every=0)
    scored = plain.replace(eval_every=50, eval_rows=128, ood_path="ood")
    average = model.estimate(plain).train / plain.steps
    assert model.longest_step(plain) == pytest.approx(model.estimate(plain, steps=4).train)  # one generation batch
    assert model.longest_step(plain) > 3 * average
    assert model.longest_step(scored) - model.longest_step(plain) == pytest.approx(
        model.estimate(scored, steps=50).train - model.estimate(plain, steps=50).train
    )
