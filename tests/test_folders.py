"""search/folders.py: the one test of whether a path is inside the study's folder, and of a mount point."""

from __future__ import annotations

import io
import os

import pytest

from search import folders
from search.folders import inside, is_mount_point, overlapping


@pytest.mark.parametrize(
    "path, root, expected",
    [
        ("runs/study/round-0001", "runs/study", True),
        ("runs/study2", "runs/study", False),  # a name that starts like the root is not inside it
        ("runs/study-x/round-0001", "runs/study", False),
        ("runs/study", "runs/study", False),  # strictly below
        ("runs/study/../other", "runs/study", False),
        ("runs", "runs/study", False),
        (None, "runs/study", False),
        (3, "runs/study", False),
        ("runs/study/a\0b", "runs/study", False),
    ],
)
def test_inside_compares_whole_path_components(tmp_path, monkeypatch, path, root, expected):
    monkeypatch.chdir(tmp_path)
    assert inside(path, root) is expected


def test_inside_resolves_symlinks(tmp_path):
    (tmp_path / "runs" / "study").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "runs" / "study" / "link").symlink_to(tmp_path / "elsewhere")
    assert not inside(tmp_path / "runs" / "study" / "link", tmp_path / "runs" / "study")


def test_overlapping_is_equal_or_nested_by_components(tmp_path):
    assert overlapping(tmp_path / "a", tmp_path / "a")
    assert overlapping(tmp_path / "a", tmp_path / "a" / "b") and overlapping(tmp_path / "a" / "b", tmp_path / "a")
    assert not overlapping(tmp_path / "a", tmp_path / "ab")
    assert not overlapping(tmp_path / "a" / "x", tmp_path / "a" / "y")


def test_a_bind_mount_that_os_path_ismount_misses_is_a_mount_point(tmp_path, monkeypatch):
    """A container's volume bound from a folder of the same filesystem: same device as its parent."""
    mounted = tmp_path / "sub mit"
    mounted.mkdir()
    table = f"36 35 98:0 /data {str(mounted).replace(' ', chr(92) + '040')} rw,noatime - ext4 /dev/sda1 rw\n"
    real_open = open
    monkeypatch.setattr(folders, "open", lambda path, *a, **k: io.StringIO(table) if path == "/proc/self/mountinfo"
                        else real_open(path, *a, **k), raising=False)  # fmt: skip
    assert not os.path.ismount(mounted) and is_mount_point(mounted)
    assert not is_mount_point(tmp_path)
