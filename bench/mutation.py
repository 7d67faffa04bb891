"""Mutation run over the modules that hold a user's promises, each with its targeted (fast) tests.

    pip install -e '.[mutation]'                 # mutmut, pinned in pyproject.toml
    python bench/mutation.py [--targets NAME ...] [--out FILE] [--list]

Each target is run by mutmut (one worker process: `--max-children 1`) in a scratch copy of this working tree
(`.mutation/<target>/`, git-ignored, made afresh each run): mutmut writes its trampolined copy under
`.mutation/<target>/mutants/`, so the working tree itself is never mutated, and nothing is left in it but the
ignored scratch folder. The tests' subprocesses import the scratch copy's unmutated code (PYTHONPATH), as they
import the project's when the suite runs.

Per target it prints (and with --out writes, as JSON) killed / survived / timeout / no tests / other, the % killed
and the seconds the run took, then each survivor: file, line and the mutation (mutmut's diff of the function).
`--list` only generates the mutants and counts them (seconds), to budget a run before starting it.

To re-point a target after a module moves, edit TARGETS below: the module's path, its test files, and optionally
the functions whose mutants run (`Class.method` or `function`; none: every function of the module), tests to leave
out (slow ones whose subject runs in a subprocess mutmut cannot reach), and a seeded random sample size.
mutmut mutates the bodies of functions and methods only: module-level constants and tables are not mutated.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRATCH = ROOT / ".mutation"
EXTRA_TESTS = ["tests/test_mutants.py"]  # tests written for this run's survivors, given to every target


@dataclasses.dataclass(frozen=True)
class Target:
    module: str  # path of the module to mutate, from the repository root
    tests: tuple[str, ...]  # its targeted test files (EXTRA_TESTS are added)
    functions: tuple[str, ...] = ()  # only these functions' mutants ("name" or "Class.method"); () = all
    deselect: tuple[str, ...] = ()  # test ids left out (pytest --deselect)
    sample: int | None = None  # a seeded random sample of this many mutants, or all
    # Each mutant's tests in a process that has collected nothing yet (mutmut's fork server, no warm-up): for test
    # modules that cannot be collected twice in one process (pytest then answers "not found", exit code 4).
    fresh_collection: bool = False


_SLOW_REAL_MODEL = "loads a real model in a checker subprocess, where no mutant runs"

TARGETS: dict[str, Target] = {
    "protocol": Target("evaluator/protocol.py", ("tests/test_protocol.py",)),
    "rewards": Target("trainer/rewards.py", ("tests/test_rewards.py",), fresh_collection=True, sample=40),
    "promotion": Target(
        "search/promotion/submission.py",
        ("tests/test_promotion.py", "tests/test_kept_promises.py", "tests/test_folders.py"),
        # the folder promises: what is swapped in, kept aside, kept, restored, pruned or deleted
        functions=("promote", "promoted", "recover_submission", "_recover", "restore_previous", "prune_run_dirs",
                   "delete_weights", "_swap_in", "_keep_aside", "_found_files", "_keep", "_replace_contents",
                   "final_check", "check_submission", "_old_path", "_previous_path"),
        deselect=("tests/test_promotion.py::test_promote_with_the_real_check",  # _SLOW_REAL_MODEL
                  "tests/test_promotion.py::test_check_submission_loads_a_real_model"),
        sample=100,
    ),
    "selection": Target(
        "search/selection.py",
        ("tests/test_kept_promises.py", "tests/test_leaderboard.py", "tests/test_merge_stage.py"),
    ),
    "folders": Target("search/folders.py", ("tests/test_folders.py", "tests/test_settings.py")),
    "verification": Target(
        "search/promotion/verification.py",
        ("tests/test_verification.py",),
        # the answers check as the search sees it; `_check` runs in the checker subprocess, out of mutmut's reach
        functions=("expected_answers", "allowed_disagreements", "verify"),
        deselect=tuple(f"tests/test_verification.py::{name}" for name in (  # _SLOW_REAL_MODEL
            "test_a_model_passes_when_it_answers_as_recorded_and_fails_otherwise",
            "test_a_corrupted_weights_file_does_not_load",
            "test_the_final_check_restores_the_previous_submission",
            "test_a_checker_started_ahead_serves_the_next_check_and_another_takes_its_place",
            "test_a_waiting_checker_ends_with_the_search_that_started_it",
            "test_a_checker_started_ahead_runs_on_the_gpus_its_request_names")),
    ),
    "settings": Target(
        "search/settings.py",
        ("tests/test_settings.py", "tests/test_bad_input.py"),
        # The bounds of the settings' values that run when a budget is read. Not here: _number, _integer, _optional,
        # _integer_option and _factory, which build the checks' tables when the module is imported: mutmut forks its
        # mutants from a process that imported it already, and credits import-time calls to whichever test runs
        # first, so their mutants can be neither reached nor matched with their tests. The closures they return call
        # trainer/validation.py (the "validation" target) at run time; tests/test_mutants.py tries each bound's edge.
        functions=("_boolean_option", "_percentile", "_max_resource", "_check_merge", "_text", "_path", "_hours_text",
                   "_hours", "_hyperband_resources", "_resolve_gpus", "_check_gpus_per_trial", "_resolve_prior_scale"),
        # the cases that run the program in a subprocess (its imports, no hang): mutmut's trampolines cannot run
        # there, and their bounds are the same functions the in-process cases reach
        deselect=tuple(f"tests/test_bad_input.py::test_bad_input_is_refused_in_one_line_and_leaves_nothing[{case}]"
                       for case in ("hours_1e300", "study_name_not_utf8", "storage_not_utf8", "budget_is_a_fifo",
                                    "budget_alias_bomb", "model_without_weights", "storage_is_a_fifo",
                                    "storage_unreachable_url")),
        sample=60,
    ),
    # The checks the settings' bounds call
    "validation": Target(
        "common/validation.py",
        ("tests/test_settings.py", "tests/test_bad_input.py"),
        functions=("is_number", "number", "integer", "boolean", "text", "one_of", "mapping", "_bounds"),
        deselect=(),  # filled below: the settings target's
        sample=40,
    ),
    # The scheduler's time and parent logic: its launches and polls, the allotment of a round's time, the parent.
    # (end_of_stage and end_of_rounds are properties, which mutmut does not mutate; tests/test_mutants.py tests them.)
    "scheduler": Target(
        "search/scheduler.py",
        ("tests/test_scheduler.py",),
        functions=("Scheduler._launch", "Scheduler._launch_base", "Scheduler._misfit", "Scheduler._poll"),
        sample=30,  # a surviving mutant runs the whole file (~35 s alone, more under load)
    ),
    "allotment": Target("search/allotment.py", ("tests/test_scheduler.py",), sample=20),
    "lineage": Target("search/lineage.py", ("tests/test_scheduler.py", "tests/test_merge_search.py"),
                      functions=("parent_of", "promotable", "base_waiting"), sample=20),
    "rounds": Target("search/rounds.py", ("tests/test_scheduler.py",),
                     functions=("RunningRound.overdue", "RunningRound.due_to_stop", "RunningRound.outcome"),
                     sample=20),
}

TARGETS["validation"] = dataclasses.replace(TARGETS["validation"], deselect=TARGETS["settings"].deselect)

SOURCE_PATHS = ["common", "evaluator", "trainer", "search", "synthetic", "run_search.py"]  # importable from mutants/
ALSO_COPY = ["bench", "docs", "budget.yaml", "demo_budget.yaml", "README.md"]  # what tests read besides

_GENERATE = """
import sys
from mutmut.__main__ import create_mutants
from mutmut.utils.file_utils import copy_src_dir, copy_also_copy_files, setup_source_paths
from mutmut.mutation.trampoline import set_mutant_under_test
set_mutant_under_test("mutant_generation")
copy_src_dir(); copy_also_copy_files(); setup_source_paths(); create_mutants(1)
"""


def _status(code: int | None) -> str:
    from mutmut.stats import status_by_exit_code

    return status_by_exit_code[code]


def _patterns(target: Target) -> list[str]:
    module = target.module[: -len(".py")].replace("/", ".")
    patterns = []
    for name in target.functions:
        cls, _, function = name.rpartition(".")
        patterns.append(f"{module}.xǁ{cls}ǁ{function}__mutmut_*" if cls else f"{module}.x_{function}__mutmut_*")
    return patterns


def _toml_list(values: list[str]) -> str:
    return "[" + ", ".join(json.dumps(v) for v in values) + "]"


def _scratch(name: str, target: Target) -> Path:
    """A fresh copy of the working tree's files (tracked and untracked, not ignored), with mutmut's config."""
    work = SCRATCH / name
    shutil.rmtree(work, ignore_errors=True)
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")  # fmt: skip
    for file in filter(None, files):
        source = ROOT / file
        if source.is_file():
            (work / file).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, work / file)
    tests = list(target.tests) + [t for t in EXTRA_TESTS if (ROOT / t).exists() and t not in target.tests]
    extra_args = ["-p", "no:cacheprovider"] + [arg for test in target.deselect for arg in ("--deselect", test)]
    with open(work / "pyproject.toml", "a") as f:
        f.write("\n[tool.mutmut]\n"
                f"source_paths = {_toml_list(SOURCE_PATHS)}\n"
                f"only_mutate = {_toml_list([target.module])}\n"
                f"also_copy = {_toml_list(ALSO_COPY)}\n"
                f"pytest_add_cli_args_test_selection = {_toml_list(tests)}\n"
                f"pytest_add_cli_args = {_toml_list(extra_args)}\n"
                "use_setproctitle = false\n")  # fmt: skip
        if target.fresh_collection:
            f.write('process_isolation = "forkserver"\nforkserver_warmup = "none"\n')
    return work


def _env(work: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(work), "PYTHONDONTWRITEBYTECODE": "1"}


def _meta(work: Path, target: Target) -> dict[str, int | None]:
    with open(work / "mutants" / (target.module + ".meta")) as f:
        return json.load(f)["exit_code_by_key"]


def _selected(names: list[str], target: Target, seed: int) -> list[str]:
    patterns = _patterns(target)
    chosen = [n for n in names if not patterns or any(fnmatch.fnmatch(n, p) for p in patterns)]
    if target.sample is not None and target.sample < len(chosen):
        chosen = sorted(random.Random(seed).sample(sorted(chosen), target.sample))
    return chosen


def _where(work: Path, name: str) -> tuple[int | None, str]:
    """(line in the module, the mutation as mutmut's diff) of one mutant."""
    diff = subprocess.run([sys.executable, "-m", "mutmut", "show", name], cwd=work, env=_env(work),
                          capture_output=True, text=True).stdout  # fmt: skip
    body = [line for line in diff.splitlines() if not line.startswith(("# ", "---", "+++"))]
    changed = [line for line in body if line.startswith(("-", "+"))]
    line_number = None
    removed = next((line[1:] for line in changed if line.startswith("-")), None)
    if removed is not None:
        source = (work / name_module_path(name)).read_text().splitlines()
        hits = [i + 1 for i, text in enumerate(source) if text.strip() == removed.strip()]  # methods: dedented
        line_number = hits[0] if len(hits) == 1 else None
        if len(hits) > 1:  # several identical lines: the one inside the mutated function
            start = _function_start(source, name)
            line_number = next((h for h in hits if h >= start), hits[0])
    return line_number, "\n".join(changed)


def name_module_path(name: str) -> str:
    module = name.partition("__mutmut_")[0].rpartition(".")[0]
    return module.replace(".", "/") + ".py"


def _function_start(source: list[str], name: str) -> int:
    key = name.partition("__mutmut_")[0].rpartition(".")[2]
    function = key.rpartition("ǁ")[2] if "ǁ" in key else key[2:]
    pattern = re.compile(rf"^\s*(async\s+)?def {re.escape(function)}\(")
    return next((i + 1 for i, text in enumerate(source) if pattern.match(text)), 1)


def run_target(name: str, target: Target, *, seed: int, only_list: bool) -> dict:
    work = _scratch(name, target)
    began = time.monotonic()
    subprocess.run([sys.executable, "-c", _GENERATE], cwd=work, env=_env(work), check=True,
                   capture_output=True)  # fmt: skip
    names = _selected(list(_meta(work, target)), target, seed)
    result = {"target": name, "module": target.module, "tests": list(target.tests), "functions": list(target.functions),
              "deselected": list(target.deselect), "sample": target.sample, "mutants": len(names)}  # fmt: skip
    if only_list:
        return result
    log = work / "mutmut-run.log"
    with open(log, "w") as out:
        rc = subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", "1", *names], cwd=work,
                            env=_env(work), stdout=out, stderr=subprocess.STDOUT).returncode  # fmt: skip
    seconds = time.monotonic() - began
    codes = _meta(work, target)
    statuses = {n: _status(codes.get(n)) for n in names}
    counts: dict[str, int] = {}
    for status in statuses.values():
        counts[status] = counts.get(status, 0) + 1
    killed = counts.get("killed", 0)
    survivors = []
    if rc != 0 or counts.get("not checked", 0) == len(names):  # mutmut stopped before the mutants: see the log
        result.update(mutmut_rc=rc, seconds=round(seconds, 1), error=f"mutmut exited {rc}: see {log}")
        return result
    for n in sorted(n for n, s in statuses.items() if s not in ("killed", "timeout")):
        line, mutation = _where(work, n)
        survivors.append({"mutant": n, "status": statuses[n], "file": target.module, "line": line,
                          "mutation": mutation})  # fmt: skip
    result.update(mutmut_rc=rc, seconds=round(seconds, 1), killed=killed, survived=counts.get("survived", 0),
                  timeout=counts.get("timeout", 0), no_tests=counts.get("no tests", 0),
                  other={s: c for s, c in counts.items() if s not in ("killed", "survived", "timeout", "no tests")},
                  killed_pct=round(100.0 * killed / len(names), 1) if names else None,
                  survivors=survivors, log=str(log.relative_to(ROOT)))  # fmt: skip
    return result


def _print(result: dict) -> None:
    if "error" in result:
        print(f"{result['target']}: {result['mutants']} mutants, not run: {result['error']}", flush=True)
        return
    if "killed" not in result:
        print(f"{result['target']}: {result['mutants']} mutants ({result['module']})", flush=True)
        return
    print(f"{result['target']}: {result['mutants']} mutants, {result['killed']} killed, {result['survived']} survived,"
          f" {result['timeout']} timeout, {result['no_tests']} no tests, other {result['other']};"
          f" {result['killed_pct']}% killed; {result['seconds']} s (mutmut rc {result['mutmut_rc']})")  # fmt: skip
    for s in result["survivors"]:
        print(f"  {s['status']}: {s['file']}:{s['line']} {s['mutant']}")
        for line in s["mutation"].splitlines():
            print(f"      {line}")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", nargs="+", choices=sorted(TARGETS), default=list(TARGETS))
    parser.add_argument("--out", type=Path, help="write the results as JSON lines here")
    parser.add_argument("--seed", type=int, default=34, help="of the sampled targets' samples")
    parser.add_argument("--list", action="store_true", help="only count each target's mutants")
    args = parser.parse_args(argv)
    try:
        import mutmut
    except ImportError:
        print("mutmut is not installed: pip install -e '.[mutation]'", file=sys.stderr)
        return 2
    print(f"mutmut {mutmut.__version__ if hasattr(mutmut, '__version__') else '?'}", flush=True)
    results = []
    for name in args.targets:
        result = run_target(name, TARGETS[name], seed=args.seed, only_list=args.list)
        _print(result)
        results.append(result)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
