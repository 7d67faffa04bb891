"""Gradient checkpointing chosen by memory: the fewest checkpointed decoder layers whose estimated peak fits the card.

The estimate, in bytes on one GPU at the peak of a training step:

    weights (as held) + trainable x 12 (float32 gradient and AdamW's two states) + the rollout replica (bfloat16)
    + the reference model (bfloat16, full fine-tuning with beta > 0)
    + tokens x hidden x (KEPT_BYTES x layers that keep their activations + CHECKPOINTED_BYTES x checkpointed layers)

with tokens = completions per process and step x (a bound on the prompt + max_completion_length): the prompt bound is
an image of `max_pixels` (one token per 28 x 28 pixels) plus PROMPT_TEXT_TOKENS. The two per-token coefficients are
fitted to the two peaks measured on an H200 for full fine-tuning of the 2B model (bench/grpo_profile.py in
bench/results/2026-12-03-h200.json: 31.1 GiB with every layer checkpointed, 41.1 GiB with none, 8 completions of
245 + 256 tokens); bench/results/2026-12-04-checkpointing-memory-model.md has the derivation and how well it predicts
the LoRA peaks. A plan fits when its estimate is at most HEADROOM of the card's memory: the rest is for the CUDA
context, the allocator's cached blocks and the estimate's error.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Bytes per token, per hidden unit, per decoder layer; fitted as the module docstring says.
KEPT_BYTES = 71.4
CHECKPOINTED_BYTES = 9.2
PROMPT_TEXT_TOKENS = 64  # the chat template and question around the image (58 for the synthetic prompts)
IMAGE_PIXELS_PER_TOKEN = 28 * 28  # Qwen2-VL: 14-pixel patches merged 2 x 2
HEADROOM = 0.9
GiB = 2**30


@dataclass(frozen=True)
class Footprint:
    """What one process holds and computes in a training step, for `peak_bytes`."""

    fixed_bytes: float  # weights, gradients, optimizer state, replica and reference model
    tokens: int  # sequence positions of one step's forward on this process
    hidden: int  # the language model's hidden size
    decoder_positions: tuple[int, ...]  # each decoder layer's index among the model's checkpointable layers


def peak_bytes(footprint: Footprint, every: int) -> float:
    """The estimated peak with every `every`-th checkpointable layer checkpointed (0: none)."""
    checkpointed = checkpointed_layers(footprint.decoder_positions, every)
    kept = len(footprint.decoder_positions) - checkpointed
    per_token = footprint.hidden * (KEPT_BYTES * kept + CHECKPOINTED_BYTES * checkpointed)
    return footprint.fixed_bytes + footprint.tokens * per_token


def checkpointed_layers(decoder_positions: Sequence[int], every: int) -> int:
    """transformers' `every_n_layers` rule: the layer at index i among all checkpointable layers (the vision tower's
    blocks come first in Qwen2-VL) is checkpointed when i % every == 0."""
    if every <= 0:
        return 0
    return sum(1 for position in decoder_positions if position % every == 0)


def choose_interval(footprint: Footprint, card_bytes: float) -> int:
    """The checkpoint interval (0: no checkpointing) with the fewest checkpointed decoder layers whose estimated peak
    fits HEADROOM x `card_bytes`; every layer (1) when none fits."""
    budget = HEADROOM * card_bytes
    layers = max(footprint.decoder_positions, default=0) + 1
    candidates = sorted(range(layers + 1), key=lambda every: checkpointed_layers(footprint.decoder_positions, every))
    for every in candidates:  # 0 first, then intervals by how many layers they checkpoint
        if peak_bytes(footprint, every) <= budget:
            return every
    return 1


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
    )
