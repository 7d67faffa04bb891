"""LocalBackend against stub programs standing in for the trainer and the evaluator (same command-line contract, same
files): tailing, the evaluation chain, STOP, killing the whole process group, hang detection through the
Scheduler, and the failure paths. The real trainer gets its own end-to-end test."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

from search import scheduler as scheduler_module
from search.backends.clock import WallClock
from search.backends.local import LocalBackend
from search.promotion import RecordingPromoter
from search.scheduler import Scheduler
from search.settings import load_settings
from search.study import open_study
from trainer.config import TrialConfig

from faultkit import alive

ROOT = Path(__file__).resolve().parents[1]

# `python stub.py trainer --config RUN_DIR/trial.json` / `python stub.py evaluator MODEL DATA... --out REPORT...
# [--wait-for-input]`; STUB_MODE (inherited through the environment) picks the behaviour.
STUB = r'''
import json, os, signal, subprocess, sys, time
from pathlib import Path

role, mode = sys.argv[1], os.environ.get("STUB_MODE", "ok")
if role == "evaluator":
    if mode == "eval_bad_split":  # fails while reading its splits, before it waits
        sys.exit("evaluator: val: no such folder")
    waited = "--wait-for-input" in sys.argv
    if waited:
        print("evaluator: waiting", flush=True)
        if not sys.stdin.readline():
            sys.exit(3)
    options = [i for i, arg in enumerate(sys.argv) if arg.startswith("--")]
    splits = sys.argv[3 : options[0]]
    outs = sys.argv[sys.argv.index("--out") + 1 :][: len(splits)]
    if mode == "eval_fails":
        sys.exit("evaluator: the model folder does not load")
    if mode == "eval_writes_ood_only":
        print("the val split vanished")
        outs = outs[:1]
    for data, out in zip(splits, outs):
        accuracy = 61.5 if "ood" in Path(data).name else 80.0
        report = {"accuracy_pct": accuracy, "n": 10, "format_rate": 95.0, "mean_completion_tokens": 12.0,
                  "argv": sys.argv, "pid": os.getpid(), "waited": waited,
                  "model_saved": Path(sys.argv[2], "config.json").is_file()}
        Path(out).write_text(json.dumps(report))
    sys.exit(0)

config = json.loads(Path(sys.argv[sys.argv.index("--config") + 1]).read_text())
out = Path(config["output_dir"])
(out / "env.json").write_text(json.dumps({"cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "argv": sys.argv}))
progress = (out / "progress.jsonl").open("a")

def line(step, **extra):
    progress.write(json.dumps({"step": step, "reward": 0.5, **extra}) + "\n")
    progress.flush()

def finish(state, steps, reason=None, model=True, code=0, **kind):
    if model:
        (out / "merged").mkdir(exist_ok=True)
        (out / "merged" / "config.json").write_text("{}")
    timings = {"setup": 0.01, "train": 0.05, "save": 0.01}
    status = {"state": state, "reason": reason, "steps_done": steps, "timings": timings, **kind}
    (out / "status.json").write_text(json.dumps(status))
    sys.exit(code)

if mode in ("ok", "eval_fails", "eval_bad_split", "eval_writes_ood_only"):
    for step in (1, 2, 3):
        line(step, **({"ood_accuracy": 52.0} if step == 2 else {}))
    finish("completed", 3)
elif mode == "until_stop":
    step = 0
    while not (out / "STOP").exists():
        step += 1
        line(step)
        time.sleep(0.02)
    finish("stopped", step)
elif mode == "failed":
    finish("failed", 0, reason="CUDA out of memory while loading the model", model=False, code=1)
elif mode in ("nan", "out_of_memory", "error"):  # the kind says it; the reason's words do not
    line(1)
    finish("failed", 1, reason="the round ended at step 1", model=False, code=1, kind=mode)
elif mode == "nan_without_kind":  # a status written before there were kinds
    line(1)
    finish("failed", 1, reason="NaN or inf loss (nan) at step 1", model=False, code=1)
elif mode == "crash":
    print("Traceback (most recent call last):\nRuntimeError: boom", file=sys.stderr)
    sys.exit(3)
elif mode == "no_model":
    line(1)
    finish("completed", 1, model=False)
elif mode == "hang":  # a child in the same group, and a leader deaf to SIGTERM
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    (out / "child.pid").write_text(str(child.pid))
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    line(1)
    time.sleep(600)
'''


def make_settings(tmp_path: Path, **overrides):
    settings = load_settings(ROOT / "budget.yaml", storage=str(tmp_path / "study.db"))
    values = dict(
        runs_dir=str(tmp_path / "runs"), ood_val_path=str(tmp_path / "ood_val"), val_path=str(tmp_path / "val"),
        ood_rows=None, val_rows=5, eval_batch_size=None, seed=7, gpus=1, gpus_per_trial=1,
    )  # fmt: skip
    return dataclasses.replace(settings, **{**values, **overrides})


@pytest.fixture
def backend(tmp_path: Path) -> LocalBackend:
    stub = tmp_path / "stub.py"
    stub.write_text(STUB)
    backend = LocalBackend(make_settings(tmp_path))
    backend.trainer_command = [sys.executable, str(stub), "trainer"]
    backend.evaluator_command = [sys.executable, str(stub), "evaluator"]
    backend.kill_grace_s = 0.5
    return backend


def start(backend: LocalBackend, tmp_path: Path, mode: str, monkeypatch, gpus=(0,)):
    monkeypatch.setenv("STUB_MODE", mode)
    config = TrialConfig(model_path="m", train_path="t", output_dir=str(tmp_path / "round"), steps=3)
    return backend.start(config, list(gpus))


def wait_done(handle, timeout: float = 30.0) -> None:
    until = time.monotonic() + timeout
    while not handle.done():
        assert time.monotonic() < until, "the round did not finish"
        time.sleep(0.02)


def test_a_round_trains_then_is_scored_on_ood_and_val(backend, tmp_path, monkeypatch):
    handle = start(backend, tmp_path, "ok", monkeypatch, gpus=(1,))
    wait_done(handle)
    run_dir = tmp_path / "round"
    assert TrialConfig.from_json(run_dir / "trial.json").steps == 3
    lines = handle.progress()
    assert [line["step"] for line in lines] == [1, 2, 3] and lines[1]["ood_accuracy"] == 52.0
    assert handle.progress() == []  # each line once
    outcome = handle.outcome()
    assert outcome.state == "completed" and outcome.reason is None
    assert (outcome.ood_accuracy, outcome.val_accuracy) == (61.5, 80.0)
    assert (outcome.format_rate, outcome.mean_completion_tokens, outcome.steps_done) == (95.0, 12.0, 3)
    assert outcome.merged_dir == str(run_dir / "merged")
    assert set(outcome.timings) == {"setup", "train", "save", "eval"} and outcome.timings["eval"] > 0
    assert json.loads((run_dir / "env.json").read_text())["cuda"] == "1"
    ood, val = (json.loads((run_dir / f"{name}_eval.json").read_text()) for name in ("ood", "val"))
    assert ood["pid"] == val["pid"]  # one evaluation process scored both splits
    assert ood["waited"] and ood["model_saved"]  # started with the trainer, told to go once the model was saved
    argv = ood["argv"]
    assert argv[3:5] == [str(tmp_path / "ood_val"), str(tmp_path / "val")]
    # ood_rows null: all of ood_val; val_rows 5 of val, seeded with the study's seed
    assert argv[argv.index("--limit") + 1 :][:2] == ["all", "5"] and argv[argv.index("--seed") + 1] == "7"
    assert argv[argv.index("--out") + 1 :][:2] == [str(run_dir / "ood_eval.json"), str(run_dir / "val_eval.json")]
    assert "--dynamic-cache" not in argv  # budget.yaml: the static cache
    assert (run_dir / "train.log").exists() and (run_dir / "eval.log").exists()


def test_a_cpu_round_sees_no_gpu(backend, tmp_path, monkeypatch):
    handle = start(backend, tmp_path, "ok", monkeypatch, gpus=())
    wait_done(handle)
    assert json.loads((tmp_path / "round" / "env.json").read_text())["cuda"] == ""


def test_progress_returns_only_complete_lines(backend, tmp_path, monkeypatch):
    handle = start(backend, tmp_path, "until_stop", monkeypatch)
    progress = tmp_path / "round" / "progress.jsonl"
    seen: list[int] = []
    until = time.monotonic() + 10
    while len(seen) < 5:
        assert time.monotonic() < until
        seen += [line["step"] for line in handle.progress()]
    handle.request_stop()
    wait_done(handle)
    seen += [line["step"] for line in handle.progress()]
    assert seen == list(range(1, len(seen) + 1))  # in order, none twice, none lost
    with progress.open("a") as f:  # a line still being written is held back until it is complete
        f.write('{"step": 1000, "rew')
    assert handle.progress() == []
    with progress.open("a") as f:
        f.write('ard": 1.0}\nnot json\n')
    assert handle.progress() == [{"step": 1000, "reward": 1.0}]


def test_stop_saves_and_scores_the_round(backend, tmp_path, monkeypatch):
    handle = start(backend, tmp_path, "until_stop", monkeypatch)
    until = time.monotonic() + 10
    while not handle.progress():  # training has begun
        assert time.monotonic() < until
        time.sleep(0.02)
    handle.request_stop()
    wait_done(handle)
    outcome = handle.outcome()
    assert outcome.state == "stopped" and outcome.steps_done >= 1 and outcome.ood_accuracy == 61.5


def round_processes(run_dir: Path) -> list[int]:
    return [json.loads(line)["pgid"] for line in (run_dir / "processes.jsonl").read_text().splitlines()]


def test_the_evaluator_waits_beside_the_trainer_and_scores_the_saved_model(backend, tmp_path, monkeypatch):
    handle = start(backend, tmp_path, "until_stop", monkeypatch)
    run_dir = tmp_path / "round"
    until = time.monotonic() + 10
    while "evaluator: waiting" not in (run_dir / "eval.log").read_text():
        assert time.monotonic() < until, "the evaluator did not start beside the trainer"
        time.sleep(0.02)
    trainer, evaluator = round_processes(run_dir)
    assert handle.pid == trainer and alive(evaluator) and not (run_dir / "merged").exists()
    time.sleep(0.3)
    assert alive(evaluator) and not (run_dir / "ood_eval.json").exists()  # it waits for the model
    handle.request_stop()
    wait_done(handle)
    assert handle.outcome().state == "stopped" and handle.outcome().ood_accuracy == 61.5
    report = json.loads((run_dir / "ood_eval.json").read_text())
    assert report["pid"] == evaluator and report["waited"] and report["model_saved"]
    assert round_processes(run_dir) == [trainer, evaluator]  # no second evaluator was started


@pytest.mark.parametrize("end", ["stop_without_evaluation", "training_fails", "kill"])
def test_a_round_that_ends_unscored_kills_its_waiting_evaluator(backend, tmp_path, monkeypatch, end):
    handle = start(backend, tmp_path, "failed" if end == "training_fails" else "until_stop", monkeypatch)
    run_dir = tmp_path / "round"
    until = time.monotonic() + 10
    while "evaluator: waiting" not in (run_dir / "eval.log").read_text():
        assert time.monotonic() < until, "the evaluator did not start beside the trainer"
        time.sleep(0.02)
    if end == "stop_without_evaluation":
        handle.request_stop(evaluate=False)
    elif end == "kill":
        handle.kill()
    wait_done(handle)
    assert handle.outcome().ood_accuracy is None and not (run_dir / "ood_eval.json").exists()
    assert len(round_processes(run_dir)) == 2
    assert not any(alive(pgid) for pgid in round_processes(run_dir))


def test_stop_without_evaluation_frees_the_gpus_after_the_save(backend, tmp_path, monkeypatch):
    handle = start(backend, tmp_path, "until_stop", monkeypatch)
    handle.request_stop(evaluate=False)
    wait_done(handle)
    outcome = handle.outcome()
    assert outcome.state == "stopped" and outcome.ood_accuracy is None and "eval" not in outcome.timings
    assert not (tmp_path / "round" / "ood_eval.json").exists()


def test_kill_ends_the_whole_process_group(backend, tmp_path, monkeypatch):
    handle = start(backend, tmp_path, "hang", monkeypatch)
    child_pid = tmp_path / "round" / "child.pid"
    until = time.monotonic() + 10
    while not (child_pid.exists() and child_pid.read_text()):
        assert time.monotonic() < until
        time.sleep(0.02)
    child = int(child_pid.read_text())
    assert alive(child) and not handle.done()
    started = time.monotonic()
    handle.kill()  # the leader ignores SIGTERM: SIGKILL after the grace
    assert time.monotonic() - started < 5
    assert handle.done() and handle.outcome().state == "failed"
    assert "killed" in handle.outcome().reason
    until = time.monotonic() + 5
    while alive(child):
        assert time.monotonic() < until, "a child of the round survived the kill"
        time.sleep(0.02)


@pytest.mark.parametrize(
    "mode, reason",
    [
        ("failed", "CUDA out of memory while loading the model"),
        ("crash", "the trainer exited with code 3: RuntimeError: boom"),
        ("no_model", "the trainer reported completed but wrote no model to"),
        ("eval_fails", "the evaluation failed with exit code 1 (evaluator: the model folder does not load)"),
        ("eval_bad_split", "the evaluation failed with exit code 1 (evaluator: val: no such folder)"),
        ("eval_writes_ood_only", "the evaluation wrote no val report (the val split vanished)"),
    ],
)
def test_failures_carry_their_reason(backend, tmp_path, monkeypatch, mode, reason):
    handle = start(backend, tmp_path, mode, monkeypatch)
    wait_done(handle)
    outcome = handle.outcome()
    assert outcome.state == "failed" and outcome.reason.startswith(reason)
    assert outcome.merged_dir is None and outcome.ood_accuracy is None


def test_the_scheduler_kills_a_hung_round(backend, tmp_path, monkeypatch):
    monkeypatch.setattr(scheduler_module, "POLL_S", 0.05)
    monkeypatch.setattr(scheduler_module, "MAX_CONSECUTIVE_FAILURES", 1)  # end the search after that round
    monkeypatch.setenv("STUB_MODE", "hang")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    settings = make_settings(tmp_path, gpus=0, hang_minutes=0.05, reserve_minutes=0, round_min_minutes=1)
    backend.settings = settings
    clock = WallClock()
    study, deadline = open_study(settings, now=clock.now())
    started = time.monotonic()
    Scheduler(settings, study, deadline, backend, clock, promoter=RecordingPromoter()).run()
    assert time.monotonic() - started < 15
    base, trial = [t for t in study.trials if t.state != optuna.trial.TrialState.WAITING]
    assert base.user_attrs["recipe"] == "base" and base.state == optuna.trial.TrialState.COMPLETE
    assert trial.state == optuna.trial.TrialState.FAIL
    assert trial.user_attrs["reason"] == "hung: no progress for 0.05 min"
    child = int(Path(trial.user_attrs["run_dir"], "child.pid").read_text())
    until = time.monotonic() + 5
    while alive(child):
        assert time.monotonic() < until, "the hung round's child survived"
        time.sleep(0.02)


@pytest.mark.parametrize(
    "mode, told, failure",
    [
        ("nan", optuna.trial.TrialState.PRUNED, "nan"),
        ("out_of_memory", optuna.trial.TrialState.PRUNED, "out_of_memory"),
        ("error", optuna.trial.TrialState.FAIL, "error"),
        ("nan_without_kind", optuna.trial.TrialState.FAIL, "error"),
    ],
)
def test_a_failure_is_told_by_its_kind_not_its_reason(backend, tmp_path, monkeypatch, mode, told, failure):
    """A NaN and an out-of-memory status are the configuration's failures: told PRUNED, which TPE learns from,
    whatever their reason says; a status without a kind reads as an error, whatever its reason says."""
    monkeypatch.setattr(scheduler_module, "POLL_S", 0.05)
    monkeypatch.setattr(scheduler_module, "MAX_CONSECUTIVE_FAILURES", 1)  # end the search after that round
    monkeypatch.setenv("STUB_MODE", mode)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    settings = make_settings(tmp_path, gpus=0, reserve_minutes=0, round_min_minutes=1)
    backend.settings = settings
    clock = WallClock()
    study, deadline = open_study(settings, now=clock.now())
    Scheduler(settings, study, deadline, backend, clock, promoter=RecordingPromoter()).run()
    base, trial = [t for t in study.trials if t.state != optuna.trial.TrialState.WAITING]
    assert base.user_attrs["recipe"] == "base" and base.state == optuna.trial.TrialState.COMPLETE
    assert trial.state == told and trial.user_attrs["state"] == "failed"
    assert trial.user_attrs["failure"] == failure and trial.user_attrs["reason"] in (
        "the round ended at step 1", "NaN or inf loss (nan) at step 1")


def test_a_real_round_end_to_end_on_the_tiny_model(tmp_path, tiny_model_dir, monkeypatch):
    """The real trainer and evaluator, as the search runs them: one CPU process, two steps, then both scores."""
    from synthetic.splits import write_split

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # two cores shared with other tests
    splits = {
        name: write_split(tmp_path / name, kind, rows, seed=seed, image_size=(56, 56), count_range=(1, 4))
        for name, kind, rows, seed in (("train", "train", 8, 0), ("ood_val", "other", 3, 1), ("val", "train", 3, 2))
    }
    settings = make_settings(tmp_path, ood_val_path=str(splits["ood_val"]), val_path=str(splits["val"]), val_rows=2)
    config = TrialConfig(
        model_path=str(tiny_model_dir), train_path=str(splits["train"]), output_dir=str(tmp_path / "round"),
        ood_path=str(splits["ood_val"]), eval_every=1, eval_rows=2, steps=2, num_generations=2, prompts_per_step=1,
        generation_steps=1, max_completion_length=8, max_pixels=56 * 56, lora_rank=4, learning_rate=1e-3,
    )  # fmt: skip
    handle = LocalBackend(settings).start(config, [])
    lines: list[dict] = []
    until = time.monotonic() + 600
    while not handle.done():
        assert time.monotonic() < until, "the round did not finish"
        lines += handle.progress()
        time.sleep(0.2)
    lines += handle.progress()
    outcome = handle.outcome()
    assert outcome.state == "completed", (outcome.reason, (tmp_path / "round" / "train.log").read_text()[-3000:])
    assert [line["step"] for line in lines] == [1, 2] and all("ood_accuracy" in line for line in lines)
    assert 0 <= outcome.ood_accuracy <= 100 and 0 <= outcome.val_accuracy <= 100 and outcome.steps_done == 2
    assert set(outcome.timings) == {"setup", "train", "save", "eval"} and min(outcome.timings.values()) > 0
    assert json.loads((tmp_path / "round" / "ood_eval.json").read_text())["n"] == 3
    assert json.loads((tmp_path / "round" / "val_eval.json").read_text())["n"] == 2


def test_eval_static_cache_false_decodes_the_evaluation_with_the_dynamic_cache(tmp_path):
    backend = LocalBackend(make_settings(tmp_path, eval_static_cache=False, eval_batch_size=8))
    argv, names = backend.eval_command(tmp_path / "merged", tmp_path / "round")
    assert names == ["ood", "val"]
    assert "--dynamic-cache" in argv and argv[argv.index("--batch-size") + 1] == "8"


def test_without_val_rows_the_evaluation_scores_ood_alone(tmp_path):
    backend = LocalBackend(make_settings(tmp_path, val_rows=0, ood_rows=300))
    argv, names = backend.eval_command(tmp_path / "merged", tmp_path / "round")
    assert names == ["ood"] and str(tmp_path / "val") not in argv
    assert argv[argv.index("--limit") + 1 :][:2] == ["300", "--seed"]
    assert argv[argv.index("--out") + 1 :] == [str(tmp_path / "round" / "ood_eval.json")]


def test_rounds_side_by_side_share_out_the_cores(tmp_path, monkeypatch):
    from search.backends.local import threads_per_round

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert threads_per_round(make_settings(tmp_path, gpus=1, gpus_per_trial=1, rounds_per_slot=4)) == 4
    assert threads_per_round(make_settings(tmp_path, gpus=2, gpus_per_trial=1, rounds_per_slot=1)) == 8
    assert threads_per_round(make_settings(tmp_path, gpus=2, gpus_per_trial=2, rounds_per_slot=1)) is None  # one
    assert threads_per_round(make_settings(tmp_path, gpus=0, rounds_per_slot=4)) is None  # a CPU: one at a time
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's choice stands
    assert threads_per_round(make_settings(tmp_path, gpus=1, gpus_per_trial=1, rounds_per_slot=4)) is None


def test_wait_returns_when_a_round_s_process_ends_and_sleeps_its_time_otherwise(backend, tmp_path, monkeypatch):
    handle = start(backend, tmp_path, "ok", monkeypatch)
    trainer, began = handle.pid, time.monotonic()
    backend.wait(300.0)  # the scheduler's pause between two polls
    assert time.monotonic() - began < 300.0 and not alive(trainer)  # it returned because the trainer ended
    wait_done(handle)
    began = time.monotonic()
    backend.wait(0.2)  # no round running: a plain pause
    assert time.monotonic() - began >= 0.2
    assert backend._rounds == []  # a done round is no longer watched


def test_wait_for_any_end_without_children_or_pidfds_sleeps(monkeypatch):
    from search.backends import local as local_backend

    began = time.monotonic()
    local_backend.wait_for_any_end([], 0.1)
    assert time.monotonic() - began >= 0.1
    monkeypatch.delattr(local_backend.os, "pidfd_open")  # another kernel or system
    began = time.monotonic()
    local_backend.wait_for_any_end([os.getpid()], 0.1)
    assert time.monotonic() - began >= 0.1


def test_the_orphan_sweep_kills_running_groups_and_passes_over_zombies(tmp_path):
    """A process the container's first process never reaps stays a zombie: nothing to kill, and not reported."""
    from search.backends.local import _record_process, reap_processes

    sleeping = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    ended = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    until = time.monotonic() + 10
    while alive(ended.pid):  # a zombie once it has ended, as it is not waited for yet
        assert time.monotonic() < until
        time.sleep(0.02)
    try:
        for process in (sleeping, ended):
            _record_process(tmp_path, process.pid)
        assert reap_processes(tmp_path) == [sleeping.pid]
        assert sleeping.wait(timeout=10) == -9
    finally:
        sleeping.kill()
        sleeping.wait()
        ended.wait()
