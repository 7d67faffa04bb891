"""Rounds that cost virtual time and score on a synthetic landscape: `run_search.py --simulate` and the tests.

A simulated round is a timeline fixed at `start` and read against the clock: setup, steps (with the in-round OOD
subset scored every `eval_every` steps), save, evaluation. Its durations come from a hidden cost function of the
configuration that is not the DurationModel's prior (other coefficients, a batch-size effect the model lacks,
per-round noise), so the model has something to learn. Its accuracies come from a landscape built from the brief's
evidence: paying the verifier's answer and a clean format, a small KL, a learning rate near the sweet spot of LoRA
or full fine-tuning (LoRA ~10x higher), short completions, no forced chain-of-thought; the inherited R1-V-like
recipe lands clearly lower. A round started from another round's merged model (`init: best`) starts from that
model's accuracy and moves toward what its own configuration reaches (up if that is higher, partly down if lower),
and long chains decay like long rounds (by the total steps from the base). Every scored model answers each row of a
fixed ood_val: row i has a hidden difficulty, and a model answers it right when that difficulty, blurred per model,
is below the model's accuracy, so two models' scores compare row by row as real ones do. Some rounds fail: a seeded few at random, LoRA rates far above the sweet spot with a
NaN loss, and a seeded few hang (no more progress, no exit, deaf to STOP) until the scheduler kills them.
Nothing is written to disk: `merged_dir` names a folder that does not exist (the backend remembers the models it
made), so a simulated search passes a recording `promote` to the Scheduler.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

from search.backends.base import RoundOutcome
from search.backends.clock import Clock
from search.backends.fit import FitCheck
from search.merge import MergeSpec
from search.settings import Settings
from trainer.config import TrialConfig
from trainer.run_folder import MERGED_DIR, FailureKind, Phase, RoundState

# The hidden cost of a round on the simulated box (seconds): a box ~3x slower than an H200 (search/duration.py's
# measured priors), where the DurationModel's prior guesses 2x, so early rounds run late and the model has to learn.
TRUE_SETUP_S = 75.0
TRUE_DECODE_FULL_S = 0.027  # per decode step of a generation batch
TRUE_DECODE_LORA_S = 0.03
TRUE_BATCH_EFFECT = 0.004  # a decode step slows by this share per sequence in the batch
TRUE_TOKEN_S = 0.0008  # per completion token (old log-probs, training forward and backward)
TRUE_COMPLETION_SHARE = 0.85  # of the cap, decoded on average by a generation batch
TRUE_INROUND_ROW_S = 0.4
TRUE_SAVE_S = 30.0
TRUE_EVAL_LOAD_S = 220.0
TRUE_EVAL_ROW_S = 0.09
OOD_ROWS = 1000  # ood_val's size when every row is scored

# The landscape.
BASE_OOD = 50.0  # the untrained model
MAX_GAIN = 35.0
PEAK_LR = {"lora": 2e-5, "full": 2e-6}
NAN_LR_FACTOR = 4.0  # LoRA rates this far above the peak may diverge
RANDOM_FAILURE = 0.03
RANDOM_HANG = 0.02
ROW_BLUR = 0.05  # per model and row: how far a row's difficulty moves for one model (paired rounds differ near it)
REGRESSION_SHARE = 0.5  # of the way down to a worse configuration's level that a child round goes
# Merges (search.merge.soup), from the papers' direction and the demo's pilots (issue 32), not the real model: a soup
# of near-equal rounds gains up to SOUP_GAIN points, a gain that fades as its ingredients spread apart (one far worse
# ingredient drags the mean down besides); moving a model from the base by eta keeps 1 - (1 - eta)^2 of its change,
# plus up to WISE_GAIN points toward the base (WiSE-FT's robustness); every merge adds MERGE_NOISE (sd, points).
SOUP_GAIN = 1.5
SOUP_SPREAD = 3.0  # points of spread between the best and worst ingredient that cut the gain to 1/e
WISE_GAIN = 1.0
MERGE_NOISE = 0.7
TRUE_BUILD_MODEL_S = 20.0  # per model a merge reads, on the simulated box
# The simulated box's cards (the user's: 48 GB each) unless the budget sets gpu_memory_gb; rounds are fitted to them
# (search.backends.fit) with the 2B model's architecture, as on the box.
CARD_GB = 48.0
# A round on n GPUs steps 1 + MULTI_GPU_EFFICIENCY x (n - 1) times as fast (data-parallel over NCCL: each GPU
# generates and trains its share of the step's completions, the gradients are all-reduced). Assumed, not measured.
MULTI_GPU_EFFICIENCY = 0.85


class SimulatedBackend:
    def __init__(
        self,
        settings: Settings,
        clock: Clock,
        seed: int = 0,
        *,
        failure_rate: float = RANDOM_FAILURE,
        hang_rate: float = RANDOM_HANG,
    ):
        self.settings = settings
        self.clock = clock
        self.failure_rate = failure_rate
        self.hang_rate = hang_rate
        self._rng = random.Random(seed)
        rows = random.Random(f"rows-{seed}")
        self.row_difficulty = [rows.random() for _ in range(settings.ood_rows or OOD_ROWS)]
        # merged_dir -> (noise-free OOD accuracy, total steps from the base, clean format) of every saved model
        self._models: dict[str, tuple[float, int, bool]] = {}
        card = (settings.gpu_memory_gb or CARD_GB) * 1e9
        self.fit = FitCheck(_architecture, lambda gpus: card)

    def start(self, config: TrialConfig, gpus: list[int]) -> "SimulatedRound":
        return SimulatedRound(self, config, random.Random(self._rng.getrandbits(64)), gpus=len(gpus) or 1)

    def score(self, model_dir: str, run_dir: str, gpus: list[int]) -> "SimulatedRound":
        return SimulatedRound(self, None, random.Random(self._rng.getrandbits(64)), model_dir=model_dir)

    def merge(self, spec: MergeSpec, run_dir: str, gpus: list[int]) -> "SimulatedRound":
        rng = random.Random(self._rng.getrandbits(64))
        points = [self.start_point(folder) for folder in spec.ingredients]
        accuracy = merged_accuracy([a for a, _, _ in points], spec.eta, rng)
        merged = str(Path(run_dir) / MERGED_DIR)
        self.remember(merged, accuracy, max(steps for _, steps, _ in points), all(clean for _, _, clean in points))
        build_s = TRUE_BUILD_MODEL_S * spec.models_read * math.exp(rng.gauss(0.0, 0.05))
        return SimulatedRound(self, None, rng, model_dir=merged, build_s=build_s)

    def has_weights(self, merged_dir: str) -> bool:
        return merged_dir == self.settings.model_path or merged_dir in self._models

    def wait(self, seconds: float) -> None:
        self.clock.sleep(seconds)  # a virtual clock: the simulated rounds move on as it does

    def start_point(self, model_path: str) -> tuple[float, int, bool]:
        """(noise-free accuracy, total steps from the base, clean answer format) of the model a round starts from;
        anything this backend did not make is the base model."""
        return self._models.get(model_path, (BASE_OOD, 0, False))

    def remember(self, merged_dir: str, accuracy: float, total_steps: int, clean_format: bool) -> None:
        self._models[merged_dir] = (accuracy, total_steps, clean_format)

    def answers(self, accuracy: float, rng: random.Random) -> list[bool]:
        """Per ood_val row, whether a model of this noise-free accuracy answers it right."""
        level = accuracy / 100.0
        return [d + rng.gauss(0.0, ROW_BLUR) < level for d in self.row_difficulty]


def merged_accuracy(accuracies: list[float], eta: float, rng: random.Random) -> float:
    """The noise-free-ish accuracy of the merge of models of these `accuracies` moved by `eta` from the base (see
    SOUP_GAIN): the soup's own, then the move, then one draw of MERGE_NOISE."""
    soup = sum(accuracies) / len(accuracies)
    if len(accuracies) > 1:
        soup += SOUP_GAIN * math.exp(-(max(accuracies) - min(accuracies)) / SOUP_SPREAD)
    moved = BASE_OOD + (soup - BASE_OOD) * (1 - (1 - eta) ** 2) + WISE_GAIN * 4 * eta * max(0.0, 1 - eta)
    return _clip(moved + rng.gauss(0.0, MERGE_NOISE))


def true_duration(config: TrialConfig, settings: Settings) -> float:
    """The noise-free seconds of a completed, evaluated round (what the DurationModel should learn)."""
    parts = _true_parts(config, settings, settings.gpus_per_trial if settings.gpus else 1)
    evals = config.steps // config.eval_every if config.eval_every else 0
    return parts["setup"] + config.steps * parts["step"] + evals * parts["inround_eval"] + parts["save"] + parts["eval"]


def true_accuracy(config: TrialConfig, step: int, *, start: float = BASE_OOD, steps_before: int = 0) -> float:
    """The noise-free OOD accuracy (percent) after `step` steps of `config`, from a model of accuracy `start` that
    `steps_before` steps of earlier rounds made (the base: BASE_OOD, 0)."""
    w = config.reward_weights
    clean_format = w.get("answer_format", 0) > 0 or w.get("brevity", 0) > 0
    reward = 0.55 + 0.3 * (w.get("accuracy", 0) > 0) + 0.15 * clean_format + 0.05 * (w.get("count_closeness", 0) > 0)
    if w.get("think_format", 0) > 0:
        reward *= 0.7  # forced chain-of-thought does not help a 2B model count
    beta = 0.95 if config.beta == 0 else 1.0 - 0.25 * min(1.0, config.beta / 0.1)
    length = 1.0 - 0.15 * max(0.0, math.log2(config.max_completion_length / 128))
    group = {4: 0.9, 8: 1.0}.get(config.num_generations, 1.02)
    peak = _peak_lr(config)
    lr = math.exp(-(math.log10(config.learning_rate / peak) ** 2) / (2 * 0.4**2))
    tau = 40.0 * max(0.5, peak / config.learning_rate) ** 0.7  # slower rates learn slower
    level = BASE_OOD + MAX_GAIN * min(1.0, reward) * beta * length * group * lr  # what this configuration reaches
    moved = 1 - math.exp(-step / tau)
    if level < start:
        moved *= REGRESSION_SHARE
    decay = math.exp(-max(0, steps_before + step - 400) / 1500)  # later checkpoints decay
    return min(100.0, BASE_OOD + (start + (level - start) * moved - BASE_OOD) * decay)


class SimulatedRound:
    """A GRPO round of `config`, or (config None) only the evaluation of the model at `model_dir`, after `build_s`
    seconds of building it when it is a merge."""

    def __init__(
        self,
        backend: SimulatedBackend,
        config: TrialConfig | None,
        rng: random.Random,
        *,
        model_dir: str = "",
        build_s: float = 0.0,
        gpus: int = 1,
    ):
        self._backend = backend
        self._clock = backend.clock
        self._config = config
        self._rng = rng
        self._started = self._clock.now()
        self._start_point = backend.start_point(config.model_path if config else model_dir)
        self._merged = str(Path(config.output_dir) / MERGED_DIR) if config else model_dir
        parts = _true_parts(config, backend.settings, gpus)
        noise = lambda sigma: math.exp(rng.gauss(0.0, sigma))  # noqa: E731 - per-part lognormal noise
        self._setup = parts["setup"] * noise(0.05) + build_s  # a merge's build is its setup: no steps follow
        self._build = build_s
        self._step = parts["step"] * noise(0.05)
        self._inround_eval = parts["inround_eval"] * noise(0.05)
        self._save = parts["save"] * noise(0.05)
        self._eval = parts["eval"] * noise(0.03)
        self._planned = config.steps if config else 0
        self._failure: tuple[int, str, FailureKind] | None = None  # (steps done, reason, kind)
        self._hang_step: int | None = None  # the last step a hung round completes
        draw = rng.random()
        if config is None:
            pass  # scoring a saved model: no training to fail
        elif draw < backend.failure_rate:
            self._failure = (0, "simulated failure: CUDA error: an illegal memory access was encountered",
                             FailureKind.ERROR)
        elif draw < backend.failure_rate + backend.hang_rate:
            self._hang_step = rng.randint(0, config.steps - 1)
        elif not config.full_finetuning and config.learning_rate > NAN_LR_FACTOR * _peak_lr(config):
            if rng.random() < 0.5:
                step = rng.randint(1, max(1, config.steps // 3))
                self._failure = (step, f"NaN or inf loss (nan) at step {step}", FailureKind.NAN)
        self._stop_step: int | None = None
        self._evaluate = True
        self._killed: tuple[float, str] | None = None  # (when, phase)
        self._emitted = 0

    # ------------------------------------------------------------------ the timeline
    def _step_end(self, step: int) -> float:
        evals = step // self._config.eval_every if self._config and self._config.eval_every else 0
        return self._started + self._setup + step * self._step + evals * self._inround_eval

    def _last_step(self) -> int:
        if self._failure is not None:
            return self._failure[0]
        if self._hang_step is not None:
            return self._hang_step
        return self._planned if self._stop_step is None else self._stop_step

    def _train_end(self) -> float:
        if self._hang_step is not None:
            return math.inf
        return self._step_end(self._last_step())  # a round failing in setup ends at _step_end(0)

    def _save_end(self) -> float:
        return self._train_end() + (0.0 if self._failure else self._save)

    def _end(self) -> float:
        evaluated = self._evaluate and self._failure is None
        return self._save_end() + (self._eval if evaluated else 0.0)

    def _now(self) -> float:
        return self._killed[0] if self._killed else self._clock.now()

    # ------------------------------------------------------------------ RoundHandle
    def progress(self) -> list[dict]:
        lines, now, last = [], self._now(), self._last_step()
        while self._emitted < last and self._step_end(self._emitted + 1) <= now:
            self._emitted += 1
            lines.append(self._line(self._emitted))
        return lines

    def phase(self) -> Phase:
        now = self._now()
        if self._killed or now >= self._end():
            return Phase.DONE
        return Phase.TRAINING if now < self._save_end() else Phase.EVALUATING

    def done(self) -> bool:
        return self.phase() == Phase.DONE

    def request_stop(self, *, evaluate: bool = True) -> None:
        if self._hang_step is not None or self.phase() != Phase.TRAINING:
            return
        self._evaluate = self._evaluate and evaluate
        if self._stop_step is None:
            # The trainer checks STOP after each step: the step running when it appeared is the last.
            now, step = self._clock.now(), 1
            while step < self._planned and self._step_end(step) < now:
                step += 1
            self._stop_step = step

    def kill(self) -> None:
        if self._killed is None and not self.done():
            self._killed = (self._clock.now(), self.phase())

    def outcome(self) -> RoundOutcome:
        if not self.done():
            raise RuntimeError("outcome() before done()")
        steps = self._last_step()
        timings = {"setup": self._setup, "train": self._train_end() - self._started - self._setup, "save": self._save}
        if self._config is None:
            timings = {"build": self._build} if self._build else {}
        if self._killed:
            when, phase = self._killed
            if phase != Phase.EVALUATING:  # the trainer's status died with it
                return _failed(f"killed while {phase}", min(steps, self._emitted), {})
            return _failed(f"killed while {phase}", steps, {**timings, "eval_at_least": when - self._save_end()})
        if self._failure:
            _, reason, kind = self._failure
            return _failed(reason, steps, {}, kind)
        state = RoundState.COMPLETED if steps == self._planned else RoundState.STOPPED
        accuracy, total_steps = self._true_accuracy(steps), self._start_point[1] + steps
        clean = self._clean_format()
        if self._config is not None:
            self._backend.remember(self._merged, accuracy, total_steps, clean)
        if not self._evaluate:
            return RoundOutcome(state, None, None, None, None, None, steps, timings, self._merged)
        timings["eval"] = self._eval
        right = self._backend.answers(accuracy, self._rng)
        ood = 100.0 * sum(right) / len(right)
        golds = [3] * len(right)  # the simulated rows' counts; only right and wrong matter
        return RoundOutcome(
            state=state,
            reason=None,
            ood_accuracy=ood,
            val_accuracy=_clip(ood + 8.0 + self._rng.gauss(0.0, 1.0)),
            format_rate=97.0 if clean else 78.0,
            mean_completion_tokens=12.0 if clean else 95.0,
            steps_done=steps,
            timings=timings,
            merged_dir=self._merged,
            ood_rows={"index": list(range(len(right))), "gold": golds, "answer": [3 if r else None for r in right]},
        )

    # ------------------------------------------------------------------ helpers
    def _true_accuracy(self, step: int) -> float:
        start, steps_before, _ = self._start_point
        if self._config is None:
            return start
        return true_accuracy(self._config, step, start=start, steps_before=steps_before)

    def _clean_format(self) -> bool:
        if self._config is None:
            return self._start_point[2]
        w = self._config.reward_weights
        return (w.get("answer_format", 0) > 0 or w.get("brevity", 0) > 0) and not w.get("think_format", 0) > 0

    def _line(self, step: int) -> dict:
        acc = self._true_accuracy(step) / 100
        fmt = 0.95 if self._clean_format() else 0.6
        rewards = {name: (acc if name == "accuracy" else fmt) for name in self._config.reward_weights}
        line = {
            "step": step,
            "seconds": round(self._step_end(step) - self._started, 3),
            "rewards": rewards,
            "reward": sum(w * rewards[name] for name, w in self._config.reward_weights.items()),
            "reward_std": 0.3,
            "kl": 0.01 * step / self._planned if self._config.beta else 0.0,
            "completion_length": self._config.max_completion_length * (0.2 if self._clean_format() else 0.7),
            "format_rate": fmt,
            "learning_rate": self._config.learning_rate,
        }
        if self._config.eval_every and step % self._config.eval_every == 0:
            # The in-round subset is small (eval_rows): its score is noisy.
            line["ood_accuracy"] = _clip(self._true_accuracy(step) + self._rng.gauss(0.0, 3.0))
        return line


def _true_parts(config: TrialConfig | None, settings, gpus: int = 1) -> dict[str, float]:
    eval_rows = (settings.ood_rows or OOD_ROWS) + settings.val_rows
    evaluation = TRUE_EVAL_LOAD_S + eval_rows * TRUE_EVAL_ROW_S  # one process scores ood and val
    if config is None:  # scoring only
        return {"setup": 0.0, "step": 0.0, "inround_eval": 0.0, "save": 0.0, "eval": evaluation}
    batch = config.prompts_per_step * config.num_generations * config.generation_steps
    decode = TRUE_DECODE_FULL_S if config.full_finetuning else TRUE_DECODE_LORA_S
    length = TRUE_COMPLETION_SHARE * config.max_completion_length
    step = (length / config.generation_steps) * decode * (1 + TRUE_BATCH_EFFECT * batch)
    step += config.prompts_per_step * config.num_generations * length * TRUE_TOKEN_S
    step /= 1 + MULTI_GPU_EFFICIENCY * (gpus - 1)
    return {
        "setup": TRUE_SETUP_S,
        "step": step,
        "inround_eval": config.eval_rows * TRUE_INROUND_ROW_S,
        "save": TRUE_SAVE_S,
        "eval": evaluation,
    }


def _architecture():
    from synthetic.models import build_config  # late: it imports transformers

    return build_config("2b")


def _peak_lr(config: TrialConfig) -> float:
    return PEAK_LR["full" if config.full_finetuning else "lora"]


def _failed(reason: str, steps: int, timings: dict, kind: FailureKind = FailureKind.ERROR) -> RoundOutcome:
    return RoundOutcome(RoundState.FAILED, reason, None, None, None, None, steps, timings, failure=kind)


def _clip(value: float) -> float:
    return min(100.0, max(0.0, value))
