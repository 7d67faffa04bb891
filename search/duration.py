"""How long a round will take, predicted from its TrialConfig and refitted on the rounds that finished.

A round is four measured parts (`search.backends.base.TIMING_KEYS`): setup, train, save, eval (a merge candidate is
two: build, one constant per model it reads, and eval). Setup, save and eval
cost the same for every round (the same model, the same evaluation rows), so each is one constant. In training, a
generation batch decodes for as long as its longest completion, which is the cap
`max_completion_length` for most batches, so the training features use the cap (the same feature at fit and at
prediction time; the fitted coefficient absorbs how often batches end early):

  decode steps   ceil(steps / generation_steps) * max_completion_length, split into full and LoRA rounds: a decode
                 step costs about the same over a wide range of batch sizes; LoRA rounds also merge the adapters;
  tokens         steps * prompts_per_step * num_generations * max_completion_length: what grows with the batch
                 (attention over the KV cache, the logits, the training forward and backward);
  in-round eval  rows greedily scored during training, (steps // eval_every) * eval_rows;
  compilation    1 when the round compiles its rollouts' decode step (once, in its first generation).

Priors come from H200 measurements of the trainer, times `prior_scale` for the box's slower 48 GB cards. Each part is
then refitted as non-negative multipliers of its prior terms, by least squares on relative errors (a 5-minute and
a 60-minute round count alike) with a ridge pulling every multiplier toward the part's median measured/prior
ratio: with one round the model is the prior rescaled, with many it is the data, and features the rounds never
varied (e.g. full fine-tuning when only LoRA ran) follow the overall ratio. A part a kill cut short is a lower
bound: it joins the fit only where the fit falls below it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from search.backends import TIMING_KEYS as PARTS

ROUND_PARTS = ("setup", "train", "save", "eval")  # a training round's parts; a merge's are build and eval
from trainer.config import TrialConfig

# H200 priors, from the trainer as it runs on the 2B model (bench/grpo_profile.py; the figures behind each constant
# are in docs/MEASUREMENTS.md): priors near a real round keep the first rounds' allotments sensible before any fit.
DECODE_FULL_S = 0.009
DECODE_LORA_S = 0.010
TOKEN_S = 0.00027
COMPILE_S = 40.0  # once per round that compiles its rollouts
INROUND_EVAL_ROW_S = 0.16  # greedy generate, dynamic cache, batch 32
SETUP_S = 25.0  # launch, imports, model, replica (and reference model) loading, dataset loading
SAVE_S = 10.0  # merge, save_pretrained of 4.4 GB
# One evaluation process: model loading and the static cache's compilation. Its imports and data loading happen while
# the round trains (LocalBackend starts the evaluator beside the trainer).
EVAL_LOAD_S = 75.0
EVAL_ROW_S = 0.03
# A merge candidate's build, per model it reads (search.merge.soup: the 2B model's 4.4 GB read, averaged in float32,
# the result written; bench/soup_cost.py).
BUILD_MODEL_S = 8.0
# The box's 48 GB cards against an H200: a guess (less bandwidth and compute; decode is partly launch-bound),
# replaced by the fit as soon as one round has finished.
BOX_SLOWDOWN = 2.0

INROUND_EVAL = 3  # index of the in-round evaluation among the training terms
RIDGE = 0.1  # weight of one multiplier's relative distance to the overall ratio, against squared relative errors


@dataclass(frozen=True)
class Estimate:
    """Predicted seconds of each part of one round."""

    setup: float
    train: float
    save: float
    eval: float

    @property
    def total(self) -> float:
        return self.setup + self.train + self.save + self.eval

    @property
    def tail(self) -> float:
        """What follows training: saving and evaluation (the time a stopped round still needs)."""
        return self.save + self.eval


class DurationModel:
    def __init__(
        self,
        *,
        eval_rows: int,
        prior_scale: float = BOX_SLOWDOWN,
        min_step_fraction: float = 0.25,
    ):
        """`eval_rows`: rows scored after each round (OOD plus val, by one process that loads the model once). A
        round shrunk below `min_step_fraction` of its sampled steps is not the configuration the sampler proposed any
        more (its schedule, its KL drift): `fit_steps` refuses it."""
        self._priors = {
            "setup": np.array([SETUP_S]),
            "train": np.array([DECODE_FULL_S, DECODE_LORA_S, TOKEN_S, INROUND_EVAL_ROW_S, COMPILE_S]),
            "save": np.array([SAVE_S]),
            "eval": np.array([EVAL_LOAD_S + eval_rows * EVAL_ROW_S]),
            "build": np.array([BUILD_MODEL_S]),
        }
        self._multipliers = {part: np.full(len(p), prior_scale) for part, p in self._priors.items()}
        # part -> [(terms, seconds, exact)]; not exact: a lower bound (the part was cut short by a kill)
        self._observed: dict[str, list[tuple[np.ndarray, float, bool]]] = {part: [] for part in PARTS}
        self.min_step_fraction = min_step_fraction

    # ------------------------------------------------------------------ prediction
    def estimate(self, config: TrialConfig, *, steps: int | None = None) -> Estimate:
        steps = config.steps if steps is None else steps
        seconds = {
            part: float(self._terms(part, config, steps) @ self._multipliers[part]) for part in ROUND_PARTS
        }
        return Estimate(**seconds)

    def eval_seconds(self) -> float:
        """Predicted seconds of a round's evaluations (the same for every round, and all a scoring round does)."""
        return float(self._terms("eval", None, 0) @ self._multipliers["eval"])

    def merge_seconds(self, models_read: int) -> float:
        """Predicted seconds of a merge candidate: building it from `models_read` models, then its evaluations."""
        return float(self._terms("build", None, 0, models_read) @ self._multipliers["build"]) + self.eval_seconds()

    def check_seconds(self, rows: int) -> float:
        """Predicted seconds of one process loading a model and generating `rows` rows (a submission's check), at the
        rate the evaluations were measured at."""
        return float((EVAL_LOAD_S + rows * EVAL_ROW_S) * self._multipliers["eval"][0])

    def predict(self, config: TrialConfig) -> float:
        return self.estimate(config).total

    def longest_step(self, config: TrialConfig) -> float:
        """Predicted seconds of the slowest step: the one that generates a batch and then scores the in-round OOD
        subset. A STOP arriving just before it takes this long to take effect."""
        terms = self._terms("train", config, config.generation_steps)
        terms[INROUND_EVAL] = (config.eval_rows if config.eval_every else 0) * self._priors["train"][INROUND_EVAL]
        return float(terms @ self._multipliers["train"])

    def min_useful_steps(self, config: TrialConfig) -> int:
        return max(1, math.ceil(self.min_step_fraction * config.steps))

    def fit_steps(self, config: TrialConfig, seconds_available: float) -> int | None:
        """The most steps (at most `config.steps`) whose predicted round fits in `seconds_available`; None when
        not even `min_useful_steps` fit. The prediction grows with the steps, so a bisection finds it."""
        low, high = self.min_useful_steps(config), config.steps
        if self.estimate(config, steps=low).total > seconds_available:
            return None
        while low < high:
            mid = (low + high + 1) // 2
            if self.estimate(config, steps=mid).total <= seconds_available:
                low = mid
            else:
                high = mid - 1
        return low

    # ------------------------------------------------------------------ learning
    @property
    def n_observed(self) -> int:
        return len(self._observed["train"])

    def observe(
        self, config: TrialConfig | None, steps_done: int, timings: dict[str, float], *, models_read: int = 0
    ) -> None:
        """Learn from a finished round's measured `timings`: each part's seconds, or `<part>_at_least` for a part a
        kill cut short. A part that is missing or not positive (the evaluation of a pruned round) teaches nothing.
        `steps_done` is what ran, not what was planned; a round that only scored a model has no config; a merge
        candidate read `models_read` models."""
        for part in PARTS:
            exact = part in timings
            seconds = timings.get(part, timings.get(f"{part}_at_least"))
            if seconds is None or not seconds > 0 or (part == "train" and (steps_done < 1 or config is None)):
                continue
            if part == "build" and models_read < 1:
                continue
            self._observed[part].append((self._terms(part, config, steps_done, models_read), float(seconds), exact))
            self._multipliers[part] = _fit_with_bounds(self._observed[part])

    def _terms(self, part: str, config: TrialConfig | None, steps: int, models_read: int = 0) -> np.ndarray:
        """The prior's seconds per term: features times prior coefficients (the multipliers scale these)."""
        if part == "build":
            return self._priors[part] * models_read
        if part != "train":
            return self._priors[part].copy()
        decode = math.ceil(steps / config.generation_steps) * config.max_completion_length
        tokens = steps * config.prompts_per_step * config.num_generations * config.max_completion_length
        eval_rows = (steps // config.eval_every) * config.eval_rows if config.eval_every else 0
        lora = not config.full_finetuning
        compile_once = 1.0 if config.compile_rollouts else 0.0
        features = np.array([0.0 if lora else decode, decode if lora else 0.0, tokens, eval_rows, compile_once])
        return features * self._priors["train"]


def _fit_with_bounds(rows: list[tuple[np.ndarray, float, bool]]) -> np.ndarray:
    """The fit on exact measurements, plus the lower bounds it violates (a bound above the fit pulls it up; one
    below it says nothing). With nothing exact yet, the bounds are the best measurements there are."""
    exact = [(terms, seconds) for terms, seconds, is_exact in rows if is_exact]
    bounds = [(terms, seconds) for terms, seconds, is_exact in rows if not is_exact]
    if not exact:
        return _fit(bounds)
    multipliers = _fit(exact)
    violated = [(terms, seconds) for terms, seconds in bounds if terms @ multipliers < seconds]
    return _fit(exact + violated) if violated else multipliers


def _fit(rows: list[tuple[np.ndarray, float]]) -> np.ndarray:
    """Non-negative multipliers m minimising sum(((y - z.m) / y)^2) + RIDGE * sum(((m_j - s) / s)^2), where s is
    the median of y / sum(z): a robust overall ratio, and the value of multipliers the data does not pin down."""
    z = np.array([terms for terms, _ in rows])
    y = np.array([seconds for _, seconds in rows])
    ratio = float(np.median(y / np.maximum(z.sum(axis=1), 1e-9)))
    k = z.shape[1]
    a = np.vstack([z / y[:, None], math.sqrt(RIDGE) / ratio * np.eye(k)])
    b = np.concatenate([np.ones(len(y)), math.sqrt(RIDGE) * np.ones(k)])
    return _nnls(a, b, start=np.full(k, ratio))


def _nnls(a: np.ndarray, b: np.ndarray, *, start: np.ndarray, sweeps: int = 500) -> np.ndarray:
    """min ||a x - b|| with x >= 0 by cyclic coordinate descent: exact for this convex problem, and a handful of
    columns needs no solver (numpy is the only numeric dependency the search may assume). The ridge rows keep
    every column's norm positive."""
    x = start.astype(float).copy()
    norms = (a * a).sum(axis=0)
    for _ in range(sweeps):
        moved = 0.0
        for j in range(len(x)):
            new = max(0.0, x[j] + a[:, j] @ (b - a @ x) / norms[j])
            moved = max(moved, abs(new - x[j]))
            x[j] = new
        if moved <= 1e-12 * max(1.0, float(np.abs(x).max())):
            break
    return x
