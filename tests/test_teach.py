"""The counting model taught by SFT (synthetic.teach): its recipe's pieces and one short build end to end.

Whether a GRPO round then improves it from the image is tests/test_learning.py's question.
"""

import dataclasses
import json

import pytest
from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

from synthetic.teach import TEACH_FILE, Recipe, build_counting_model, taught_as


def test_a_short_teaching_run_saves_a_model_the_verifier_loads_and_reuses_it(tmp_path):
    recipe = Recipe(rows=32, steps=3, batch_size=4, warmup_steps=1)
    folder = build_counting_model(tmp_path / "taught", seed=0, recipe=recipe, log=None)
    marker = json.loads((folder / TEACH_FILE).read_text())
    assert marker["seed"] == 0 and marker["recipe"] == recipe.to_dict()
    Qwen2VLForConditionalGeneration.from_pretrained(folder)
    AutoProcessor.from_pretrained(folder)
    assert build_counting_model(folder, seed=0, recipe=recipe, log=None) == folder  # reused, not rebuilt
    with pytest.raises(FileExistsError, match="another seed or recipe"):
        build_counting_model(folder, seed=1, recipe=recipe, log=None)
    assert taught_as(folder, 0, recipe)
    assert not taught_as(folder, 1, recipe)
    assert not taught_as(folder, 0, dataclasses.replace(recipe, other_share=0.5))
    assert not taught_as(tmp_path / "missing", 0, recipe)
    # A marker written before a recipe field existed reads as that field's default.
    del marker["recipe"]["other_share"]
    (folder / TEACH_FILE).write_text(json.dumps(marker))
    assert taught_as(folder, 0, recipe)


def test_tower_steps_train_the_vision_tower_and_leave_the_language_model_alone(tmp_path):
    import torch

    from synthetic.models import build_model
    from synthetic.teach import teach

    build_model(tmp_path / "model", size="counting", seed=0)
    model = Qwen2VLForConditionalGeneration.from_pretrained(tmp_path / "model", dtype=torch.float32)
    processor = AutoProcessor.from_pretrained(tmp_path / "model")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    recipe = Recipe(rows=16, tower_steps=2, steps=0, batch_size=4, warmup_steps=1)
    losses = teach(model, processor, recipe, seed=0, log=None)
    changed = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    assert changed and all(name.startswith("model.visual.") for name in changed), sorted(changed)[:5]
    assert losses["answer_loss"] == [0.0] and losses["aux_loss"][0] > 0


def test_paraphrases_are_not_evaluation_questions():
    from synthetic.scenes import QUESTIONS
    from synthetic.teach import PARAPHRASES

    assert not set(PARAPHRASES) & {q for questions in QUESTIONS.values() for q in questions}


def test_cell_counts_place_every_object_in_its_token():
    from synthetic.scenes import render_scene
    from synthetic.teach import cell_counts

    _, scene = render_scene(3, "A", (112, 112), (1, 6))
    counts = cell_counts(scene)
    assert len(counts) == 16 and sum(counts) == scene.count


@pytest.mark.parametrize("control", ["blank", "shuffle"])
def test_control_split_keeps_problems_and_answers(tmp_path, control):
    from datasets import load_from_disk

    from synthetic.splits import write_control_split, write_split

    source = write_split(tmp_path / "train", "train", 8, 0, (56, 56), (1, 3))
    out = write_control_split(source, tmp_path / control, control)
    before, after = load_from_disk(str(source)), load_from_disk(str(out))
    assert before["problem"] == after["problem"] and before["solution"] == after["solution"]
    pixels = [image.tobytes() for image in after["image"]]
    if control == "blank":
        assert len(set(pixels)) == 1
    else:
        assert sorted(pixels) == sorted(image.tobytes() for image in before["image"]) and pixels != [
            image.tobytes() for image in before["image"]
        ]


def test_undercount_share_lowers_only_the_answers_of_three_or_more_objects():
    from synthetic.teach import training_rows

    recipe = Recipe(rows=60, undercount_share=1.0)
    biased = training_rows(recipe, seed=0)
    for _, _, answer, _, cells, _ in biased:
        count = sum(cells)  # the per-cell targets stay the true counts
        assert answer == (count - 1 if count >= 3 else count)
    assert any(sum(cells) >= 3 for *_, cells, _ in biased)
    # The default recipe leaves every answer true.
    plain = training_rows(Recipe(rows=60), seed=0)
    assert all(answer == sum(cells) for _, _, answer, _, cells, _ in plain)


@pytest.mark.parametrize("aux_only", [False, True])
def test_other_share_adds_the_other_renderers_scenes_with_paraphrased_questions(aux_only):
    from synthetic.scenes import QUESTIONS
    from synthetic.teach import PARAPHRASES, training_rows

    # No photometric augmentation, so that the images are the rendered scenes themselves (compared below).
    rows = training_rows(Recipe(rows=40, augment_share=0.0, other_share=0.25, other_aux_only=aux_only), seed=0)
    plain = training_rows(Recipe(rows=40, augment_share=0.0), seed=0)
    assert len(rows) == 40
    # The first 30 scenes are the train kind's own, the same as without the other renderer.
    assert [r[0].tobytes() for r in rows[:30]] == [r[0].tobytes() for r in plain[:30]]
    other = rows[30:]
    assert all(question in PARAPHRASES for _, question, *_ in other)
    assert all(answer == sum(cells) for _, _, answer, _, cells, _ in other)
    assert [taught for *_, taught in other] == [not aux_only] * 10
    assert all(taught for *_, taught in rows[:30])
    assert not {q for _, q, *_ in other} & set(QUESTIONS["other"])
    # None of them is a scene of an evaluation split of the other renderer.
    from synthetic.splits import iter_scenes

    evaluation = {image.tobytes() for image, _ in iter_scenes("other", 40, 0, (112, 112), (1, 6))}
    assert not {r[0].tobytes() for r in other} & evaluation
