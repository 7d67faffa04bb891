"""Does the merge stage hand in a better model than the best single round? `run_search.py --demo` with the stage off
(its rounds get the whole budget), then the stage by hand on its kept rounds (`run_search.py merge`), then the best
trained round (what the search hands in without the stage) against every merge candidate the stage built, the
stage's choice among them and the submission, all scored on the same fresh rows of the synthetic compositional and
different-renderer splits (another seed than the demo box's: rows no round or stage saw).

    python bench/merge_vs_best.py --hours 0.3 --sampler-seeds 0 1 2 --out bench/results/DATE-cpu-merge-vs-best.jsonl

Each sampler seed is one search (the demo's taught model and box are the same; its rounds differ). Every round's
weights are kept (`keep_rounds`); the stage deletes the weights of candidates beaten on its selection rows, so those
are built again from their ingredients with search.merge.soup (the same build, so the same weights). Figures: accuracy with
its Wilson 95% interval, and each arm minus the best round on the same rows with its paired 95% interval
(bench/learning.py's statistics).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.learning import accuracy_entry, paired_difference, score  # noqa: E402
from bench.search_vs_baseline import KINDS, append_line, budget_copy, machine, run_search  # noqa: E402


def seeded_budget(work: Path, sampler_seed: int) -> Path:
    """The demo's budget under `work` (search_vs_baseline.budget_copy), with the stage off (it runs by hand after the
    search) and this sampler seed."""
    path = budget_copy(work)
    text = path.read_text()
    for pattern, line in ((r"^  seed: \d+$", f"  seed: {sampler_seed}"), (r"^  enabled: \w+$", "  enabled: false")):
        text, found = re.subn(pattern, line, text, flags=re.MULTILINE)
        if found != 1:
            raise ValueError(f"{path} has {found} lines like {pattern!r}; expected one")
    path.write_text(text)
    return path


def merge_by_hand(budget: Path) -> None:
    command = [sys.executable, str(ROOT / "run_search.py"), "merge", "--budget", str(budget)]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, cwd=ROOT, check=True)


def arms(settings, study, work: Path) -> tuple[dict[str, Path], dict[str, Any]]:
    """The model folders compared (the best round, each merge candidate, the submission) and what the stage did."""
    from optuna.trial import TrialState

    from search.promotion import promoted
    from search.merge import MergeSpec, build
    from trainer.run_folder import MERGED_DIR

    done = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE and t.value is not None]
    rounds = [t for t in done if t.user_attrs.get("recipe") not in ("base", "merge")]
    candidates = [t for t in done if t.user_attrs.get("recipe") == "merge"]
    if not rounds:
        raise SystemExit("the search completed no trained round")
    if not candidates:
        raise SystemExit("the search built no merge candidate (too little time left for the stage?)")
    best = max(rounds, key=lambda t: (t.value, -t.number))
    folders = {t.number: Path(t.user_attrs["run_dir"]) / MERGED_DIR for t in done if "run_dir" in t.user_attrs}
    models = {"base": Path(settings.model_path), f"round{best.number}": folders[best.number]}
    for t in candidates:
        folder = folders[t.number]
        if not (folder / "config.json").is_file():  # beaten on the selection rows: its weights were deleted
            folder = work / "rebuilt" / f"round-{t.number:04d}"
            if not (folder / "config.json").is_file():
                spec = MergeSpec(tuple(str(folders[n]) for n in t.user_attrs["ingredients"]), settings.model_path,
                                 float(t.user_attrs["eta"]))  # fmt: skip
                build(spec, folder)
        models[f"merge{t.number}"] = folder
    marker = promoted(settings.submission_path)
    models["submission"] = Path(settings.submission_path)
    stage = {
        "best_round": best.number,
        "best_round_ood_val": best.value,
        "submission_trial": marker["trial"] if marker else None,
        "candidates": [{"trial": t.number, "kind": t.user_attrs.get("merge_kind"), "ingredients":
                        t.user_attrs.get("ingredients"), "eta": t.user_attrs.get("eta"), "ood_val": t.value,
                        "selection_accuracy": t.user_attrs.get("selection_accuracy"),
                        "held_out_lead": t.user_attrs.get("held_out_lead"), "chosen": t.user_attrs.get("merge_chosen"),
                        "decision": t.user_attrs.get("merge_decision")} for t in candidates],
    }  # fmt: skip
    return models, stage


def compare(models: dict[str, Path], reference: str, work: Path, n_eval: int, seed: int, device: str) -> dict:
    """Every arm scored on `n_eval` fresh rows of each kind, and its paired difference from `reference`."""
    import datasets

    from synthetic.splits import write_split
    from synthetic.teach import DEMO_RECIPE

    datasets.disable_progress_bars()
    result: dict[str, Any] = {"models": {k: str(v) for k, v in models.items()}, "reference": reference, "kinds": {}}
    for kind in KINDS:
        split = work.parent / f"{kind}-{n_eval}-seed{seed}"
        if not split.is_dir():
            write_split(split, kind, n_eval, seed, DEMO_RECIPE.image_size, DEMO_RECIPE.count_range)
        scores = {arm: score(model, split, device=device) for arm, model in models.items()}
        entry: dict[str, Any] = {arm: accuracy_entry(s) for arm, s in scores.items()}
        entry["minus_reference"] = {arm: paired_difference(scores[reference]["correct"], s["correct"])
                                    for arm, s in scores.items() if arm != reference}  # fmt: skip
        result["kinds"][kind] = entry
    return result


def format_result(result: dict[str, Any]) -> str:
    chosen = {f"merge{c['trial']}" for c in result["stage"]["candidates"] if c["chosen"]}
    kinds = {f"merge{c['trial']}": f"{c['kind']} {'+'.join(map(str, c['ingredients']))} eta {c['eta']:g}"
             for c in result["stage"]["candidates"]}  # fmt: skip
    lines = [f"sampler seed {result['sampler_seed']}: best round {result['stage']['best_round']}, submission holds "
             f"trial {result['stage']['submission_trial']}"]  # fmt: skip
    for kind, entry in result["kinds"].items():
        for arm in result["models"]:
            e = entry[arm]
            label = arm + (" (chosen)" if arm in chosen else "")
            line = f"  {kind:13s} {label:18s} {e['accuracy']:5.1f}% [{e['ci'][0]:5.1f}, {e['ci'][1]:5.1f}]"
            if arm in entry["minus_reference"]:
                d = entry["minus_reference"][arm]
                line += f"  {d['diff']:+5.1f} [{d['low']:+5.1f}, {d['high']:+5.1f}]"
            lines.append(line + (f"  {kinds[arm]}" if arm in kinds else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hours", type=float, default=0.2, help="each search's wall-clock budget")
    parser.add_argument("--sampler-seeds", type=int, nargs="+", default=[0], help="one search per seed")
    parser.add_argument("--work", type=Path, default=ROOT / "built" / "merge-vs-best")
    parser.add_argument("--n-eval", type=int, default=1000, help="fresh rows scored per kind")
    parser.add_argument("--seed", type=int, default=1,
                        help="seed of the scored rows (not the demo box's: synthetic.demo.DEMO_BOX_SEED_OFFSET apart)")
    parser.add_argument("--device", default="cpu", help="where the models are scored (cpu, cuda)")
    parser.add_argument("--score-only", action="store_true", help="score the studies already under --work")
    parser.add_argument("--out", type=Path, help="append each search's result as a JSON line here")
    args = parser.parse_args(argv)
    from search.settings import load_settings
    from search.study import load_existing_study

    for sampler_seed in args.sampler_seeds:
        work = (args.work / f"sampler-seed-{sampler_seed}").resolve()
        work.mkdir(parents=True, exist_ok=True)
        budget = work / "budget.yaml" if args.score_only else seeded_budget(work, sampler_seed)
        if not args.score_only:
            run_search(budget, args.hours)
            merge_by_hand(budget)
        settings = load_settings(budget)
        study = load_existing_study(settings)
        models, stage = arms(settings, study, work)
        result = {"hours": args.hours, "sampler_seed": sampler_seed, "machine": machine(args.device), "stage": stage,
                  **compare(models, f"round{stage['best_round']}", work, args.n_eval, args.seed, args.device)}
        print(format_result(result), flush=True)
        append_line(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
