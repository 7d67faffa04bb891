"""The search's settings: `budget.yaml` read, checked and frozen, and the box it points at checked.

Every key is documented in `budget.yaml`, where it is declared. Every key is required (the file is the defaults), and
every error names its key path, e.g. "space.learning_rate_lora.low: must be > 0 (the range is log-uniform)". Values go
through the project's one validation layer (common/validation.py); values that end up in a round's TrialConfig are
checked by TrialConfig itself. Nothing here writes anything.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import json
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import optuna
import yaml

from search import space as space_module
from search.folders import inside, overlapping, study_folder, unwritable
from common import validation
from trainer.config import GPU_MEMORY_GB_MAX, ConfigError, TrialConfig
from common.validation import InvalidValue, show, show_key

# The budget files beside the package folders: an editable install (the README's) runs from the project itself.
BUDGET = Path(__file__).resolve().parents[1] / "budget.yaml"
DEMO_BUDGET = BUDGET.with_name("demo_budget.yaml")  # `--demo`: a small model and a synthetic box, on a CPU
HOURS_MAX = 168  # a week: longer than any search this project runs, short enough that every deadline is a real time
MINUTES_MAX = HOURS_MAX * 60  # the bound of every *_minutes key
GPUS_MAX = 64  # per box: more than any one machine holds
BUDGET_MAX_BYTES = 1 << 20  # budget.yaml is a few KB
# YAML values a budget may expand to, aliases counted at every use: budget.yaml has a few hundred, a "billion laughs"
# alias bomb a billion.
YAML_MAX_VALUES = 100_000
PATH_MAX = 4096  # Linux's PATH_MAX
STUDY_NAME_MAX = 128  # characters; RDB storages keep at most 512

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
    "gpu_memory_gb": "gpu_memory_gb",
    **{field: "space" for field in space_module.SEARCHED_FIELDS},
}
_PATH_KEYS = ("model_path", "train_path", "val_path", "ood_val_path", "submission_path", "runs_dir")


class SettingsError(InvalidValue):
    """A bad setting; `key` is its key path, the message one line."""


class BoxError(SettingsError):
    """The box does not hold what the settings point at (model, data, GPUs, writable folders)."""


def _integer_option(low: int, high: int) -> Callable[[str, Any], int]:
    return lambda key, value: validation.integer(key, value, low=low, high=high, error=SettingsError)


def _boolean_option(key: str, value: Any) -> bool:
    return validation.boolean(key, value, error=SettingsError)


def _percentile(key: str, value: Any) -> float:
    return validation.number(key, value, low=0, high=100, error=SettingsError)


def _max_resource(key: str, value: Any) -> int | str:
    if value == "auto":
        return value
    return validation.integer(key, value, low=1, high=10**9, error=SettingsError)


_SEED = _integer_option(0, 2**32 - 1)
_COUNT = _integer_option(0, 10**6)
_PRUNER_OPTIONS = {"n_startup_trials": _COUNT, "n_warmup_steps": _COUNT, "interval_steps": _integer_option(1, 10**6),
                   "n_min_trials": _integer_option(1, 10**6)}  # fmt: skip
# Samplers and pruners a budget may name, and the options it may give each, with their checks: Optuna's constructors
# check some ranges but not types (TPESampler(n_startup_trials="six") is built, and fails at the first ask). Options
# that take functions, and those Optuna deprecates (they warn), cannot be set from a budget.
SAMPLERS: dict[str, tuple[type, dict[str, Callable[[str, Any], Any]]]] = {
    "tpe": (optuna.samplers.TPESampler, {
        "seed": _SEED, "n_startup_trials": _COUNT, "n_ei_candidates": _integer_option(1, 10_000),
        "multivariate": _boolean_option, "group": _boolean_option, "constant_liar": _boolean_option,
    }),
    "random": (optuna.samplers.RandomSampler, {"seed": _SEED}),
}  # fmt: skip
PRUNERS: dict[str, tuple[type, dict[str, Callable[[str, Any], Any]]]] = {
    "median": (optuna.pruners.MedianPruner, _PRUNER_OPTIONS),
    "percentile": (optuna.pruners.PercentilePruner, {"percentile": _percentile, **_PRUNER_OPTIONS}),
    "hyperband": (optuna.pruners.HyperbandPruner, {
        "min_resource": _integer_option(1, 10**9), "max_resource": _max_resource,
        "reduction_factor": _integer_option(2, 100), "bootstrap_count": _integer_option(0, 10**6),
    }),
    "none": (optuna.pruners.NopPruner, {}),
}  # fmt: skip


@dataclass(frozen=True)
class MergeSettings:
    """budget.yaml's `merge` (documented there): the merge stage of search.merge.stage."""

    enabled: bool
    top_k: int
    etas: tuple[float, ...]
    held_out_share: float


MERGE_TOP_K_MAX = 16
MERGE_ETAS_MAX = 8
MERGE_ETA_MAX = 4.0  # past the soup by three times its change: further is no interpolation any more


def _check_merge(key: str, value: Any) -> MergeSettings:
    fields = [f.name for f in dataclasses.fields(MergeSettings)]
    validation.mapping(key, value, "merge stage options", error=SettingsError)
    unknown = validation.unknown_keys(value, fields)
    if unknown:
        name = unknown[0]
        raise SettingsError(f"{key}.{show_key(name)}", f"unknown key{validation.did_you_mean(name, fields)}")
    missing = [name for name in fields if name not in value]
    if missing:
        raise SettingsError(f"{key}.{missing[0]}", "missing (budget.yaml documents every key)")
    etas = value["etas"]
    if not isinstance(etas, list) or len(etas) > MERGE_ETAS_MAX:
        raise SettingsError(f"{key}.etas", f"must be a list of at most {MERGE_ETAS_MAX} numbers, got {show(etas)}")
    checked = tuple(_number(low=0, high=MERGE_ETA_MAX)(f"{key}.etas[{i}]", eta) for i, eta in enumerate(etas))
    if len(set(checked)) != len(checked):
        raise SettingsError(f"{key}.etas", f"each eta once, got {show(etas)}")
    return MergeSettings(
        enabled=validation.boolean(f"{key}.enabled", value["enabled"], error=SettingsError),
        top_k=_integer(low=1, high=MERGE_TOP_K_MAX)(f"{key}.top_k", value["top_k"]),
        etas=checked,
        held_out_share=float(validation.number(f"{key}.held_out_share", value["held_out_share"], low=0, high=1,
                                               low_open=True, high_open=True, error=SettingsError)),
    )


@dataclass(frozen=True)
class Settings:
    """Every budget.yaml key (documented there). Paths are absolute; `storage` is kept as written, but a file path's
    `~`, expanded here once for every file that goes next to it (the journal, the leaderboard, search.log)."""

    hours: float
    reserve_minutes: float
    round_min_minutes: float
    round_max_minutes: float
    gpus: int
    gpus_per_trial: int
    gpu_memory_gb: float | None
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
    merge: "MergeSettings"
    hang_minutes: float
    duration_prior_scale: float  # resolved for the device the rounds run on (a `{gpu, cpu}` mapping in the file)
    space: dict
    fixed: dict
    warm_starts: list[dict]

    @property
    def slots(self) -> list[list[int]]:
        """The GPU sets rounds run on side by side, each set rounds_per_slot times, round-robin so that rounds spread
        over the GPUs before they share one; one slot of no GPU on a CPU (one round at a time)."""
        if self.gpus == 0:
            return [[]]
        per = self.gpus_per_trial
        gpu_sets = [list(range(i * per, (i + 1) * per)) for i in range(self.gpus // per)]
        return [gpus for _ in range(self.rounds_per_slot) for gpus in gpu_sets]

    @property
    def rounds_dir(self) -> str:
        """The folder of this study's rounds, `runs_dir/<study name as a folder name>`: the only place the search
        deletes in or kills the processes of."""
        return os.path.join(self.runs_dir, study_folder(self.study_name))


KEYS = tuple(f.name for f in dataclasses.fields(Settings))


def load_settings(
    path: str | os.PathLike,
    *,
    hours: float | str | None = None,
    storage: str | None = None,
    study_name: str | None = None,
) -> Settings:
    """Read and check a budget file; `hours` (a number, or the CLI's text), `storage` and `study_name` override the
    file's values. Raises SettingsError, whatever the file holds."""
    raw = _read_budget(Path(path).expanduser())
    unknown = validation.unknown_keys(raw, KEYS)
    if unknown:
        name = unknown[0]
        raise SettingsError(show_key(name), f"unknown key in {path}{validation.did_you_mean(name, KEYS)}")
    missing = [key for key in KEYS if key not in raw]
    if missing:
        raise SettingsError(missing[0], f"missing in {path} (budget.yaml documents every key)")
    overrides = {"hours": _hours_text(hours), "storage": storage, "study_name": study_name}
    raw.update({key: value for key, value in overrides.items() if value is not None})

    values = {key: check(key, raw[key]) for key, check in _CHECKS.items()}
    values["space"] = _check_space(raw["space"])
    values["gpus"] = _resolve_gpus(raw["gpus"])
    values["gpus_per_trial"] = _check_gpus_per_trial(raw["gpus_per_trial"], values["gpus"])
    values["duration_prior_scale"] = _resolve_prior_scale(raw["duration_prior_scale"], values["gpus"])
    values["fixed"], managed = _check_fixed(raw["fixed"], raw)
    values.update(managed)
    values["warm_starts"] = _check_warm_starts(raw["warm_starts"], values["space"])
    settings = Settings(**values)
    _check_consistency(settings)
    _check_layouts(settings)
    return settings


def check_box(settings: Settings) -> None:
    """Check that the box holds what the settings point at, loading no model and decoding no image.

    The model folder must be a Qwen2-VL folder with whole weights, `gpus` at most the GPUs this machine shows, the
    data folders must load as splits with rows and the columns `image`, `problem` and `solution` (every solution
    holding a gold count), and the submission's parent and the runs folder must be writable; no two of the paths may
    be one folder or hold one another (`_check_overlaps`). Raises BoxError (one line), whatever the folders hold.
    """
    _check_overlaps(settings)
    with _box_guard("model_path"):
        _check_model_folder(Path(settings.model_path))
    if settings.gpus:
        with _box_guard("gpus"):
            _check_visible_gpus(settings.gpus)
    _check_splits(settings)
    with _box_guard("submission_path"):
        submission = Path(settings.submission_path)
        if submission.exists() and not submission.is_dir():
            raise BoxError("submission_path", f"{submission} exists and is not a folder")
        _check_writable("submission_path", submission.parent, must_exist=True)
        _check_lock_file(submission)
    with _box_guard("runs_dir"):
        _check_writable("runs_dir", Path(settings.rounds_dir), must_exist=False)


# ---------------------------------------------------------------------------------------------------------- reading
_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"


class _BudgetLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader without the YAML 1.1 surprises of a file a person edits, by one rule: what a person would not
    mean is refused, never read another way (budget.yaml's header says so):

    - `1e-5` is a float (YAML 1.1's floats need a dot; learning rates are written that way);
    - `7:30` and `020` are the texts "7:30" and "020", not the sexagesimal 450 nor the octal 16 (and then refused
      where a number is due);
    - a key given twice is an error (YAML 1.1 lets the last one win, silently), and so is a merge key (`<<:`), which
      would give a key a second value from elsewhere.

    Aliases are expanded only by reference, and the composed document is measured before it is built (see
    `get_single_node`), so an alias bomb is refused instead of filling the memory wherever it is walked.
    """

    yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_INT, _FLOAT)]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    def get_single_node(self) -> yaml.Node | None:
        node = super().get_single_node()
        if node is not None:
            _expanded_size(node, {}, set())
        return node

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise yaml.constructor.ConstructorError(None, None, "a merge key (<<) is not allowed: write each key "
                                                        "once, where it applies", key_node.start_mark)  # fmt: skip
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key: the base constructor refuses it
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {show(key)}", key_node.start_mark)
        return super().construct_mapping(node, deep)


# YAML 1.1's int and float patterns without their sexagesimal forms (`1:30`, `1:30.5`) and octal integers (`020`).
_BudgetLoader.add_implicit_resolver(
    _INT, re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"),
)  # fmt: skip
_BudgetLoader.add_implicit_resolver(
    _FLOAT,
    re.compile(r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?|\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?"
               r"|[-+]?(?:\d[\d_]*)[eE][-+]?\d+|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."),
)  # fmt: skip


class _TooLarge(Exception):
    pass


class _Recursive(Exception):
    pass


def _expanded_size(node: yaml.Node, sizes: dict[int, int], open_nodes: set[int]) -> int:
    """The number of values `node` stands for with every alias expanded (each node measured once)."""
    if id(node) in sizes:
        return sizes[id(node)]
    if id(node) in open_nodes:
        raise _Recursive
    open_nodes.add(id(node))
    size = 1
    if isinstance(node, yaml.SequenceNode):
        size += sum(_expanded_size(child, sizes, open_nodes) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        size += sum(_expanded_size(k, sizes, open_nodes) + _expanded_size(v, sizes, open_nodes) for k, v in node.value)
    open_nodes.discard(id(node))
    if size > YAML_MAX_VALUES:
        raise _TooLarge
    sizes[id(node)] = size
    return size


def _read_budget(path: Path) -> dict[Any, Any]:
    """The budget file's mapping; SettingsError (key `budget`) for a file that is not a UTF-8 YAML mapping."""
    try:
        if not path.exists():
            raise SettingsError("budget", f"cannot read {path}: no such file")
        if not path.is_file():  # a folder, a device, a FIFO (which would block the read forever)
            raise SettingsError("budget", f"{path} is not a file")
        size = path.stat().st_size
        if size > BUDGET_MAX_BYTES:
            raise SettingsError("budget", f"{path} is {size / 2**20:.1f} MB; a budget is a few KB")
        data = path.read_bytes()
    except SettingsError:
        raise
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        raise SettingsError("budget", f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark is what some editors write first
    except UnicodeDecodeError as exc:
        where = f"byte 0x{exc.object[exc.start]:02x} at offset {exc.start}"
        raise SettingsError("budget", f"{path} is not UTF-8 text ({where}); save it as UTF-8") from None
    if "\0" in text:  # valid UTF-8, but what UTF-16 looks like read as UTF-8
        where = f"a NUL character at offset {text.index(chr(0))}"
        raise SettingsError("budget", f"{path} is not UTF-8 text ({where}); save it as UTF-8")
    try:
        document = yaml.load(text, Loader=_BudgetLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or exc
        raise SettingsError("budget", f"malformed YAML at {where}: {problem}") from None
    except _TooLarge:
        raise SettingsError("budget", f"{path} expands to more than {YAML_MAX_VALUES} values (its YAML aliases); "
                                      "write them out") from None  # fmt: skip
    except _Recursive:
        raise SettingsError("budget", f"{path} holds a recursive alias (a YAML anchor used inside itself)") from None
    except RecursionError:
        raise SettingsError("budget", f"{path} is nested too deeply") from None
    if document is None:
        raise SettingsError("budget", f"{path} holds no keys (budget.yaml documents every key)")
    if not isinstance(document, dict):
        kind = type(document).__name__
        article = "an" if kind[0] in "aeiou" else "a"
        raise SettingsError("budget", f"{path} must hold a mapping of keys, got {article} {kind}")
    return document


# ---------------------------------------------------------------------------------------------------------- values
def _number(
    *, low: float | None = None, high: float | None = None, low_open: bool = False
) -> Callable[[str, Any], float]:
    return lambda key, value: float(validation.number(key, value, low=low, high=high, low_open=low_open,
                                                      error=SettingsError))  # fmt: skip


def _integer(*, low: int, high: int | None = None) -> Callable[[str, Any], int]:
    return lambda key, value: validation.integer(key, value, low=low, high=high, error=SettingsError)


def _optional(check: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
    return lambda key, value: None if value is None else check(key, value)


def _text(key: str, value: Any, max_length: int = PATH_MAX) -> str:
    return validation.text(key, value, max_length=max_length, error=SettingsError)


def _path(key: str, value: Any) -> str:
    # Relative paths are relative to the folder the search is started from.
    return os.path.abspath(os.path.expanduser(_text(key, value)))


def _storage(storage: str) -> str:
    return storage if "://" in storage else os.path.expanduser(storage)


def _hours_text(hours: float | str | None) -> float | None:
    """--hours arrives as text; a budget file's `hours` must be a YAML number."""
    if not isinstance(hours, str):
        return hours
    try:
        return float(hours)
    except ValueError:
        raise SettingsError("hours", f"must be a number of hours, got {show(hours)}") from None


def _hours(key: str, value: Any) -> float:
    hours = float(validation.number(key, value, low=0, low_open=True, error=SettingsError))
    if hours > HOURS_MAX:
        raise SettingsError(key, f"must be <= {HOURS_MAX} (a week), got {show(value)}")
    return hours


def _factory(kinds: Mapping[str, tuple[type, dict[str, Callable[[str, Any], Any]]]]) -> Callable[[str, Any], dict]:
    """The check of a sampler or pruner mapping: `type`, then the options of that class a budget may set."""

    def check(key: str, value: Any) -> dict:
        validation.mapping(key, value, "a type and its options", error=SettingsError)
        kind = value.get("type")
        if not isinstance(kind, str) or kind not in kinds:
            raise SettingsError(f"{key}.type", f"must be one of {sorted(kinds)}, got {show(kind)}")
        cls, options = kinds[kind]
        parameters = inspect.signature(cls).parameters
        kwargs = {}
        for name, option in value.items():
            if name == "type":
                continue
            where = f"{key}.{show_key(name)}"
            if name in options:
                kwargs[name] = options[name](where, option)
            elif name in parameters:
                options_text = f"options of {cls.__name__}: {sorted(options)}"
                raise SettingsError(where, f"not an option a budget can set; {options_text}")
            else:
                raise SettingsError(where, f"not an option of {cls.__name__}; options: {sorted(options)}")
        for name, parameter in parameters.items():
            if parameter.default is inspect.Parameter.empty and name not in kwargs:
                raise SettingsError(f"{key}.{name}", f"missing ({cls.__name__} needs it)")
        if kind in _BOUNDS:
            _BOUNDS[kind](key, kwargs, parameters)
        try:  # the constructor has the last word on its values, e.g. group needs multivariate
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                cls(**kwargs)
        except (TypeError, ValueError) as exc:
            raise SettingsError(key, f"{cls.__name__} refuses {show(kwargs)}: {exc}") from None
        return {"type": kind, **kwargs}

    return check


def _hyperband_resources(key: str, options: dict, parameters: Mapping[str, inspect.Parameter]) -> None:
    """Optuna's HyperbandPruner takes min_resource above an integer max_resource, and never prunes."""
    low = options.get("min_resource", parameters["min_resource"].default)
    high = options.get("max_resource", parameters["max_resource"].default)
    if isinstance(high, int) and low > high:
        raise SettingsError(f"{key}.min_resource", f"must be <= max_resource ({high}), got {low}: Hyperband would "
                                                   "never prune")  # fmt: skip


# Checks of a sampler's or pruner's options taken together, by its type.
_BOUNDS: dict[str, Callable[[str, dict, Mapping[str, inspect.Parameter]], None]] = {
    "hyperband": _hyperband_resources,
}

_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "hours": _hours,
    "reserve_minutes": _number(low=0, high=MINUTES_MAX),
    "round_min_minutes": _number(low=0, high=MINUTES_MAX, low_open=True),
    "round_max_minutes": _number(low=0, high=MINUTES_MAX, low_open=True),
    "hang_minutes": _number(low=0, high=MINUTES_MAX, low_open=True),
    **{key: _path for key in _PATH_KEYS},
    "study_name": lambda key, value: _text(key, value, STUDY_NAME_MAX),
    "storage": lambda key, value: _storage(_text(key, value)),
    "ood_rows": _optional(_integer(low=1)),
    "val_rows": _integer(low=0),
    "eval_batch_size": _optional(_integer(low=1, high=65536)),
    "eval_static_cache": lambda key, value: validation.boolean(key, value, error=SettingsError),
    "rounds_per_slot": _integer(low=1, high=GPUS_MAX),
    "gpu_memory_gb": _optional(_number(low=0, high=GPU_MEMORY_GB_MAX, low_open=True)),
    "sampler": _factory(SAMPLERS),
    "pruner": _factory(PRUNERS),
    "min_format_rate": _number(low=0, high=100),
    "keep_rounds": _integer(low=0),
    "merge": _check_merge,
}
# Checked by TrialConfig, as the fields they set: prune_every, prune_rows, seed (see _check_fixed).


def _resolve_gpus(value: Any) -> int:
    if value == "auto":
        import torch  # late: only `auto` needs it; device_count() asks NVML and creates no CUDA context

        return torch.cuda.device_count()
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= GPUS_MAX:
        raise SettingsError("gpus", f"must be an integer in [0, {GPUS_MAX}] or 'auto', got {show(value)}")
    return value


def _check_gpus_per_trial(value: Any, gpus: int) -> int:
    per_trial = validation.integer("gpus_per_trial", value, low=1, error=SettingsError)
    if gpus == 0:  # CPU only: one round at a time, whatever the file says for GPUs
        return per_trial
    if per_trial > gpus:
        raise SettingsError("gpus_per_trial", f"{per_trial} is more than gpus ({gpus})")
    if gpus % per_trial:
        raise SettingsError("gpus_per_trial", f"{per_trial} does not divide gpus ({gpus}); a GPU would sit idle")
    return per_trial


def _resolve_prior_scale(value: Any, gpus: int) -> float:
    """One positive number, or {gpu: number, cpu: number}: the value for where the rounds run (gpus 0 = the CPU)."""
    key = "duration_prior_scale"
    scale = _number(low=0, high=1000, low_open=True)
    if not isinstance(value, Mapping):
        return scale(key, value)
    if set(value) != {"gpu", "cpu"}:
        raise SettingsError(key, f"a mapping must have exactly the keys gpu and cpu, got {show(list(value))}")
    scales = {device: scale(f"{key}.{device}", value[device]) for device in ("gpu", "cpu")}
    return scales["gpu" if gpus else "cpu"]


def _check_space(value: Any) -> dict:
    try:
        return space_module.check_space(value)
    except space_module.SpaceError as exc:
        raise exc.under("space", SettingsError) from None


def _check_fixed(value: Any, raw: Mapping[str, Any]) -> tuple[dict, dict[str, int]]:
    """`fixed`, and the values of prune_every, prune_rows and seed: all checked by TrialConfig, with a stand-in for
    every searched option and path, as the fields they set in every round."""
    validation.mapping("fixed", value, "TrialConfig options", error=SettingsError)
    fields = {f.name for f in dataclasses.fields(TrialConfig)}
    for name in value:
        key = f"fixed.{show_key(name)}"
        if isinstance(name, str) and name in _MANAGED_FIELDS:
            raise SettingsError(key, f"set by the key {_MANAGED_FIELDS[name]!r}, not in fixed")
        if not isinstance(name, str) or name not in fields:
            options = sorted(fields - set(_MANAGED_FIELDS))
            hint = validation.did_you_mean(name, options)
            raise SettingsError(key, f"not a TrialConfig option{hint}; options: {options}")
    managed = {"eval_every": "prune_every", "eval_rows": "prune_rows", "seed": "seed", "eval_seed": "seed"}
    try:
        TrialConfig(model_path="-", train_path="-", output_dir="-", ood_path="-",
                    **{field: raw[key] for field, key in managed.items()}, **value)  # fmt: skip
    except ConfigError as exc:
        raise SettingsError(managed.get(exc.key) or f"fixed.{exc.key}", exc.message) from None
    return copy.deepcopy(dict(value)), {key: raw[key] for key in managed.values()}


def _check_warm_starts(value: Any, space: dict) -> list[dict]:
    if not isinstance(value, list):
        raise SettingsError("warm_starts", f"must be a list of {{name, params}}, got {show(value)}")
    names = set()
    for i, entry in enumerate(value):
        key = f"warm_starts[{i}]"
        if not isinstance(entry, Mapping) or set(entry) != {"name", "params"}:
            raise SettingsError(key, f"must have exactly the keys name and params, got {show(entry)}")
        name = _text(f"{key}.name", entry["name"], STUDY_NAME_MAX)
        if name in names or name in (space_module.SAMPLED, space_module.BASE):
            raise SettingsError(
                f"{key}.name", f"{name!r} is taken (names are unique; 'sampled' marks sampled trials, 'base' round 0)"
            )
        names.add(name)
        params = validation.mapping(f"{key}.params", entry["params"], "TrialConfig options", error=SettingsError)
        try:
            space_module.warm_start_params(params, space)
        except space_module.SpaceError as exc:
            raise exc.under(f"{key}.params", SettingsError) from None
    return copy.deepcopy(value)


def _check_consistency(settings: Settings) -> None:
    if settings.round_max_minutes < settings.round_min_minutes:
        raise SettingsError(
            "round_max_minutes",
            f"must be >= round_min_minutes ({settings.round_min_minutes:g}), got {settings.round_max_minutes:g}",
        )
    needed = settings.reserve_minutes + settings.round_min_minutes
    if settings.hours * 60 < needed:
        raise SettingsError(
            "hours",
            f"{settings.hours:g} h leaves no room for one round: round_min_minutes ({settings.round_min_minutes:g}) "
            f"+ reserve_minutes ({settings.reserve_minutes:g}) = {needed:g} min",
        )


def _check_layouts(settings: Settings) -> None:
    """Every group size a round may get (the space's, the warm starts') lays out over a round's processes: else every
    such round would fail in the trainer's batch_layout, minutes into the search."""
    if settings.gpus == 0 or settings.gpus_per_trial == 1:
        return
    prompts = settings.fixed.get("prompts_per_step", TrialConfig.prompts_per_step)
    groups = set(settings.space["num_generations"])
    groups |= {start["params"]["num_generations"] for start in settings.warm_starts
               if "num_generations" in start["params"]}  # fmt: skip
    for group in sorted(groups):
        if (prompts * group) % settings.gpus_per_trial:
            raise SettingsError(
                "gpus_per_trial",
                f"{settings.gpus_per_trial} processes cannot share a step's {prompts * group} completions "
                f"(prompts_per_step {prompts} x num_generations {group}); choose a divisor of it",
            )


# ---------------------------------------------------------------------------------------------------------- the box
@contextlib.contextmanager
def _box_guard(key: str) -> Iterator[None]:
    """Whatever a folder of the box holds, its check ends in a BoxError naming `key`, never a traceback."""
    try:
        yield
    except BoxError:
        raise
    except Exception as exc:  # noqa: BLE001 - filesystems and libraries raise many types; see the docstring
        raise BoxError(key, f"{type(exc).__name__}: {exc}") from None


# The paths of a box, by what the search does there: it replaces the submission, deletes in the runs folder, writes
# the journal file, and only reads the model and the data. The data splits may share a folder; no other two paths
# may be one folder or hold one another, or a promotion would move the model aside or the pruning delete a submission.
_READ_ONLY_PATHS = ("train_path", "val_path", "ood_val_path")


def _check_overlaps(settings: Settings) -> None:
    submission = settings.submission_path
    if os.path.realpath(submission) == os.path.realpath(os.sep):
        raise BoxError("submission_path", "is the filesystem root; name a folder of its own")
    paths = {key: getattr(settings, key) for key in ("submission_path", "runs_dir", "model_path", *_READ_ONLY_PATHS)}
    if "://" not in settings.storage:
        paths["storage"] = os.path.abspath(settings.storage)
    keys = list(paths)
    for i, key in enumerate(keys):
        for other in keys[i + 1:]:
            if key in _READ_ONLY_PATHS and other in _READ_ONLY_PATHS:
                continue
            if overlapping(paths[key], paths[other]):
                same = os.path.realpath(paths[key]) == os.path.realpath(paths[other])
                how = "is the same as" if same else "holds" if inside(paths[other], paths[key]) else "is inside"
                raise BoxError(key, f"{paths[key]} {how} {other} ({paths[other]}); give each its own place")


# Weights of a `save_pretrained` folder: one file, or shards named by an index.
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def _check_model_folder(folder: Path) -> None:
    config = folder / "config.json"
    if not folder.exists():
        raise BoxError("model_path", f"{folder} does not exist")
    if not folder.is_dir():
        raise BoxError("model_path", f"{folder} is not a folder")
    if not config.is_file():
        raise BoxError("model_path", f"{folder} is not a model folder (no config.json)")
    model_type = _json_object(config).get("model_type")
    if model_type != "qwen2_vl":
        raise BoxError("model_path", f"{folder} is not a Qwen2-VL folder (config.json model_type {show(model_type)})")
    _check_weights(folder)


def _check_weights(folder: Path) -> None:
    """The weights are there and whole: every shard an index names exists, every safetensors file's header covers
    the file (a truncated copy fails here rather than in every round)."""
    for name in _WEIGHT_INDEXES:
        index = folder / name
        if index.is_file():
            weight_map = _json_object(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise BoxError("model_path", f"{index} names no shards (no weight_map)")
            for shard in sorted({str(file) for file in weight_map.values()}):
                if not (folder / shard).is_file():
                    raise BoxError("model_path", f"{folder / shard} is missing (named by {name})")
                _check_weight_file(folder / shard)
            return
    for name in _WEIGHT_FILES:
        if (folder / name).is_file():
            _check_weight_file(folder / name)
            return
    raise BoxError("model_path", f"{folder} holds no weights ({' or '.join(_WEIGHT_FILES + _WEIGHT_INDEXES)})")


def _check_weight_file(path: Path) -> None:
    if path.suffix != ".safetensors":
        if path.stat().st_size == 0:
            raise BoxError("model_path", f"{path} is empty")
        return
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy"):  # reads the header and checks it against the file's size
            pass
    except SafetensorError as exc:
        raise BoxError("model_path", f"{path} is not a whole safetensors file: {exc}") from None


def _json_object(path: Path) -> dict:
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise BoxError("model_path", f"{path} is not a readable JSON object: {exc}") from None
    if not isinstance(data, dict):
        raise BoxError("model_path", f"{path} is not a readable JSON object: it holds {show(data)}")
    return data


def _check_visible_gpus(gpus: int) -> None:
    import torch  # late: only a GPU budget needs it; device_count() asks NVML and creates no CUDA context

    visible = torch.cuda.device_count()
    if gpus > visible:
        raise BoxError("gpus", f"{gpus}, but this machine shows {visible} GPUs (CUDA_VISIBLE_DEVICES, the driver)")


def _check_splits(settings: Settings) -> None:
    from evaluator.data import DataError, load_split, validate_solutions  # late: `datasets` is slow to import

    import datasets

    bars_were_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # a parquet folder is converted with bars on stderr: a refusal is one line
    try:
        for key in ("train_path", "val_path", "ood_val_path"):
            with _box_guard(key):
                try:
                    split = load_split(getattr(settings, key))  # the folder and its columns; arrow is mapped, not read
                    validate_solutions(split, getattr(settings, key))  # the solution column alone: no image decoded
                except DataError as exc:
                    raise BoxError(key, str(exc)) from None
    finally:
        if bars_were_on:
            datasets.enable_progress_bars()


def _check_lock_file(submission: Path) -> None:
    """The promotion locks a plain file next to the submission: a symlink there would have the search open (and
    create) whatever it points at."""
    from search.promotion import lock_path  # late: a budget's checks load without the promotion's imports

    lock = lock_path(submission)
    if lock.is_symlink():
        raise BoxError("submission_path", f"{lock} is a symlink; remove it (the search locks a plain file there)")
    if lock.exists() and not lock.is_file():
        raise BoxError("submission_path", f"{lock} is not a plain file; remove it (the search locks one there)")


def _check_writable(key: str, folder: Path, *, must_exist: bool) -> None:
    problem = unwritable(folder, must_exist=must_exist)
    if problem:
        raise BoxError(key, problem)
