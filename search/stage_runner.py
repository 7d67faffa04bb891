"""The scheduler's side of the merge stage: when it runs, what each candidate records, and what is handed in.

The stage runs once the rounds are over (no more start, none still trains), in the time the scheduler kept for it
before the reserve (`seconds`): its greedy soup's chain one candidate after another, then its eta candidates side by
side on the slots. Each candidate is a trial the scheduler runs like a round (`advance` launches them on its free
slots, `finish` records one). Scored candidates stay RUNNING until the stage decides, so the chosen one is promoted
before it is told; the weights of those beaten on the selection rows are deleted as soon as they are beaten.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from optuna.trial import TrialState

from search import lineage, selection, space, trials
from search.allotment import Allotment
from search.merge import Candidate, Decision, Ingredient, MergeSpec, MergeStage, rank
from search.promotion import delete_weights
from search.log import minutes
from search.report import describe_merge, gpus_text
from search.rounds import RunningRound

if TYPE_CHECKING:
    import optuna

    from search.backends import RoundOutcome
    from search.duration import DurationModel
    from search.scheduler import Scheduler
    from search.settings import Settings


@dataclass(frozen=True)
class Handed:
    """A scored candidate once the stage decided: whether it was chosen, and whether it is to be promoted."""

    trial: optuna.Trial
    outcome: RoundOutcome
    candidate: Candidate
    chosen: bool
    promote: bool
    decision: str | None  # the chosen one's line: promoted or kept out, and why


class StageRunner:
    def __init__(self, settings: Settings, *, by_hand: bool = False):
        self.settings = settings
        self.over = not (settings.merge.enabled or by_hand)  # no stage, or it has decided
        self.stage: MergeStage | None = None
        self.ingredients: dict[int, Ingredient] = {}
        self.pending: list[tuple[optuna.Trial, RoundOutcome, Candidate]] = []

    def seconds(self, duration: DurationModel, slots: int) -> float:
        """The stage's predicted seconds: its greedy soup's chain, one candidate after another, then its eta
        candidates side by side on the slots (and the uniform soup where there is no second slot for it)."""
        m = self.settings.merge
        etas = sum(eta != 1.0 for eta in m.etas)
        waves = (m.top_k - 1) + math.ceil(etas / slots) + (m.top_k >= 3 and slots == 1)
        return waves * duration.merge_seconds(m.top_k + 1)

    def plan(self, found: Sequence[Ingredient], reference: tuple[str, list[bool]] | None) -> list[Ingredient]:
        """The stage over the `found` rounds (lineage.merge_ingredients), scored on the submission's rows
        (`reference`); the ranked ingredients, none when there is nothing to merge (the stage is then over)."""
        m = self.settings.merge
        ranked = rank(found, top_k=m.top_k, seed=self.settings.seed, held_out_share=m.held_out_share)
        if not ranked:
            self.over = True
            return []
        self.ingredients = {i.trial: i for i in ranked}
        self.stage = MergeStage(ranked, reference[1] if reference else None, m.etas, m.held_out_share,
                                self.settings.seed)  # fmt: skip
        return ranked

    def next(self) -> tuple[Candidate, MergeSpec] | None:
        """The next candidate ready to build, with what it reads; None when none is ready."""
        ready = self.stage.ready()
        if not ready:
            return None
        candidate = ready[0]
        sources = tuple(self.ingredients[n].merged_dir for n in candidate.ingredients)
        return candidate, MergeSpec(sources, self.settings.model_path, candidate.eta)

    def total_steps(self, candidate: Candidate) -> int:
        return max(self.ingredients[n].total_steps for n in candidate.ingredients)

    def scored(self, trial: optuna.Trial, outcome: RoundOutcome, candidate: Candidate) -> dict | None:
        """Record a finished candidate. Its selection-row figures as trial attributes when it was scored on the
        stage's rows (it then waits, RUNNING, for the decision); None when it cannot take part in the choice."""
        rows = selection.correctness(outcome.ood_rows) if outcome.state.saved and outcome.ood_rows else None
        comparable = rows is not None and len(rows) == len(self.stage.ingredients[0].correct)
        self.stage.scored(candidate, rows if comparable else None)
        if not comparable:
            return None
        attrs = {"selection_accuracy": round(self.stage.selection_accuracy(rows), 2)}
        lead = self.stage.held_out_lead(rows)
        if lead is not None:
            attrs["held_out_lead"] = [round(lead.points, 2), round(lead.low, 2), round(lead.high, 2), lead.n]
        self.pending.append((trial, outcome, candidate))
        return attrs

    def beaten(self) -> list[tuple[optuna.Trial, RoundOutcome]]:
        """The scored candidates that are not the best on the selection rows: only the best can be chosen, and every
        later candidate is built from the rounds, so their weights can go."""
        best = max(self.pending, key=lambda p: p[0].user_attrs.get("selection_accuracy", -1.0))
        return [(trial, outcome) for trial, outcome, _ in self.pending if trial is not best[0]]

    def decide(self) -> tuple[list[Handed], Decision]:
        """Every scored candidate, with the stage's choice (search.merge.stage's guard, then the format floor); the
        pending list emptied."""
        self.over = True
        decision = self.stage.decide()
        handed = []
        for trial, outcome, candidate in self.pending:
            chosen = decision.chosen is not None and candidate.key == decision.chosen.key
            promote, line = False, None
            if chosen:
                promote = decision.promote and (outcome.format_rate or 0.0) >= self.settings.min_format_rate
                why = decision.why if promote or not decision.promote else "its format rate is below min_format_rate"
                line = ("promoted: " if promote else "kept out: ") + why
            handed.append(Handed(trial, outcome, candidate, chosen, promote, line))
        self.pending = []
        return handed, decision

    # ------------------------------------------------------------------ run by the scheduler
    def advance(self, s: Scheduler, now: float) -> None:
        """Once the rounds are over (no more start, none still trains): plan the stage, launch its candidates on the
        free slots while they fit before the reserve, and decide when nothing more runs or can be launched."""
        if s._closed is None or self.over or any(r.config is not None for r in s._running.values()):
            return
        if self.stage is None:
            all_trials = s.study.get_trials(deepcopy=False)
            held = [t for t in all_trials if s._best is not None and t.number == s._best[1]]
            reference = selection.read_rows_attr(held[0].user_attrs) if held else None  # the submission's rows
            found = lineage.merge_ingredients(all_trials, reference, self.settings.min_format_rate,
                                              s.backend.has_weights)  # fmt: skip
            ranked = self.plan(found, reference)
            if not ranked:
                s._say("merge stage: no completed round to merge")
                return
            s._say(f"merge stage over rounds {', '.join(str(i.trial) for i in ranked)}, predicted "
                   f"{minutes(self.seconds(s.duration, len(s._slots)))} of {minutes(s.end_of_stage - s.clock.now())}")
        for slot in range(len(s._slots)):
            if slot not in s._running and not self._launch(s, slot, now):
                break
        if not any(r.merge for r in s._running.values()):
            self._decide(s)

    def _launch(self, s: Scheduler, slot: int, now: float) -> bool:
        """Start the next candidate on `slot`; False when none is ready or it would not fit in time."""
        ready = self.next()
        if ready is None:
            return False
        candidate, spec = ready
        predicted = s.duration.merge_seconds(spec.models_read)
        if now + predicted > s.end_of_stage:
            return False
        trial = trials.new_trial(s.study, space.MERGE)
        s.workers.claim(trial)
        run_dir, gpus = trials.run_dir(s.settings.rounds_dir, trial), s._slots[slot]
        trials.set_attrs(trial, {
            "parent": list(candidate.ingredients), "ingredients": list(candidate.ingredients), "eta": candidate.eta,
            "merge_kind": candidate.kind, "models_read": spec.models_read, "steps": 0,
            "predicted_s": round(predicted, 1), "allotted_s": round(s.end_of_stage - now, 1),
            "run_dir": str(run_dir), "gpus": gpus, "started_at": now,
        })  # fmt: skip
        self.stage.launched(candidate)
        try:
            handle = s.backend.merge(spec, str(run_dir), gpus)
        except OSError as error:
            self.stage.scored(candidate, None)
            s._tell_failed(trial, f"could not start the merge: {error}")
            return True
        end = s.end_of_stage  # a merge trains nothing, so it is never asked to stop; killed at the reserve
        allotted = Allotment(0, predicted, end_by=end, stop_at=math.inf, kill_at=end)
        s._start(slot, RunningRound(trial, None, gpus, handle, now, allotted, merge=candidate))
        s._say(f"round {trial.number} starts on {gpus_text(gpus)}: {describe_merge(candidate)}, predicted "
               f"{minutes(predicted)}")  # fmt: skip
        return True

    def finish(self, s: Scheduler, r: RunningRound, now: float) -> None:
        """A candidate ended: recorded, then told at once when it cannot take part in the choice, or kept RUNNING
        for the decision (the beaten ones' weights deleted)."""
        outcome = r.outcome()
        s.duration.observe(None, 0, outcome.timings, models_read=r.trial.user_attrs.get("models_read", 0))
        trials.set_attrs(r.trial, trials.outcome_attrs(outcome, r.started, now, self.total_steps(r.merge)))
        figures = self.scored(r.trial, outcome, r.merge)
        if figures is None:
            if outcome.state.saved:
                trials.tell(s.study, r.trial, outcome.ood_accuracy)
            else:
                trials.tell(s.study, r.trial, state=TrialState.FAIL)
            s.workers.heartbeat.remove(r.trial)
            s._say(f"round {r.trial.number} (merge) {outcome.state}: {outcome.reason or 'no comparable rows'}")
            s._round_ended(r.trial, outcome)
            return
        trials.set_attrs(r.trial, figures)
        s._say(f"round {r.trial.number} (merge) scored: ood {outcome.ood_accuracy:.1f}%, selection rows "
               f"{figures['selection_accuracy']:.1f}% after {minutes(now - r.started)}")  # fmt: skip
        for trial, beaten in self.beaten():
            if beaten.merged_dir and s.backend.has_weights(beaten.merged_dir):
                delete_weights(trial.user_attrs.get("run_dir"), self.settings.rounds_dir)

    def _decide(self, s: Scheduler) -> None:
        """The stage's choice promoted when it passes the guard and the format floor; every scored candidate told."""
        handed, decision = self.decide()
        for h in handed:
            h.trial.set_user_attr("merge_chosen", h.chosen)
            if h.chosen:
                h.trial.set_user_attr("merge_decision", h.decision)
                if h.promote and s._beats_best(h.outcome):
                    s._promote(h.trial, h.outcome)
                s._say(f"merge stage chose round {h.trial.number} ({describe_merge(h.candidate)}): {h.decision}")
        if decision.chosen is None:
            s._say(f"merge stage: {decision.why}")
        for h in handed:
            if s.on_round_scored is not None:
                s.on_round_scored(h.trial, h.outcome)
            trials.tell(s.study, h.trial, h.outcome.ood_accuracy)
            s.workers.heartbeat.remove(h.trial)
            s._round_ended(h.trial, h.outcome)
