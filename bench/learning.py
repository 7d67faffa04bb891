"""Does a GRPO round teach counting from the image? The taught counting model (synthetic.teach), one round of the
project's trainer (trainer.round.run_round) with the accuracy reward, scored before and after on the same rows of the
synthetic compositional and different-renderer splits; then the same round on the same problems with the images
blanked (a solid gray image) or shuffled across rows, which must not gain.

    python bench/learning.py --work built/learning --seeds 0 1 2 --n-eval 300

Figures: accuracy with its Wilson 95% interval, and the paired difference (after - before, on the same rows) with a
95% interval from the per-row differences (normal approximation; n is a few hundred). Every model and split is
written under --work and reused by later runs with the same arguments.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from synthetic.teach import TEACH_COUNT_RANGE, TEACH_IMAGE_SIZE, Recipe, build_counting_model  # noqa: E402

EVAL_KINDS = ("val", "compositional", "other")  # "val": condition A held out, the train kind's own distribution


# ---------------------------------------------------------------------------------------------------- statistics
def wilson(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for a proportion, in percent."""
    if n == 0:
        return (0.0, 100.0)
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (100 * (centre - half), 100 * (centre + half))


def paired_difference(before: list[bool], after: list[bool], z: float = 1.96) -> dict[str, float]:
    """after - before on the same rows, in points, with a normal-approximation 95% interval of the mean difference."""
    assert len(before) == len(after) and before
    diffs = [float(a) - float(b) for a, b in zip(after, before)]
    n = len(diffs)
    mean = sum(diffs) / n
    var = sum((d - mean) ** 2 for d in diffs) / max(1, n - 1)
    half = z * math.sqrt(var / n)
    return {"diff": 100 * mean, "low": 100 * (mean - half), "high": 100 * (mean + half), "n": n}


# ---------------------------------------------------------------------------------------------------- pieces
@dataclass
class Setup:
    work: Path
    seed: int = 0
    recipe: Recipe = field(default_factory=Recipe)
    n_train: int = 512
    n_eval: int = 300

    @property
    def model(self) -> Path:
        return self.work / f"model-seed{self.seed}"

    def split(self, kind: str) -> Path:
        n = self.n_train if kind == "train" else self.n_eval
        return self.work / f"data-seed{self.seed}" / f"{kind}-{n}"

    def control(self, control: str) -> Path:
        return self.work / f"data-seed{self.seed}" / f"train-{self.n_train}-{control}"


def prepare(setup: Setup, kinds=EVAL_KINDS, controls=("blank",), log=print) -> None:
    """The taught model and the splits (train, the evaluation kinds, the control train splits), cached."""
    import datasets

    from synthetic.splits import write_control_split, write_split

    datasets.disable_progress_bars()
    build_counting_model(setup.model, seed=setup.seed, recipe=setup.recipe, log=log)
    for kind in ("train", *kinds):
        if not setup.split(kind).is_dir():
            # GRPO train rows start after the SFT rows (another seed), so the round sees scenes SFT never saw.
            seed = setup.seed + 1000 if kind == "train" else setup.seed
            write_split(setup.split(kind), kind, setup.n_train if kind == "train" else setup.n_eval, seed,
                        setup.recipe.image_size, setup.recipe.count_range)
    for control in controls:
        if not setup.control(control).is_dir():
            write_control_split(setup.split("train"), setup.control(control), control, seed=setup.seed)


def score(model_dir: Path, split: Path, max_new_tokens: int = 32, batch_size: int = 32) -> dict[str, Any]:
    """Per-row correctness of greedy completions prompted as the verifier prompts (evaluator.generation)."""
    import torch
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    from evaluator.data import load_split
    from evaluator.generation import generate_completions
    from evaluator.protocol import extract_answer, is_correct, parse_gold

    rows = load_split(split)
    model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    processor = AutoProcessor.from_pretrained(model_dir)
    completions = generate_completions(model.eval(), processor, rows, batch_size=batch_size,
                                       max_new_tokens=max_new_tokens)
    golds = [parse_gold(s) for s in rows["solution"]]
    correct = [is_correct(c.text, g) for c, g in zip(completions, golds)]
    parsed = [extract_answer(c.text) is not None for c in completions]
    return {"correct": correct, "format_rate": sum(parsed) / len(parsed), "n": len(correct),
            "sample": [c.text for c in completions[:3]]}


def grpo_round(setup: Setup, train: Path, out: Path, *, steps: int, learning_rate: float, seed: int,
               num_generations: int = 8, prompts_per_step: int = 4, lora_rank: int = 0,
               reward_weights: dict[str, float] | None = None) -> Path:
    """One round of the project's trainer; returns its merged model folder (reused when already there)."""
    from trainer.config import TrialConfig
    from trainer.round import MERGED_DIR, run_round

    merged = out / MERGED_DIR
    if (merged / "config.json").is_file() and (out / "status.json").is_file():
        return merged
    width, height = setup.recipe.image_size
    config = TrialConfig(
        model_path=str(setup.model),
        train_path=str(train),
        output_dir=str(out),
        reward_weights=reward_weights or {"accuracy": 1.0},
        steps=steps,
        learning_rate=learning_rate,
        beta=0.0,
        num_generations=num_generations,
        prompts_per_step=prompts_per_step,
        generation_steps=1,
        temperature=1.0,
        loss_type="dapo",
        max_completion_length=16,
        max_pixels=width * height,
        phrasing="eval",
        gradient_checkpointing=False,
        lora_rank=lora_rank,
        seed=seed,
    )
    result = run_round(config)
    if result.state != "completed":
        raise RuntimeError(f"round in {out} {result.state}: {result.reason}")
    return merged


# ---------------------------------------------------------------------------------------------------- experiment
def experiment(setup: Setup, *, steps: int, learning_rate: float, controls=("blank",), kinds=("compositional", "other"),
               grpo_seed: int = 0, lora_rank: int = 0, log=print) -> dict[str, Any]:
    """Base model, the real round and each control round, scored on the same rows of every kind."""
    prepare(setup, kinds=kinds, controls=controls, log=log)
    arms = {"base": setup.model}
    tag = f"s{steps}-lr{learning_rate:g}-r{lora_rank}-g{grpo_seed}"
    for arm, train in [("image", setup.split("train")), *[(c, setup.control(c)) for c in controls]]:
        began = time.perf_counter()
        arms[arm] = grpo_round(setup, train, setup.work / f"rounds-seed{setup.seed}" / f"{arm}-{tag}",
                               steps=steps, learning_rate=learning_rate, seed=grpo_seed, lora_rank=lora_rank)
        log(f"round {arm}: {time.perf_counter() - began:.0f}s")
    scores = {arm: {kind: score(path, setup.split(kind)) for kind in kinds} for arm, path in arms.items()}
    result: dict[str, Any] = {"seed": setup.seed, "grpo_seed": grpo_seed, "steps": steps,
                              "learning_rate": learning_rate, "lora_rank": lora_rank, "arms": {}}
    for arm, by_kind in scores.items():
        result["arms"][arm] = {}
        for kind, s in by_kind.items():
            k, n = sum(s["correct"]), s["n"]
            entry = {"correct": k, "n": n, "accuracy": 100 * k / n, "ci": wilson(k, n), "format_rate": s["format_rate"]}
            if arm != "base":
                entry["gain"] = paired_difference(scores["base"][kind]["correct"], s["correct"])
            result["arms"][arm][kind] = entry
    return result


def format_result(result: dict[str, Any]) -> str:
    lines = [f"seed {result['seed']} (grpo seed {result['grpo_seed']}), {result['steps']} steps, "
             f"lr {result['learning_rate']:g}, lora rank {result['lora_rank']}"]
    for arm, by_kind in result["arms"].items():
        for kind, e in by_kind.items():
            line = (f"  {arm:8s} {kind:13s} {e['correct']:4d}/{e['n']:<4d} = {e['accuracy']:5.1f}% "
                    f"[{e['ci'][0]:5.1f}, {e['ci'][1]:5.1f}]  format {100 * e['format_rate']:5.1f}%")
            if "gain" in e:
                g = e["gain"]
                line += f"  gain {g['diff']:+5.1f} pts [{g['low']:+5.1f}, {g['high']:+5.1f}]"
            lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=ROOT / "built" / "learning")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--n-eval", type=int, default=300)
    parser.add_argument("--n-train", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--lora-rank", type=int, default=0)
    parser.add_argument("--controls", nargs="*", default=["blank", "shuffle"])
    parser.add_argument("--base-only", action="store_true", help="only score the taught model on every kind")
    parser.add_argument("--out", type=Path, help="append the results as JSON lines here")
    args = parser.parse_args(argv)
    for seed in args.seeds:
        setup = Setup(args.work, seed=seed, n_train=args.n_train, n_eval=args.n_eval)
        if args.base_only:
            prepare(setup, controls=())
            for kind in EVAL_KINDS:
                s = score(setup.model, setup.split(kind))
                k, n = sum(s["correct"]), s["n"]
                lo, hi = wilson(k, n)
                print(f"seed {seed} base {kind:13s} {k}/{n} = {100 * k / n:.1f}% [{lo:.1f}, {hi:.1f}] "
                      f"format {100 * s['format_rate']:.1f}%  e.g. {s['sample'][0]!r}", flush=True)
            continue
        result = experiment(setup, steps=args.steps, learning_rate=args.learning_rate, controls=tuple(args.controls),
                            lora_rank=args.lora_rank)
        print(format_result(result), flush=True)
        if args.out:
            with args.out.open("a") as handle:
                handle.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
