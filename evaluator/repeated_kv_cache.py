"""A static KV cache that holds every key/value head once per query head it serves, so that a decode step reads the
cache in place: `repeated_kv_cache(model, max_cache_len)` with `use_repeated_kv_attention(model)`.

transformers 5.17's sdpa path repeats each key/value head for its query heads (`repeat_kv`) whenever there is an
attention mask, and a batched, left-padded decode over a static cache always has one: with the ordinary cache, each
decode step copies the whole cache six times over in every layer. This cache repeats only the new tokens' keys and
values, once, as they are written; the attention then hands SDPA the very tensor `repeat_kv` would have built (the
same values, shape and layout), so SDPA runs the same kernel on the same inputs: the verifier's arithmetic, without
the copy. The price is memory: the cache is `num_attention_heads / num_key_value_heads` times larger (12/2 for
Qwen2-VL-2B). No library offers a cache that stores repeated heads.

Where transformers' sdpa would not repeat (no mask: an unpadded prefill), the attention passes it the cache's
original heads and sdpa takes SDPA's own `enable_gqa` path, as it would with the ordinary cache.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from transformers.cache_utils import Cache, StaticLayer
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward, use_gqa_in_sdpa

from evaluator.text_attention import use_text_attention

ATTENTION_NAME = "sdpa_repeated_kv"


def use_repeated_kv_attention(model: torch.nn.Module, enabled: bool = True) -> None:
    """Make `model`'s language model attend with `repeated_kv_attention` (`enabled=False`: transformers' sdpa, as
    loaded). In place, on this instance only; the vision tower is not touched. With an ordinary cache, or none, the
    attention is transformers' sdpa unchanged, so a model set up this way still trains and generates as before."""
    use_text_attention(model, ATTENTION_NAME, repeated_kv_attention, enabled)


def uses_repeated_kv_attention(model: torch.nn.Module) -> bool:
    return getattr(model.config.get_text_config(), "_attn_implementation", None) == ATTENTION_NAME


def repeated_kv_cache(model: torch.nn.Module, max_cache_len: int) -> Cache:
    """An empty static cache for `model`'s language model, `max_cache_len` positions per layer, its key/value heads
    repeated as the query heads use them. Its tensors are allocated on the first forward; `reset()` empties it for
    the next batch of the same size. Only `repeated_kv_attention` reads it correctly, hence the check."""
    if not uses_repeated_kv_attention(model):
        raise ValueError("a repeated-KV cache needs the model set up with use_repeated_kv_attention(model)")
    text = model.config.get_text_config()
    repeats = text.num_attention_heads // text.num_key_value_heads
    return Cache(layers=[RepeatedKVLayer(max_cache_len, repeats) for _ in range(text.num_hidden_layers)])


class RepeatedKVLayer(StaticLayer):
    """transformers' static cache layer, storing each key/value head `repeats` times (query head h reads copy h)."""

    def __init__(self, max_cache_len: int, repeats: int):
        super().__init__(max_cache_len=max_cache_len)
        self.repeats = repeats

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        # `repeat_kv` itself, so the stored heads are exactly what transformers' sdpa would have built from the cache.
        return super().update(repeat_kv(key_states, self.repeats), repeat_kv(value_states, self.repeats), *args,
                              **kwargs)  # fmt: skip


class _Heads(NamedTuple):
    """What transformers' sdpa reads of the attention module; one key/value group: the heads are already repeated."""

    num_key_value_groups: int
    is_causal: bool


def repeated_kv_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """An `AttentionInterface` function: transformers' sdpa, except that keys and values that come with as many heads
    as the query (from a `repeated_kv_cache`) are not repeated again."""
    groups = getattr(module, "num_key_value_groups", 1)
    if groups == 1 or key.shape[1] != query.shape[1]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if use_gqa_in_sdpa(attention_mask, key, value):
        # Here sdpa passes the cache's own heads with `enable_gqa`: give it exactly those, laid out as it has them.
        key, value = key[:, ::groups].contiguous(), value[:, ::groups].contiguous()
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    heads = _Heads(num_key_value_groups=1, is_causal=getattr(module, "is_causal", True))
    return sdpa_attention_forward(heads, query, key, value, attention_mask, **kwargs)
