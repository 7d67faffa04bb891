"""search.merge.stage: the row split, the order of the candidates, and the guard on what is handed in."""

from __future__ import annotations

import random

import pytest

from search.merge.stage import ETA, GREEDY, UNIFORM, Candidate, Ingredient, MergeStage, rank

N = 400


def rows(accuracy: float, seed: int) -> tuple[bool, ...]:
    rng = random.Random(seed)
    return tuple(rng.random() < accuracy for _ in range(N))


def stage(ingredients, reference=None, etas=(0.5, 1.5), share=0.5, seed=0) -> MergeStage:
    return MergeStage(ingredients, reference, etas, share, seed)


def ingredient(trial: int, accuracy: float) -> Ingredient:
    return Ingredient(trial, f"runs/round-{trial:04d}/merged", rows(accuracy, trial))


def on_rows(st: MergeStage, selection_value: bool, held_value: bool) -> list[bool]:
    correct = [False] * N
    for i in st.selection_rows:
        correct[i] = selection_value
    for i in st.held_out_rows:
        correct[i] = held_value
    return correct


def test_the_rows_split_once_by_a_seeded_permutation():
    a, b = stage([ingredient(1, 0.5)], seed=3), stage([ingredient(1, 0.5)], seed=3)
    assert a.held_out_rows == b.held_out_rows and len(a.held_out_rows) == N // 2
    assert sorted(a.held_out_rows + a.selection_rows) == list(range(N))
    assert stage([ingredient(1, 0.5)], seed=4).held_out_rows != a.held_out_rows
    assert len(stage([ingredient(1, 0.5)], share=0.25).held_out_rows) == N // 4


def test_ingredients_are_ranked_on_the_selection_rows_only():
    probe = stage([ingredient(1, 0.5)])
    good_where_it_counts = Ingredient(1, "a", tuple(on_rows(probe, True, False)))
    good_on_held_back_rows = Ingredient(2, "b", tuple(on_rows(probe, False, True)))
    ordered = rank([good_on_held_back_rows, good_where_it_counts], top_k=2, seed=0, held_out_share=0.5)
    assert [i.trial for i in ordered] == [1, 2]
    assert len(rank([ingredient(t, 0.5) for t in range(5)], top_k=3, seed=0, held_out_share=0.5)) == 3


def test_the_greedy_soup_keeps_an_ingredient_only_if_the_soup_does_not_get_worse():
    ings = [ingredient(1, 0.6), ingredient(2, 0.5), ingredient(3, 0.5), ingredient(4, 0.5)]
    st = stage(ings)
    first = st.ready()
    assert [(c.ingredients, c.kind) for c in first] == [((1, 2), GREEDY), ((1, 2, 3, 4), UNIFORM)]
    for c in first:
        st.launched(c)
    assert st.ready() == []  # the next greedy step waits for the last one's score
    st.scored(first[0], on_rows(st, False, False))  # worse than round 1 alone: round 2 is left out
    assert [c.ingredients for c in st.ready()] == [(1, 3)]
    st.launched(st.ready()[0])
    st.scored(Candidate((1, 3), 1.0, GREEDY), on_rows(st, True, True))  # better: round 3 stays
    assert [c.ingredients for c in st.ready()] == [(1, 3, 4)]
    st.launched(st.ready()[0])
    st.scored(Candidate((1, 3, 4), 1.0, GREEDY), on_rows(st, False, True))
    assert not st.ready()  # the uniform soup is still being scored: the eta wave waits for every soup
    st.scored(first[1], on_rows(st, False, False))
    wave = st.ready()
    assert [(c.ingredients, c.eta, c.kind) for c in wave] == [((1, 3), 0.5, ETA), ((1, 3), 1.5, ETA)]
    for c in wave:
        st.launched(c)
        st.scored(c, None)  # failed builds end the stage too
    assert st.done


def test_a_soup_built_as_another_candidate_is_not_built_twice():
    ings = [ingredient(1, 0.6), ingredient(2, 0.55), ingredient(3, 0.5)]
    st = stage(ings, etas=())
    greedy, uniform = st.ready()
    for c in (greedy, uniform):
        st.launched(c)
    st.scored(uniform, on_rows(st, True, False))
    st.scored(greedy, on_rows(st, True, False))  # kept: the next greedy step is the uniform soup, already scored
    assert st.ready() == [] and st.done


def test_with_one_ingredient_the_stage_only_moves_it_along_its_change():
    st = stage([ingredient(7, 0.6)], etas=(0.75, 1.0, 1.25))
    assert [(c.ingredients, c.eta) for c in st.ready()] == [((7,), 0.75), ((7,), 1.25)]


def test_the_choice_is_handed_in_only_past_the_guard():
    best = ingredient(1, 0.6)
    st = stage([best, ingredient(2, 0.5)], reference=best.correct, etas=())
    (candidate,) = st.ready()
    st.launched(candidate)
    anchor = list(best.correct)

    better_everywhere = [True] * N
    st.scored(candidate, better_everywhere)
    decision = st.decide()
    assert decision.promote and decision.chosen == candidate and "held-back lead +" in decision.why

    # Better on the selection rows, worse on the held-back ones: a lead the choice made, not the merge.
    overfit = [True if i in st.selection_rows else anchor[i] for i in range(N)]
    for i in [i for i in st.held_out_rows if anchor[i]][:5]:
        overfit[i] = False  # five held-back rows the submission gets right, this merge wrong
    assert sum(overfit) > sum(anchor)  # still ahead on all rows: only the held-back rows tell
    st.scored(candidate, overfit)
    decision = st.decide()
    assert not decision.promote and "held-back rows is negative" in decision.why

    # The same as the best round on the selection rows: no reason to change.
    tie = [anchor[i] if i in st.selection_rows else True for i in range(N)]
    st.scored(candidate, tie)
    assert not st.decide().promote and "does not beat the best round" in st.decide().why


def test_a_merge_that_does_not_beat_the_submission_on_all_rows_is_kept_out():
    best = ingredient(1, 0.6)
    stronger_submission = tuple([True] * N)
    st = stage([best, ingredient(2, 0.5)], reference=stronger_submission, etas=())
    (candidate,) = st.ready()
    st.launched(candidate)
    st.scored(candidate, [True if i in st.selection_rows else best.correct[i] for i in range(N)])
    decision = st.decide()
    assert not decision.promote and "does not beat the submission" in decision.why


def test_without_a_scored_candidate_nothing_is_chosen():
    st = stage([ingredient(1, 0.6), ingredient(2, 0.5)], etas=())
    (candidate,) = st.ready()
    st.launched(candidate)
    st.scored(candidate, None)
    assert st.decide().chosen is None and not st.decide().promote and st.done
    with pytest.raises(ValueError, match="at least one ingredient"):
        stage([])
