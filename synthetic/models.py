"""Qwen2-VL model folders built offline: the real classes and file layout, random weights, named sizes.

Nothing can be downloaded, so the project builds its own Qwen2-VL-2B-Instruct stand-ins. `build_model` writes with
`save_pretrained` exactly the files transformers 5 writes for the real model after loading it (config.json with nested
text_config / vision_config, generation_config.json, weights, tokenizer, processor_config.json, chat template), so
everything downstream (trainer, evaluator, verifier) loads it with the same calls it uses on the real folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForImageTextToText,
    GenerationConfig,
    Qwen2VLConfig,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
    Qwen2VLVideoProcessor,
)

from synthetic.tokenizer import SPECIAL_TOKENS, build_tokenizer


@dataclass(frozen=True)
class ModelSize:
    """The dimensions that vary between sizes; everything else is the real Qwen2-VL-2B's."""

    hidden: int  # text hidden size; also the vision merger's output size
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    mrope_section: tuple[int, int, int]  # temporal/height/width rotary split: sums to head_dim / 2
    vision_depth: int
    vision_dim: int
    vision_heads: int
    dtype: torch.dtype  # the dtype the weights are saved in


SIZES: dict[str, ModelSize] = {
    # CPU tests: under a second to build, 40 MB on disk (the 151936-row embedding is most of it).
    "tiny": ModelSize(64, 128, 2, 4, 2, (2, 3, 3), 2, 32, 4, torch.float32),
    # The taught counting model (synthetic.teach): learns the answer format and rough counting in minutes on a CPU.
    "counting": ModelSize(128, 512, 2, 4, 2, (4, 6, 6), 2, 64, 4, torch.float32),
    # Learning experiments on one GPU: 44M parameters (39M of them the embedding), head_dim 64.
    "small": ModelSize(256, 1024, 4, 4, 2, (8, 12, 12), 4, 128, 4, torch.float32),
    # The real Qwen2-VL-2B-Instruct architecture (2.2B parameters, 4.4 GB in bfloat16 as shipped).
    "2b": ModelSize(1536, 8960, 28, 12, 2, (16, 24, 24), 32, 1280, 16, torch.bfloat16),
}

VOCAB_SIZE = 151936  # the real embedding rows (> the last special id 151656, as in the real model)

# The real preprocessor_config.json's settings. One dict for the image and the video processor: transformers 5
# loads the real folder's video processor from the same file, so both carry them.
_VISION_PROCESSING = {
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}
_MIN_PIXELS, _MAX_PIXELS = 3136, 12845056


def build_config(size: str = "tiny") -> Qwen2VLConfig:
    """The Qwen2VLConfig of a named size, with the real token ids, rope and vision patching."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; known: {', '.join(SIZES)}")
    s = SIZES[size]
    if sum(s.mrope_section) * 2 != s.hidden // s.heads:
        raise ValueError(f"size {size!r}: mrope_section {s.mrope_section} must sum to head_dim / 2")
    text_config = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "max_position_embeddings": 32768,
        "max_window_layers": s.layers,
        "use_sliding_window": False,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": list(s.mrope_section)},
        "bos_token_id": SPECIAL_TOKENS["<|endoftext|>"],
        "eos_token_id": SPECIAL_TOKENS["<|im_end|>"],
    }
    vision_config = {
        "depth": s.vision_depth,
        "embed_dim": s.vision_dim,
        "hidden_size": s.hidden,
        "num_heads": s.vision_heads,
        "mlp_ratio": 4,
        "in_channels": 3,
        "patch_size": _VISION_PROCESSING["patch_size"],
        "spatial_merge_size": _VISION_PROCESSING["merge_size"],
        "temporal_patch_size": _VISION_PROCESSING["temporal_patch_size"],
    }
    return Qwen2VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=SPECIAL_TOKENS["<|image_pad|>"],
        video_token_id=SPECIAL_TOKENS["<|video_pad|>"],
        vision_start_token_id=SPECIAL_TOKENS["<|vision_start|>"],
        vision_end_token_id=SPECIAL_TOKENS["<|vision_end|>"],
        tie_word_embeddings=True,
    )


def build_generation_config() -> GenerationConfig:
    """The real Qwen2-VL-2B-Instruct generation_config.json (near-greedy sampling; the verifier overrides it)."""
    return GenerationConfig(
        bos_token_id=SPECIAL_TOKENS["<|endoftext|>"],
        pad_token_id=SPECIAL_TOKENS["<|endoftext|>"],
        eos_token_id=[SPECIAL_TOKENS["<|im_end|>"], SPECIAL_TOKENS["<|endoftext|>"]],
        do_sample=True,
        temperature=0.01,
        top_p=0.001,
        top_k=1,
        repetition_penalty=1.0,
    )


def build_processor() -> Qwen2VLProcessor:
    """Tokenizer, image and video processors, and the chat template, as `AutoProcessor` loads the real folder."""
    # A fresh `size` dict per processor: passing min_pixels/max_pixels instead makes transformers 5.17 write them
    # into the class-level default `size` dict, changing the defaults of every later instance in the process.
    def settings() -> dict:
        return {**_VISION_PROCESSING, "size": {"shortest_edge": _MIN_PIXELS, "longest_edge": _MAX_PIXELS}}

    tokenizer = build_tokenizer()
    return Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(**settings()),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(**settings()),
        chat_template=tokenizer.chat_template,
    )


def build_model(out_dir: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    """Write a Qwen2-VL folder of a named size with seeded random weights; return its path.

    It loads with `Qwen2VLForConditionalGeneration.from_pretrained`, `AutoProcessor.from_pretrained` and
    `AutoTokenizer.from_pretrained` like the real Qwen2-VL-2B-Instruct folder.
    """
    config = build_config(size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    # Seeded without touching the caller's random state. The Qwen2VLForConditionalGeneration is initialized
    # directly in the saved dtype: building the 2b model in float32 first would take twice the memory for nothing.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=SIZES[size].dtype)
    model.generation_config = build_generation_config()
    model.save_pretrained(out)
    build_processor().save_pretrained(out)
    return out
