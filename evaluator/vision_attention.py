"""Qwen2-VL's vision tower attends to a whole batch of images in one call: `use_batched_vision_attention(model)`.

transformers 5.17's `VisionAttention` calls its attention function once per image and layer (32 layers x every image
of a prefill) unless the vision config names a flash implementation; then it calls it once per layer with the
packed batch and the images' boundaries (`cu_seq_lens_q/k`). flash-attn is not installed, so this module registers
its own function in transformers' `AttentionInterface` under a name containing "flash" (`is_flash_attention_requested`
tests for that substring) and selects it for the vision tower only, through `set_attn_implementation`'s per-sub-config
form. The language model keeps sdpa.

What the function runs:

- CUDA, bfloat16/float16: `torch.nn.attention.varlen.varlen_attn` (torch >= 2.10), PyTorch's own varlen
  flash-attention kernel: block-diagonal attention over all the images in one launch, without a mask or compilation.
  FlexAttention, the other block-diagonal kernel in torch, is only fast compiled; the packed length changes from
  batch to batch (recompilations or dynamic shapes) and its block mask would be rebuilt for every batch.
- Elsewhere (a CPU, float32): SDPA on the images grouped by patch count, one batched call per distinct size. It is
  the arithmetic of the per-image loop (same kernel, same arguments), with a batch dimension; varlen_attn is CUDA only
  and uncompiled FlexAttention materializes the full packed score matrix.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import AttentionInterface, Qwen2VLConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch < 2.9
    varlen_attn = None

# "flash" in the name is what makes VisionAttention pass the packed batch (see the module docstring).
ATTENTION_NAME = "flash_batched_vision"
# torch 2.9's varlen_attn took no `scale`; 2.10 onwards do.
_VARLEN_OK = varlen_attn is not None and "scale" in inspect.signature(varlen_attn).parameters


def use_batched_vision_attention(model: torch.nn.Module, enabled: bool = True) -> None:
    """Make `model`'s vision tower attend to all the images of a call at once (`enabled=False`: once per image, with
    transformers' sdpa, as loaded). In place, on this instance only; the language model is not touched."""
    if not isinstance(getattr(model, "config", None), Qwen2VLConfig):
        raise TypeError(f"{type(model).__name__} is not a Qwen2-VL model")
    AttentionInterface.register(ATTENTION_NAME, batched_vision_attention)
    # The per-sub-config form, on the whole model: on the tower itself, transformers would take a name containing
    # "flash" for a flash kernel to load from the hub; as a sub-config's value it only checks that it is registered.
    model.set_attn_implementation({"vision_config": ATTENTION_NAME if enabled else "sdpa"})


def varlen_applies(query: torch.Tensor) -> bool:
    """Whether `query` goes to torch's varlen kernel (CUDA, half precision, torch >= 2.10), else grouped SDPA."""
    return _VARLEN_OK and query.is_cuda and query.dtype in (torch.bfloat16, torch.float16)


def batched_vision_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """An `AttentionInterface` function for VisionAttention's flash call: query, key and value of shape
    (1, heads, packed tokens, head_dim), the images delimited by `cu_seq_lens_q` (= `cu_seq_lens_k`); returns the
    output as (1, packed tokens, heads, head_dim), as transformers' attention functions do."""
    # VisionAttention passes one boundary tensor as both (compared by identity: a value check would sync the GPU).
    if attention_mask is not None or cu_seq_lens_q is None or cu_seq_lens_k is not cu_seq_lens_q:
        raise ValueError("batched vision attention is full attention within each image, without a mask")
    if varlen_applies(query) and dropout == 0.0:
        cu_seqlens = cu_seq_lens_q.to(torch.int32)
        # (tokens, heads, head_dim); contiguous: value is a strided slice of the qkv projection.
        packed = [tensor[0].transpose(0, 1).contiguous() for tensor in (query, key, value)]
        # max_length_q: VisionAttention computes it for flash implementations (one host sync per forward).
        output = varlen_attn(*packed, cu_seqlens, cu_seqlens, max_length_q, max_length_q, scale=scaling)
        return output.unsqueeze(0), None
    return _grouped_sdpa(module, query, key, value, cu_seq_lens_q, scaling, dropout), None


def _grouped_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scaling: float | None,
    dropout: float,
) -> torch.Tensor:
    starts = cu_seqlens[:-1].tolist()
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    output = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # (tokens, heads, head_dim)
    for length in sorted(set(lengths)):
        first = [start for start, size in zip(starts, lengths) if size == length]
        tokens = (torch.tensor(first).unsqueeze(1) + torch.arange(length)).to(query.device)  # (images, length)
        # (1, heads, tokens, d) -> (images, heads, length, d)
        q, k, v = (tensor[0][:, tokens].transpose(0, 1) for tensor in (query, key, value))
        # transformers' own sdpa call, as its per-image loop makes it; returns (images, length, heads, d).
        grouped, _ = sdpa_attention_forward(
            module, q, k, v, attention_mask=None, scaling=scaling, dropout=dropout, is_causal=False
        )
        output[tokens] = grouped
    return output.unsqueeze(0)
