"""Tests written for the survivors of the mutation run (bench/mutation.py; the figures and the list of survivors in
bench/results/2026-12-07-cpu-mutation.md): each one kills mutants a user would have been hurt by. CPU, seconds."""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path

import pytest

from evaluator import protocol
from search import folders, selection


# --- evaluator/protocol.py -------------------------------------------------------------------------------------------


def test_the_messages_carry_the_template_they_are_given():
    """The prompt a round trains and is scored with is the configured template's, not silently the default one."""
    messages = protocol.build_messages("image", "How many apples?", template="Q: {question} A:")
    assert messages[0]["content"][1] == {"type": "text", "text": "Q: How many apples? A:"}


# --- trainer/rewards.py ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reward", ["accuracy", "count_closeness", "brevity"])
def test_a_reward_refuses_a_batch_whose_columns_do_not_pair_up(reward):
    """A completion is paid against its own gold count (and its own token ids): a batch whose columns differ in length
    is refused, never silently paired with a shifted or shortened column."""
    from trainer import rewards

    completions = ["<answer>3</answer>", "<answer>4</answer>"]
    with pytest.raises(ValueError):
        rewards.REWARDS[reward](completions=completions, solution=["3"], completion_ids=[[1]])
    with pytest.raises(ValueError):
        rewards.REWARDS[reward](completions=completions[:1], solution=["3", "4"], completion_ids=[[1], [2]])


# --- search/folders.py -----------------------------------------------------------------------------------------------


def test_a_studys_folder_name_is_stable():
    """A resumed study finds its round folders: the folder of a name that is not plain is its plain characters (upper
    case kept, runs of others one dash, no leading or trailing dot or dash, at most 60) and 10 hex digits of the
    name's SHA-256, the same on every version that reads the study."""

    def digest(name: str) -> str:
        return hashlib.sha256(name.encode()).hexdigest()[:10]

    assert folders.study_folder("My Study/2") == f"My-Study-2-{digest('My Study/2')}"
    assert folders.study_folder(".hidden:") == f"hidden-{digest('.hidden:')}"
    assert folders.study_folder("..") == f"study-{digest('..')}"
    assert folders.study_folder("X:X") == f"X-X-{digest('X:X')}"  # only dots and dashes are stripped from the ends
    assert folders.study_folder("ÄÖ") == f"study-{digest('ÄÖ')}"
    long = "A" * 70 + "/"
    assert folders.study_folder(long) == f"{'A' * 60}-{digest(long)}"
    assert folders.study_folder("plain_Name-1.0") == "plain_Name-1.0"


def _fake_mountinfo(monkeypatch, content: bytes | None, tmp_path: Path) -> None:
    """/proc/self/mountinfo read from a file of `content` (None: unreadable, as on a system without /proc)."""
    table = tmp_path / "mountinfo"
    if content is not None:
        table.write_bytes(content)
    real_open = open

    def fake_open(path, *args, **kwargs):
        if path == "/proc/self/mountinfo":
            if content is None:
                raise FileNotFoundError(path)
            return real_open(table, *args, **kwargs)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(folders, "open", fake_open, raising=False)


def test_without_a_mount_table_a_plain_folder_is_no_mount_point_and_the_root_is_one(tmp_path, monkeypatch):
    """Where the kernel's table cannot be read, os.path.ismount still decides: the root is a mount point (never
    renamed), a folder of the same filesystem is not (the submission is swapped by rename as usual)."""
    _fake_mountinfo(monkeypatch, None, tmp_path)
    assert folders.is_mount_point("/")
    assert not folders.is_mount_point(tmp_path)


def test_a_mount_table_with_bytes_that_are_not_utf8_is_still_read(tmp_path, monkeypatch):
    """A mount point whose name is not UTF-8 (another volume's) does not hide the submission's bind mount, nor crash
    the check."""
    mounted = tmp_path / "sub mit"
    mounted.mkdir()
    escaped = str(mounted).replace(" ", "\\040").encode()
    content = (b"35 30 0:1 / /mnt/caf\xe9 rw - ext4 /dev/sdb1 rw\n"
               b"36 35 98:0 /data " + escaped + b" rw,noatime - ext4 /dev/sda1 rw\n")  # fmt: skip
    _fake_mountinfo(monkeypatch, content, tmp_path)
    assert folders.is_mount_point(mounted)
    assert not folders.is_mount_point(tmp_path)


def test_a_folder_nobody_can_write_to_is_reported(tmp_path):
    """check_box's writability test writes in the folder itself: /proc refuses even root, and says so."""
    why = folders.unwritable(Path("/proc"), must_exist=True)
    assert why is not None and why.startswith("/proc is not writable")
    assert folders.unwritable(tmp_path, must_exist=True) is None
    assert folders.unwritable(tmp_path / "a" / "b", must_exist=False) is None
    assert not (tmp_path / "a").exists()  # the check writes nothing that outlives it


# --- search/selection.py ---------------------------------------------------------------------------------------------


def test_a_row_is_correct_only_when_its_answer_equals_the_gold_count():
    """The per-row correctness the paired comparison and the leaderboard read: an answer counts only when equal."""
    per_row = {"index": [0, 1, 2, 3], "answer": [3, 2, None, 0], "gold": [3, 4, 1, 0]}
    assert selection.correctness(per_row) == [True, False, False, True]


def test_a_report_with_fewer_answers_than_rows_is_refused():
    """A truncated report is never scored on the rows it happens to have."""
    with pytest.raises(ValueError):
        selection.correctness({"answer": [1, 2], "gold": [1, 2, 3]})


@pytest.mark.parametrize("n", range(0, 10))
def test_rows_packed_into_a_study_read_back_as_they_were(n):
    """A round's per-row correctness, stored in the study as hex, reads back row for row, whatever the row count."""
    rows = [(i * 7) % 3 != 1 for i in range(n)]
    assert selection.unpack(selection.pack(rows), n) == rows
    attr = selection.rows_attr({"index": list(range(n)), "answer": [int(r) for r in rows], "gold": [1] * n})
    assert selection.read_rows_attr({selection.OOD_ROWS: attr})[1] == rows


def test_the_packed_rows_and_the_digest_keep_their_format():
    """Studies written by earlier versions stay comparable: the packed rows and the rows' digest are the same bytes."""
    assert selection.pack([True, False, True, True, False]) == "b0"
    assert selection.pack([]) == ""
    per_row = {"index": [4, 7], "gold": [2, 5], "answer": [2, 1]}
    identity = json.dumps([[4, 7], [2, 5]], separators=(",", ":"))
    assert selection.rows_digest(per_row) == hashlib.sha256(identity.encode()).hexdigest()[:16]
    assert selection.rows_attr(per_row) == {"n": 2, "digest": selection.rows_digest(per_row), "correct": "8"}


def test_a_lead_needs_the_same_rows_on_both_sides():
    """Two rounds scored on different rows are not compared (no silently shortened pairing)."""
    with pytest.raises(ValueError, match="got 1 and 2"):
        selection.paired_lead([True], [True, False])
    with pytest.raises(ValueError, match="got 0 and 0"):
        selection.paired_lead([], [])


def test_the_paired_interval_on_few_rows():
    """The lead's interval: one row has no spread (no division by zero); two rows use the sample variance (n - 1)."""
    one = selection.paired_lead([True], [False])
    assert (one.points, one.low, one.high, one.n) == (100.0, 100.0, 100.0, 1)
    two = selection.paired_lead([True, False], [False, False])
    half = selection.Z_95 * (0.5 / 2) ** 0.5
    assert two.n == 2 and two.points == 50.0
    assert two.low == pytest.approx(100 * (0.5 - half)) and two.high == pytest.approx(100 * (0.5 + half))


# --- search/verification.py: the answers check as the search reads its checker's outcome -----------------------------


class _Checker:
    """A checker subprocess that answers `outcome` (or exits `returncode` with `stderr`) without loading anything."""

    def __init__(self, stdout: str, stderr: str = "", returncode: int = 0):
        self.stdout, self.stderr, self.returncode, self.request, self.timeout = stdout, stderr, returncode, None, None

    def poll(self):
        return self.returncode

    def communicate(self, request=None, timeout=None):
        self.request, self.timeout = json.loads(request), timeout
        return self.stdout, self.stderr

    def kill(self):
        pass


def _checked(monkeypatch, checker: _Checker, **kwargs) -> dict:
    from search.promotion import verification

    monkeypatch.setattr(verification, "_take_ready", lambda: None)
    monkeypatch.setattr(verification, "_start_checker", lambda: checker)
    monkeypatch.setattr(verification, "_keep_ready", False)
    return verification.verify("model-dir", "split-dir", {"index": [0, 1], "answer": [2, 3]}, **kwargs)


def _outcome(rows: int, differ: int, allowed: int) -> str:
    marks = [100.0, 101.5, 104.0]
    outcome = {"rows": rows, "differ": differ, "allowed": allowed, "differing_rows": list(range(differ)),
               "device": "cpu", "marks": marks}  # fmt: skip
    return "log line\nanother\n" + json.dumps(outcome) + "\n"


def test_a_model_within_the_tolerance_passes_and_its_check_is_timed(monkeypatch):
    """As many differing rows as allowed pass; the outcome gives every part of the check's time, in order."""
    from search.promotion import verification

    checker = _Checker(_outcome(rows=50, differ=2, allowed=2))
    outcome = _checked(monkeypatch, checker, gpus=[2, 5], batch_size=8, max_new_tokens=32)
    assert (outcome["rows"], outcome["differ"], outcome["allowed"]) == (50, 2, 2)
    assert list(outcome["seconds"]) == list(verification.CHECK_PARTS) and "marks" not in outcome
    assert outcome["seconds"]["load"] == 1.5 and outcome["seconds"]["answers"] == 2.5
    assert checker.request == {"model": "model-dir", "data": "split-dir", "batch_size": 8,
                               "expected": {"index": [0, 1], "answer": [2, 3]}, "max_new_tokens": 32,
                               "cuda_visible_devices": "2,5"}  # fmt: skip
    assert checker.timeout == verification.TIMEOUT_S  # a hung checker cannot hang the search


def test_a_model_past_the_tolerance_fails_its_check_naming_the_rows(monkeypatch):
    """One differing row more than allowed: the folder is not the model that was scored, and the error says which
    rows differ and how many may."""
    from search.promotion.verification import VerificationError

    with pytest.raises(VerificationError) as error:
        _checked(monkeypatch, _Checker(_outcome(rows=50, differ=12, allowed=2)))
    assert str(error.value) == ("model-dir answers 12 of 50 ood_val rows otherwise than when it was scored (at most 2 "
                                "may differ): rows [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]")  # fmt: skip
    with pytest.raises(VerificationError, match="answers 3 of 50"):
        _checked(monkeypatch, _Checker(_outcome(rows=50, differ=3, allowed=2)))


def test_a_checker_that_fails_says_why_in_one_line(monkeypatch):
    """The checker's last words are the error; a silent crash still names its exit code."""
    from search.promotion.verification import VerificationError

    checker = _Checker("", "Traceback ...\n  line\ndoes not load: OSError: bad file\n\n", returncode=1)
    with pytest.raises(VerificationError) as error:
        _checked(monkeypatch, checker)
    assert str(error.value) == "model-dir does not load: OSError: bad file"
    with pytest.raises(VerificationError) as error:
        _checked(monkeypatch, _Checker("", "", returncode=-11))
    assert str(error.value) == "model-dir failed the check: exit code -11"


def test_a_load_only_check_sends_no_data(monkeypatch):
    """Without recorded answers the check only loads the model: the request names no split."""
    from search.promotion import verification

    checker = _Checker(_outcome(rows=0, differ=0, allowed=0))
    monkeypatch.setattr(verification, "_take_ready", lambda: None)
    monkeypatch.setattr(verification, "_start_checker", lambda: checker)
    monkeypatch.setattr(verification, "_keep_ready", False)
    verification.verify("model-dir")
    assert checker.request["data"] is None and checker.request["expected"] is None


def test_the_answers_compared_are_the_first_fifty_rows_and_two_may_differ():
    """The check regenerates the first CHECK_ROWS recorded rows and allows two differences in fifty."""
    from search.promotion import verification

    per_row = {"index": list(range(80)), "answer": list(range(100, 180)), "gold": [0] * 80}
    assert verification.expected_answers(per_row) == {"index": list(range(50)), "answer": list(range(100, 150))}
    assert verification.expected_answers(per_row, rows=3) == {"index": [0, 1, 2], "answer": [100, 101, 102]}
    assert verification.allowed_disagreements(49) == 1 and verification.allowed_disagreements(75) == 3


# --- search/promotion.py ---------------------------------------------------------------------------------------------


def _model_folder(folder: Path, tag: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"tag": tag}))
    (folder / "model.safetensors").write_text(tag * 100)
    return folder


def _promoted_into(submission: Path, merged: Path, accuracy: float, **kwargs) -> bool:
    from search.promotion.submission import promote

    return promote(merged, submission, min_format_rate=90.0, format_rate=97.5, accuracy=accuracy, trial=7,
                   check=lambda path: None, **kwargs)  # fmt: skip


def test_files_found_in_the_submission_are_kept_beside_it_by_default(tmp_path):
    """Without a study folder to keep them in, what the submission held that no promotion wrote is kept beside it."""
    submission = _model_folder(tmp_path / "submission", "users")
    assert _promoted_into(submission, _model_folder(tmp_path / "a", "a"), 10.0)
    [kept] = sorted(tmp_path.glob("kept-submission-*"))
    assert json.loads((kept / "config.json").read_text())["tag"] == "users"


def test_the_promoted_marker_records_what_was_promoted(tmp_path):
    """PROMOTED.json says which trial, its accuracy and format rate, and where it came from."""
    from search.promotion.submission import promoted

    merged = _model_folder(tmp_path / "a", "a")
    assert _promoted_into(tmp_path / "submission", merged, 55.0, details={"check_rows": {"index": [1]}})
    marker = promoted(tmp_path / "submission")
    assert (marker["trial"], marker["accuracy"], marker["format_rate"]) == (7, 55.0, 97.5)
    assert marker["source"] == str(merged.resolve()) and marker["check_rows"] == {"index": [1]}


def test_a_submission_without_a_promoted_model_fails_the_final_check(tmp_path):
    """The reserve's check never passes a folder the search did not promote into (nothing there for the verifier)."""
    from search.promotion.submission import final_check

    _model_folder(tmp_path / "submission", "users")
    result = final_check(tmp_path / "submission", "ood_val", check=lambda path, **kwargs: None)
    assert not result.passed and result.line == f"FINAL CHECK: {tmp_path / 'submission'} holds no promoted model"


def test_the_final_check_says_what_passed_and_which_trial_the_submission_holds(tmp_path):
    """The summary's line and the trial the submission holds, with and without recorded answers, and when a failed
    check has nothing to restore."""
    from search.promotion.submission import PromotionError, final_check

    submission = tmp_path / "submission"
    assert _promoted_into(submission, _model_folder(tmp_path / "a", "a"), 55.0)
    result = final_check(submission, "ood_val", check=lambda path, **kwargs: None)
    assert (result.passed, result.trial) == (True, 7)
    assert result.line == "final check passed: the submission (trial 7) loads (no recorded answers)"

    def fails(path, **kwargs):
        raise PromotionError("broken")

    result = final_check(submission, "ood_val", check=fails)
    assert (result.passed, result.trial, result.restored) == (False, 7, False)


def test_a_previous_submission_without_an_accuracy_is_still_restored(tmp_path):
    """A previous PROMOTED.json without an accuracy (written by hand, or by an older version) does not make the
    final check raise: the line says nan."""
    from search.promotion.submission import PromotionError, final_check

    submission = tmp_path / "submission"
    assert _promoted_into(submission, _model_folder(tmp_path / "a", "a"), 55.0)
    assert _promoted_into(submission, _model_folder(tmp_path / "b", "b"), 65.0)
    previous = tmp_path / ".submission.previous" / "PROMOTED.json"
    marker = json.loads(previous.read_text())
    del marker["accuracy"]
    previous.write_text(json.dumps(marker))

    def fails(path, **kwargs):
        raise PromotionError("broken")

    result = final_check(submission, "ood_val", check=fails)
    assert result.restored and "nan% on ood_val" in result.line


def test_the_submission_check_passes_its_data_and_options_to_the_verifier(monkeypatch):
    """check_submission checks the answers on the split it is given, with every option of the caller."""
    from search.promotion import submission as promotion
    from search.promotion import verification

    seen = {}
    monkeypatch.setattr(verification, "verify", lambda *args, **kwargs: seen.update(args=args, kwargs=kwargs) or {})
    promotion.check_submission("sub", data="split", expected={"index": [1]}, gpus=[3], batch_size=4, max_new_tokens=9)
    assert seen == {"args": ("sub", "split", {"index": [1]}), "kwargs": {"gpus": [3], "batch_size": 4,
                                                                       "max_new_tokens": 9}}  # fmt: skip


def test_every_ingredient_of_a_running_merge_keeps_its_weights(tmp_path):
    """A merge names its ingredients (a list of parents): none of their weights is pruned while it runs."""
    import optuna
    from optuna.trial import create_trial

    from search.promotion.submission import prune_run_dirs

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize")
    runs = tmp_path / "runs"
    for value, name in ((70.0, "best"), (60.0, "one"), (50.0, "two"), (40.0, "neither")):
        _model_folder(runs / name / "merged", name)
        study.add_trial(create_trial(value=value, user_attrs={"run_dir": str(runs / name)}))
    study.ask().set_user_attr("parent", [1, 2])
    assert [p.relative_to(runs).as_posix() for p in prune_run_dirs(study, 0, runs)] == ["neither/merged"]


# --- search/scheduler.py: the time and parent logic -------------------------------------------------------------------

_ROOT = Path(__file__).resolve().parents[1]
_START = 1_800_000_000.0


def _scheduler(tmp_path: Path, **overrides):
    """A Scheduler on the simulated backend and a virtual clock: 3 hours, 2 one-GPU slots, a 20-minute reserve."""
    import dataclasses

    import optuna

    from search.backends.clock import VirtualClock
    from search.promotion import RecordingPromoter
    from search.scheduler import Scheduler
    from search.settings import MergeSettings, load_settings
    from search.backends.simulated import SimulatedBackend
    from search.study import open_study

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    settings = load_settings(_ROOT / "budget.yaml", hours=3, storage=str(tmp_path / "study.db"))
    values = dict(runs_dir=str(tmp_path / "runs"), gpus=2, gpus_per_trial=1, reserve_minutes=20, round_min_minutes=20,
                  round_max_minutes=60, hang_minutes=15, ood_rows=None, val_rows=500,
                  merge=MergeSettings(enabled=False, top_k=4, etas=(0.5, 0.75, 1.25, 1.5), held_out_share=0.5))
    settings = dataclasses.replace(settings, **{**values, **overrides})  # fmt: skip
    clock = VirtualClock(_START)
    study, deadline = open_study(settings, now=clock.now())
    backend = SimulatedBackend(settings, clock, 0)
    return Scheduler(settings, study, deadline, backend, clock, promoter=RecordingPromoter())


def test_rounds_end_before_the_reserve_and_before_the_merge_stage(tmp_path):
    """No round runs into the reserve (the deadline minus reserve_minutes), nor, with the merge stage on, into the
    merge stage's predicted time before it."""
    from search.settings import MergeSettings

    scheduler = _scheduler(tmp_path)
    assert scheduler.end_of_stage == scheduler.deadline - 20 * 60.0
    assert scheduler.end_of_rounds == scheduler.end_of_stage
    merging = _scheduler(tmp_path / "merge", merge=MergeSettings(enabled=True, top_k=4, etas=(0.5, 1.5),
                                                                  held_out_share=0.5))  # fmt: skip
    stage_seconds = merging.stage.seconds(merging.duration, len(merging.settings.slots))
    assert stage_seconds > 0
    assert merging.end_of_rounds == merging.end_of_stage - stage_seconds


def test_a_late_last_round_is_killed_before_the_reserve(tmp_path):
    """A round launched near the end is allotted only the time left, stopped ahead of its allotment's end by its
    predicted tail, and killed at the latest where the reserve begins (no grace past it)."""
    scheduler = _scheduler(tmp_path)
    now = scheduler.end_of_rounds - 30 * 60.0
    scheduler._launch(0, now)  # round 0, the base, comes first
    scheduler._launch(1, now)
    r = scheduler._running[1]
    assert r.config is not None and r.started == now
    assert r.allotment.end_by == scheduler.end_of_rounds and r.trial.user_attrs["allotted_s"] == 30 * 60.0
    assert r.allotment.kill_at == scheduler.end_of_rounds  # not end_by plus its grace: that is the reserve's time
    assert now < r.allotment.stop_at < r.allotment.end_by
    assert r.trial.user_attrs["predicted_s"] <= 30 * 60.0


def test_an_early_round_gets_round_max_and_its_grace(tmp_path):
    """Far from the end, a round is allotted round_max_minutes and may overrun it by its grace share before a kill."""
    from search.allotment import GRACE_SHARE

    scheduler = _scheduler(tmp_path)
    now = _START + 60.0
    scheduler._launch(0, now)
    scheduler._launch(1, now)
    r = scheduler._running[1]
    assert r.allotment.end_by == now + 60 * 60.0 and r.allotment.kill_at == r.allotment.end_by + GRACE_SHARE * 60 * 60.0
    assert r.trial.user_attrs["allotted_s"] == 3600.0 and r.trial.user_attrs["started_at"] == now


def test_round_zero_started_near_the_deadline_is_capped_by_it(tmp_path):
    """Round 0 (the base, the fallback submission) may use the reserve but never runs past the deadline."""
    scheduler = _scheduler(tmp_path)
    now = scheduler.deadline - scheduler.duration.eval_seconds() - 1.0
    scheduler._launch(0, now)
    r = scheduler._running[0]
    assert r.config is None and r.trial.user_attrs["recipe"] == "base"
    assert r.allotment.end_by == r.allotment.stop_at == r.allotment.kill_at == scheduler.deadline
    assert r.trial.user_attrs["allotted_s"] == round(scheduler.deadline - now, 1)


# --- search/settings.py and common/validation.py: the settings' bounds ----------------------------------------------


def _budget(folder: Path, changes: dict) -> Path:
    """budget.yaml with `changes` at dotted keys ("sampler.seed")."""
    import yaml

    data = yaml.safe_load((_ROOT / "budget.yaml").read_text())
    for path, value in changes.items():
        *parents, last = path.split(".")
        node = data
        for key in parents:
            node = node[key]
        node[last] = value
    (folder / "budget.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return folder / "budget.yaml"


_TPE = {"type": "tpe"}
_HYPERBAND = {"type": "hyperband"}
_BOUND_CASES = [
    # (changes, the refusal's text, or None: accepted). Each bound is tried on both sides of its edge.
    ({"sampler": {**_TPE, "seed": 0}}, None),
    ({"sampler": {**_TPE, "seed": 2**32 - 1}}, None),
    ({"sampler": {**_TPE, "seed": -1}}, "sampler.seed: must be an integer in [0, 4294967295], got -1"),
    ({"sampler": {**_TPE, "seed": 2**32}}, "sampler.seed: must be an integer in [0, 4294967295], got 4294967296"),
    ({"sampler": {**_TPE, "n_startup_trials": 10**6}}, None),
    ({"sampler": {**_TPE, "n_startup_trials": 10**6 + 1}}, "sampler.n_startup_trials: must be an integer in [0, 1000000]"),  # noqa: E501
    ({"sampler": {**_TPE, "n_ei_candidates": 1}}, None),
    ({"sampler": {**_TPE, "n_ei_candidates": 0}}, "sampler.n_ei_candidates: must be an integer in [1, 10000], got 0"),
    ({"sampler": {**_TPE, "n_ei_candidates": 10_001}}, "sampler.n_ei_candidates: must be an integer in [1, 10000]"),
    ({"sampler": {**_TPE, "multivariate": "yes"}}, "sampler.multivariate: must be true or false, got 'yes'"),
    ({"sampler": {**_TPE, "multivariate": True, "group": True}}, None),
    ({"sampler": {"type": "random", "seed": 3}}, None),
    ({"pruner": {"type": "percentile", "percentile": 100}}, None),
    ({"pruner": {"type": "percentile", "percentile": 0.0}}, None),
    ({"pruner": {"type": "percentile", "percentile": 100.5}}, "pruner.percentile: must be in [0, 100], got 100.5"),
    ({"pruner": {"type": "percentile", "percentile": -0.5}}, "pruner.percentile: must be in [0, 100], got -0.5"),
    ({"pruner": {"type": "median", "interval_steps": 1, "n_min_trials": 1}}, None),
    ({"pruner": {"type": "median", "interval_steps": 0}}, "pruner.interval_steps: must be an integer in [1, 1000000]"),
    ({"pruner": {"type": "median", "n_min_trials": 0}}, "pruner.n_min_trials: must be an integer in [1, 1000000]"),
    ({"pruner": {"type": "median", "n_warmup_steps": 10**6}}, None),
    ({"pruner": {**_HYPERBAND, "min_resource": 1, "max_resource": "auto"}}, None),
    ({"pruner": {**_HYPERBAND, "min_resource": 0}}, "pruner.min_resource: must be an integer in [1, 1000000000], got 0"),  # noqa: E501
    ({"pruner": {**_HYPERBAND, "max_resource": 10**9}}, None),
    ({"pruner": {**_HYPERBAND, "max_resource": 0}}, "pruner.max_resource: must be an integer in [1, 1000000000], got 0"),  # noqa: E501
    ({"pruner": {**_HYPERBAND, "max_resource": 10**9 + 1}}, "pruner.max_resource: must be an integer in [1, 1000000000]"),  # noqa: E501
    ({"pruner": {**_HYPERBAND, "max_resource": "all"}}, "pruner.max_resource: must be an integer, got 'all'"),
    ({"pruner": {**_HYPERBAND, "reduction_factor": 2}}, None),
    ({"pruner": {**_HYPERBAND, "reduction_factor": 100}}, None),
    ({"pruner": {**_HYPERBAND, "reduction_factor": 1}}, "pruner.reduction_factor: must be an integer in [2, 100], got 1"),  # noqa: E501
    ({"pruner": {**_HYPERBAND, "reduction_factor": 101}}, "pruner.reduction_factor: must be an integer in [2, 100]"),
    ({"pruner": {**_HYPERBAND, "bootstrap_count": -1}}, "pruner.bootstrap_count: must be an integer in [0, 1000000]"),
    ({"pruner": {**_HYPERBAND, "min_resource": 30, "max_resource": 30}}, None),
    ({"pruner": {**_HYPERBAND, "min_resource": 31, "max_resource": 30}},
     "pruner.min_resource: must be <= max_resource (30), got 31: Hyperband would never prune"),
    ({"pruner": {"type": "none"}}, None),
    ({"pruner": {"type": "none", "seed": 1}}, "pruner.seed: not an option of NopPruner; options: []"),
    ({"hours": 168}, None),
    ({"hours": 168.5}, "hours: must be <= 168 (a week), got 168.5"),
    ({"hours": 0}, "hours: must be > 0, got 0"),
    ({"reserve_minutes": 0}, None),
    ({"reserve_minutes": -1}, "reserve_minutes: must be in [0, 10080], got -1"),
    ({"hang_minutes": 10080}, None),
    ({"hang_minutes": 10080.5}, "hang_minutes: must be in (0, 10080], got 10080.5"),
    ({"hang_minutes": 0}, "hang_minutes: must be in (0, 10080], got 0"),
    ({"min_format_rate": 100}, None),
    ({"min_format_rate": 100.1}, "min_format_rate: must be in [0, 100], got 100.1"),
    ({"ood_rows": None}, None),
    ({"ood_rows": 1}, None),
    ({"ood_rows": 0}, "ood_rows: must be an integer >= 1, got 0"),
    ({"eval_batch_size": 65536}, None),
    ({"eval_batch_size": 65537}, "eval_batch_size: must be an integer in [1, 65536], got 65537"),
    ({"val_rows": 0}, None),
    ({"val_rows": -1}, "val_rows: must be an integer >= 0, got -1"),
    ({"keep_rounds": True}, "keep_rounds: must be an integer, got True"),
    ({"study_name": "a\u2029b"}, "study_name: must not hold control characters"),  # the paragraph separator
    ({"study_name": "a\u2028b"}, "study_name: must not hold control characters"),  # the line separator
    ({"gpu_memory_gb": 0}, "gpu_memory_gb: must be in (0, "),
    ({"merge": "on"}, "merge: must be a mapping of merge stage options, got 'on'"),
    ({"merge.topk": 2, "merge.zeta": 1}, "merge.topk: unknown key (did you mean 'top_k'?)"),
    ({"merge": {"enabled": True}}, "merge.top_k: missing (budget.yaml documents every key)"),
    ({"merge.etas": [0.5] * 9}, "merge.etas: must be a list of at most 8 numbers, got [0.5, 0.5,"),
    ({"merge.etas": [0.5, 0.5]}, "merge.etas: each eta once, got [0.5, 0.5]"),
    ({"merge.etas": [4.5]}, "merge.etas[0]: must be in [0, 4.0], got 4.5"),
    ({"merge.etas": [0.5, -0.5]}, "merge.etas[1]: must be in [0, 4.0], got -0.5"),
    ({"merge.enabled": "yes"}, "merge.enabled: must be true or false, got 'yes'"),
    ({"merge.top_k": 17}, "merge.top_k: must be an integer in [1, 16], got 17"),
    ({"merge.held_out_share": 1}, "merge.held_out_share: must be in (0, 1), got 1"),
]


@pytest.mark.parametrize("changes, refusal", _BOUND_CASES, ids=[f"case{i}" for i in range(len(_BOUND_CASES))])
def test_each_bound_takes_its_edge_and_refuses_one_past_it(tmp_path, changes, refusal):
    """A budget value exactly at a bound loads as written; one past it is refused naming the key, the bound and the
    value (Optuna's constructors check some ranges, not all, and a bad one would fail the search hours later)."""
    from search.settings import SettingsError, load_settings

    path = _budget(tmp_path, changes)
    if refusal is None:
        settings = load_settings(path)
        for key, value in changes.items():
            assert getattr(settings, key) == value
    else:
        with pytest.raises(SettingsError) as error:
            load_settings(path)
        assert refusal in str(error.value)


def test_a_launched_round_is_stamped_with_its_worker_and_its_folder_and_clears_the_misfit_count(tmp_path):
    """A round is found again by its worker (an interrupt abandons this process's RUNNING trials, the sweep fails a
    dead worker's) and by its run folder (pruning, reaping); a round that fits ends a streak of misfits."""
    from pathlib import Path as _Path

    scheduler = _scheduler(tmp_path)
    now = _START + 60.0
    scheduler._launch(0, now)
    scheduler._misfits = 5
    scheduler._launch(1, now)
    for r in scheduler._running.values():
        assert r.trial.user_attrs["worker"] == scheduler.workers.id
        expected = _Path(scheduler.settings.rounds_dir) / f"round-{r.trial.number:04d}"
        assert r.trial.user_attrs["run_dir"] == str(expected)
    assert scheduler._running[1].config.output_dir == str(scheduler._running[1].trial.user_attrs["run_dir"])
    assert scheduler._misfits == 0
    assert scheduler._running[1].trial.user_attrs["init"] in ("base", "best")  # the leaderboard's "from" column


def test_a_launched_round_records_its_parent_and_runs_on_its_slots_gpus(tmp_path, capsys):
    """What the dashboard and the status line show of a running round: the parent it continues (its trial and its
    steps from the base), and the GPUs of its slot, round 0 included."""
    scheduler = _scheduler(tmp_path)
    now = _START + 60.0
    scheduler._launch(0, now)  # round 0 (the base) comes first
    scheduler._launch(1, now)
    base, trained = scheduler._running[0], scheduler._running[1]
    assert (base.gpus, trained.gpus) == (scheduler._slots[0], scheduler._slots[1]) == ([0], [1])
    assert f"round {base.trial.number} starts on gpu 0: scoring the base model" in capsys.readouterr().out
    parent = scheduler.parent_of(trained.trial.user_attrs["init"])
    assert trained.trial.user_attrs["parent"] == parent.trial
    assert trained.trial.user_attrs["parent_total_steps"] == parent.total_steps == 0  # nothing trained yet


def test_a_trial_asked_after_another_worker_took_round_zero_fails_uncounted_with_why(tmp_path, monkeypatch):
    """No time for a round, and round 0 was queued but taken by another worker before this one asked: the trial it
    got is failed with the reason (not counted towards the failures that stop a search) and no more rounds start."""
    from optuna.trial import TrialState

    from search import lineage

    scheduler = _scheduler(tmp_path)
    scheduler._base_due = False
    taken = scheduler.study.ask()  # another worker takes the queued round 0
    monkeypatch.setattr(lineage, "base_waiting", lambda study: True)  # as this worker saw the queue a moment before
    scheduler._launch(0, scheduler.end_of_rounds - 60.0)  # a minute left: under round_min_minutes
    asked = [t for t in scheduler.study.get_trials(deepcopy=False) if t.state != TrialState.WAITING]  # warm starts
    (trial,) = [t for t in asked if t.number != taken.number]
    assert trial.state == TrialState.FAIL and trial.user_attrs["reason"] == "no time left for a useful round"
    assert scheduler._failures == 0 and scheduler._closed.startswith("no time left for a useful round")
    assert not scheduler._running


def test_round_zero_started_early_gets_four_evaluations_or_round_min(tmp_path):
    """Round 0's allotment: four times its predicted evaluation, and never less than round_min_minutes."""
    from search.allotment import BASE_ALLOTMENT_FACTOR

    scheduler = _scheduler(tmp_path)
    now = _START + 60.0
    scheduler._launch(0, now)
    r = scheduler._running[0]
    assert r.allotment.end_by - now == max(BASE_ALLOTMENT_FACTOR * scheduler.duration.eval_seconds(), 20 * 60.0)
    assert r.allotment.end_by - now == 20 * 60.0  # here the prediction is under 5 minutes: round_min decides


class _Unfit:
    fits = False

    def reason(self) -> str:
        return "does not fit: predicted 99.0 GB of 70.0 GB"

    def attrs(self) -> dict:
        return {"predicted_peak_gb": 99.0, "usable_gb": 70.0}


def test_a_round_too_big_for_its_card_is_not_launched_and_told_pruned(tmp_path, monkeypatch):
    """A configuration no memory plan fits is a bad point for the sampler (PRUNED, with why), not a crash."""
    import io as _io
    from contextlib import redirect_stdout

    from optuna.trial import TrialState

    scheduler = _scheduler(tmp_path)
    now = _START + 60.0
    scheduler._launch(0, now)
    monkeypatch.setattr(scheduler.backend, "fit", lambda config, gpus: _Unfit())
    with redirect_stdout(_io.StringIO()):
        scheduler._launch(1, now)
    assert 1 not in scheduler._running and scheduler._misfits == 1
    [refused] = [t for t in scheduler.study.get_trials() if t.state == TrialState.PRUNED]
    assert refused.user_attrs["reason"] == "does not fit: predicted 99.0 GB of 70.0 GB"
    assert refused.user_attrs["predicted_peak_gb"] == 99.0 and refused.value is None


def test_a_best_round_starts_from_the_base_when_no_round_beats_it(tmp_path):
    """init: best, with only the base scored (or every round below it): the round starts from the base model."""
    from search.lineage import Parent

    scheduler = _scheduler(tmp_path)
    study = scheduler.study
    base = study.ask()
    base.set_user_attr("total_steps", 0)
    study.tell(base, 50.0)
    below = study.ask()
    for key, value in {"recipe": "sampled", "format_rate": 99.0, "merged_dir": "/runs/below/merged"}.items():
        below.set_user_attr(key, value)
    study.tell(below, 40.0)
    scheduler.backend.remember("/runs/below/merged", 40.0, 100, True)
    expected = Parent(base.number, scheduler.settings.model_path, 0)
    assert scheduler.parent_of("best") == expected


def test_a_round_without_a_recorded_format_rate_is_not_promotable():
    """A round whose format rate was never recorded (its scoring did not finish writing) is neither handed in nor
    continued: an unknown format rate counts as 0, not as clean."""
    from search.lineage import promotable

    here = lambda path: True  # noqa: E731
    assert promotable({"merged_dir": "m", "format_rate": 0.95}, 0.9, here)
    assert not promotable({"merged_dir": "m"}, 0.9, here)
    assert not promotable({"merged_dir": "m", "format_rate": None}, 0.9, here)


# --- search/rounds.py: what the scheduler saw, put over the round's own account -----------------------------------------


class _RoundHandle:
    """A round's handle at a fixed phase, ending with a fixed outcome."""

    def __init__(self, phase, outcome=None):
        self._phase, self._outcome = phase, outcome

    def phase(self):
        return self._phase

    def outcome(self):
        return self._outcome


def _running(handle, *, steps=20, latest_step=None):
    from search.allotment import Allotment
    from search.rounds import RunningRound
    from trainer.config import TrialConfig

    config = TrialConfig(model_path="m", train_path="t", output_dir="o", steps=steps)
    allotment = Allotment(steps, predicted_s=600.0, end_by=1000.0, stop_at=900.0, kill_at=1100.0)
    r = RunningRound(trial=None, config=config, gpus=[0], handle=handle, started=400.0, allotment=allotment)
    if latest_step is not None:
        r.latest = {"step": latest_step}
    return r


def _round_outcome(state, *, failure=None, ood=60.0):
    from search.backends import RoundOutcome

    return RoundOutcome(state, "its own reason", ood, 50.0, 99.0, 20.0, 20, failure=failure)


def test_a_round_past_its_stop_time_is_asked_to_stop_only_while_steps_remain():
    """The STOP goes to a round still stepping past its stop time; one that has logged its last step is saving
    already, and a STOP then would only mark a finished round as stopped."""
    from trainer.run_folder import Phase

    assert _running(_RoundHandle(Phase.TRAINING), latest_step=19).due_to_stop(950.0)
    assert not _running(_RoundHandle(Phase.TRAINING), latest_step=19).due_to_stop(850.0)
    assert not _running(_RoundHandle(Phase.TRAINING), latest_step=20).due_to_stop(950.0)
    assert not _running(_RoundHandle(Phase.EVALUATING), latest_step=12).due_to_stop(950.0)


def test_a_pruned_round_that_finished_anyway_is_recorded_pruned_and_a_failed_one_failed():
    """The pruner's verdict stands over a round that completed before the stop reached it; a round that failed keeps
    its failure, whatever the pruner said."""
    from trainer.run_folder import FailureKind, RoundState

    for own in (RoundState.COMPLETED, RoundState.STOPPED):
        r = _running(_RoundHandle(None, _round_outcome(own)))
        r.pruned = "pruned at step 8: below the median"
        outcome = r.outcome()
        assert (outcome.state, outcome.reason, outcome.failure) == (RoundState.PRUNED, r.pruned, None)
    r = _running(_RoundHandle(None, _round_outcome(RoundState.FAILED, failure=FailureKind.NAN, ood=None)))
    r.pruned = "pruned at step 8: below the median"
    outcome = r.outcome()
    assert (outcome.state, outcome.reason, outcome.failure) == (RoundState.FAILED, "its own reason", FailureKind.NAN)


def test_only_a_failed_round_carries_a_failure_kind():
    """A completed round has no failure kind (the search counts failures by kind); a failed one without a kind of its
    own is an error."""
    from trainer.run_folder import FailureKind, RoundState

    assert _running(_RoundHandle(None, _round_outcome(RoundState.COMPLETED))).outcome().failure is None
    failed = _running(_RoundHandle(None, _round_outcome(RoundState.FAILED, ood=None))).outcome()
    assert (failed.state, failed.failure) == (RoundState.FAILED, FailureKind.ERROR)


def test_a_saved_round_without_an_ood_accuracy_fails_saying_so():
    from trainer.run_folder import FailureKind, RoundState

    outcome = _running(_RoundHandle(None, _round_outcome(RoundState.COMPLETED, ood=None))).outcome()
    assert (outcome.state, outcome.reason, outcome.failure) == \
        (RoundState.FAILED, "the evaluation gave no OOD accuracy", FailureKind.ERROR)  # fmt: skip


def test_a_round_killed_past_its_allotment_says_how_far_past():
    """The kill line names the phase, how long past the end of its allotment and the allotment itself."""
    from trainer.run_folder import Phase

    r = _running(_RoundHandle(Phase.EVALUATING))
    assert not r.overdue(1099.0, hang_minutes=30)
    assert r.overdue(1120.0, hang_minutes=30)
    assert r.killed == "killed: still evaluating 2 min past its allotment of 10 min"
