"""Faults an eight-hour unattended run meets, injected one by one; the study, the finished rounds and a whole
submission must survive each.

Three layers, each as real as a CPU allows:
- the simulated backend on a virtual clock (a whole 7.5-hour search with every kind of failing round);
- the real `run_search.py` program (settings, study, Scheduler, LocalBackend's process groups, promotion) whose
  GRPO round and evaluation are stub programs (tests/faultkit.py): kill -9 of the scheduler, rounds that raise, run
  out of memory, go NaN, get OOM-killed or hang, a full disk while promoting;
- the real trainer on the tiny Qwen2-VL: kill -9 of the scheduler during a real round, out of memory while
  training and a full disk while saving.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

import faultkit
from faultkit import alive, group_members, read_jsonl, wait_for
from search.promotion import submission as promotion
from search.backends.clock import VirtualClock
from search.promotion import RecordingPromoter
from search.scheduler import Scheduler
from search.settings import load_settings
from search.backends.simulated import SimulatedBackend
from search.study import DEADLINE_ATTR, open_storage, open_study
from trainer.run_folder import FailureKind

ROOT = Path(__file__).resolve().parents[1]
ORPHANED = "orphaned: the scheduler stopped during this round"


# ---------------------------------------------------------------------------------------------------------- helpers
def stub_box(tmp_path: Path, split: Path, **changes) -> Path:
    """A budget for the stub rounds: the real box checks, a few seconds of search."""
    values = dict(
        hours=20 / 3600, reserve_minutes=0, round_min_minutes=0.02, round_max_minutes=0.5, hang_minutes=0.05,
        duration_prior_scale=0.001, gpus=0, model_path=str(faultkit.fake_model(tmp_path / "model")),
        train_path=str(split), val_path=str(split), ood_val_path=str(split), val_rows=2, keep_rounds=1,
        submission_path=str(tmp_path / "app" / "submission"), runs_dir=str(tmp_path / "runs"),
        storage=str(tmp_path / "study.db"), study_name="faults",
    )  # fmt: skip
    (tmp_path / "app").mkdir(exist_ok=True)
    return faultkit.write_budget(tmp_path, **{**values, **changes})


def load(tmp_path: Path, name: str = "faults") -> optuna.Study:
    return optuna.load_study(study_name=name, storage=open_storage(str(tmp_path / "study.db"), create=False))


def submission_is_whole(submission: Path) -> dict:
    """The submission holds one round's model entire, and PROMOTED.json names that round."""
    marker = promotion.promoted(submission)
    assert marker is not None, f"no PROMOTED.json in {submission}"
    config = json.loads((submission / "config.json").read_text())
    if marker.get("recipe") == "base":  # faultkit.fake_model's folder
        assert config["tag"] == "base" and (submission / "model.safetensors").stat().st_size > 0
    else:
        assert config["tag"] == f"round-{marker['trial']:04d}"
        assert (submission / "model.safetensors").read_text() == config["tag"] * 100
    leftovers = [p.name for p in submission.parent.iterdir() if ".incoming" in p.name or p.name.endswith(".old")]
    assert leftovers == []
    return marker


def no_round_process_survives(runs: Path) -> int:
    """Every process group any round spawned is gone; returns how many groups were checked."""
    groups = [entry["pgid"] for f in runs.rglob("processes.jsonl") for entry in read_jsonl(f)]
    for pgid in groups:
        wait_for(lambda: not group_members(pgid), 10, f"process group {pgid} to be gone")
    return len(groups)


def by_number(study: optuna.Study) -> dict[int, optuna.trial.FrozenTrial]:
    return {t.number: t for t in study.trials}


# ---------------------------------------------------------------------------------------------------------- simulated
class ScriptedBackend(SimulatedBackend):
    """The simulated backend with a fault forced on chosen rounds (by start order; round 0, the base, is start 0)."""

    def __init__(self, *args, faults: dict[int, str], **kwargs):
        super().__init__(*args, failure_rate=0.0, hang_rate=0.0, **kwargs)
        self.faults, self.started = faults, 0

    def score(self, model_dir, run_dir, gpus):
        self.started += 1
        return super().score(model_dir, run_dir, gpus)

    def start(self, config, gpus):
        index, self.started = self.started, self.started + 1
        fault = self.faults.get(index)
        if fault == "cannot start":
            raise OSError(errno.ENOSPC, "No space left on device", config.output_dir)
        handle = super().start(config, gpus)
        if fault == "raise":
            handle._failure = (0, "RuntimeError: CUDA error: an illegal memory access was encountered",
                               FailureKind.ERROR)
        elif fault == "oom":
            handle._failure = (1, "out of memory: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
                               FailureKind.OUT_OF_MEMORY)  # fmt: skip
        elif fault == "nan":
            handle._failure = (2, "NaN or inf loss (nan) at step 2", FailureKind.NAN)
        elif fault == "hang":
            handle._hang_step = 1
        return handle


def test_simulated_rounds_that_fail_every_way_are_recorded_and_the_search_goes_on(tmp_path):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    settings = dataclasses.replace(
        load_settings(ROOT / "budget.yaml", hours=7.5, storage=str(tmp_path / "study.db")),
        runs_dir=str(tmp_path / "runs"), gpus=1, gpus_per_trial=1, round_min_minutes=20, round_max_minutes=60,
    )  # fmt: skip
    clock = VirtualClock(1_800_000_000.0)
    study, deadline = open_study(settings, now=clock.now())
    faults = {1: "raise", 2: "oom", 4: "nan", 5: "hang", 7: "cannot start"}
    backend = ScriptedBackend(settings, clock, 0, faults=faults)
    promoted = []
    scheduler = Scheduler(settings, study, deadline, backend, clock,
                          promoter=RecordingPromoter(lambda outcome, trial: promoted.append(trial.number) or True))
    with contextlib.redirect_stdout(io.StringIO()):
        scheduler.run()
    started = sorted((t for t in study.trials if "started_at" in t.user_attrs), key=lambda t: t.user_attrs["started_at"])
    reasons = {i: started[i].user_attrs["reason"] for i in (1, 2, 4, 5, 7)}
    assert reasons[1].startswith("RuntimeError: CUDA error") and started[1].state == TrialState.FAIL
    assert reasons[2].startswith("out of memory") and started[2].state == TrialState.PRUNED  # the configuration's
    assert reasons[4].startswith("NaN or inf loss") and started[4].state == TrialState.PRUNED
    assert reasons[5] == "hung: no progress for 15 min" and started[5].state == TrialState.FAIL
    assert reasons[7].startswith("could not start the round: [Errno 28] No space left on device")
    assert all(started[i].user_attrs["state"] == "failed" for i in reasons)
    completed = [t for t in started if t.state == TrialState.COMPLETE]
    assert len(started) > 12 and len(completed) > 6 and max(t.number for t in completed) > started[7].number
    assert not [t for t in study.trials if t.state == TrialState.RUNNING]
    assert promoted and clock.now() <= deadline


# ---------------------------------------------------------------------------------------------------------- stub rounds
def test_rounds_that_raise_oom_nan_get_killed_or_hang_are_ended_and_recorded(tmp_path, tiny_split_dir):
    """The real program; the rounds are stub processes. A promotion meets a full disk on the way."""
    # 30 s: nine planned rounds, a 3 s hang among them, and at least one more; 20 s ran exactly nine on a loaded CPU.
    budget = stub_box(tmp_path, tiny_split_dir, hours=30 / 3600)
    env = {**os.environ, "FAULT_PLAN": "ok,raise,ok,oom,nan,ok,oomkill,hang,ok", "STUB_ENOSPC_COPY": "2",
           "PROMOTION_LOG": str(tmp_path / "promotions.jsonl")}  # fmt: skip
    result = subprocess.run(faultkit.search_command("--budget", str(budget)), cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    trials = by_number(load(tmp_path))
    expected = {
        1: (TrialState.FAIL, "RuntimeError: boom in the reward function"),
        3: (TrialState.PRUNED, "out of memory: OutOfMemoryError: CUDA out of memory"),
        4: (TrialState.PRUNED, "NaN or inf reward (None) at step 2"),
        6: (TrialState.FAIL, "the trainer was killed by SIGKILL (the kernel's out-of-memory killer sends it)"),
        7: (TrialState.FAIL, "hung: no progress for 0.05 min"),
    }
    for number, (state, reason) in expected.items():
        t = trials[number]
        assert t.state == state and t.user_attrs["state"] == "failed", (number, t.state, t.user_attrs["reason"])
        assert t.user_attrs["reason"].startswith(reason), (number, t.user_attrs["reason"])
    hung_child = int(Path(trials[7].user_attrs["run_dir"], "child.pid").read_text())
    assert not alive(hung_child)
    # The search went on past every fault.
    assert len(trials) > 9 and [n for n, t in trials.items() if n > 7 and t.state == TrialState.COMPLETE]
    assert not [t for t in trials.values() if t.state == TrialState.RUNNING]
    # The full disk: that round is recorded unpromoted, the submission stayed whole, a later round was promoted.
    [full] = [t for t in trials.values() if "promotion_error" in t.user_attrs]
    assert full.user_attrs["promotion_error"].startswith("OSError: [Errno 28] No space left on device")
    marker = submission_is_whole(tmp_path / "app" / "submission")
    completed = [t for t in trials.values() if t.state == TrialState.COMPLETE and t.number != full.number]
    assert marker["accuracy"] == max(t.value for t in completed)
    swaps = [e["accuracy"] for e in read_jsonl(tmp_path / "promotions.jsonl")]
    assert swaps == sorted(set(swaps)) and len(swaps) >= 2  # each promotion strictly better than the last
    # A trained round's files are linked into the submission, not copied.
    assert marker["recipe"] != "base" and (tmp_path / "runs") in Path(marker["source"]).parents
    assert os.path.samefile(tmp_path / "app" / "submission" / "config.json", Path(marker["source"]) / "config.json")
    assert no_round_process_survives(tmp_path / "runs") >= 9


def test_when_every_round_fails_the_base_is_the_checked_submission(tmp_path, tiny_split_dir):
    """Round 0 scores the base model and promotes it (the format floor does not apply to it); every round after it
    fails; the search ends with the base in the submission, checked in the reserve, and says so."""
    budget = stub_box(tmp_path, tiny_split_dir, hours=20 / 3600, min_format_rate=99.0)
    env = {**os.environ, "FAULT_PLAN": ",".join(["ok"] + ["raise"] * 10)}
    result = subprocess.run(faultkit.search_command("--budget", str(budget)), cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    trials = by_number(load(tmp_path))
    base = trials[0]
    assert base.user_attrs["recipe"] == "base" and base.state == TrialState.COMPLETE and base.user_attrs["promoted"]
    assert base.user_attrs["format_rate"] < 99.0  # below the floor, promoted all the same: it is the fallback
    parts = base.user_attrs["promotion_timings"]  # where the promotion's seconds went
    assert set(parts) == {"copy", "flush", "check", "check_start", "check_load", "check_answers", "check_exit"}
    assert parts["copy"] + parts["flush"] + parts["check"] <= base.user_attrs["promotion_s"] + 0.2
    rounds = [t for n, t in trials.items() if n > 0]
    assert len(rounds) >= 5 and all(t.state == TrialState.FAIL for t in rounds)
    marker = submission_is_whole(tmp_path / "app" / "submission")
    assert (marker["trial"], marker["recipe"], marker["accuracy"]) == (0, "base", base.value)
    # The base model's folder is the user's: copied, so that re-saving the submission cannot write through to it.
    assert not os.path.samefile(tmp_path / "app" / "submission" / "config.json",
                                Path(marker["source"]) / "config.json")  # fmt: skip
    lines = result.stdout.splitlines()
    assert f"submission: {tmp_path / 'app' / 'submission'} holds trial 0 (base, {base.value:.1f}% on ood_val)" in lines
    assert any("final check passed: the submission (trial 0)" in line for line in lines)
    board = (tmp_path / "leaderboard.md").read_text()
    assert "| 1 | 0 | **base** | completed |" in board and "final check passed" in board


def test_kill_9_of_the_scheduler_then_the_same_command_again(tmp_path, tiny_split_dir):
    """Round 2 hangs deaf to SIGTERM with a child: the parent-death signal cannot end it, the rerun's orphan
    sweep must. Nothing finished is lost, the deadline is kept, the submission is whole throughout."""
    budget = stub_box(tmp_path, tiny_split_dir, hours=35 / 3600, hang_minutes=5)  # round 0 scores the base first
    env = {**os.environ, "FAULT_PLAN": "ok,ok,hang"}
    command = faultkit.search_command("--budget", str(budget))
    first = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    child_pid = tmp_path / "runs" / "faults" / "round-0002" / "child.pid"
    try:
        wait_for(lambda: child_pid.exists() and child_pid.read_text(), 60, "round 2 to hang")
    finally:
        first.send_signal(signal.SIGKILL)
        output = first.communicate()[0].decode()
    study = load(tmp_path)
    before = {n: (t.state, t.value, t.user_attrs.get("promoted")) for n, t in by_number(study).items()
              if t.state.is_finished()}  # fmt: skip
    assert {0, 1} <= set(before) and study.trials[2].state == TrialState.RUNNING, output
    deadline = study.user_attrs[DEADLINE_ATTR]
    submission = tmp_path / "app" / "submission"
    marker = submission_is_whole(submission)
    leader = read_jsonl(tmp_path / "runs" / "faults" / "round-0002" / "processes.jsonl")[0]["pgid"]
    child = int(child_pid.read_text())
    time.sleep(0.5)
    assert alive(leader) and alive(child)  # a round deaf to SIGTERM outlives its scheduler...

    second = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert not alive(leader) and not alive(child)  # ...until the same command again sweeps it
    study = load(tmp_path)
    trials = by_number(study)
    assert study.user_attrs[DEADLINE_ATTR] == deadline
    assert f"deadline {time.strftime('%Y-%m-%d %H:%M', time.localtime(deadline))}" in second.stdout
    orphan = trials[2]
    assert orphan.state == TrialState.FAIL and orphan.user_attrs["reason"] == ORPHANED
    assert orphan.user_attrs["reaped_process_groups"] == [leader]
    assert f"round 2 {ORPHANED}" in second.stdout
    assert {n: (trials[n].state, trials[n].value, trials[n].user_attrs.get("promoted")) for n in before} == before
    assert [n for n, t in trials.items() if n > 2 and t.state == TrialState.COMPLETE]  # the search went on
    assert not [t for t in trials.values() if t.state == TrialState.RUNNING]
    assert submission_is_whole(submission)["accuracy"] >= marker["accuracy"]
    no_round_process_survives(tmp_path / "runs")


# ---------------------------------------------------------------------------------------------------------- promotion
PROMOTE_AND_PAUSE = r"""
import os, shutil, sys, time
from pathlib import Path
from search.promotion import submission as promotion

point, merged, submission, ready = sys.argv[1:5]

def pause():
    Path(ready).write_text("1")
    time.sleep(120)

def copy(source, target):
    if point == "copy":  # half the files are there
        os.makedirs(target)
        shutil.copy(Path(source) / "config.json", target)
        pause()
    shutil.copytree(source, target)

def check(path):
    if point == "check":
        pause()

if point == "swap":  # a filesystem without RENAME_EXCHANGE: killed between the two renames
    promotion._exchange = lambda a, b: False
    rename = os.rename
    def paused_rename(a, b):
        rename(a, b)
        if str(b).endswith("submission.old"):
            pause()
    os.rename = paused_rename
promotion.promote(merged, submission, min_format_rate=0, format_rate=99.0, accuracy=99.0, trial=9, check=check,
                  copy_tree=copy)
"""


def _model(folder: Path, tag: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2_vl", "tag": tag}))
    (folder / "model.safetensors").write_text(tag * 100)
    return folder


@pytest.mark.parametrize("point", ["copy", "check", "swap"])
def test_a_kill_during_promotion_leaves_the_previous_submission_whole(tmp_path, point):
    submission = tmp_path / "submission"
    assert promotion.promote(_model(tmp_path / "round-0001", "round-0001"), submission, min_format_rate=0,
                             format_rate=99.0, accuracy=50.0, trial=1, check=lambda path: None)  # fmt: skip
    before = {p.name: p.read_bytes() for p in submission.iterdir()}
    new, ready = _model(tmp_path / "round-0009", "round-0009"), tmp_path / "ready"
    worker = subprocess.Popen([sys.executable, "-c", PROMOTE_AND_PAUSE, point, str(new), str(submission), str(ready)],
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    try:
        wait_for(ready.exists, 60, f"the promotion to reach {point}")
    finally:
        worker.kill()
        worker.wait()
    if point == "swap":  # the only window without a submission at its path: the old one waits aside, whole
        assert not submission.exists() and (tmp_path / ".submission.old").is_dir()
    else:
        assert {p.name: p.read_bytes() for p in submission.iterdir()} == before
    promotion.recover_submission(submission)  # what the next start does
    assert {p.name: p.read_bytes() for p in submission.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [".submission.lock", "ready", "round-0001", "round-0009",
                                                          "submission"]  # fmt: skip
    # The lock died with the killed worker: the next promotion goes through.
    assert promotion.promote(new, submission, min_format_rate=0, format_rate=99.0, accuracy=99.0, trial=9,
                             check=lambda path: None)  # fmt: skip
    assert submission_is_whole(submission)["trial"] == 9


# ---------------------------------------------------------------------------------------------------------- real rounds
def real_trial(tmp_path: Path, model: Path, split: Path, **overrides):
    from trainer.config import TrialConfig

    values = dict(model_path=str(model), train_path=str(split), output_dir=str(tmp_path / "round"), steps=2,
                  num_generations=2, prompts_per_step=1, generation_steps=1, max_completion_length=8,
                  max_pixels=56 * 56, lora_rank=4, learning_rate=1e-3, eval_every=0)  # fmt: skip
    return TrialConfig(**{**values, **overrides})


@pytest.mark.parametrize("fault", ["out_of_memory", "full_disk_while_saving"])
def test_a_real_round_that_runs_out_of_memory_or_disk_fails_with_its_reason(tmp_path, tiny_model_dir, tiny_split_dir,
                                                                            monkeypatch, fault):  # fmt: skip
    import torch
    from transformers import PreTrainedModel

    from trainer import round as round_module
    from trainer.round import run_round

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    if fault == "out_of_memory":
        def train(self, *args, **kwargs):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

        monkeypatch.setattr(round_module.ReplicaGRPOTrainer, "train", train)
        expected = "out of memory: OutOfMemoryError: CUDA out of memory"
    else:
        def save_pretrained(self, folder, *args, **kwargs):
            Path(folder).mkdir(parents=True, exist_ok=True)
            (Path(folder) / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 4096)  # half written
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(PreTrainedModel, "save_pretrained", save_pretrained)
        expected = "OSError: [Errno 28] No space left on device"
    config = real_trial(tmp_path, tiny_model_dir, tiny_split_dir, steps=1)
    result = run_round(config)
    status = json.loads((tmp_path / "round" / "status.json").read_text())
    assert result.state == status["state"] == "failed" and status["reason"].startswith(expected), status["reason"]
    assert sorted(p.name for p in (tmp_path / "round").iterdir() if p.name not in ("trl",)) == (
        ["progress.jsonl", "status.json"] if fault != "out_of_memory" else ["status.json"]
    )  # no merged/ and no half-written .merged.tmp taking the disk


def test_kill_9_of_the_scheduler_during_a_real_tiny_round(tmp_path, tiny_model_dir, tiny_split_dir):
    """The real trainer: it dies with its scheduler (a parent-death SIGTERM: it stops after its step and saves);
    the same command again fails the orphaned trial with its reason and keeps the deadline. The budget leaves the
    rerun no time for another real round."""
    hours_s = 90
    budget = faultkit.write_budget(
        tmp_path, hours=hours_s / 3600, reserve_minutes=0, round_min_minutes=1, round_max_minutes=1.5,
        hang_minutes=5, duration_prior_scale=0.01, gpus=0, model_path=str(tiny_model_dir),
        train_path=str(tiny_split_dir), val_path=str(tiny_split_dir), ood_val_path=str(tiny_split_dir), val_rows=2,
        prune_every=0, submission_path=str(tmp_path / "submission"), runs_dir=str(tmp_path / "runs"),
        storage=str(tmp_path / "study.db"), study_name="faults",
    )  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(ROOT / "run_search.py"), "--budget", str(budget)]
    started = time.time()
    # Round 0 (the base model scored) is taken as done by an earlier run, so that the first round trains at once.
    study, _ = open_study(load_settings(budget), now=started)
    base = study.ask()
    assert base.user_attrs["recipe"] == "base"
    study.tell(base, 1.0)
    first = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    run_dir = tmp_path / "runs" / "faults" / "round-0001"
    try:
        wait_for(lambda: (run_dir / "progress.jsonl").exists() and (run_dir / "progress.jsonl").read_text(), 150,
                 "the real round's first step", interval=0.1)  # fmt: skip
    finally:
        first.send_signal(signal.SIGKILL)
        output = first.communicate()[0].decode()
    trainer, evaluator = read_jsonl(run_dir / "processes.jsonl")  # the evaluator waits beside the trainer
    wait_for(lambda: not group_members(trainer["pgid"]), 90, "the trainer to end with its scheduler", interval=0.2)
    wait_for(lambda: not group_members(evaluator["pgid"]), 30, "the waiting evaluator to end with its scheduler",
             interval=0.2)  # fmt: skip
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "stopped" and "SIGTERM" in (status["reason"] or ""), (status, output[-2000:])
    study = load(tmp_path)
    deadline = study.user_attrs[DEADLINE_ATTR]
    assert started < deadline - hours_s + 30  # the deadline is the first start's
    time.sleep(max(0.0, deadline - 60 + 3 - time.time()))  # past the last moment a 1-minute round may start

    second = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    study = load(tmp_path)
    assert study.user_attrs[DEADLINE_ATTR] == deadline
    orphan = study.trials[1]
    assert orphan.state == TrialState.FAIL and orphan.user_attrs["reason"] == ORPHANED
    assert "round 1 orphaned" in second.stdout and "no time left for a useful round" in second.stdout
    assert not [t for t in study.trials if t.state == TrialState.RUNNING]
    assert not (tmp_path / "submission").exists()  # nothing finished, nothing promoted, nothing half-written
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".submission.") and p.name != ".submission.lock"]
