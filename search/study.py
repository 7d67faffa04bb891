"""The Optuna study of a search: its storage, sampler, pruner, deadline and warm starts.

A storage written as a path is an Optuna Journal file, because that is what `optuna-dashboard study.db` opens as typed
(the dashboard takes an existing plain file for a journal and rejects a SQLite file given without `sqlite:///`). A
storage written as a URL is an `RDBStorage`, which lets several machines share one study. Rounds are driven with
ask/tell, so Optuna's heartbeat (which only `optimize()` runs) is not configured.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import optuna
from optuna.storages.journal import JournalFileBackend

from search import space
from search.settings import PRUNERS, SAMPLERS, Settings
from trainer.validation import one_line

DEADLINE_ATTR = "deadline"  # unix seconds; set once, at creation, and kept by every resumed run
# How long a study without a deadline is given for its creator (another worker, a moment earlier) to store one.
DEADLINE_WAIT_S = 5.0
# Attempts at opening a database whose schema another worker is creating at the same moment.
SCHEMA_ATTEMPTS = 4


class StudyError(ValueError):
    """The storage cannot be opened, or it holds a study this search cannot continue; one line."""


def open_storage(storage: str, *, create: bool = True) -> optuna.storages.BaseStorage:
    """The storage a budget's `storage` names: a Journal file for a path, an RDBStorage for a URL."""
    if "://" in storage:
        url = _with_driver(storage)
        for attempt in range(SCHEMA_ATTEMPTS):
            try:
                return optuna.storages.RDBStorage(url, engine_kwargs=_engine_kwargs(url))
            except Exception as exc:  # drivers raise their own types (ImportError, OperationalError, ...)
                # Workers started together on an empty database race to create Optuna's tables and types: the
                # loser's CREATE fails with "already exists". The creation checks first, so a retry finds them.
                if "already exists" in str(exc) and attempt + 1 < SCHEMA_ATTEMPTS:
                    time.sleep(0.5 * (attempt + 1))
                    continue
                raise StudyError(f"storage: cannot open {_redact(storage)}: {one_line(exc)}") from None
    path = Path(storage).expanduser()
    if not create and not path.is_file():
        raise StudyError(f"storage: {storage} does not exist")
    try:
        if create:
            path.parent.mkdir(parents=True, exist_ok=True)
        return optuna.storages.JournalStorage(JournalFileBackend(str(path)))
    except OSError as exc:
        raise StudyError(f"storage: cannot open the journal file {storage}: {exc.strerror}") from None


def open_study(settings: Settings, *, now: float) -> tuple[optuna.Study, float]:
    """The study of `settings` and its deadline (unix seconds), created at `now` or resumed.

    At creation the deadline is `now + hours` and the warm starts are enqueued; a resumed study keeps both its own
    deadline and its own queue. A study of the same name that minimizes (or has several objectives) is refused.
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
            previous = 0
        else:
            deadline = now + settings.hours * 3600.0
            study.set_user_attr(DEADLINE_ATTR, deadline)
            study.set_user_attr("hours", settings.hours)
            for recipe in settings.warm_starts:
                study.enqueue_trial(
                    space.warm_start_params(recipe["params"], settings.space), user_attrs={"recipe": recipe["name"]}
                )
            return study, deadline
    study = optuna.load_study(storage=storage, study_name=settings.study_name, sampler=sampler, pruner=pruner)
    if len(study.directions) != 1 or study.direction != optuna.study.StudyDirection.MAXIMIZE:
        directions = [d.name.lower() for d in study.directions]
        raise StudyError(
            f"study_name: the study {settings.study_name!r} in {_redact(settings.storage)} optimizes {directions}, "
            "not maximize; pick another --study-name"
        )
    if DEADLINE_ATTR not in study.user_attrs and not _wait_for_deadline(study):
        raise StudyError(f"study_name: the study {settings.study_name!r} was not created by this search (no deadline)")
    return study, float(study.user_attrs[DEADLINE_ATTR])


def _wait_for_deadline(study: optuna.Study, seconds: float = DEADLINE_WAIT_S) -> bool:
    """A worker that lost the race to create the study may load it before its creator stored the deadline (a moment
    later): wait a little for it rather than refuse the study. False when it never comes."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        time.sleep(0.1)
        if DEADLINE_ATTR in study.user_attrs:  # read from the storage at each access
            return True
    return False


def load_existing_study(settings: Settings) -> optuna.Study:
    """The study of `settings` for reading (the leaderboard); creates nothing."""
    storage = open_storage(settings.storage, create=False)
    if _existing_trials(storage, settings.study_name) is None:
        names = [s.study_name for s in storage.get_all_studies()]
        raise StudyError(f"study_name: no study {settings.study_name!r} in {_redact(settings.storage)}; it holds {names}")
    return optuna.load_study(storage=storage, study_name=settings.study_name)


def make_sampler(options: dict, *, offset: int = 0) -> optuna.samplers.BaseSampler:
    """The sampler of a `sampler` setting. `offset` shifts the seed: a resumed study (offset = its trial count) would
    otherwise replay the random draws of its first trials."""
    kwargs = {k: v for k, v in options.items() if k != "type"}
    if kwargs.get("seed") is not None:
        kwargs["seed"] = kwargs["seed"] + offset
    with warnings.catch_warnings():  # `group` is experimental; budget.yaml says so where it is set
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        cls, _ = SAMPLERS[options["type"]]
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


# Seconds to wait for a database server before giving up: an unreachable host (a firewall that drops packets) would
# otherwise hang the start for minutes (the driver's default is the operating system's TCP timeout).
CONNECT_TIMEOUT_S = 10


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
    raise StudyError(f"storage: no PostgreSQL driver for {_redact(url)}: pip install psycopg2-binary")


def _engine_kwargs(url: str) -> dict:
    scheme = url.split("://", 1)[0].split("+", 1)[0].lower()
    if scheme in ("postgresql", "postgres", "mysql", "mariadb"):
        return {"connect_args": {"connect_timeout": CONNECT_TIMEOUT_S}}
    return {}


def _redact(url: str) -> str:
    """A storage URL without its password, for messages."""
    if "://" not in url or "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    credentials, host = rest.rsplit("@", 1)
    return f"{scheme}://{credentials.split(':', 1)[0]}:***@{host}"
