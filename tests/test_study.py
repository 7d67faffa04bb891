"""The study: journal file the dashboard opens as typed, deadline kept on resume, warm starts once, clear refusals."""

from __future__ import annotations

import dataclasses
import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import optuna
import pytest

from search.plots import plot_round, upload_plot
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
    png = plot_round(progress, tmp_path / "round-0.png", title="trial 0")
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
    assert plot_round(tmp_path / "absent.jsonl", tmp_path / "a.png") is None
    progress = tmp_path / "progress.jsonl"
    progress.write_text(json.dumps({"step": 1, "reward": 0.5, "rewards": {"accuracy": 0.5}}) + "\n{\"step\": 2, \"rew")
    png = plot_round(progress, tmp_path / "round.png")
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
