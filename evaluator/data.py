"""Loading a counting split from disk, as the box holds it: a `save_to_disk` folder or a folder of parquet/arrow files.

Every bad folder fails here, before a model is loaded, with a message that names the folder and what is wrong:
whatever a folder holds, reading it ends in a DataError.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import datasets
import pyarrow
import pyarrow.parquet
from datasets.exceptions import DatasetGenerationError

from evaluator.protocol import parse_gold

REQUIRED_COLUMNS = ("image", "problem", "solution")
# `save_to_disk` writes these two files beside its arrow shards; a `DatasetDict` writes `dataset_dict.json` instead.
_SAVED_DATASET_FILES = ("state.json", "dataset_info.json")
_SAVED_DICT_FILE = "dataset_dict.json"


class DataError(ValueError):
    """A split folder the evaluator cannot use; the message names the folder and the problem."""


def load_split(path: str | Path, limit: int | None = None, seed: int | None = None) -> datasets.Dataset:
    """The split at `path` with columns image (decoded to PIL), problem, solution.

    `limit`: keep at most this many rows; without `seed` the first ones, with `seed` a seeded random subset
    (kept in the folder's order, so the same seed always picks the same rows).
    """
    folder = Path(path)
    try:
        if not folder.exists():
            raise DataError(f"{folder}: no such folder")
        if not folder.is_dir():
            raise DataError(f"{folder}: not a folder")
        ds = _read(folder)
        missing = [name for name in REQUIRED_COLUMNS if name not in ds.column_names]
        if missing:
            raise DataError(f"{folder}: missing column(s) {', '.join(missing)} (has {', '.join(ds.column_names)})")
        if len(ds) == 0:
            raise DataError(f"{folder}: zero rows")
        return _subset(_decoded_images(ds, folder), limit, seed)
    except DataError:
        raise
    except Exception as error:  # noqa: BLE001 - datasets and pyarrow fail on a damaged folder with many types
        raise DataError(f"{folder}: cannot read it as a split ({type(error).__name__}: {error})") from error


def validate_solutions(ds: datasets.Dataset, source: str = "split") -> list[int]:
    """The gold count of every row, parsed as the verifier does; DataError names the first bad row.

    Reads the solution column alone, so no image is decoded.
    """
    golds = []
    for index, solution in enumerate(ds.select_columns("solution")["solution"]):
        try:
            golds.append(parse_gold(solution))
        except ValueError as error:
            raise DataError(f"{source}: row {index}: {error}") from None
    return golds


def _read(folder: Path) -> datasets.Dataset:
    if (folder / _SAVED_DICT_FILE).exists():
        return _only_split(datasets.load_from_disk(str(folder)), folder)
    if any((folder / name).exists() for name in _SAVED_DATASET_FILES):
        _check_saved_shards(folder)
        return datasets.load_from_disk(str(folder))
    # The top level only: a folder that holds several splits' folders is not one split.
    parquet = sorted(str(p) for p in folder.glob("*.parquet"))
    arrow = sorted(str(p) for p in folder.glob("*.arrow"))
    if parquet and arrow:
        raise DataError(f"{folder}: holds both parquet and arrow files; keep one format per split folder")
    if not parquet and not arrow:
        raise DataError(f"{folder}: neither a save_to_disk folder nor a folder of *.parquet or *.arrow files")
    builder, files = ("parquet", parquet) if parquet else ("arrow", arrow)
    try:
        # datasets cannot read parquet without rows (it fails with "BatchSize must be greater than 0"): count first.
        if parquet and sum(pyarrow.parquet.ParquetFile(file).metadata.num_rows for file in parquet) == 0:
            raise DataError(f"{folder}: zero rows")
        return datasets.load_dataset(builder, data_files=files, split="train")
    except (pyarrow.ArrowException, DatasetGenerationError) as error:
        raise DataError(f"{folder}: cannot read its {builder} files ({error.__cause__ or error})") from error


def _check_saved_shards(folder: Path) -> None:
    """The arrow shards a `save_to_disk` folder's state.json names are there, and there is at least one (an empty
    dataset is saved without any, and `load_from_disk` then fails with an IndexError)."""
    try:
        state = json.loads((folder / "state.json").read_bytes())
    except (OSError, ValueError) as error:
        raise DataError(f"{folder}: state.json is not a readable JSON object ({error})") from None
    shards = state.get("_data_files") if isinstance(state, dict) else None
    named = isinstance(shards, list) and all(isinstance(s, dict) and isinstance(s.get("filename"), str) for s in shards)
    if not named:
        raise DataError(f"{folder}: state.json is not a readable JSON object (no list of _data_files)")
    if not shards:
        raise DataError(f"{folder}: zero rows")
    for shard in shards:
        if not (folder / shard["filename"]).is_file():
            raise DataError(f"{folder}: {shard['filename']} is missing (named by state.json)")


def _only_split(splits: datasets.DatasetDict, folder: Path) -> datasets.Dataset:
    """A saved DatasetDict is accepted when it holds one split: with several, which one to score is a guess."""
    if len(splits) != 1:
        raise DataError(f"{folder}: a DatasetDict with splits {', '.join(splits)}; point at a folder with one split")
    return next(iter(splits.values()))


def _decoded_images(ds: datasets.Dataset, folder: Path) -> datasets.Dataset:
    """Make the image column decode to PIL: parquet written without `datasets` metadata stores {bytes, path}."""
    feature = ds.features["image"]
    if isinstance(feature, datasets.Image) and feature.decode:
        return ds
    stored_as_image = isinstance(feature, datasets.Image) or (
        isinstance(feature, dict) and set(feature) == {"bytes", "path"}
    )
    if not stored_as_image:
        raise DataError(f"{folder}: column image holds {feature}, not images")
    return ds.cast_column("image", datasets.Image())


def subset_indices(n_rows: int, limit: int | None = None, seed: int | None = None) -> list[int]:
    """The row indices `load_split(limit=limit, seed=seed)` keeps of a split of `n_rows`, in the folder's order."""
    if limit is not None and limit < 1:
        raise DataError(f"limit must be a positive number of rows, got {limit}")
    if limit is None or limit >= n_rows:
        return list(range(n_rows))
    if seed is None:
        return list(range(limit))
    return sorted(random.Random(seed).sample(range(n_rows), limit))


def _subset(ds: datasets.Dataset, limit: int | None, seed: int | None) -> datasets.Dataset:
    indices = subset_indices(len(ds), limit, seed)
    return ds if len(indices) == len(ds) else ds.select(indices)
