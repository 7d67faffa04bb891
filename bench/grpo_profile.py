"""Where a GRPO round's seconds go: this project's round (trainer.run_round) with a synchronized timer around each
phase of TRL's step, for a few variants of the round (bench/gpu.py's `profile` section runs it).

Phases (inclusive; a phase may contain another, e.g. `generate_and_score` holds `rollout`, `old_logps` and
`rewards`):

- generate_and_score: TRL's `_generate_and_score_completions`, once per generation batch;
- rollout: the replica's `generate` (trainer.rollout), including its weight sync (`sync`, also reported alone);
- logps_no_grad: log-probabilities without gradients (the old policy's, and the reference model's when beta > 0);
- rewards: the reward functions;
- loss_forward: `compute_loss` (the forward pass with gradients and the loss);
- backward: `accelerator.backward`;
- optimizer: the optimizer's step (with gradient clipping's norm, which the Trainer computes just before it, in
  `other`).

Each variant also reports `peak_gb` (the CUDA allocator's peak) and `settings`: how `liger_kernels` and
`gradient_checkpointing` resolved in the round, with trainer/memory.py's estimated peak for that choice.

`other` is the train seconds none of the phases cover (the dataloader, clipping, logging, the scheduler). Compilation
of the first rollout falls in `rollout` of the first generation, reported apart as `first_rollout_s`.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from trl import GRPOTrainer

from synthetic.splits import write_split
from trainer.config import TrialConfig
from trainer.rollout import ReplicaGRPOTrainer, RolloutReplica
from trainer.round import run_round
from trainer.run_folder import RoundState, read_progress

TOP_LEVEL = ("generate_and_score", "loss_forward", "backward", "optimizer")  # disjoint: they add up with `other`


class PhaseClock:
    """Cumulative seconds and calls per phase; every timing is bracketed by CUDA synchronizations."""

    def __init__(self):
        self.seconds: dict[str, list[float]] = defaultdict(list)

    def wrap(self, phase: str, function: Callable, when: Callable[[], bool] = lambda: True) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not when():
                return function(*args, **kwargs)
            _synchronize()
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                _synchronize()
                self.seconds[phase].append(time.perf_counter() - start)

        return timed


@contextmanager
def timed_phases(clock: PhaseClock) -> Iterator[None]:
    """Rebinds the phase methods on their classes for the duration (a benchmark's instrument, not the trainer's)."""
    targets = [
        (GRPOTrainer, "_generate_and_score_completions", "generate_and_score", None),
        (ReplicaGRPOTrainer, "_generate_single_turn", "rollout", None),
        (RolloutReplica, "sync_from", "sync", None),
        (GRPOTrainer, "_get_per_token_logps_and_entropies", "logps_no_grad", lambda: not torch.is_grad_enabled()),
        (GRPOTrainer, "_calculate_rewards", "rewards", None),
        (GRPOTrainer, "compute_loss", "loss_forward", None),
        (Accelerator, "backward", "backward", None),
        (AcceleratedOptimizer, "step", "optimizer", None),
    ]
    with ExitStack() as stack:
        for owner, name, phase, when in targets:
            original = owner.__dict__[name]
            stack.callback(setattr, owner, name, original)
            setattr(owner, name, clock.wrap(phase, original, when or (lambda: True)))
        yield


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profile_round(config: TrialConfig) -> dict[str, Any]:
    clock = PhaseClock()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    with timed_phases(clock):
        result = run_round(config)
    if result.state == RoundState.FAILED:
        return {"state": result.state, "reason": result.reason, "settings": result.settings}
    lines = read_progress(config.output_dir)
    first_rollout = clock.seconds["rollout"][0] if clock.seconds["rollout"] else 0.0
    # Steady state: every phase's seconds after the first generation batch (which compiles), per optimizer step.
    steps_after = len(lines) - config.generation_steps
    train_after = lines[-1]["seconds"] - lines[config.generation_steps - 1]["seconds"]
    per_step: dict[str, float] = {}
    for phase, seconds in clock.seconds.items():
        per_generation = phase in ("generate_and_score", "rollout", "sync", "rewards")
        skip = 1 if per_generation else 0
        kept = seconds[skip:]
        if phase == "logps_no_grad":  # one old-logps call per generation batch (two with a reference model)
            calls_per_generation = len(seconds) // max(1, len(clock.seconds["generate_and_score"]))
            kept = seconds[calls_per_generation:]
        elif not per_generation:
            kept = seconds[config.generation_steps:]
        per_step[phase] = sum(kept) / max(1, steps_after)
    per_step["other"] = train_after / max(1, steps_after) - sum(per_step.get(p, 0.0) for p in TOP_LEVEL)
    s_per_step = train_after / max(1, steps_after)
    return {
        "state": result.state,
        "steps": result.steps_done,
        "s_per_step": s_per_step,
        "completions_per_s": config.prompts_per_step * config.num_generations / s_per_step,
        "seconds_per_step": per_step,
        "share": {phase: seconds / s_per_step for phase, seconds in per_step.items()},
        "first_rollout_s": first_rollout,
        "peak_gb": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        "settings": result.settings,  # how liger and checkpointing resolved, and the estimated peak
    }


# The variants, full fine-tuning unless named lora_: the round as the search runs it (`as_run`: liger and gradient
# checkpointing as the configuration resolves them on this GPU), then one lever at a time against `checkpoint_all`
# (no liger, every layer checkpointed: the round as run before the levers), each lever's setting stated explicitly.
LORA = {"lora_rank": 64, "learning_rate": 1e-5}
VARIANTS: dict[str, dict[str, Any]] = {
    "as_run": {},
    "checkpoint_all": {"liger_kernels": False, "gradient_checkpointing": True},
    "liger": {"liger_kernels": True, "gradient_checkpointing": True},
    "no_checkpointing": {"liger_kernels": False, "gradient_checkpointing": False},
    "liger_no_checkpointing": {"liger_kernels": True, "gradient_checkpointing": False},
    "checkpoint_every_2": {"liger_kernels": False, "gradient_checkpointing": 2},
    "liger_checkpoint_every_2": {"liger_kernels": True, "gradient_checkpointing": 2},
    "compiled_layers": {"liger_kernels": False, "gradient_checkpointing": False, "compile_training": True},
    "generation_steps_16": {"generation_steps": 16},
    "lora_as_run": LORA,
    "lora_checkpoint_all": {**LORA, "liger_kernels": False, "gradient_checkpointing": True},
    "lora_no_checkpointing": {**LORA, "liger_kernels": False, "gradient_checkpointing": False},
    "lora_liger_no_checkpointing": {**LORA, "liger_kernels": True, "gradient_checkpointing": False},
}


def parse_variants(text: str) -> list[str]:
    """`--profile-variants`: comma-separated names of VARIANTS, in the order given, each once."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown profile variant {unknown[0]!r}; known: {', '.join(VARIANTS)}")
    if not names:
        raise ValueError("no profile variant given")
    return list(dict.fromkeys(names))


def variant_config(name: str, model: Path, train: Path, work: Path, steps: int, generation_steps: int,
                   max_completion_length: int = 256) -> TrialConfig:  # fmt: skip
    settings = {"lora_rank": 0, "learning_rate": 1e-6, "generation_steps": generation_steps, **VARIANTS[name]}
    return TrialConfig(
        model_path=str(model), train_path=str(train), output_dir=str(work / name),
        reward_weights={"accuracy": 1.0, "answer_format": 0.5}, num_generations=8, prompts_per_step=1,
        max_completion_length=max_completion_length, steps=max(steps, 2 * settings["generation_steps"]),
        **settings,
    )  # fmt: skip


def measure(model: Path, work: Path, variants: list[str], steps: int, generation_steps: int,
            max_completion_length: int = 256,
            on_variant: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:  # fmt: skip
    """Profile each variant in turn; `on_variant(figures so far)` after each, so a cut-short call keeps them."""
    train = work / "train"
    if not train.exists():
        write_split(train, "train", 64, seed=0)
    figures: dict[str, Any] = {}
    for name in variants:
        config = variant_config(name, model, train, work, steps, generation_steps, max_completion_length)
        try:
            figures[name] = profile_round(config)
        except Exception as exc:  # one variant's failure (a kernel that does not build) leaves the others measured
            figures[name] = {"state": "failed", "reason": f"{type(exc).__name__}: {exc}"[:2000]}
        print(name, json.dumps(figures[name]), flush=True)
        if on_variant is not None:
            on_variant(figures)
    return figures
