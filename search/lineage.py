"""Which model a round starts from, and which rounds a merge may average: both read the study's finished rounds.

A round whose `init` is `best` starts from the merged model of the best round so far that this box could promote
(its weights still on disk, its format rate at least `min_format_rate`, its promotion not failed; a merge only if the
stage's guard let it through), the base model when there is none: it never waits for a round still being scored.
Each trial records its `parent` and its `total_steps` from the base.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import optuna
from optuna.trial import FrozenTrial, TrialState

from search import selection, space
from search.merge import Ingredient


@dataclass(frozen=True)
class Parent:
    """The model a round starts from: a scored trial (None when the base has no trial yet) and its weights."""

    trial: int | None
    model_path: str
    total_steps: int


def promotable(attrs: dict, min_format_rate: float, has_weights: Callable[[str], bool]) -> bool:
    """A finished round this box could hand in: its format above the floor, no failed promotion, its weights here."""
    return ((attrs.get("format_rate") or 0.0) >= min_format_rate and "promotion_error" not in attrs
            and bool(attrs.get("merged_dir")) and has_weights(attrs["merged_dir"]))  # fmt: skip


def parent_of(init: str, trials: Sequence[FrozenTrial], base_model: str, min_format_rate: float,
              has_weights: Callable[[str], bool]) -> Parent:  # fmt: skip
    """What a round of `init` starts from: the base, or the best promotable round whose weights are here."""
    bases = [t for t in trials if t.user_attrs.get("recipe") == space.BASE]
    scored_bases = [t for t in bases if t.state == TrialState.COMPLETE and t.value is not None]
    base_trial = (scored_bases or bases or [None])[0]
    base = Parent(base_trial.number if base_trial else None, base_model, 0)
    if init == "base":
        return base
    best: FrozenTrial | None = scored_bases[0] if scored_bases else None
    for t in trials:
        attrs = t.user_attrs
        if t.state != TrialState.COMPLETE or t.value is None or attrs.get("recipe") == space.BASE:
            continue
        if attrs.get("recipe") == space.MERGE and not attrs.get("promoted"):
            continue  # the stage's guard kept it out: its score is not trusted as a starting point
        if (best is None or t.value > best.value) and promotable(attrs, min_format_rate, has_weights):
            best = t
    if best is None or best.user_attrs.get("recipe") == space.BASE:
        return base
    return Parent(best.number, best.user_attrs["merged_dir"], int(best.user_attrs.get("total_steps", 0)))


def base_waiting(study: optuna.Study) -> bool:
    """Round 0 is queued and no worker has taken it yet."""
    waiting = study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
    return any(t.user_attrs.get("recipe") == space.BASE for t in waiting)


def merge_ingredients(trials: Sequence[FrozenTrial], reference: tuple[str, list[bool]] | None,
                      min_format_rate: float, has_weights: Callable[[str], bool]) -> list[Ingredient]:  # fmt: skip
    """The trained rounds a merge may average: completed, promotable, and scored on the submission's rows
    (`reference`: its rows' key and correctness; None: no submission yet), for a paired comparison."""
    found = []
    for t in trials:
        attrs, rows = t.user_attrs, selection.read_rows_attr(t.user_attrs)
        if t.state != TrialState.COMPLETE or attrs.get("recipe") in (space.BASE, space.MERGE) or rows is None:
            continue
        if reference is not None and (rows[0] != reference[0] or len(rows[1]) != len(reference[1])):
            continue  # scored on other rows: no paired comparison
        if promotable(attrs, min_format_rate, has_weights):
            found.append(Ingredient(t.number, attrs["merged_dir"], tuple(rows[1]), int(attrs.get("total_steps", 0))))
    return found
