"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest


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
