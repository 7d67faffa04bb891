"""What a running round reports and obeys: the progress lines, stop requests, NaN guard, intermediate evaluation.

One `TrainerCallback`, hooked on `on_log` (transformers calls it after every optimizer step with `logging_steps=1`,
after `on_step_end`, on every process, with TRL's metrics already gathered over all processes):

- progress: the main process appends one JSON line per step to `output_dir/progress.jsonl` and flushes it, so the
  search can tail the file while the round runs;
- stop: a file named `STOP` in `output_dir`, or SIGTERM, ends the round after the current step. Each process
  checks on its own (a signal may reach one worker only), and accelerate's trigger (an all-reduce) makes every
  process see the request at the same step; a process that stopped alone would leave the others waiting in the
  next collective forever;
- NaN: a non-finite loss, gradient norm or reward stops the round as failed (the weights are already poisoned);
- intermediate evaluation: every `eval_every` steps the main process scores the current policy (a callable the
  round provides) while the others wait at a barrier; the result goes into that step's line.

TRL logs the rollout metrics (rewards, completion length) only on the step that generated them: with
`steps_per_generation > 1` the following steps train on slices of the same batch and log none. Their lines carry
the batch's values forward, so every line has every field.
"""

from __future__ import annotations

import json
import math
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from evaluator.protocol import extract_answer
from trainer.rewards import completion_text
from trainer.run_folder import PROGRESS_FILE, STOP_FILE

FORMAT_RATE = "format_rate"

# TRL 1.16 metric names that describe a generation batch (logged only on the step that generated it).
_ROLLOUT_KEYS = (
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "completions/mean_length",
    "completions/clipped_ratio",
)
# Checked every step; any non-finite value fails the round.
_GUARDED_KEYS = ("loss", "grad_norm", "reward")


def format_rate(completions: list, **kwargs: Any) -> list[float]:
    """1.0 when the verifier's extraction finds an answer in the completion, else 0.0.

    A diagnostic, not an incentive: the round adds it with weight 0, so it leaves the advantages unchanged and TRL
    logs its mean like any reward (`rewards/format_rate/mean`). One side effect of a weight-0 function that always
    returns a number: TRL's "unscorable" rule (every reward None -> advantage 0) can no longer fire, so a completion
    that every weighted reward calls not-applicable counts as reward 0 (only possible when `reasoning_agreement` is
    the only weighted reward).
    """
    return [float(extract_answer(completion_text(completion)) is not None) for completion in completions]


class StopRequest:
    """A stop asked from outside: SIGTERM (flag set by the handler) or the STOP file."""

    def __init__(self, output_dir: str | Path):
        self.path = Path(output_dir) / STOP_FILE
        self.signalled = False
        self._previous: Any = None

    def install(self) -> None:
        """Catch SIGTERM (only possible on the main thread; elsewhere the STOP file is the only way)."""
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signalled = True  # only a flag: the step in flight finishes, then the callback stops the round

    def reason(self) -> str | None:
        if self.signalled:
            return "SIGTERM"
        if self.path.exists():
            return "STOP file"
        return None


class ProgressCallback(TrainerCallback):
    """See the module docstring. `bind(accelerator)` once the trainer exists (the trigger all-reduce needs it)."""

    def __init__(
        self,
        output_dir: str | Path,
        reward_names: list[str],
        start_time: float,
        stop: StopRequest,
        evaluate: Callable[[], dict[str, float]] | None = None,
        eval_every: int = 0,
    ):
        self.path = Path(output_dir) / PROGRESS_FILE
        self.reward_names = list(reward_names)
        self.start_time = start_time
        self.stop = stop
        self.evaluate = evaluate
        self.eval_every = eval_every
        self.accelerator: Any = None
        self._rollout: dict[str, Any] = {}  # the latest generation batch's metrics, carried to later steps
        self.steps_done = 0
        self.stop_reason: str | None = None  # set when a stop request ended the round
        self.failure: str | None = None  # set when a NaN ended the round

    def bind(self, accelerator: Any) -> "ProgressCallback":
        self.accelerator = accelerator
        return self

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "loss" not in logs:  # the end-of-training summary (train_runtime, ...), not a step
            return control
        step = state.global_step
        self.steps_done = step
        for key, value in logs.items():
            if key in _ROLLOUT_KEYS or key.startswith("rewards/"):
                self._rollout[key] = value
        failure = _non_finite(logs, step)
        local_stop = self.stop.reason()
        if failure or local_stop:
            self.accelerator.set_trigger()
        stopping = self.accelerator.check_trigger()  # all processes call it at every step: one all-reduce
        line = self._line(step, logs)
        if not stopping and self.evaluate is not None and self.eval_every > 0 and step % self.eval_every == 0:
            line.update(self._evaluate())
        if self.accelerator.is_main_process:
            with self.path.open("a") as handle:
                handle.write(json.dumps(line) + "\n")
                handle.flush()
        if failure:
            self.failure = failure
            control.should_training_stop = True
        elif stopping:
            self.stop_reason = local_stop or "stop requested on another process"
            control.should_training_stop = True
        return control

    def _evaluate(self) -> dict[str, float]:
        result: dict[str, float] = {}
        if self.accelerator.is_main_process:
            started = time.monotonic()
            result = dict(self.evaluate())
            result["eval_seconds"] = round(time.monotonic() - started, 3)
        self.accelerator.wait_for_everyone()
        return result

    def _line(self, step: int, logs: dict[str, Any]) -> dict[str, Any]:
        rollout = self._rollout
        line = {
            "step": step,
            "seconds": round(time.monotonic() - self.start_time, 3),
            "rewards": {name: _finite(rollout.get(f"rewards/{name}/mean")) for name in self.reward_names},
            "reward": rollout.get("reward"),
            "reward_std": rollout.get("reward_std"),
            "kl": logs.get("kl"),  # TRL computes it only when beta > 0
            "completion_length": rollout.get("completions/mean_length"),
            "format_rate": rollout.get(f"rewards/{FORMAT_RATE}/mean"),
            "learning_rate": logs.get("learning_rate"),
            # Beyond the contract's fields: what a person reading a stalled round looks at first.
            "loss": logs.get("loss"),
            "grad_norm": logs.get("grad_norm"),
            "entropy": logs.get("entropy"),
            "clipped_ratio": rollout.get("completions/clipped_ratio"),
            "frac_reward_zero_std": rollout.get("frac_reward_zero_std"),
        }
        # Strict JSON has no NaN/Infinity; a non-finite value is written as null (status.json names it).
        return {key: _finite(value) if not isinstance(value, dict) else value for key, value in line.items()}


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _non_finite(logs: dict[str, Any], step: int) -> str | None:
    """"NaN ..." naming the first guarded metric that is not finite at this step, else None. A reward the step
    logged as None means every completion's reward was NaN."""
    for key in _GUARDED_KEYS:
        if key not in logs:
            continue
        value = logs[key]
        if value is None or (isinstance(value, (int, float)) and not math.isfinite(value)):
            return f"NaN or inf {key} ({value}) at step {step}"
    return None
