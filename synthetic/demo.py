"""The demo's model and box (`run_search.py --demo`): a small Qwen2-VL taught to count, and a synthetic box of the
images it was taught on. Each is built once; a finished build with the same seed and sizes is reused.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

# Rows of the demo box (rendered on a CPU in seconds). ood_val is what the search selects on: at 48 rows its noise
# (about 7 points) let a round no better than the baseline win; 200 rows cost a CPU round about 15 s of scoring.
DEMO_SIZES = {"train": 256, "val": 32, "ood_val": 200, "test_compositional": 32, "test_other": 32}
# The box's row seed is the budget's seed plus this: rows from the teach seed would be the very scenes the model's
# SFT saw, where every round (the baseline's too) reaches the same accuracy and the search cannot show a lead.
DEMO_BOX_SEED_OFFSET = 1000
DEMO_BOX_MARKER = "demo_box.json"  # the seed and sizes the box was rendered with


def build_demo(model_path: str | Path, box_path: str | Path, seed: int, *, say: Callable[[str], None] = print) -> None:
    """The taught model in `model_path` and the box (train/, val/, ...) in `box_path`, unless already built."""
    import datasets

    datasets.disable_progress_bars()  # a few hundred rows: the bars would only bury the search's own lines
    from synthetic.teach import DEMO_RECIPE, taught_as

    recipe = DEMO_RECIPE
    model = Path(model_path)
    if not taught_as(model, seed, recipe):
        import torch

        from synthetic.teach import build_counting_model

        # Taught by SFT to answer in the verifier's format: a base that a GRPO round measurably improves
        # (tests/test_learning.py), where a random model never writes a parsable answer.
        device = "cuda" if torch.cuda.is_available() else "cpu"
        say(f"demo: teaching a small Qwen2-VL to count in {model} on {device}")
        _build_into(
            model, lambda partial: build_counting_model(partial, seed=seed, recipe=recipe, log=say, device=device)
        )
    box = Path(box_path)
    box_seed = seed + DEMO_BOX_SEED_OFFSET
    if not demo_box_is(box, DEMO_SIZES, box_seed):
        say(f"demo: rendering a synthetic box in {box}")
        _build_into(box, lambda partial: render_demo_box(partial, DEMO_SIZES, box_seed, recipe))


def render_demo_box(folder: Path, sizes: dict[str, int], seed: int, recipe) -> None:
    """The images and counts `recipe` teaches, from the scenes of `seed`, marked with the seed and sizes."""
    from synthetic.splits import write_box

    write_box(folder, sizes, seed, recipe.image_size, recipe.count_range)
    (folder / DEMO_BOX_MARKER).write_text(json.dumps({"seed": seed, "sizes": sizes}) + "\n")


def demo_box_is(box: Path, sizes: dict[str, int], seed: int) -> bool:
    """Whether `box` was rendered by `render_demo_box` with these sizes and this seed."""
    try:
        return json.loads((box / DEMO_BOX_MARKER).read_text()) == {"seed": seed, "sizes": sizes}
    except (FileNotFoundError, json.JSONDecodeError):
        return False


def _build_into(target: Path, build: Callable[[Path], object]) -> None:
    # Built aside and renamed into place, so an interrupted build is never mistaken for a finished one.
    partial = target.with_name(f".{target.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    build(partial)
    shutil.rmtree(target, ignore_errors=True)
    os.rename(partial, target)
