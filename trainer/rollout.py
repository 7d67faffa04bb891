"""Rollouts from a generation replica: a second copy of the policy, in the inference dtype, refreshed from the
trained weights before every generation, and the GRPO trainer that samples from it.

Why a replica (TRL 1.16 generates with transformers' `generate` on the model being trained, or on vLLM, which the
GPU machine does not have):

- Full fine-tuning keeps float32 master weights (trainer.round._load_model says why), and TRL's rollouts run outside
  autocast, so every decode step read 4 bytes per weight and ran float32 matmuls. The replica holds bfloat16 weights:
  the values the training forward's bf16 autocast computes with anyway (round-to-nearest of the same masters).
- LoRA: the unmerged peft model runs each adapted projection twice per decode step, which made a LoRA step about
  twice as slow as a full fine-tuning one. The replica holds W + scale * B @ A, one matmul per projection; the base
  weights of the policy are never touched, so the frozen reference and the final merge stay exact.
- A static KV cache with a compiled decode step (transformers' `cache_implementation="static"`, several times
  faster per decode step than the dynamic cache) needs weights at fixed addresses: CUDA graphs replay reads from the
  captured storage. The replica's tensors are updated in place (`copy_`), so one compilation serves the whole round.
  TRL itself turns compilation off (`disable_compile=True` in its generation config).

The sampled distribution is the policy's up to the rounding of its weights to the replica's dtype, which is the
rounding the bf16 training forward applies too; TRL computes the old log-probs for the importance ratio with the
training model, so nothing else changes in what is optimized. Only the regular transformers path is replaced: with
vLLM or continuous batching configured, TRL's own path runs.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import numpy as np
import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer
from transformers import GenerationConfig, Qwen2VLForConditionalGeneration
from trl import GRPOTrainer
from trl.trainer.utils import pad

from evaluator.generation import tokens_until_eos
from evaluator.vision_attention import use_batched_vision_attention

# Static caches are sized in multiples of this many positions, so prompts of slightly different lengths share one
# compiled decode step (transformers keeps the largest cache length it has seen, and recompiles when it grows).
CACHE_LENGTH_QUANTUM = 256


class RolloutReplica:
    """An inference copy of the policy; `sync_from(policy)` writes the policy's current weights into it in place.
    `batched_vision_attention`: its vision tower attends to all the images of a prefill at once (see
    `evaluator.vision_attention`)."""

    def __init__(
        self,
        model_path: str,
        dtype: torch.dtype,
        device: torch.device,
        batched_vision_attention: bool = False,
    ):
        self.model = Qwen2VLForConditionalGeneration.from_pretrained(
            model_path, dtype=dtype, attn_implementation="sdpa"
        ).to(device)
        if batched_vision_attention:
            use_batched_vision_attention(self.model)
        self.model.eval().requires_grad_(False)
        self._parameters = dict(self.model.named_parameters())

    @torch.no_grad()
    def sync_from(self, policy: torch.nn.Module) -> None:
        """Copy what training can change: every trainable parameter of a fully fine-tuned model, or every LoRA-adapted
        weight as base + delta. Frozen parameters are the checkpoint's in both copies and are left alone."""
        if isinstance(policy, PeftModel):
            inner = policy.base_model.model  # the Qwen2-VL model with LoRA layers in place of the adapted Linears
            for name, module in inner.named_modules():
                if isinstance(module, LoraLayer):
                    merged = module.get_base_layer().weight.float()
                    for adapter in module.active_adapters:
                        merged = merged + module.get_delta_weight(adapter).float()
                    self._parameters[f"{name}.weight"].copy_(merged)
            return
        for name, parameter in policy.named_parameters():
            if parameter.requires_grad:
                self._parameters[name].copy_(parameter)


class ReplicaGRPOTrainer(GRPOTrainer):
    """TRL's GRPOTrainer whose transformers-generate rollouts come from a `RolloutReplica` (see the module docstring).

    `compile_rollouts`: a static KV cache and a compiled decode step (GPU only; transformers does not compile on CPU).
    """

    def __init__(self, *args: Any, replica: RolloutReplica, compile_rollouts: bool, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.replica = replica
        self.rollout_generation_config = copy.deepcopy(self.generation_config)
        if compile_rollouts:
            self.rollout_generation_config.cache_implementation = "static"
            self.rollout_generation_config.disable_compile = False

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        # TRL turns checkpointing off for its no-grad log-probabilities and back on with `gradient_checkpointing_kwargs`
        # as the checkpoint function's arguments: on every layer, `every_n_layers` passed on to the layers' forward.
        # The configured layers are set again before the gradient pass.
        kwargs = dict(self.args.gradient_checkpointing_kwargs or {})
        every = kwargs.pop("every_n_layers", 1)
        if self.args.gradient_checkpointing and every > 1:
            model = self.accelerator.unwrap_model(self.model)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None, every_n_layers=every)
        return output

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if self.use_vllm or self.use_transformers_continuous_batching or has_tool_images:
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        self.replica.sync_from(self.accelerator.unwrap_model(self.model))
        device = self.accelerator.device
        prompts = [torch.tensor(ids) for ids in prompt_ids]
        inputs = {
            "input_ids": pad(prompts, padding_value=self._tokenizer.pad_token_id, padding_side="left"),
            "attention_mask": pad([torch.ones_like(ids) for ids in prompts], padding_value=0, padding_side="left"),
        }
        for key, value in multimodal_fields.items():  # as TRL passes them: pixel_values, image_grid_thw, ...
            if isinstance(value, torch.Tensor):
                inputs[key] = value
            elif isinstance(value, list) and value and isinstance(value[0], list):  # per token: padded as the ids
                inputs[key] = pad([torch.tensor(row) for row in value], padding_value=0, padding_side="left")
            else:
                inputs[key] = torch.tensor(np.array(value))
        inputs = {key: value.to(device) for key, value in inputs.items()}
        prompt_length = inputs["input_ids"].shape[1]
        with torch.no_grad():
            output = self.replica.model.generate(**inputs, generation_config=self._rollout_config(prompt_length))
        new_tokens = output[:, prompt_length:].cpu()
        lengths = tokens_until_eos(new_tokens, self.eos_token_ids)
        return [row[:length].tolist() for row, length in zip(new_tokens, lengths, strict=True)], None

    def _rollout_config(self, prompt_length: int) -> GenerationConfig:
        config = self.rollout_generation_config
        if config.cache_implementation == "static":
            needed = prompt_length + config.max_new_tokens
            config.max_cache_len = math.ceil(needed / CACHE_LENGTH_QUANTUM) * CACHE_LENGTH_QUANTUM
        return config
