"""Promotion: the best merged model into the submission folder, whole or not at all; and the runs folder kept small.

The submission must be loadable at every instant the box may be stopped. So a new model is copied next to the
submission (same filesystem; a round's own files are hard-linked instead where they can be, `link_tree`), flushed
to disk, checked as the verifier will use it (search.promotion.verification: loaded with the verifier's calls, and
answering the recorded ood_val rows as it did when scored), and only then swapped in with one atomic directory
exchange; the previous submission stays whole until then, and is kept aside afterwards (`.<name>.previous`), so that
the final check in the reserve (`final_check`) can restore it when the submission no longer passes. `PROMOTED.json`
inside the submission records which trial it holds, its accuracy and the answers it must give: it moves with the
model in the same exchange, and only a strictly better model replaces it. A lock on the submission's parent
serializes workers that share one study.

The search deletes only what it wrote. A submission folder holding files no promotion wrote (no PROMOTED.json: a
user's model, notes) has them kept, linked or copied under the study's folder (`kept-<name>-<time>`), before the
first promotion replaces them, mount point or not. The names the search uses beside the submission all start with
`.<name>.` (`.incoming`, `.old`, `.previous`, `.rejected`, `.lock`); a sibling such as `submission.old` is the user's.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import optuna
from optuna.trial import TrialState

from search.promotion import verification
from search.folders import inside, is_mount_point
from search.log import warn
from search.space import MERGE

MARKER = "PROMOTED.json"
_LOG = logging.getLogger(__name__)
# Files of a round folder that hold weights or checkpoints; everything else at its top level is small (logs, JSON).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


class PromotionError(RuntimeError):
    """A model cannot become the submission (it does not load, or the swap failed); one line."""


def promote(
    merged_dir: str | os.PathLike,
    submission_dir: str | os.PathLike,
    *,
    min_format_rate: float,
    format_rate: float | None,
    accuracy: float,
    trial: int | None = None,
    details: dict | None = None,
    check: Callable[[Path], None] | None = None,
    copy_tree: Callable[[str, str], Any] = shutil.copytree,
    timings: dict[str, float] | None = None,
    keep_dir: str | os.PathLike | None = None,
) -> bool:
    """Make `merged_dir` the submission if it clears the format floor and beats the promoted model's accuracy.

    Returns True when the submission now holds it, False when it was refused (format rate below the floor, or not
    strictly better than PROMOTED.json's accuracy). Raises PromotionError when it fails its check; the previous
    submission is then untouched. `details` join PROMOTED.json (`check_rows`: the answers `final_check` expects).
    `check` defaults to `check_submission` (loading only); `copy_tree` is the copy (tests break it). `timings`, when
    given, gets the seconds of each part that ran: "copy", "flush" (to disk), "check". What the submission held that
    no promotion wrote is kept under `keep_dir` (the study's folder; default: beside the submission).
    """
    if format_rate is None or format_rate < min_format_rate:
        _LOG.info("not promoting %s: format rate %s is below the floor %s", merged_dir, format_rate, min_format_rate)
        return False
    check = check or check_submission
    submission = Path(submission_dir)
    with _locked(lock_path(submission)):
        _recover(submission)
        current = promoted(submission)
        if current is not None and accuracy <= current["accuracy"]:
            _LOG.info("not promoting trial %s: %.2f%% does not beat trial %s's %.2f%%",
                      trial, accuracy, current.get("trial"), current["accuracy"])  # fmt: skip
            return False
        in_place = is_mount_point(submission)  # a mount point cannot be renamed: stage inside it instead
        staging = (submission if in_place else submission.parent) / f".{submission.name}.incoming"
        _remove(staging)
        timings = {} if timings is None else timings
        try:
            with _timed(timings, "copy"):
                copy_tree(str(merged_dir), str(staging))
                marker = {"trial": trial, "accuracy": accuracy, "format_rate": format_rate, "time": time.time(),
                          "source": str(Path(merged_dir).resolve()), **(details or {})}  # fmt: skip
                (staging / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
            with _timed(timings, "flush"):
                _fsync_tree(staging, readable=True)
            with _timed(timings, "check"):
                check(staging)
            found = _found_files(submission, staging)
            if found:  # kept whole before anything of the submission is replaced
                _keep(found, submission, Path(keep_dir) if keep_dir is not None else submission.parent)
        except BaseException:
            _remove(staging)
            raise
        if in_place:
            _replace_contents(submission, staging)
        else:
            _swap_in(staging, submission)
        _LOG.info("promoted trial %s (%.2f%%) into %s", trial, accuracy, submission)
        return True


@contextlib.contextmanager
def _timed(timings: dict[str, float], part: str) -> Iterator[None]:
    began = time.monotonic()
    try:
        yield
    finally:
        timings[part] = round(time.monotonic() - began, 1)


def link_tree(source: str, destination: str) -> None:
    """A `copy_tree` for a round's own merged folder: each file hard-linked where the filesystem allows it (the same
    bytes without writing a 4.4 GB copy and flushing it again), copied where it does not (another filesystem, a file
    this user does not own). Nothing writes into a round's merged files once they are saved, and pruning a round
    unlinks its names only, so the submission may share them. Not for the base model's folder: whoever re-saves the
    submission in place would write through to it."""
    shutil.copytree(source, destination, copy_function=_link_or_copy)


def _link_or_copy(source: str, destination: str) -> None:
    if os.stat(source).st_uid == os.geteuid():  # the kernel's protected_hardlinks refuses others' files anyway
        try:
            os.link(source, destination)
            return
        except OSError:  # another filesystem, or one without hard links
            pass
    shutil.copy2(source, destination)


def promoted(submission_dir: str | os.PathLike) -> dict | None:
    """The PROMOTED.json of the submission, or None when it holds no promoted model."""
    try:
        return json.loads((Path(submission_dir) / MARKER).read_text())
    except (OSError, ValueError):
        return None


def recover_submission(submission_dir: str | os.PathLike) -> None:
    """Finish or undo a swap a crash interrupted (only the two-rename fallback can leave one), drop stale staging.

    Run at start: a search that died between the two renames would otherwise leave no submission until its next
    promotion. Takes the lock, so a worker promoting meanwhile keeps its staging folder.
    """
    submission = Path(submission_dir)
    if submission.parent.is_dir():
        with _locked(lock_path(submission)):
            _recover(submission)


def _recover(submission: Path) -> None:
    old = _old_path(submission)
    if old.exists():
        if submission.exists():  # the new submission was renamed in whole: only the keeping aside is left
            _keep_aside(old, submission)
        else:  # died between the two renames: the old submission is whole
            os.rename(old, submission)
    _remove(submission.parent / f".{submission.name}.incoming")
    _remove(submission / f".{submission.name}.incoming")


def check_submission(
    path: str | os.PathLike,
    *,
    data: str | None = None,
    expected: dict | None = None,
    gpus: list[int] | tuple = (),
    batch_size: int | None = None,
    **options: Any,
) -> dict:
    """Check `path` as the verifier will use it (search.promotion.verification.verify: it loads, and with `expected` it
    gives the recorded answers on those rows of the split `data`); returns verify's outcome, raises PromotionError on
    failure."""
    try:
        return verification.verify(path, data, expected, gpus=gpus, batch_size=batch_size, **options)
    except verification.VerificationError as error:
        raise PromotionError(str(error)) from None


@dataclass(frozen=True)
class FinalCheck:
    """What the check of the submission in the reserve found. `line` says it for the summary and the leaderboard."""

    passed: bool
    line: str
    trial: int | None = None  # what the submission holds after the check
    restored: bool = False


def final_check(
    submission_dir: str | os.PathLike,
    data: str,
    *,
    gpus: list[int] | tuple = (),
    batch_size: int | None = None,
    check: Callable[..., None] | None = None,
) -> FinalCheck:
    """Check the submission in place as the verifier will use it, against the answers PROMOTED.json recorded. When
    it fails, the previous submission (checked when it was promoted) is swapped back in. Never raises for a model
    that fails: the result says so."""
    check = check or check_submission
    submission = Path(submission_dir)
    marker = promoted(submission)
    if marker is None:
        return FinalCheck(False, f"FINAL CHECK: {submission} holds no promoted model")
    try:
        check(submission, data=data, expected=marker.get("check_rows"), gpus=gpus, batch_size=batch_size)
    except PromotionError as error:
        failure = f"FINAL CHECK FAILED: the submission (trial {marker.get('trial')}) {error}"
    else:
        rows = len((marker.get("check_rows") or {}).get("index", []))
        what = f"loads and answers {rows} recorded ood_val rows as when scored" if rows else "loads (no recorded answers)"
        return FinalCheck(True, f"final check passed: the submission (trial {marker.get('trial')}) {what}",
                          marker.get("trial"))  # fmt: skip
    previous = restore_previous(submission)
    if previous is None:
        return FinalCheck(False, f"{failure}; there is no previous submission to restore", marker.get("trial"))
    return FinalCheck(
        False,
        f"{failure}; restored the previous submission (trial {previous.get('trial')}, "
        f"{previous.get('accuracy', float('nan')):.1f}% on ood_val, checked when it was promoted)",
        previous.get("trial"),
        restored=True,
    )


def restore_previous(submission_dir: str | os.PathLike) -> dict | None:
    """Swap the previous submission (kept aside at the last promotion) back in; returns its PROMOTED.json, or None
    when there is none. The replaced submission is deleted (its round folder still holds the model)."""
    submission = Path(submission_dir)
    with _locked(lock_path(submission)):
        previous = _previous_path(submission)
        marker = promoted(previous)
        if marker is None:
            return None
        if not _exchange(previous, submission):
            rejected = submission.with_name(f".{submission.name}.rejected")
            _remove(rejected)
            os.rename(submission, rejected)
            os.rename(previous, submission)
            previous = rejected
        _remove(previous)
        _fsync_dir(submission.parent)
        return marker


# ---------------------------------------------------------------------------------------------------------- runs folder
def prune_run_dirs(
    study: optuna.Study,
    keep_rounds: int,
    rounds_dir: str | os.PathLike,
    *,
    keep: set[int] | frozenset = frozenset(),
    merge_top_k: int = 0,
) -> list[Path]:
    """Delete the weights of this study's finished rounds but the best one, the `keep_rounds` next best (the
    `merge_top_k` best when that is more: the merge stage's ingredients), the rounds in `keep` (the one the submission
    holds) and the parents of running rounds (`parent` user attr: a round that continues another starts from its
    merged model; a merge names its ingredients). A merge candidate's weights are kept only in `keep`.

    Weights are a round folder's sub-folders (merged/, checkpoints) and weight files; logs, JSON and plots stay, so
    the leaderboard and the dashboard keep every round's story. Only folders the study's trials name (user attr
    `run_dir`) inside `rounds_dir` (the study's own folder) are touched: a `run_dir` is storage content, which
    whoever can write to a shared database sets. Never a round still running. Returns what was deleted.
    """
    trials = study.get_trials(deepcopy=False)
    completed = [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None]
    rounds = [t for t in completed if t.user_attrs.get("recipe") != MERGE]
    rounds.sort(key=lambda t: t.value, reverse=True)
    keep = {t.number for t in rounds[: max(keep_rounds + 1, merge_top_k)]} | set(keep)
    for t in trials:
        if t.state == TrialState.RUNNING:
            parent = t.user_attrs.get("parent")
            keep |= set(parent) if isinstance(parent, list) else {parent}
    deleted = []
    for trial in trials:
        if trial.number not in keep and trial.state.is_finished():
            deleted += delete_weights(trial.user_attrs.get("run_dir"), rounds_dir)
    return deleted


def delete_weights(folder: object, rounds_dir: str | os.PathLike) -> list[Path]:
    """Delete a round folder's weights (its sub-folders and weight files), if it is a folder inside `rounds_dir`;
    returns what was deleted."""
    if not inside(folder, rounds_dir) or not Path(folder).is_dir() or Path(folder).is_symlink():
        return []
    deleted = []
    for entry in sorted(Path(folder).iterdir()):
        if entry.is_dir() or entry.suffix in _WEIGHT_SUFFIXES:
            _remove(entry)
            deleted.append(entry)
    return deleted


# ---------------------------------------------------------------------------------------------------------- swapping
def _swap_in(staging: Path, submission: Path) -> None:
    """Make `staging` the submission. The previous submission, if any, is whole until the single exchange."""
    if not submission.exists():
        os.rename(staging, submission)
    elif _exchange(staging, submission):
        previous = staging  # the exchange left the previous submission at the staging path
        _keep_aside(previous, submission)
    else:  # no atomic exchange here: two renames; recover_submission repairs a crash between them
        old = _old_path(submission)
        os.rename(submission, old)
        os.rename(staging, submission)
        _keep_aside(old, submission)
    _fsync_dir(submission.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically exchange two paths with Linux renameat2(RENAME_EXCHANGE); False where that is unavailable.

    Python has no API for an atomic exchange of two directories (os.replace cannot replace a non-empty directory),
    hence the libc call through ctypes.
    """
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not glibc >= 2.28 (or not Linux)
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL):  # old kernel, or a filesystem without RENAME_EXCHANGE
        return False
    raise PromotionError(f"exchanging {a} and {b} failed: {os.strerror(err)}")


def _keep_aside(previous: Path, submission: Path) -> None:
    """The replaced submission: a promoted one becomes `.<name>.previous` (replacing the one before it), for
    `restore_previous`; any other was kept by `_keep` before the swap, so this copy goes."""
    if promoted(previous) is not None:
        target = _previous_path(submission)
        _remove(target)
        os.rename(previous, target)
        return
    _remove(previous)


def _found_files(submission: Path, staging: Path) -> list[Path]:
    """The entries of a submission that no promotion wrote (it has no PROMOTED.json), but the staged copy."""
    if not submission.is_dir() or promoted(submission) is not None:
        return []
    return sorted(entry for entry in submission.iterdir() if entry != staging)


def _keep(entries: list[Path], submission: Path, keep_dir: Path) -> Path:
    """Link or copy `entries` into a new `kept-<name>-<time>` folder of `keep_dir` and flush it, before the promotion
    deletes them: hard links where the filesystem allows (no copy of a model-sized folder), copies elsewhere (another
    filesystem, a mount point's). Raises (OSError) before anything is deleted when they cannot be kept."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = keep_dir / f"kept-{submission.name}-{stamp}"
    suffix = 1
    while target.exists() or target.is_symlink():
        target, suffix = keep_dir / f"kept-{submission.name}-{stamp}-{suffix}", suffix + 1
    target.mkdir(parents=True)
    for entry in entries:
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, target / entry.name, symlinks=True, copy_function=_link_or_copy)
        elif entry.is_symlink():
            shutil.copy2(entry, target / entry.name, follow_symlinks=False)
        else:
            _link_or_copy(str(entry), str(target / entry.name))
    _fsync_tree(target)
    warn(f"warning: {submission} held files no promotion wrote (no {MARKER}); kept them in {target}")
    return target


def _replace_contents(submission: Path, staging: Path) -> None:
    """For a submission that is a mount point: swap its entries for the staged ones, PROMOTED.json last.

    Not atomic (a mount point cannot be renamed); a crash in between leaves no PROMOTED.json, so the next promotion
    replaces whatever is there.
    """
    (submission / MARKER).unlink(missing_ok=True)
    for entry in submission.iterdir():
        if entry != staging:
            _remove(entry)
    for entry in staging.iterdir():
        if entry.name != MARKER:
            os.rename(entry, submission / entry.name)
    os.rename(staging / MARKER, submission / MARKER)
    _remove(staging)
    _fsync_dir(submission)


def lock_path(submission: Path) -> Path:
    """The file workers sharing `submission` lock while they promote into it (a plain file next to it)."""
    return submission.parent / f".{submission.name}.lock"


def _old_path(submission: Path) -> Path:
    return submission.with_name(f".{submission.name}.old")


def _previous_path(submission: Path) -> Path:
    return submission.with_name(f".{submission.name}.previous")


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    # O_NOFOLLOW: a symlink planted at the lock's path would have the search open, or create, whatever it names.
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise PromotionError(f"{path} is a symlink; the lock must be a plain file (remove it)") from None
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _fsync_tree(root: Path, *, readable: bool = False) -> None:
    """Flush every file and folder under `root` to disk; with `readable`, open them to every user first (safetensors
    writes its files 0600, and the verifier need not run as the user who trained)."""
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            if os.path.islink(path):  # a kept symlink: its target is not ours to open or open up
                continue
            if readable:
                os.chmod(path, os.stat(path).st_mode | 0o444)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        if readable:
            os.chmod(folder, os.stat(folder).st_mode | 0o555)
        _fsync_dir(Path(folder))


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
