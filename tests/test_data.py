"""evaluator.data: the split folders the box may hold load to the same rows, and bad folders fail clearly."""

from __future__ import annotations

from pathlib import Path

import datasets
import PIL.Image
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from evaluator.data import DataError, load_split, validate_solutions
from synthetic.splits import write_parquet_split


@pytest.fixture(scope="module")
def parquet_dir(tiny_split_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same rows as tiny_split_dir (same kind, seed, sizes), as two parquet files."""
    folder = tmp_path_factory.mktemp("parquet") / "val"
    return write_parquet_split(folder, "val", 8, seed=0, image_size=(56, 56), count_range=(1, 3), num_files=2)


def _rows(ds: datasets.Dataset) -> list[tuple[str, str, bytes]]:
    return [(row["problem"], row["solution"], row["image"].tobytes()) for row in ds]


def test_save_to_disk_and_parquet_folders_load_the_same_rows(tiny_split_dir: Path, parquet_dir: Path) -> None:
    saved, parquet = load_split(tiny_split_dir), load_split(parquet_dir)
    assert len(saved) == 8
    assert isinstance(saved[0]["image"], PIL.Image.Image) and isinstance(parquet[0]["image"], PIL.Image.Image)
    assert _rows(saved) == _rows(parquet)


def test_parquet_without_datasets_metadata_decodes_images(tiny_split_dir: Path, tmp_path: Path) -> None:
    # Parquet written by plain pyarrow stores images as {bytes, path} structs and carries no feature types.
    table = pa.Table.from_pylist(list(load_split(tiny_split_dir).cast_column("image", datasets.Image(decode=False))))
    pq.write_table(table.replace_schema_metadata(None), tmp_path / "rows.parquet")
    assert _rows(load_split(tmp_path)) == _rows(load_split(tiny_split_dir))


def test_a_dataset_dict_folder_with_one_split_loads(tiny_split_dir: Path, tmp_path: Path) -> None:
    ds = load_split(tiny_split_dir)
    datasets.DatasetDict({"validation": ds}).save_to_disk(str(tmp_path / "one"))
    assert _rows(load_split(tmp_path / "one")) == _rows(ds)
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "two"))
    with pytest.raises(DataError, match="train, test"):
        load_split(tmp_path / "two")


def test_limit_takes_the_first_rows_and_a_seed_a_fixed_random_subset(tiny_split_dir: Path) -> None:
    everything = _rows(load_split(tiny_split_dir))
    assert _rows(load_split(tiny_split_dir, limit=3)) == everything[:3]
    assert _rows(load_split(tiny_split_dir, limit=100)) == everything
    first, again, other = (_rows(load_split(tiny_split_dir, limit=4, seed=seed)) for seed in (1, 1, 2))
    assert first == again and first != other
    # A subset keeps the folder's order.
    assert [everything.index(row) for row in first] == sorted(everything.index(row) for row in first)
    with pytest.raises(DataError, match="limit"):
        load_split(tiny_split_dir, limit=0)


def test_bad_folders_are_named_with_the_problem(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no such folder"):
        load_split(tmp_path / "absent")
    (tmp_path / "file.parquet").write_text("not a folder")
    with pytest.raises(DataError, match="not a folder"):
        load_split(tmp_path / "file.parquet")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="empty.*neither a save_to_disk folder nor"):
        load_split(tmp_path / "empty")


def test_a_missing_column_and_zero_rows_are_named(tmp_path: Path) -> None:
    image = PIL.Image.new("RGB", (28, 28))
    no_solution = datasets.Dataset.from_dict({"image": [image], "problem": ["How many?"]})
    no_solution = no_solution.cast_column("image", datasets.Image())
    no_solution.save_to_disk(str(tmp_path / "no_solution"))
    with pytest.raises(DataError, match=r"no_solution: missing column\(s\) solution"):
        load_split(tmp_path / "no_solution")
    (tmp_path / "zero").mkdir()
    schema = pa.schema({"image": pa.struct({"bytes": pa.binary(), "path": pa.string()}), "problem": pa.string(),
                        "solution": pa.string()})
    pq.write_table(schema.empty_table(), tmp_path / "zero" / "rows.parquet")
    with pytest.raises(DataError, match="zero: zero rows"):
        load_split(tmp_path / "zero")


def test_validate_solutions_returns_the_gold_counts_and_names_the_first_bad_row() -> None:
    ds = datasets.Dataset.from_dict({"solution": ["<answer> 3 </answer>", " 7 ", "<answer> two </answer>", "x"]})
    with pytest.raises(DataError, match="val: row 2:"):
        validate_solutions(ds, source="val")
    assert validate_solutions(ds.select(range(2))) == [3, 7]
