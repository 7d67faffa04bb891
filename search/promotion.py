"""Promotion: the best merged model into the submission folder, whole or not at all; and the runs folder kept small.

The submission must be loadable at every instant the box may be stopped. So a new model is copied next to the
submission (same filesystem), flushed to disk, load-checked as the verifier loads it, and only then swapped in with
one atomic directory exchange; the previous submission stays whole until then. `PROMOTED.json` inside the submission
records which trial it holds and its accuracy: it moves with the model in the same exchange, and only a strictly
better model replaces it. A lock on the submission's parent serializes workers that share one study.
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
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import optuna
from optuna.trial import TrialState

from search.folders import inside

MARKER = "PROMOTED.json"
_LOG = logging.getLogger(__name__)
# Files of a round folder that hold weights or checkpoints; everything else at its top level is small (logs, JSON).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_CHECK_TIMEOUT_S = 1800


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
    check: Callable[[Path], None] | None = None,
    copy_tree: Callable[[str, str], Any] = shutil.copytree,
) -> bool:
    """Make `merged_dir` the submission if it clears the format floor and beats the promoted model's accuracy.

    Returns True when the submission now holds it, False when it was refused (format rate below the floor, or not
    strictly better than PROMOTED.json's accuracy). Raises PromotionError when it does not load; the previous
    submission is then untouched. `check` defaults to `check_submission`; `copy_tree` is the copy (tests break it).
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
        in_place = os.path.ismount(submission)  # a mount point cannot be renamed: stage inside it instead
        staging = (submission if in_place else submission.parent) / f".{submission.name}.incoming"
        _remove(staging)
        try:
            copy_tree(str(merged_dir), str(staging))
            marker = {"trial": trial, "accuracy": accuracy, "format_rate": format_rate, "time": time.time(),
                      "source": str(Path(merged_dir).resolve())}  # fmt: skip
            (staging / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
            _fsync_tree(staging, readable=True)
            check(staging)
        except BaseException:
            _remove(staging)
            raise
        if in_place:
            _replace_contents(submission, staging)
        else:
            _swap_in(staging, submission)
        _LOG.info("promoted trial %s (%.2f%%) into %s", trial, accuracy, submission)
        return True


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
        if submission.exists():  # the new submission was renamed in whole: only the cleanup is left
            _remove(old)
        else:  # died between the two renames: the old submission is whole
            os.rename(old, submission)
    _remove(submission.parent / f".{submission.name}.incoming")
    _remove(submission / f".{submission.name}.incoming")


def check_submission(path: str | os.PathLike) -> None:
    """Load `path` as the verifier does (`from_pretrained` of the model and the processor, offline) and render the
    chat template; raises PromotionError on failure.

    It runs in a subprocess: the weights (4.4 GB in bfloat16 for the 2B model) are freed when it ends, a crash of
    the loader cannot take the search down, and offline mode is set there as in the verifier's clean box.
    """
    root = Path(__file__).resolve().parents[1]
    code = f"import sys; sys.path.insert(0, {str(root)!r}); from search.promotion import _load; _load(sys.argv[1])"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    try:
        result = subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True, text=True,
                                timeout=_CHECK_TIMEOUT_S)  # fmt: skip
    except subprocess.TimeoutExpired:
        raise PromotionError(f"{path}: loading took over {_CHECK_TIMEOUT_S} s") from None
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        raise PromotionError(f"{path} does not load: {lines[-1] if lines else f'exit code {result.returncode}'}")


def _load(path: str) -> None:
    """The verifier's loading calls (run by check_submission in a fresh interpreter)."""
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    from evaluator.protocol import build_messages

    model = Qwen2VLForConditionalGeneration.from_pretrained(path)
    processor = AutoProcessor.from_pretrained(path)
    text = processor.apply_chat_template(build_messages(None, "How many objects?"), tokenize=False,
                                         add_generation_prompt=True)  # fmt: skip
    if "<|image_pad|>" not in text:
        raise SystemExit(f"the chat template does not place the image: {text!r}")
    del model


# ---------------------------------------------------------------------------------------------------------- runs folder
def prune_run_dirs(study: optuna.Study, keep_rounds: int, rounds_dir: str | os.PathLike) -> list[Path]:
    """Delete the weights of this study's finished rounds but the best one and the `keep_rounds` next best.

    Weights are a round folder's sub-folders (merged/, checkpoints) and weight files; logs, JSON and plots stay, so
    the leaderboard and the dashboard keep every round's story. Only folders the study's trials name (user attr
    `run_dir`) inside `rounds_dir` (the study's own folder) are touched: a `run_dir` is storage content, which
    whoever can write to a shared database sets. Never a round still running. Returns what was deleted.
    """
    trials = study.get_trials(deepcopy=False)
    completed = [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None]
    completed.sort(key=lambda t: t.value, reverse=True)
    keep = {t.number for t in completed[: keep_rounds + 1]}
    deleted = []
    for trial in trials:
        folder = trial.user_attrs.get("run_dir")
        if trial.number in keep or not trial.state.is_finished() or not inside(folder, rounds_dir):
            continue
        if not Path(folder).is_dir() or Path(folder).is_symlink():
            continue
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
        _keep_if_foreign(previous, submission)
    else:  # no atomic exchange here: two renames; recover_submission repairs a crash between them
        old = _old_path(submission)
        os.rename(submission, old)
        os.rename(staging, submission)
        _keep_if_foreign(old, submission)
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


def _keep_if_foreign(previous: Path, submission: Path) -> None:
    """Delete the replaced submission, unless someone else put it there (no PROMOTED.json): keep that aside."""
    if promoted(previous) is None and any(previous.iterdir()):
        aside = submission.with_name(f"{submission.name}.before-search")
        if not aside.exists():
            os.rename(previous, aside)
            _LOG.warning("kept the submission found before the search in %s", aside)
            return
    _remove(previous)


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
    return submission.with_name(f"{submission.name}.old")


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
