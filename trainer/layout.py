"""How one optimizer step's completions are spread over the processes (checked before any model is loaded).

TRL counts batches in completions, not prompts: an optimizer step sees `per_device_train_batch_size x processes x
gradient_accumulation_steps` completions, made of whole groups of `num_generations`. We keep one micro-batch per
step (no gradient accumulation), so `prompts_per_step x num_generations` completions must divide evenly over the
processes. A group may straddle processes: TRL gathers the rewards before computing the group advantages.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from trainer.config import ConfigError, TrialConfig


@dataclass(frozen=True)
class BatchLayout:
    per_device_train_batch_size: int  # completions per process per optimizer step
    steps_per_generation: int  # optimizer steps whose completions one generation call produces
    num_processes: int
    generation_prompts: int  # distinct prompts one generation call samples (all processes together)


def launched_processes() -> int:
    """The processes of this launch: `accelerate launch` and torchrun set WORLD_SIZE, plain python does not."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def batch_layout(config: TrialConfig, num_processes: int) -> BatchLayout:
    completions = config.prompts_per_step * config.num_generations
    if num_processes < 1 or completions % num_processes:
        raise ConfigError(
            "prompts_per_step",
            f"prompts_per_step x num_generations = {config.prompts_per_step} x {config.num_generations} = "
            f"{completions} completions per step do not divide over {num_processes} processes",
        )
    return BatchLayout(
        completions // num_processes,
        config.generation_steps,
        num_processes,
        config.prompts_per_step * config.generation_steps,
    )
