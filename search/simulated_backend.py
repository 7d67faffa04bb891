"""Rounds that cost virtual time and score on a synthetic landscape: `run_search.py --simulate` and the tests.

A simulated round is a timeline fixed at `start` and read against the clock: setup, steps (with the in-round OOD
subset scored every `eval_every` steps), save, evaluation. Its durations come from a hidden cost function of the
configuration that is not the DurationModel's prior (other coefficients, a batch-size effect the model lacks,
per-round noise), so the model has something to learn. Its accuracies come from a landscape built from the brief's
evidence: paying the verifier's answer and a clean format, a small KL, a learning rate near the sweet spot of LoRA
or full fine-tuning (LoRA ~10x higher), short completions, no forced chain-of-thought; the inherited R1-V-like
recipe lands clearly lower. Some rounds fail: a seeded few at random, LoRA rates far above the sweet spot with a
NaN loss, and a seeded few hang (no more progress, no exit, deaf to STOP) until the scheduler kills them.
Nothing is written to disk: `merged_dir` names a folder that does not exist, so a simulated search passes a
recording `promote` to the Scheduler.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

from search.backend import DONE, EVALUATING, TRAINING, RoundOutcome
from search.clock import Clock
from trainer.config import TrialConfig

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


class SimulatedBackend:
    def __init__(
        self,
        settings,
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

    def start(self, config: TrialConfig, gpus: list[int]) -> "SimulatedRound":
        return SimulatedRound(self, config, random.Random(self._rng.getrandbits(64)))


def true_duration(config: TrialConfig, settings) -> float:
    """The noise-free seconds of a completed, evaluated round (what the DurationModel should learn)."""
    parts = _true_parts(config, settings)
    evals = config.steps // config.eval_every if config.eval_every else 0
    return parts["setup"] + config.steps * parts["step"] + evals * parts["inround_eval"] + parts["save"] + parts["eval"]


def true_accuracy(config: TrialConfig, step: int) -> float:
    """The noise-free OOD accuracy (percent) after `step` steps of `config`."""
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
    learned = (1 - math.exp(-step / tau)) * math.exp(-max(0, step - 400) / 1500)  # later checkpoints decay
    return min(100.0, BASE_OOD + MAX_GAIN * min(1.0, reward) * beta * length * group * lr * learned)


class SimulatedRound:
    def __init__(self, backend: SimulatedBackend, config: TrialConfig, rng: random.Random):
        self._clock = backend.clock
        self._config = config
        self._rng = rng
        self._started = self._clock.now()
        parts = _true_parts(config, backend.settings)
        noise = lambda sigma: math.exp(rng.gauss(0.0, sigma))  # noqa: E731 - per-part lognormal noise
        self._setup = parts["setup"] * noise(0.05)
        self._step = parts["step"] * noise(0.05)
        self._inround_eval = parts["inround_eval"] * noise(0.05)
        self._save = parts["save"] * noise(0.05)
        self._eval = parts["eval"] * noise(0.03)
        self._planned = config.steps
        self._failure: tuple[int, str] | None = None  # (steps done, reason)
        self._hang_step: int | None = None  # the last step a hung round completes
        draw = rng.random()
        if draw < backend.failure_rate:
            self._failure = (0, "simulated failure: CUDA error: an illegal memory access was encountered")
        elif draw < backend.failure_rate + backend.hang_rate:
            self._hang_step = rng.randint(0, config.steps - 1)
        elif not config.full_finetuning and config.learning_rate > NAN_LR_FACTOR * _peak_lr(config):
            if rng.random() < 0.5:
                step = rng.randint(1, max(1, config.steps // 3))
                self._failure = (step, f"NaN or inf loss (nan) at step {step}")
        self._stop_step: int | None = None
        self._evaluate = True
        self._killed: tuple[float, str] | None = None  # (when, phase)
        self._emitted = 0

    # ------------------------------------------------------------------ the timeline
    def _step_end(self, step: int) -> float:
        evals = step // self._config.eval_every if self._config.eval_every else 0
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

    def phase(self) -> str:
        now = self._now()
        if self._killed or now >= self._end():
            return DONE
        return TRAINING if now < self._save_end() else EVALUATING

    def done(self) -> bool:
        return self.phase() == DONE

    def request_stop(self, *, evaluate: bool = True) -> None:
        if self._hang_step is not None or self.phase() != TRAINING:
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
        merged = str(Path(self._config.output_dir) / "merged")
        timings = {"setup": self._setup, "train": self._train_end() - self._started - self._setup, "save": self._save}
        if self._killed:
            when, phase = self._killed
            if phase != EVALUATING:  # the trainer's status died with it
                return _failed(f"killed while {phase}", min(steps, self._emitted), {})
            return _failed(f"killed while {phase}", steps, {**timings, "eval_at_least": when - self._save_end()})
        if self._failure:
            return _failed(self._failure[1], steps, {})
        state = "completed" if steps == self._planned else "stopped"
        if not self._evaluate:
            return RoundOutcome(state, None, None, None, None, None, steps, timings, merged)
        timings["eval"] = self._eval
        ood = _clip(true_accuracy(self._config, steps) + self._rng.gauss(0.0, 1.0))
        clean = self._clean_format()
        return RoundOutcome(
            state=state,
            reason=None,
            ood_accuracy=ood,
            val_accuracy=_clip(ood + 8.0 + self._rng.gauss(0.0, 1.0)),
            format_rate=97.0 if clean else 78.0,
            mean_completion_tokens=12.0 if clean else 95.0,
            steps_done=steps,
            timings=timings,
            merged_dir=merged,
        )

    # ------------------------------------------------------------------ helpers
    def _clean_format(self) -> bool:
        w = self._config.reward_weights
        return (w.get("answer_format", 0) > 0 or w.get("brevity", 0) > 0) and not w.get("think_format", 0) > 0

    def _line(self, step: int) -> dict:
        acc = true_accuracy(self._config, step) / 100
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
            line["ood_accuracy"] = _clip(true_accuracy(self._config, step) + self._rng.gauss(0.0, 3.0))
        return line


def _true_parts(config: TrialConfig, settings) -> dict[str, float]:
    batch = config.prompts_per_step * config.num_generations * config.generation_steps
    decode = TRUE_DECODE_FULL_S if config.full_finetuning else TRUE_DECODE_LORA_S
    length = TRUE_COMPLETION_SHARE * config.max_completion_length
    step = (length / config.generation_steps) * decode * (1 + TRUE_BATCH_EFFECT * batch)
    step += config.prompts_per_step * config.num_generations * length * TRUE_TOKEN_S
    eval_rows = (settings.ood_rows or OOD_ROWS) + settings.val_rows
    return {
        "setup": TRUE_SETUP_S,
        "step": step,
        "inround_eval": config.eval_rows * TRUE_INROUND_ROW_S,
        "save": TRUE_SAVE_S,
        "eval": (2 if settings.val_rows else 1) * TRUE_EVAL_LOAD_S + eval_rows * TRUE_EVAL_ROW_S,
    }


def _peak_lr(config: TrialConfig) -> float:
    return PEAK_LR["full" if config.full_finetuning else "lora"]


def _failed(reason: str, steps: int, timings: dict) -> RoundOutcome:
    return RoundOutcome("failed", reason, None, None, None, None, steps, timings)


def _clip(value: float) -> float:
    return min(100.0, max(0.0, value))
