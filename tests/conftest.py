"""Shared pytest fixtures."""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

import pytest

# glibc's malloc serves blocks over 32 MB with mmap and gives them back with munmap, so every step of the taught
# model's SFT and rounds (151,936-row head: 78 MB gradients, optimizer buffers, logits) faults its memory in anew:
# ~40% of a step was kernel time. Keeping freed memory in the heap halves a teaching step (0.54 -> 0.30 s on 2 cores,
# bench/results/2026-12-04-cpu-learning-test-cheaper.md); the arithmetic is unchanged. This process through mallopt,
# the processes the tests start through the environment. glibc only; elsewhere nothing changes.
_MALLOC = {"MALLOC_MMAP_THRESHOLD_": (-3, 1 << 30), "MALLOC_TRIM_THRESHOLD_": (-1, (1 << 31) - 1),
           "MALLOC_TOP_PAD_": (-2, 1 << 28)}  # env name: (mallopt parameter, value)
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL("libc.so.6")
    except OSError:
        _libc = None
    if _libc is not None and hasattr(_libc, "mallopt"):
        for _name, (_param, _value) in _MALLOC.items():
            if _libc.mallopt(_param, _value) == 1:
                os.environ.setdefault(_name, str(_value))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2-VL folder (model, tokenizer, processor), built once per test session."""
    from synthetic.models import build_model

    return build_model(tmp_path_factory.mktemp("tiny_model"), size="tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_split_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small save_to_disk split (8 rows of 56x56 images, counts 1-3), written once per test session."""
    from synthetic.splits import write_split

    folder = tmp_path_factory.mktemp("tiny_split") / "val"
    return write_split(folder, "val", 8, seed=0, image_size=(56, 56), count_range=(1, 3))
