"""Where a study's rounds live on disk, and the one test of whether a path is in there.

Each study keeps its round folders in `runs_dir/<study folder>`. The search deletes (old rounds' weights) and kills
(an orphaned round's processes) only there; a trial's recorded `run_dir` is storage content, which anyone who can
write to a shared database controls, so it is checked against that folder before it is acted on.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path

# A study name used as a folder name as it is: letters, digits, dot, dash and underscore, not starting with a dot.
_PLAIN = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}")


def study_folder(study_name: str) -> str:
    """A folder name for `study_name`: the name itself when it is plain, else its plain characters and a digest of the
    whole name (so that "a/b" and "a:b" never share a folder). Never empty, ".", ".." nor anything with a slash."""
    if _PLAIN.fullmatch(study_name):
        return study_name
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", study_name).strip(".-")[:60] or "study"
    return f"{stem}-{hashlib.sha256(study_name.encode()).hexdigest()[:10]}"


def inside(path: str | os.PathLike, root: str | os.PathLike) -> bool:
    """Whether `path` is strictly below `root` once symlinks and `..` are resolved (False for anything not a path)."""
    if not isinstance(path, (str, os.PathLike)):
        return False
    try:
        real, base = os.path.realpath(path), os.path.realpath(root)
    except (OSError, ValueError):  # a NUL byte, a loop of symlinks
        return False
    return real != base and os.path.commonpath([real, base]) == base


def overlapping(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether `a` and `b` are one folder, or one holds the other, once symlinks and `..` are resolved."""
    return os.path.realpath(a) == os.path.realpath(b) or inside(a, b) or inside(b, a)


def is_mount_point(path: str | os.PathLike) -> bool:
    """Whether `path` is a mount point, which cannot be renamed. os.path.ismount misses a bind mount of a folder of
    the same filesystem (a container's volume), so the kernel's table of this process's mounts is read too."""
    if os.path.ismount(path):
        return True
    real = os.path.realpath(path)
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as table:
            # Field 5 is the mount point, with space, tab, newline and backslash written as octal escapes.
            points = {_unescape(line.split(" ")[4]) for line in table if line.count(" ") >= 4}
    except OSError:  # not Linux
        return False
    return real in points


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def unwritable(folder: Path, *, must_exist: bool) -> str | None:
    """What stops the search from writing in `folder` (a folder it creates when `must_exist` is False: then its
    nearest existing ancestor must take it), or None. Writes nothing that outlives the check."""
    probe = folder
    if not must_exist:
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
    if not probe.is_dir():
        return f"{probe} {'does not exist' if not probe.exists() else 'is not a folder'}"
    try:  # a real write: os.access says yes to root even where writes fail (read-only mounts aside)
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as exc:
        return f"{probe} is not writable: {exc.strerror}"
    return None
