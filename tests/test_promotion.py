"""Promotion: the submission is always whole, only a strictly better model replaces it, workers serialize."""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest
from optuna.trial import TrialState, create_trial

from search.promotion import submission as promotion
from search.promotion.submission import (
    MARKER,
    PromotionError,
    check_submission,
    final_check,
    link_tree,
    promote,
    promoted,
    prune_run_dirs,
    recover_submission,
    restore_previous,
)


def _no_check(path: Path) -> None:
    """Stands in for the real load check where the 'models' are a few text files."""


def _model(folder: Path, tag: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2_vl", "tag": tag}))
    (folder / "model.safetensors").write_text(tag * 1000)
    (folder / "tokenizer.json").write_text(tag)
    return folder


def _tag(submission: Path) -> str:
    return json.loads((submission / "config.json").read_text())["tag"]


def _promote(merged: Path, submission: Path, accuracy: float, **kwargs) -> bool:
    kwargs.setdefault("check", _no_check)
    kwargs.setdefault("format_rate", 98.0)
    return promote(merged, submission, min_format_rate=90.0, accuracy=accuracy, trial=int(accuracy), **kwargs)


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name not in ("submission", ".submission.lock"))


def test_first_promotion_writes_model_and_marker(tmp_path):
    merged, submission = _model(tmp_path / "runs" / "a" / "merged", "a"), tmp_path / "app" / "submission"
    submission.parent.mkdir()
    assert _promote(merged, submission, 70.0)
    assert _tag(submission) == "a" and (submission / "model.safetensors").read_text() == "a" * 1000
    assert promoted(submission)["trial"] == 70 and promoted(submission)["accuracy"] == 70.0
    assert _leftovers(submission.parent) == []
    assert merged.is_dir()  # copied, not moved: the round folder stays whole


def test_a_promotion_times_its_copy_flush_and_check(tmp_path, monkeypatch):
    merged, submission = _model(tmp_path / "a", "a"), tmp_path / "submission"
    clock = [0.0]  # promotion's monotonic clock, moved only by the copy and the check below
    monkeypatch.setattr(promotion, "time", SimpleNamespace(monotonic=lambda: clock[0], time=time.time))

    def copy_tree(source, target):
        clock[0] += 2.0
        shutil.copytree(source, target)

    def check(path):
        clock[0] += 3.0

    timings = {}
    assert _promote(merged, submission, 70.0, check=check, copy_tree=copy_tree, timings=timings)
    assert timings == {"copy": 2.0, "flush": 0.0, "check": 3.0}
    refused = {}
    assert not _promote(merged, submission, 60.0, timings=refused)  # not better: nothing was copied or checked
    assert refused == {}


def test_a_rounds_own_files_are_linked_into_the_submission_and_outlive_its_pruning(tmp_path):
    merged, submission = _model(tmp_path / "runs" / "round-0001" / "merged", "a"), tmp_path / "submission"
    (merged / "model.safetensors").chmod(0o600)  # as safetensors writes it
    assert _promote(merged, submission, 70.0, copy_tree=link_tree)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert os.path.samefile(submission / name, merged / name)  # one file, two names: nothing was copied
    assert (submission / "model.safetensors").stat().st_mode & 0o444 == 0o444
    shutil.rmtree(merged)  # the round pruned
    assert _tag(submission) == "a" and (submission / "model.safetensors").read_text() == "a" * 1000


@pytest.mark.parametrize("why", ["another filesystem", "another user's file"])
def test_files_that_cannot_be_linked_are_copied(tmp_path, monkeypatch, why):
    merged, target = _model(tmp_path / "merged", "a"), tmp_path / "linked"
    if why == "another filesystem":
        def cross_device(source, destination):
            raise OSError(errno.EXDEV, "Invalid cross-device link")

        monkeypatch.setattr(promotion.os, "link", cross_device)
    else:
        monkeypatch.setattr(promotion.os, "geteuid", lambda: os.stat(merged / "config.json").st_uid + 1)
    link_tree(str(merged), str(target))
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert not os.path.samefile(target / name, merged / name)
        assert (target / name).read_bytes() == (merged / name).read_bytes()


def test_the_submission_is_readable_by_every_user(tmp_path):
    merged = _model(tmp_path / "a", "a")
    (merged / "model.safetensors").chmod(0o600)  # as safetensors writes it
    submission = tmp_path / "submission"
    assert _promote(merged, submission, 70.0)
    assert all(p.stat().st_mode & 0o444 == 0o444 for p in submission.iterdir())
    assert submission.stat().st_mode & 0o555 == 0o555


def test_an_empty_existing_submission_folder_is_replaced(tmp_path):
    submission = tmp_path / "submission"
    submission.mkdir()
    assert _promote(_model(tmp_path / "a", "a"), submission, 70.0)
    assert _tag(submission) == "a" and _leftovers(tmp_path) == ["a"]


def test_only_a_strictly_better_model_replaces_the_submission(tmp_path):
    submission = tmp_path / "submission"
    assert _promote(_model(tmp_path / "a", "a"), submission, 70.0)
    assert not _promote(_model(tmp_path / "b", "b"), submission, 70.0)  # a tie is not better
    assert not _promote(_model(tmp_path / "c", "c"), submission, 65.0)
    assert _tag(submission) == "a"
    assert _promote(_model(tmp_path / "d", "d"), submission, 70.5)
    assert _tag(submission) == "d" and promoted(submission)["accuracy"] == 70.5
    # No staging left behind; the replaced submission is kept aside for the final check to restore.
    assert _leftovers(tmp_path) == [".submission.previous", "a", "b", "c", "d"]
    assert _tag(tmp_path / ".submission.previous") == "a"


def test_below_the_format_floor_is_refused_without_touching_anything(tmp_path):
    submission = tmp_path / "submission"
    assert not _promote(_model(tmp_path / "a", "a"), submission, 99.0, format_rate=80.0)
    assert not _promote(_model(tmp_path / "b", "b"), submission, 99.0, format_rate=None)
    assert not submission.exists() and _leftovers(tmp_path) == ["a", "b"]


def test_a_copy_failing_midway_leaves_the_old_submission_whole(tmp_path):
    submission = tmp_path / "submission"
    _promote(_model(tmp_path / "a", "a"), submission, 70.0)
    before = {p.name: p.read_bytes() for p in submission.iterdir()}

    def broken_copy(source: str, target: str) -> None:
        Path(target).mkdir()
        shutil.copy(Path(source) / "config.json", target)  # half the files, then the disk fills
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        _promote(_model(tmp_path / "b", "b"), submission, 90.0, copy_tree=broken_copy)
    assert {p.name: p.read_bytes() for p in submission.iterdir()} == before
    assert _leftovers(tmp_path) == ["a", "b"]


def test_a_model_that_does_not_load_is_not_promoted(tmp_path):
    submission = tmp_path / "submission"
    _promote(_model(tmp_path / "a", "a"), submission, 70.0)

    def failing_check(path: Path) -> None:
        assert path.name == ".submission.incoming"  # the staged copy itself is what gets checked
        raise PromotionError(f"{path} does not load: broken")

    with pytest.raises(PromotionError, match="does not load"):
        _promote(_model(tmp_path / "b", "b"), submission, 90.0, check=failing_check)
    assert _tag(submission) == "a" and _leftovers(tmp_path) == ["a", "b"]


def test_two_rename_fallback_and_recovery(tmp_path, monkeypatch):
    monkeypatch.setattr(promotion, "_exchange", lambda a, b: False)  # a filesystem without RENAME_EXCHANGE
    submission = tmp_path / "submission"
    _promote(_model(tmp_path / "a", "a"), submission, 70.0)
    assert _promote(_model(tmp_path / "b", "b"), submission, 80.0)
    assert _tag(submission) == "b" and _leftovers(tmp_path) == [".submission.previous", "a", "b"]

    # A crash between the two renames: the old submission was moved aside, the new one not yet in place.
    submission.rename(tmp_path / ".submission.old")
    _model(tmp_path / ".submission.incoming", "half")
    recover_submission(submission)
    assert _tag(submission) == "b" and _leftovers(tmp_path) == [".submission.previous", "a", "b"]
    # A crash after both renames: only keeping the old one aside is left.
    (tmp_path / ".submission.previous").rename(tmp_path / ".submission.old")
    recover_submission(submission)
    assert _tag(submission) == "b" and _leftovers(tmp_path) == [".submission.previous", "a", "b"]
    # The final check's restore works without the atomic exchange too.
    assert restore_previous(submission)["trial"] == 70
    assert _tag(submission) == "a" and _leftovers(tmp_path) == ["a", "b"]


def test_the_exchange_is_atomic_renameat2(tmp_path):
    a, b = _model(tmp_path / "x", "x"), _model(tmp_path / "y", "y")
    if not promotion._exchange(a, b):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not available on this kernel or filesystem")
    assert _tag(a) == "y" and _tag(b) == "x"


def _kept(folder: Path) -> list[Path]:
    return sorted(folder.glob("kept-submission-*"))


def test_a_submission_found_before_the_search_is_kept_under_the_studys_folder(tmp_path, capsys):
    submission = _model(tmp_path / "submission", "users")  # no PROMOTED.json: not ours
    (submission / "notes.txt").write_text("mine")
    study_folder = tmp_path / "runs" / "count-grpo"
    assert _promote(_model(tmp_path / "a", "a"), submission, 10.0, keep_dir=study_folder)
    [kept] = _kept(study_folder)
    assert _tag(submission) == "a" and _tag(kept) == "users" and (kept / "notes.txt").read_text() == "mine"
    assert "kept them in" in capsys.readouterr().err
    # A second promotion replaces a promoted submission: nothing more is kept.
    assert _promote(_model(tmp_path / "b", "b"), submission, 20.0, keep_dir=study_folder)
    assert _kept(study_folder) == [kept] and _tag(kept) == "users"


def test_a_submission_found_before_the_search_is_kept_even_when_a_copy_was_kept_before(tmp_path):
    """Two searches (two study folders, or the same one twice in a second): each keeping is a new folder."""
    for tag in ("first", "second"):
        submission = _model(tmp_path / "submission", tag)
        assert _promote(_model(tmp_path / f"m-{tag}", "m"), submission, 10.0, keep_dir=tmp_path / "kept")
        shutil.rmtree(submission)
    assert sorted(_tag(kept) for kept in _kept(tmp_path / "kept")) == ["first", "second"]


def _unrenamable(monkeypatch, folder: Path) -> None:
    """`folder` behaves as a mount point: it cannot be renamed or exchanged (EBUSY), and is_mount_point says so."""
    real_rename = os.rename

    def rename(src, dst, *args, **kwargs):
        if Path(src) == folder or Path(dst) == folder:
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(src))
        return real_rename(src, dst, *args, **kwargs)

    def exchange(a, b):
        if folder in (Path(a), Path(b)):
            raise PromotionError(f"exchanging {a} and {b} failed: {os.strerror(errno.EBUSY)}")
        return False

    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(promotion, "_exchange", exchange)
    monkeypatch.setattr(promotion, "is_mount_point", lambda path: Path(path) == folder)


def test_a_mount_point_submission_keeps_the_files_found_in_it(tmp_path, monkeypatch):
    submission = tmp_path / "mnt" / "submission"
    submission.mkdir(parents=True)
    (submission / "data").mkdir()
    (submission / "data" / "rows.parquet").write_text("the user's data")
    (submission / "readme.txt").write_text("hello")
    os.symlink("/nowhere", submission / "dangling")
    _unrenamable(monkeypatch, submission)
    keep = tmp_path / "runs" / "study"
    assert _promote(_model(tmp_path / "a", "a"), submission, 70.0, keep_dir=keep)
    assert _tag(submission) == "a" and not (submission / "readme.txt").exists()
    [kept] = _kept(keep)
    assert (kept / "data" / "rows.parquet").read_text() == "the user's data"
    assert (kept / "readme.txt").read_text() == "hello" and os.readlink(kept / "dangling") == "/nowhere"
    # The next promotion replaces a promoted submission in place; nothing more to keep.
    assert _promote(_model(tmp_path / "b", "b"), submission, 80.0, keep_dir=keep)
    assert _tag(submission) == "b" and _kept(keep) == [kept]


def test_files_that_cannot_be_kept_are_not_deleted(tmp_path, monkeypatch):
    submission = _model(tmp_path / "submission", "users")
    monkeypatch.setattr(promotion, "_keep", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space")))
    with pytest.raises(OSError, match="No space"):
        _promote(_model(tmp_path / "a", "a"), submission, 70.0, keep_dir=tmp_path / "runs")
    assert _tag(submission) == "users" and not (tmp_path / ".submission.incoming").exists()


def test_a_users_submission_old_is_never_touched(tmp_path, monkeypatch):
    """`submission.old` beside the submission is the user's: neither a crash's leftover nor a place the swap uses."""
    monkeypatch.setattr(promotion, "_exchange", lambda a, b: False)  # the two-rename swap, which moves one aside
    submission = tmp_path / "submission"
    users = _model(tmp_path / "submission.old", "users")
    _promote(_model(tmp_path / "a", "a"), submission, 70.0)
    recover_submission(submission)
    assert _promote(_model(tmp_path / "b", "b"), submission, 80.0)
    recover_submission(submission)
    assert _tag(users) == "users" and _tag(submission) == "b"
    shutil.rmtree(submission)  # and with no submission, recovery does not take it for a swap cut short
    recover_submission(submission)
    assert not submission.exists() and _tag(users) == "users"


def test_workers_serialize_on_the_lock(tmp_path):
    submission = tmp_path / "submission"
    submission.parent.mkdir(exist_ok=True)
    merged = _model(tmp_path / "a", "a")
    result = {}
    with promotion._locked(tmp_path / ".submission.lock"):  # another worker is promoting
        worker = threading.Thread(target=lambda: result.setdefault("ok", _promote(merged, submission, 70.0)))
        worker.start()
        time.sleep(0.5)
        assert worker.is_alive() and not submission.exists()
    worker.join(timeout=10)
    assert result == {"ok": True} and _tag(submission) == "a"


def test_the_lock_is_not_followed_through_a_symlink(tmp_path):
    """A symlink planted at the lock's path would have the search open (or create) what it names, as root maybe."""
    submission = tmp_path / "submission"
    (tmp_path / ".submission.lock").symlink_to(tmp_path / "created-elsewhere")
    with pytest.raises(PromotionError, match=r"\.submission\.lock is a symlink"):
        _promote(_model(tmp_path / "a", "a"), submission, 70.0)
    with pytest.raises(PromotionError, match="is a symlink"):
        recover_submission(submission)
    assert not (tmp_path / "created-elsewhere").exists() and not submission.exists()


def test_prune_run_dirs_keeps_the_best_rounds_and_every_log(tmp_path):
    study = optuna.create_study(direction="maximize")
    runs = tmp_path / "runs"
    for name in ("a", "b", "c", "d", "p", "running", "other-study"):
        _model(runs / name / "merged", name)
        (runs / name / "progress.jsonl").write_text("{}\n")
        (runs / name / "adapter.safetensors").write_text("w")
    for value, name in ((50.0, "a"), (70.0, "b"), (60.0, "c"), (40.0, "d")):
        study.add_trial(create_trial(value=value, user_attrs={"run_dir": str(runs / name)}))
    study.add_trial(create_trial(state=TrialState.PRUNED, user_attrs={"run_dir": str(runs / "p")}))
    study.ask().set_user_attr("run_dir", str(runs / "running"))

    deleted = prune_run_dirs(study, keep_rounds=1, rounds_dir=runs)
    assert sorted(p.relative_to(runs).as_posix() for p in deleted) == [
        "a/adapter.safetensors", "a/merged", "d/adapter.safetensors", "d/merged", "p/adapter.safetensors", "p/merged"
    ]  # fmt: skip
    for kept in ("b", "c", "running", "other-study"):
        assert (runs / kept / "merged").is_dir()
    assert (runs / "a" / "progress.jsonl").is_file()
    assert prune_run_dirs(study, keep_rounds=1, rounds_dir=runs) == []


def test_prune_run_dirs_deletes_nothing_outside_the_studys_rounds_folder(tmp_path):
    """A finished trial's run_dir is storage content: whoever can write to a shared database can point it anywhere.
    Outside runs_dir/<study> (by path, by `..`, or through a symlink) nothing is deleted; inside, pruning goes on."""
    study = optuna.create_study(direction="maximize")
    rounds = tmp_path / "runs" / "study"
    outside = tmp_path / "precious"
    _model(outside / "merged", "precious")
    (outside / "weights.safetensors").write_text("w")
    (rounds / "round-0003").mkdir(parents=True)
    (rounds / "round-0003" / "link").symlink_to(outside)  # a round folder may hold a link out: only it goes
    (rounds / "round-0004").symlink_to(outside, target_is_directory=True)
    _model(rounds / "round-0005" / "merged", "ours")
    recorded = [str(outside), str(rounds / ".." / ".." / "precious"), str(rounds / "round-0004"), "/", str(rounds),
                str(tmp_path), 5, ["a"], str(rounds / "round-0003"), str(rounds / "round-0005")]
    for i, run_dir in enumerate(recorded):
        study.add_trial(create_trial(value=float(i), user_attrs={"run_dir": run_dir}))
    study.add_trial(create_trial(value=100.0, user_attrs={"run_dir": str(rounds / "best")}))
    before = sorted(str(p) for p in outside.rglob("*"))

    deleted = prune_run_dirs(study, keep_rounds=0, rounds_dir=rounds)
    assert sorted(deleted) == [rounds / "round-0003" / "link", rounds / "round-0005" / "merged"]
    assert sorted(str(p) for p in outside.rglob("*")) == before and (outside / "merged" / "config.json").is_file()
    assert (tmp_path / "runs").is_dir() and (rounds / "round-0004").is_symlink()


def test_prune_run_dirs_keeps_the_parent_of_a_running_round_and_the_submissions_round(tmp_path):
    study = optuna.create_study(direction="maximize")
    runs = tmp_path / "runs"
    for value, name in ((70.0, "best"), (60.0, "parent"), (50.0, "held"), (40.0, "neither")):
        _model(runs / name / "merged", name)
        study.add_trial(create_trial(value=value, user_attrs={"run_dir": str(runs / name)}))
    child = study.ask()  # a round running from trial 1's merged weights
    child.set_user_attr("parent", 1)
    deleted = prune_run_dirs(study, 0, runs, keep={2})  # trial 2 is what this box's submission holds
    assert [p.relative_to(runs).as_posix() for p in deleted] == ["neither/merged"]
    study.tell(child, 65.0)  # the child is done: its parent is an ordinary round again
    assert sorted(p.relative_to(runs).as_posix() for p in prune_run_dirs(study, 0, runs)) == [
        "held/merged", "parent/merged"
    ]  # fmt: skip


def test_final_check_restores_the_previous_submission_when_the_current_one_fails(tmp_path):
    submission = tmp_path / "submission"
    assert _promote(_model(tmp_path / "a", "a"), submission, 60.0, details={"check_rows": {"index": [0]}})
    assert _promote(_model(tmp_path / "b", "b"), submission, 70.0)
    seen = []

    def check(path, **kwargs):
        seen.append((_tag(path), kwargs["data"]))
        if _tag(path) == "b":
            raise PromotionError(f"{path} answers 9 of 50 ood_val rows otherwise than when it was scored")

    result = final_check(submission, "ood_val", check=check)
    assert seen == [("b", "ood_val")] and not result.passed and result.restored and result.trial == 60
    assert result.line.startswith("FINAL CHECK FAILED: the submission (trial 70) ")
    assert "answers 9 of 50" in result.line and "restored the previous submission (trial 60, 60.0% on ood_val" in result.line
    assert _tag(submission) == "a" and promoted(submission)["check_rows"] == {"index": [0]}
    assert _leftovers(tmp_path) == ["a", "b"]  # the failed copy is gone; its round folder keeps the model
    # Nothing left to restore: the failure is still a loud line, and the submission stays.
    result = final_check(submission, "ood_val", check=lambda path, **kwargs: (_ for _ in ()).throw(PromotionError("x")))
    assert not result.passed and not result.restored and result.line.endswith("no previous submission to restore")
    assert _tag(submission) == "a"
    assert final_check(submission, "ood_val", check=lambda path, **kwargs: None).passed
    assert final_check(tmp_path / "empty", "ood_val").line.startswith("FINAL CHECK: ")


def test_check_submission_loads_a_real_model(tmp_path, tiny_model_dir):
    check_submission(tiny_model_dir)
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(tiny_model_dir / "config.json", broken)
    with pytest.raises(PromotionError, match=r"broken does not load: "):
        check_submission(broken)


def test_promote_with_the_real_check(tmp_path, tiny_model_dir):
    submission = tmp_path / "submission"
    assert promote(tiny_model_dir, submission, min_format_rate=0, format_rate=50.0, accuracy=1.0, trial=3)
    assert promoted(submission)["trial"] == 3 and (submission / MARKER).is_file()
    check_submission(submission)
