"""The Scheduler's decisions, one at a time, on the simulated backend and a virtual clock: GPU slots, fitting
rounds into the time left, stopping and killing late or hung rounds, promotion, and orphaned trials of dead
workers in a shared study."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from search import scheduler as scheduler_module
from search.backends.clock import VirtualClock
from search.duration import DurationModel
from search.allotment import GRACE_SHARE, SAFETY_SHARE
from search.promotion import RecordingPromoter
from search.lineage import Parent
from search.scheduler import POLL_S, Scheduler
from search import workers as workers_module
from search.settings import MergeSettings, load_settings
from search.backends import simulated
from search.backends.simulated import SimulatedBackend
from search.study import open_study
from trainer.config import ConfigError, TrialConfig

ROOT = Path(__file__).resolve().parents[1]
START = 1_800_000_000.0


NO_MERGE = MergeSettings(enabled=False, top_k=4, etas=(0.5, 0.75, 1.25, 1.5), held_out_share=0.5)


def make_settings(tmp_path: Path, **overrides):
    settings = load_settings(ROOT / "budget.yaml", hours=3, storage=str(tmp_path / "study.db"))
    values = dict(
        runs_dir=str(tmp_path / "runs"), gpus=2, gpus_per_trial=1, reserve_minutes=20, round_min_minutes=20,
        round_max_minutes=60, hang_minutes=15, ood_rows=None, val_rows=500, prune_every=50, prune_rows=128,
        sampler={"type": "tpe", "seed": 0, "n_startup_trials": 6},
        pruner={"type": "median", "n_startup_trials": 4, "n_warmup_steps": 100},
        merge=NO_MERGE,  # the rounds' schedule alone; the merge stage's tests turn it on
    )  # fmt: skip
    return dataclasses.replace(settings, **{**values, **overrides})


def scheduler_for(tmp_path: Path, *, backend_options=None, promote=None, clock_offset=0.0, **overrides):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    settings = make_settings(tmp_path, **overrides)
    clock = VirtualClock(START)
    study, deadline = open_study(settings, now=clock.now())
    clock.sleep(clock_offset)
    backend = SimulatedBackend(settings, clock, 0, **(backend_options or {}))
    return Scheduler(settings, study, deadline, backend, clock, promoter=RecordingPromoter(promote))


def run(scheduler: Scheduler) -> str:
    with contextlib.redirect_stdout(io.StringIO()) as out:
        scheduler.run()
    return out.getvalue()


def ran(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """The training rounds that started (round 0, which scores the base model, is not one)."""
    return [t for t in study.trials if "started_at" in t.user_attrs and t.user_attrs["recipe"] != "base"]


@pytest.mark.parametrize("rounds_per_slot", [1, 3])  # rounds_per_slot is for GPUs: ignored on a CPU
def test_a_cpu_search_runs_one_round_at_a_time(tmp_path, rounds_per_slot):
    scheduler = scheduler_for(tmp_path, gpus=0, rounds_per_slot=rounds_per_slot)
    run(scheduler)
    rounds = sorted(ran(scheduler.study), key=lambda t: t.user_attrs["started_at"])
    assert len(rounds) >= 3 and all(t.user_attrs["gpus"] == [] for t in rounds)
    for a, b in zip(rounds, rounds[1:]):
        assert a.user_attrs["ended_at"] <= b.user_attrs["started_at"]


def test_gpus_are_split_into_disjoint_slots(tmp_path):
    scheduler = scheduler_for(tmp_path, gpus=4, gpus_per_trial=2)
    run(scheduler)
    assert {tuple(t.user_attrs["gpus"]) for t in ran(scheduler.study)} == {(0, 1), (2, 3)}


def test_rounds_per_slot_runs_several_rounds_on_one_gpu_at_once(tmp_path):
    scheduler = scheduler_for(tmp_path, gpus=1, gpus_per_trial=1, rounds_per_slot=3)
    run(scheduler)
    rounds = ran(scheduler.study)
    assert rounds and all(t.user_attrs["gpus"] == [0] for t in rounds)
    # The most rounds running at one moment: three, never more.
    starts = sorted(t.user_attrs["started_at"] for t in rounds)
    at_once = max(sum(t.user_attrs["started_at"] <= s < t.user_attrs["ended_at"] for t in rounds) for s in starts)
    assert at_once == 3


def test_only_the_base_is_scored_when_no_useful_round_fits(tmp_path):
    # 19 minutes before the reserve, with 20-minute rounds at the least: the base model, the fallback submission, is
    # still scored; no round is asked.
    scheduler = scheduler_for(tmp_path, clock_offset=3 * 3600 - 39 * 60)
    output = run(scheduler)
    base, *others = scheduler.study.trials
    assert base.user_attrs["recipe"] == "base" and base.state == TrialState.COMPLETE
    assert others and all(t.state == TrialState.WAITING for t in others)  # the warm starts wait their turn
    assert "no more rounds: no time left for a useful round (19 min before the reserve)" in output


def test_rounds_are_cut_to_fit_their_allotment_and_too_slow_ones_are_not_run(tmp_path):
    # ~8 of the simulated box's minutes go to a round's fixed parts (setup, save, evaluation): a 19-minute cap cuts
    # long rounds, and a quarter of the longest sampled ones does not fit it.
    scheduler = scheduler_for(tmp_path, round_min_minutes=15, round_max_minutes=19)
    output = run(scheduler)
    cut = [t for t in ran(scheduler.study) if t.user_attrs["steps"] < t.params["steps"]]
    assert cut
    too_slow = [t for t in scheduler.study.trials if (t.user_attrs.get("reason") or "").startswith("too slow")]
    assert too_slow and "round_max_minutes" in too_slow[0].user_attrs["reason"]
    for t in too_slow:  # a bad point for TPE, not a failure; the search went on
        assert t.state == TrialState.PRUNED and t.value is None and "started_at" not in t.user_attrs
    assert max(t.number for t in ran(scheduler.study)) > min(t.number for t in too_slow)
    assert "too slow" not in output.splitlines()[-1]
    for t in ran(scheduler.study):
        assert t.user_attrs["allotted_s"] <= 19 * 60
        assert t.user_attrs["predicted_s"] <= t.user_attrs["allotted_s"] * (1 - SAFETY_SHARE)
        assert t.user_attrs["steps"] >= t.params["steps"] / 4  # never below a useful share of the sampled steps


def late_search(tmp_path, *, tail_known: bool):
    """A 7.5-hour search with 16-minute rounds whose prior believes rounds take a third of their time."""
    scheduler = scheduler_for(tmp_path, hours=7.5, round_min_minutes=12, round_max_minutes=16)
    scheduler.duration = DurationModel(eval_rows=1500, prior_scale=2.0 / 3)
    if tail_known:  # setup, save and evaluation measured before (no training part): only training runs late
        config = TrialConfig(model_path="m", train_path="t", output_dir="o")
        evaluation = simulated.TRUE_EVAL_LOAD_S + 1500 * simulated.TRUE_EVAL_ROW_S  # one process: ood and val
        scheduler.duration.observe(
            config, 0, {"setup": simulated.TRUE_SETUP_S, "save": simulated.TRUE_SAVE_S, "eval": evaluation}
        )
    output = run(scheduler)
    rounds = sorted(ran(scheduler.study), key=lambda t: t.user_attrs["started_at"])
    for t in rounds:  # stopped or killed, never later than the allotment plus its grace
        allotted = t.user_attrs["allotted_s"]
        assert t.user_attrs["ended_at"] - t.user_attrs["started_at"] <= allotted * (1 + GRACE_SHARE) + POLL_S
    return rounds, output


def test_a_late_round_is_stopped_early_enough_to_be_scored(tmp_path):
    rounds, _ = late_search(tmp_path, tail_known=True)
    stopped = [t for t in rounds if t.user_attrs["reason"] == "stopped: over its allotment"]
    assert rounds[0] in stopped and rounds[1] in stopped
    for t in stopped:
        assert t.state == TrialState.COMPLETE and t.value is not None
        assert t.user_attrs["steps_done"] < t.user_attrs["steps"]
        assert t.user_attrs["ended_at"] - t.user_attrs["started_at"] <= t.user_attrs["allotted_s"] + POLL_S


def test_a_round_still_late_is_killed_and_the_model_learns_from_it(tmp_path):
    rounds, _ = late_search(tmp_path, tail_known=False)  # its evaluation, believed short, overruns
    killed = [t for t in rounds if (t.user_attrs["reason"] or "").startswith("killed: still evaluating")]
    assert rounds[0] in killed
    for t in killed:
        assert t.state == TrialState.FAIL and "past its allotment of 16 min" in t.user_attrs["reason"]
        assert t.user_attrs["timings"]["eval_at_least"] > 0
    # What the killed rounds' evaluations took so far taught the model: later rounds are scored in time.
    assert max(rounds.index(t) for t in killed) < 4 and len(rounds) > 12


def test_an_invalid_sampled_configuration_fails_its_trial_and_the_search_goes_on(tmp_path, monkeypatch):
    sample = scheduler_module.space.sample_config
    calls = []

    def first_invalid(trial, settings, output_dir):
        calls.append(trial.number)
        if len(calls) == 1:
            raise ConfigError("generation_steps", "must divide the batch")
        return sample(trial, settings, output_dir)

    monkeypatch.setattr(scheduler_module.space, "sample_config", first_invalid)
    scheduler = scheduler_for(tmp_path, gpus=0)
    run(scheduler)
    first = scheduler.study.trials[calls[0]]
    assert first.state == TrialState.FAIL
    assert first.user_attrs["reason"] == "invalid configuration: generation_steps: must divide the batch"
    assert len(ran(scheduler.study)) >= 3


def test_failures_the_configuration_causes_are_bad_points_for_the_sampler(tmp_path, monkeypatch):
    from search.backends import simulated as simulated_backend

    monkeypatch.setattr(simulated_backend, "NAN_LR_FACTOR", 0.0)  # any LoRA rate may diverge
    scheduler = scheduler_for(tmp_path, backend_options={"failure_rate": 0.1, "hang_rate": 0.0})
    run(scheduler)
    rounds = ran(scheduler.study)
    diverged = [t for t in rounds if (t.user_attrs["reason"] or "").startswith("NaN or inf loss")]
    assert diverged and all(t.state == TrialState.PRUNED and t.user_attrs["state"] == "failed" for t in diverged)
    others = [t for t in rounds if (t.user_attrs["reason"] or "").startswith("simulated failure")]
    assert others and all(t.state == TrialState.FAIL for t in others)  # not the configuration's doing: invisible


def test_hung_rounds_are_killed_and_a_broken_search_stops(tmp_path):
    scheduler = scheduler_for(tmp_path, backend_options={"hang_rate": 1.0, "failure_rate": 0.0})
    output = run(scheduler)
    failed = [t for t in scheduler.study.trials if t.state == TrialState.FAIL]
    # The round on the other GPU was already running when the fifth failure closed the search.
    assert scheduler_module.MAX_CONSECUTIVE_FAILURES <= len(failed) <= scheduler_module.MAX_CONSECUTIVE_FAILURES + 1
    assert all(t.user_attrs["reason"] == "hung: no progress for 15 min" for t in failed)
    assert f"{scheduler_module.MAX_CONSECUTIVE_FAILURES} rounds in a row failed" in output.splitlines()[-1]
    assert scheduler.clock.now() < scheduler.deadline - 3600  # it gave up long before the end


def test_a_failed_promotion_keeps_the_previous_best_and_the_search_going(tmp_path):
    calls: list[int] = []

    def promote(outcome, trial):
        calls.append(trial.number)
        if len(calls) == 1:
            raise OSError("No space left on device")
        return len(calls) != 2  # the second is refused (e.g. its format rate is too low)

    scheduler = scheduler_for(tmp_path, promote=promote)
    run(scheduler)
    trials = scheduler.study.trials
    assert trials[calls[0]].user_attrs["promotion_error"] == "OSError: No space left on device"
    assert trials[calls[1]].user_attrs["promoted"] is False
    assert len(calls) >= 3 and trials[calls[2]].user_attrs["promoted"] is True
    # Rounds on two GPUs end in another order than they start: promotions come in the order rounds end.
    in_order = sorted((t for t in trials if t.user_attrs.get("promoted")), key=lambda t: t.user_attrs["ended_at"])
    promoted = [t.value for t in in_order]
    assert promoted == sorted(promoted)


def test_only_trials_of_dead_workers_are_failed_as_orphans(tmp_path, monkeypatch):
    """At once: a worker on this host whose process is gone, or a scheduler of this process that stopped. Later: a
    worker whose heartbeat has not moved for ORPHAN_AFTER_S of this worker's own time. A heartbeat that moves keeps
    its trial alive whatever time it holds: another box's clock, or another --simulate run's virtual one, is never
    compared with ours."""
    elapsed = [0.0]
    monkeypatch.setattr(workers_module, "_liveness_clock", lambda: elapsed[0])
    scheduler = scheduler_for(tmp_path, clock_offset=3 * 3600)  # no time left: it only sweeps
    study, now = scheduler.study, scheduler.clock.now()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    workers = {
        "live elsewhere": ("otherhost:1:aaaaaa", now + 10 * 3600),  # a clock hours ahead
        "stale elsewhere": ("otherhost:2:bbbbbb", now),
        "dead here": (f"{socket.gethostname()}:{int(dead.stdout)}:cccccc", now),
        "stopped in this process": (f"{socket.gethostname()}:{os.getpid()}:dddddd", now),
    }
    numbers = {}
    for name, (worker, heartbeat) in workers.items():
        trial = study.ask()
        trial.set_user_attr("worker", worker)
        trial.set_user_attr("heartbeat", heartbeat)
        numbers[name] = trial.number

    def states() -> dict[str, TrialState]:
        trials = study.trials
        return {name: trials[number].state for name, number in numbers.items()}

    with contextlib.redirect_stdout(io.StringIO()) as out:
        scheduler.workers.sweep({r.trial.number for r in scheduler._running.values()})
    assert states() == {"live elsewhere": TrialState.RUNNING, "stale elsewhere": TrialState.RUNNING,
                        "dead here": TrialState.FAIL, "stopped in this process": TrialState.FAIL}  # fmt: skip
    live = study.trials[numbers["live elsewhere"]]
    study._storage.set_trial_user_attr(live._trial_id, "heartbeat", now + 10 * 3600 + 60)  # it beats, by its clock
    elapsed[0] = workers_module.ORPHAN_AFTER_S
    with contextlib.redirect_stdout(out):
        scheduler.workers.sweep({r.trial.number for r in scheduler._running.values()})
    assert states()["live elsewhere"] == TrialState.RUNNING and states()["stale elsewhere"] == TrialState.FAIL
    for name in ("stale elsewhere", "dead here", "stopped in this process"):
        assert study.trials[numbers[name]].user_attrs["reason"] == "orphaned: the scheduler stopped during this round"
    assert out.getvalue().count("orphaned") == 3


def test_a_round_another_worker_finished_is_ended_and_the_search_goes_on(tmp_path):
    """Another worker fails one of this worker's running trials (it took it for dead): that round is ended and logged,
    the trial keeps the other worker's verdict, and this worker goes on with new rounds."""
    scheduler = scheduler_for(tmp_path)
    taken: list[int] = []

    def other_worker_fails_a_running_trial(trial, outcome):
        running = [r.trial for r in scheduler._running.values() if r.trial.number != trial.number]
        if not taken and running:
            other = optuna.trial.Trial(scheduler.study, running[0]._trial_id)
            other.set_user_attr("reason", "orphaned: the scheduler stopped during this round")
            scheduler.study.tell(running[0].number, state=TrialState.FAIL)
            taken.append(running[0].number)

    scheduler.on_round_end = other_worker_fails_a_running_trial
    output = run(scheduler)
    assert len(taken) == 1, "the hook never found a second running round"
    [line] = [line for line in output.splitlines() if f"round {taken[0]} ended here" in line]
    assert "another worker finished its trial (FAIL: orphaned: the scheduler stopped during this round)" in line
    lost = scheduler.study.trials[taken[0]]
    assert lost.state == TrialState.FAIL and "ended_at" not in lost.user_attrs  # its result was not recorded
    assert max(t.number for t in ran(scheduler.study)) > taken[0] + 2  # the search went on
    assert not [t for t in scheduler.study.trials if t.state == TrialState.RUNNING]
    assert output.splitlines()[-1].startswith("[search") and "search over: no time left" in output.splitlines()[-1]


def test_the_heartbeat_goes_on_while_a_promotion_blocks_the_loop(tmp_path, monkeypatch):
    monkeypatch.setattr(workers_module, "HEARTBEAT_S", 0.05)
    beats: list[tuple[object, object]] = []

    def slow_promotion(outcome, trial):
        stored = lambda: scheduler.study._storage.get_trial(trial._trial_id).user_attrs.get("heartbeat")  # noqa: E731
        first = stored()
        deadline = time.monotonic() + 30  # a guard against a heartbeat that never comes, not a measurement
        while stored() == first and time.monotonic() < deadline:
            time.sleep(0.01)
        beats.append((first, stored()))
        return True

    scheduler = scheduler_for(tmp_path, gpus=0, promote=slow_promotion, hours=1.5)
    run(scheduler)
    assert beats and all(first != later for first, later in beats), beats


def test_the_time_left_on_each_line_is_read_when_the_line_is_printed(tmp_path):
    """A promotion's check takes minutes; the lines after it say what is left then, never more than the line before."""

    def slow_promotion(outcome, trial):
        scheduler.clock.sleep(5 * 60)
        return True

    scheduler = scheduler_for(tmp_path, gpus=0, promote=slow_promotion, hours=1.5)
    lines = [line for line in run(scheduler).splitlines() if line.startswith("[search ")]
    left = [_minutes_left(line) for line in lines]
    assert any("promoted" in line for line in lines)
    assert all(later <= earlier for earlier, later in zip(left, left[1:])), lines


def _minutes_left(line: str) -> int:
    """"[search 1h05 left] ..." -> 65, "[search 12 min left] ..." -> 12."""
    shown = line.split()[1]
    if "h" in shown:
        hours, minutes = shown.split("h")
        return 60 * int(hours) + int(minutes)
    return int(shown)


def test_an_orphans_processes_are_reaped_only_inside_the_studys_rounds_folder(tmp_path):
    """A dead worker's trial records a run_dir outside runs_dir/<study>: its processes.jsonl (which anyone who can
    write the storage can point anywhere) is not read, the process it names lives on, and the trial is still failed."""
    from search.backends.local import LocalBackend

    scheduler = scheduler_for(tmp_path, clock_offset=3 * 3600)
    scheduler.backend = LocalBackend(scheduler.settings)
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        start = Path(f"/proc/{victim.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
        (outside / "processes.jsonl").write_text(json.dumps({"pgid": victim.pid, "start": int(start),
                                                             "host": socket.gethostname()}) + "\n")  # fmt: skip
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        trial = scheduler.study.ask()
        trial.set_user_attr("worker", f"{socket.gethostname()}:{int(dead.stdout)}:eeeeee")
        trial.set_user_attr("run_dir", str(Path(scheduler.settings.rounds_dir) / ".." / ".." / "outside"))
        with contextlib.redirect_stdout(io.StringIO()) as out:
            scheduler.workers.sweep({r.trial.number for r in scheduler._running.values()})
        assert victim.poll() is None  # alive
        assert scheduler.study.trials[trial.number].state == TrialState.FAIL
        assert "could not end its processes: OSError" in out.getvalue() and "is not inside" in out.getvalue()
    finally:
        victim.kill()
        victim.wait()


def test_an_exception_kills_the_running_rounds_and_records_why(tmp_path):
    class Boom(Exception):
        pass

    def boom(trial, outcome):
        raise Boom

    scheduler = scheduler_for(tmp_path)
    scheduler.on_round_end = boom
    with pytest.raises(Boom), contextlib.redirect_stdout(io.StringIO()):
        scheduler.run()
    interrupted = [t for t in scheduler.study.trials if (t.user_attrs.get("reason") or "").startswith("interrupted")]
    assert len(interrupted) == 1 and interrupted[0].state == TrialState.FAIL
    assert not [t for t in scheduler.study.trials if t.state == TrialState.RUNNING]


# ---------------------------------------------------------------------------------------------------------- round 0
class Promotions:
    """A promotion hook that keeps what it was offered, as (trial, ood accuracy, recipe)."""

    def __init__(self):
        self.offered: list[tuple[int, float, str]] = []

    def __call__(self, outcome, trial) -> bool:
        self.offered.append((trial.number, outcome.ood_accuracy, trial.user_attrs["recipe"]))
        return True


def test_the_base_is_promoted_when_every_round_fails(tmp_path):
    promotions = Promotions()
    scheduler = scheduler_for(tmp_path, promote=promotions, backend_options={"failure_rate": 1.0, "hang_rate": 0.0})
    output = run(scheduler)
    base, *rounds = [t for t in scheduler.study.trials if t.state != TrialState.WAITING]
    assert base.user_attrs["recipe"] == "base" and base.state == TrialState.COMPLETE
    assert promotions.offered == [(0, base.value, "base")] and base.user_attrs["promoted"] is True
    assert len(rounds) >= scheduler_module.MAX_CONSECUTIVE_FAILURES and all(t.state == TrialState.FAIL for t in rounds)
    assert f"best ood {base.value:.1f}% (round 0)" in output.splitlines()[-1]


def test_no_round_is_promoted_below_the_base(tmp_path, monkeypatch):
    # Every trained model answers worse than the base (e.g. a reward that breaks the format).
    monkeypatch.setattr(simulated, "true_accuracy", lambda config, step, start, steps_before: start - 12.0)
    promotions = Promotions()
    scheduler = scheduler_for(tmp_path, promote=promotions)
    run(scheduler)
    scored = [t for t in ran(scheduler.study) if t.state == TrialState.COMPLETE]
    base = scheduler.study.trials[0]
    assert len(scored) >= 4 and all(t.value < base.value for t in scored)
    assert promotions.offered == [(0, base.value, "base")]
    # init: best finds no round better than the base, so every round started from the base.
    assert {t.user_attrs["config"]["model_path"] for t in ran(scheduler.study)} == {scheduler.settings.model_path}
    assert {t.user_attrs["parent"] for t in ran(scheduler.study)} == {0}


def test_a_base_that_fails_to_score_is_queued_once_more(tmp_path, monkeypatch):
    calls = []
    score = SimulatedBackend.score

    def failing_once(self, model_dir, run_dir, gpus):
        calls.append(run_dir)
        if len(calls) == 1:
            raise OSError("the evaluator cannot be started")
        return score(self, model_dir, run_dir, gpus)

    monkeypatch.setattr(SimulatedBackend, "score", failing_once)
    promotions = Promotions()
    scheduler = scheduler_for(tmp_path, gpus=1, promote=promotions)
    output = run(scheduler)
    bases = [t for t in scheduler.study.trials if t.user_attrs.get("recipe") == "base"]
    assert [t.state for t in bases] == [TrialState.FAIL, TrialState.COMPLETE] and len(calls) == 2
    assert bases[0].user_attrs["reason"] == "could not start scoring the base model: the evaluator cannot be started"
    assert promotions.offered[0] == (bases[1].number, bases[1].value, "base")
    assert "gave the base model no score: it is scored once more, next" in output


def test_a_resumed_study_without_a_scored_base_scores_it(tmp_path):
    scheduler = scheduler_for(tmp_path, gpus=1)
    study = scheduler.study
    killed = study.ask()  # round 0 of an earlier run, killed while it was being scored
    assert killed.user_attrs["recipe"] == "base"
    study.tell(killed, state=TrialState.FAIL)
    run(scheduler)
    bases = [t for t in study.trials if t.user_attrs.get("recipe") == "base"]
    assert [t.state for t in bases] == [TrialState.FAIL, TrialState.COMPLETE]
    assert bases[1].user_attrs["started_at"] == min(t.user_attrs["started_at"] for t in study.trials
                                                    if "started_at" in t.user_attrs)  # fmt: skip


def test_a_child_starts_from_the_best_promotable_round_with_weights(tmp_path):
    scheduler = scheduler_for(tmp_path)
    study = scheduler.study
    base = study.ask()
    base.set_user_attr("total_steps", 0)
    study.tell(base, 50.0)
    runs = {}
    for value, fmt, name in ((70.0, 95.0, "good"), (80.0, 60.0, "unformatted"), (75.0, 95.0, "deleted")):
        trial = study.ask()
        runs[name] = trial.number
        for key, attr in {"recipe": "sampled", "format_rate": fmt, "merged_dir": f"/runs/{name}/merged",
                          "total_steps": 100}.items():  # fmt: skip
            trial.set_user_attr(key, attr)
        study.tell(trial, value)
    running = study.ask()  # a better round still being scored: not a parent
    running.set_user_attr("merged_dir", "/runs/running/merged")
    scheduler.backend.remember("/runs/good/merged", 70.0, 100, True)
    scheduler.backend.remember("/runs/unformatted/merged", 80.0, 100, False)  # "deleted" is not remembered
    parent = scheduler.parent_of("best")
    assert (parent.trial, parent.model_path, parent.total_steps) == (runs["good"], "/runs/good/merged", 100)
    assert scheduler.parent_of("base") == Parent(0, scheduler.settings.model_path, 0)
