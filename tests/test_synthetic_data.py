"""The rendered counting data: deterministic, correctly labelled, obeying the CoGenT rule, in the box's format."""

from __future__ import annotations

import hashlib
import itertools
import re
import sys
import types
from pathlib import Path

import datasets
import numpy as np
import pyarrow.parquet as pq
import pytest

from evaluator.protocol import parse_gold
from synthetic.__main__ import main
from synthetic.scenes import CONDITIONS, OTHER_COLORS, OTHER_SHAPES, QUESTIONS, SHAPE_COLORS, render_scene
from synthetic.splits import derive_seed, iter_scenes, write_box, write_parquet_split, write_split

SMALL = (112, 112)
BOX_SIZES = {"train": 6, "val": 3, "ood_val": 4, "test_compositional": 2, "test_other": 3}


def _digest(image) -> str:
    return hashlib.sha1(image.tobytes()).hexdigest()


def _blob_count(image) -> int:
    """Connected groups (8-neighbourhood) of pixels that differ from the floor, the image's most common color."""
    pixels = np.asarray(image, dtype=np.int16)
    colors, counts = np.unique(pixels.reshape(-1, 3), axis=0, return_counts=True)
    mask = (np.abs(pixels - colors[counts.argmax()]).sum(axis=2) > 30).tolist()
    height, width = len(mask), len(mask[0])
    seen = [[False] * width for _ in range(height)]
    blobs = 0
    for start_y, start_x in itertools.product(range(height), range(width)):
        if not mask[start_y][start_x] or seen[start_y][start_x]:
            continue
        blobs += 1
        seen[start_y][start_x] = True
        stack = [(start_y, start_x)]
        while stack:
            y, x = stack.pop()
            for ny in range(max(y - 1, 0), min(y + 2, height)):
                for nx in range(max(x - 1, 0), min(x + 2, width)):
                    if mask[ny][nx] and not seen[ny][nx]:
                        seen[ny][nx] = True
                        stack.append((ny, nx))
    return blobs


def _allowed_pairs(condition: str) -> set[tuple[str, str]]:
    return {(shape, color) for shape, colors in SHAPE_COLORS[condition].items() for color in colors}


# --- the renderer ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("condition", CONDITIONS)
def test_same_seed_same_pixels_and_labels(condition):
    image, scene = render_scene(7, condition, SMALL)
    again_image, again_scene = render_scene(7, condition, SMALL)
    assert image.mode == "RGB" and image.size == SMALL
    assert image.tobytes() == again_image.tobytes()
    assert scene == again_scene
    other_image, other_scene = render_scene(8, condition, SMALL)
    assert other_image.tobytes() != image.tobytes()
    assert other_scene != scene


def test_row_seeds_do_not_depend_on_the_process():
    # Python's hash() of a str changes per process; a pinned value catches a switch to it.
    assert derive_seed(0, "train", 0) == 319726663699066854


@pytest.mark.parametrize("condition", ["A", "B"])
def test_count_is_the_number_of_drawn_objects(condition):
    for count, seed in itertools.product(range(1, 11), range(2)):
        image, scene = render_scene(seed, condition, (160, 120), (count, count))
        assert scene.count == len(scene.objects) == count
        assert _blob_count(image) == count, f"seed {seed}"


def test_other_scenes_keep_objects_inside_and_at_most_lightly_overlapping():
    for _, scene in iter_scenes("other", 60, seed=0, image_size=SMALL, count_range=(8, 10)):
        width, height = scene.image_size
        assert 8 <= scene.count == len(scene.objects) <= 10
        for obj in scene.objects:
            assert obj.radius >= 3  # still countable by eye
            assert obj.radius <= obj.x <= width - obj.radius and obj.radius <= obj.y <= height - obj.radius
        for first, second in itertools.combinations(scene.objects, 2):
            apart = max(abs(first.x - second.x), abs(first.y - second.y))
            assert apart >= 0.8 * (first.radius + second.radius)


def test_condition_b_swaps_the_cube_and_cylinder_colors_of_a():
    a, b = SHAPE_COLORS["A"], SHAPE_COLORS["B"]
    assert not set(a["cube"]) & set(a["cylinder"])
    assert (set(b["cube"]), set(b["cylinder"])) == (set(a["cylinder"]), set(a["cube"]))
    assert set(a["sphere"]) == set(b["sphere"]) == set(a["cube"]) | set(a["cylinder"])


def test_condition_rule_separates_a_and_b():
    only_a = _allowed_pairs("A") - _allowed_pairs("B")
    only_b = _allowed_pairs("B") - _allowed_pairs("A")
    assert only_a and only_b
    for kind, condition, forbidden in (("train", "A", only_b), ("compositional", "B", only_a)):
        seen = {
            (obj.shape, obj.color)
            for _, scene in iter_scenes(kind, 150, seed=0, image_size=(64, 64), count_range=(10, 10))
            for obj in scene.objects
        }
        assert not seen & forbidden
        # Every allowed combination shows up: the rule holds because of the table, not because few pairs are drawn.
        assert seen == _allowed_pairs(condition)


def test_other_renderer_uses_none_of_the_clevr_shapes_or_colors():
    seen_shapes, seen_colors = set(), set()
    for _, scene in iter_scenes("other", 40, seed=0, image_size=(64, 64), count_range=(5, 10)):
        seen_shapes |= {obj.shape for obj in scene.objects}
        seen_colors |= {obj.color for obj in scene.objects}
    assert seen_shapes == set(OTHER_SHAPES) and seen_colors == set(OTHER_COLORS)
    assert not seen_shapes & set(SHAPE_COLORS["A"])
    assert not seen_colors & {color for colors in SHAPE_COLORS["A"].values() for color in colors}


def test_kinds_never_share_an_image():
    digests = {
        kind: [_digest(image) for image, _ in iter_scenes(kind, 20, seed=0, image_size=(64, 64))]
        for kind in ("train", "val", "compositional", "other")
    }
    everything = [digest for kind_digests in digests.values() for digest in kind_digests]
    assert len(set(everything)) == len(everything)


# --- the on-disk formats --------------------------------------------------------------------------------------


def test_write_split_round_trips_through_load_from_disk(tmp_path):
    path = write_split(tmp_path / "val", "val", 6, seed=3, image_size=(96, 64), count_range=(2, 5))
    data = datasets.load_from_disk(str(path))
    assert data.column_names == ["image", "problem", "solution"]
    assert isinstance(data.features["image"], datasets.Image)
    expected = list(iter_scenes("val", 6, seed=3, image_size=(96, 64), count_range=(2, 5)))
    assert len(data) == len(expected) == 6
    for row, (image, scene) in zip(data, expected):
        assert row["image"].mode == "RGB" and row["image"].size == (96, 64)
        assert row["image"].tobytes() == image.tobytes()
        assert re.fullmatch(r"<answer> \d+ </answer>", row["solution"])
        assert parse_gold(row["solution"]) == scene.count and 2 <= scene.count <= 5
        assert row["problem"] == scene.question


def test_write_box_writes_the_five_folders(tmp_path):
    paths = write_box(tmp_path / "data", BOX_SIZES, seed=1, image_size=(64, 64))
    assert set(paths) == set(BOX_SIZES)
    folders = {folder: datasets.load_from_disk(str(path)) for folder, path in paths.items()}
    assert {folder: len(data) for folder, data in folders.items()} == BOX_SIZES
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == sorted(BOX_SIZES)  # no temporary leftovers

    # ood_val holds both shifts; the two phrasing sets are disjoint, so the question tells them apart.
    assert not set(QUESTIONS["B"]) & set(QUESTIONS["other"])
    ood_questions = set(folders["ood_val"]["problem"])
    assert ood_questions & set(QUESTIONS["B"]) and ood_questions & set(QUESTIONS["other"])
    assert set(folders["test_compositional"]["problem"]) <= set(QUESTIONS["B"])
    assert set(folders["test_other"]["problem"]) <= set(QUESTIONS["other"])

    digests = {folder: {_digest(row["image"]) for row in data} for folder, data in folders.items()}
    assert not digests["ood_val"] & (digests["test_compositional"] | digests["test_other"])
    assert not digests["val"] & digests["train"]


def test_write_box_checks_everything_before_writing(tmp_path):
    (tmp_path / "test_other").mkdir()
    (tmp_path / "test_other" / "old.parquet").write_text("stale")
    with pytest.raises(FileExistsError, match="test_other"):
        write_box(tmp_path, BOX_SIZES, image_size=(64, 64))
    with pytest.raises(ValueError, match="val"):
        write_box(tmp_path / "fresh", {**BOX_SIZES, "val": 0}, image_size=(64, 64))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["test_other"]


def test_split_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match="kind"):
        write_split(tmp_path / "x", "test", 3, seed=0)
    with pytest.raises(ValueError, match="n must be"):
        write_split(tmp_path / "x", "train", -1, seed=0)
    with pytest.raises(ValueError, match="cannot place 30"):
        write_split(tmp_path / "x", "train", 3, seed=0, image_size=(32, 32), count_range=(30, 30))
    assert not (tmp_path / "x").exists()


def test_parquet_writer_holds_the_same_rows(tmp_path):
    args = ("ood_val", 5, 11, (64, 48), (1, 6))
    from_disk = datasets.load_from_disk(str(write_split(tmp_path / "disk", *args)))
    folder = write_parquet_split(tmp_path / "parquet", *args, num_files=2)
    files = sorted(str(path) for path in Path(folder).glob("*.parquet"))
    assert len(files) == 2
    assert pq.read_schema(files[0]).field("image").type.names == ["bytes", "path"]
    from_parquet = datasets.load_dataset("parquet", data_files=files, split="train", cache_dir=str(tmp_path / "cache"))
    assert from_parquet.column_names == from_disk.column_names == ["image", "problem", "solution"]
    assert from_parquet["problem"] == from_disk["problem"]
    assert from_parquet["solution"] == from_disk["solution"]
    for parquet_row, disk_row in zip(from_parquet, from_disk):
        assert parquet_row["image"].tobytes() == disk_row["image"].tobytes()


# --- the command line -----------------------------------------------------------------------------------------


def test_cli_data_writes_the_box(tmp_path):
    argv = ["data", str(tmp_path), "--seed", "2", "--train", "3", "--val", "2", "--ood-val", "2", "--test", "1"]
    assert main(argv + ["--image-size", "48x40", "--count-range", "1-4"]) == 0
    for folder, size in {"train": 3, "val": 2, "ood_val": 2, "test_compositional": 1, "test_other": 1}.items():
        data = datasets.load_from_disk(str(tmp_path / folder))
        assert len(data) == size and data[0]["image"].size == (48, 40)
        assert 1 <= parse_gold(data[0]["solution"]) <= 4


@pytest.mark.parametrize(
    "bad",
    [
        ["--train", "-3"],
        ["--test", "0"],
        ["--image-size", "48by40"],
        ["--image-size", "16x16"],
        ["--count-range", "5-2"],
    ],
)
def test_cli_rejects_bad_arguments_with_status_2(tmp_path, bad, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["data", str(tmp_path / "out")] + bad)
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_cli_model_dispatches_to_build_model(tmp_path, monkeypatch):
    calls = []
    fake = types.ModuleType("synthetic.models")
    fake.build_model = lambda out_dir, size, seed: calls.append((out_dir, size, seed)) or out_dir
    monkeypatch.setitem(sys.modules, "synthetic.models", fake)
    assert main(["model", str(tmp_path), "--size", "small", "--seed", "4"]) == 0
    assert calls == [(tmp_path, "small", 4)]
