"""Gradient checkpointing chosen by memory (trainer.memory), and bench/grpo_profile.py's variants."""

from __future__ import annotations

import pytest

from trainer import memory
from trainer.memory import Footprint

GiB = 2**30
# The 2B model's layout: 32 vision blocks, then 28 decoder layers.
POSITIONS = tuple(range(32, 60))


def test_checkpointed_layers_follow_transformers_every_n_layers_over_all_checkpointable_layers():
    assert memory.checkpointed_layers(POSITIONS, 0) == 0
    assert memory.checkpointed_layers(POSITIONS, 1) == 28
    assert memory.checkpointed_layers(POSITIONS, 2) == 14
    assert memory.checkpointed_layers(POSITIONS, 3) == 9  # 33, 36, ..., 57
    assert memory.checkpointed_layers(POSITIONS, 100) == 0


def footprint(fixed_gib: float, tokens: int = 4008) -> Footprint:
    return Footprint(fixed_bytes=fixed_gib * GiB, tokens=tokens, hidden=1536, decoder_positions=POSITIONS)


def test_a_card_with_room_trains_without_checkpointing():
    assert memory.choose_interval(footprint(29.6), 139 * GiB) == 0


def test_a_card_without_room_for_any_plan_checkpoints_every_layer():
    assert memory.choose_interval(footprint(29.6), 24 * GiB) == 1


def test_in_between_the_fewest_checkpointed_layers_that_fit():
    fp = footprint(29.6, tokens=6656)
    card = 47.5 * GiB
    every = memory.choose_interval(fp, card)
    assert 1 < every < len(POSITIONS)
    assert memory.peak_bytes(fp, every) <= memory.HEADROOM * card
    fewer = memory.checkpointed_layers(POSITIONS, every)
    for other in range(0, 61):  # no interval checkpointing fewer layers fits
        if memory.checkpointed_layers(POSITIONS, other) < fewer:
            assert memory.peak_bytes(fp, other) > memory.HEADROOM * card


def test_more_checkpointed_layers_never_raise_the_estimate():
    fp = footprint(29.6)
    peaks = sorted((memory.checkpointed_layers(POSITIONS, n), memory.peak_bytes(fp, n)) for n in range(0, 61))
    assert all(a[1] >= b[1] for a, b in zip(peaks, peaks[1:]))


def test_the_estimate_reproduces_the_measured_2b_peaks():
    """Full fine-tuning of the 2B model, 8 completions of 245 + 256 tokens, H200 (bench/results/2026-12-03-h200.json):
    31.1 GiB with every layer checkpointed, 41.1 GiB with none."""
    import torch
    from transformers import Qwen2VLForConditionalGeneration

    from synthetic.models import build_config

    with torch.device("meta"):
        model = Qwen2VLForConditionalGeneration(build_config("2b"))
    model.model.visual.requires_grad_(False)
    fp = memory.footprint(model, lora_targets=None, lora_rank=0, per_device_completions=8, max_pixels=401408,
                          max_completion_length=256, reference_model=False)  # fmt: skip
    assert fp.decoder_positions == POSITIONS
    measured = Footprint(fp.fixed_bytes, 8 * (245 + 256), fp.hidden, fp.decoder_positions)
    assert memory.peak_bytes(measured, 1) / GiB == pytest.approx(31.08, abs=0.05)
    assert memory.peak_bytes(measured, 0) / GiB == pytest.approx(41.06, abs=0.05)
    # The bound at max_pixels (512 image tokens) on a 48 GB card: every layer on 44.4 GiB, every other on 47.5.
    assert memory.choose_interval(fp, 44.4 * GiB) == 1
    assert memory.choose_interval(fp, 47.5 * GiB) == 2
    assert memory.choose_interval(fp, 139 * GiB) == 0


def test_profile_variants_parse_and_build_valid_configs(tmp_path):
    from bench import grpo_profile

    assert grpo_profile.parse_variants("as_run, liger,as_run") == ["as_run", "liger"]
    with pytest.raises(ValueError, match="unknown profile variant 'ligr'"):
        grpo_profile.parse_variants("as_run,ligr")
    with pytest.raises(ValueError, match="no profile variant"):
        grpo_profile.parse_variants(" , ")
    for name in grpo_profile.VARIANTS:
        config = grpo_profile.variant_config(name, tmp_path / "m", tmp_path / "t", tmp_path, 16, 8)
        assert config.output_dir == str(tmp_path / name)
    assert grpo_profile.variant_config("liger_checkpoint_every_2", tmp_path, tmp_path, tmp_path, 16, 8
                                       ).gradient_checkpointing == 2  # fmt: skip


def test_grpo_speed_modes_are_valid_trial_settings_and_unknown_ones_fail_before_any_work(tmp_path):
    from bench import grpo_speed
    from trainer.config import TrialConfig

    for name, settings in grpo_speed.MODES.items():
        config = TrialConfig(model_path=str(tmp_path), train_path=str(tmp_path), output_dir=str(tmp_path / name),
                             **settings)  # fmt: skip
        assert config.full_finetuning == (name == "full")
    assert grpo_speed.MODES["lora_uncompiled"]["compile_training"] is False
    assert set(grpo_speed.TRL_MODES) <= set(grpo_speed.MODES)
    cases = ((["lora", "qlora"], None, "qlora"), (["lora"], ["lora_uncompiled"], "lora_uncompiled"))
    for modes, trl_modes, bad in cases:
        with pytest.raises(ValueError, match=f"unknown mode '{bad}'"):
            grpo_speed.measure(tmp_path, tmp_path / "work", modes, 2, 2, 1, trl_modes=trl_modes)
    assert not (tmp_path / "work").exists()
