"""The Optuna study of a search: its storage, sampler, pruner, deadline and warm starts.

A storage written as a path is an Optuna Journal file, because that is what `optuna-dashboard study.db` opens as typed
(the dashboard takes an existing plain file for a journal and rejects a SQLite file given without `sqlite:///`). A
storage written as a URL is an `RDBStorage`, which lets several machines share one study. Rounds are driven with
ask/tell, so Optuna's heartbeat (which only `optimize()` runs) is not configured; the scheduler keeps its own.

Setting a study up takes several writes (create it, enqueue the warm starts, store the deadline), and a search can be
killed between any two: the deadline is written last, so a study without one is a study whose set-up was cut short,
and whoever opens it next finishes it (`_set_up` adds only what is missing).
"""

from __future__ import annotations

import fcntl
import math
import os
import re
import shutil
import time
import urllib.parse
import warnings
from pathlib import Path

import optuna
from optuna.storages.journal import JournalFileBackend
from optuna.storages.journal._file import BaseJournalFileLock
from optuna.trial import TrialState

from search import space
from search.folders import unwritable
from search.log import warn
from search.settings import HOURS_MAX, PRUNERS, SAMPLERS, Settings
from common.validation import InvalidValue, is_number, one_line, show

DEADLINE_ATTR = "deadline"  # unix seconds; set once, at creation, and kept by every resumed run
# {passed, line, worker, time}: the last check of a submission in the reserve (search.promotion.final_check)
FINAL_CHECK_ATTR = "final_check"
HOURS_ATTR = "hours"
RECIPE_ATTR = "recipe"  # a trial's warm start name ("sampled" for the sampler's trials, "base" for round 0)
# How long a study without a deadline is given for its creator (another worker, a moment earlier) to store one;
# then this search finishes the set-up itself.
DEADLINE_WAIT_S = 5.0
# Attempts at opening a database whose schema another worker is creating at the same moment.
SCHEMA_ATTEMPTS = 4
# Seconds to wait for a database server before giving up: an unreachable host (a firewall that drops packets) would
# otherwise hang the start for minutes (the driver's default is the operating system's TCP timeout).
CONNECT_TIMEOUT_S = 10
_SQLITE_HEADER = b"SQLite format 3\0"


class StudyError(InvalidValue):
    """The storage cannot be opened, or it holds a study this search cannot continue; `key` is storage or
    study_name."""


def open_storage(storage: str, *, create: bool = True) -> optuna.storages.BaseStorage:
    """The storage a budget's `storage` names: a Journal file for a path, an RDBStorage for a URL. Whatever the file
    or the URL holds, a failure is a StudyError; nothing is written unless the storage opens."""
    if "://" in storage:
        return _open_database(storage)
    return _open_journal(storage, create=create)


def _open_database(url: str) -> optuna.storages.RDBStorage:
    authority = url.split("://", 1)[1].split("/", 1)[0].split("?", 1)[0]
    if authority.count("@") > 1:  # SQLAlchemy would take the rest of the password for the host, and print it
        raise StudyError("storage", f"{_shown(url)}: the password holds an unencoded '@'; write it as %40")
    full_url = _with_driver(url)
    attempt = 0
    while True:
        try:
            return optuna.storages.RDBStorage(full_url, engine_kwargs=_engine_kwargs(full_url))
        except Exception as exc:  # drivers raise their own types (ImportError, OperationalError, ValueError, ...)
            # Workers started together on an empty database race to create Optuna's tables and types: the
            # loser's CREATE fails with "already exists". The creation checks first, so a retry finds them.
            attempt += 1
            if "already exists" not in str(exc) or attempt >= SCHEMA_ATTEMPTS:
                raise StudyError("storage", f"cannot open {_shown(url)}: {redact(one_line(exc), url)}") from None
            time.sleep(0.5 * attempt)


def _open_journal(storage: str, *, create: bool) -> optuna.storages.JournalStorage:
    path = Path(storage)  # its `~` was expanded with the settings (search.settings), once
    try:
        if path.exists():
            if not path.is_file():  # a folder; a FIFO would block the journal's open forever
                raise StudyError("storage", f"{storage} is not a file")
            with path.open("rb") as f:
                if f.read(len(_SQLITE_HEADER)) == _SQLITE_HEADER:
                    raise StudyError("storage", f"{storage} is not an Optuna journal file (it is an SQLite database: "
                                                f"use --storage sqlite:///{storage})")  # fmt: skip
        elif not create:
            raise StudyError("storage", f"{storage} does not exist")
        else:
            problem = unwritable(path.parent, must_exist=False)
            if problem:
                raise StudyError("storage", problem)
            path.parent.mkdir(parents=True, exist_ok=True)
        backend = JournalFileBackend(str(path), lock_obj=JournalFileFlock(str(path)))
    except StudyError:
        raise
    except (OSError, ValueError) as exc:
        why = getattr(exc, "strerror", None) or exc
        raise StudyError("storage", f"cannot open the journal file {storage}: {why}") from None
    try:
        journal = optuna.storages.JournalStorage(backend)  # replays the whole file, but a torn last line
    except Exception as exc:  # noqa: BLE001 - a file of other bytes fails the replay with any type
        raise StudyError("storage", f"{storage} is not an Optuna journal file ({type(exc).__name__}: {exc})") from None
    if create:  # a search appends: its torn last line goes first; a read (the leaderboard) skips it as Optuna does
        try:
            repair_torn_tail(path)
        except OSError as exc:
            raise StudyError("storage", f"cannot repair the torn last line of {storage}: {exc.strerror}") from None
    return journal


def repair_torn_tail(path: Path) -> Path | None:
    """Cut a journal file's torn last line (a process killed while appending leaves it without its newline), after
    keeping the whole file as `<name>.torn-<time>`; returns that copy, or None when the file ends in a whole line.

    Optuna's reader skips a torn last line, but its writer appends after it, which makes a line no reader can parse
    and every study in the file unreadable. Done under the journal's lock, which every append holds, so a line still
    being written by a live worker is never taken for a torn one."""
    lock = JournalFileFlock(str(path))
    lock.acquire()
    try:
        with path.open("r+b") as journal:
            size = journal.seek(0, os.SEEK_END)
            if size == 0 or _byte_at(journal, size - 1) == b"\n":
                return None
            whole = _end_of_last_whole_line(journal, size)
            copy = path.with_name(f"{path.name}.torn-{time.strftime('%Y%m%d-%H%M%S')}")
            journal.seek(0)
            with copy.open("xb") as kept:
                shutil.copyfileobj(journal, kept)
                kept.flush()
                os.fsync(kept.fileno())
            journal.truncate(whole)
            journal.flush()
            os.fsync(journal.fileno())
    finally:
        lock.release()
    warn(f"warning: {path}'s last line was torn (a kill while it was written): cut its last {size - whole} bytes, "
         f"the file as it was kept in {copy}")  # fmt: skip
    return copy


def _byte_at(journal, offset: int) -> bytes:
    journal.seek(offset)
    return journal.read(1)


def _end_of_last_whole_line(journal, size: int) -> int:
    """The offset just after the last newline of the file (0 when it has none), read backwards in blocks."""
    block = 1 << 16
    end = size
    while end > 0:
        start = max(0, end - block)
        journal.seek(start)
        newline = journal.read(end - start).rfind(b"\n")
        if newline >= 0:
            return start + newline + 1
        end = start
    return 0


class JournalFileFlock(BaseJournalFileLock):
    """The journal's write lock: a flock on the journal file itself.

    Optuna's default lock is a symlink next to the file: a process killed while it holds it leaves it behind, and the
    next writer waits out a 30 s grace period before breaking it. The kernel releases a flock when its holder dies,
    and it needs no other file. Workers on one machine share a journal (README), where flock works.
    """

    def __init__(self, path: str):
        self._path = path
        self._fd: int | None = None

    def acquire(self) -> bool:
        fd = os.open(self._path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return True

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)


def open_study(settings: Settings, *, now: float) -> tuple[optuna.Study, float]:
    """The study of `settings` and its deadline (unix seconds), created at `now` or resumed.

    At creation the warm starts are enqueued and the deadline is `now + hours`; a resumed study keeps both its own
    deadline and its own queue, and one whose set-up was cut short is finished. A study of the same name that
    minimizes (or has several objectives), or that this search cannot have set up, is refused.
    """
    storage = open_storage(settings.storage)
    previous = _existing_trials(storage, settings.study_name)
    sampler = make_sampler(settings.sampler, offset=previous or 0)
    pruner = make_pruner(settings.pruner)
    if previous is None:
        try:
            study = optuna.create_study(
                storage=storage,
                study_name=settings.study_name,
                direction="maximize",
                sampler=sampler,
                pruner=pruner,
            )
        except optuna.exceptions.DuplicatedStudyError:  # another worker created it a moment ago
            pass
        else:
            return study, _set_up(study, settings, now)
    study = optuna.load_study(storage=storage, study_name=settings.study_name, sampler=sampler, pruner=pruner)
    if len(study.directions) != 1 or study.direction != optuna.study.StudyDirection.MAXIMIZE:
        directions = [d.name.lower() for d in study.directions]
        raise StudyError(
            "study_name",
            f"the study {settings.study_name!r} in {_shown(settings.storage)} optimizes {directions}, not maximize; "
            "pick another --study-name",
        )
    _check_space_unchanged(study, settings)
    deadline = _deadline(study, settings, now)
    if deadline is None and _wait_for_deadline(study):
        deadline = _deadline(study, settings, now)
    if deadline is None:  # its creator died before storing it
        if not _set_up_was_cut_short(study, settings):
            raise StudyError("study_name", f"the study {settings.study_name!r} was not created by this search (no "
                                           "deadline); pick another --study-name")  # fmt: skip
        _set_up(study, settings, now)
        deadline = _deadline(study, settings, now)  # another worker finishing it at the same moment may have won
    return study, deadline


def _check_space_unchanged(study: optuna.Study, settings: Settings) -> None:
    """A choice list of `space` edited since the study sampled from it, or a queued trial's value no longer among the
    choices, is refused here in one line naming the key: Optuna would refuse it at the round's first suggestion (its
    storage compares each parameter with the first trial that recorded it), leaving a RUNNING trial. Ranges may
    change: Optuna records their bounds per trial."""
    expected = space.choice_distributions(settings.space)
    first: dict[str, optuna.distributions.BaseDistribution] = {}
    for t in study.get_trials(deepcopy=False):
        for name, recorded in t.distributions.items():
            first.setdefault(name, recorded)
        if t.state == TrialState.WAITING:
            for name, value in t.system_attrs.get("fixed_params", {}).items():
                if name in expected and value not in expected[name][1].choices:
                    key, now = expected[name]
                    raise StudyError(f"space.{key}", f"queued trial {t.number} ({t.user_attrs.get(RECIPE_ATTR)}) has "
                                                     f"{name} {show(value)}, no longer one of {list(now.choices)}; "
                                                     f"{_EDITED_SPACE_HELP}")  # fmt: skip
    for name, recorded in first.items():
        if name in expected and recorded != expected[name][1]:
            key, now = expected[name]
            was = list(recorded.choices) if hasattr(recorded, "choices") else type(recorded).__name__
            raise StudyError(f"space.{key}", f"the study {settings.study_name!r} sampled {name} from {show(was)}, the "
                                             f"budget now gives {list(now.choices)}; {_EDITED_SPACE_HELP}")  # fmt: skip


_EDITED_SPACE_HELP = "a study keeps its choice lists: restore the list, or start a new study (--study-name)"


def _set_up(study: optuna.Study, settings: Settings, now: float) -> float:
    """Enqueue round 0 and the warm starts the study lacks (round 0 first: it is scored while the first rounds
    train), then store its deadline, last: a study with a deadline is set up."""
    have = {t.user_attrs.get(RECIPE_ATTR) for t in study.get_trials(deepcopy=False)}
    if space.BASE not in have:
        enqueue_base(study)
    for recipe in settings.warm_starts:
        if recipe["name"] not in have:
            params = space.warm_start_params(recipe["params"], settings.space)
            study.enqueue_trial(params, user_attrs={RECIPE_ATTR: recipe["name"]})
    _drop_duplicate_warm_starts(study)
    deadline = now + settings.hours * 3600.0
    study.set_user_attr(HOURS_ATTR, settings.hours)
    study.set_user_attr(DEADLINE_ATTR, deadline)
    return deadline


def enqueue_base(study: optuna.Study) -> None:
    """Queue round 0: the base model scored, no parameters sampled (the scheduler runs it as a scoring round)."""
    study.enqueue_trial({}, user_attrs={RECIPE_ATTR: space.BASE})


def _drop_duplicate_warm_starts(study: optuna.Study) -> None:
    """Two workers finishing one cut-short set-up at the same moment may both enqueue a missing warm start (or round
    0): only the first of each runs, the others are failed before anyone asks for them (the deadline is not stored
    yet)."""
    seen = set()
    for t in study.get_trials(deepcopy=False):
        recipe = t.user_attrs.get(RECIPE_ATTR)
        if recipe in seen and t.state == TrialState.WAITING:
            study._storage.set_trial_user_attr(t._trial_id, "reason", f"a second copy of the queued {recipe!r} trial")
            study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
        seen.add(recipe)


def _set_up_was_cut_short(study: optuna.Study, settings: Settings) -> bool:
    """Whether the study holds nothing but round 0 and warm starts of this budget waiting their turn: what a search
    killed between creating the study and storing its deadline leaves (another tool's study has other trials)."""
    names = {space.BASE} | {recipe["name"] for recipe in settings.warm_starts}
    trials = study.get_trials(deepcopy=False)
    return all(t.state == TrialState.WAITING and t.user_attrs.get(RECIPE_ATTR) in names for t in trials)


def _deadline(study: optuna.Study, settings: Settings, now: float) -> float | None:
    """The stored deadline, None when there is none yet; StudyError for one this search cannot have stored."""
    if DEADLINE_ATTR not in study.user_attrs:  # read from the storage at each access
        return None
    value = study.user_attrs[DEADLINE_ATTR]
    latest = now + (HOURS_MAX + 24) * 3600.0  # a day of slack for the clocks of several boxes
    if not is_number(value) or not math.isfinite(value) or not 0 <= value <= latest:
        raise StudyError("study_name", f"the study {settings.study_name!r} has a deadline this search cannot have set "
                                       f"({show(value)}); pick another --study-name")  # fmt: skip
    return float(value)


def _wait_for_deadline(study: optuna.Study) -> bool:
    """A worker that lost the race to create the study may load it before its creator stored the deadline (a moment
    later): wait a little for it. False when it never comes."""
    until = time.monotonic() + DEADLINE_WAIT_S
    while time.monotonic() < until:
        time.sleep(0.1)
        if DEADLINE_ATTR in study.user_attrs:
            return True
    return False


def load_existing_study(settings: Settings) -> optuna.Study:
    """The study of `settings` for reading (the leaderboard); creates nothing."""
    storage = open_storage(settings.storage, create=False)
    if _existing_trials(storage, settings.study_name) is None:
        names = [s.study_name for s in storage.get_all_studies()]
        raise StudyError("study_name", f"no study {settings.study_name!r} in {_shown(settings.storage)}; "
                                       f"it holds {show(names)}")  # fmt: skip
    return optuna.load_study(storage=storage, study_name=settings.study_name)


def make_sampler(options: dict, *, offset: int = 0) -> optuna.samplers.BaseSampler:
    """The sampler of a `sampler` setting. `offset` shifts the seed: a resumed study (offset = its trial count) would
    otherwise replay the random draws of its first trials."""
    cls, _ = SAMPLERS[options["type"]]
    kwargs = {k: v for k, v in options.items() if k != "type"}
    if kwargs.get("seed") is not None:
        kwargs["seed"] = (kwargs["seed"] + offset) % 2**32  # numpy's seeds stop at 2**32 - 1
    with warnings.catch_warnings():  # `group` is experimental; budget.yaml says so where it is set
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return cls(**kwargs)


def make_pruner(options: dict) -> optuna.pruners.BasePruner:
    """The pruner of a `pruner` setting."""
    cls, _ = PRUNERS[options["type"]]
    return cls(**{k: v for k, v in options.items() if k != "type"})


def _existing_trials(storage: optuna.storages.BaseStorage, name: str) -> int | None:
    """The number of trials of the study `name`, or None when there is no such study."""
    try:
        study_id = storage.get_study_id_from_name(name)
    except KeyError:
        return None
    return len(storage.get_all_trials(study_id, deepcopy=False))


def _with_driver(url: str) -> str:
    """A PostgreSQL URL without a driver, made to use the installed one. SQLAlchemy 2.1 maps a bare `postgresql://`
    to psycopg 3, while this project installs psycopg2 (`psycopg2-binary`); `postgres://` is no longer accepted."""
    scheme, rest = url.split("://", 1)
    if scheme not in ("postgresql", "postgres"):
        return url
    import importlib.util

    if importlib.util.find_spec("psycopg") is not None:
        return f"postgresql+psycopg://{rest}"
    if importlib.util.find_spec("psycopg2") is not None:
        return f"postgresql+psycopg2://{rest}"
    raise StudyError("storage", f"no PostgreSQL driver for {_shown(url)}: pip install psycopg2-binary")


def _engine_kwargs(url: str) -> dict:
    scheme = url.split("://", 1)[0].split("+", 1)[0].lower()
    if scheme in ("postgresql", "postgres", "mysql", "mariadb"):
        return {"connect_args": {"connect_timeout": CONNECT_TIMEOUT_S}}
    return {}


# ---------------------------------------------------------------------------------------------------------- secrets
# Query parameters that carry a password (libpq and the MySQL drivers read them).
_SECRET_PARAMETERS = ("password", "passwd", "pwd", "pass", "sslpassword", "secret", "token")
# The password of a URL: the user info's part after its first colon, up to the last '@' of the host part (a raw '@'
# in a password is common, and must not leak its tail); and query parameters that carry one (libpq reads them).
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^:/?#@\s]*):(?P<password>[^/?#\s]*)@")
# A query value ends at the next parameter, or at a colon and a space (where a message goes on after the URL).
_SECRET_QUERY = re.compile(
    r"(?i)(?P<name>[?&;](?:password|passwd|pwd|pass|sslpassword|secret|token)=)(?:[^&#\s:]|:(?!\s|$))*"
)


def _parsed_secrets(storage: str) -> list[str]:
    """The password of `storage` as SQLAlchemy reads it (every character up to the host's '@': '/', '#', '?' and
    spaces included), as written and decoded, and the values of its password parameters."""
    from sqlalchemy.engine import make_url  # late: SQLAlchemy is slow to import, and only a URL needs it

    try:
        url = make_url(storage)
    except Exception:  # noqa: BLE001 - not a URL SQLAlchemy reads: the patterns above are all there is
        return []
    found = []
    if url.password:
        found.append(str(url.password))
        userinfo = storage.split("://", 1)[1].split("@", 1)[0]
        found.append(userinfo.partition(":")[2])  # as written, %-encoded
    for name, value in url.query.items():
        if name.lower() in _SECRET_PARAMETERS:
            found += [value] if isinstance(value, str) else list(value)
    return found


def _shown(storage: str) -> str:
    """A storage as a line may show it: its own password, whatever characters it holds, replaced."""
    return redact(storage, storage)


def redact(text: str, storage: str | None = None) -> str:
    """`text` with the password of every URL in it replaced by ***, and every piece of `storage`'s password too
    (a driver may quote it on its own)."""
    cleaned = _SECRET_QUERY.sub(r"\g<name>***", _USERINFO.sub(r"\g<scheme>\g<user>:***@", text))
    for secret in _secrets(storage):
        cleaned = cleaned.replace(secret, "***")
    return cleaned


def _secrets(storage: str | None) -> list[str]:
    if not storage or "://" not in storage:
        return []
    found = [m.group("password") for m in _USERINFO.finditer(storage)]
    found += [m.group(0).split("=", 1)[1] for m in _SECRET_QUERY.finditer(storage)]
    found += _parsed_secrets(storage)
    found += [urllib.parse.unquote(secret) for secret in found]
    # Longest first, so that a password's tail is not replaced before the whole of it; a very short one would only
    # garble the line.
    return sorted({secret for secret in found if len(secret) >= 3}, key=len, reverse=True)
