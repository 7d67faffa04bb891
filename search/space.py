"""The search space: which TrialConfig options Optuna samples, within which bounds, and the round config built from them.

The space is define-by-run. Its parameter names are the study's vocabulary: the dashboard shows them, the sampler
models them, and warm starts are enqueued with them (`warm_start_params` translates a recipe written with
TrialConfig's names). Conditional options get distinct parameter names, so that every name keeps one distribution:

- `w_accuracy`, then `w_answer_format` when accuracy is weighted, else `w_answer_format_alone` whose choices exclude 0:
  the two are never both 0, by construction rather than by rejection;
- `use_kl`, then `beta` (log-uniform) only when the KL term is on, so beta = 0 (no reference model) is a real option;
- `lora_rank` (0 = full fine-tuning), then `lr_lora` or `lr_full`: LoRA wants ~10x the full fine-tuning rate, and one
  range for both would waste most samples.

`init` is the one searched option that is not a TrialConfig field: where the round starts, `base` (the base model) or
`best` (the merged model of the best scored round so far). The scheduler resolves it into the config's `model_path`
(`sampled_init`), since which round is best is known only when the round starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import optuna

from common import validation
from trainer.config import ConfigError, TrialConfig
from trainer.rewards import REWARDS
from common.validation import InvalidValue, show, show_key

if TYPE_CHECKING:
    from search.settings import Settings

# Options sampled from a list of choices (the YAML list is the choices, in order).
CHOICE_OPTIONS = ("num_generations", "lora_rank", "loss_type", "max_pixels", "phrasing")
# Options sampled from a range {low, high}: (parameter name, TrialConfig field, kind).
RANGE_OPTIONS = {
    "beta": ("beta", "beta", "log"),
    "learning_rate_lora": ("lr_lora", "learning_rate", "log"),
    "learning_rate_full": ("lr_full", "learning_rate", "log"),
    "temperature": ("temperature", "temperature", "float"),
    "steps": ("steps", "steps", "int"),
}
# Where a round starts: the base model, or the best scored round so far (population-based training's exploit step).
INITS = ("base", "best")
SPACE_KEYS = ("init", "reward_weights", *CHOICE_OPTIONS, *RANGE_OPTIONS)
# The rewards whose weights may not both be 0: without either, nothing pays the verifier's answer.
CORE_REWARDS = ("accuracy", "answer_format")
# TrialConfig fields a warm start may set; every other field comes from `fixed`, the prune settings or the paths.
SEARCHED_FIELDS = ("reward_weights", "beta", "learning_rate", "steps", "temperature", *CHOICE_OPTIONS)
# What a warm start's `params` may set: the searched TrialConfig fields, and `init`.
WARM_START_KEYS = ("init", *SEARCHED_FIELDS)
# The `recipe` user attribute of a trial: a warm start's name, SAMPLED, or BASE for round 0, which trains nothing and
# scores the base model (the fallback submission and the reference every round is compared with).
SAMPLED, BASE = "sampled", "base"
MERGE = "merge"  # the recipe of the merge stage's candidates (search.merge.stage)
# The answer_format weight's parameter when accuracy is 0: its choices exclude 0, so a distribution of its own.
ANSWER_FORMAT_ALONE = "w_answer_format_alone"


class SpaceError(InvalidValue):
    """A bad space or warm-start entry; `key` is its path below `space` (or below a warm start's `params`)."""


# ---------------------------------------------------------------------------------------------------------- sampling
def sample_config(trial: optuna.Trial, settings: "Settings", output_dir: str) -> TrialConfig:
    """The round configuration of `trial`: searched options from the trial, the rest from `settings`."""
    space = settings.space
    if "recipe" not in trial.user_attrs:  # enqueued warm starts carry their name; everything else was sampled
        trial.set_user_attr("recipe", SAMPLED)

    trial.suggest_categorical("init", space["init"])  # read back with sampled_init; see the module docstring
    lora_rank = trial.suggest_categorical("lora_rank", space["lora_rank"])
    lr_option = "learning_rate_lora" if lora_rank > 0 else "learning_rate_full"
    use_kl = trial.suggest_categorical("use_kl", [False, True])
    return TrialConfig(
        model_path=settings.model_path,
        train_path=settings.train_path,
        output_dir=str(output_dir),
        ood_path=settings.ood_val_path,
        reward_weights=_sample_reward_weights(trial, space["reward_weights"]),
        beta=_suggest_range(trial, "beta", space) if use_kl else 0.0,
        lora_rank=lora_rank,
        learning_rate=_suggest_range(trial, lr_option, space),
        steps=_suggest_range(trial, "steps", space),
        temperature=_suggest_range(trial, "temperature", space),
        num_generations=trial.suggest_categorical("num_generations", space["num_generations"]),
        loss_type=trial.suggest_categorical("loss_type", space["loss_type"]),
        max_pixels=trial.suggest_categorical("max_pixels", space["max_pixels"]),
        phrasing=trial.suggest_categorical("phrasing", space["phrasing"]),
        # The intermediate OOD score is what the pruner sees.
        eval_every=settings.prune_every,
        eval_rows=settings.prune_rows,
        # One seed for every round: rounds then differ by their configuration, not by their luck with data order.
        seed=settings.seed,
        eval_seed=settings.seed,
        gpu_memory_gb=settings.gpu_memory_gb,
        **settings.fixed,
    )


def sampled_init(trial: optuna.Trial) -> str:
    """Where the round of `trial` starts: "base" or "best" (see `INITS`)."""
    return trial.params.get("init", "base")


def with_steps(config: TrialConfig, steps: int) -> TrialConfig:
    """`config` with `steps` optimizer steps (the scheduler shortens a round to fit the time left)."""
    return config.replace(steps=steps)


def _sample_reward_weights(trial: optuna.Trial, choices: Mapping[str, list[float]]) -> dict[str, float]:
    weights = {"accuracy": trial.suggest_categorical(_reward_param("accuracy"), choices["accuracy"])}
    if weights["accuracy"] > 0:
        weights["answer_format"] = trial.suggest_categorical(_reward_param("answer_format"), choices["answer_format"])
    else:
        positive = [w for w in choices["answer_format"] if w > 0]
        weights["answer_format"] = trial.suggest_categorical(ANSWER_FORMAT_ALONE, positive)
    for name, options in choices.items():
        if name not in CORE_REWARDS:
            weights[name] = trial.suggest_categorical(_reward_param(name), options)
    return weights


def _reward_param(name: str) -> str:
    return f"w_{name}"


def choice_distributions(space: Mapping[str, Any]) -> dict[str, tuple[str, optuna.distributions.BaseDistribution]]:
    """Every categorical parameter `sample_config` suggests, with the key of the space that sets its choices. Optuna
    refuses a choice list other than the one a study first recorded for a name, so a resumed study is compared with
    these before anything is sampled (search.study)."""
    weights = space["reward_weights"]
    choices: dict[str, tuple[str, list[Any]]] = {
        "init": ("init", space["init"]),
        "use_kl": ("beta", [False, True]),
        **{option: (option, space[option]) for option in CHOICE_OPTIONS},
        **{_reward_param(name): (f"reward_weights.{name}", options) for name, options in weights.items()},
        ANSWER_FORMAT_ALONE: ("reward_weights.answer_format", [w for w in weights["answer_format"] if w > 0]),
    }
    categorical = optuna.distributions.CategoricalDistribution
    return {name: (key, categorical(values)) for name, (key, values) in choices.items()}


def _suggest_range(trial: optuna.Trial, option: str, space: Mapping[str, Any]) -> float | int:
    param, _, kind = RANGE_OPTIONS[option]
    bounds = space[option]
    if kind == "int":
        return trial.suggest_int(param, bounds["low"], bounds["high"], step=bounds.get("step", 1))
    return trial.suggest_float(param, bounds["low"], bounds["high"], log=kind == "log")


# ---------------------------------------------------------------------------------------------------------- warm starts
def warm_start_params(recipe: Mapping[str, Any], space: Mapping[str, Any]) -> dict[str, Any]:
    """The Optuna parameters of a recipe written with TrialConfig's names (e.g. `learning_rate`, `beta: 0`).

    Every value must lie in the space, so that the sampler's distributions contain the enqueued trial. Options the
    recipe leaves out are sampled; rewards it leaves out get weight 0.
    """
    unknown = validation.unknown_keys(recipe, WARM_START_KEYS)
    if unknown:
        searched = f"searched: {list(WARM_START_KEYS)} (set the others in fixed)"
        raise SpaceError(show_key(unknown[0]), f"not a searched option; {searched}")
    params: dict[str, Any] = {}
    if "init" in recipe:
        params["init"] = _in_choices("init", recipe["init"], space["init"], "space.init")
    if "reward_weights" in recipe:
        params.update(_reward_params(recipe["reward_weights"], space["reward_weights"]))
    if "beta" in recipe:
        params["use_kl"] = _number("beta", recipe["beta"]) != 0
        if params["use_kl"]:
            params["beta"] = _in_range("beta", recipe["beta"], "beta", space)
    if "learning_rate" in recipe and "lora_rank" not in recipe:
        raise SpaceError("learning_rate", "needs lora_rank: the LoRA and full fine-tuning rates are separate options")
    for option in CHOICE_OPTIONS:
        if option in recipe:
            params[option] = _in_choices(option, recipe[option], space[option], f"space.{option}")
    if "learning_rate" in recipe:
        option = "learning_rate_lora" if params["lora_rank"] > 0 else "learning_rate_full"
        params[RANGE_OPTIONS[option][0]] = _in_range("learning_rate", recipe["learning_rate"], option, space)
    for option in ("temperature", "steps"):
        if option in recipe:
            params[option] = _in_range(option, recipe[option], option, space)
    return params


def _reward_params(weights: Any, choices: Mapping[str, list[float]]) -> dict[str, Any]:
    if not isinstance(weights, Mapping):
        raise SpaceError("reward_weights", f"must map reward names to weights, got {show(weights)}")
    unknown = validation.unknown_keys(weights, choices)
    if unknown:
        raise SpaceError(f"reward_weights.{show_key(unknown[0])}", f"not in space.reward_weights {sorted(choices)}")
    values = {name: _number(f"reward_weights.{name}", weights.get(name, 0.0)) for name in choices}
    if values["accuracy"] == 0 and values["answer_format"] == 0:
        raise SpaceError("reward_weights", "accuracy and answer_format must not both be 0")
    params = {}
    for name, value in values.items():
        param = _reward_param(name)
        if name == "answer_format" and values["accuracy"] == 0:
            param = ANSWER_FORMAT_ALONE
        params[param] = _in_choices(f"reward_weights.{name}", value, choices[name], f"space.reward_weights.{name}")
    return params


def _in_choices(key: str, value: Any, choices: list[Any], where: str) -> Any:
    # The stored choice itself (e.g. 1.0 for a YAML 1), so the enqueued value is exactly one of the distribution's.
    for choice in choices:
        if type(choice) is type(value) or (validation.is_number(choice) and validation.is_number(value)):
            if choice == value:
                return choice
    raise SpaceError(key, f"{show(value)} is not one of {where} {choices}")


def _in_range(key: str, value: Any, option: str, space: Mapping[str, Any]) -> float | int:
    bounds = space[option]
    value = _number(key, value)
    if not bounds["low"] <= value <= bounds["high"]:
        raise SpaceError(key, f"{value} is outside space.{option} [{bounds['low']}, {bounds['high']}]")
    if RANGE_OPTIONS[option][2] == "int":
        step = bounds.get("step", 1)
        if value != int(value) or (int(value) - bounds["low"]) % step:
            raise SpaceError(key, f"{value} is not on the grid of space.{option} (low {bounds['low']}, step {step})")
        return int(value)
    return float(value)


# ---------------------------------------------------------------------------------------------------------- validation
def check_space(space: Any) -> dict[str, Any]:
    """The validated space (a copy, numbers normalized); raises SpaceError naming the key below `space`."""
    if not isinstance(space, Mapping):
        raise SpaceError("", f"must be a mapping of option -> bounds, got {show(space)}")
    unknown = validation.unknown_keys(space, SPACE_KEYS)
    if unknown:
        raise SpaceError(show_key(unknown[0]), f"unknown option; searched options: {list(SPACE_KEYS)}")
    missing = [key for key in SPACE_KEYS if key not in space]
    if missing:
        raise SpaceError(missing[0], "missing")
    checked: dict[str, Any] = {
        "init": _check_init(space["init"]),
        "reward_weights": _check_reward_weights(space["reward_weights"]),
    }
    for option in CHOICE_OPTIONS:
        checked[option] = _check_choices(option, space[option])
    for option in RANGE_OPTIONS:
        checked[option] = _check_range(option, space[option])
    return checked


def _check_init(choices: Any) -> list[str]:
    if not isinstance(choices, list) or not choices or any(choice not in INITS for choice in choices):
        raise SpaceError("init", f"must be a non-empty list of {list(INITS)}, got {show(choices)}")
    if len(set(choices)) != len(choices):
        raise SpaceError("init", f"has a repeated choice: {show(choices)}")
    return list(choices)


def _check_reward_weights(value: Any) -> dict[str, list[float]]:
    if not isinstance(value, Mapping) or not value:
        raise SpaceError("reward_weights", f"must map reward names to lists of weights, got {show(value)}")
    unknown = validation.unknown_keys(value, REWARDS)
    if unknown:
        raise SpaceError(f"reward_weights.{show_key(unknown[0])}", f"unknown reward; known: {sorted(REWARDS)}")
    for name in CORE_REWARDS:
        if name not in value:
            raise SpaceError(f"reward_weights.{name}", "missing (list [0.0] to switch it off)")
    checked = {}
    for name, choices in value.items():
        key = f"reward_weights.{name}"
        if not isinstance(choices, list) or not choices:
            raise SpaceError(key, f"must be a non-empty list of weights, got {show(choices)}")
        weights = [_number(f"{key}[{i}]", w) for i, w in enumerate(choices)]
        for i, w in enumerate(weights):
            if not 0 <= w <= 1e3:
                raise SpaceError(f"{key}[{i}]", f"must be in [0, 1000], got {w}")
        if len(set(weights)) != len(weights):
            raise SpaceError(key, f"has a repeated weight: {show(choices)}")
        checked[name] = [float(w) for w in weights]
    if 0 in checked["accuracy"] and not any(w > 0 for w in checked["answer_format"]):
        raise SpaceError("reward_weights.answer_format", "needs a weight > 0, since accuracy may be 0")
    return checked


def _check_choices(option: str, choices: Any) -> list[Any]:
    if not isinstance(choices, list) or not choices:
        raise SpaceError(option, f"must be a non-empty list of choices, got {show(choices)}")
    for i, choice in enumerate(choices):
        _check_config_value(f"{option}[{i}]", option, choice)
    if len(set(choices)) != len(choices):
        raise SpaceError(option, f"has a repeated choice: {show(choices)}")
    return list(choices)


def _check_range(option: str, bounds: Any) -> dict[str, Any]:
    _, field, kind = RANGE_OPTIONS[option]
    allowed = ("low", "high", "step") if kind == "int" else ("low", "high")
    if not isinstance(bounds, Mapping):
        raise SpaceError(option, f"must be a mapping with keys {list(allowed)}, got {show(bounds)}")
    unknown = validation.unknown_keys(bounds, allowed)
    if unknown:
        raise SpaceError(f"{option}.{show_key(unknown[0])}", f"unknown key; known: {list(allowed)}")
    for key in ("low", "high"):
        if key not in bounds:
            raise SpaceError(f"{option}.{key}", "missing")
    checked = {}
    for key, value in bounds.items():
        number = _number(f"{option}.{key}", value)
        if kind == "int" and number != int(number):
            raise SpaceError(f"{option}.{key}", f"must be an integer, got {show(value)}")
        checked[key] = int(number) if kind == "int" else float(number)
    if kind == "log" and checked["low"] <= 0:
        raise SpaceError(f"{option}.low", "must be > 0 (the range is log-uniform)")
    if checked["high"] < checked["low"]:
        raise SpaceError(f"{option}.high", f"must be >= low ({checked['low']})")
    if "step" in checked and checked["step"] < 1:
        raise SpaceError(f"{option}.step", "must be >= 1")
    for key in ("low", "high"):
        _check_config_value(f"{option}.{key}", field, checked[key])
    return checked


def _check_config_value(key: str, field: str, value: Any) -> None:
    """TrialConfig's own validation of one value: one definition of what the trainer accepts."""
    try:
        TrialConfig(model_path="-", train_path="-", output_dir="-", **{field: value})
    except ConfigError as exc:
        raise SpaceError(key, exc.message) from None


def _number(key: str, value: Any) -> float:
    return validation.number(key, value, error=SpaceError)
