"""The search's settings: `budget.yaml` read, checked and frozen, and the box it points at checked.

Every key is documented in `budget.yaml`, where it is declared. Every key is required (the file is the defaults), and
every error names its key path, e.g. "space.learning_rate_lora.low: must be > 0 (the range is log-uniform)".
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import math
import os
import re
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import optuna
import yaml

from search import space as space_module
from trainer.config import ConfigError, TrialConfig

# Samplers and pruners a budget may name; their other keys are the class's keyword arguments.
SAMPLERS: dict[str, type] = {"tpe": optuna.samplers.TPESampler, "random": optuna.samplers.RandomSampler}
PRUNERS: dict[str, type] = {
    "median": optuna.pruners.MedianPruner,
    "percentile": optuna.pruners.PercentilePruner,
    "hyperband": optuna.pruners.HyperbandPruner,
    "none": optuna.pruners.NopPruner,
}
# TrialConfig fields that `fixed` may not set, and the key that sets them instead.
_MANAGED_FIELDS = {
    "model_path": "model_path",
    "train_path": "train_path",
    "ood_path": "ood_val_path",
    "output_dir": "runs_dir",
    "eval_every": "prune_every",
    "eval_rows": "prune_rows",
    "seed": "seed",
    "eval_seed": "seed",
    **{field: "space" for field in space_module.SEARCHED_FIELDS},
}
_PATH_KEYS = ("model_path", "train_path", "val_path", "ood_val_path", "submission_path", "runs_dir")


class SettingsError(ValueError):
    """A bad setting; the message names its key path and fits on one line."""


class BoxError(SettingsError):
    """The box does not hold what the settings point at (model, data, writable folders)."""


@dataclass(frozen=True)
class Settings:
    """Every budget.yaml key (documented there). Paths are absolute; `storage` is kept as written."""

    hours: float
    reserve_minutes: float
    round_min_minutes: float
    round_max_minutes: float
    gpus: int
    gpus_per_trial: int
    rounds_per_slot: int
    model_path: str
    train_path: str
    val_path: str
    ood_val_path: str
    submission_path: str
    runs_dir: str
    study_name: str
    storage: str
    ood_rows: int | None
    prune_rows: int
    prune_every: int
    val_rows: int
    eval_batch_size: int | None
    eval_static_cache: bool
    sampler: dict
    pruner: dict
    seed: int
    min_format_rate: float
    keep_rounds: int
    hang_minutes: float
    duration_prior_scale: float  # resolved for the device the rounds run on (a `{gpu, cpu}` mapping in the file)
    space: dict
    fixed: dict
    warm_starts: list[dict]


KEYS = tuple(f.name for f in dataclasses.fields(Settings))


def load_settings(
    path: str | os.PathLike,
    *,
    hours: float | str | None = None,
    storage: str | None = None,
    study_name: str | None = None,
) -> Settings:
    """Read and check a budget file; `hours` (a number, or the CLI's text), `storage` and `study_name` override the
    file's values."""
    raw = _read_yaml(Path(path))
    unknown = sorted(set(raw) - set(KEYS))
    if unknown:
        raise SettingsError(f"{unknown[0]}: unknown key in {path}; known keys: {list(KEYS)}")
    missing = [key for key in KEYS if key not in raw]
    if missing:
        raise SettingsError(f"{missing[0]}: missing in {path} (budget.yaml documents every key)")
    overrides = {"hours": hours, "storage": storage, "study_name": study_name}
    raw.update({key: value for key, value in overrides.items() if value is not None})

    values = {key: check(key, raw[key]) for key, check in _CHECKS.items()}
    values["space"] = _check_space(raw["space"])
    values["fixed"] = _check_fixed(raw["fixed"])
    values["warm_starts"] = _check_warm_starts(raw["warm_starts"], values["space"])
    values["gpus"] = _resolve_gpus(raw["gpus"])
    values["gpus_per_trial"] = _check_gpus_per_trial(raw["gpus_per_trial"], values["gpus"])
    values["duration_prior_scale"] = _resolve_prior_scale(raw["duration_prior_scale"], values["gpus"])
    settings = Settings(**values)
    _check_consistency(settings)
    return settings


def check_box(settings: Settings) -> None:
    """Check that the box holds what the settings point at, loading no model and decoding no image.

    The model folder must be a Qwen2-VL folder, the data folders must load as splits with `image`, `problem` and
    `solution` (every solution holding a gold count), and the submission's parent and the runs folder must be
    writable. Raises BoxError (one line).
    """
    from evaluator.data import DataError, load_split, validate_solutions  # late: `datasets` is slow to import

    import datasets

    _check_model_folder(Path(settings.model_path))
    bars_were_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # a parquet folder is converted with bars on stderr: a refusal is one line
    try:
        for key in ("train_path", "val_path", "ood_val_path"):
            try:
                split = load_split(getattr(settings, key))  # the folder and its columns; arrow is mapped, not read
                validate_solutions(split, getattr(settings, key))  # the solution column alone: no image decoded
            except DataError as exc:
                raise BoxError(f"{key}: {one_line(exc)}") from None
    finally:
        if bars_were_on:
            datasets.enable_progress_bars()
    submission = Path(settings.submission_path)
    if submission.exists() and not submission.is_dir():
        raise BoxError(f"submission_path: {submission} exists and is not a folder")
    _check_writable("submission_path", submission.parent, must_exist=True)
    _check_writable("runs_dir", Path(settings.runs_dir), must_exist=False)


# ---------------------------------------------------------------------------------------------------------- reading
class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads `1e-5` as a string (its floats need a dot); learning rates are written that way."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d[\d_]*(?:\.[\d_]*)?|\.\d[\d_]*)[eE][-+]?\d+$"),
    list("-+0123456789."),
)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise SettingsError(f"budget: cannot read {path}: {exc.strerror}") from None
    try:
        data = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or one_line(exc)
        raise SettingsError(f"budget: malformed YAML at {where}: {problem}") from None
    if not isinstance(data, dict):
        raise SettingsError(f"budget: {path} must hold a mapping of keys, got {type(data).__name__}")
    return data


# ---------------------------------------------------------------------------------------------------------- values
def _number(key: str, value: Any, *, low: float = -math.inf, high: float = math.inf, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SettingsError(f"{key}: must be a finite number, got {value!r}")
    if value < low or (low_open and value == low):
        raise SettingsError(f"{key}: must be {'>' if low_open else '>='} {low:g}, got {value!r}")
    if value > high:
        raise SettingsError(f"{key}: must be <= {high:g}, got {value!r}")
    return float(value)


def _integer(key: str, value: Any, *, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SettingsError(f"{key}: must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bounds = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise SettingsError(f"{key}: must be an integer {bounds}, got {value}")
    return value


def _boolean(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise SettingsError(f"{key}: must be true or false, got {value!r}")
    return value


def _optional(check: Callable[..., Any], **bounds: Any) -> Callable[[str, Any], Any]:
    return lambda key, value: None if value is None else check(key, value, **bounds)


def _text(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise SettingsError(f"{key}: must be a non-empty string, got {value!r}")
    return value


def _path(key: str, value: Any) -> str:
    # Relative paths are relative to the folder the search is started from.
    return os.path.abspath(os.path.expanduser(_text(key, value)))


def _minutes(key: str, value: Any) -> float:
    return _number(key, value, low=0)


def _hours(key: str, value: Any) -> float:
    if isinstance(value, str):  # --hours arrives as text; a string from YAML is as welcome
        try:
            value = float(value)
        except ValueError:
            raise SettingsError(f"{key}: must be a positive number of hours, got {value!r}") from None
    return _number(key, value, low=0, low_open=True)


def _factory(kinds: Mapping[str, type]) -> Callable[[str, Any], dict]:
    """The check of a sampler or pruner mapping: `type` plus keyword arguments of that class."""

    def check(key: str, value: Any) -> dict:
        if not isinstance(value, Mapping) or value.get("type") not in kinds:
            got = value.get("type") if isinstance(value, Mapping) else value
            raise SettingsError(f"{key}.type: must be one of {sorted(kinds)}, got {got!r}")
        cls = kinds[value["type"]]
        kwargs = {k: v for k, v in value.items() if k != "type"}
        known = [name for name in inspect.signature(cls).parameters if name != "self"]
        for name in kwargs:
            if name not in known:
                raise SettingsError(f"{key}.{name}: not an option of {cls.__name__}; options: {known}")
        try:  # the constructor is the authority on its values
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                cls(**kwargs)
        except (TypeError, ValueError) as exc:
            raise SettingsError(f"{key}: {cls.__name__}({kwargs}) fails: {one_line(exc)}") from None
        return dict(value)

    return check


_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "hours": _hours,
    "reserve_minutes": _minutes,
    "round_min_minutes": lambda k, v: _number(k, v, low=0, low_open=True),
    "round_max_minutes": lambda k, v: _number(k, v, low=0, low_open=True),
    **{key: _path for key in _PATH_KEYS},
    "study_name": _text,
    "storage": _text,
    "ood_rows": _optional(_integer, low=1),
    "prune_rows": lambda k, v: _integer(k, v, low=1),
    "prune_every": lambda k, v: _integer(k, v, low=0),
    "val_rows": lambda k, v: _integer(k, v, low=0),
    "eval_batch_size": _optional(_integer, low=1),
    "eval_static_cache": _boolean,
    "rounds_per_slot": lambda k, v: _integer(k, v, low=1),
    "sampler": _factory(SAMPLERS),
    "pruner": _factory(PRUNERS),
    "seed": lambda k, v: _integer(k, v, low=0, high=2**32 - 1),
    "min_format_rate": lambda k, v: _number(k, v, low=0, high=100),
    "keep_rounds": lambda k, v: _integer(k, v, low=0),
    "hang_minutes": lambda k, v: _number(k, v, low=0, low_open=True),
}


def _resolve_gpus(value: Any) -> int:
    if value == "auto":
        import torch  # late: only `auto` needs it; device_count() asks NVML and creates no CUDA context

        return torch.cuda.device_count()
    if isinstance(value, str):
        raise SettingsError(f"gpus: must be an integer >= 0 or 'auto', got {value!r}")
    return _integer("gpus", value, low=0)


def _check_gpus_per_trial(value: Any, gpus: int) -> int:
    per_trial = _integer("gpus_per_trial", value, low=1)
    if gpus == 0:  # CPU only: one round at a time, whatever the file says for GPUs
        return per_trial
    if per_trial > gpus:
        raise SettingsError(f"gpus_per_trial: {per_trial} is more than gpus ({gpus})")
    if gpus % per_trial:
        raise SettingsError(f"gpus_per_trial: {per_trial} does not divide gpus ({gpus}); a GPU would sit idle")
    return per_trial


def _resolve_prior_scale(value: Any, gpus: int) -> float:
    """One positive number, or {gpu: number, cpu: number}: the value for where the rounds run (gpus 0 = the CPU)."""
    key = "duration_prior_scale"
    if not isinstance(value, Mapping):
        return _number(key, value, low=0, low_open=True)
    if set(value) != {"gpu", "cpu"}:
        raise SettingsError(f"{key}: a mapping must have exactly the keys gpu and cpu, got {sorted(map(str, value))}")
    scales = {device: _number(f"{key}.{device}", value[device], low=0, low_open=True) for device in ("gpu", "cpu")}
    return scales["gpu" if gpus else "cpu"]


def _check_space(value: Any) -> dict:
    try:
        return space_module.check_space(value)
    except space_module.SpaceError as exc:
        raise SettingsError(f"space.{exc.key}: {exc.message}".replace("space.: ", "space: ")) from None


def _check_fixed(value: Any) -> dict:
    if not isinstance(value, Mapping):
        raise SettingsError(f"fixed: must be a mapping of TrialConfig options, got {value!r}")
    fields = {f.name for f in dataclasses.fields(TrialConfig)}
    for name in value:
        if name in _MANAGED_FIELDS:
            owner = _MANAGED_FIELDS[name]
            raise SettingsError(f"fixed.{name}: set by the key {owner!r}, not in fixed")
        if name not in fields:
            raise SettingsError(f"fixed.{name}: not a TrialConfig option; options: {sorted(fields - set(_MANAGED_FIELDS))}")
    try:
        TrialConfig(model_path="-", train_path="-", output_dir="-", **value)
    except ConfigError as exc:
        raise SettingsError(f"fixed.{exc}") from None
    return copy.deepcopy(dict(value))


def _check_warm_starts(value: Any, space: dict) -> list[dict]:
    if not isinstance(value, list):
        raise SettingsError(f"warm_starts: must be a list of {{name, params}}, got {value!r}")
    names = set()
    for i, entry in enumerate(value):
        key = f"warm_starts[{i}]"
        if not isinstance(entry, Mapping) or set(entry) != {"name", "params"}:
            raise SettingsError(f"{key}: must have exactly the keys name and params, got {entry!r}")
        name = _text(f"{key}.name", entry["name"])
        if name in names or name in (space_module.SAMPLED, space_module.BASE):
            raise SettingsError(
                f"{key}.name: {name!r} is taken (names are unique; 'sampled' marks sampled trials, 'base' round 0)"
            )
        names.add(name)
        if not isinstance(entry["params"], Mapping):
            raise SettingsError(f"{key}.params: must be a mapping of TrialConfig options, got {entry['params']!r}")
        try:
            space_module.warm_start_params(entry["params"], space)
        except space_module.SpaceError as exc:
            raise SettingsError(f"{key}.params.{exc}") from None
    return copy.deepcopy(value)


def _check_consistency(settings: Settings) -> None:
    if settings.round_max_minutes < settings.round_min_minutes:
        raise SettingsError(
            f"round_max_minutes: must be >= round_min_minutes ({settings.round_min_minutes:g}), "
            f"got {settings.round_max_minutes:g}"
        )
    needed = settings.reserve_minutes + settings.round_min_minutes
    if settings.hours * 60 < needed:
        raise SettingsError(
            f"hours: {settings.hours:g} h leaves no room for one round: round_min_minutes "
            f"({settings.round_min_minutes:g}) + reserve_minutes ({settings.reserve_minutes:g}) = {needed:g} min"
        )


# ---------------------------------------------------------------------------------------------------------- the box
def _check_model_folder(folder: Path) -> None:
    config = folder / "config.json"
    if not folder.is_dir():
        raise BoxError(f"model_path: {folder} does not exist")
    if not config.is_file():
        raise BoxError(f"model_path: {folder} is not a model folder (no config.json)")
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError) as exc:
        raise BoxError(f"model_path: {config} is not a readable JSON object: {one_line(exc)}") from None
    if model_type != "qwen2_vl":
        raise BoxError(f"model_path: {folder} is not a Qwen2-VL folder (config.json model_type {model_type!r})")


def _check_writable(key: str, folder: Path, *, must_exist: bool) -> None:
    probe = folder
    if not must_exist:  # created later: its nearest existing ancestor must take it
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
    if not probe.is_dir():
        what = "does not exist" if not probe.exists() else "is not a folder"
        raise BoxError(f"{key}: {probe} {what}")
    try:  # a real write: os.access says yes to root even where writes fail (read-only mounts aside)
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as exc:
        raise BoxError(f"{key}: {probe} is not writable: {exc.strerror}") from None


def one_line(exc: BaseException) -> str:
    """An exception's message on one line: every error of the search's CLI is one stderr line."""
    return " ".join(str(exc).split())
