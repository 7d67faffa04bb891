"""The GPU benchmarks of the performance issue, on the random-weight Qwen2-VL-2B (256-token worst case), written to
one results file with the headline ratios:

    python bench/gpu.py --sections eval,grpo,search --out bench/results/$(date +%F)-h200.json

- eval (bench/eval_speed.py): the evaluator's examples/s with its defaults against plain batch-64 `generate`
  (`eval_speedup`), on --eval-speed-rows rows, at each of --eval-batch-sizes and at the best with each of
  eval_speed.OPTIONS (`eval_speedup_with_options`: the fastest), with the rows whose completions differ from the
  defaults';
- eval_1k: 1,000 examples end to end in a fresh process (`eval_1k_seconds`, with a warm inductor cache, as in every
  evaluation of a search after its first; the cold run that warms it is in the raw figures), with the evaluator's
  defaults at the batch size eval found fastest when its figures are in --out, else at --e2e-batch-size; then warm
  with each of --eval-1k-variants (eval_speed.END_TO_END_VARIANTS: another compile pool or cache; started_ahead, the
  process as the search starts it, timed from its go line: `eval_1k_seconds_started_ahead`);
- round_eval (bench/round_evaluation.py): a round's evaluation as budget.yaml sets it (--eval-rows of ood_val, then
  its val_rows of a val split, its eval_batch_size and seed) in one evaluator process against one per split, warm,
  and the one process started ahead as the search starts it (`round_eval_ahead_saved_s`);
- decode_profile: one batch of --e2e-batch-size rows, prefill against decode steps and where the time goes;
- grpo (bench/grpo_speed.py): completions/s of this project's trainer against TRL's defaults, full fine-tuning and
  LoRA r=64, group size 8 (`grpo_full_speedup`, `lora_vs_full`), peak memory of each;
- profile (bench/grpo_profile.py): where full fine-tuning's step goes (rollout, old log-probs, forward, backward,
  optimizer) and its peak memory, for the round as run and with one lever changed at a time (--profile-variants);
- vision (bench/eval_speed.py): the vision tower's attention once per image against the batched one
  (evaluator.vision_attention), side by side on one model: the tower's seconds for one batch of --vision-batch-size
  rows' images and the evaluator's examples/s on --vision-rows rows (`vision_tower_speedup`, `vision_eval_speedup`),
  and the tower alone on 256 images of 448x448;
- search: `run_search.py` for --search-minutes of real rounds on a synthetic 480x320 box, and from its study the
  seconds each round spent outside training and evaluation: start-up (launch to first step), merge and save,
  promotion (copy, flush, the verifier's check). `overhead_fraction`: those seconds of a round that is promoted over
  a 30-minute round; `overhead_fraction_as_run`: the mean of the rounds as they ran (the bench's trained rounds,
  on random weights, are never promoted).

A section given again replaces its figures in --out; the others are kept, so the sections may run in separate
calls of a time-limited machine (each fits one 10-minute call with its defaults). Figures are written after every
measurement inside a section too, marked `"incomplete": true` until the section ends, so a call cut short keeps what
it measured. Each section records the GPU and versions it ran with.
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

import torch  # noqa: E402
import yaml  # noqa: E402

from search.promotion import CHECK_PARTS  # noqa: E402

SECTIONS = ("eval", "eval_1k", "round_eval", "decode_profile", "grpo", "profile", "vision", "search")
ROUND_SECONDS = 30 * 60  # the reference round
PROMOTION_PARTS = ("copy", "flush", "check")  # search.promotion.promote's timings, in order
# The profile's default variants: ~40-60 s each on an H200 after the first (which compiles the rollout), so these and
# building the model fit one 10-minute call.
PROFILE_VARIANTS = ("as_run", "checkpoint_all", "liger", "no_checkpointing", "liger_no_checkpointing")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {SECTIONS}")
    parser.add_argument("--work", type=Path, default=ROOT / "built" / "bench", help="models, data and runs")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--eval-rows", type=int, default=1000, help="rows of eval_1k")
    parser.add_argument("--eval-speed-rows", type=int, default=512, help="rows of eval's evaluator runs")
    parser.add_argument("--plain-rows", type=int, default=128, help="rows for plain generate (it is slow)")
    parser.add_argument("--eval-batch-sizes", default="256", help="eval's evaluator batch sizes (256 was best)")
    parser.add_argument("--eval-options", help="comma-separated, of eval_speed.OPTIONS (default: all)")
    parser.add_argument("--e2e-batch-size", type=int, default=256,
                        help="batch size of decode_profile, and of eval_1k without eval's figures")  # fmt: skip
    parser.add_argument("--decode-profile-tokens", type=int, default=256, help="new tokens of decode_profile")
    parser.add_argument("--grpo-modes", default="full,lora", help="comma-separated, of grpo_speed.MODES")
    parser.add_argument("--grpo-trl-modes", default="full,lora",
                        help="the grpo modes also measured with TRL's defaults, of grpo_speed.TRL_MODES")  # fmt: skip
    parser.add_argument("--grpo-steps", type=int, default=16, help="steps of this project's rounds")
    parser.add_argument("--grpo-generation-steps", type=int, default=8)
    parser.add_argument("--profile-variants", default=",".join(PROFILE_VARIANTS),
                        help="comma-separated names of bench/grpo_profile.py's VARIANTS")  # fmt: skip
    parser.add_argument("--trl-steps", type=int, default=4, help="steps of the TRL-defaults rounds")
    parser.add_argument("--vision-batch-size", type=int, default=256)
    parser.add_argument("--vision-rows", type=int, default=512, help="rows the evaluator scores each way")
    parser.add_argument("--eval-1k-variants", default="",
                        help="comma-separated, of eval_speed.END_TO_END_VARIANTS: also run warm with each")  # fmt: skip
    parser.add_argument("--search-minutes", type=float, default=7.0)
    args = parser.parse_args(argv)
    sections = args.sections.split(",")
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown section {unknown[0]!r}; known: {', '.join(SECTIONS)}")
    if "profile" in sections:
        from bench import grpo_profile

        try:
            variants = grpo_profile.parse_variants(args.profile_variants)
        except ValueError as exc:
            parser.error(str(exc))
    eval_1k_variants = [name for name in args.eval_1k_variants.split(",") if name]
    if "eval_1k" in sections:
        from bench.eval_speed import END_TO_END_VARIANTS

        unknown = sorted(set(eval_1k_variants) - set(END_TO_END_VARIANTS))
        if unknown:
            parser.error(f"unknown eval_1k variant {unknown[0]!r}; known: {', '.join(END_TO_END_VARIANTS)}")
    if not torch.cuda.is_available():
        parser.error("needs a GPU")

    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    model = _model(args.work / "qwen2vl-2b")
    machine = _machine()
    for section in sections:
        began = time.perf_counter()

        def record(figures: dict[str, Any], done: bool = False, section: str = section, began: float = began) -> None:
            entry = {**figures, "machine": machine, "section_seconds": time.perf_counter() - began}
            if not done:
                entry["incomplete"] = True
            results[section] = entry
            results.update(_headline(results))
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=2) + "\n")

        if section == "eval":
            from bench import eval_speed

            split = _split(args.work / f"other-{args.eval_speed_rows}", args.eval_speed_rows)
            sizes = [int(size) for size in args.eval_batch_sizes.split(",")]
            options = args.eval_options.split(",") if args.eval_options else None
            figures = eval_speed.measure(model, split, args.plain_rows, sizes, record, options=options)
        elif section == "eval_1k":
            # The evaluator's defaults, at the batch size the eval section found fastest when its figures are in --out.
            settings = results.get("eval", {}).get("defaults", {"batch_size": args.e2e_batch_size})
            figures = eval_end_to_end(model, _split(args.work / f"other-{args.eval_rows}", args.eval_rows), settings,
                                      record, eval_1k_variants)  # fmt: skip
        elif section == "round_eval":
            from bench import round_evaluation

            budget = yaml.safe_load((ROOT / "budget.yaml").read_text())
            ood = _split(args.work / f"other-{args.eval_rows}", args.eval_rows)
            val = _split(args.work / f"train-{budget['val_rows']}", budget["val_rows"], kind="train")
            figures = round_evaluation.measure(model, ood, val, budget["val_rows"], budget["seed"],
                                               budget["eval_batch_size"], repeats=1)  # fmt: skip
        elif section == "decode_profile":
            from bench import eval_speed

            split = _split(args.work / f"other-{args.eval_speed_rows}", args.eval_speed_rows)
            figures = eval_speed.decode_profile(model, split, args.e2e_batch_size, args.decode_profile_tokens)
        elif section == "grpo":
            from bench import grpo_speed

            trl_modes = [mode for mode in args.grpo_trl_modes.split(",") if mode]
            figures = grpo_speed.measure(model, args.work / "grpo", args.grpo_modes.split(","), args.grpo_steps,
                                         args.trl_steps, args.grpo_generation_steps, on_figure=record,
                                         trl_modes=trl_modes)  # fmt: skip
        elif section == "profile":
            figures = grpo_profile.measure(model, args.work / "profile", variants, args.grpo_steps,
                                           args.grpo_generation_steps, on_variant=record)  # fmt: skip
        elif section == "vision":
            from bench import eval_speed

            split = _split(args.work / f"other-{args.eval_speed_rows}", args.eval_speed_rows)
            figures = eval_speed.vision_attention(model, split, "cuda:0", args.vision_batch_size, args.vision_rows,
                                                  record=record)  # fmt: skip
            record(figures)
            figures["tower_alone"] = eval_speed.vision_tower_speed("cuda:0", images=256, sides=(448,))
        else:
            figures = search_overhead(model, args.work / "search", args.search_minutes)
        record(figures, done=True)
        print(json.dumps({section: results[section]}, indent=2), flush=True)
    return 0


def eval_end_to_end(model: Path, split: Path, settings: dict[str, Any], record: Any,
                    variants: list[str] = ()) -> dict[str, Any]:  # fmt: skip
    """`python -m evaluator` on every row of `split` with `settings` (a batch size and `evaluate`'s flags) in a
    fresh process, with an empty inductor cache and then with the cache that run left, then warm with each of
    `variants` (eval_speed.END_TO_END_VARIANTS; one that saves for its next run runs twice, its first run named
    `..._first`), with how many rows' answers differ from the warm run's; recorded after each."""
    import tempfile

    from bench import eval_speed

    figures: dict[str, Any] = {"rows": None, "settings": settings}
    runs = [("end_to_end_cold", None), ("end_to_end_warm", None)]
    for variant in variants:  # a variant that saves for its next run runs first, then again for the figure
        if eval_speed.END_TO_END_VARIANTS[variant].get("runs", 1) == 2:
            runs.append((f"end_to_end_warm_{variant}_first", variant))
        runs.append((f"end_to_end_warm_{variant}", variant))
    answers = None  # the warm defaults' answers, which every later run is compared with
    with tempfile.TemporaryDirectory() as inductor_cache:
        for name, variant in runs:
            run = eval_speed._end_to_end(model, split, inductor_cache, variant=variant, **settings)
            these = run.pop("answers")
            if answers is not None:
                run["rows_with_other_answers"] = sum(a != b for a, b in zip(these, answers))
            elif name == "end_to_end_warm":
                answers = these
            figures[name], figures["rows"] = run, run["n"]
            record(figures)
    return figures


def _headline(results: dict[str, Any]) -> dict[str, Any]:
    headline: dict[str, Any] = {}
    if "defaults_speedup" in results.get("eval", {}):
        headline["eval_speedup"] = results["eval"]["defaults_speedup"]
        headline["eval_speedup_with_options"] = results["eval"]["speedup"]
    for run, name in (("end_to_end_warm", "eval_1k_seconds"), ("end_to_end_warm_started_ahead",
                                                                 "eval_1k_seconds_started_ahead")):
        if run in results.get("eval_1k", {}):
            warm = results["eval_1k"][run]
            headline[name] = warm["seconds"] * 1000 / warm["n"]
    if "together_speedup" in results.get("round_eval", {}):
        headline["round_eval_saved_s"] = results["round_eval"]["saved_s"]
    if "ahead_saved_s" in results.get("round_eval", {}):
        headline["round_eval_ahead_saved_s"] = results["round_eval"]["ahead_saved_s"]
    if "grpo" in results:
        if "speedup" in results["grpo"].get("full", {}):
            headline["grpo_full_speedup"] = results["grpo"]["full"]["speedup"]
        if "lora_vs_full" in results["grpo"]:
            headline["lora_vs_full"] = results["grpo"]["lora_vs_full"]
    for name in ("tower_speedup", "eval_speedup"):
        if name in results.get("vision", {}):
            headline[f"vision_{name}"] = results["vision"][name]
    if "overhead_fraction" in results.get("search", {}):
        headline["overhead_fraction"] = results["search"]["overhead_fraction"]
    return headline


# ---------------------------------------------------------------------------------------------------- search
def search_overhead(model: Path, work: Path, minutes: float) -> dict[str, Any]:
    """A real search on the 2B model for `minutes`, and what its rounds spent outside training and evaluation."""
    from synthetic.splits import write_box

    box = work / "box"
    if not (box / "ood_val").exists():
        # On one GPU round 0 scores all of ood_val before any round trains: a small split leaves a call's time to one.
        write_box(box, {"train": 256, "val": 64, "ood_val": 64, "test_compositional": 8, "test_other": 8})
    budget = _bench_budget(model, box, work, minutes)
    began = time.perf_counter()
    run = subprocess.run([sys.executable, str(ROOT / "run_search.py"), "--budget", str(budget)], cwd=work,
                         capture_output=True, text=True)  # fmt: skip
    wall = time.perf_counter() - began
    (work / "search.log").write_text(run.stdout + run.stderr)
    print(run.stdout[-4000:], run.stderr[-4000:], sep="\n", flush=True)

    from search.settings import load_settings
    from search.study import load_existing_study

    study = load_existing_study(load_settings(budget))
    rounds = []
    for trial in study.get_trials(deepcopy=False):
        attrs = trial.user_attrs
        timings = attrs.get("timings", {})
        rounds.append({
            "number": trial.number,
            "state": attrs.get("state"),
            "steps_done": attrs.get("steps_done"),
            "duration_s": attrs.get("duration_s"),
            "timings": timings,
            "promotion_s": attrs.get("promotion_s", 0.0),
            "promotion_timings": attrs.get("promotion_timings", {}),
            "ood_accuracy": trial.value,
        })  # fmt: skip
    figures: dict[str, Any] = {
        "minutes": minutes,
        "exit_code": run.returncode,
        "wall_seconds": wall,
        "rounds": rounds,
        "submission": json.loads((work / "submission" / "PROMOTED.json").read_text())
        if (work / "submission" / "PROMOTED.json").exists()
        else None,
    }
    return {**figures, **overhead_figures(rounds)}


def overhead_figures(rounds: list[dict[str, Any]]) -> dict[str, float]:
    """What rounds (`search_overhead`'s records) spent outside training and evaluation: launch to first step
    (imports, loading; compiling is in training), merge and save, promotion (copy, flush, the verifier's check; each
    part's mean in `promotion_parts`).
    Only rounds that ran every part count. The bench's random weights never beat the base model, so its trained
    rounds are not promoted: a promotion's seconds come from the rounds that were, round 0 (which trains nothing)
    among them, and `overhead_fraction` is a promoted round's, the worst case."""
    figures: dict[str, float] = {}
    promotions = [r["promotion_s"] for r in rounds if r["promotion_s"]]
    if promotions:
        figures["promotion_seconds"] = sum(promotions) / len(promotions)
    parts = [r["promotion_timings"] for r in rounds if "check" in r["promotion_timings"]]
    if parts:  # the mean of each part over the promotions that ran whole (the check is the last part), and of the
        # check's own parts where every one of them recorded them
        names = [*PROMOTION_PARTS, *(f"check_{part}" for part in CHECK_PARTS)]
        figures["promotion_parts"] = {name: sum(p[name] for p in parts) / len(parts) for name in names
                                      if all(name in p for p in parts)}  # fmt: skip
    whole = [r for r in rounds if all(key in r["timings"] for key in ("setup", "train", "save", "eval"))]
    if not whole:
        return figures
    overhead = [r["timings"]["setup"] + r["timings"]["save"] + r["promotion_s"] for r in whole]
    figures["overhead_seconds_per_round"] = sum(overhead) / len(overhead)
    figures["overhead_fraction_as_run"] = figures["overhead_seconds_per_round"] / ROUND_SECONDS
    figures["overhead_share_of_these_rounds"] = sum(overhead) / sum(r["duration_s"] for r in whole)
    if promotions:
        start_and_save = sum(r["timings"]["setup"] + r["timings"]["save"] for r in whole) / len(whole)
        figures["overhead_seconds_promoted_round"] = start_and_save + figures["promotion_seconds"]
        figures["overhead_fraction"] = figures["overhead_seconds_promoted_round"] / ROUND_SECONDS
    return figures


def _bench_budget(model: Path, box: Path, work: Path, minutes: float) -> Path:
    """budget.yaml with the box's paths, a short budget and short rounds."""
    budget = yaml.safe_load((ROOT / "budget.yaml").read_text())
    budget.update(
        hours=minutes / 60,
        reserve_minutes=1,
        round_min_minutes=1.5,
        round_max_minutes=5,
        hang_minutes=5,
        duration_prior_scale=1.0,  # search/duration.py's priors are H200 measurements
        gpus="auto",
        model_path=str(model),
        train_path=str(box / "train"),
        val_path=str(box / "val"),
        ood_val_path=str(box / "ood_val"),
        submission_path=str(work / "submission"),
        runs_dir=str(work / "runs"),
        study_name="bench-2b",
        storage=str(work / "study.db"),
        # What this section measures is outside training and evaluation, so both are made short: one evaluation
        # process per round (no val health check, no in-round pruning evaluations) on the dynamic cache, and
        # nothing compiled, whose cold start in a fresh machine would leave one device call no time for a trained round.
        prune_rows=32,
        prune_every=0,
        val_rows=0,
        eval_static_cache=False,
        eval_batch_size=None,
        min_format_rate=0,  # random weights never answer in the format
        keep_rounds=1,
    )
    budget["fixed"].update(compile_rollouts=False, compile_training=False)
    budget["space"]["steps"] = {"low": 10, "high": 40, "step": 10}
    for recipe in budget["warm_starts"]:
        recipe["params"]["steps"] = 20
    path = work / "budget.yaml"
    work.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(budget, sort_keys=False))
    return path


# ---------------------------------------------------------------------------------------------------- pieces
def _model(folder: Path) -> Path:
    if not (folder / "config.json").exists():
        from synthetic.models import build_model

        build_model(folder, size="2b", seed=0)
        os.sync()  # a freshly written 4.4 GB model is still being flushed to disk; that slowed the first timings
    return folder


def _split(folder: Path, rows: int, kind: str = "other") -> Path:
    if not folder.exists():
        from synthetic.splits import write_split

        write_split(folder, kind, rows, seed=0, image_size=(480, 320))
    return folder


def _machine() -> dict[str, Any]:
    import peft
    import transformers
    import trl

    return {
        "gpu": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(),
        "versions": {m.__name__: m.__version__ for m in (torch, transformers, trl, peft)},
    }


if __name__ == "__main__":
    sys.exit(main())
