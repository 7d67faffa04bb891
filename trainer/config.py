"""The trial configuration: everything one GRPO round needs, written as JSON by the search, read by the trainer.

Each option is documented where it is declared (`metadata["help"]`), as TRL's configs do. `validate()` runs on
construction and names the offending field, so a bad configuration fails before any model is loaded.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import validation
from common.validation import InvalidValue, show

PHRASINGS = ("eval", "inherited", "mix")
LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo")
SCALE_REWARDS = ("group", "batch", "none")
LR_SCHEDULES = ("constant", "linear", "cosine")
# The language model's attention and MLP projections in Qwen2-VL.
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Qwen2-VL's image sides are multiples of 28 (patch 14, merge 2): 4 and 16384 merged patches bound the pixels.
MIN_PIXELS = 4 * 28 * 28
MAX_PIXELS = 16384 * 28 * 28
GPU_MEMORY_GB_MAX = 10_000.0  # far above any card
MAX_CHECKPOINT_INTERVAL = 1024  # an interval past the layer count checkpoints only the first layer


class ConfigError(InvalidValue):
    """A configuration value of the wrong type or out of range; `key` is the field's name."""


def _help(text: str, default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field documented where it is declared."""
    return field(default=default, default_factory=default_factory, metadata={"help": text})


@dataclass
class TrialConfig:
    # --- paths ---
    model_path: str = _help("Folder of the base Qwen2-VL model (`save_pretrained` output) every round starts from.")
    train_path: str = _help("Train split folder (`save_to_disk` or parquet/arrow files). The only split trained on.")
    output_dir: str = _help("The round's folder: progress.jsonl, status.json, merged/ are written here.")
    ood_path: str | None = _help(
        "OOD validation split, read only for the intermediate evaluation subset; never trained on.", None
    )
    train_rows: int | None = _help("Use a seeded subset of this many train rows (None: all of them).", None)

    # --- rewards ---
    reward_weights: dict[str, float] = _help(
        "Reward name (see trainer.rewards.REWARDS) -> weight >= 0. Zero weights are allowed; the sum must be > 0.",
        default_factory=lambda: {"accuracy": 1.0, "answer_format": 0.5},
    )

    # --- GRPO ---
    steps: int = _help("Optimizer steps of the round (GRPOConfig.max_steps).", 100)
    learning_rate: float = _help("Peak learning rate. LoRA wants ~10x the full fine-tuning rate.", 1e-5)
    lr_schedule: str = _help(f"Learning-rate schedule, one of {LR_SCHEDULES}.", "constant")
    warmup_ratio: float = _help("Share of the steps spent warming the learning rate up, in [0, 0.5].", 0.0)
    beta: float = _help("KL coefficient against the base model; 0 drops the reference model.", 0.0)
    num_generations: int = _help("Completions sampled per prompt (the GRPO group size), >= 2.", 8)
    prompts_per_step: int = _help("Distinct prompts per optimizer step, over all processes.", 1)
    generation_steps: int = _help(
        "Optimizer steps whose completions are generated in one batch (GRPOConfig.steps_per_generation). "
        "Larger is faster; later steps of a batch are slightly off-policy (importance-weighted by TRL).",
        4,
    )
    temperature: float = _help("Sampling temperature of the rollouts, in (0, 2].", 1.0)
    loss_type: str = _help(f"TRL loss aggregation, one of {LOSS_TYPES}.", "dapo")
    epsilon: float = _help("Lower clip range of the policy ratio, in (0, 1).", 0.2)
    epsilon_high: float | None = _help("Upper clip range (DAPO clip-higher); None means equal to epsilon.", None)
    scale_rewards: str = _help(f"Advantage normalization, one of {SCALE_REWARDS}.", "group")
    max_completion_length: int = _help("Tokens a rollout may generate, in [8, 2048].", 256)
    max_pixels: int = _help(f"Largest image area in pixels fed to the model, in [{MIN_PIXELS}, {MAX_PIXELS}].", 401408)
    phrasing: str = _help(
        f"Training prompt phrasing, one of {PHRASINGS}: the verifier's, the inherited one, or each row picked "
        "at random (seeded) between the two.",
        "eval",
    )
    gradient_checkpointing: bool | int | None = _help(
        "Recompute activations in the backward pass to save memory: true on every decoder layer, false on none, an "
        "integer n on every n-th layer only (transformers' `every_n_layers`, counted over the vision blocks and the "
        "decoder layers; 1 is true). None: on CUDA the fewest checkpointed layers whose estimated peak fits the card "
        "(trainer/memory.py; every layer when the vision tower trains, whose activations it leaves out), none on CPU. "
        "Fewer checkpointed layers: a faster step, a higher peak (docs/MEASUREMENTS.md).",
        None,
    )
    gpu_memory_gb: float | None = _help(
        "GPU memory the round may use, in GB (10^9 bytes): the card is capped to it "
        "(torch.cuda.set_per_process_memory_fraction) and the memory plan fits within it, so that a larger card "
        "rehearses a smaller one. None: the whole card.",
        None,
    )
    liger_kernels: bool = _help(
        "Run the policy's RMSNorm, SwiGLU MLP (and the vision tower's LayerNorm) as liger-kernel's Triton kernels "
        "(the `gpu` extra: pip install '.[gpu]'); the loss stays TRL's. A round without them (no CUDA, no package) "
        "fails at set-up. Off by default: they lower the peak but slow the step (docs/MEASUREMENTS.md).",
        False,
    )
    compile_training: bool = _help(
        "Compile the policy's decoder layers for the training forward and backward (torch.compile per layer, in place, "
        "dynamic shapes; with LoRA, the adapted layers as peft builds them). GPU only; ignored on a CPU, where it is "
        "not measured. The first steps of a round compile.",
        True,
    )
    compile_rollouts: bool = _help(
        "Sample rollouts with a static KV cache and a compiled decode step (GPU only; ignored on CPU). The first "
        "generation of a round compiles (about a minute; later rounds reuse inductor's on-disk cache).",
        True,
    )
    batched_vision_attention: bool = _help(
        "The vision tower attends to all the images of a forward in one call (evaluator.vision_attention) instead "
        "of once per image and layer, in the rollout replica and in the trained policy. Off by default: the tower is "
        "a small part of a step, so little is to be gained end to end for another kernel's arithmetic.",
        False,
    )

    # --- LoRA ---
    lora_rank: int = _help("LoRA rank on the language model's projections; 0 means full fine-tuning.", 64)
    lora_alpha: float | None = _help("LoRA alpha; None means 2 x rank.", None)
    lora_dropout: float = _help("LoRA dropout, in [0, 1).", 0.0)
    lora_targets: list[str] = _help(
        "Module names LoRA adapts (the language model's attention and MLP projections).",
        default_factory=lambda: list(DEFAULT_LORA_TARGETS),
    )
    train_vision_tower: bool = _help(
        "Train the vision tower and its merger too: all their weights under full fine-tuning, LoRA on their linear "
        "layers (attention qkv/proj, MLP fc1/fc2, merger MLP) otherwise. False: only the language model trains.",
        False,
    )

    # --- evaluation during the round ---
    eval_every: int = _help("Score the model on the OOD subset every this many steps; 0 turns it off.", 0)
    eval_rows: int = _help("Rows of the fixed, seeded OOD subset scored during the round.", 64)
    eval_seed: int = _help("Seed choosing the OOD subset (fixed across rounds, so their curves compare).", 0)

    seed: int = _help("Seed of sampling, data order and initialization.", 0)

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        for name in ("model_path", "train_path", "output_dir"):
            validation.text(name, getattr(self, name), error=ConfigError)
        if self.ood_path is not None:
            validation.text("ood_path", self.ood_path, error=ConfigError)
        _int_range("steps", self.steps, 1, 1_000_000)
        _num_range("learning_rate", self.learning_rate, 0.0, 1e-2, low_open=True)
        _choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        _num_range("warmup_ratio", self.warmup_ratio, 0.0, 0.5)
        _num_range("beta", self.beta, 0.0, 10.0)
        _int_range("num_generations", self.num_generations, 2, 256)
        _int_range("prompts_per_step", self.prompts_per_step, 1, 1024)
        _int_range("generation_steps", self.generation_steps, 1, 64)
        _num_range("temperature", self.temperature, 0.0, 2.0, low_open=True)
        _choice("loss_type", self.loss_type, LOSS_TYPES)
        _num_range("epsilon", self.epsilon, 0.0, 1.0, low_open=True, high_open=True)
        if self.epsilon_high is not None:
            _num_range("epsilon_high", self.epsilon_high, self.epsilon, 1.0, high_open=True)
        _choice("scale_rewards", self.scale_rewards, SCALE_REWARDS)
        _int_range("max_completion_length", self.max_completion_length, 8, 2048)
        _int_range("max_pixels", self.max_pixels, MIN_PIXELS, MAX_PIXELS)
        _choice("phrasing", self.phrasing, PHRASINGS)
        validation.boolean("compile_rollouts", self.compile_rollouts, error=ConfigError)
        validation.boolean("compile_training", self.compile_training, error=ConfigError)
        validation.boolean("train_vision_tower", self.train_vision_tower, error=ConfigError)
        checkpointing = self.gradient_checkpointing
        if checkpointing is not None and not isinstance(checkpointing, bool):
            if not isinstance(checkpointing, int) or not 1 <= checkpointing <= MAX_CHECKPOINT_INTERVAL:
                raise ConfigError(
                    "gradient_checkpointing",
                    f"must be true, false, null or a layer interval in [1, {MAX_CHECKPOINT_INTERVAL}], "
                    f"got {show(checkpointing)}",
                )
        if self.gpu_memory_gb is not None:
            _num_range("gpu_memory_gb", self.gpu_memory_gb, 0.0, GPU_MEMORY_GB_MAX, low_open=True)
        validation.boolean("liger_kernels", self.liger_kernels, error=ConfigError)
        validation.boolean("batched_vision_attention", self.batched_vision_attention, error=ConfigError)
        _int_range("lora_rank", self.lora_rank, 0, 1024)
        if self.lora_alpha is not None:
            _num_range("lora_alpha", self.lora_alpha, 0.0, 1e6, low_open=True)
        _num_range("lora_dropout", self.lora_dropout, 0.0, 1.0, high_open=True)
        targets = self.lora_targets
        # A string is refused although it iterates: "q_proj" would be the targets q, _, p, r, o, j.
        if not isinstance(targets, list) or not targets or not all(isinstance(t, str) and t for t in targets):
            raise ConfigError("lora_targets", f"must be a non-empty list of module names, got {show(targets)}")
        _int_range("eval_every", self.eval_every, 0, 1_000_000)
        _int_range("eval_rows", self.eval_rows, 1, 1_000_000)
        if self.eval_every > 0 and not self.ood_path:
            raise ConfigError("ood_path", "is needed when eval_every > 0")
        if self.train_rows is not None:
            _int_range("train_rows", self.train_rows, 1, 100_000_000)
        _int_range("seed", self.seed, 0, 2**32 - 1)
        _int_range("eval_seed", self.eval_seed, 0, 2**32 - 1)
        self._validate_rewards()

    def _validate_rewards(self) -> None:
        from trainer.rewards import REWARDS  # late: rewards import the evaluator's protocol, not this module

        weights = self.reward_weights
        if not isinstance(weights, dict) or not weights:
            raise ConfigError("reward_weights", f"must map at least one reward name to a weight, got {show(weights)}")
        for name, weight in weights.items():
            if name not in REWARDS:
                raise ConfigError("reward_weights", f"unknown reward {show(name)}; known: {sorted(REWARDS)}")
            _num_range(f"reward_weights.{name}", weight, 0.0, 1e3)
        if sum(weights.values()) <= 0:
            raise ConfigError("reward_weights", "at least one weight must be > 0")

    # ------------------------------------------------------------------ derived
    @property
    def full_finetuning(self) -> bool:
        return self.lora_rank == 0

    @property
    def effective_lora_alpha(self) -> float:
        return self.lora_alpha if self.lora_alpha is not None else 2.0 * self.lora_rank

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrialConfig":
        if not isinstance(data, dict):
            raise ConfigError("config", f"must be a JSON object, got {type(data).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = validation.unknown_keys(data, known)
        if unknown:
            name = unknown[0]
            raise ConfigError(validation.show_key(name), f"unknown option{validation.did_you_mean(name, known)}")
        required = [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        missing = [name for name in required if name not in data]
        if missing:
            raise ConfigError(missing[0], "is required")
        return cls(**data)

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def from_json(cls, path: str | Path) -> "TrialConfig":
        try:
            data = json.loads(Path(path).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError("config", f"{path} is not valid JSON: {exc}") from exc
        return cls.from_dict(data)

    def replace(self, **changes: Any) -> "TrialConfig":
        return dataclasses.replace(self, **changes)


def _int_range(name: str, value: Any, low: int, high: int) -> None:
    validation.integer(name, value, low=low, high=high, error=ConfigError)


def _num_range(
    name: str, value: Any, low: float, high: float, low_open: bool = False, high_open: bool = False
) -> None:
    validation.number(name, value, low=low, high=high, low_open=low_open, high_open=high_open, error=ConfigError)


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    validation.one_of(name, value, choices, error=ConfigError)
