"""Folded grouped-query attention computes what transformers' sdpa computes with the cache copied per query head.

The evaluator's answers with it are checked row for row in tests/test_evaluator.py; the bench's side-by-side
measurement (bench/eval_speed.py) runs here on the tiny model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from attentionkit import DIM, HEADS, KEYS, Attention, tensors
from evaluator.text_attention import ATTENTION_NAME, folded_gqa_attention, use_folded_gqa_attention


@pytest.mark.parametrize("queries", [1, 5])
@pytest.mark.parametrize("additive", [False, True])
def test_folded_attention_is_sdpa_with_the_cache_copied(queries: int, additive: bool) -> None:
    query, key, value, mask = tensors(queries)
    if additive:
        mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    expected, _ = sdpa_attention_forward(Attention(), query, key, value, mask, scaling=0.3)
    output, _ = folded_gqa_attention(Attention(), query, key, value, mask, scaling=0.3)
    assert output.shape == (2, queries, HEADS, DIM)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-6)
    # Each group of query heads reads its own key/value head: pairing them otherwise gives another output.
    swapped, _ = folded_gqa_attention(Attention(), query, key.flip(1), value.flip(1), mask, scaling=0.3)
    assert not torch.allclose(swapped, expected, atol=1e-3)


def test_without_a_mask_one_query_attends_to_every_key_and_a_prefill_is_left_to_sdpa() -> None:
    query, key, value, _ = tensors(1)
    expected, _ = sdpa_attention_forward(Attention(), query, key, value, None)
    torch.testing.assert_close(folded_gqa_attention(Attention(), query, key, value, None)[0], expected)
    query, key, value, _ = tensors(KEYS)
    expected, _ = sdpa_attention_forward(Attention(), query, key, value, None)
    assert torch.equal(folded_gqa_attention(Attention(), query, key, value, None)[0], expected)


def test_only_the_language_model_of_that_instance_is_switched(tiny_model_dir: Path) -> None:
    from evaluator.evaluation import load_model

    model, _ = load_model(tiny_model_dir, "cpu")
    other, _ = load_model(tiny_model_dir, "cpu")
    use_folded_gqa_attention(model)
    assert model.config.text_config._attn_implementation == ATTENTION_NAME
    assert model.config.vision_config._attn_implementation == "sdpa"
    assert other.config.text_config._attn_implementation == "sdpa"
    use_folded_gqa_attention(model, enabled=False)
    assert model.config.text_config._attn_implementation == "sdpa"
    with pytest.raises(TypeError, match="is not a Qwen2-VL model"):
        use_folded_gqa_attention(torch.nn.Linear(2, 2))


def test_the_bench_measures_each_option_against_the_default_on_a_cpu(tiny_model_dir: Path,
                                                                     tiny_split_dir: Path) -> None:  # fmt: skip
    """bench/eval_speed.py's comparison, as bench/gpu.py's eval section runs it on the GPU, on the tiny model."""
    from bench import eval_speed

    recorded = []
    figures = eval_speed.measure(tiny_model_dir, tiny_split_dir, plain_rows=4, batch_sizes=[2, 4],
                                 record=lambda f: recorded.append(sorted(f)), device="cpu", max_new_tokens=8)  # fmt: skip
    assert figures["plain"]["n"] == 4 and figures["rows"] == 8
    assert set(figures["best"]) == {"batch_size", *eval_speed.DEFAULTS}
    best_size = max((2, 4), key=lambda size: figures[f"evaluator_static_{size}"]["examples_per_s"])
    for name in eval_speed.OPTIONS:
        # float32 on a CPU: the same answers, row for row
        assert figures[f"evaluator_static_{best_size}_{name}"]["rows_with_other_completions"] == 0
    assert figures["speedup"] > 0 and len(recorded) == 1 + 2 + len(eval_speed.OPTIONS)
