"""Gradient checkpointing chosen by memory: the fewest checkpointed decoder layers whose estimated peak fits the card.

The estimate, in bytes on one GPU at the peak of a training step:

    weights (as held) + trainable x 12 (float32 gradient and AdamW's two states) + the rollout replica (bfloat16)
    + the reference model (bfloat16, full fine-tuning with beta > 0)
    + the larger of: a training pass's activations,
          tokens / micro_batches x hidden x (KEPT_BYTES x layers keeping their activations + CHECKPOINTED_BYTES x
          checkpointed layers),
      and what scoring a generation batch holds, LOGIT_BYTES x vocabulary x completion tokens (not split)
    + ACCUMULATION_BYTES x trainable, when a step is split into micro-batches and some decoder layer keeps its
      activations

with tokens = completions per process and step x (a bound on the prompt + max_completion_length): the prompt bound is
an image of `max_pixels` (one token per 28 x 28 pixels) plus PROMPT_TEXT_TOKENS. The two per-token coefficients are
fitted to the two peaks measured on an H200 for full fine-tuning of the 2B model (bench/grpo_profile.py in
bench/results/2026-12-03-h200.json: 31.1 GiB with every layer checkpointed, 41.1 GiB with none, 8 completions of
245 + 256 tokens); bench/results/2026-12-04-checkpointing-memory-model.md has the derivation and how well it predicts
the LoRA peaks. LOGIT_BYTES comes from a round of 32 completions that ran out of memory under a 48 GB cap in every
split it was given (bench/results/2026-12-07-fit-vs-measured.md). ACCUMULATION_BYTES comes from four rounds that ran
out of memory under a 48 GB cap (bench/results/2026-12-08-fit-vs-measured-accumulation.md): every 2nd layer
checkpointed in 2 or 4 micro-batches, where the same passes in one micro-batch, and every layer checkpointed in 2 or
4, ran within the estimate. A plan fits when its estimate is at most HEADROOM of the card's memory: the rest is for
the CUDA context, the allocator's cached blocks and the estimate's error.

What a round may change to fit (`plan`), in this order: checkpoint more decoder layers, then split the step's
completions into more micro-batches, at least enough that a pass holds at most MAX_PASS_TOKENS (TRL's gradient
accumulation: the same groups and the same optimizer step, each forward and backward on a share of the tokens). A
round whose every plan is over the card does not fit: the search never launches it (search/backends/fit.py predicts
the same plan before the launch).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trainer.config import TrialConfig
from trainer.policy import lora_target_pattern

# Bytes per token, per hidden unit, per decoder layer; fitted as the module docstring says.
KEPT_BYTES = 71.4
CHECKPOINTED_BYTES = 9.2
PROMPT_TEXT_TOKENS = 64  # the chat template and question around the image (58 for the synthetic prompts)
IMAGE_PIXELS_PER_TOKEN = 28 * 28  # Qwen2-VL: 14-pixel patches merged 2 x 2
# The most tokens a training pass may hold: twice the largest pass the per-token coefficients were fitted on. Past it
# the estimate runs low, so larger passes are split.
MAX_PASS_TOKENS = 8000
# Bytes per completion token per vocabulary entry held while a generation batch is scored (its logits for the old and
# reference log-probs, whichever micro-batches the training step is split into).
LOGIT_BYTES = 5.4
# Bytes per trainable parameter held on top of the rest when a step is split into micro-batches while some decoder
# layers keep their activations: at least 7.3 GB (4.7 per parameter, full fine-tuning of the 2B model) above the
# estimate in all four such rounds measured; the float32 gradients accumulated across the passes are 4.
ACCUMULATION_BYTES = 5.0
# Of the card, for the estimate: the rest is for the CUDA context, the allocator's cached blocks and the estimate's
# error.
HEADROOM = 0.85
GiB = 2**30


@dataclass(frozen=True)
class Footprint:
    """What one process holds and computes in a training step, for `peak_bytes`."""

    fixed_bytes: float  # weights, gradients, optimizer state, replica and reference model
    tokens: int  # sequence positions of one step's forward on this process (all its micro-batches together)
    hidden: int  # the language model's hidden size
    decoder_positions: tuple[int, ...]  # each decoder layer's index among the model's checkpointable layers
    completions: int = 1  # sequences of one step on this process: the micro-batches split them evenly
    generation_bytes: float = 0.0  # held while a generation batch is scored, before training: not split
    trainable: int = 0  # trained parameters (with LoRA, the adapters')


@dataclass(frozen=True)
class Plan:
    """How a round trains within its card: `micro_batches` forward/backward passes a step (gradient accumulation),
    every `checkpoint_every`-th checkpointable layer checkpointed (0: none), and the estimated peak of that."""

    micro_batches: int
    checkpoint_every: int
    peak_bytes: float | None  # None: no estimate (a CPU round)
    fits: bool  # the estimate is within HEADROOM of the card


def peak_bytes(footprint: Footprint, every: int, micro_batches: int = 1) -> float:
    """The estimated peak with every `every`-th checkpointable layer checkpointed (0: none), the step's tokens in
    `micro_batches` passes."""
    checkpointed = checkpointed_layers(footprint.decoder_positions, every)
    kept = len(footprint.decoder_positions) - checkpointed
    per_token = footprint.hidden * (KEPT_BYTES * kept + CHECKPOINTED_BYTES * checkpointed)
    accumulating = ACCUMULATION_BYTES * footprint.trainable if micro_batches > 1 and kept > 0 else 0.0
    return (footprint.fixed_bytes + max(footprint.generation_bytes, footprint.tokens / micro_batches * per_token)
            + accumulating)  # fmt: skip


def checkpointed_layers(decoder_positions: Sequence[int], every: int) -> int:
    """transformers' `every_n_layers` rule: the layer at index i among all checkpointable layers (the vision tower's
    blocks come first in Qwen2-VL) is checkpointed when i % every == 0."""
    if every <= 0:
        return 0
    return sum(1 for position in decoder_positions if position % every == 0)


def plan(footprint: Footprint, card_bytes: float, *, every: int | None = None) -> Plan:
    """The first plan whose estimated peak fits HEADROOM x `card_bytes`: the fewest micro-batches (divisors of the
    step's completions, each pass at most MAX_PASS_TOKENS) at which some checkpoint interval fits, with the fewest
    checkpointed decoder layers there; `every` given: that interval only. None fitting: the lowest estimate (every
    layer, or `every`, one completion a pass), marked as not fitting."""
    budget = HEADROOM * card_bytes
    layers = max(footprint.decoder_positions, default=0) + 1
    by_cost = sorted(range(layers + 1), key=lambda n: checkpointed_layers(footprint.decoder_positions, n))
    intervals = by_cost if every is None else [every]  # 0 first, then intervals by how many layers they checkpoint
    divisors = [n for n in range(1, footprint.completions + 1) if footprint.completions % n == 0]
    splits = [n for n in divisors if footprint.tokens / n <= MAX_PASS_TOKENS] or divisors[-1:]
    for micro in splits:
        for interval in intervals:
            peak = peak_bytes(footprint, interval, micro)
            if peak <= budget:
                return Plan(micro, interval, peak, True)
    lowest = 1 if every is None else every
    return Plan(splits[-1], lowest, peak_bytes(footprint, lowest, splits[-1]), False)


def fixed_interval(config: TrialConfig) -> int | None:
    """The checkpoint interval a round's plan must keep: `gradient_checkpointing` as configured (true: 1, false: 0),
    every layer when the vision tower trains (the estimate leaves its activations out); None: the plan chooses."""
    if config.gradient_checkpointing is not None:
        return int(config.gradient_checkpointing)
    return 1 if config.train_vision_tower else None


def round_footprint(config: TrialConfig, model: torch.nn.Module, per_device_completions: int) -> Footprint:
    """`footprint` of a round of `config` on `model` as loaded (trainer.policy)."""
    return footprint(
        model,
        lora_targets=lora_target_pattern(config),
        lora_rank=config.lora_rank,
        per_device_completions=per_device_completions,
        max_pixels=config.max_pixels,
        max_completion_length=config.max_completion_length,
        reference_model=config.full_finetuning and config.beta > 0,
    )


def footprint(model: torch.nn.Module, *, lora_targets: str | None, lora_rank: int, per_device_completions: int,
              max_pixels: int, max_completion_length: int, reference_model: bool) -> Footprint:  # fmt: skip
    """The footprint of a Qwen2-VL policy as loaded (frozen parts already frozen; LoRA not yet applied: its adapters
    are counted from `lora_targets`, the regex peft matches module names against), trained on
    `per_device_completions` sequences a step, with a bfloat16 rollout replica."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    parameters = list(model.parameters())
    total = sum(p.numel() for p in parameters)
    weights = sum(p.numel() * p.element_size() for p in parameters)
    if lora_targets is None:
        trainable = sum(p.numel() for p in parameters if p.requires_grad)
    else:
        trainable = sum(
            lora_rank * (module.in_features + module.out_features)
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and re.fullmatch(lora_targets, name)
        )
        weights += 4 * trainable  # peft keeps the adapters in float32
    text = model.model.language_model
    decoder = {id(layer) for layer in text.layers}
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    prompt = math.ceil(max_pixels / IMAGE_PIXELS_PER_TOKEN) + PROMPT_TEXT_TOKENS
    return Footprint(
        fixed_bytes=weights + 12 * trainable + 2 * total + (2 * total if reference_model else 0),
        tokens=per_device_completions * (prompt + max_completion_length),
        hidden=text.config.hidden_size,
        decoder_positions=tuple(i for i, layer in enumerate(layers) if id(layer) in decoder),
        completions=per_device_completions,
        generation_bytes=LOGIT_BYTES * text.config.vocab_size * max_completion_length * per_device_completions,
        trainable=trainable,
    )
