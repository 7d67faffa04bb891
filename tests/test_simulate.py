"""A whole 7.5-hour search against the simulated backend on a virtual clock: it runs in seconds, keeps the deadline
and the reserve, records every round with its reason, runs rounds side by side on disjoint GPUs, promotes the best,
learns how long rounds take, and survives being killed and restarted on the same storage."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import random
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from search.backends.clock import VirtualClock
from search.duration import DurationModel
from search.promotion import RecordingPromoter
from search import scheduler as scheduler_module
from search.scheduler import POLL_S, Scheduler
from search.settings import MergeSettings, load_settings
from search.backends import simulated
from search.backends.simulated import SimulatedBackend, true_duration
from search.study import open_study
from trainer.config import TrialConfig

ROOT = Path(__file__).resolve().parents[1]
START = 1_800_000_000.0  # a virtual origin far from zero, like unix time


NO_MERGE = MergeSettings(enabled=False, top_k=4, etas=(0.5, 0.75, 1.25, 1.5), held_out_share=0.5)


def make_settings(tmp_path: Path, **overrides):
    settings = load_settings(ROOT / "budget.yaml", hours=7.5, storage=str(tmp_path / "study.db"))
    values = dict(
        runs_dir=str(tmp_path / "runs"), gpus=2, gpus_per_trial=1, reserve_minutes=20, round_min_minutes=20,
        round_max_minutes=60, hang_minutes=15, ood_rows=None, val_rows=500, prune_every=50, prune_rows=128,
        sampler={"type": "tpe", "seed": 0, "n_startup_trials": 6, "multivariate": True, "constant_liar": True},
        pruner={"type": "median", "n_startup_trials": 4, "n_warmup_steps": 100, "interval_steps": 1},
        merge=NO_MERGE,  # the rounds' schedule alone; the merge stage's tests turn it on
    )  # fmt: skip
    return dataclasses.replace(settings, **{**values, **overrides})


class Recorder:
    """The promotion hook of a simulated search: remembers, promotes nothing."""

    def __init__(self):
        self.promoted: list[tuple[int, float]] = []

    def __call__(self, outcome, trial) -> bool:
        self.promoted.append((trial.number, outcome.ood_accuracy))
        return True


@dataclasses.dataclass
class Search:
    settings: object
    study: optuna.Study
    deadline: float
    scheduler: Scheduler
    clock: VirtualClock
    recorder: Recorder
    wall_s: float
    output: str

    @property
    def finished(self) -> list[optuna.trial.FrozenTrial]:
        return [t for t in self.study.trials if t.state.is_finished()]


def run_search(tmp_path: Path, *, seed: int = 0, clock: VirtualClock | None = None, **overrides) -> Search:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    settings = make_settings(tmp_path, **overrides)
    clock = clock or VirtualClock(START)
    study, deadline = open_study(settings, now=clock.now())
    recorder = Recorder()
    scheduler = Scheduler(settings, study, deadline, SimulatedBackend(settings, clock, seed), clock, promoter=RecordingPromoter(recorder))
    out = io.StringIO()
    started = time.monotonic()
    with contextlib.redirect_stdout(out):
        scheduler.run()
    return Search(settings, study, deadline, scheduler, clock, recorder, time.monotonic() - started, out.getvalue())


@pytest.fixture(scope="module")
def search(tmp_path_factory) -> Search:
    return run_search(tmp_path_factory.mktemp("simulate"))


def test_a_75_hour_search_runs_in_seconds(search):
    assert search.wall_s < 30
    assert len(search.finished) >= 15  # two slots of ~30-60 min rounds over 7 hours


def test_no_round_ends_after_the_deadline_and_the_reserve_is_kept(search):
    end_of_rounds = search.deadline - 60 * search.settings.reserve_minutes
    assert search.clock.now() <= end_of_rounds + POLL_S  # the scheduler returned with the reserve intact
    ran = [t for t in search.finished if "ended_at" in t.user_attrs]
    assert all(t.user_attrs["ended_at"] <= end_of_rounds + POLL_S for t in ran)
    # ... and it did not give up early: the last round ended less than a minimal round before the reserve.
    assert max(t.user_attrs["ended_at"] for t in ran) > end_of_rounds - 60 * search.settings.round_min_minutes
    for t in ran:  # stopped or killed in time: never past the allotment's grace
        assert t.user_attrs["ended_at"] - t.user_attrs["started_at"] <= t.user_attrs["allotted_s"] * 1.1 + POLL_S


def test_every_round_is_recorded_with_its_state_and_reason(search):
    trials = search.study.trials
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    for t in search.finished:
        attrs = t.user_attrs
        assert attrs["state"] in ("completed", "stopped", "pruned", "failed")
        base = attrs["recipe"] == "base"
        if t.state == TrialState.COMPLETE:
            assert attrs["state"] in ("completed", "stopped") and t.value is not None
            assert attrs["val_accuracy"] is not None and attrs["format_rate"] is not None
            assert attrs["timings"].keys() == ({"eval"} if base else {"setup", "train", "save", "eval"})
        else:
            assert attrs["reason"], t.number
        if "started_at" in attrs:
            assert {"steps", "predicted_s", "allotted_s", "run_dir", "duration_s", "steps_done", "total_steps"} <= set(
                attrs
            )
            if base:
                assert attrs["steps"] == attrs["steps_done"] == attrs["total_steps"] == 0 and "config" not in attrs
            else:
                assert attrs["steps"] == attrs["config"]["steps"] <= t.params["steps"]
    pruned = [t for t in trials if t.state == TrialState.PRUNED]
    failed = [t for t in trials if t.state == TrialState.FAIL]
    assert pruned and failed
    by_pruner = [t for t in pruned if t.user_attrs["state"] == "pruned"]
    assert by_pruner and all(t.user_attrs["reason"].startswith("pruned by MedianPruner at step ") for t in by_pruner)
    assert all(t.value == t.intermediate_values[max(t.intermediate_values)] for t in by_pruner)
    # The configuration's own failures are told PRUNED too (a bad point for TPE), their state still says failed.
    assert all(t.user_attrs["reason"].startswith(("NaN", "out of memory")) for t in pruned if t not in by_pruner)
    assert {t.user_attrs["recipe"] for t in search.finished} >= {"strong", "baseline", "sampled"}


def test_rounds_run_side_by_side_on_disjoint_gpus(search):
    ran = [t for t in search.finished if "started_at" in t.user_attrs]
    assert {tuple(t.user_attrs["gpus"]) for t in ran} == {(0,), (1,)}
    overlapping = 0
    for a, b in itertools.combinations(ran, 2):
        a_attrs, b_attrs = a.user_attrs, b.user_attrs
        if a_attrs["started_at"] < b_attrs["ended_at"] and b_attrs["started_at"] < a_attrs["ended_at"]:
            overlapping += 1
            assert not set(a.user_attrs["gpus"]) & set(b.user_attrs["gpus"])
    assert overlapping >= len(ran) // 2


def test_the_best_round_is_promoted_and_beats_the_baseline(search):
    values = [value for _, value in search.recorder.promoted]
    assert values == sorted(values) and len(set(values)) == len(values)  # only improvements are promoted
    best = max(t.value for t in search.finished if t.state == TrialState.COMPLETE)
    assert values[-1] == best
    assert all(t.user_attrs.get("promoted") for t in search.finished if (t.number, t.value) in search.recorder.promoted)
    [baseline] = [t for t in search.finished if t.user_attrs.get("recipe") == "baseline"]
    assert best > baseline.value + 10
    assert f"best ood {best:.1f}%" in search.output.splitlines()[-1]


def test_the_base_model_is_round_0_and_the_first_promotion(search):
    base = search.study.trials[0]
    assert base.user_attrs["recipe"] == "base" and base.state == TrialState.COMPLETE and base.params == {}
    assert abs(base.value - simulated.BASE_OOD) < 3  # the base's own score, not a trained model's
    assert search.recorder.promoted[0] == (0, base.value)
    assert base.user_attrs["started_at"] == START  # scored while the first round trains on the other GPU
    first_round = search.study.trials[1]
    assert first_round.user_attrs["started_at"] == START and first_round.user_attrs["ended_at"] > base.user_attrs["ended_at"]


def test_rounds_continue_from_the_best_round_and_record_their_chain(search):
    by_number = {t.number: t for t in search.study.trials}
    started = [t for t in search.finished if "config" in t.user_attrs]
    children = [t for t in started if t.user_attrs["parent"] not in (None, 0)]
    assert children, "no round continued another"
    assert {t.params["init"] for t in started if t.user_attrs["recipe"] == "sampled"} == {"base", "best"}
    for t in started:
        attrs = t.user_attrs
        parent = by_number[attrs["parent"]]
        if attrs["parent"] == 0:  # from the base: its weights are the base model's
            assert attrs["config"]["model_path"] == search.settings.model_path
        else:  # from a round: its merged weights, and the steps add up from the base
            assert attrs["init"] == "best"
            assert attrs["config"]["model_path"] == parent.user_attrs["merged_dir"]
            assert parent.state == TrialState.COMPLETE and parent.user_attrs["started_at"] < attrs["started_at"]
            assert parent.user_attrs["ended_at"] <= attrs["started_at"]  # it never started from a round being scored
        assert attrs["total_steps"] == parent.user_attrs["total_steps"] + attrs["steps_done"]
    # A child of `best` starts from the best promotable round finished before it started.
    for t in children:
        before = [p for p in search.finished if p.state == TrialState.COMPLETE
                  and p.user_attrs["ended_at"] <= t.user_attrs["started_at"]
                  and p.user_attrs["format_rate"] >= search.settings.min_format_rate]  # fmt: skip
        assert by_number[t.user_attrs["parent"]].value == max(p.value for p in before)


def test_the_duration_model_learns(search):
    # Rounds that ran as planned: their predictions get closer as the model refits.
    ran = [t for t in search.finished if t.user_attrs.get("state") == "completed"]
    ran.sort(key=lambda t: t.user_attrs["started_at"])
    errors = [abs(t.user_attrs["predicted_s"] - t.user_attrs["duration_s"]) / t.user_attrs["duration_s"] for t in ran]
    assert sum(errors[-3:]) / 3 < sum(errors[:3]) / 3
    assert max(errors[-3:]) < 0.08
    # And against the simulated box's hidden cost, on configurations it never ran.
    rng = random.Random(0)
    settings = search.settings
    configs = [
        TrialConfig(
            model_path="m", train_path="t", output_dir="o", ood_path="ood", eval_every=50, eval_rows=128,
            steps=rng.randrange(50, 301, 10), lora_rank=rng.choice([0, 16, 64]), num_generations=rng.choice([4, 8, 16]),
            prompts_per_step=2, generation_steps=4,
        )  # fmt: skip
        for _ in range(20)
    ]
    prior = DurationModel(eval_rows=1000 + settings.val_rows)

    def error(model):
        return sum(abs(model.predict(c) / true_duration(c, settings) - 1) for c in configs) / len(configs)

    assert error(search.scheduler.duration) < 0.1 < error(prior)


def test_the_display_is_not_spammy(search):
    lines = search.output.splitlines()
    hours = search.settings.hours
    assert len(lines) < hours * 60 + 6 * len(search.finished)  # about a line a minute, plus the events
    assert any("step" in line and "reward" in line for line in lines)


class Crash(Exception):
    pass


def test_a_killed_search_resumes_on_the_same_storage(tmp_path, monkeypatch):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    settings = make_settings(tmp_path)
    clock = VirtualClock(START)
    study, deadline = open_study(settings, now=clock.now())
    ended: list[int] = []

    def crash_after_four(trial, outcome):
        ended.append(trial.number)
        if len(ended) == 4:
            raise Crash

    backend = SimulatedBackend(settings, clock, 0)
    first = Scheduler(settings, study, deadline, backend, clock, on_round_end=crash_after_four,
                      promoter=RecordingPromoter(Recorder()))
    # A hard kill (SIGKILL, power loss) runs no cleanup: the running round stays RUNNING in the storage.
    monkeypatch.setattr(scheduler_module, "abandon", lambda *args: None)
    with pytest.raises(Crash), contextlib.redirect_stdout(io.StringIO()):
        first.run()
    before = {t.number: (t.state, t.value) for t in study.trials if t.state.is_finished()}
    [orphan] = [t.number for t in study.trials if t.state == TrialState.RUNNING]
    best_before = max(t.value for t in study.trials if t.user_attrs.get("promoted"))
    crashed_at = clock.now()

    monkeypatch.undo()
    restart = VirtualClock(crashed_at + 120)  # back two minutes later
    study2, deadline2 = open_study(settings, now=restart.now())
    assert deadline2 == deadline
    recorder = Recorder()
    second = Scheduler(settings, study2, deadline2, SimulatedBackend(settings, restart, 1), restart,
                       promoter=RecordingPromoter(recorder))
    with contextlib.redirect_stdout(io.StringIO()) as out:
        second.run()

    trials = study2.trials
    assert {n: (trials[n].state, trials[n].value) for n in before} == before  # nothing finished was lost
    assert trials[orphan].state == TrialState.FAIL
    assert trials[orphan].user_attrs["reason"] == "orphaned: the scheduler stopped during this round"
    assert "orphaned" in out.getvalue()
    assert not [t for t in trials if t.state == TrialState.RUNNING]
    assert len(trials) > len(before) + 4  # and the search went on
    assert restart.now() <= deadline - 60 * settings.reserve_minutes + POLL_S
    assert all(value > best_before for _, value in recorder.promoted)  # the earlier best still counts
    assert second.duration.n_observed >= len([s for s, _ in before.values() if s != TrialState.FAIL])


def test_two_simulated_workers_share_one_journal_study(tmp_path):
    """Two `run_search.py --simulate` processes on one study, each on its own virtual clock: both exit 0, no trial
    number twice, nothing left RUNNING, each warm start run once, no live trial taken for an orphan.
    bench/simulate_workers.py runs this ten times (bench/results/)."""
    from bench.simulate_workers import run_once

    result = run_once(tmp_path, hours=3)
    assert result["ok"], result
    assert result["orphaned"] == 0 and result["rounds_ended_by_another_worker"] == 0
    assert len(result["rounds_per_worker"]) == 2  # both ran rounds
