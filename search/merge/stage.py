"""The merge stage: which merges of the kept rounds to build, in which order, and whether the best one is handed in.

Models fine-tuned from one base average well (model soups, Wortsman et al. 2022), and moving a fine-tuned model
toward its base can help under distribution shift (WiSE-FT); both are choices made on scores, so both can fool the
one who makes them. The stage therefore splits the ood_val rows once, by a seeded permutation: the *selection* rows
rank the ingredients and choose every merge, the *held-back* rows only judge the final choice.

Candidates, each a trial scored by the evaluator like a round (search.merge.soup builds it):
  greedy   the ingredients in order of selection accuracy, each added to the soup only if the soup does not get
           worse on the selection rows (one candidate at a time: each depends on the last);
  uniform  the soup of all top-k ingredients (k >= 3; for two it is the greedy soup's first step);
  eta      theta = base + eta * (M - base) for each eta of the budget, where M is the best of the above on the
           selection rows, or the best single ingredient when no soup beat it.
The chosen candidate is the best on the selection rows. It is handed in only when it beats the best single
ingredient on the selection rows (a tie is no reason to change), beats the submission on all rows, and its lead over
the submission on the held-back rows is not negative.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Sequence

from search import selection

GREEDY, UNIFORM, ETA = "greedy", "uniform", "eta"


@dataclass(frozen=True)
class Ingredient:
    """A completed round the stage may merge: its trial, its merged weights and its per-row correctness."""

    trial: int
    merged_dir: str
    correct: tuple[bool, ...]
    total_steps: int = 0


@dataclass(frozen=True)
class Candidate:
    """A merge to build: the trials it averages (in ranking order) and eta."""

    ingredients: tuple[int, ...]
    eta: float
    kind: str

    @property
    def key(self) -> tuple[tuple[int, ...], float]:
        return tuple(sorted(self.ingredients)), self.eta


@dataclass(frozen=True)
class Decision:
    chosen: Candidate | None
    promote: bool
    why: str


@dataclass
class _Result:
    correct: tuple[bool, ...] | None  # None: the candidate failed
    selection: float | None = None


@dataclass
class MergeStage:
    """The stage's plan, advanced by the scores of its candidates. `ingredients` best first (see `rank`);
    `reference` is the submission's per-row correctness on the same rows."""

    ingredients: Sequence[Ingredient]
    reference: Sequence[bool] | None
    etas: Sequence[float]
    held_out_share: float
    seed: int
    _results: dict = field(default_factory=dict)  # Candidate.key -> _Result
    _launched: dict = field(default_factory=dict)  # Candidate.key -> Candidate
    _greedy_soup: list = field(default_factory=list)  # trial numbers kept so far
    _greedy_next: int = 1  # index of the next ingredient the greedy soup tries
    _greedy_score: float = 0.0  # the greedy soup's selection accuracy so far

    def __post_init__(self) -> None:
        if not self.ingredients:
            raise ValueError("the merge stage needs at least one ingredient")
        n = len(self.ingredients[0].correct)
        rows = list(range(n))
        random.Random(f"merge-rows-{self.seed}").shuffle(rows)
        held = round(self.held_out_share * n)
        self.held_out_rows, self.selection_rows = sorted(rows[:held]), sorted(rows[held:])
        self._greedy_soup = [self.ingredients[0].trial]
        self._greedy_score = self.selection_accuracy(self.ingredients[0].correct)

    # ------------------------------------------------------------------ scores on the two parts of the rows
    def selection_accuracy(self, correct: Sequence[bool]) -> float:
        return 100.0 * sum(correct[i] for i in self.selection_rows) / max(1, len(self.selection_rows))

    def held_out_lead(self, correct: Sequence[bool]) -> selection.Lead | None:
        """The lead over the submission on the held-back rows; None without comparable rows."""
        if self.reference is None or len(self.reference) != len(correct) or not self.held_out_rows:
            return None
        return selection.paired_lead([correct[i] for i in self.held_out_rows],
                                     [self.reference[i] for i in self.held_out_rows])  # fmt: skip

    # ------------------------------------------------------------------ the plan
    def ready(self) -> list[Candidate]:
        """Candidates that can be built now and were not launched yet."""
        greedy = self._greedy_candidate()
        planned = [greedy] if greedy is not None else []
        uniform = Candidate(tuple(i.trial for i in self.ingredients), 1.0, UNIFORM)
        if len(self.ingredients) >= 3:
            planned.append(uniform)
        soups_scored = greedy is None and (len(self.ingredients) < 3 or uniform.key in self._results)
        if soups_scored:
            anchor = self._best_soup()
            planned += [Candidate(anchor, float(eta), ETA) for eta in self.etas if float(eta) != 1.0]
        fresh, seen = [], set(self._launched)
        for candidate in planned:  # one build per ingredient set and eta
            if candidate.key not in seen:
                fresh.append(candidate)
                seen.add(candidate.key)
        return fresh

    def launched(self, candidate: Candidate) -> None:
        self._launched[candidate.key] = candidate

    def scored(self, candidate: Candidate, correct: Sequence[bool] | None) -> None:
        """A launched candidate's per-row correctness (None: it failed, or has no comparable rows)."""
        result = _Result(tuple(correct) if correct is not None else None)
        if result.correct is not None:
            result.selection = self.selection_accuracy(result.correct)
        self._results[candidate.key] = result

    @property
    def done(self) -> bool:
        """Everything launched has a score and nothing more can be planned."""
        return not self.ready() and all(key in self._results for key in self._launched)

    def decide(self) -> Decision:
        scored = [(key, r) for key, r in self._results.items() if r.selection is not None]
        if not scored:
            return Decision(None, False, "no merge candidate was scored")
        key, best = max(scored, key=lambda item: item[1].selection)  # the first of equals: built earliest
        chosen = self._launched[key]
        anchor = self.selection_accuracy(self.ingredients[0].correct)
        lead = self.held_out_lead(best.correct)
        if best.selection <= anchor:
            return Decision(chosen, False, f"the best merge ({best.selection:.1f}%) does not beat the best round "
                                           f"({anchor:.1f}%) on the selection rows")  # fmt: skip
        if self.reference is None or lead is None:
            return Decision(chosen, False, "the submission has no per-row scores on these rows to compare against")
        mine, theirs = 100.0 * sum(best.correct) / len(best.correct), 100.0 * sum(self.reference) / len(self.reference)
        if mine <= theirs:
            return Decision(chosen, False, f"on all rows it does not beat the submission ({mine:.1f}% vs {theirs:.1f}%)")
        if lead.points < 0:
            return Decision(chosen, False, f"its lead over the submission on the held-back rows is negative ({lead})")
        return Decision(chosen, True, f"selection {best.selection:.1f}% vs {anchor:.1f}%, held-back lead {lead}")

    # ------------------------------------------------------------------ helpers
    def _greedy_candidate(self) -> Candidate | None:
        """The greedy soup's next step (None once it is over), after taking in the steps already scored: a step's soup
        may have been built as another candidate (the uniform soup of the same rounds)."""
        while self._greedy_next < len(self.ingredients):
            trial = self.ingredients[self._greedy_next].trial
            candidate = Candidate((*self._greedy_soup, trial), 1.0, GREEDY)
            result = self._results.get(candidate.key)
            if result is None:
                return candidate
            self._greedy_next += 1
            if result.selection is not None and result.selection >= self._greedy_score:
                self._greedy_soup, self._greedy_score = list(candidate.ingredients), result.selection
        return None

    def _best_soup(self) -> tuple[int, ...]:
        """The ingredients of the best soup on the selection rows; the best single ingredient when none beats it."""
        best, score = (self.ingredients[0].trial,), self.selection_accuracy(self.ingredients[0].correct)
        for key, c in self._launched.items():
            result = self._results.get(key)
            if c.kind != ETA and result and result.selection is not None and result.selection > score:
                best, score = c.ingredients, result.selection
        return best


def rank(ingredients: Sequence[Ingredient], *, top_k: int, seed: int, held_out_share: float) -> list[Ingredient]:
    """The top `top_k` ingredients by accuracy on the stage's selection rows (never the held-back ones)."""
    if not ingredients:
        return []
    probe = MergeStage(ingredients, None, (), held_out_share, seed)
    ordered = sorted(ingredients, key=lambda i: (-probe.selection_accuracy(i.correct), i.trial))
    return ordered[:top_k]
