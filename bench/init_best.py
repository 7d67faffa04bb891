"""Do rounds that continue the best round so far (`init: best`) give a better model than rounds that all start from
the base, in the same budget? Demo searches with the same budget file and seed that differ only in `space.init`,
their promoted models scored on the same fresh rows of both held-out kinds (other renderer, compositional), rows no
search saw; then paired differences between the arms.

    python bench/init_best.py --arm base --hours 0.2 --out built/init-best/base.json       # init: [base]
    python bench/init_best.py --arm searched --hours 0.2 --out built/init-best/searched.json  # init: [base, best]
    python bench/init_best.py --compare built/init-best/base.json built/init-best/searched.json

One arm per call, so that each fits a device call; an arm's file keeps the per-row correctness of its promoted model
(and of the base with --score-base), and --compare pairs them row by row. Arms: `base` pins init to base, `searched`
lets the sampler choose (the default budget's space), `forced` pins it to best (the warm starts, which run while the
base is being scored, then start from the base all the same).
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
from bench.search_vs_baseline import KINDS, machine  # noqa: E402
from search.settings import DEMO_BUDGET  # noqa: E402

ARMS = {"base": "[base]", "searched": "[base, best]", "forced": "[best]"}


def budget_copy(work: Path, arm: str) -> Path:
    """The demo's budget with the study, runs and submission under `work`, and `space.init` set for `arm`."""
    text = DEMO_BUDGET.read_text()
    overrides = {r"^storage:.*$": f"storage: {work / 'study.db'}", r"^runs_dir:.*$": f"runs_dir: {work / 'runs'}",
                 r"^submission_path:.*$": f"submission_path: {work / 'submission'}",
                 r"^study_name:.*$": f"study_name: init-{arm}", r"^  init: \[.*\]$": f"  init: {ARMS[arm]}"}  # fmt: skip
    for pattern, line in overrides.items():
        text, found = re.subn(pattern, line, text, flags=re.MULTILINE)
        if found != 1:
            raise ValueError(f"{DEMO_BUDGET}: {found} lines match {pattern!r}; expected one")
    if "base" not in ARMS[arm]:  # the warm starts' `init: base` is outside this space: they take best (the base then)
        text = re.sub(r"^      init: base\n", "", text, flags=re.MULTILINE)
    work.mkdir(parents=True, exist_ok=True)
    path = work / "budget.yaml"
    path.write_text(text)
    return path


def run_arm(arm: str, hours: float, work: Path, n_eval: int, seed: int, device: str, score_base: bool) -> dict:
    budget = budget_copy(work / arm, arm)
    command = [sys.executable, str(ROOT / "run_search.py"), "--demo", "--budget", str(budget), "--hours", str(hours)]
    print("$", " ".join(command), flush=True)
    search = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    print(search.stdout[-4000:], search.stderr[-2000:], sep="\n", flush=True)
    if search.returncode != 0:
        raise SystemExit(f"the {arm} search exited with {search.returncode}")
    from search.report import why_it_won
    from search.promotion import promoted
    from search.settings import load_settings
    from search.study import load_existing_study

    settings = load_settings(budget)
    study = load_existing_study(settings)
    marker = promoted(settings.submission_path)
    result: dict[str, Any] = {
        "arm": arm, "init": ARMS[arm], "hours": hours, "machine": machine(device), "exit_code": search.returncode,
        "why": why_it_won(study), "promoted": marker and {k: marker.get(k) for k in ("trial", "recipe", "accuracy")},
        "trials": [{"trial": t.number, "recipe": t.user_attrs.get("recipe"), "state": t.user_attrs.get("state"),
                    "ood_val": t.value, "init": t.params.get("init"), "parent": t.user_attrs.get("parent"),
                    "total_steps": t.user_attrs.get("total_steps")} for t in study.get_trials(deepcopy=False)],
        "kinds": {},
    }  # fmt: skip
    models = {"promoted": Path(settings.submission_path)} if marker else {}
    if score_base:
        models["base"] = Path(settings.model_path)
    from synthetic.splits import write_split
    from synthetic.teach import Recipe

    recipe = Recipe()  # the demo box's image size and counts
    for kind in KINDS:
        split = work / f"{kind}-{n_eval}-seed{seed}"
        if not split.is_dir():
            write_split(split, kind, n_eval, seed, recipe.image_size, recipe.count_range)
        batch = 128 if device.startswith("cuda") else 32
        scores = {name: score(path, split, batch_size=batch, device=device) for name, path in models.items()}
        result["kinds"][kind] = {name: {**accuracy_entry(s), "per_row": s["correct"]} for name, s in scores.items()}
    return result


def compare(paths: list[Path]) -> str:
    arms = [json.loads(path.read_text()) for path in paths]
    lines = []
    for arm in arms:
        promoted = arm["promoted"] or {}
        lines.append(f"{arm['arm']:9s} ({arm['machine']}, {arm['hours']} h, {len(arm['trials'])} trials): promoted "
                     f"trial {promoted.get('trial')} ({promoted.get('recipe')}, {promoted.get('accuracy')} on ood_val)")
        lines.append(f"          {arm['why'][:300]}")
        for kind, entry in arm["kinds"].items():
            for model, e in entry.items():
                lines.append(f"          {kind:13s} {model:8s} {e['correct']:4d}/{e['n']:<4d} = {e['accuracy']:5.1f}% "
                             f"[{e['ci'][0]:5.1f}, {e['ci'][1]:5.1f}]")
    first = arms[0]
    for other in arms[1:]:
        for kind in KINDS:
            a, b = first["kinds"][kind].get("promoted"), other["kinds"][kind].get("promoted")
            if a and b:
                d = paired_difference(a["per_row"], b["per_row"])
                lines.append(f"{other['arm']} - {first['arm']:9s} {kind:13s} {d['diff']:+5.1f} pts "
                             f"[{d['low']:+5.1f}, {d['high']:+5.1f}] on {d['n']} rows")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arm", choices=sorted(ARMS), help="run one arm's search and score its promoted model")
    parser.add_argument("--compare", nargs="+", type=Path, help="arm files to pair (the first is the reference)")
    parser.add_argument("--hours", type=float, default=0.2, help="each search's wall-clock budget")
    parser.add_argument("--work", type=Path, default=ROOT / "built" / "init-best")
    parser.add_argument("--n-eval", type=int, default=1000, help="fresh rows scored per kind")
    parser.add_argument("--seed", type=int, default=1, help="seed of the scored rows (not the demo box's)")
    parser.add_argument("--device", default="cpu", help="where the models are scored (cpu, cuda)")
    parser.add_argument("--score-base", action="store_true", help="score the taught base model too")
    parser.add_argument("--out", type=Path, help="write the arm's result (JSON) here")
    args = parser.parse_args(argv)
    if args.compare:
        print(compare(args.compare))
        return 0
    if not args.arm:
        parser.error("give --arm or --compare")
    result = run_arm(args.arm, args.hours, args.work.resolve(), args.n_eval, args.seed, args.device, args.score_base)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result) + "\n")
    print(compare([args.out]) if args.out else json.dumps({k: v for k, v in result.items() if k != "kinds"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
