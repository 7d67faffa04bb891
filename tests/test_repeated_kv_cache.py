"""The repeated-KV cache hands SDPA exactly what transformers' sdpa hands it with the ordinary cache, so the answers are
the same bit for bit, in bfloat16 as in float32.

The evaluator's answers with it are checked row for row in tests/test_evaluator.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

from attentionkit import DIM, GROUPS, HEADS, KEYS, KV_HEADS, Attention, tensors
from evaluator.generation import _emptied_cache
from evaluator.repeated_kv_cache import (
    ATTENTION_NAME,
    RepeatedKVLayer,
    repeated_kv_attention,
    repeated_kv_cache,
    use_repeated_kv_attention,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("queries", [1, 5])
@pytest.mark.parametrize("additive", [False, True])
def test_repeated_heads_give_sdpas_output_bit_for_bit(queries: int, additive: bool, dtype: torch.dtype) -> None:
    query, key, value, mask = tensors(queries, dtype)
    if additive:
        mask = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, float("-inf"))
    expected, _ = sdpa_attention_forward(Attention(), query, key, value, mask, scaling=0.3)
    repeated_key, repeated_value = repeat_kv(key, GROUPS), repeat_kv(value, GROUPS)
    output, _ = repeated_kv_attention(Attention(), query, repeated_key, repeated_value, mask, scaling=0.3)
    assert torch.equal(output, expected)
    # The copies must sit in repeat_kv's order (query head h reads key/value head h // groups): tiled, they do not.
    tiled, _ = repeated_kv_attention(Attention(), query, key.repeat(1, GROUPS, 1, 1), value.repeat(1, GROUPS, 1, 1),
                                     mask, scaling=0.3)  # fmt: skip
    assert not torch.allclose(tiled.float(), expected.float(), atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_a_mask_sdpa_gets_the_caches_own_heads(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unpadded prefill: transformers' sdpa would pass the unrepeated heads with SDPA's `enable_gqa`, and so it
    does here; with an ordinary cache's heads the attention is transformers' sdpa as it is."""
    query, key, value, _ = tensors(KEYS, dtype)
    expected, _ = sdpa_attention_forward(Attention(), query, key, value, None)
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recorded_sdpa(*args: torch.Tensor, **kwargs: object) -> torch.Tensor:
        calls.append((args[1].shape, kwargs))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recorded_sdpa)
    output, _ = repeated_kv_attention(Attention(), query, repeat_kv(key, GROUPS), repeat_kv(value, GROUPS), None)
    assert torch.equal(output, expected)
    assert calls == [((2, KV_HEADS, KEYS, DIM), {"attn_mask": None, "dropout_p": 0.0, "scale": None, "is_causal": True,
                                                 "enable_gqa": True})]  # fmt: skip
    assert torch.equal(repeated_kv_attention(Attention(), query, key, value, None)[0], expected)


def test_the_layer_stores_the_new_tokens_repeated_and_empties_on_reset() -> None:
    layer = RepeatedKVLayer(max_cache_len=KEYS, repeats=GROUPS)
    _, key, value, _ = tensors(1, torch.float32)
    keys, values = layer.update(key[:, :, :4], value[:, :, :4])
    keys, values = layer.update(key[:, :, 4:5], value[:, :, 4:5])
    assert keys.shape == (2, HEADS, KEYS, DIM)
    assert torch.equal(keys[:, :, :5], repeat_kv(key[:, :, :5], GROUPS))
    assert torch.equal(values[:, :, :5], repeat_kv(value[:, :, :5], GROUPS))
    assert not keys[:, :, 5:].any()
    layer.reset()
    assert int(layer.get_seq_length()) == 0 and not layer.keys.any()


def test_the_cache_needs_the_attention_and_grows_but_never_shrinks(tiny_model_dir: Path) -> None:
    from evaluator.evaluation import load_model

    model, _ = load_model(tiny_model_dir, "cpu")
    with pytest.raises(ValueError, match="use_repeated_kv_attention"):
        repeated_kv_cache(model, 10)
    use_repeated_kv_attention(model)
    assert model.config.text_config._attn_implementation == ATTENTION_NAME
    assert model.config.vision_config._attn_implementation == "sdpa"
    cache = _emptied_cache(model, None, 40)
    assert len(cache.layers) == model.config.text_config.num_hidden_layers and cache.get_max_length() == 40
    assert _emptied_cache(model, cache, 30) is cache and cache.get_max_length() == 40  # shorter prompts reuse it
    longer = _emptied_cache(model, cache, 41)
    assert longer is not cache and longer.get_max_length() == 41
    use_repeated_kv_attention(model, enabled=False)
    assert model.config.text_config._attn_implementation == "sdpa"
    with pytest.raises(TypeError, match="is not a Qwen2-VL model"):
        use_repeated_kv_attention(torch.nn.Linear(2, 2))


def test_folded_attention_takes_no_repeated_cache(tiny_model_dir: Path) -> None:
    from evaluator.evaluation import load_model

    with pytest.raises(ValueError, match="folded_gqa_attention reads the ordinary cache"):
        load_model(tiny_model_dir, "cpu", folded_gqa_attention=True, repeated_kv_cache=True)
