"""What the language-model attention tests share: a stand-in for transformers' attention module and grouped-query
inputs with a left-padded, causal mask, as a static cache's decode gives them."""

from __future__ import annotations

import torch

HEADS, KV_HEADS, KEYS, DIM = 6, 2, 9, 8
GROUPS = HEADS // KV_HEADS


class Attention(torch.nn.Module):
    """What transformers' sdpa reads from an attention module."""

    num_key_value_groups = GROUPS
    is_causal = True


def tensors(queries: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """query (2, HEADS, queries, DIM), key and value (2, KV_HEADS, KEYS, DIM), a boolean mask (2, 1, queries, KEYS)."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, HEADS, queries, DIM, generator=generator).to(dtype)
    key, value = (torch.randn(2, KV_HEADS, KEYS, DIM, generator=generator).to(dtype) for _ in range(2))
    # Row 0 left-padded by 3; causal over the last `queries` positions.
    mask = torch.tril(torch.ones(queries, KEYS, dtype=torch.bool), diagonal=KEYS - queries).expand(2, 1, queries, KEYS)
    mask = mask.clone()
    mask[0, :, :, :3] = False
    return query, key, value, mask
