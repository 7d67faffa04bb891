"""With the same budget, does the search beat the inherited baseline? `run_search.py --demo` under --hours, then the
model it promoted against the round its `baseline` warm start trained (the inherited configuration, in the same
study, on the same box and model), both scored on the same fresh rows of the synthetic different-renderer ("other")
and compositional splits, rows the search never saw (another seed than the demo box's).

    python bench/search_vs_baseline.py --hours 0.5 --work built/search-vs-baseline --out results.jsonl

The search runs as the user runs it (a subprocess of run_search.py), with the demo's budget file copied under --work
with its own study, runs and submission folders, and every round's weights kept (`keep_rounds`) so that the baseline
round's merged model is still there to score. The demo's taught model and box (under ./built) are shared with the
demo and built by the search when missing. Figures: accuracy with its Wilson 95% interval, and the paired difference
promoted - baseline on the same rows with its 95% interval (bench/learning.py's statistics).

What it measured: bench/results/2026-12-03-search-vs-baseline-notes.md.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.learning import accuracy_entry, paired_difference, score  # noqa: E402
from search.settings import DEMO_BUDGET  # noqa: E402
from search.report import BASELINE  # noqa: E402  (the warm start the leaderboard compares against)

KINDS = ("other", "compositional")


def budget_copy(work: Path) -> Path:
    """The demo's budget file with the study, the runs and the submission under `work`, every round's weights kept."""
    overrides = {"storage": work / "study.db", "runs_dir": work / "runs", "submission_path": work / "submission",
                 "study_name": "search-vs-baseline", "keep_rounds": 1000}
    path = work / "budget.yaml"
    path.write_text(with_top_level_keys(DEMO_BUDGET.read_text(), overrides, DEMO_BUDGET))
    return path


def with_top_level_keys(text: str, values: dict, source: object) -> str:
    """A budget file's `text` with each top-level key of `values` set to its value, the rest of the file as it was
    (its comments too); each key must appear once at the top level of `source`."""
    for key, value in values.items():
        text, found = re.subn(rf"^{key}:.*$", f"{key}: {value}", text, flags=re.MULTILINE)
        if found != 1:
            raise ValueError(f"{source} has {found} top-level {key!r} keys; expected one")
    return text


def run_search(budget: Path, hours: float) -> None:
    command = [sys.executable, str(ROOT / "run_search.py"), "--demo", "--budget", str(budget), "--hours", str(hours)]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, cwd=ROOT, check=True)


def arms(settings, study) -> dict[str, Path]:
    """The model folders compared: the taught base, the promoted model, the baseline round's merged model."""
    from search.promotion import promoted
    from trainer.run_folder import MERGED_DIR

    marker = promoted(settings.submission_path)
    if marker is None:
        raise SystemExit(f"the search promoted nothing into {settings.submission_path}")
    baselines = [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("recipe") == BASELINE]
    merged = [Path(t.user_attrs["run_dir"]) / MERGED_DIR for t in baselines if "run_dir" in t.user_attrs]
    merged = [m for m in merged if (m / "config.json").is_file()]
    if not merged:
        states = [(t.number, t.user_attrs.get("state"), t.user_attrs.get("reason")) for t in baselines]
        raise SystemExit(f"no finished baseline round with its weights in the study: {states}")
    print(f"promoted: trial {marker['trial']} ({marker['accuracy']:.1f}% on ood_val); baseline: {merged[0].parent}")
    return {"base": Path(settings.model_path), "promoted": Path(settings.submission_path), "baseline": merged[0]}


def trials(study) -> list[dict[str, Any]]:
    """Every trial of the search: its recipe, state and ood_val accuracy (what it was selected on)."""
    return [{"trial": t.number, "recipe": t.user_attrs.get("recipe"), "state": t.state.name, "ood_val": t.value,
             "steps": t.params.get("steps"), "lora_rank": t.params.get("lora_rank")}
            for t in study.get_trials(deepcopy=False)]


def machine(device: str) -> str:
    import os

    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name()
    return f"cpu, {os.cpu_count()} cores"


def compare(models: dict[str, Path], work: Path, n_eval: int, seed: int, device: str) -> dict[str, Any]:
    import datasets

    from synthetic.splits import write_split
    from synthetic.teach import Recipe

    datasets.disable_progress_bars()
    recipe = Recipe()  # the demo box's image size and counts
    result: dict[str, Any] = {"models": {k: str(v) for k, v in models.items()}, "kinds": {}}
    for kind in KINDS:
        split = work / f"{kind}-{n_eval}-seed{seed}"
        if not split.is_dir():
            write_split(split, kind, n_eval, seed, recipe.image_size, recipe.count_range)
        scores = {arm: score(model, split, device=device) for arm, model in models.items()}
        entry: dict[str, Any] = {arm: accuracy_entry(s) for arm, s in scores.items()}
        entry["promoted_minus_baseline"] = paired_difference(scores["baseline"]["correct"],
                                                             scores["promoted"]["correct"])
        entry["promoted_minus_base"] = paired_difference(scores["base"]["correct"], scores["promoted"]["correct"])
        entry["baseline_minus_base"] = paired_difference(scores["base"]["correct"], scores["baseline"]["correct"])
        result["kinds"][kind] = entry
    return result


def format_result(result: dict[str, Any]) -> str:
    lines = []
    for kind, entry in result["kinds"].items():
        for arm in ("base", "baseline", "promoted"):
            e = entry[arm]
            lines.append(f"  {kind:13s} {arm:9s} {e['correct']:4d}/{e['n']:<4d} = {e['accuracy']:5.1f}% "
                         f"[{e['ci'][0]:5.1f}, {e['ci'][1]:5.1f}]  format {100 * e['format_rate']:5.1f}%")
        for name in ("promoted_minus_baseline", "promoted_minus_base", "baseline_minus_base"):
            d = entry[name]
            lines.append(f"  {kind:13s} {name:24s} {d['diff']:+5.1f} pts [{d['low']:+5.1f}, {d['high']:+5.1f}]")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hours", type=float, default=0.5, help="the search's wall-clock budget")
    parser.add_argument("--work", type=Path, default=ROOT / "built" / "search-vs-baseline")
    parser.add_argument("--n-eval", type=int, default=300, help="rows scored per kind")
    parser.add_argument("--seed", type=int, default=1,
                        help="seed of the scored rows (not the demo box's: synthetic.demo.DEMO_BOX_SEED_OFFSET apart)")
    parser.add_argument("--device", default="cpu", help="where the models are scored (cpu, cuda)")
    parser.add_argument("--score-only", action="store_true", help="score the study already under --work")
    parser.add_argument("--out", type=Path, help="append the result as a JSON line here")
    args = parser.parse_args(argv)
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    budget = args.work / "budget.yaml" if args.score_only else budget_copy(args.work)
    if not args.score_only:
        run_search(budget, args.hours)
    from search.settings import load_settings
    from search.study import load_existing_study

    settings = load_settings(budget)
    study = load_existing_study(settings)  # loaded once: the trials listed and the arms scored come from it
    result = {"hours": args.hours, "machine": machine(args.device), "trials": trials(study),
              **compare(arms(settings, study), args.work, args.n_eval, args.seed, args.device)}
    print(format_result(result), flush=True)
    append_line(args.out, result)
    return 0


def append_line(path: Path | None, result: dict[str, Any]) -> None:
    """`result` appended to `path` as one JSON line (nothing without a path)."""
    if path is not None:
        with path.open("a") as handle:
            handle.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    sys.exit(main())
