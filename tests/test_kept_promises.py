"""The promises a realistic one-line bug would break without any other test noticing: each test here pins one of them
where it is kept (the scheduler's own call, the hook that prunes, the interval's formula, a bound's edge)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.trial import TrialState, create_trial

from search import selection
from search.promotion import SubmissionPromoter
from search.promotion import submission as promotion
from search.backends.base import RoundOutcome
from search.report.hooks import RoundEnd
from search.scheduler import POLL_S
from search.settings import BUDGET, SettingsError, load_settings
from common import validation
from trainer.run_folder import MERGED_DIR, RoundState

from test_scheduler import make_settings, ran, run, scheduler_for


# ---------------------------------------------------------------------------------------------------------- intervals
def test_the_lead_interval_is_paired_and_95_percent():
    """b is right on 50 of 100 rows, a on those and 10 more: the rows agree on 90, so the paired interval is narrow
    (an unpaired one, from each side's own variance, would hold 0); its half-width is 1.96 standard errors."""
    a = [True] * 60 + [False] * 40
    b = [True] * 50 + [False] * 50
    lead = selection.paired_lead(a, b)
    diffs = [0.0] * 50 + [1.0] * 10 + [0.0] * 40
    variance = sum((d - 0.1) ** 2 for d in diffs) / 99
    half = 1.96 * math.sqrt(variance / 100)
    assert lead.points == pytest.approx(10.0)
    assert lead.low == pytest.approx(100 * (0.1 - half), abs=0.01)
    assert lead.high == pytest.approx(100 * (0.1 + half), abs=0.01)
    assert lead.low == pytest.approx(4.09, abs=0.01) and lead.beyond_noise


def test_a_lead_on_swapped_rows_is_within_the_noise():
    """The same accuracies on disjoint rows: paired, every row differs, so the interval is wide and holds 0."""
    a = [True] * 55 + [False] * 45
    b = [False] * 45 + [True] * 55
    lead = selection.paired_lead(a, b)
    assert lead.points == 0.0 and lead.low < 0 < lead.high
    assert lead.high == pytest.approx(100 * 1.96 * math.sqrt(0.9 * 100 / 99 / 100), abs=0.01)


def _stored(rows: list[bool], digest: str = "rows") -> dict:
    return {selection.OOD_ROWS: {"n": len(rows), "digest": digest, "correct": selection.pack(rows)}}


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 63, 64, 65, 1001])
def test_the_leaderboards_lead_from_stored_rows_is_the_paired_lead_of_the_rows(n):
    """The leaderboard counts leads on the packed bits; they equal the paired lead of the rows read back, at every
    padding of the last hex digit, and either way round."""
    a = [(i * 7) % 3 != 1 for i in range(n)]
    b = [(i * 5) % 4 == 0 for i in range(n)]
    for mine, theirs in ((a, b), (b, a), (a, a)):
        fast, slow = selection.lead_between(_stored(mine), _stored(theirs)), selection.paired_lead(mine, theirs)
        assert (fast.points, fast.n) == (slow.points, slow.n)
        assert fast.low == pytest.approx(slow.low, abs=1e-9) and fast.high == pytest.approx(slow.high, abs=1e-9)


def test_a_stored_lead_needs_the_same_rows_and_rows_pack_wrote():
    """No lead between rounds of other rows (digest or count), of no rows, or from a value `pack` did not write (a
    foreign program's): those rows show no interval, and a padding bit set by such a program is not counted."""
    a, b = [True, False, True], [False, False, True]
    assert selection.lead_between(_stored(a), _stored(b)).points == pytest.approx(100 / 3)
    assert selection.lead_between(_stored(a, "x"), _stored(b, "y")) is None
    assert selection.lead_between(_stored(a), _stored(b + [True])) is None
    assert selection.lead_between(_stored([]), _stored([])) is None
    assert selection.lead_between(_stored([False] * 3), _stored(b)).points == pytest.approx(-100 / 3)  # all wrong
    assert selection.lead_between({}, _stored(b)) is None
    for odd in ("0xa", "zz", "a0", 5, None):
        foreign = {selection.OOD_ROWS: {"n": 3, "digest": "rows", "correct": odd}}
        assert selection.lead_between(foreign, _stored(b)) is None and selection.read_rows_attr(foreign) is None
    padded = {selection.OOD_ROWS: {"n": 3, "digest": "rows", "correct": "b"}}  # rows 101 and a set padding bit
    assert selection.lead_between(padded, _stored(b)) == selection.lead_between(_stored(a), _stored(b))
    assert selection.read_rows_attr(padded) == ("rows", a)
    every_digit = "0123456789abcdefABCDEF"  # another program's upper-case hex reads as the same bits
    foreign = {selection.OOD_ROWS: {"n": 88, "digest": "rows", "correct": every_digit}}
    assert selection.read_rows_attr(foreign)[1] == selection.unpack(every_digit.lower(), 88)


# ---------------------------------------------------------------------------------------------------------- the floor
def _model(folder: Path, tag: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2_vl", "tag": tag}))
    (folder / "model.safetensors").write_text(tag)
    return folder


@pytest.mark.parametrize("recipe, format_rate, promoted", [("sampled", 80.0, False), ("sampled", 95.0, True),
                                                           ("base", 70.0, True)])  # fmt: skip
def test_the_schedulers_promotion_holds_a_round_to_the_format_floor(tmp_path, monkeypatch, recipe, format_rate,
                                                                    promoted):
    """A round more accurate than the submission but below min_format_rate stays out; the base does not need it."""
    scheduler = scheduler_for(tmp_path, submission_path=str(tmp_path / "submission"), min_format_rate=90.0)
    promotion.promote(_model(tmp_path / "held", "held"), tmp_path / "submission", min_format_rate=0.0,
                      format_rate=99.0, accuracy=10.0, trial=0, check=lambda path: None)  # fmt: skip
    monkeypatch.setattr(promotion, "check_submission", lambda *a, **k: {"seconds": {}})  # no model to load here
    trial = scheduler.study.ask()
    trial.set_user_attr("recipe", recipe)
    merged = _model(Path(scheduler.settings.rounds_dir) / "round-0009" / MERGED_DIR, "new")
    outcome = RoundOutcome(RoundState.COMPLETED, None, 60.0, 50.0, format_rate, 20.0, 10, merged_dir=str(merged))
    assert SubmissionPromoter(scheduler.settings).promote(outcome, trial) is promoted
    assert promotion.promoted(tmp_path / "submission")["trial"] == (trial.number if promoted else 0)


# ---------------------------------------------------------------------------------------------------------- bounds
def test_an_integer_exactly_at_its_bound_is_accepted_and_one_past_it_refused():
    assert validation.integer("k", 10, low=0, high=10) == 10 and validation.integer("k", 0, low=0, high=10) == 0
    for past in (11, -1):
        with pytest.raises(validation.InvalidValue, match="must be"):
            validation.integer("k", past, low=0, high=10)


@pytest.mark.parametrize("path, top", [("rounds_per_slot", 64), ("eval_batch_size", 65536), ("seed", 2**32 - 1),
                                       ("merge.top_k", 16), ("sampler.seed", 2**32 - 1), ("hours", 168)])  # fmt: skip
def test_a_budget_value_at_its_upper_bound_is_accepted(tmp_path, path, top):
    data = yaml.safe_load(BUDGET.read_text())
    *parents, last = path.split(".")
    node = data
    for key in parents:
        node = node[key]
    node[last] = top
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(data))
    settings = load_settings(tmp_path / "b.yaml")
    value = settings
    for key in path.split("."):
        value = value[key] if isinstance(value, dict) else getattr(value, key)
    assert value == top
    node[last] = top + 1
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(SettingsError, match=rf"^{path}: must be"):
        load_settings(tmp_path / "b.yaml")


# ---------------------------------------------------------------------------------------------------------- pruning
def test_pruning_through_the_round_end_hook_keeps_the_submissions_round(tmp_path):
    """The submission holds round 1, which the study does not rank among the kept ones (a better round failed its
    promotion's check): pruning after a round ends keeps its weights all the same."""
    settings = dataclasses.replace(make_settings(tmp_path), keep_rounds=0, submission_path=str(tmp_path / "sub"))
    study = optuna.create_study(direction="maximize")
    folders = {}
    for number, value in enumerate([40.0, 50.0, 80.0, 60.0]):
        folders[number] = Path(settings.rounds_dir) / f"round-{number:04d}"
        (folders[number] / MERGED_DIR).mkdir(parents=True)
        (folders[number] / "progress.jsonl").write_text("{}\n")
        study.add_trial(create_trial(value=value, user_attrs={"recipe": "sampled", "run_dir": str(folders[number])}))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / promotion.MARKER).write_text(json.dumps({"trial": 1, "accuracy": 50.0}))
    RoundEnd(settings, study, tmp_path / "board", prune=True)(study.trials[3], None)
    kept = {n for n, folder in folders.items() if (folder / MERGED_DIR).exists()}
    assert kept == {1, 2}  # the submission's round and the best; every log stays
    assert all((folder / "progress.jsonl").exists() for folder in folders.values())


# ---------------------------------------------------------------------------------------------------------- time
def test_a_late_last_round_is_killed_before_the_reserve(tmp_path):
    """Rounds that hang (no progress; the hang check is far off) run until their kill: the last one's kill is at the
    reserve, not its allotment's grace past it."""
    scheduler = scheduler_for(tmp_path, hours=1.0, reserve_minutes=20, round_min_minutes=10, round_max_minutes=60,
                              hang_minutes=600, backend_options={"hang_rate": 1.0, "failure_rate": 0.0})  # fmt: skip
    run(scheduler)
    reserve_starts = scheduler.deadline - 20 * 60
    rounds = ran(scheduler.study)
    assert rounds and all(t.user_attrs["reason"].startswith("killed") for t in rounds)
    last = max(rounds, key=lambda t: t.user_attrs["ended_at"])
    assert last.user_attrs["started_at"] + last.user_attrs["allotted_s"] == pytest.approx(reserve_starts)
    assert all(t.user_attrs["ended_at"] <= reserve_starts + POLL_S for t in rounds)


def test_round_0_started_near_the_deadline_is_capped_by_it(tmp_path):
    """The base is scored last-minute (a resumed study whose round 0 never ran): it may use the reserve, never more."""
    scheduler = scheduler_for(tmp_path, hours=1.0, reserve_minutes=20, round_min_minutes=20, clock_offset=50 * 60)
    run(scheduler)
    bases = [t for t in scheduler.study.trials if t.user_attrs.get("recipe") == "base"]
    [base] = [t for t in bases if "started_at" in t.user_attrs]
    left = scheduler.deadline - base.user_attrs["started_at"]
    assert left < 20 * 60 and base.user_attrs["allotted_s"] == pytest.approx(left, abs=0.1)
    assert base.user_attrs["ended_at"] <= scheduler.deadline + POLL_S
    assert not ran(scheduler.study)  # and no training round: there was no time for one
    assert base.state in (TrialState.COMPLETE, TrialState.FAIL)
