"""GRPO completions/s on a GPU: this project's round (trainer.run_round) against TRL's defaults, full fine-tuning and
LoRA, the same group size, side by side in one process (bench/gpu.py runs it).

The model is the random-weight Qwen2-VL-2B: with random weights every completion runs to the token cap, the worst
case. TRL's defaults: the same model, data, rewards, group size, prompts per step and completion cap, everything else
GRPOConfig's defaults (one generation per optimizer step, rollouts through the training model: float32 weights for
full fine-tuning, the unmerged peft model for LoRA; no compilation). Ours: the trainer as the search runs it
(`generation_steps` optimizer steps generated at once, from the bf16 rollout replica with a compiled decode step).
Both optimize the same loss on one prompt's group per optimizer step. Steady-state seconds per step are measured
between step ends after the first generation, so model loading, warm-up and compilation are left out (they are
reported: `timings.setup`, and the first generation's seconds).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoProcessor, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from synthetic.splits import write_split
from trainer.config import TrialConfig
from trainer.data import build_train_dataset
from trainer.round import _lora_config, run_round
from trainer.run_folder import read_progress
from trainer.rewards import build_reward_funcs


class StepClock(TrainerCallback):
    def __init__(self):
        self.ends: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.ends.append(time.perf_counter())


def peak_gb() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def steady_seconds_per_step(ends: list[float], skip: int) -> float:
    return (ends[-1] - ends[skip - 1]) / (len(ends) - skip)


def trl_defaults(config: TrialConfig, steps: int) -> dict:
    """TRL 1.16's GRPOTrainer with its defaults for everything this comparison does not fix."""
    funcs, weights = build_reward_funcs(config)
    clock = StepClock()
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        max_steps=steps,
        num_generations=config.num_generations,
        per_device_train_batch_size=config.num_generations,
        max_completion_length=config.max_completion_length,
        reward_weights=weights,
        model_init_kwargs={"dtype": "bfloat16" if torch.cuda.is_available() else "float32"},
        bf16=torch.cuda.is_available(),
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
    )
    processor = AutoProcessor.from_pretrained(config.model_path, padding_side="left")
    trainer = GRPOTrainer(
        model=config.model_path,
        reward_funcs=funcs,
        args=args,
        train_dataset=build_train_dataset(config),
        processing_class=processor,
        callbacks=[clock],
        peft_config=_lora_config(config),
    )
    reset_peak()
    trainer.train()
    seconds = steady_seconds_per_step(clock.ends, skip=1)
    result = {
        "steps": steps,
        "s_per_step": seconds,
        "completions_per_s": config.num_generations / seconds,
        "peak_gb": peak_gb(),
    }
    del trainer
    return result


def ours(config: TrialConfig) -> dict:
    reset_peak()
    result = run_round(config)
    lines = read_progress(config.output_dir)
    ends = [line["seconds"] for line in lines]
    seconds = steady_seconds_per_step(ends, skip=config.generation_steps)
    return {
        "first_generation_done_at_s": ends[config.generation_steps - 1],  # since the round began: setup + compile
        "state": result.state,
        "steps": result.steps_done,
        "s_per_step": seconds,
        "completions_per_s": config.prompts_per_step * config.num_generations / seconds,
        "peak_gb": peak_gb(),
        "timings": result.timings,
    }


# The trial settings of each mode; the project's options not named are the defaults the search runs with.
MODES = {
    "full": {"lora_rank": 0, "learning_rate": 1e-6},
    "lora": {"lora_rank": 64, "learning_rate": 1e-5},
    "lora_uncompiled": {"lora_rank": 64, "learning_rate": 1e-5, "compile_training": False},
}
# TRL's defaults take only the model and the adapter from a mode's settings.
TRL_MODES = ("full", "lora")


def measure(model: Path, work: Path, modes: list[str], steps: int, trl_steps: int, generation_steps: int,
            max_completion_length: int = 256, on_figure: Callable[[dict], None] | None = None,
            trl_modes: list[str] | None = None) -> dict:  # fmt: skip
    """Each mode's TRL-defaults round (for those of `modes` in `trl_modes`, default all of TRL_MODES), then ours;
    `on_figure(figures so far)` after each round, so a cut-short call keeps what it measured."""
    unknown = sorted(set(modes) - set(MODES)) + sorted(set(trl_modes or ()) - set(TRL_MODES))
    if unknown:
        raise ValueError(f"unknown mode {unknown[0]!r}; modes: {', '.join(MODES)}; TRL's: {', '.join(TRL_MODES)}")
    trl_modes = list(TRL_MODES) if trl_modes is None else trl_modes
    train = work / "train"
    if not train.exists():
        write_split(train, "train", 64, seed=0)
    figures: dict = {}
    for mode in modes:
        base = dict(
            model_path=str(model),
            train_path=str(train),
            reward_weights={"accuracy": 1.0, "answer_format": 0.5},
            num_generations=8,
            prompts_per_step=1,
            max_completion_length=max_completion_length,
            **MODES[mode],
        )
        figures[mode] = {}
        if mode in trl_modes:
            default = trl_defaults(TrialConfig(output_dir=str(work / f"trl-{mode}"), **base), trl_steps)
            print(mode, "trl defaults", default, flush=True)
            figures[mode]["trl_defaults"] = default
            if on_figure is not None:
                on_figure(figures)
        config = TrialConfig(output_dir=str(work / f"ours-{mode}"), steps=steps, generation_steps=generation_steps,
                             **base)  # fmt: skip
        project = ours(config)
        print(mode, "ours", project, flush=True)
        figures[mode]["ours"] = project
        if "trl_defaults" in figures[mode]:
            figures[mode]["speedup"] = project["completions_per_s"] / figures[mode]["trl_defaults"]["completions_per_s"]
        if on_figure is not None:
            on_figure(figures)
    speed = {mode: figures[mode]["ours"]["completions_per_s"] for mode in figures}
    if "full" in speed and "lora" in speed:
        figures["lora_vs_full"] = speed["lora"] / speed["full"]
    if "lora" in speed and "lora_uncompiled" in speed:
        figures["lora_compiled_speedup"] = speed["lora"] / speed["lora_uncompiled"]
    return figures
