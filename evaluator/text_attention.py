"""Qwen2-VL's language model attends with its 12 query heads to its 2 key/value heads without copying the cache:
`use_folded_gqa_attention(model)`.

transformers 5.17's sdpa path repeats every key/value head for its query heads (`repeat_kv`) whenever there is an
attention mask, because SDPA's `enable_gqa` with a mask falls back to its math kernel. A batched, left-padded decode
with a static cache always has a mask, so each decode step copies the whole cache six times over in every layer.
This function folds instead: the query heads that share a key/value head become query rows of that head, (batch,
kv_heads, group x queries, head_dim), each row with its own query's mask row. That is the same attention, row by row
(every query row still attends alone), with the cache read in place. No library offers it for a masked SDPA call.

Where there is no mask and more than one query (a prefill with no padding), transformers' sdpa is called unchanged:
it takes SDPA's own `enable_gqa` path then, which copies nothing.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface, Qwen2VLConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION_NAME = "sdpa_folded_gqa"


def use_folded_gqa_attention(model: torch.nn.Module, enabled: bool = True) -> None:
    """Make `model`'s language model use `folded_gqa_attention` (`enabled=False`: transformers' sdpa, as loaded). In
    place, on this instance only; the vision tower is not touched."""
    use_text_attention(model, ATTENTION_NAME, folded_gqa_attention, enabled)


def use_text_attention(model: torch.nn.Module, name: str, function: Any, enabled: bool) -> None:
    """Register `function` as the attention `name`, with sdpa's masks, and make `model`'s language model use it
    (`enabled=False`: transformers' sdpa). In place, on this instance only."""
    if not isinstance(getattr(model, "config", None), Qwen2VLConfig):
        raise TypeError(f"{type(model).__name__} is not a Qwen2-VL model")
    AttentionInterface.register(name, function)
    # The language model builds sdpa's masks for it: without a registered mask function it would build none.
    AttentionMaskInterface.register(name, sdpa_mask)
    model.set_attn_implementation({"text_config": name if enabled else "sdpa"})


def folded_gqa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """An `AttentionInterface` function: query (batch, heads, queries, head_dim), key and value (batch, kv_heads,
    keys, head_dim), a boolean or additive mask broadcastable to (batch, 1, queries, keys) or None; returns
    (batch, queries, heads, head_dim), as transformers' sdpa does."""
    batch, heads, queries, head_dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    if group == 1 or (attention_mask is None and queries > 1) or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)  # fmt: skip
    # Query head h uses key/value head h // group (transformers' repeat_kv), so the heads of one group are adjacent.
    folded = query.reshape(batch, kv_heads, group * queries, head_dim)
    mask = None
    if attention_mask is not None:
        mask = attention_mask[:, :, :, : key.shape[2]]
        mask = mask.expand(batch, 1, queries, mask.shape[-1])
        mask = mask.unsqueeze(2).expand(batch, 1, group, queries, mask.shape[-1])
        mask = mask.reshape(batch, 1, group * queries, mask.shape[-1])
    output = torch.nn.functional.scaled_dot_product_attention(
        folded, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling
    )
    return output.reshape(batch, heads, queries, head_dim).transpose(1, 2).contiguous(), None
