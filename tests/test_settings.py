"""budget.yaml: the defaults load, every bad value is refused naming its key, the box is checked without loading."""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import pytest
import yaml

import faultkit
from search.settings import HOURS_MAX, BoxError, Settings, SettingsError, check_box, load_settings

ROOT = Path(__file__).resolve().parents[1]
BUDGET = ROOT / "budget.yaml"
DEMO_BUDGET = ROOT / "demo_budget.yaml"


def write_budget(folder: Path, changes: dict | None = None, removed: tuple[str, ...] = ()) -> Path:
    """budget.yaml with `changes` applied at dotted key paths ("space.beta.low") and `removed` keys dropped."""
    data = yaml.safe_load(BUDGET.read_text())
    for path, value in (changes or {}).items():
        *parents, last = path.split(".")
        node = data
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    for key in removed:
        del data[key]
    path = folder / "budget.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_defaults_load():
    settings = load_settings(BUDGET)
    assert isinstance(settings, Settings)
    assert settings.hours == 7.5 and settings.gpus == 2 and settings.gpus_per_trial == 1
    assert settings.model_path == "/app/models/Qwen2-VL-2B-Instruct"
    assert settings.submission_path == "/app/submission"
    assert Path(settings.runs_dir).is_absolute()
    assert settings.storage == "study.db" and settings.ood_rows is None
    assert settings.sampler["type"] == "tpe" and settings.pruner["type"] == "median"
    assert [w["name"] for w in settings.warm_starts] == ["strong", "baseline"]
    assert settings.space["learning_rate_lora"] == {"low": 3e-6, "high": 1e-4}


def test_demo_budget_has_the_same_keys_and_loads():
    assert set(yaml.safe_load(DEMO_BUDGET.read_text())) == set(yaml.safe_load(BUDGET.read_text()))
    settings = load_settings(DEMO_BUDGET)
    import torch

    assert settings.gpus == torch.cuda.device_count()  # gpus: auto
    assert settings.model_path.endswith("built/demo-counting-model")


@pytest.mark.parametrize("gpus, expected", [(0, 1.0), (2, 0.1)])
def test_duration_prior_scale_per_device(tmp_path, gpus, expected):
    budget = write_budget(tmp_path, {"gpus": gpus, "duration_prior_scale": {"gpu": 0.1, "cpu": 1.0}})
    assert load_settings(budget).duration_prior_scale == expected
    # One number serves both.
    assert load_settings(write_budget(tmp_path, {"gpus": gpus, "duration_prior_scale": 3})).duration_prior_scale == 3.0


def test_demo_prior_scale_follows_the_device():
    import torch

    assert load_settings(DEMO_BUDGET).duration_prior_scale == (0.1 if torch.cuda.device_count() else 1.0)


def test_overrides():
    settings = load_settings(BUDGET, hours=2.0, storage="postgresql://u@h/db", study_name="other")
    assert (settings.hours, settings.storage, settings.study_name) == (2.0, "postgresql://u@h/db", "other")
    assert load_settings(BUDGET, hours="3").hours == 3.0  # the CLI passes its text


@pytest.mark.parametrize("hours", [0, -1, math.nan, math.inf, "abc", "nan", "7.5", True, None, 168.5, 1e300])
def test_bad_hours_in_the_file(tmp_path, hours):
    with pytest.raises(SettingsError, match=r"^hours: "):
        load_settings(write_budget(tmp_path, {"hours": hours}))


@pytest.mark.parametrize("hours", [0, -2.0, math.nan, "x", "0", "-1", "7:30", "1e9", 169])
def test_bad_hours_override(hours):
    with pytest.raises(SettingsError, match=r"^hours: "):
        load_settings(BUDGET, hours=hours)


def test_hours_stop_at_a_week():
    assert load_settings(BUDGET, hours=HOURS_MAX).hours == 168
    with pytest.raises(SettingsError, match=r"^hours: must be <= 168 \(a week\), got 168.1$"):
        load_settings(BUDGET, hours="168.1")


def test_hours_must_leave_room_for_one_round():
    with pytest.raises(SettingsError, match=r"^hours: 0.5 h leaves no room for one round"):
        load_settings(BUDGET, hours=0.5)


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"reserve_minutes": -1}, r"reserve_minutes: must be in \[0, 10080\], got -1"),
        ({"round_min_minutes": 0}, r"round_min_minutes: must be in \(0, 10080\], got 0"),
        ({"round_max_minutes": 10}, "round_max_minutes: must be >= round_min_minutes"),
        ({"hang_minutes": "soon"}, "hang_minutes: must be a number, got 'soon'"),
        ({"gpus": -1}, r"gpus: must be an integer in \[0, 64\] or 'auto', got -1"),
        ({"gpus": "many"}, r"gpus: must be an integer in \[0, 64\] or 'auto', got 'many'"),
        ({"gpus_per_trial": 3}, "gpus_per_trial: 3 is more than gpus"),
        ({"gpus": 3, "gpus_per_trial": 2}, "gpus_per_trial: 2 does not divide gpus"),
        ({"gpus_per_trial": 0}, "gpus_per_trial: must be an integer >= 1"),
        ({"rounds_per_slot": 0}, r"rounds_per_slot: must be an integer in \[1, 64\]"),
        ({"duration_prior_scale": 0}, r"duration_prior_scale: must be in \(0, 1000\]"),
        ({"duration_prior_scale": {"gpu": 1.0}}, r"duration_prior_scale: a mapping must have exactly the keys gpu"),
        ({"duration_prior_scale": {"gpu": 1.0, "cpu": -2}}, "duration_prior_scale.cpu: must be in"),
        ({"model_path": ""}, "model_path: must be a non-empty string"),
        ({"study_name": None}, "study_name: must be a non-empty string"),
        ({"storage": 5}, "storage: must be a non-empty string"),
        ({"ood_rows": 0}, "ood_rows: must be an integer >= 1"),
        ({"prune_rows": 2.5}, "prune_rows: must be an integer"),
        ({"prune_every": -1}, r"prune_every: must be an integer in \[0, 1000000\]"),
        ({"eval_batch_size": 0}, r"eval_batch_size: must be an integer in \[1, 65536\]"),
        ({"eval_static_cache": "yes"}, "eval_static_cache: must be true or false"),
        ({"seed": -1}, "seed: must be an integer in"),
        ({"min_format_rate": 150}, r"min_format_rate: must be in \[0, 100\]"),
        ({"keep_rounds": -1}, "keep_rounds: must be an integer >= 0"),
        ({"sampler.type": "cmaes"}, "sampler.type: must be one of"),
        ({"sampler.n_startup": 3}, "sampler.n_startup: not an option of TPESampler"),
        ({"pruner.n_warmup_steps": -1}, "pruner.n_warmup_steps: must be an integer in"),
        ({"pruner": {"type": "percentile"}}, r"pruner.percentile: missing \(PercentilePruner needs it\)"),
        ({"sampler.n_startup_trials": "six"}, "sampler.n_startup_trials: must be an integer, got 'six'"),
        ({"sampler.gamma": "x"}, "sampler.gamma: not an option a budget can set"),
        ({"prune_rows": 10**7}, r"prune_rows: must be an integer in \[1, 1000000\]"),
        ({"fixed.lora_targets": "q_proj"}, "fixed.lora_targets: must be a non-empty list of module names"),
        ({"space.learning_rate_lora.low": 0}, "space.learning_rate_lora.low: must be > 0"),
        ({"space.beta.high": 0.0001}, "space.beta.high: must be >= low"),
        ({"space.beta.mid": 0.01}, "space.beta.mid: unknown key"),
        ({"space.steps.low": 10.5}, "space.steps.low: must be an integer"),
        ({"space.temperature.high": 3.0}, "space.temperature.high: must be in"),
        ({"space.num_generations": [1, 8]}, r"space.num_generations\[0\]: must be an integer in \[2, 256\]"),
        ({"space.num_generations": []}, "space.num_generations: must be a non-empty list"),
        ({"space.lora_rank": [0, 16, 16]}, "space.lora_rank: has a repeated choice"),
        ({"space.loss_type": ["ppo"]}, r"space.loss_type\[0\]: must be one of"),
        ({"space.max_pixels": [10]}, r"space.max_pixels\[0\]: must be an integer in"),
        ({"space.momentum": [0.9]}, "space.momentum: unknown option"),
        ({"space.reward_weights.bogus": [0.0]}, "space.reward_weights.bogus: unknown reward"),
        ({"space.reward_weights.brevity": [-1.0]}, r"space.reward_weights.brevity\[0\]: must be in \[0, 1000\]"),
        ({"space.reward_weights.answer_format": [0.0]}, "space.reward_weights.answer_format: needs a weight > 0"),
        ({"fixed.learning_rate": 1e-5}, "fixed.learning_rate: set by the key 'space'"),
        ({"fixed.eval_rows": 64}, "fixed.eval_rows: set by the key 'prune_rows'"),
        ({"fixed.output_dir": "x"}, "fixed.output_dir: set by the key 'runs_dir'"),
        ({"fixed.bogus": 1}, "fixed.bogus: not a TrialConfig option"),
        ({"fixed.prompts_per_step": 0}, "fixed.prompts_per_step: must be an integer in"),
        ({"warm_starts.0.params.learning_rate": 1.0}, r"warm_starts\[0\].params.learning_rate: 1.0 is outside"),
        ({"warm_starts.0.params.lora_rank": 32}, r"warm_starts\[0\].params.lora_rank: 32 is not one of"),
        ({"warm_starts.1.params.steps": 105}, r"warm_starts\[1\].params.steps: 105 is not on the grid"),
        ({"warm_starts.1.params.optimizer": "sgd"}, r"warm_starts\[1\].params.optimizer: not a searched option"),
        ({"warm_starts.1.params.reward_weights": {"brevity": 1.0}}, r"warm_starts\[1\].params.reward_weights: accur"),
        ({"warm_starts.1.name": "strong"}, r"warm_starts\[1\].name: 'strong' is taken"),
        ({"warm_starts.1": {"name": "x"}}, r"warm_starts\[1\]: must have exactly the keys name and params"),
    ],
)
def test_bad_values_name_their_key(tmp_path, changes, expected):
    with pytest.raises(SettingsError, match="^" + expected):
        load_settings(write_budget(tmp_path, changes))


def test_unknown_and_missing_keys(tmp_path):
    with pytest.raises(SettingsError, match=r"^hourz: unknown key"):
        load_settings(write_budget(tmp_path, {"hourz": 3}))
    with pytest.raises(SettingsError, match=r"^reserve_minutes: missing"):
        load_settings(write_budget(tmp_path, removed=("reserve_minutes",)))


def test_malformed_yaml_names_the_line(tmp_path):
    path = tmp_path / "budget.yaml"
    path.write_text("hours: 7.5\nspace: {beta: [1, 2\nseed: 0\n")
    with pytest.raises(SettingsError, match=r"^budget: malformed YAML at .*budget.yaml:\d+"):
        load_settings(path)
    path.write_text("- just\n- a list\n")
    with pytest.raises(SettingsError, match="must hold a mapping"):
        load_settings(path)
    with pytest.raises(SettingsError, match="cannot read"):
        load_settings(tmp_path / "absent.yaml")


def test_exponent_numbers_without_a_dot_are_floats(tmp_path):
    path = write_budget(tmp_path)
    path.write_text(path.read_text().replace("low: 3.0e-06", "low: 3e-6"))
    assert load_settings(path).space["learning_rate_lora"]["low"] == 3e-6


def test_what_a_budget_may_still_write(tmp_path):
    """Accepted on purpose: a UTF-8 byte-order mark, YAML anchors and aliases of a sane size, `yes` for true, and
    YAML 1.1's other numbers (0x10, 1_000); what the bad-input suite refuses is only what would mislead."""
    text = BUDGET.read_text()
    assert "    accuracy: [0.0, 1.0, 2.0]\n" in text and "    count_closeness: [0.0, 0.25, 0.5]\n" in text
    text = text.replace("    accuracy: [0.0, 1.0, 2.0]\n", "    accuracy: &weights [0.0, 1.0, 2.0]\n")
    text = text.replace("    count_closeness: [0.0, 0.25, 0.5]\n", "    count_closeness: *weights\n")
    text = text.replace("eval_static_cache: true", "eval_static_cache: yes")
    text = text.replace("prune_rows: 128", "prune_rows: 0x80")
    text = text.replace("val_rows: 500", "val_rows: 1_000")
    path = tmp_path / "budget.yaml"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    settings = load_settings(path)
    assert settings.space["reward_weights"]["count_closeness"] == [0.0, 1.0, 2.0]
    assert settings.eval_static_cache is True and settings.prune_rows == 128 and settings.val_rows == 1000


@pytest.mark.parametrize(
    "line, expected",
    [
        ("hours: 7:30", "hours: must be a number, got '7:30'"),  # YAML 1.1 would read 450
        ("hours: 7.5\nhours: 3", "budget: malformed YAML at .*:2: duplicate key 'hours'"),  # the last would win
        ("hours: &h [" + ", ".join(["&a0 [x, x, x, x, x, x, x, x, x, x]"]
                                   + [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]) + "]",
         "budget: .* expands to more than 100000 values"),  # a billion strings once walked
    ],
)  # fmt: skip
def test_yaml_that_would_mislead_is_refused(tmp_path, line, expected):
    path = write_budget(tmp_path)
    lines = [row for row in path.read_text().splitlines() if not row.startswith("hours:")]
    path.write_text(line + "\n" + "\n".join(lines) + "\n")
    with pytest.raises(SettingsError, match="^" + expected):
        load_settings(path)


def test_messages_are_one_line(tmp_path):
    with pytest.raises(SettingsError) as info:
        load_settings(write_budget(tmp_path, {"pruner.n_warmup_steps": -1}))
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------------------------------------------------- the box
@pytest.fixture()
def box(tmp_path, tiny_split_dir) -> Settings:
    model = faultkit.fake_model(tmp_path / "model")
    changes = {
        "gpus": 0,
        "model_path": str(model),
        "train_path": str(tiny_split_dir),
        "val_path": str(tiny_split_dir),
        "ood_val_path": str(tiny_split_dir),
        "submission_path": str(tmp_path / "app" / "submission"),
        "runs_dir": str(tmp_path / "runs" / "deeper"),
    }
    (tmp_path / "app").mkdir()
    return load_settings(write_budget(tmp_path, changes))


def test_check_box_accepts_a_good_box_and_writes_nothing(box, tmp_path):
    before = sorted(p.name for p in tmp_path.rglob("*"))
    check_box(box)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_check_box_refuses_a_model_that_is_not_qwen2_vl(box):
    Path(box.model_path, "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(BoxError, match=r"^model_path: .* is not a Qwen2-VL folder \(config.json model_type 'llama'\)"):
        check_box(box)
    Path(box.model_path, "config.json").unlink()
    with pytest.raises(BoxError, match=r"^model_path: .* is not a model folder \(no config.json\)"):
        check_box(box)


def test_check_box_refuses_missing_or_bad_data(box, tmp_path):
    import dataclasses

    with pytest.raises(BoxError, match=r"^train_path: "):
        check_box(dataclasses.replace(box, train_path=str(tmp_path / "absent")))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(BoxError, match=r"^ood_val_path: "):
        check_box(dataclasses.replace(box, ood_val_path=str(empty)))


def test_check_box_refuses_unwritable_places(box, tmp_path):
    import dataclasses

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(BoxError, match=r"^submission_path: .*a-file is not a folder"):
        check_box(dataclasses.replace(box, submission_path=str(blocker / "submission")))
    with pytest.raises(BoxError, match=r"^submission_path: .* does not exist"):
        check_box(dataclasses.replace(box, submission_path=str(tmp_path / "no" / "submission")))
    with pytest.raises(BoxError, match=r"^submission_path: .* exists and is not a folder"):
        check_box(dataclasses.replace(box, submission_path=str(blocker)))
    with pytest.raises(BoxError, match=r"^runs_dir: .*a-file is not a folder"):
        check_box(dataclasses.replace(box, runs_dir=str(blocker / "runs")))


def test_check_box_accepts_folders_whose_names_only_share_a_prefix(box, tmp_path):
    import dataclasses

    (tmp_path / "app" / "sub").mkdir()
    check_box(dataclasses.replace(box, submission_path=str(tmp_path / "app" / "sub"),
                                  runs_dir=str(tmp_path / "app" / "sub2"), storage=str(tmp_path / "app" / "sub3")))
    with pytest.raises(BoxError, match=r"^submission_path: .*/app/sub holds runs_dir \(.*/app/sub/2\)"):
        check_box(dataclasses.replace(box, submission_path=str(tmp_path / "app" / "sub"),
                                      runs_dir=str(tmp_path / "app" / "sub" / "2")))


def test_settings_are_frozen():
    settings = load_settings(BUDGET)
    with pytest.raises(Exception):
        settings.hours = 1.0  # type: ignore[misc]
    assert copy.deepcopy(settings) == settings


@pytest.mark.parametrize("name", ["../x", "/etc", "a/b", "a:b", "..", ".", "-", "x" * 128, "ünïcode", "a b", ".h"])
def test_a_study_name_never_takes_its_rounds_out_of_runs_dir(tmp_path, name):
    settings = load_settings(BUDGET, study_name=name)
    rounds = Path(settings.rounds_dir)
    assert rounds.parent == Path(settings.runs_dir) and rounds.name not in ("", ".", "..")
    assert re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9._-]*", rounds.name) and len(rounds.name) <= 100


def test_plain_study_names_keep_their_folder_and_others_get_distinct_ones():
    folders = {name: Path(load_settings(BUDGET, study_name=name).rounds_dir).name for name in ("a/b", "a:b", "a b")}
    assert len(set(folders.values())) == 3  # each unsafe name gets its own folder, never a shared one
    assert Path(load_settings(BUDGET, study_name="count-grpo_v2.1").rounds_dir).name == "count-grpo_v2.1"
