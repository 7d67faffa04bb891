"""The round's data: train rows as TRL 1.16 conversational vision prompts, and the OOD subset it only scores.

TRL's GRPOTrainer takes a conversational `prompt` column whose user turn holds an `{"type": "image"}` placeholder,
plus an `image` column: it fills the placeholder with the row's image (`prepare_multimodal_messages`), renders the
chat template through the processor and passes every other column (`solution` here) to the reward functions.

The prompt is built on the fly (`Dataset.with_transform`), not with `map`: `map` would rewrite every image of the
~68k-row split into a new cache file (minutes and gigabytes per round) to add a few words of text.

Images are resized the verifier's way (`qwen_vl_utils.fetch_image`: PIL, sides rounded to multiples of 28) before
TRL hands them to the processor, whose own resize is then the identity: training sees the very pixels the
verifier feeds the model (the processor's torchvision resize alone differs slightly), capped at `max_pixels`.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any

import datasets
import numpy as np
from qwen_vl_utils import fetch_image

from evaluator.data import load_split
from evaluator.protocol import EVAL_TEMPLATE, INHERITED_TEMPLATE, format_prompt
from trainer.config import TrialConfig

TEMPLATES = {"eval": EVAL_TEMPLATE, "inherited": INHERITED_TEMPLATE}
IMAGE_CACHE_ROWS = 256  # ~120 MB of 480x320 images; more distinct rows per generation batch than this: no reuse
_ROW_ID = "_row_id"  # the row's position in the split folder; keys the seeded phrasing choice of "mix"


def conversation(problem: str, template: str) -> list[dict[str, Any]]:
    """One user turn, image first then text, no system message: the verifier's message shape, with TRL's image
    placeholder where the verifier puts the image itself."""
    return [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": format_prompt(problem, template)}]}
    ]


class _ToPrompts:
    """The `with_transform` function: a batch of stored rows -> the columns the trainer reads.

    A class rather than a closure so the dataset stays picklable (dataloader workers, fingerprinting).
    `use_eval` holds, per stored row, whether that row is phrased with the verifier's template; the choice depends
    only on the row, so the `num_generations` copies of a prompt that TRL samples (possibly on different processes)
    all see the same text, as a GRPO group must.
    """

    def __init__(self, use_eval: np.ndarray, max_pixels: int):
        self.use_eval = use_eval
        self.max_pixels = max_pixels
        self._decoder = datasets.Image()
        self._images: OrderedDict[int, Any] = OrderedDict()  # row id -> resized image, least recently used first

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        templates = [EVAL_TEMPLATE if self.use_eval[i] else INHERITED_TEMPLATE for i in batch[_ROW_ID]]
        return {
            "prompt": [conversation(p, t) for p, t in zip(batch["problem"], templates, strict=True)],
            "image": [self._image(row, stored) for row, stored in zip(batch[_ROW_ID], batch["image"], strict=True)],
            "solution": batch["solution"],
        }

    def _image(self, row: int, stored: dict[str, Any]) -> Any:
        """The row's image, decoded and resized once while it stays among the last `IMAGE_CACHE_ROWS` rows read.

        Why a cache: TRL's dataloader yields the whole generation batch (each prompt `num_generations` times) at every
        optimizer step and uses it only at generation steps, so each image was decoded and resized
        num_generations x generation_steps times, a sizeable share of a step (docs/MEASUREMENTS.md). The copies share
        one image object; nothing downstream edits it."""
        image = self._images.pop(row, None)
        if image is None:
            image = fetch_image({"image": self._decoder.decode_example(stored), "max_pixels": self.max_pixels})
            if len(self._images) >= IMAGE_CACHE_ROWS:
                self._images.popitem(last=False)
        self._images[row] = image
        return image


def phrasing_choices(phrasing: str, n_rows: int, seed: int) -> np.ndarray:
    """Per stored row: True when it is phrased with the verifier's template. "mix" draws each row with p=1/2 from
    `seed`, so a round is reproducible and rows differ (the same question text gets both phrasings)."""
    if phrasing == "eval":
        return np.ones(n_rows, dtype=bool)
    if phrasing == "inherited":
        return np.zeros(n_rows, dtype=bool)
    if phrasing == "mix":
        return np.random.default_rng(seed).random(n_rows) < 0.5
    raise ValueError(f"phrasing must be one of {sorted([*TEMPLATES, 'mix'])}, got {phrasing!r}")


def build_train_dataset(config: TrialConfig) -> datasets.Dataset:
    """`config.train_path` (optionally a seeded subset of `train_rows` rows) with `prompt`, `image`, `solution`.

    Only this split is ever trained on.
    """
    stored = load_split(config.train_path)
    # The row id column is added before any subset is taken: `add_column` on a dataset without an indices mapping
    # just appends an in-memory column, while on a `select`ed one it would first copy every selected image.
    stored = stored.select_columns(["image", "problem", "solution"]).add_column(_ROW_ID, list(range(len(stored))))
    use_eval = phrasing_choices(config.phrasing, len(stored), config.seed)
    if config.train_rows is not None and config.train_rows < len(stored):
        # Sorted, like evaluator.data's subsets: reading in folder order keeps the memory-mapped reads sequential.
        stored = stored.select(sorted(random.Random(config.seed).sample(range(len(stored)), config.train_rows)))
    # Stored images reach the transform undecoded: it decodes only the rows its cache does not hold.
    stored = stored.cast_column("image", datasets.Image(decode=False))
    return stored.with_transform(_ToPrompts(use_eval, config.max_pixels))


def build_ood_subset(config: TrialConfig) -> datasets.Dataset | None:
    """The fixed, seeded OOD subset scored during the round (never trained on); None when evaluation is off."""
    if config.eval_every <= 0 or not config.ood_path:
        return None
    return load_split(config.ood_path, limit=config.eval_rows, seed=config.eval_seed)
