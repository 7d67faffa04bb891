"""The merge stage inside a search: planned like a round, its candidates trials, its choice guarded, pruning kept."""

from __future__ import annotations

import dataclasses

import optuna
import pytest
from optuna.trial import TrialState

from search.merge import stage as merge_stage
from search.merge.stage import Decision
from search.promotion.submission import prune_run_dirs
from search.settings import MergeSettings
from test_scheduler import run, scheduler_for


def stage_seconds(scheduler) -> float:
    return scheduler.stage.seconds(scheduler.duration, len(scheduler.settings.slots))

MERGE = MergeSettings(enabled=True, top_k=3, etas=(0.5, 1.25), held_out_share=0.5)


def merges(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return [t for t in study.trials if t.user_attrs.get("recipe") == "merge"]


def test_a_search_ends_with_the_merge_stage_before_the_reserve(tmp_path):
    promoted = []
    scheduler = scheduler_for(tmp_path, merge=MERGE, promote=lambda outcome, trial: promoted.append(trial.number) or True)
    output = run(scheduler)
    candidates = merges(scheduler.study)
    assert candidates and all(t.state == TrialState.COMPLETE for t in candidates)
    rounds = [t for t in scheduler.study.trials if t.user_attrs.get("recipe") not in ("base", "merge")]
    ingredients = {n for t in candidates for n in t.user_attrs["ingredients"]}
    assert ingredients <= {t.number for t in rounds if t.state == TrialState.COMPLETE}
    for t in candidates:
        assert t.user_attrs["parent"] == t.user_attrs["ingredients"] and t.user_attrs["eta"] in (0.5, 1.0, 1.25)
        assert 0 <= t.user_attrs["selection_accuracy"] <= 100 and len(t.user_attrs["held_out_lead"]) == 4
    # Every round ended before the first candidate started, and the stage before the reserve.
    first = min(t.user_attrs["started_at"] for t in candidates)
    assert all(t.user_attrs["ended_at"] <= first for t in rounds if "ended_at" in t.user_attrs)
    assert max(t.user_attrs["ended_at"] for t in candidates) <= scheduler.end_of_stage
    chosen = [t for t in candidates if t.user_attrs["merge_chosen"]]
    assert len(chosen) == 1 and chosen[0].user_attrs["merge_decision"].startswith(("promoted: ", "kept out: "))
    handed_in = chosen[0].user_attrs["merge_decision"].startswith("promoted: ")
    assert (chosen[0].number in promoted) == handed_in
    assert not any(t.number in promoted for t in candidates if t is not chosen[0])
    assert "merge stage chose round" in output


def test_an_eta_wave_follows_the_soups(tmp_path):
    scheduler = scheduler_for(tmp_path, merge=MERGE)
    run(scheduler)
    candidates = sorted(merges(scheduler.study), key=lambda t: t.user_attrs["started_at"])
    kinds = [t.user_attrs["merge_kind"] for t in candidates]
    assert kinds[:2] == ["greedy", "uniform"] and kinds[-2:] == ["eta", "eta"]
    soups_end = max(t.user_attrs["ended_at"] for t in candidates if t.user_attrs["merge_kind"] != "eta")
    assert all(t.user_attrs["started_at"] >= soups_end for t in candidates if t.user_attrs["merge_kind"] == "eta")


def force_decision(monkeypatch, promote: bool) -> None:
    """The stage's own choice, with the guard's verdict replaced."""
    decide = merge_stage.MergeStage.decide

    def forced(self):
        decision = decide(self)
        return Decision(decision.chosen, promote, "forced by the test")

    monkeypatch.setattr(merge_stage.MergeStage, "decide", forced)


def test_a_merge_the_guard_keeps_out_is_never_promoted(tmp_path, monkeypatch):
    force_decision(monkeypatch, promote=False)
    promoted = []
    scheduler = scheduler_for(tmp_path, merge=MERGE, promote=lambda outcome, trial: promoted.append(trial) or True)
    run(scheduler)
    assert merges(scheduler.study)
    assert all(t.user_attrs.get("recipe") != "merge" for t in promoted)
    assert all("promoted" not in t.user_attrs for t in merges(scheduler.study))


def test_a_merge_that_fails_its_promotion_check_leaves_the_submission_as_it_was(tmp_path, monkeypatch):
    force_decision(monkeypatch, promote=True)
    submission = []

    def promote(outcome, trial):
        if trial.user_attrs.get("recipe") == "merge":
            raise RuntimeError("the promoted copy answered 3 of 50 checked rows differently")
        submission.append(trial.number)
        return True

    scheduler = scheduler_for(tmp_path, merge=MERGE, promote=promote)
    output = run(scheduler)
    (chosen,) = [t for t in merges(scheduler.study) if t.user_attrs["merge_chosen"]]
    assert chosen.value > scheduler.study.trials[submission[-1]].value  # so the scheduler tried to promote it
    assert "answered 3 of 50" in chosen.user_attrs["promotion_error"]
    assert scheduler._best[1] == submission[-1] and "promoted" not in chosen.user_attrs
    assert f"round {chosen.number} not promoted" in output


def test_a_later_round_never_starts_from_a_merge_that_was_kept_out(tmp_path, monkeypatch):
    force_decision(monkeypatch, promote=False)
    scheduler = scheduler_for(tmp_path, merge=MERGE)
    run(scheduler)
    best_merge = max(merges(scheduler.study), key=lambda t: t.value)
    scheduler.backend.has_weights = lambda merged_dir: True
    assert scheduler.parent_of("best").trial != best_merge.number


def test_the_stage_s_time_is_taken_from_the_rounds_and_none_without_a_stage(tmp_path):
    with_stage = scheduler_for(tmp_path / "a", merge=MERGE)
    without = scheduler_for(tmp_path / "b", merge=dataclasses.replace(MERGE, enabled=False))
    assert without.end_of_rounds == without.end_of_stage
    assert with_stage.end_of_rounds == pytest.approx(with_stage.end_of_stage - stage_seconds(with_stage))
    # Two slots: a greedy chain of two (top_k 3), then two etas side by side, each a build of 4 models and a scoring.
    assert stage_seconds(with_stage) == pytest.approx(3 * with_stage.duration.merge_seconds(4))


def test_an_interrupted_stage_leaves_no_running_trial(tmp_path, monkeypatch):
    scheduler = scheduler_for(tmp_path, merge=MERGE)
    decide = scheduler.stage.decide

    def interrupt():
        if scheduler.stage.pending:
            raise KeyboardInterrupt
        return decide()

    monkeypatch.setattr(scheduler.stage, "decide", interrupt)
    with pytest.raises(KeyboardInterrupt):
        run(scheduler)
    assert merges(scheduler.study)
    assert not [t for t in scheduler.study.trials if t.state == TrialState.RUNNING]


# ---------------------------------------------------------------------------------------------------------- pruning
def finished(study: optuna.Study, tmp_path, value: float, recipe: str = "sampled", **attrs) -> int:
    number = len(study.trials)
    run_dir = tmp_path / "runs" / f"round-{number:04d}"
    (run_dir / "merged").mkdir(parents=True)
    (run_dir / "merged" / "model.safetensors").write_text("w")
    study.add_trial(optuna.trial.create_trial(value=value, user_attrs={"recipe": recipe, "run_dir": str(run_dir),
                                                                        **attrs}))  # fmt: skip
    return number


def kept(tmp_path, number: int) -> bool:
    return (tmp_path / "runs" / f"round-{number:04d}" / "merged").exists()


def test_pruning_keeps_the_top_k_rounds_the_stage_needs_and_no_beaten_merge(tmp_path):
    study = optuna.create_study(direction="maximize")
    rounds = [finished(study, tmp_path, value) for value in (60.0, 70.0, 65.0, 50.0)]
    soup = finished(study, tmp_path, 72.0, "merge", parent=[1, 2])
    prune_run_dirs(study, keep_rounds=0, rounds_dir=tmp_path / "runs", merge_top_k=3)
    assert [kept(tmp_path, n) for n in rounds] == [True, True, True, False]
    assert not kept(tmp_path, soup)  # a merge's weights stay only while the submission holds it


def test_pruning_keeps_the_ingredients_of_a_running_merge_and_the_submission_s_merge(tmp_path):
    study = optuna.create_study(direction="maximize")
    rounds = [finished(study, tmp_path, value) for value in (60.0, 70.0, 65.0)]
    soup = finished(study, tmp_path, 72.0, "merge", parent=[1, 2])
    running = study.ask()
    running.set_user_attr("parent", [0, 2])
    prune_run_dirs(study, keep_rounds=0, rounds_dir=tmp_path / "runs", keep={soup})
    assert [kept(tmp_path, n) for n in rounds] == [True, True, True] and kept(tmp_path, soup)


def test_a_later_round_may_start_from_a_merge_that_was_handed_in(tmp_path, monkeypatch):
    force_decision(monkeypatch, promote=True)
    scheduler = scheduler_for(tmp_path, merge=MERGE)
    run(scheduler)
    (chosen,) = [t for t in merges(scheduler.study) if t.user_attrs["merge_chosen"]]
    best_round = max(t.value for t in scheduler.study.trials if t.user_attrs.get("recipe") not in ("base", "merge")
                     and t.value is not None)  # fmt: skip
    assert chosen.value > best_round and chosen.user_attrs["promoted"] is True  # this seed's stage beats its rounds
    parent = scheduler.parent_of("best")
    assert parent.trial == chosen.number and parent.model_path == chosen.user_attrs["merged_dir"]
    assert parent.total_steps == chosen.user_attrs["total_steps"]
