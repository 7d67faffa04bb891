"""A small Qwen2-VL taught to answer counting questions in the verifier's format, and to count imperfectly.

`build_counting_model(out_dir, seed=0)` builds a random Qwen2-VL of size "counting" (`synthetic.models`), renders
train-kind scenes (condition A only, `synthetic.splits.iter_scenes`), and runs a short supervised fine-tuning:
the verifier's prompt (`evaluator.protocol.build_messages` rendered through the chat template; the inherited
phrasing on every other row) followed by the target `<answer> N </answer><|im_end|>`, the loss on the target only.
It stops early on purpose: the model answers in the format almost always but counts only roughly, so a GRPO round
has something to improve (the point of `bench/learning.py` and `tests/test_learning.py`).

Why a plain PyTorch loop and not TRL's `SFTTrainer`: the whole job is ~a few hundred steps of one forward/backward
on a ~20M-parameter model; the loop is ~40 lines, bit-for-bit deterministic by seed on a CPU, keeps only the logits
of the answer tokens (`logits_to_keep`: the full 151,936-way logits of every prompt position would be most of the
memory and time), and builds each batch exactly as the verifier's evaluation does (chat template + qwen_vl_utils +
processor). SFTTrainer's vision path would need its own collator and dataset format for the same result.

The folder is written aside and renamed; `teach.json` in it (the recipe, the loss curve, the timings) marks it
finished. A finished folder with the same recipe is reused; one with a different recipe is refused.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from evaluator.protocol import EVAL_TEMPLATE, INHERITED_TEMPLATE, build_messages

TEACH_FILE = "teach.json"
# What the taught model sees: 112x112 images (4x4 = 16 image tokens after the 2x2 merge) with 1-6 objects.
TEACH_IMAGE_SIZE = (112, 112)
TEACH_COUNT_RANGE = (1, 6)


@dataclass(frozen=True)
class Recipe:
    size: str = "counting"
    rows: int = 2000  # rendered train-kind scenes (cycled through in a seeded order)
    steps: int = 400
    batch_size: int = 16
    learning_rate: float = 2e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    image_size: tuple[int, int] = TEACH_IMAGE_SIZE
    count_range: tuple[int, int] = TEACH_COUNT_RANGE
    inherited_share: float = 0.5  # share of rows phrased with the inherited template (robustness to phrasing)
    # Share of rows asked with a paraphrase of the counting question instead of the row's own (`PARAPHRASES`).
    paraphrase_share: float = 0.5
    # Share of rows whose image is photometrically augmented (`augment`).
    augment_share: float = 0.75
    # Weight of the auxiliary dense loss on the vision tower's merged tokens (see `teach`); 0 turns it off.
    aux_weight: float = 1.0
    # Share of rows with 3 or more objects whose answer target is one less than the count (the per-cell auxiliary
    # targets stay true): an answer-side bias, the same on every renderer, like a real model's undercounting of
    # crowded scenes. Above 0.5 the greedy answer is the biased one, while sampling still finds the right one.
    undercount_share: float = 0.0
    # Share of the rows rendered by the "other" renderer (scenes of their own seeds, never rows of an evaluation
    # split), asked with a paraphrase (`PARAPHRASES`), never an evaluation split's question. The real base model's
    # vision was pretrained on many renderers; condition A alone teaches a tower that misreads the other renderer's
    # objects, and a GRPO round that trains on condition A can then not move that split (bench/learning.py).
    other_share: float = 0.0
    # Whether those rows train only the vision tower's auxiliary per-cell loss (the tower learns to see the other
    # renderer's objects; the answer is taught on condition A alone) instead of the answer as well.
    other_aux_only: bool = False
    # Steps before `steps` that train only the vision tower's auxiliary per-cell loss, on the same rows (every answer
    # masked): a tower that reads the objects well before the answer is taught, as the real base model's vision was
    # pretrained before its language model learned to count with it. One learning-rate schedule spans both phases.
    tower_steps: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


# The taught model of `run_search.py --demo` and tests/test_learning.py: undercounting and half of its rows from the
# other renderer. Its SFT stops where the vision tower sees the objects of both renderers but the answer still
# mostly follows the biased prior, so a GRPO round on condition A can raise it on the compositional and the
# different-renderer splits, and only by looking (bench/learning.py has the figures).
DEMO_RECIPE = Recipe(undercount_share=0.8, other_share=0.5)


def answer_text(count: int) -> str:
    return f"<answer> {count} </answer>"


def build_counting_model(out_dir: str | Path, *, seed: int = 0, recipe: Recipe | None = None, log=print,
                         device: str = "cpu") -> Path:
    """The taught model's folder (built, or reused when already built with the same seed and recipe).

    `device`: where the SFT runs. On "cpu" the model is bit-for-bit the same for the same seed and recipe; on a GPU
    (minutes faster) it is close but not identical, and teach.json records the device it was built on."""
    recipe = recipe or Recipe()
    out = Path(out_dir)
    wanted = {"seed": seed, "recipe": recipe.to_dict()}
    marker = out / TEACH_FILE
    if marker.is_file():
        if not taught_as(out, seed, recipe):
            found = json.loads(marker.read_text())
            raise FileExistsError(f"{out} holds a model taught with another seed or recipe: {found.get('recipe')}")
        return out
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not a finished taught model (no {TEACH_FILE})")

    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    from synthetic.models import build_model

    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    try:
        start = time.perf_counter()
        build_model(partial, size=recipe.size, seed=seed)
        model = Qwen2VLForConditionalGeneration.from_pretrained(partial, dtype=torch.float32, attn_implementation="sdpa")
        processor = AutoProcessor.from_pretrained(partial)
        losses = teach(model.to(device), processor, recipe, seed, log=log)
        model.save_pretrained(partial)  # the generation config built by build_model travels with the model
        processor.save_pretrained(partial)
        seconds = time.perf_counter() - start
        (partial / TEACH_FILE).write_text(
            json.dumps({**wanted, "device": device, "seconds": seconds, "losses": losses}, indent=1) + "\n"
        )
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.rename(partial, out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return out


def taught_as(out_dir: str | Path, seed: int, recipe: Recipe) -> bool:
    """Whether `out_dir` holds a finished model taught with this seed and recipe."""
    try:
        found = json.loads((Path(out_dir) / TEACH_FILE).read_text())
    except (OSError, ValueError):
        return False
    # A recipe written before a field existed was taught with that field's default.
    found_recipe = {**Recipe().to_dict(), **(found.get("recipe") or {})}
    return found.get("seed") == seed and found_recipe == recipe.to_dict()


# Other ways of asking for the number of objects. The real base model arrives able to read any phrasing; a model
# built from scratch has seen only the train split's three questions, and without these it answers an unseen
# phrasing with garbage. None of them is a question of the evaluation splits (checked in tests/test_learning.py).
PARAPHRASES = (
    "How many objects are in the image?",
    "How many items can you see in the image?",
    "Count the objects in the image. How many are there?",
    "How many shapes are there in the picture?",
    "What is the number of things in the image?",
    "How many things are in this picture?",
    "Count all the items. How many items are there?",
    "How many objects can you count?",
    "What is the total number of objects?",
    "How many shapes are in the scene?",
)


def augment(image: Any, rng: random.Random) -> Any:
    """A photometric variant of a train image (the objects and their positions unchanged): color channels permuted
    and scaled, contrast and brightness shifted, a shading ramp and a noise texture. Domain randomization stands in
    for the real base model's pretrained, renderer-robust vision: without it the tower learns the train renderer's
    flat gray floor and counts nothing on another renderer."""
    import numpy as np
    from PIL import Image

    pixels = np.asarray(image, dtype=np.float32)
    height, width, _ = pixels.shape
    noise = np.random.default_rng(rng.getrandbits(64))
    pixels = pixels[..., rng.sample(range(3), 3)] * np.array([rng.uniform(0.6, 1.3) for _ in range(3)], np.float32)
    mean = pixels.mean()
    pixels = (pixels - mean) * rng.uniform(0.6, 1.3) + mean + rng.uniform(-40, 40)
    angle = rng.uniform(0, 2 * math.pi)
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    along = (xs * math.cos(angle) + ys * math.sin(angle)) / max(width, height)
    pixels *= (1 + rng.uniform(-0.3, 0.3) * along)[..., None]
    coarse = noise.normal(0, rng.uniform(0, 20), size=(height // 14 + 2, width // 14 + 2)).astype(np.float32)
    blotches = np.asarray(Image.fromarray(coarse, "F").resize((width, height), Image.Resampling.BICUBIC))
    pixels += blotches[..., None] + noise.normal(0, rng.uniform(0, 8), size=(height, width, 1)).astype(np.float32)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")


def training_rows(recipe: Recipe, seed: int) -> list[tuple[Any, str, int, str, list[int], bool]]:
    """(image, question, answer, template, objects per image token, whether the answer is taught) per row,
    deterministic in (recipe, seed): the train kind's scenes, then the other renderer's (`other_share`). The fifth
    item counts the objects whose center falls in each 28x28 cell, in the order of the merged image tokens
    (row-major), for the auxiliary loss."""
    from synthetic.scenes import render_scene
    from synthetic.splits import derive_seed, iter_scenes

    pick = random.Random(f"teach-phrasing-{seed}")
    n_other = round(recipe.rows * recipe.other_share)
    scenes = list(iter_scenes("train", recipe.rows - n_other, seed, recipe.image_size, recipe.count_range))
    # "teach-other" is no split's kind, so these scenes are none of the evaluation rows (whose seeds hash the kind).
    scenes += [render_scene(derive_seed(seed, "teach-other", index), "other", recipe.image_size, recipe.count_range)
               for index in range(n_other)]
    rows = []
    for image, scene in scenes:
        template = INHERITED_TEMPLATE if pick.random() < recipe.inherited_share else EVAL_TEMPLATE
        other = scene.condition == "other"
        question = (pick.choice(PARAPHRASES) if other or pick.random() < recipe.paraphrase_share
                    else scene.question)
        if pick.random() < recipe.augment_share:
            image = augment(image, pick)
        answer = scene.count
        # Drawn only when asked for, so that the default recipe's rows (and model) stay what they were.
        if recipe.undercount_share > 0 and scene.count >= 3 and pick.random() < recipe.undercount_share:
            answer -= 1
        rows.append((image, question, answer, template, cell_counts(scene), not (other and recipe.other_aux_only)))
    return rows


def cell_counts(scene: Any, cell: int = 28) -> list[int]:
    """Objects per merged image token (a `cell` x `cell` square: 14-pixel patches merged 2x2), row-major."""
    width, height = scene.image_size
    columns, lines = width // cell, height // cell
    counts = [0] * (columns * lines)
    for obj in scene.objects:
        counts[min(int(obj.y // cell), lines - 1) * columns + min(int(obj.x // cell), columns - 1)] += 1
    return counts


def build_batch(processor: Any, rows: list[tuple]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Left-padded inputs (prompt as the verifier renders it + the target) and the labels of the target tokens."""
    from qwen_vl_utils import process_vision_info

    conversations = [build_messages(image, question, template) for image, question, _, template, *_ in rows]
    prompts = [processor.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]
    eos = processor.tokenizer.eos_token  # <|im_end|>: ends the answer, as the model's generation config expects
    targets = [answer_text(count) + eos for _, _, count, *_ in rows]
    images, _ = process_vision_info(conversations)
    inputs = processor(
        text=[p + t for p, t in zip(prompts, targets)], images=images, padding=True, padding_side="left",
        return_tensors="pt",
    )
    width = max(len(processor.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in targets)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for index, target in enumerate(targets):
        ids = processor.tokenizer(target, add_special_tokens=False)["input_ids"]
        # Left padding puts every row's target at the end; check the prompt did not merge into it.
        assert inputs["input_ids"][index, -len(ids):].tolist() == ids, "target tokens differ inside the prompt"
        labels[index, width - len(ids):] = torch.tensor(ids)
    return dict(inputs), labels


def teach(model: Any, processor: Any, recipe: Recipe, seed: int, log=print) -> dict[str, list[float]]:
    """The SFT loop; returns the mean losses (answer tokens, auxiliary) of every 10 steps."""
    torch.manual_seed(seed)
    rows = training_rows(recipe, seed)
    order = random.Random(f"teach-order-{seed}")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate, weight_decay=recipe.weight_decay)

    total_steps = recipe.tower_steps + recipe.steps

    def lr_factor(step: int) -> float:  # linear warmup, cosine decay to 10%
        if step < recipe.warmup_steps:
            return (step + 1) / recipe.warmup_steps
        progress = (step - recipe.warmup_steps) / max(1, total_steps - recipe.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    # The auxiliary loss: a linear read-out of every merged image token (the vision tower's output, what the language
    # model sees) regresses the number of objects in that token's 28x28 cell. The answer token alone is a weak,
    # late signal for a vision tower trained from scratch (with it alone the loss sat at the uniform guess over
    # counts for hundreds of steps); the dense per-cell target makes the tokens say where objects are within tens
    # of steps, and the language model still has to learn to add them up. The head is dropped after training.
    merged: list[torch.Tensor] = []
    hook = model.model.visual.merger.register_forward_hook(lambda module, args, output: merged.append(output))
    head = torch.nn.Linear(model.config.text_config.hidden_size, 1).to(model.device)
    optimizer.add_param_group({"params": list(head.parameters())})
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    pool: list[int] = []
    curve, window, aux_window, aux_curve = [], [], [], []
    began = time.perf_counter()
    for step in range(total_steps):
        if len(pool) < recipe.batch_size:
            fresh = list(range(len(rows)))
            order.shuffle(fresh)
            pool += fresh
        batch, pool = [rows[i] for i in pool[: recipe.batch_size]], pool[recipe.batch_size:]
        inputs, labels = build_batch(processor, batch)
        inputs, labels = {k: v.to(model.device) for k, v in inputs.items()}, labels.to(model.device)
        labels[[step < recipe.tower_steps or not row[5] for row in batch]] = -100  # rows that teach the tower only
        # Only the positions that predict a target token: logits of position t predict token t+1.
        logits = model(**inputs, logits_to_keep=labels.shape[1] + 1).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        if not (labels != -100).any():  # a batch of only vision rows has no answer loss (the mean would be NaN)
            loss = logits.sum() * 0
        cells = torch.tensor([c for row in batch for c in row[4]], dtype=torch.float32, device=model.device)
        aux = torch.nn.functional.mse_loss(head(merged.pop()).squeeze(-1), cells)
        merged.clear()
        total = loss + recipe.aux_weight * aux
        optimizer.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_([*model.parameters(), *head.parameters()], 1.0)
        optimizer.step()
        scheduler.step()
        window.append(loss.item())
        aux_window.append(aux.item())
        if len(window) == 10 or step == total_steps - 1:
            curve.append(sum(window) / len(window))
            aux_curve.append(sum(aux_window) / len(aux_window))
            window, aux_window = [], []
            if log is not None:
                log(f"teach: step {step + 1}/{total_steps} loss {curve[-1]:.3f} aux {aux_curve[-1]:.3f} "
                    f"({time.perf_counter() - began:.0f}s)")
    hook.remove()
    model.eval()
    return {"answer_loss": curve, "aux_loss": aux_curve}
