"""The study: journal file the dashboard opens as typed, deadline kept on resume, warm starts once, clear refusals."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import optuna
import pytest

from search import study as study_module
from search.report.plots import plot_round, upload_plot
from search.settings import load_settings
from search.study import DEADLINE_ATTR, StudyError, load_existing_study, make_sampler, open_study

BUDGET = Path(__file__).resolve().parents[1] / "budget.yaml"

optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.fixture()
def settings(tmp_path):
    return load_settings(BUDGET, storage=str(tmp_path / "study.db"))


def test_deadline_is_stored_at_creation_and_kept_on_resume(settings):
    study, deadline = open_study(settings, now=1000.0)
    assert deadline == 1000.0 + 7.5 * 3600 and study.user_attrs[DEADLINE_ATTR] == deadline
    waiting = study.get_trials(states=(optuna.trial.TrialState.WAITING,))
    assert [t.user_attrs["recipe"] for t in waiting] == ["base", "strong", "baseline"]  # round 0, then warm starts
    resumed, kept = open_study(dataclasses.replace(settings, hours=1.0), now=99999.0)
    assert kept == deadline
    assert len(resumed.trials) == 3  # neither round 0 nor the warm starts were enqueued again


def test_journal_file_opens_the_way_optuna_dashboard_opens_it(settings):
    from optuna_dashboard._storage_url import get_storage

    study, _ = open_study(settings, now=0.0)
    trial = study.ask()
    study.tell(trial, 42.0)
    storage = get_storage(settings.storage)  # what `optuna-dashboard study.db` does with its argument
    assert isinstance(storage, optuna.storages.JournalStorage)
    loaded = optuna.load_study(study_name=settings.study_name, storage=storage)
    assert loaded.best_value == 42.0 and loaded.direction == optuna.study.StudyDirection.MAXIMIZE


def test_a_study_of_another_direction_is_refused(settings):
    optuna.create_study(storage=optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(settings.storage)), study_name=settings.study_name)  # fmt: skip
    with pytest.raises(StudyError, match=r"^study_name: the study 'count-grpo' .* optimizes \['minimize'\]"):
        open_study(settings, now=0.0)


def test_unreachable_storage_url_is_one_clear_error(settings, tmp_path):
    url = "sqlite:///" + str(tmp_path / "no" / "such" / "dir" / "x.db")
    with pytest.raises(StudyError, match=r"^storage: cannot open sqlite:///"):
        open_study(dataclasses.replace(settings, storage=url), now=0.0)
    with pytest.raises(StudyError, match=r"^storage: cannot open postgresql://user:\*\*\*@"):
        open_study(dataclasses.replace(settings, storage="postgresql://user:secret@127.0.0.1:1/db"), now=0.0)


def test_reading_a_missing_study_creates_nothing(settings, tmp_path):
    with pytest.raises(StudyError, match="does not exist"):
        load_existing_study(settings)
    assert not Path(settings.storage).exists()
    open_study(settings, now=0.0)
    with pytest.raises(StudyError, match="no study 'other'"):
        load_existing_study(dataclasses.replace(settings, study_name="other"))


def test_a_resumed_sampler_does_not_replay_its_draws(settings):
    first = make_sampler({"type": "random", "seed": 0})
    again = make_sampler({"type": "random", "seed": 0}, offset=5)
    draws = [
        optuna.create_study(sampler=sampler).ask().suggest_float("x", 0, 1) for sampler in (first, again)
    ]
    assert draws[0] != draws[1]


def test_sampler_and_pruner_come_from_the_settings(settings):
    study, _ = open_study(settings, now=0.0)
    assert isinstance(study.sampler, optuna.samplers.TPESampler)
    assert isinstance(study.pruner, optuna.pruners.MedianPruner)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(url: str, timeout_s: float = 30.0) -> bytes:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return response.read()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


def test_optuna_dashboard_cli_opens_the_journal_and_serves_a_round_plot(settings, tmp_path):
    study, _ = open_study(settings, now=0.0)
    trial = study.ask()
    progress = tmp_path / "progress.jsonl"
    progress.write_text("".join(
        json.dumps({"step": s, "rewards": {"accuracy": s / 10}, "reward": s / 10, "completion_length": 40 - s,
                    "ood_accuracy": 50 + s if s % 2 == 0 else None}) + "\n" for s in range(1, 9)
    ))  # fmt: skip
    png = plot_round(tmp_path, tmp_path / "round-0.png", title="trial 0")
    artifact_id = upload_plot(trial, png, tmp_path / "artifacts")
    study.tell(trial, 55.0)

    port = _free_port()
    # As a user types it, in the folder of the study: `optuna-dashboard study.db --artifact-dir artifacts`.
    executable = [shutil.which("optuna-dashboard")] if shutil.which("optuna-dashboard") else [
        sys.executable, "-m", "optuna_dashboard._cli"]  # fmt: skip
    command = [*executable, "study.db", "--port", str(port), "--artifact-dir", "artifacts", "--quiet"]
    dashboard = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        studies = json.loads(_get(f"http://127.0.0.1:{port}/api/studies"))
        assert [s["study_name"] for s in studies["study_summaries"]] == [settings.study_name]
        image = _get(f"http://127.0.0.1:{port}/artifacts/0/{trial._trial_id}/{artifact_id}")
        assert image.startswith(b"\x89PNG")
    finally:
        dashboard.terminate()
        dashboard.wait(timeout=10)


def test_round_plot_skips_a_torn_line_and_needs_data(tmp_path):
    assert plot_round(tmp_path / "absent", tmp_path / "a.png") is None
    progress = tmp_path / "progress.jsonl"
    progress.write_text(json.dumps({"step": 1, "reward": 0.5, "rewards": {"accuracy": 0.5}}) + "\n{\"step\": 2, \"rew")
    png = plot_round(tmp_path, tmp_path / "round.png")
    assert png is not None and png.read_bytes().startswith(b"\x89PNG")


def test_a_rounds_plot_is_attached_to_its_trial(tmp_path):
    study = optuna.create_study(direction="maximize")
    trial = study.ask()
    png = tmp_path / "round-0000.png"
    png.write_bytes(b"\x89PNG fake")
    artifact_id = upload_plot(trial, png, tmp_path / "artifacts")
    study.tell(trial, 1.0)
    metas = optuna.artifacts.get_all_artifact_meta(study.trials[0], storage=study._storage)
    assert [(m.artifact_id, m.filename) for m in metas] == [(artifact_id, "round-0000.png")]
    assert optuna.artifacts.get_all_artifact_meta(study) == []


# ---------------------------------------------------------------------------------------------------------- set-up
class Killed(BaseException):
    """A kill -9 at that point: nothing after it runs (BaseException, so that no `except Exception` sees it)."""


@pytest.mark.parametrize(
    "killed_at", ["enqueue:1", "enqueue:2", "enqueue:3", "set_user_attr:hours", "set_user_attr:deadline"]
)
def test_a_set_up_killed_at_any_point_is_finished_by_the_next_run(settings, monkeypatch, killed_at):
    """Created, then killed before round 0 is queued, before either warm start, before `hours` or before the deadline:
    the same command again finishes the set-up (deadline from its own start) and round 0 and every warm start are
    queued once, in that order."""
    monkeypatch.setattr(study_module, "DEADLINE_WAIT_S", 0.0)
    method, _, when = killed_at.partition(":")
    calls = []
    original = {"enqueue": optuna.Study.enqueue_trial, "set_user_attr": optuna.Study.set_user_attr}

    def kill_at(self, *args, **kwargs):
        calls.append(args[0])
        if (method == "enqueue" and len(calls) == int(when)) or (method == "set_user_attr" and args[0] == when):
            raise Killed
        return original[method](self, *args, **kwargs)

    # Only the kill is undone after the first run: the next run must not wait DEADLINE_WAIT_S (5 s) for a deadline
    # that no one is about to store.
    with monkeypatch.context() as kill:
        kill.setattr(optuna.Study, {"enqueue": "enqueue_trial", "set_user_attr": "set_user_attr"}[method], kill_at)
        with pytest.raises(Killed):
            open_study(settings, now=1000.0)
    study, deadline = open_study(settings, now=5000.0)
    assert deadline == 5000.0 + 7.5 * 3600 == study.user_attrs[DEADLINE_ATTR]
    waiting = study.get_trials(states=(optuna.trial.TrialState.WAITING,))
    assert [t.user_attrs["recipe"] for t in waiting] == ["base", "strong", "baseline"] and len(study.trials) == 3
    again, kept = open_study(settings, now=9000.0)
    assert kept == deadline and len(again.trials) == 3


def test_two_workers_finishing_one_set_up_run_each_warm_start_once(settings, monkeypatch):
    """Both enqueued round 0 and the missing warm starts before either stored the deadline: the second copies are
    failed before anyone asks for a trial."""
    monkeypatch.setattr(study_module, "DEADLINE_WAIT_S", 0.0)
    storage = study_module.open_storage(settings.storage)
    study = optuna.create_study(storage=storage, study_name=settings.study_name, direction="maximize")
    for name in ("base", "base", "strong", "strong", "baseline", "baseline"):
        recipe = next((w["params"] for w in settings.warm_starts if w["name"] == name), {})
        study.enqueue_trial(study_module.space.warm_start_params(recipe, settings.space), user_attrs={"recipe": name})
    study, _ = open_study(settings, now=0.0)
    waiting = study.get_trials(states=(optuna.trial.TrialState.WAITING,))
    assert [(t.number, t.user_attrs["recipe"]) for t in waiting] == [(0, "base"), (2, "strong"), (4, "baseline")]
    failed = study.get_trials(states=(optuna.trial.TrialState.FAIL,))
    assert [t.user_attrs["reason"] for t in failed] == [f"a second copy of the queued {name!r} trial"
                                                        for name in ("base", "strong", "baseline")]  # fmt: skip


def test_a_killed_writer_leaves_no_lock_behind(settings, tmp_path, monkeypatch):
    """The journal's lock is a flock on the journal itself: the kernel drops it with its holder, and there is no lock
    file to wait out (Optuna's default symlink lock makes the next writer wait 30 s)."""
    open_study(settings, now=0.0)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; sys.path.insert(0, sys.argv[2]); from search.study import "
         "JournalFileFlock; JournalFileFlock(sys.argv[1]).acquire(); print('locked', flush=True); time.sleep(120)",
         settings.storage, str(BUDGET.parent)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline() == "locked\n"
        with open(settings.storage, "rb") as journal:
            with pytest.raises(BlockingIOError):  # the lock is real while its holder lives
                fcntl.flock(journal, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        holder.kill()
        holder.wait()
    with open(settings.storage, "rb") as journal:
        fcntl.flock(journal, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free at once: no grace period
        fcntl.flock(journal, fcntl.LOCK_UN)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["study.db"]
    # A lock file an older writer left (Optuna's symlink) is not waited for: a write that would sleep fails here.
    Path(settings.storage + ".lock").symlink_to(settings.storage)
    monkeypatch.setattr("optuna.storages.journal._file.time.sleep", lambda s: pytest.fail("waited for a lock file"))
    study, _ = open_study(settings, now=0.0)
    study.set_user_attr("written", True)
    assert study.user_attrs["written"] is True


def test_a_sampler_seed_near_the_top_still_resumes(settings):
    sampler = make_sampler({"type": "tpe", "seed": 2**32 - 1}, offset=5)
    assert isinstance(sampler, optuna.samplers.TPESampler)


@pytest.mark.parametrize(
    "url, secret",
    [
        ("postgresql://search:hunter2secret@db:5432/optuna", "hunter2secret"),
        ("postgresql://search@db/optuna?password=hunter2secret", "hunter2secret"),
        ("postgresql://search@db/optuna?sslmode=require&password=hunter2secret&x=1", "hunter2secret"),
        ("postgresql://search:hunter2%40secret@db/optuna", "hunter2%40secret"),
        ("mysql+pymysql://root:hunter2:secret@db/optuna", "hunter2:secret"),
    ],
)
def test_passwords_are_redacted_whatever_the_url_looks_like(url, secret):
    line = f"storage: cannot open {url}: the server said {secret} and {urllib.parse.unquote(secret)}"
    redacted = study_module.redact(line, url)
    assert secret not in redacted and urllib.parse.unquote(secret) not in redacted and "***" in redacted
    assert "db" in redacted  # the host stays: the message still says which database


# ---------------------------------------------------------------------------------------------------------- a torn journal
def _plain_optuna(path: str) -> optuna.storages.JournalStorage:
    return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(path))


@pytest.mark.parametrize("tail", [b'{"op_code": 5, "worker_id": "w", "trial', b'{"op_code": 0}', b"\0\0\0\0"])
def test_a_torn_last_line_is_cut_after_keeping_the_file_and_the_study_stays_readable(settings, capsys, tail):
    study, _ = open_study(settings, now=0.0)
    study.tell(study.ask(), 1.0)
    path = Path(settings.storage)
    with path.open("ab") as journal:  # a kill in the middle of an append
        journal.write(tail)
    torn = path.read_bytes()
    resumed, _ = open_study(settings, now=0.0)
    resumed.tell(resumed.ask(), 2.0)  # appends: after a whole line, not after the torn one
    [kept] = path.parent.glob("study.db.torn-*")
    assert kept.read_bytes() == torn and path.read_bytes().startswith(torn[: -len(tail)])
    err = capsys.readouterr().err
    assert len([line for line in err.splitlines() if "torn" in line]) == 1 and str(kept) in err
    loaded = optuna.load_study(study_name=settings.study_name, storage=_plain_optuna(str(path)))
    values = [t.value for t in loaded.trials]
    assert 1.0 in values and 2.0 in values


def test_a_journal_ending_in_a_whole_line_is_not_touched(settings):
    open_study(settings, now=0.0)
    before = Path(settings.storage).read_bytes()
    open_study(settings, now=0.0)
    assert Path(settings.storage).read_bytes() == before and not list(Path(settings.storage).parent.glob("*.torn-*"))


def test_reading_a_torn_journal_for_the_leaderboard_writes_nothing(settings):
    open_study(settings, now=0.0)
    with Path(settings.storage).open("ab") as journal:
        journal.write(b'{"op_code"')
    before = Path(settings.storage).read_bytes()
    assert load_existing_study(settings).study_name == settings.study_name
    assert Path(settings.storage).read_bytes() == before


# ---------------------------------------------------------------------------------------------------------- an edited space
def _space_with(settings, **changes):
    return dataclasses.replace(settings, space={**settings.space, **changes})


def _sample_one(settings) -> None:
    from search.space import sample_config

    study, _ = open_study(dataclasses.replace(settings, warm_starts=[]), now=0.0)  # the queue: round 0 alone
    trial = study.ask()
    sample_config(trial, settings, "run")
    study.tell(trial, 1.0)


@pytest.mark.parametrize("key, changes", [
    ("space.lora_rank", {"lora_rank": [0, 16]}),
    ("space.loss_type", {"loss_type": ["dapo", "grpo", "dr_grpo"]}),  # the same choices in another order
    ("space.init", {"init": ["base"]}),  # pinned
])  # fmt: skip
def test_an_edited_choice_list_is_refused_in_one_line_naming_its_key(settings, key, changes):
    _sample_one(settings)
    with pytest.raises(StudyError, match=rf"^{key}: the study 'count-grpo' sampled \w+ from .*budget now gives"):
        open_study(_space_with(settings, **changes), now=0.0)
    running = optuna.load_study(study_name=settings.study_name, storage=_plain_optuna(settings.storage))
    assert not running.get_trials(states=(optuna.trial.TrialState.RUNNING,))


def test_an_edited_reward_weight_list_names_the_reward(settings):
    _sample_one(settings)
    weights = {**settings.space["reward_weights"], "brevity": [0.0, 0.5]}
    with pytest.raises(StudyError, match=r"^space\.reward_weights\.brevity: .* w_brevity from \[0\.0, 0\.25, 0\.5\]"):
        open_study(_space_with(settings, reward_weights=weights), now=0.0)


def test_an_edited_range_is_adopted(settings):
    from search.space import sample_config

    _sample_one(settings)
    edited = _space_with(settings, steps={"low": 60, "high": 200, "step": 20}, beta={"low": 0.01, "high": 0.02})
    study, _ = open_study(edited, now=0.0)
    config = sample_config(study.ask(), edited, "run")
    assert 60 <= config.steps <= 200 and (config.beta == 0.0 or 0.01 <= config.beta <= 0.02)


def test_a_queued_warm_start_outside_an_edited_list_is_refused(settings):
    open_study(settings, now=0.0)  # the warm starts queued, nothing sampled yet: lora_rank 64 waits in the queue
    with pytest.raises(StudyError, match=r"^space\.lora_rank: queued trial 1 \(strong\) has lora_rank 64"):
        open_study(_space_with(settings, lora_rank=[0, 16]), now=0.0)


# ---------------------------------------------------------------------------------------------------------- secrets, ~
@pytest.mark.parametrize("password", ["hunter/2secret", "hunter#2secret", "hunter?2secret", "hunter 2secret",
                                      "/#?hunter2", "hunter2%2Fsecret", "a b/c#d?e"])  # fmt: skip
def test_a_password_of_any_characters_is_never_shown(password):
    url = f"postgresql://search:{password}@db:5432/optuna?sslmode=require"
    line = f"storage: cannot open {url}: the server said {password!r}, {urllib.parse.unquote(password)}"
    redacted = study_module.redact(line, url)
    assert password not in redacted and urllib.parse.unquote(password) not in redacted
    assert "search:***@db:5432/optuna?sslmode=require" in redacted


def test_a_journal_path_under_the_home_folder_gets_its_log_and_leaderboard_beside_it(tmp_path, monkeypatch):
    import run_search

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    assert run_search.main(["--simulate", "--hours", "1", "--storage", "~/x/st.db"]) == 0
    assert {p.name for p in (tmp_path / "home" / "x").iterdir()} >= {"st.db", "search.log", "leaderboard.md"}
    assert list((tmp_path / "cwd").iterdir()) == []  # no literal ./~ folder


def test_a_budget_path_under_the_home_folder_is_read(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copy(BUDGET, tmp_path / "mine.yaml")
    assert load_settings("~/mine.yaml", storage="~/st.db").storage == str(tmp_path / "st.db")
