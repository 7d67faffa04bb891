"""liger-kernel's Triton layer kernels on the policy being trained (the optional `gpu` extra, imported only here).

Applied to the policy instance directly rather than through TRL's `use_liger_kernel`: in TRL 1.16 that flag is
deprecated (for the Hub's `kernels`, which need a download) and, through transformers' Trainer, applies liger's
defaults for Qwen2-VL, whose rotary kernel replaces a function of transformers' qwen2_vl module for every model of the
process, the rollout replica's compiled decode included. Here only the policy's own modules change: its RMSNorms and
SwiGLU MLPs (and the vision tower's LayerNorms), bound per instance by liger's `apply_liger_kernel_to_qwen2_vl(model=)`,
whose class-level swaps are undone so that models built later (the replica, the evaluator's) keep transformers'
layers. Neither liger's cross-entropy nor its fused linear cross-entropy: the loss and its log-probabilities stay TRL's
(its chunked LM head, trainer/cpu_loss.py).
"""

from __future__ import annotations

import functools

import torch

from trainer.config import ConfigError, TrialConfig

INSTALL_HINT = "liger-kernel, importable (pip install '.[gpu]')"


@functools.cache
def liger_importable() -> bool:
    """Whether liger-kernel imports here (it is missing, or its Triton does not match this torch's: both mean no)."""
    try:
        import liger_kernel.transformers  # noqa: F401
    except Exception:
        return False
    return True


def use_liger(config: TrialConfig, on_gpu: bool) -> bool:
    """Whether the round runs liger's kernels; requested where they cannot run is a configuration error."""
    if not config.liger_kernels:
        return False
    if on_gpu and liger_importable():
        return True
    reason = "a CUDA device" if not on_gpu else INSTALL_HINT
    raise ConfigError("liger_kernels", f"true needs liger-kernel's Triton kernels on CUDA; missing: {reason}")


def apply_liger_kernels(model: torch.nn.Module) -> None:
    """Bind liger's RMSNorm, SwiGLU MLP and LayerNorm to this Qwen2-VL model's modules, and to no other model."""
    from liger_kernel.transformers import apply_liger_kernel_to_qwen2_vl
    from transformers.models.qwen2_vl import modeling_qwen2_vl

    module_attributes = dict(vars(modeling_qwen2_vl))
    try:
        apply_liger_kernel_to_qwen2_vl(
            rope=False,  # a module-level swap only (see the module docstring)
            cross_entropy=False,
            fused_linear_cross_entropy=False,
            rms_norm=True,
            layer_norm=True,
            swiglu=True,
            model=model,
        )
    finally:
        for name in set(vars(modeling_qwen2_vl)) - set(module_attributes):  # e.g. Qwen2RMSNorm, gone in transformers 5.2
            delattr(modeling_qwen2_vl, name)
        for name, value in module_attributes.items():
            if vars(modeling_qwen2_vl).get(name) is not value:
                setattr(modeling_qwen2_vl, name, value)
