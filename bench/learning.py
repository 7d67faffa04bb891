"""Does a GRPO round teach counting from the image? The taught counting model (synthetic.teach), one round of the
project's trainer (trainer.round.run_round) with the accuracy reward, scored before and after on the same rows of the
synthetic compositional and different-renderer splits; then the same round on the same problems with the images
blanked (a solid gray image) or shuffled across rows, which must not gain: a gain that is not there when the images
carry no information about the count proves that the round learned from looking.

    python bench/learning.py --seeds 0 --grpo-seeds 0 1 2 --out built/learning/results.jsonl

Figures: accuracy with its Wilson 95% interval, and the paired difference (after - before, on the same rows) with a
95% interval from the per-row differences (normal approximation; n is a few hundred); with several runs, each arm's
gains over the runs (mean, min, max). Every model, split and round is written under --work and reused by later runs
with the same arguments.

The default round (`RoundRecipe`): LoRA rank 16 on the language model, lr 2e-3, 40 steps of 8 prompts x 8
generations, temperature 1 (~7-8 s a step on 2 CPU cores). What it measured, on which taught models and machines:
bench/results/2026-12-03-learning-notes.md.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from synthetic.teach import Recipe, build_counting_model  # noqa: E402

EVAL_KINDS = ("val", "compositional", "other")  # "val": condition A held out, the train kind's own distribution
HELD_OUT_KINDS = ("compositional", "other")  # the two the round must improve (the hidden test sets' stand-ins)
CONTROLS = ("blank", "shuffle")


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
    """Where one taught model and its splits live: the model of teach seed `seed` and `teach` recipe, the GRPO train
    split (`n_train` rows never seen by SFT), the evaluation splits (`n_eval` rows each) and the control splits."""

    work: Path
    seed: int = 0
    teach: Recipe = field(default_factory=Recipe)
    n_train: int = 512
    n_eval: int = 300
    device: str = "cpu"  # where the taught model is built and scored (the rounds use the GPU when there is one)

    @property
    def name(self) -> str:
        """seed<N>, then each field of the taught recipe that differs from the default one, as -<field><value>."""
        default = Recipe().to_dict()
        changed = [f"-{key}{value:g}" if isinstance(value, float) else f"-{key}{value}"
                   for key, value in self.teach.to_dict().items() if value != default[key]]
        return f"seed{self.seed}" + "".join(changed)

    @property
    def model(self) -> Path:
        return self.work / f"model-{self.name}"

    def split(self, kind: str) -> Path:
        n = self.n_train if kind == "train" else self.n_eval
        return self.work / f"data-seed{self.seed}" / f"{kind}-{n}"

    def control(self, control: str) -> Path:
        return self.work / f"data-seed{self.seed}" / f"train-{self.n_train}-{control}"

    def train(self, arm: str) -> Path:
        """The train split of an arm: "image" (the real images) or a control."""
        return self.split("train") if arm == "image" else self.control(arm)

    def round_dir(self, arm: str, recipe: RoundRecipe) -> Path:
        return self.work / f"rounds-{self.name}" / f"{arm}-{recipe.tag}"


def prepare(setup: Setup, kinds=EVAL_KINDS, controls=CONTROLS, log=print) -> None:
    """The taught model and the splits (train, the evaluation kinds, the control train splits), cached."""
    import datasets

    from synthetic.splits import write_control_split, write_split

    datasets.disable_progress_bars()
    build_counting_model(setup.model, seed=setup.seed, recipe=setup.teach, log=log, device=setup.device)
    for kind in ("train", *kinds):
        if not setup.split(kind).is_dir():
            # GRPO train rows start after the SFT rows (another seed), so the round sees scenes SFT never saw.
            seed = setup.seed + 1000 if kind == "train" else setup.seed
            write_split(setup.split(kind), kind, setup.n_train if kind == "train" else setup.n_eval, seed,
                        setup.teach.image_size, setup.teach.count_range)
    for control in controls:
        if not setup.control(control).is_dir():
            write_control_split(setup.split("train"), setup.control(control), control, seed=setup.seed)


def score(model_dir: Path, split: Path, max_new_tokens: int = 32, batch_size: int = 32,
          device: str = "cpu") -> dict[str, Any]:
    """Per-row correctness of greedy completions prompted as the verifier prompts (evaluator.generation)."""
    import torch
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    from evaluator.data import load_split
    from evaluator.generation import generate_completions
    from evaluator.protocol import extract_answer, is_correct, parse_gold

    rows = load_split(split)
    model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    processor = AutoProcessor.from_pretrained(model_dir)
    completions = generate_completions(model.to(device).eval(), processor, rows, batch_size=batch_size,
                                       max_new_tokens=max_new_tokens)
    golds = [parse_gold(s) for s in rows["solution"]]
    correct = [is_correct(c.text, g) for c, g in zip(completions, golds)]
    parsed = [extract_answer(c.text) is not None for c in completions]
    return {"correct": correct, "format_rate": sum(parsed) / len(parsed), "n": len(correct),
            "sample": [c.text for c in completions[:3]]}


def accuracy_entry(scored: dict[str, Any]) -> dict[str, Any]:
    """A `score` result as figures: correct rows, n, accuracy and its Wilson interval (percent), format rate."""
    k, n = sum(scored["correct"]), scored["n"]
    return {"correct": k, "n": n, "accuracy": 100 * k / n, "ci": wilson(k, n), "format_rate": scored["format_rate"]}


@dataclass(frozen=True)
class RoundRecipe:
    """The GRPO round of the experiment (the TrialConfig fields it varies); every arm of a run trains with it."""

    steps: int = 40
    learning_rate: float = 2e-3
    lora_rank: int = 16  # 0: full fine-tuning
    train_vision: bool = False  # train the vision tower too (TrialConfig.train_vision_tower)
    prompts_per_step: int = 8
    num_generations: int = 8
    temperature: float = 1.0
    seed: int = 0  # the round's seed (sampling, data order)
    # Reward name -> weight (TrialConfig.reward_weights), the KL coefficient, the loss and the training phrasing:
    # the accuracy reward alone by default, or a warm start's (`from_warm_start`).
    reward_weights: tuple[tuple[str, float], ...] = (("accuracy", 1.0),)
    beta: float = 0.0
    loss_type: str = "dapo"
    phrasing: str = "eval"
    warmup_ratio: float = 0.0  # TrialConfig.warmup_ratio

    @classmethod
    def from_warm_start(cls, name: str, seed: int = 0) -> "RoundRecipe":
        """The round of the demo's warm start `name` (demo_budget.yaml), with the demo's prompts per step."""
        import yaml

        from search.settings import DEMO_BUDGET

        budget = yaml.safe_load(DEMO_BUDGET.read_text())
        recipes = {w["name"]: w["params"] for w in budget["warm_starts"]}
        if name not in recipes:
            raise SystemExit(f"--warm-start: {name!r} is not a warm start of {DEMO_BUDGET}; known: {sorted(recipes)}")
        p = recipes[name]
        return cls(steps=p["steps"], learning_rate=p["learning_rate"], lora_rank=p["lora_rank"],
                   prompts_per_step=budget["fixed"]["prompts_per_step"], num_generations=p["num_generations"],
                   temperature=p["temperature"], seed=seed, reward_weights=tuple(p["reward_weights"].items()),
                   beta=p["beta"], loss_type=p["loss_type"], phrasing=p["phrasing"])

    @property
    def tag(self) -> str:
        tag = (f"s{self.steps}-lr{self.learning_rate:g}-r{self.lora_rank}{'v' if self.train_vision else ''}"
               f"-p{self.prompts_per_step}-n{self.num_generations}-t{self.temperature:g}-g{self.seed}")
        if (self.reward_weights, self.beta, self.loss_type, self.phrasing) != (
                RoundRecipe.reward_weights, RoundRecipe.beta, RoundRecipe.loss_type, RoundRecipe.phrasing):
            rewards = "+".join(f"{name}{weight:g}" for name, weight in self.reward_weights)
            tag += f"-kl{self.beta:g}-{self.loss_type}-{self.phrasing}-{rewards}"
        if self.warmup_ratio:
            tag += f"-w{self.warmup_ratio:g}"
        return tag


def grpo_round(setup: Setup, arm: str, recipe: RoundRecipe) -> tuple[Path, float]:
    """One round of the project's trainer with the accuracy reward on the arm's train split; returns its merged model
    folder and its training seconds per optimizer step (a finished round is reused)."""
    from trainer.config import TrialConfig
    from trainer.round import run_round
    from trainer.run_folder import MERGED_DIR, RoundState, read_status

    out = setup.round_dir(arm, recipe)
    merged = out / MERGED_DIR
    if not ((merged / "config.json").is_file() and read_status(out) is not None):
        width, height = setup.teach.image_size
        config = TrialConfig(
            model_path=str(setup.model),
            train_path=str(setup.train(arm)),
            output_dir=str(out),
            reward_weights=dict(recipe.reward_weights),
            steps=recipe.steps,
            learning_rate=recipe.learning_rate,
            beta=recipe.beta,
            num_generations=recipe.num_generations,
            prompts_per_step=recipe.prompts_per_step,
            generation_steps=1,
            temperature=recipe.temperature,
            warmup_ratio=recipe.warmup_ratio,
            loss_type=recipe.loss_type,
            max_completion_length=16,
            max_pixels=width * height,
            phrasing=recipe.phrasing,
            gradient_checkpointing=False,
            lora_rank=recipe.lora_rank,
            train_vision_tower=recipe.train_vision,
            compile_rollouts=False,  # ~9-token completions from a tiny model: a compilation per round costs more
            seed=recipe.seed,
        )
        result = run_round(config)
        if result.state != RoundState.COMPLETED:
            raise RuntimeError(f"round in {out} {result.state}: {result.reason}")
    status = read_status(out)
    return merged, status.timings["train"] / status.steps_done


# ---------------------------------------------------------------------------------------------------- experiment
def experiment(setup: Setup, recipe: RoundRecipe, *, controls=CONTROLS, kinds=HELD_OUT_KINDS, log=print,
               scores: dict[tuple[str, str], dict[str, Any]] | None = None) -> dict[str, Any]:
    """The base model, the image round and each control round, scored on the same rows of every kind.

    `scores` caches scores by (model folder, split folder) across calls (the base model's, over several rounds)."""
    prepare(setup, kinds=kinds, controls=controls, log=log)
    scores = {} if scores is None else scores
    models, step_seconds = {"base": setup.model}, {}
    for arm in ("image", *controls):
        models[arm], step_seconds[arm] = grpo_round(setup, arm, recipe)
        log(f"round {arm} ({recipe.tag}): {step_seconds[arm]:.1f} s/step")
    result: dict[str, Any] = {"seed": setup.seed, "teach": setup.teach.to_dict(), "round": asdict(recipe),
                              "step_seconds": step_seconds, "arms": {}}
    rows: dict[str, list[bool]] = {}  # each arm's per-row correctness over every kind, in one order
    for arm, model in models.items():
        result["arms"][arm], rows[arm] = {}, []
        for kind in kinds:
            key = (str(model), str(setup.split(kind)))
            if key not in scores:
                scores[key] = score(model, setup.split(kind), device=setup.device)
            rows[arm] += scores[key]["correct"]
            entry = accuracy_entry(scores[key])
            if arm != "base":
                entry["gain"] = paired_difference(scores[(str(setup.model), str(setup.split(kind)))]["correct"],
                                                  scores[key]["correct"])
            result["arms"][arm][kind] = entry
    # Every kind's rows together: one round's gain is noisy per split, and whether it moved the answers on the
    # held-out rows as a whole is what the question asks.
    result["pooled_gain"] = {arm: paired_difference(rows["base"], rows[arm]) for arm in models if arm != "base"}
    return result


def format_entry(arm: str, kind: str, e: dict[str, Any]) -> str:
    """One `accuracy_entry` as a line: arm, kind, correct/n, accuracy [Wilson interval], format rate."""
    return (f"  {arm:8s} {kind:13s} {e['correct']:4d}/{e['n']:<4d} = {e['accuracy']:5.1f}% "
            f"[{e['ci'][0]:5.1f}, {e['ci'][1]:5.1f}]  format {100 * e['format_rate']:5.1f}%")


def format_result(result: dict[str, Any]) -> str:
    r = result["round"]
    lines = [f"teach seed {result['seed']}, grpo seed {r['seed']}: {r['steps']} steps x {r['prompts_per_step']} "
             f"prompts x {r['num_generations']} generations, lr {r['learning_rate']:g}, lora rank {r['lora_rank']}, "
             f"temperature {r['temperature']:g}, warmup {r.get('warmup_ratio', 0):g}, kl {r['beta']:g}, "
             f"{r['loss_type']}, {r['phrasing']} phrasing, rewards {dict(r['reward_weights'])}; s/step " +
             ", ".join(f"{arm} {s:.1f}" for arm, s in result["step_seconds"].items())]
    for arm, by_kind in result["arms"].items():
        for kind, e in by_kind.items():
            line = format_entry(arm, kind, e)
            if "gain" in e:
                g = e["gain"]
                line += f"  gain {g['diff']:+5.1f} pts [{g['low']:+5.1f}, {g['high']:+5.1f}]"
            lines.append(line)
    for arm, g in result.get("pooled_gain", {}).items():
        lines.append(f"  {arm:8s} {'all kinds':13s} {g['n']:4d} rows  gain {g['diff']:+5.1f} pts "
                     f"[{g['low']:+5.1f}, {g['high']:+5.1f}]")
    return "\n".join(lines)


def summarize(results: list[dict[str, Any]]) -> str:
    """Each arm's gains on each kind over the runs: mean, min, max, and the runs' gains in order."""
    lines = [f"{len(results)} runs: gain in points (after - before, same rows), mean [min, max]"]
    arms = [arm for arm in results[0]["arms"] if arm != "base"]
    for arm in arms:
        for kind in results[0]["arms"][arm]:
            gains = [r["arms"][arm][kind]["gain"]["diff"] for r in results]
            spread = f"{statistics.mean(gains):+5.1f} [{min(gains):+5.1f}, {max(gains):+5.1f}]"
            lines.append(f"  {arm:8s} {kind:13s} {spread}  runs: {' '.join(f'{g:+.1f}' for g in gains)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    defaults = RoundRecipe()
    parser.add_argument("--work", type=Path, default=ROOT / "built" / "learning")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="teach seeds (one taught model each)")
    parser.add_argument("--grpo-seeds", type=int, nargs="+", default=[0], help="round seeds, per taught model")
    parser.add_argument("--undercount-share", type=float, default=0.0,
                        help="the taught model's answer-side bias (synthetic.teach.Recipe.undercount_share)")
    parser.add_argument("--other-share", type=float, default=0.0,
                        help="share of the taught rows from the other renderer (synthetic.teach.Recipe.other_share)")
    parser.add_argument("--other-aux-only", action="store_true",
                        help="those rows teach the vision tower only (synthetic.teach.Recipe.other_aux_only)")
    parser.add_argument("--teach-steps", type=int, default=Recipe.steps, help="the taught model's SFT steps")
    parser.add_argument("--teach-batch-size", type=int, default=Recipe.batch_size, help="the taught model's SFT rows "
                        "per step (tests/test_learning.py teaches with 8)")
    parser.add_argument("--tower-steps", type=int, default=Recipe.tower_steps,
                        help="tower-only SFT steps before them (synthetic.teach.Recipe.tower_steps)")
    parser.add_argument("--n-eval", type=int, default=300)
    parser.add_argument("--n-train", type=int, default=512)
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--learning-rate", type=float, default=defaults.learning_rate)
    parser.add_argument("--lora-rank", type=int, default=defaults.lora_rank)
    parser.add_argument("--train-vision", action="store_true", help="train the vision tower too")
    parser.add_argument("--device", default="cpu", help="where the taught model is built and scored (cpu, cuda)")
    parser.add_argument("--prompts-per-step", type=int, default=defaults.prompts_per_step)
    parser.add_argument("--num-generations", type=int, default=defaults.num_generations)
    parser.add_argument("--temperature", type=float, default=defaults.temperature)
    parser.add_argument("--warmup-ratio", type=float, default=defaults.warmup_ratio)
    parser.add_argument("--warm-start", help="run the demo's warm start of this name (e.g. baseline) instead of the "
                        "round the options above describe")
    parser.add_argument("--controls", nargs="*", default=list(CONTROLS), choices=CONTROLS)
    parser.add_argument("--base-only", action="store_true", help="only score the taught model on every kind")
    parser.add_argument("--out", type=Path, help="append the results as JSON lines here")
    args = parser.parse_args(argv)
    results, scores = [], {}
    for seed in args.seeds:
        teach = Recipe(undercount_share=args.undercount_share, other_share=args.other_share,
                       other_aux_only=args.other_aux_only, steps=args.teach_steps, tower_steps=args.tower_steps,
                       batch_size=args.teach_batch_size)
        setup = Setup(args.work, seed=seed, teach=teach, n_train=args.n_train, n_eval=args.n_eval, device=args.device)
        if args.base_only:  # also writes every split, so that runs started after it in parallel only read them
            prepare(setup)
            for kind in EVAL_KINDS:
                s = score(setup.model, setup.split(kind), device=setup.device)
                print(f"seed {seed}{format_entry('base', kind, accuracy_entry(s))}  e.g. {s['sample'][0]!r}",
                      flush=True)
            continue
        for grpo_seed in args.grpo_seeds:
            if args.warm_start:
                recipe = RoundRecipe.from_warm_start(args.warm_start, seed=grpo_seed)
            else:
                recipe = RoundRecipe(args.steps, args.learning_rate, args.lora_rank, args.train_vision,
                                     args.prompts_per_step, args.num_generations, args.temperature, grpo_seed,
                                     warmup_ratio=args.warmup_ratio)
            result = experiment(setup, recipe, controls=tuple(args.controls), scores=scores)
            results.append(result)
            print(format_result(result), flush=True)
            if args.out:
                with args.out.open("a") as handle:
                    handle.write(json.dumps(result) + "\n")
    if len(results) > 1:
        print(summarize(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
