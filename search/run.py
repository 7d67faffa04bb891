"""A search, or a study's leaderboard, as the command line asks for it: the budget read, the box and the storage
checked, the study opened, the scheduler run with its hooks, and what it leaves for its user to read.

Bad input (budget, box, storage) is one line on stderr with exit code 2, before any model is loaded and before
anything is written; a failure during the search is its traceback, exit code 1. No line shows a storage URL's
password, in the terminal or in the log.

What a search leaves to read (leaderboard.md, leaderboard.csv, search.log: every line it printed, with its time) goes
next to the study's journal file. A database URL names no folder: they go into the folder the search is started from,
which is each box's own when several share a study.

The scheduler, the backends (torch), the promotion and the demo's builder are imported where a branch needs them: a
leaderboard, a bad input or `--help` answers without loading them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import traceback
import uuid
from pathlib import Path
from typing import Iterator

from search import interrupts, log
from search.settings import BUDGET, DEMO_BUDGET, Settings, SettingsError, check_box, load_settings
from search.study import load_existing_study, open_study, redact
from common.validation import InvalidValue, is_number

# A rehearsal gets its own journal file and a fresh study each time, so it never mixes with the real study.
SIMULATED_STORAGE = "simulated/study.db"


@dataclasses.dataclass(frozen=True)
class Request:
    """What the command line asks for; None takes the budget file's value."""

    leaderboard: bool = False  # print the study's leaderboard instead of searching
    merge: bool = False  # run the merge stage on an existing study's kept rounds instead of searching
    check: bool = False  # the preflight of the box (search.preflight) instead of searching
    budget: Path | None = None  # default: budget.yaml, or demo_budget.yaml with `demo`
    hours: str | None = None  # the command line's text, checked with the budget
    storage: str | None = None
    study_name: str | None = None
    simulate: bool = False  # virtual clock and simulated rounds: no model, data or GPU
    demo: bool = False  # build the demo's model and box first


def run(request: Request, *, prog: str) -> int:
    """Do what `request` asks; the exit code (0, 1 a failure, 2 bad input, 130 Ctrl-C, 143 SIGTERM, 141 a search's
    stdout closed; a leaderboard whose reader stopped reading ends with 0)."""
    storage = {"in use": request.storage}  # the storage whose password no line may show, once the budget is read
    with interrupts.handled(), log.recording(lambda text: redact(text, storage["in use"])) as recording:
        try:
            if request.leaderboard:
                return _print_leaderboard(request)
            if request.check:
                return _preflight(request)
            return _search(request, storage, recording)
        except InvalidValue as exc:
            log.warn(f"{prog}: error: {exc}")
            return 2
        except Exception:  # not bad input: a failure during the search, shown whole
            log.warn(traceback.format_exc().rstrip("\n"))
            return 1
        except interrupts.OutputClosed:
            if request.leaderboard:
                return 0
            log.warn(f"{prog}: stdout was closed: the search stopped, its rounds were ended; the same command "
                     "resumes it")
            return interrupts.exit_code(interrupts.OutputClosed())
        except KeyboardInterrupt as interrupt:  # at any point: set-up, a round's launch, a promotion, the leaderboard
            what = "terminated" if isinstance(interrupt, interrupts.Terminated) else "interrupted"
            log.warn(f"{prog}: {what}: running rounds were ended; the study and the submission are as they were")
            return interrupts.exit_code(interrupt)


class _InputError(InvalidValue):
    """Reading the input failed in a way no check foresaw; still one line, naming what was being read."""


@contextlib.contextmanager
def _reading(key: str) -> Iterator[None]:
    """Whatever the budget, the box or the storage hold, reading them ends in one line and exit code 2: an exception
    no check foresaw is reported with its type, under the key being read."""
    try:
        yield
    except InvalidValue:
        raise
    except Exception as exc:  # noqa: BLE001 - see the docstring
        raise _InputError(key, f"{type(exc).__name__}: {exc}") from None


def _load(request: Request, **overrides: str | None) -> Settings:
    budget = request.budget or (DEMO_BUDGET if request.demo else BUDGET)
    values = {"hours": request.hours, "storage": request.storage, "study_name": request.study_name, **overrides}
    return load_settings(budget, **values)


def _print_leaderboard(request: Request) -> int:
    from search.report import format_leaderboard

    if request.simulate:
        raise SettingsError("leaderboard", "--simulate is for a search; give the simulated study's --storage instead")
    with _reading("budget"):
        settings = _load(request)
    with _reading("storage"):
        board = format_leaderboard(load_existing_study(settings))
    log.say(board)
    return 0


def _preflight(request: Request) -> int:
    if request.simulate:
        raise SettingsError("check", "checks a real box; --simulate has none (--demo checks the demo's)")
    with _reading("budget"):
        settings = _load(request)
    if request.demo:
        from synthetic.demo import build_demo

        build_demo(settings.model_path, Path(settings.train_path).parent, settings.seed, say=log.say)
    with _reading("box"):
        check_box(settings)
    from search.preflight import preflight

    return preflight(settings, say=log.say)


def _search(request: Request, storage: dict[str, str | None], recording: log.Recording) -> int:
    if request.merge and (request.simulate or request.demo):
        raise SettingsError("merge", "runs on an existing study; give its --storage and --study-name instead")
    with _reading("budget"):
        settings = _load(request, storage=request.storage or SIMULATED_STORAGE) if request.simulate else _load(request)
    storage["in use"] = settings.storage
    if request.simulate and request.study_name is None:  # a fresh study per rehearsal, even two started in one second
        name = f"{settings.study_name}-sim-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        settings = dataclasses.replace(settings, study_name=name)
    if request.demo:
        from synthetic.demo import build_demo

        build_demo(settings.model_path, Path(settings.train_path).parent, settings.seed, say=log.say)
    if not request.simulate:
        with _reading("box"):
            check_box(settings)  # before the study exists, so bad input leaves nothing behind

    from search.backends import VirtualClock, WallClock
    from search.promotion import RecordingPromoter, SubmissionPromoter
    from search.report import RoundEnd, RoundPlot
    from search.scheduler import Scheduler

    clock = VirtualClock(start=time.time()) if request.simulate else WallClock()
    with _reading("storage"):
        if request.merge:
            load_existing_study(settings)  # by hand, the stage merges a study's rounds: it never creates one
        study, deadline = open_study(settings, now=clock.now())
    if request.simulate:
        from search.backends import SimulatedBackend

        backend, promoter = SimulatedBackend(settings, clock, seed=settings.seed), RecordingPromoter()
    else:
        from search.backends import LocalBackend
        from search.promotion import recover_submission

        with _reading("submission_path"):
            recover_submission(settings.submission_path)
        backend, promoter = LocalBackend(settings), SubmissionPromoter(settings)
    folder = results_folder(settings.storage)
    recording.open(folder / log.LOG_NAME)  # the input passed every check: from here on the search writes
    finished = sum(t.state.is_finished() for t in study.get_trials(deepcopy=False))
    where = settings.storage if "://" not in settings.storage else "the database"
    log.say(f"study {settings.study_name} in {where}: deadline {_clock_time(deadline)}, {finished} round(s) finished "
            f"before; log: {recording.path}; watch it with: {_dashboard_command(settings.storage)}")  # fmt: skip
    scheduler = Scheduler(
        settings,
        study,
        deadline,
        backend,
        clock,
        promoter=promoter,
        on_round_end=RoundEnd(settings, study, folder, prune=not request.simulate),
        on_round_scored=None if request.simulate else RoundPlot(settings),
        merge_only=request.merge,
    )
    if not request.simulate:
        from search.promotion import keep_a_checker_ready

        keep_a_checker_ready()  # the first promotion's check finds its interpreter started
    try:
        scheduler.run()
    finally:
        if not request.simulate:
            keep_a_checker_ready(False)
        _write_leaderboard(study, folder)
    log.say(_summary(study, settings, recording.path, simulated=request.simulate,
                     final_check=scheduler.final_check_result))  # fmt: skip
    return 0


def _write_leaderboard(study, folder: Path) -> None:
    """The last leaderboard write; its failure (a full disk, a folder gone) is a warning, so that it never hides the
    summary, the search's own error or its interrupt."""
    from search.report import write_leaderboard

    try:
        write_leaderboard(study, folder)
    except Exception as error:  # noqa: BLE001 - see the docstring
        log.warn(f"warning: the leaderboard could not be written into {folder}: {type(error).__name__}: {error}")


def results_folder(storage: str) -> Path:
    """Where the leaderboard and the log go: next to the study's journal file (the current folder for a URL)."""
    return Path(storage).parent if "://" not in storage else Path(".")


def _summary(
    study, settings: Settings, log_path: Path, *, simulated: bool, final_check: tuple[bool, str] | None
) -> str:
    from search.report import format_leaderboard
    from search.promotion import MARKER, promoted

    lines = [
        format_leaderboard(study),
        f"leaderboard: {results_folder(settings.storage) / 'leaderboard.md'}",
        f"log: {log_path}",
    ]
    if not simulated:
        marker = promoted(settings.submission_path)
        accuracy = marker.get("accuracy") if isinstance(marker, dict) else None
        lines.append(
            f"submission: {settings.submission_path} holds trial {marker.get('trial')} "
            f"({marker.get('recipe') or 'round'}, {accuracy:.1f}% on ood_val)"
            if is_number(accuracy)
            else f"submission: nothing promoted into {settings.submission_path}"
            if marker is None
            else f"submission: {settings.submission_path} holds a {MARKER} this search cannot read"
        )
    if final_check is not None and not final_check[0]:
        lines.append(final_check[1])  # again last, where a user who reads only the end sees it
    return "\n".join(lines)


def _dashboard_command(storage: str) -> str:
    if "://" in storage:
        return "optuna-dashboard STORAGE_URL --artifact-dir artifacts"
    from search.report import artifact_dir

    return f"optuna-dashboard {storage} --artifact-dir {artifact_dir(storage)}"


def _clock_time(unix: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(unix))
