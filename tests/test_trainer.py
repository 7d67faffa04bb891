"""One GRPO round end to end on the tiny model (CPU): launched as the search launches it, stopped, failed.

Kept lean for a 2-core machine: 56x56 images, 2 generations of 16 tokens, 1-3 steps per round. The tiny random
model never produces a parsable answer, so the rounds that must show learning add a test-only reward that varies
between completions (`token_parity`), registered by a small launcher script before the trainer's own main().
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rewardkit import token_parity

REPO = Path(__file__).resolve().parents[1]
LAUNCH = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_machines", "1",
          "--mixed_precision", "no", "--dynamo_backend", "no"]  # fmt: skip
PROGRESS_FIELDS = {
    "step", "seconds", "rewards", "reward", "reward_std", "kl", "completion_length", "format_rate", "learning_rate",
}  # fmt: skip
# Two workers on two cores: one thread each, or they fight over the cores.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}

# A launcher that registers a reward which varies between random completions (so the policy gets a gradient),
# then runs the trainer's real entry point.
LAUNCHER = f"""
import sys
sys.path[:0] = [{str(REPO)!r}, {str(REPO / "tests")!r}]
from rewardkit import token_parity
from trainer import rewards

rewards.REWARDS["token_parity"] = token_parity
from trainer.__main__ import main
sys.exit(main())
"""


@pytest.fixture(scope="module")
def splits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from synthetic.splits import write_split

    root = tmp_path_factory.mktemp("splits")
    return {
        "train": write_split(root / "train", "train", 16, seed=0, image_size=(56, 56), count_range=(1, 4)),
        "ood": write_split(root / "ood", "other", 4, seed=1, image_size=(56, 56), count_range=(1, 4)),
    }


@pytest.fixture(scope="module")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("launcher") / "launch_with_test_reward.py"
    path.write_text(LAUNCHER)
    return path


def write_trial(folder: Path, model: Path, splits: dict[str, Path], **overrides) -> Path:
    config = {
        "model_path": str(model),
        "train_path": str(splits["train"]),
        "output_dir": str(folder / "run"),
        "steps": 3,
        "num_generations": 2,
        "prompts_per_step": 1,
        "generation_steps": 1,
        "max_completion_length": 16,
        "max_pixels": 56 * 56,
        "lora_rank": 4,
        "learning_rate": 1e-2,
        **overrides,
    }
    path = folder / "trial.json"
    path.write_text(json.dumps(config))
    return path


def run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        print(result.stdout[-6000:], result.stderr[-6000:], sep="\n")
    return result


def read_status(out: Path) -> dict:
    return json.loads((out / "status.json").read_text())


def read_progress(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "progress.jsonl").read_text().splitlines()]


def load_merged(path: Path):
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration.from_pretrained(path), AutoProcessor.from_pretrained(path)


def changed_weights(base_dir: Path, merged_dir: Path) -> list[str]:
    base, _ = load_merged(base_dir)
    merged, _ = load_merged(merged_dir)
    merged_state = merged.state_dict()
    return [name for name, tensor in base.state_dict().items() if not torch.equal(tensor, merged_state[name])]


# ------------------------------------------------------------------------------------------- configuration
@pytest.mark.parametrize("value", [None, True, False, 1, 2, 28])
def test_gradient_checkpointing_takes_a_switch_or_a_layer_interval(value):
    from trainer.config import TrialConfig

    assert TrialConfig(model_path="m", train_path="t", output_dir="o", gradient_checkpointing=value)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("gradient_checkpointing", "yes", "must be true, false, null or a layer interval in [1, 1024], got 'yes'"),
        ("gradient_checkpointing", 0, "must be true, false, null or a layer interval"),
        ("gradient_checkpointing", -2, "must be true, false, null or a layer interval"),
        ("gradient_checkpointing", 2.0, "must be true, false, null or a layer interval"),
        ("gradient_checkpointing", 4096, "must be true, false, null or a layer interval"),
        ("liger_kernels", "yes", "must be true or false, got 'yes'"),
        ("liger_kernels", 1, "must be true or false, got 1"),
        ("liger_kernels", None, "must be true or false, got None"),
        ("compile_training", None, "must be true or false, got None"),
    ],
)
def test_speed_options_refuse_what_they_cannot_mean(option, value, message):
    import re

    from trainer.config import ConfigError, TrialConfig

    with pytest.raises(ConfigError, match="^" + re.escape(f"{option}: {message}")):
        TrialConfig(model_path="m", train_path="t", output_dir="o", **{option: value})


def test_batched_vision_attention_is_true_or_false_and_off_by_default(tmp_path):
    from trainer.config import ConfigError, TrialConfig

    paths = dict(model_path="m", train_path="t", output_dir="o")
    assert TrialConfig(**paths).batched_vision_attention is False
    for value in (True, False):
        TrialConfig(**paths, batched_vision_attention=value).to_json(tmp_path / "trial.json")
        assert TrialConfig.from_json(tmp_path / "trial.json").batched_vision_attention is value
    for bad in ("yes", 1, None):
        with pytest.raises(ConfigError, match="^batched_vision_attention: must be true or false"):
            TrialConfig(**paths, batched_vision_attention=bad)


def test_bad_config_exits_2_with_one_line(tmp_path, tiny_model_dir, splits):
    bad_path = write_trial(tmp_path, tmp_path / "no_model", splits)
    result = run([sys.executable, "-m", "trainer", "--config", str(bad_path)], timeout=60)
    assert result.returncode == 2
    assert "model_path" in result.stderr and len(result.stderr.strip().splitlines()) == 1

    # 1 prompt x 3 generations cannot split over 2 processes: caught before anything is loaded.
    odd = write_trial(tmp_path, tiny_model_dir, splits, num_generations=3)
    result = subprocess.run(
        [sys.executable, "-m", "trainer", "--config", str(odd)],
        cwd=REPO, env={**ENV, "WORLD_SIZE": "2"}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and "prompts_per_step" in result.stderr
    assert not (tmp_path / "run").exists()


def test_train_prompts_carry_image_and_phrasing(tmp_path, tiny_model_dir, splits):
    from evaluator.data import load_split
    from evaluator.protocol import EVAL_TEMPLATE, INHERITED_TEMPLATE, format_prompt
    from trainer.config import TrialConfig
    from trainer.data import build_train_dataset

    def texts(phrasing: str, **extra) -> list[str]:
        config = TrialConfig.from_json(write_trial(tmp_path, tiny_model_dir, splits, phrasing=phrasing, **extra))
        dataset = build_train_dataset(config)
        rows = [dataset[i] for i in range(len(dataset))]
        for row in rows:
            (turn,) = row["prompt"]  # one user turn, no system message
            assert turn["role"] == "user" and turn["content"][0] == {"type": "image"}
            assert row["image"].size == (56, 56) and row["solution"].startswith("<answer>")
        return [row["prompt"][0]["content"][1]["text"] for row in rows]

    problems = load_split(splits["train"])["problem"]
    assert texts("eval") == [format_prompt(p, EVAL_TEMPLATE) for p in problems]
    assert texts("inherited") == [format_prompt(p, INHERITED_TEMPLATE) for p in problems]
    mixed = texts("mix")
    assert mixed == texts("mix")  # seeded
    assert all(t in (format_prompt(p, EVAL_TEMPLATE), format_prompt(p, INHERITED_TEMPLATE))
               for t, p in zip(mixed, problems))  # fmt: skip
    assert {" First output " in t for t in mixed} == {True, False}
    subset = texts("mix", train_rows=5)
    assert len(subset) == 5 and set(subset) <= set(mixed)


def test_training_images_are_the_verifiers_pixels(tmp_path, tiny_model_dir):
    from transformers import AutoProcessor

    from evaluator.data import load_split
    from evaluator.generation import build_inputs
    from synthetic.splits import write_split
    from trainer.config import TrialConfig
    from trainer.data import build_train_dataset
    from trainer.round import _training_processor

    # 90x62: not multiples of 28, so both paths resize.
    split = write_split(tmp_path / "odd", "train", 2, seed=0, image_size=(90, 62), count_range=(1, 2))
    config = TrialConfig.from_json(write_trial(tmp_path, tiny_model_dir, {"train": split}, max_pixels=401408))
    trained = build_train_dataset(config)[0]
    training = _training_processor(config).image_processor(images=[trained["image"]], return_tensors="pt")
    verifier = build_inputs(AutoProcessor.from_pretrained(tiny_model_dir), [load_split(split)[0]])
    assert torch.equal(training["image_grid_thw"], verifier["image_grid_thw"])
    assert torch.equal(training["pixel_values"], verifier["pixel_values"])


def test_a_generation_batch_decodes_each_image_once(tmp_path, tiny_model_dir, splits, monkeypatch):
    import numpy as np

    from evaluator.data import load_split
    from trainer import data
    from trainer.config import TrialConfig

    config = TrialConfig.from_json(write_trial(tmp_path, tiny_model_dir, splits))
    dataset = data.build_train_dataset(config)
    decoded = []
    decode = data.datasets.Image.decode_example
    monkeypatch.setattr(data.datasets.Image, "decode_example",
                        lambda self, value, **kw: decoded.append(1) or decode(self, value, **kw))
    batch = [index for index in (0, 1, 2) for _ in range(4)]  # TRL's order: each prompt num_generations times
    first = dataset.__getitems__(batch)
    again = dataset.__getitems__(batch)  # the next optimizer steps of the same generation batch
    assert len(decoded) == 3
    stored = load_split(splits["train"])
    for row, index in zip(first + again, batch + batch):
        assert np.array_equal(np.asarray(row["image"]), np.asarray(stored[index]["image"]))  # 56x56: no resize

    monkeypatch.setattr(data, "IMAGE_CACHE_ROWS", 2)  # fewer rows than the batch holds: decoded again, still right
    small = data.build_train_dataset(config)
    decoded.clear()
    rows = small.__getitems__(batch) + small.__getitems__(batch)
    assert len(decoded) > 3
    assert all(np.array_equal(np.asarray(r["image"]), np.asarray(stored[i]["image"])) for r, i in zip(rows, batch * 2))


# ------------------------------------------------------------------------------------------- rollout replica
def test_replica_synced_from_a_fully_fine_tuned_policy_computes_what_it_computes(tiny_model_dir):
    from transformers import Qwen2VLForConditionalGeneration

    from trainer.rollout import RolloutReplica

    policy = Qwen2VLForConditionalGeneration.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    policy.model.visual.requires_grad_(False)  # as trainer.round trains it
    with torch.no_grad():  # a training step's worth of change in every trainable weight
        for parameter in policy.parameters():
            if parameter.requires_grad:
                parameter.add_(0.05 * torch.randn_like(parameter))
    replica = RolloutReplica(tiny_model_dir, torch.float32, torch.device("cpu"))
    assert replica.model.config.vision_config._attn_implementation == "sdpa"  # the batched attention: GPU default
    ids = torch.randint(0, 3000, (2, 12))
    with torch.no_grad():
        stale = replica.model(input_ids=ids).logits
        replica.sync_from(policy)
        synced = replica.model(input_ids=ids).logits
        expected = policy(input_ids=ids).logits
    assert not torch.allclose(stale, expected, atol=1e-3)  # the change matters, so the sync is what makes them equal
    assert torch.equal(synced, expected)
    storage = [p.data_ptr() for p in replica.model.parameters()]
    replica.sync_from(policy)
    assert [p.data_ptr() for p in replica.model.parameters()] == storage  # in place: a compiled step stays valid


def test_replica_synced_from_a_lora_policy_holds_the_merged_weights_and_leaves_the_base_alone(tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer
    from transformers import Qwen2VLForConditionalGeneration

    from trainer.rollout import RolloutReplica

    model = Qwen2VLForConditionalGeneration.from_pretrained(tiny_model_dir, dtype=torch.float32)
    # init_lora_weights=False: a random, non-zero B, so the adapter really changes the logits.
    config = LoraConfig(r=4, lora_alpha=8, target_modules=r"^(?:.*\.)?language_model\.(?:.*\.)?(?:q_proj|down_proj)$",
                        init_lora_weights=False)  # fmt: skip
    policy = get_peft_model(model, config).eval()
    layers = [m for m in policy.modules() if isinstance(m, LoraLayer)]
    base = [(layer.get_base_layer().weight, layer.get_base_layer().weight.detach().clone()) for layer in layers]
    replica = RolloutReplica(tiny_model_dir, torch.float32, torch.device("cpu"))
    ids = torch.randint(0, 3000, (2, 12))
    with torch.no_grad():
        plain = replica.model(input_ids=ids).logits
        replica.sync_from(policy)
        merged = replica.model(input_ids=ids).logits
        adapted = policy(input_ids=ids).logits
    assert not torch.allclose(plain, adapted, atol=1e-4)  # the adapter matters
    torch.testing.assert_close(merged, adapted, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(weight, original) for weight, original in base)  # the policy's base is untouched
    assert not any(layer.merged for layer in layers)


# ------------------------------------------------------------------------------------------- rounds
def test_lora_round_on_two_processes_trains_saves_and_reports(tmp_path, tiny_model_dir, splits, launcher):
    trial = write_trial(
        tmp_path, tiny_model_dir, splits,
        reward_weights={"token_parity": 1.0, "accuracy": 1.0}, beta=0.04, prompts_per_step=2, generation_steps=2,
        ood_path=str(splits["ood"]), eval_every=2, eval_rows=2,
    )  # fmt: skip
    out = tmp_path / "run"
    result = run([*LAUNCH, "--num_processes", "2", str(launcher), "--config", str(trial)])
    assert result.returncode == 0
    status = read_status(out)
    assert status["state"] == "completed" and status["steps_done"] == 3
    assert set(status["timings"]) == {"setup", "train", "save"}

    lines = read_progress(out)
    assert [line["step"] for line in lines] == [1, 2, 3]
    for line in lines:
        assert PROGRESS_FIELDS <= set(line)
        assert set(line["rewards"]) == {"token_parity", "accuracy"} and line["format_rate"] == 0.0
        assert line["kl"] is not None and line["completion_length"] > 0
    assert [("ood_accuracy" in line) for line in lines] == [False, True, False]
    assert 0.0 <= lines[1]["ood_accuracy"] <= 100.0

    merged = out / "merged"
    changed = changed_weights(tiny_model_dir, merged)
    assert changed, "training changed no weight"
    assert all("language_model" in name and name.split(".")[-2].endswith("proj") for name in changed)
    assert json.loads((merged / "config.json").read_text()) == json.loads((tiny_model_dir / "config.json").read_text())

    from evaluator import evaluate

    report = evaluate(merged, splits["ood"], limit=2, batch_size=2, max_new_tokens=16)  # short: a load check
    assert report["n"] == 2 and 0.0 <= report["accuracy_pct"] <= 100.0


def test_full_finetuning_round_on_two_processes_freezes_the_vision_tower(tmp_path, tiny_model_dir, splits, launcher):
    trial = write_trial(tmp_path, tiny_model_dir, splits, lora_rank=0, learning_rate=1e-3, steps=2,
                        reward_weights={"token_parity": 1.0})  # fmt: skip
    out = tmp_path / "run"
    result = run([*LAUNCH, "--num_processes", "2", str(launcher), "--config", str(trial)])
    assert result.returncode == 0
    assert read_status(out)["state"] == "completed"
    lines = read_progress(out)
    assert [line["step"] for line in lines] == [1, 2] and all(PROGRESS_FIELDS <= set(line) for line in lines)
    assert lines[0]["kl"] is None  # beta 0: TRL computes no KL
    changed = changed_weights(tiny_model_dir, out / "merged")
    assert any("language_model" in name for name in changed)
    assert not any("visual" in name for name in changed)
    load_merged(out / "merged")


@pytest.mark.parametrize("lora_rank", [4, 0], ids=["lora", "full"])
def test_train_vision_tower_trains_the_tower_and_the_language_model(tmp_path, tiny_model_dir, splits, lora_rank,
                                                                     monkeypatch):
    from trainer import rewards
    from trainer.config import ConfigError, TrialConfig
    from trainer.round import run_round

    monkeypatch.setitem(rewards.REWARDS, "token_parity", token_parity)
    # The LoRA round trains the tower through the batched vision attention (off by default on a CPU).
    trial = json.loads(write_trial(tmp_path, tiny_model_dir, splits, lora_rank=lora_rank, steps=2,
                                   learning_rate=1e-2 if lora_rank else 1e-3, prompts_per_step=2,
                                   reward_weights={"token_parity": 1.0}, train_vision_tower=True,
                                   batched_vision_attention=bool(lora_rank)).read_text())  # fmt: skip
    result = run_round(TrialConfig(**trial))
    assert result.state == "completed", result.reason
    changed = changed_weights(tiny_model_dir, tmp_path / "run" / "merged")
    assert any("language_model" in name for name in changed)
    assert any(".visual.blocks." in name for name in changed) and any(".visual.merger." in name for name in changed)
    if lora_rank:  # LoRA adapts linear layers only: the patch embedding (a Conv3d) and the norms stay as they were
        assert not any("patch_embed" in name or "norm" in name for name in changed)
    with pytest.raises(ConfigError, match="^train_vision_tower: must be true or false"):
        TrialConfig(**{**trial, "train_vision_tower": "yes"})


def test_stop_file_stops_every_process_after_one_step_and_saves(tmp_path, tiny_model_dir, splits):
    out = tmp_path / "run"
    out.mkdir()
    (out / "STOP").touch()  # present from the start: the round must still end within one step
    trial = write_trial(tmp_path, tiny_model_dir, splits, lora_rank=0, steps=50)
    result = run([*LAUNCH, "--num_processes", "2", "-m", "trainer", "--config", str(trial)])
    assert result.returncode == 0
    status = read_status(out)
    assert status["state"] == "stopped" and status["reason"] == "STOP file" and status["steps_done"] == 1
    assert len(read_progress(out)) == 1
    load_merged(out / "merged")


def test_sigterm_stops_a_single_process_round_and_saves(tmp_path, tiny_model_dir, splits):
    trial = write_trial(tmp_path, tiny_model_dir, splits, steps=500)
    out = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "-m", "trainer", "--config", str(trial)], cwd=REPO, env=ENV,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not ((out / "progress.jsonl").exists() and (out / "progress.jsonl").read_text()):
            assert process.poll() is None and time.monotonic() < deadline, "no progress line"
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 0, output[-6000:]
    status = read_status(out)
    assert status["state"] == "stopped" and status["reason"] == "SIGTERM"
    assert 1 <= status["steps_done"] <= 3 and status["steps_done"] == len(read_progress(out))
    load_merged(out / "merged")


@pytest.mark.parametrize(
    ("reward", "expected", "kind"),
    [
        (lambda completions, **kwargs: [float("inf")] * len(completions), "NaN", "nan"),
        (lambda completions, **kwargs: 1 / 0, "ZeroDivisionError", "error"),
    ],
    ids=["inf_reward", "raising_reward"],
)
def test_a_failing_round_writes_failed_status_with_the_reason(tmp_path, tiny_model_dir, splits, monkeypatch,
                                                              reward, expected, kind):  # fmt: skip
    from trainer import rewards
    from trainer.config import TrialConfig
    from trainer.round import run_round

    monkeypatch.setitem(rewards.REWARDS, "bad", reward)
    config = TrialConfig.from_json(write_trial(tmp_path, tiny_model_dir, splits, lora_rank=0,
                                               reward_weights={"bad": 1.0}))  # fmt: skip
    result = run_round(config)
    status = read_status(tmp_path / "run")
    assert result.state == status["state"] == "failed"
    assert result.kind == status["kind"] == kind
    assert status["reason"].startswith(expected) and status["steps_done"] <= 1
    assert not (tmp_path / "run" / "merged").exists()


def test_an_exception_becomes_a_failure_kind_and_a_reason():
    from trainer.failure import describe_exception
    from trainer.run_folder import FailureKind

    for exc in (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), MemoryError()):
        kind, reason = describe_exception(exc)
        assert kind == FailureKind.OUT_OF_MEMORY and reason.startswith(f"out of memory: {type(exc).__name__}")
    kind, reason = describe_exception(ValueError("bad reward"))
    assert kind == FailureKind.ERROR and reason.startswith("ValueError: bad reward")


def test_scoring_only_completion_positions_off_cuda_changes_nothing_in_a_round(tmp_path, tiny_model_dir,
                                                                               tiny_split_dir, monkeypatch):
    """Off CUDA a round's loss scores only the completion positions (trainer.cpu_loss, ~6x a step on a CPU); TRL's
    own path, every position, gives the same losses and weights."""
    from contextlib import nullcontext

    from safetensors.torch import load_file

    import trainer.round as round_module
    from trainer import rewards
    from trainer.config import TrialConfig
    from trainer.round import run_round
    from trainer.run_folder import MERGED_DIR

    monkeypatch.setitem(rewards.REWARDS, "token_parity", token_parity)

    def round_in(name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
        config = TrialConfig(
            model_path=str(tiny_model_dir), train_path=str(tiny_split_dir), output_dir=str(tmp_path / name),
            reward_weights={"token_parity": 1.0}, steps=2, learning_rate=1e-3, num_generations=4,
            prompts_per_step=2, generation_steps=1, max_completion_length=8, max_pixels=56 * 56,
            gradient_checkpointing=False, lora_rank=0, seed=0,
        )
        result = run_round(config)
        assert result.state == "completed", result.reason
        lines = (tmp_path / name / "progress.jsonl").read_text().splitlines()
        weights = load_file(tmp_path / name / MERGED_DIR / "model.safetensors")
        return [json.loads(line)["loss"] for line in lines], weights

    compact_losses, compact_weights = round_in("completions-only")
    with monkeypatch.context() as patch:
        patch.setattr(round_module, "completion_positions_only", nullcontext)  # TRL's own path off CUDA
        losses, weights = round_in("every-position")
    assert any(loss != 0 for loss in losses)  # the reward varied, so the loss trained something
    assert compact_losses == pytest.approx(losses, rel=1e-5, abs=1e-7)
    assert weights.keys() == compact_weights.keys()
    for name, tensor in weights.items():
        if name.endswith("k_proj.bias"):
            # Softmax ignores a shift shared by every key, so the key bias's gradient is zero but for rounding, and
            # AdamW turns that rounding into lr-sized steps: 2e-3 in both paths, apart by 2e-6 on this machine.
            continue
        torch.testing.assert_close(compact_weights[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def test_a_round_that_continues_another_starts_from_its_merged_weights(tmp_path, tiny_model_dir, tiny_split_dir,
                                                                        monkeypatch):
    """`init: best`: the search gives the child round its parent's merged folder as `model_path`; the child's policy
    starts from exactly those weights (not the base's), trains on, and saves a model loadable as the verifier loads it."""
    import trainer.round as round_module
    from trainer import rewards
    from trainer.config import TrialConfig
    from trainer.round import run_round
    from trainer.run_folder import MERGED_DIR

    monkeypatch.setitem(rewards.REWARDS, "token_parity", token_parity)
    started_from = {}
    load_model = round_module._load_model

    def recording_load(config, on_gpu):
        model = load_model(config, on_gpu)
        started_from[config.output_dir] = {name: t.detach().clone() for name, t in model.state_dict().items()}
        return model

    monkeypatch.setattr(round_module, "_load_model", recording_load)

    def round_from(model: Path, name: str, **options) -> Path:
        config = TrialConfig(
            model_path=str(model), train_path=str(tiny_split_dir), output_dir=str(tmp_path / name),
            reward_weights={"token_parity": 1.0}, steps=2, learning_rate=1e-2, num_generations=4, prompts_per_step=2,
            generation_steps=1, max_completion_length=8, max_pixels=56 * 56, seed=0, **options,
        )  # fmt: skip
        result = run_round(config)
        assert result.state == "completed", result.reason
        return tmp_path / name / MERGED_DIR

    parent = round_from(tiny_model_dir, "parent", lora_rank=4)
    child = round_from(parent, "child", lora_rank=0, gradient_checkpointing=False)

    parent_weights = load_merged(parent)[0].state_dict()  # as the verifier would load the parent's model
    start = started_from[str(tmp_path / "child")]
    base_start = started_from[str(tmp_path / "parent")]
    assert set(start) == set(parent_weights)
    for name, tensor in parent_weights.items():
        torch.testing.assert_close(start[name], tensor.to(start[name].dtype), rtol=0, atol=0, msg=name)
    assert any(not torch.equal(start[name], base_start[name]) for name in start)  # the parent trained something
    child_weights = load_merged(child)[0].state_dict()
    assert any(not torch.equal(child_weights[name], parent_weights[name]) for name in parent_weights)
    assert json.loads((child / "config.json").read_text()) == json.loads((tiny_model_dir / "config.json").read_text())


# ------------------------------------------------------------------------------------------- speed options
def test_liger_kernels_requested_off_cuda_fail_the_round_at_set_up(tmp_path, tiny_model_dir, splits):
    from trainer.config import TrialConfig
    from trainer.round import run_round

    config = TrialConfig.from_json(write_trial(tmp_path, tiny_model_dir, splits, liger_kernels=True))
    result = run_round(config)
    status = read_status(tmp_path / "run")
    assert result.state == status["state"] == "failed" and status["steps_done"] == 0
    assert status["reason"].startswith("ConfigError: liger_kernels: true needs liger-kernel's Triton kernels on CUDA")


def test_selective_checkpointing_survives_trls_no_grad_pass_and_defaults_resolve_off_cuda(
    tmp_path, tiny_model_dir, splits, monkeypatch
):
    """`gradient_checkpointing: 2` checkpoints the first of the tiny model's two decoder layers (the vision tower's two
    blocks come first: indices 2 and 3) in every gradient pass, although TRL re-enables checkpointing on every layer
    after each generation's no-grad log-probabilities; liger left at null is off on a CPU."""
    from trainer.config import TrialConfig
    from trainer.rollout import ReplicaGRPOTrainer
    from trainer.round import run_round

    flags: list[list[bool]] = []
    compute_loss = ReplicaGRPOTrainer.compute_loss

    def recording(self, model, inputs, *args, **kwargs):
        layers = self.accelerator.unwrap_model(model).base_model.model.model.language_model.layers
        flags.append([layer.gradient_checkpointing for layer in layers])
        return compute_loss(self, model, inputs, *args, **kwargs)

    monkeypatch.setattr(ReplicaGRPOTrainer, "compute_loss", recording)
    config = TrialConfig.from_json(write_trial(tmp_path, tiny_model_dir, splits, steps=2, gradient_checkpointing=2))
    result = run_round(config)
    assert result.state == "completed", result.reason
    assert result.settings == {"liger_kernels": False, "checkpoint_every": 2, "micro_batches": 1,
                               "estimated_peak_gb": None}  # fmt: skip
    assert flags == [[True, False], [True, False]]


def test_a_plan_of_two_micro_batches_trains_each_step_in_two_passes_of_half_the_completions(
    tmp_path, tiny_model_dir, splits, monkeypatch
):
    """The memory plan's micro-batches are TRL's gradient accumulation: a step's 4 completions (2 prompts x group 2)
    in 2 passes of 2, the same number of optimizer steps, the generation still covering whole steps."""
    from trainer import memory, round as round_module
    from trainer.config import TrialConfig
    from trainer.rollout import ReplicaGRPOTrainer

    passes: list[int] = []
    compute_loss = ReplicaGRPOTrainer.compute_loss

    def recording(self, model, inputs, *args, **kwargs):
        passes.append(int(inputs["completion_ids"].shape[0]))
        return compute_loss(self, model, inputs, *args, **kwargs)

    monkeypatch.setattr(ReplicaGRPOTrainer, "compute_loss", recording)
    monkeypatch.setattr(round_module, "memory_plan", lambda *args: memory.Plan(2, 0, None, True))
    config = TrialConfig.from_json(write_trial(tmp_path, tiny_model_dir, splits, steps=2, prompts_per_step=2,
                                               generation_steps=2))  # fmt: skip
    result = round_module.run_round(config)
    assert result.state == "completed", result.reason
    assert result.steps_done == 2 and result.settings["micro_batches"] == 2
    assert passes == [2, 2, 2, 2]


def test_liger_kernels_bind_to_the_policy_alone(tiny_model_dir):
    """liger's layer kernels go on the given model's modules; transformers' qwen2_vl module (and so every model built
    after, such as the rollout replica) keeps its own classes and rotary function. Binding only: Triton needs CUDA."""
    pytest.importorskip("liger_kernel")
    from transformers import Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl import modeling_qwen2_vl

    from trainer.kernels import apply_liger_kernels

    before = dict(vars(modeling_qwen2_vl))
    model = Qwen2VLForConditionalGeneration.from_pretrained(tiny_model_dir)
    apply_liger_kernels(model)
    layer = model.model.language_model.layers[0]
    assert "forward" in vars(layer.mlp) and "forward" in vars(layer.input_layernorm)
    assert "forward" in vars(model.model.visual.blocks[0].norm1)
    assert {name: value for name, value in vars(modeling_qwen2_vl).items() if before.get(name) is not value} == {}
    other = Qwen2VLForConditionalGeneration.from_pretrained(tiny_model_dir)
    assert "forward" not in vars(other.model.language_model.layers[0].mlp)
