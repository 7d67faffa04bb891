"""Issue 5's learning test: one GRPO round of the project's trainer, with the accuracy reward, raises the taught
counting model's accuracy on the synthetic compositional and different-renderer splits, and the same round on
blanked images does not: the gain comes from looking.

The cut-down (about 20 minutes on 2 CPU cores): the demo's taught model (synthetic.teach.DEMO_RECIPE, teach seed 0,
~6 minutes), then bench/learning.py's default round (LoRA 16, lr 2e-3, 40 steps of 8 prompts x 8 generations, ~5
minutes) on the real images and on blanked ones, each model scored greedily as the verifier scores, on the same 200
rows of each split (bench/learning.py has the larger runs). On a CPU every piece is deterministic by seed.

How the margins were chosen, from runs of this configuration (gains in points, paired 95% interval):
- this machine's CPU (2 cores), teach seed 0, GRPO seed 0: image compositional +18.0 [+8.9, +27.1], other +17.5
  [+9.2, +25.8]; GRPO seed 1: +15.0 [+9.8, +20.2] and +17.0 [+11.6, +22.4]; blank +0.0 and +0.0 in both (its greedy
  answers did not change). With 30-step rounds, seed 0: image +9.0 [+0.2, +17.8] and +20.0 [+12.0, +28.0].
- the H200, teach seed 0, n 300, GRPO seeds 0 1: image compositional +20.7 +25.3, other +16.3 +18.0; blank +0.0 +0.0
  and +0.0 +1.0; images shuffled across rows -1.0 +0.0 and -1.3 +0.0.
Noise is the paired interval (its half width is ~9 points at n 200) and what a round gains without the image (at
most +1.0 in every run). So: the image round's gain must be >= MIN_GAIN with its interval above 0, the blank round's
at most MAX_BLANK_GAIN, and the image round must beat it by MIN_GAP; the smallest 40-step image gain seen (+15.0,
its interval from +9.8) clears them by 10 points.

What this does not show: that a round improves every taught model. DEMO_RECIPE taught with seeds 1 and 2 (H200,
n 300) starts far higher (compositional 41.3 and 37.0, other 31.3 and 31.0) and the same round barely moves it
(+0.3 / +0.0 and -2.3 / +3.0); the test pins teach seed 0, whose base answers "2" nearly everywhere and which the
round teaches to look.
"""

from __future__ import annotations

import pytest

N_EVAL = 200  # rows scored per split
N_TRAIN = 256  # GRPO train rows (scenes the SFT never saw)
MIN_GAIN = 5.0  # points: the image round's gain on each held-out split reaches this, its 95% interval above 0
MAX_BLANK_GAIN = 3.0  # points: the blank round's gain on each held-out split stays at or below this
MIN_GAP = 5.0  # points: the image round's gain minus the blank round's, on each held-out split


@pytest.fixture(scope="module")
def learning(tmp_path_factory) -> dict:
    from bench.learning import RoundRecipe, Setup, experiment
    from synthetic.teach import DEMO_RECIPE

    setup = Setup(tmp_path_factory.mktemp("learning"), seed=0, teach=DEMO_RECIPE, n_train=N_TRAIN, n_eval=N_EVAL)
    return experiment(setup, RoundRecipe(), controls=("blank",))


@pytest.mark.parametrize("kind", ["compositional", "other"])
def test_a_round_raises_counting_accuracy_on_held_out_splits(learning, kind):
    gain = learning["arms"]["image"][kind]["gain"]
    assert gain["n"] == N_EVAL
    assert gain["diff"] >= MIN_GAIN and gain["low"] > 0, gain


@pytest.mark.parametrize("kind", ["compositional", "other"])
def test_the_same_round_on_blank_images_does_not(learning, kind):
    image, blank = learning["arms"]["image"][kind]["gain"], learning["arms"]["blank"][kind]["gain"]
    assert blank["diff"] <= MAX_BLANK_GAIN, blank
    assert image["diff"] - blank["diff"] >= MIN_GAP, (image, blank)


def test_a_warm_start_round_is_the_demo_budgets_recipe():
    """`bench/learning.py --warm-start NAME` trains the demo's warm start as written in search/demo_budget.yaml."""
    import yaml

    from bench.learning import RoundRecipe
    from run_search import DEMO_BUDGET

    budget = yaml.safe_load(DEMO_BUDGET.read_text())
    params = next(w["params"] for w in budget["warm_starts"] if w["name"] == "baseline")
    recipe = RoundRecipe.from_warm_start("baseline", seed=3)
    assert dict(recipe.reward_weights) == params["reward_weights"]
    assert (recipe.steps, recipe.learning_rate, recipe.lora_rank, recipe.beta, recipe.loss_type, recipe.phrasing) == (
        params["steps"], params["learning_rate"], params["lora_rank"], params["beta"], params["loss_type"],
        params["phrasing"])  # fmt: skip
    assert (recipe.prompts_per_step, recipe.seed) == (budget["fixed"]["prompts_per_step"], 3)
    assert recipe.tag != RoundRecipe(steps=recipe.steps, learning_rate=recipe.learning_rate, lora_rank=0, seed=3).tag
    with pytest.raises(SystemExit, match="not a warm start"):
        RoundRecipe.from_warm_start("nonexistent")
