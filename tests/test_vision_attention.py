"""The batched vision attention computes what transformers' per-image loop computes, on images of several sizes.

The evaluator's answers with it are checked row for row in tests/test_evaluator.py. On a CPU the batched path is
SDPA on equal-size groups; the CUDA test (the device machine runs it) checks torch's varlen kernel in bfloat16.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from evaluator import vision_attention
from evaluator.vision_attention import ATTENTION_NAME, use_batched_vision_attention

# Patches per side (t, h, w): several sizes, two of them twice and one pair of equal size but other shape (8x4 and
# 4x8), so both the grouping and the order of the images back in the packed sequence matter.
GRID = torch.tensor([[1, 4, 4], [1, 8, 4], [1, 4, 8], [1, 6, 4], [1, 4, 4], [1, 6, 6], [1, 8, 4]])


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path):
    """The tiny model with larger random vision weights: the saved ones are small enough to make every image's
    features nearly alike, which would hide images attending across their boundaries."""
    from transformers import Qwen2VLForConditionalGeneration

    model = Qwen2VLForConditionalGeneration.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.model.visual.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return model.eval()


def pixels_for(tower, grid: torch.Tensor, seed: int = 0) -> torch.Tensor:
    config = tower.config
    channels = config.in_channels * config.temporal_patch_size * config.patch_size**2
    return torch.randn(int(grid.prod(dim=1).sum()), channels, generator=torch.Generator().manual_seed(seed))


def test_the_tower_computes_the_same_features_and_gradients_in_one_call_per_layer(model, monkeypatch) -> None:
    per_image, batched = model, copy.deepcopy(model)
    use_batched_vision_attention(batched)
    assert batched.config.vision_config._attn_implementation == ATTENTION_NAME
    assert batched.config.text_config._attn_implementation == "sdpa"  # the language model is left alone
    assert per_image.config.vision_config._attn_implementation == "sdpa"  # on that instance only

    calls = []
    grouped = vision_attention._grouped_sdpa
    monkeypatch.setattr(vision_attention, "_grouped_sdpa", lambda *args: calls.append(args[4]) or grouped(*args))
    pixels = pixels_for(model.model.visual, GRID)
    features = {}
    for name, copy_ in (("per_image", per_image), ("batched", batched)):
        tower = copy_.model.visual
        tower.zero_grad()
        output = tower(pixels, grid_thw=GRID).pooler_output
        (output * torch.linspace(-1, 1, output.numel()).view_as(output)).sum().backward()
        features[name] = output.detach(), tower.blocks[0].attn.qkv.weight.grad.clone()
    depth = model.config.vision_config.depth
    assert len(calls) == depth  # one call per layer for the whole batch, none in the per-image model
    assert torch.equal(calls[0], torch.cat([torch.zeros(1, dtype=torch.int32), GRID.prod(dim=1).cumsum(0)]).int())
    (expected, expected_grad), (output, grad) = features["per_image"], features["batched"]
    starts = torch.cat([torch.zeros(1, dtype=torch.long), (GRID.prod(dim=1) // 4).cumsum(0)])
    images = [expected[a:b] for a, b in zip(starts[:-1], starts[1:])]
    assert not torch.allclose(images[0], images[4], atol=1e-3)  # same size, different pixels: features differ
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-5)

    use_batched_vision_attention(batched, enabled=False)
    assert batched.config.vision_config._attn_implementation == "sdpa"


def test_only_qwen2_vl_models_are_accepted() -> None:
    with pytest.raises(TypeError, match="is not a Qwen2-VL model"):
        use_batched_vision_attention(torch.nn.Linear(2, 2))


def test_the_bench_measures_both_ways_on_a_cpu(tiny_model_dir: Path, tiny_split_dir: Path) -> None:
    """bench/eval_speed.py's comparison, as bench/gpu.py's vision section runs it on the GPU, on the tiny model."""
    from bench import eval_speed

    figures = eval_speed.vision_attention(tiny_model_dir, tiny_split_dir, "cpu", batch_size=4, rows=8,
                                          max_new_tokens=4, repeats=1)  # fmt: skip
    assert figures["images_in_tower_batch"] == 4 and figures["rows"] == 8
    assert figures["tower_max_abs_difference"] == 0 and figures["rows_with_other_completions"] == 0
    assert figures["per_image"]["examples_per_s"] > 0 and figures["eval_speedup"] > 0
    tower = eval_speed.vision_tower_speed("cpu", images=5, sides=(56, 84), dtype=torch.float32, size="tiny",
                                          repeats=1)  # fmt: skip
    assert tower["batched_kernel"] == "grouped sdpa" and tower["patches"] == 3 * 16 + 2 * 36
    assert tower["batched"]["max_abs_difference"] == 0 and tower["batched_grouped_sdpa"]["speedup"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_varlen_attention_in_bfloat16_is_the_loop_up_to_rounding(model) -> None:
    grid = torch.tensor([[1, 32, 32], [1, 22, 34], [1, 32, 32], [1, 16, 12]], device="cuda")  # up to 448x448 pixels
    per_image = copy.deepcopy(model).to("cuda", torch.bfloat16)
    batched = copy.deepcopy(per_image)
    use_batched_vision_attention(batched)
    pixels = pixels_for(per_image.model.visual, grid).to("cuda", torch.bfloat16)
    assert vision_attention.varlen_applies(pixels)
    with torch.no_grad():
        expected = per_image.model.visual(pixels, grid_thw=grid).pooler_output.float()
    pixels.requires_grad_(True)  # the backward works too (a trained tower)
    output = batched.model.visual(pixels, grid_thw=grid).pooler_output
    output.float().sum().backward()
    assert pixels.grad is not None and torch.isfinite(pixels.grad).all()
    # bfloat16 keeps 8 bits of mantissa; two kernels may round differently at each layer.
    scale = expected.abs().max()
    assert (output.detach().float() - expected).abs().max() <= 0.05 * scale
