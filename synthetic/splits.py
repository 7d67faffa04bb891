"""Rendered counting splits in the box's on-disk format: columns `image`, `problem`, `solution`.

`write_split` writes one split with `save_to_disk`, `write_parquet_split` the same rows as parquet files, and
`write_box` the box's whole layout. Every row comes from `iter_scenes`, whose row seeds are a stable hash of
(seed, kind, row index): two kinds never share an image, and the same arguments give the same rows.
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from datasets import Dataset, Features, Image, Value
from PIL.Image import Image as PILImage

from synthetic.scenes import Scene, check_render_args, render_scene

FEATURES = Features({"image": Image(), "problem": Value("string"), "solution": Value("string")})

# The scene condition of each kind of split; "ood_val" interleaves its conditions row by row.
KIND_CONDITIONS: dict[str, tuple[str, ...]] = {
    "train": ("A",),
    "val": ("A",),
    "compositional": ("B",),
    "other": ("other",),
    "ood_val": ("B", "other"),
}

# The box's folders and the kind each holds (the test folders stand in for the hidden test sets). The kinds differ
# and row seeds hash the kind, so no two folders share a row.
BOX_FOLDERS: dict[str, str] = {
    "train": "train",
    "val": "val",
    "ood_val": "ood_val",
    "test_compositional": "compositional",
    "test_other": "other",
}
DEFAULT_SIZES: dict[str, int] = {
    "train": 2000,
    "val": 200,
    "ood_val": 200,
    "test_compositional": 500,
    "test_other": 500,
}


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from `parts`, the same in every process (Python's hash() of a str is salted per process)."""
    digest = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def solution_text(count: int) -> str:
    return f"<answer> {count} </answer>"


def iter_scenes(
    kind: str,
    n: int,
    seed: int,
    image_size: tuple[int, int] = (480, 320),
    count_range: tuple[int, int] = (1, 10),
) -> Iterator[tuple[PILImage, Scene]]:
    """The `n` scenes of a split, in row order."""
    _check_split_args(kind, n, image_size, count_range)
    conditions = KIND_CONDITIONS[kind]
    for index in range(n):
        yield render_scene(derive_seed(seed, kind, index), conditions[index % len(conditions)], image_size, count_range)


def _rows(kind: str, n: int, seed: int, image_size: tuple[int, int], count_range: tuple[int, int]) -> Iterator[dict]:
    for image, scene in iter_scenes(kind, n, seed, image_size, count_range):
        yield {"image": image, "problem": scene.question, "solution": solution_text(scene.count)}


def _check_split_args(kind: str, n: int, image_size: tuple[int, int], count_range: tuple[int, int]) -> None:
    if kind not in KIND_CONDITIONS:
        raise ValueError(f"kind must be one of {tuple(KIND_CONDITIONS)}, got {kind!r}")
    # datasets 5.2 writes an empty split that load_from_disk then cannot read back.
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive number of rows, got {n!r}")
    check_render_args(image_size, count_range)
    # One scene at the largest count, so a count range the image has no room for fails here, before any writing,
    # rather than inside datasets' generator, which wraps the error.
    for condition in KIND_CONDITIONS[kind]:
        render_scene(0, condition, image_size, (count_range[1], count_range[1]))


def _check_free(out_dir: Path) -> None:
    # Refuse to write over a folder: stale shards or parquet files left in it would be read as rows.
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} already exists and is not empty")


def _render_and_write(
    out_dir: Path,
    write: Callable[[Dataset, Path], None],
    kind: str,
    n: int,
    seed: int,
    image_size: tuple[int, int],
    count_range: tuple[int, int],
) -> Path:
    """Renders the rows (the one code path both formats share) into a Dataset, then `write`s it to `out_dir`."""
    _check_split_args(kind, n, image_size, count_range)
    out_dir = Path(out_dir)
    _check_free(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # The generator's arrow cache goes next to the output rather than into ~/.cache, and is removed afterwards.
    with tempfile.TemporaryDirectory(prefix=f".{out_dir.name}-", dir=out_dir.parent) as cache_dir:
        dataset = Dataset.from_generator(
            _rows,
            features=FEATURES,
            gen_kwargs={
                "kind": kind,
                "n": n,
                "seed": seed,
                "image_size": tuple(image_size),
                "count_range": tuple(count_range),
            },
            cache_dir=cache_dir,
        )
        write(dataset, out_dir)
    return out_dir


def write_split(
    out_dir: str | Path,
    kind: str,
    n: int,
    seed: int,
    image_size: tuple[int, int] = (480, 320),
    count_range: tuple[int, int] = (1, 10),
) -> Path:
    """`n` rows of `kind` written with `Dataset.save_to_disk` (what `datasets.load_from_disk` reads)."""
    return _render_and_write(
        Path(out_dir), lambda dataset, path: dataset.save_to_disk(str(path)), kind, n, seed, image_size, count_range
    )


def write_parquet_split(
    out_dir: str | Path,
    kind: str,
    n: int,
    seed: int,
    image_size: tuple[int, int] = (480, 320),
    count_range: tuple[int, int] = (1, 10),
    num_files: int = 1,
) -> Path:
    """The same rows as `write_split`, as `num_files` parquet files (images as {"bytes", "path"} structs)."""
    _check_split_args(kind, n, image_size, count_range)
    if isinstance(num_files, bool) or not isinstance(num_files, int) or not 1 <= num_files <= n:
        raise ValueError(f"num_files must be between 1 and n={n}, got {num_files!r}")

    def write(dataset: Dataset, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        for index in range(num_files):
            shard = dataset.shard(num_files, index, contiguous=True)
            shard.to_parquet(str(path / f"{kind}-{index:05d}-of-{num_files:05d}.parquet"))

    return _render_and_write(Path(out_dir), write, kind, n, seed, image_size, count_range)


def write_box(
    root: str | Path,
    sizes: dict[str, int] | None = None,
    seed: int = 0,
    image_size: tuple[int, int] = (480, 320),
    count_range: tuple[int, int] = (1, 10),
) -> dict[str, Path]:
    """The box's data layout under `root`: train/ val/ ood_val/ test_compositional/ test_other/.

    `sizes` maps folder names to row counts; folders it leaves out get `DEFAULT_SIZES`. Each folder holds a
    different kind and row seeds hash the kind, so ood_val never repeats a test image and val never a train image.
    Everything is checked before anything is written."""
    unknown = set(sizes or {}) - set(BOX_FOLDERS)
    if unknown:
        raise ValueError(f"sizes names unknown folders {sorted(unknown)}; the folders are {list(BOX_FOLDERS)}")
    sizes = {**DEFAULT_SIZES, **(sizes or {})}
    check_render_args(image_size, count_range)
    root = Path(root)
    for folder, kind in BOX_FOLDERS.items():
        try:
            _check_split_args(kind, sizes[folder], image_size, count_range)
        except ValueError as error:
            raise ValueError(f"{folder}: {error}") from None
        _check_free(root / folder)
    return {
        folder: write_split(root / folder, kind, sizes[folder], seed, image_size, count_range)
        for folder, kind in BOX_FOLDERS.items()
    }


# ------------------------------------------------------------------------------------------- image controls
CONTROLS = ("blank", "shuffle")


def write_control_split(source: str | Path, out_dir: str | Path, control: str, seed: int = 0) -> Path:
    """A copy of the split at `source` (a `save_to_disk` folder) whose images carry no information about the count:
    the same problems and solutions in the same order, with every image replaced by a solid gray one of its size
    ("blank"), or the images permuted across rows by a seeded permutation ("shuffle").

    A GRPO round on such a split is the control of a learning experiment: any gain it shows does not come from
    looking at the image."""
    import random

    from datasets import load_from_disk
    from PIL import Image as PILImageModule

    if control not in CONTROLS:
        raise ValueError(f"control must be one of {CONTROLS}, got {control!r}")
    out_dir = Path(out_dir)
    _check_free(out_dir)
    rows = load_from_disk(str(source))
    if control == "shuffle":
        order = list(range(len(rows)))
        random.Random(derive_seed(seed, "shuffle", len(rows))).shuffle(order)
        images = rows.select(order)["image"]
    else:
        images = [PILImageModule.new("RGB", image.size, (128, 128, 128)) for image in rows["image"]]
    dataset = Dataset.from_dict(
        {"image": images, "problem": rows["problem"], "solution": rows["solution"]}, features=FEATURES
    )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    dataset.save_to_disk(str(out_dir))
    return out_dir
