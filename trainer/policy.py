"""How a round holds its policy: the dtype it loads in, what stays frozen, which modules LoRA adapts.

One place for these choices, because two readers need them: the round loading the real model (trainer.round), and
the search predicting a round's memory before it launches (search/backends/fit.py, on a meta-device model of the same
architecture: no weights read).
"""

from __future__ import annotations

import torch

from trainer.config import TrialConfig

# The vision tower's linear layers under `train_vision_tower` with LoRA: each block's attention (qkv, proj) and MLP
# (fc1, fc2), and the merger's MLP (indices 0 and 2 of its Sequential). The patch embedding (a Conv3d) stays frozen.
VISION_LORA_PATTERN = r"(?:.*\.)?visual\.(?:blocks\.\d+\.(?:attn\.(?:qkv|proj)|mlp\.(?:fc1|fc2))|merger\.mlp\.[02])"


def policy_dtype(config: TrialConfig, on_gpu: bool) -> torch.dtype:
    # GPU: LoRA keeps the frozen base in bfloat16 (peft keeps its adapters in float32) under bf16 autocast. Full
    # fine-tuning keeps float32 master weights under the same autocast: AdamW steps of ~lr (1e-6 .. 1e-5) are far
    # below bfloat16's resolution for weights of magnitude ~1e-2 (spacing ~1e-4), so pure-bf16 weights would round
    # almost every update away. CPU: float32 throughout (no fast bf16 matmuls there).
    return torch.bfloat16 if on_gpu and not config.full_finetuning else torch.float32


def freeze_untrained(model: torch.nn.Module, config: TrialConfig) -> None:
    """Full fine-tuning trains the language model (embeddings, decoder, tied LM head) and, unless
    `train_vision_tower`, freezes the vision tower and its merger: what a round gains is mostly the answer's format
    and length (language side), the OOD test is a different renderer (vision features fitted to the train renderer
    are the part most likely to transfer badly), and a frozen tower saves its gradients and AdamW state (~0.6B
    parameters). LoRA freezes the base itself (peft)."""
    if config.full_finetuning and not config.train_vision_tower:
        model.model.visual.requires_grad_(False)


def lora_target_pattern(config: TrialConfig) -> str | None:
    """The regex peft full-matches module names against (None: full fine-tuning). Restricted to the language model:
    Qwen2-VL's vision blocks use other names today (qkv, proj, fc1, fc2), but a bare name list would also catch any
    vision module that shares a name."""
    if config.full_finetuning:
        return None
    targets = "|".join(sorted(set(config.lora_targets)))
    pattern = rf"(?:.*\.)?language_model\.(?:.*\.)?(?:{targets})"
    if config.train_vision_tower:
        pattern += "|" + VISION_LORA_PATTERN
    return rf"^(?:{pattern})$"


def meta_policy(model_config, config: TrialConfig) -> torch.nn.Module:
    """The policy a round of `config` trains on a GPU, on the meta device (shapes and dtypes, no memory): for
    predicting its footprint (trainer.memory) from the model's config alone."""
    from transformers import Qwen2VLForConditionalGeneration

    with torch.device("meta"):
        model = Qwen2VLForConditionalGeneration._from_config(model_config, dtype=policy_dtype(config, on_gpu=True))
    freeze_untrained(model, config)
    return model
