"""Does the fit check tell the truth? Rounds of the 2B architecture (random weights) run under a `gpu_memory_gb` cap,
each in a fresh process, and the search's prediction (search.backends.fit, before any launch) set beside what the CUDA
allocator measured: its peak allocated and reserved bytes, and whether the round ran out of memory.

    python bench/memory_fit.py --work /tmp/memory-fit --cap-gb 48 --out bench/results/DATE-h200-memory-fit.json

The rounds (CONFIGS), all at two prompts a step: the heaviest of budget.yaml's space (full fine-tuning, group 16,
the KL reference, the larger image bound), which the check refuses at 48 GB; the heaviest it admits, the round
`run_search.py check` runs (full fine-tuning without the reference at the smaller image bound, group 4: one pass,
every 2nd layer checkpointed), and the same at groups 8 and 16 (in 2 and 4 passes: every layer checkpointed, since the
estimate charges the accumulation of a split step); full fine-tuning with the reference at group 8 (the inherited
baseline's shape), and without it at group 16; a LoRA round at group 16; and the heaviest with its vision tower
trained too.
Refused rounds run without the check, to see whether they really run out of memory. Images are rendered at 672 x 588
(395,136 pixels, 504 image tokens), near the larger `max_pixels` bound the estimate assumes; a round of the smaller
bound gets them resized to it by the processor. Figures are written after each round, so a call cut short keeps
what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

IMAGE_SIZE = (672, 588)
SPACE_HEAVIEST = {"lora_rank": 0, "learning_rate": 1e-6, "num_generations": 16, "beta": 0.04}
CONFIGS: dict[str, dict[str, Any]] = {
    "refused_full_kl_group_16": SPACE_HEAVIEST,
    "heaviest_admitted": {**SPACE_HEAVIEST, "num_generations": 4, "beta": 0.0, "max_pixels": 200704},
    # Full fine-tuning at the smaller image bound split into micro-batches (trainer.memory's ACCUMULATION_BYTES
    # rounds), also with one step a generation and with the dynamic KV cache.
    "full_group_16_small_images": {**SPACE_HEAVIEST, "beta": 0.0, "max_pixels": 200704},
    "full_group_8_small_images": {**SPACE_HEAVIEST, "num_generations": 8, "beta": 0.0, "max_pixels": 200704},
    "full_group_16_small_images_one_step_a_generation": {**SPACE_HEAVIEST, "beta": 0.0, "max_pixels": 200704,
                                                         "generation_steps": 1},
    "full_group_16_small_images_dynamic_cache": {**SPACE_HEAVIEST, "beta": 0.0, "max_pixels": 200704,
                                                 "compile_rollouts": False},
    "full_kl_group_8": {**SPACE_HEAVIEST, "num_generations": 8},
    "full_group_16": {**SPACE_HEAVIEST, "beta": 0.0},
    "lora64_group_16": {**SPACE_HEAVIEST, "lora_rank": 64, "learning_rate": 1e-5},
    "refused_vision_tower": {**SPACE_HEAVIEST, "train_vision_tower": True},
}


def trial_config(name: str, model: Path, train: Path, work: Path, steps: int, cap_gb: float):
    """The round `name` as the search would configure it from budget.yaml's `fixed` (two prompts a step, 4 steps a
    generation, 256 tokens), capped to `cap_gb`."""
    import yaml

    from trainer.config import TrialConfig

    fixed = yaml.safe_load((ROOT / "budget.yaml").read_text())["fixed"]
    return TrialConfig(model_path=str(model), train_path=str(train), output_dir=str(work / name), steps=steps,
                       gpu_memory_gb=cap_gb, **{"max_pixels": 401408, **fixed, **CONFIGS[name]})  # fmt: skip


def predicted(config, model: Path) -> dict[str, Any]:
    """What the search predicts before the launch: the plan on a card of `gpu_memory_gb`, one GPU."""
    from transformers import AutoConfig

    from search.backends import FitCheck

    fit = FitCheck(lambda: AutoConfig.from_pretrained(model), lambda gpus: config.gpu_memory_gb * 1e9)(config, [0])
    return {"fits": fit.fits, **fit.attrs()}


def run_one(config_path: Path) -> dict[str, Any]:
    """In this process: the round, and the allocator's peaks."""
    import torch

    from trainer.config import TrialConfig
    from trainer.round import run_round

    config = TrialConfig.from_json(config_path)
    began = time.perf_counter()
    result = run_round(config)
    return {"state": result.state, "reason": (result.reason or "")[:300], "kind": result.kind,
            "steps_done": result.steps_done, "seconds": round(time.perf_counter() - began, 1),
            "trainer_settings": result.settings,
            "peak_allocated_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2),
            "peak_reserved_gb": round(torch.cuda.max_memory_reserved() / 1e9, 2)}  # fmt: skip


def measure(names: list[str], work: Path, steps: int, cap_gb: float, out: Path | None) -> dict[str, Any]:
    from synthetic.models import build_model
    from synthetic.splits import write_split

    model, train = work / "qwen2vl-2b", work / "train-672x588"
    if not (model / "config.json").is_file():
        build_model(model, size="2b", seed=0)
    if not train.is_dir():
        write_split(train, "train", 64, seed=0, image_size=IMAGE_SIZE)
    figures: dict[str, Any] = {"cap_gb": cap_gb, "steps": steps, "image_size": IMAGE_SIZE, "rounds": {}}
    for name in names:
        config = trial_config(name, model, train, work, steps, cap_gb)
        path = work / f"{name}.json"
        config.to_json(path)
        entry: dict[str, Any] = {"config": CONFIGS[name], "predicted": predicted(config, model)}
        child = subprocess.run([sys.executable, __file__, "--one", str(path)], capture_output=True, text=True,
                               cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
        try:
            entry["measured"] = json.loads(child.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            entry["measured"] = {"state": "crashed", "returncode": child.returncode, "stderr": child.stderr[-2000:]}
        figures["rounds"][name] = entry
        print(name, json.dumps(entry), flush=True)
        if out is not None:
            out.write_text(json.dumps(figures, indent=1) + "\n")
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=ROOT / "built" / "memory-fit")
    parser.add_argument("--rounds", default=",".join(CONFIGS), help=f"comma-separated names of {list(CONFIGS)}")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cap-gb", type=float, default=48.0, help="gpu_memory_gb of every round")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--one", type=Path, help=argparse.SUPPRESS)  # a child: run this trial.json, print figures
    args = parser.parse_args(argv)
    if args.one is not None:
        print(json.dumps(run_one(args.one)), flush=True)
        return 0
    names = [name.strip() for name in args.rounds.split(",") if name.strip()]
    unknown = [name for name in names if name not in CONFIGS]
    if unknown:
        parser.error(f"unknown round {unknown[0]!r}; known: {', '.join(CONFIGS)}")
    args.work.mkdir(parents=True, exist_ok=True)
    measure(names, args.work, args.steps, args.cap_gb, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
