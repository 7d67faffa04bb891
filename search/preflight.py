"""`python run_search.py check`: before the long search, does a real round fit and train on this box? In minutes.

1. the box check (search.settings.check_box, before: bad input is one line and exit code 2);
2. the heaviest configuration of the space that the fit check admits (search.backends.fit) on each slot's card;
3. on every slot at once, a real round of that configuration: 2 steps on the real model and data, saved and merged,
   then the evaluation of CHECK_OOD_ROWS ood_val rows, exactly as the search runs rounds (search.backends.local);
4. the free disk against what the search keeps: the submission, `keep_rounds` and the best round, the merge stage's
   top_k ingredients and a candidate, and the rounds running at once, each the size of the base model;
5. the rounds the budget is predicted to hold: the scheduler's duration model, refitted on the check's own setup,
   steps and save.

It prints one table; exit code 0 when everything passed, else the failing row's line on stderr and 1. Nothing of the
study is read or written; the check's round folders (under runs_dir/<study>/preflight) are deleted after it.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import optuna

from search import space
from search.duration import DurationModel
from search.backends import FitCheck, LocalBackend, card_bytes_of, model_config
from search.log import warn
from search.settings import Settings
from trainer import memory
from trainer.config import TrialConfig
from common.validation import one_line

CHECK_STEPS = 2
CHECK_OOD_ROWS = 16
CHECK_TIMEOUT_S = 15 * 60  # a round of the check still running after this is killed and the check fails
PREFLIGHT_DIR = "preflight"


@dataclass
class Row:
    what: str
    ok: bool
    detail: str


def preflight(settings: Settings, say: Callable[[str], None] = print) -> int:
    """Run the check on a box that passed `check_box` and print its table; the exit code (0: passed, 1: a row
    failed)."""
    began = time.monotonic()
    rows = [Row("box", True, _box_text(settings))]
    check = FitCheck(lambda: model_config(settings.model_path), card_bytes_of(settings.gpu_memory_gb))
    config = heaviest_admitted(settings, check)
    if config is None:
        rows.append(Row("fit", False, "no configuration of the space fits its card"))
    else:
        round_rows, timings = _rounds(settings, config, check)
        rows += round_rows
    rows.append(_disk(settings))
    if config is not None and all(row.ok for row in rows):
        rows.append(_budget(settings, config, timings))
    say(_table(rows, time.monotonic() - began))
    failed = [row for row in rows if not row.ok]
    if failed:
        warn(f"check failed: {failed[0].what}: {failed[0].detail}")
        return 1
    return 0


# ---------------------------------------------------------------------------------------------------- the round
def candidates(settings: Settings) -> list[TrialConfig]:
    """The space's memory-heavy corners, from the first warm start's recipe (or the space's first choices): each LoRA
    rank, group size and image bound of the space, with and without the KL reference where the space has both."""
    recipe = dict(settings.warm_starts[0]["params"]) if settings.warm_starts else {}
    s = settings.space
    configs = []
    for rank in s["lora_rank"]:
        rate = s["learning_rate_lora" if rank > 0 else "learning_rate_full"]["low"]
        for group in s["num_generations"]:
            for pixels in s["max_pixels"]:
                for kl in (False, True):
                    corner = {**recipe, "lora_rank": rank, "learning_rate": rate, "num_generations": group,
                              "max_pixels": pixels, "beta": s["beta"]["high"] if kl else 0.0}  # fmt: skip
                    configs.append(_config(settings, corner))
    return configs


def _config(settings: Settings, recipe: dict) -> TrialConfig:
    """The TrialConfig the search would run for `recipe` (the options it leaves out as Optuna samples them)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # one in-memory study per candidate: no line each
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=settings.seed))
    study.enqueue_trial(space.warm_start_params(recipe, settings.space))
    run_dir = Path(settings.rounds_dir) / PREFLIGHT_DIR / "slot-0"
    return space.sample_config(study.ask(), settings, str(run_dir))


def heaviest_admitted(settings: Settings, check: FitCheck) -> TrialConfig | None:
    """Of `candidates`, the one of the highest predicted peak that `check` admits on the first slot's card (on the
    CPU, or a card of unknown memory: the one of the largest footprint)."""
    best, best_peak = None, -math.inf
    for config in candidates(settings):
        fit = check(config, settings.slots[0])
        if fit is None:  # nothing to check here: rank by the footprint of one process, nothing checkpointed
            completions = config.prompts_per_step * config.num_generations
            peak = memory.peak_bytes(memory.round_footprint(config, check.policy(config), completions), 0)
        elif fit.fits:
            peak = fit.plan.peak_bytes
        else:
            continue
        if peak > best_peak:
            best, best_peak = config, peak
    return best


def _rounds(settings: Settings, config: TrialConfig, fit_check: FitCheck) -> tuple[list[Row], list[dict]]:
    """The check's round on every slot at once, each in its own folder: its rows, and the timings of those that
    completed."""
    backend = LocalBackend(dataclasses.replace(settings, ood_rows=CHECK_OOD_ROWS, val_rows=0))
    folder = Path(settings.rounds_dir) / PREFLIGHT_DIR
    rows: list[Row] = []
    running = []
    for index, gpus in enumerate(dict.fromkeys(tuple(s) for s in settings.slots)):
        where = _where(list(gpus))
        fit = fit_check(config, list(gpus))
        if fit is None:
            rows.append(Row(f"{where}: fit", True, f"not checked ({'the CPU' if not gpus else 'card memory unknown'})"))
        else:
            every = fit.plan.checkpoint_every
            plan = f"{fit.plan.micro_batches} micro-batch(es), {f'every {every}. layer' if every else 'no layer'} " \
                   f"checkpointed"
            rows.append(Row(f"{where}: fit", fit.fits,
                            f"predicted {fit.predicted_gb:.1f} GB of {fit.usable_gb:.1f} GB ({plan})"))  # fmt: skip
        round_config = space.with_steps(config.replace(output_dir=str(folder / f"slot-{index}")), CHECK_STEPS)
        running.append((where, backend.start(round_config, list(gpus))))
    until = time.monotonic() + CHECK_TIMEOUT_S
    timings = []
    try:
        while not all(handle.done() for _, handle in running) and time.monotonic() < until:
            backend.wait(1.0)
        for where, handle in running:
            rows += _round_rows(where, handle)
            if handle.done() and handle.outcome().state == "completed":
                timings.append(handle.outcome().timings)
    finally:
        for _, handle in running:
            handle.kill()
        shutil.rmtree(folder, ignore_errors=True)
    return rows, timings


def _round_rows(where: str, handle) -> list[Row]:
    if not handle.done():
        return [Row(f"{where}: round", False, f"still running after {CHECK_TIMEOUT_S // 60} minutes: killed")]
    outcome = handle.outcome()
    t = outcome.timings
    if outcome.state != "completed" or outcome.steps_done < CHECK_STEPS:
        why = one_line((outcome.reason or "no reason recorded").splitlines()[0])  # not the traceback the log keeps
        return [Row(f"{where}: round", False, f"{outcome.state} after {outcome.steps_done} step(s): {why}")]
    trained = (f"setup {t.get('setup', 0):.0f} s, {outcome.steps_done} steps {t.get('train', 0):.0f} s, saved and "
               f"merged {t.get('save', 0):.0f} s")  # fmt: skip
    rows = [Row(f"{where}: round", True, trained)]
    if outcome.ood_accuracy is None:
        return rows + [Row(f"{where}: evaluation", False, outcome.reason or "no ood_val accuracy")]
    scored = (f"{CHECK_OOD_ROWS} ood_val rows in {t.get('eval', 0):.0f} s: accuracy {outcome.ood_accuracy:.1f}%, "
              f"format {outcome.format_rate:.1f}%")  # fmt: skip
    return rows + [Row(f"{where}: evaluation", True, scored)]


# ---------------------------------------------------------------------------------------------------- disk, budget
def model_bytes(model_path: str) -> int:
    return sum(f.stat().st_size for f in Path(model_path).glob("*.safetensors"))


def disk_needed(settings: Settings) -> tuple[int, str]:
    """Bytes the search keeps at most at once, and how they add up: each a model of the base's size."""
    size = model_bytes(settings.model_path)
    parts = {"submission": 1, "keep_rounds and the best": settings.keep_rounds + 1,
             "rounds running": len(settings.slots)}  # fmt: skip
    if settings.merge.enabled:
        parts["merge stage"] = settings.merge.top_k + 1
    models = sum(parts.values())
    text = " + ".join(f"{n} ({name})" for name, n in parts.items())
    return models * size, f"{models} models of {size / 1e9:.1f} GB: {text}"


def _disk(settings: Settings) -> Row:
    folder = Path(settings.rounds_dir)
    while not folder.exists():
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    needed, how = disk_needed(settings)
    return Row("disk", free >= needed, f"{free / 1e9:.1f} GB free in {folder}, {needed / 1e9:.1f} GB needed ({how})")


def _budget(settings: Settings, config: TrialConfig, timings: list[dict]) -> Row:
    """Rounds of `config` at its recipe's steps that the budget holds, by the duration model refitted on this check's
    setup, steps and save (its evaluation, of fewer rows, stays the prior's)."""
    model = DurationModel(eval_rows=(settings.ood_rows or 1000) + settings.val_rows,
                          prior_scale=settings.duration_prior_scale)  # fmt: skip
    for measured in timings:
        model.observe(config, CHECK_STEPS, {k: v for k, v in measured.items() if k in ("setup", "train", "save")})
    minutes = model.estimate(config).total / 60
    per_slot = max(0, math.floor((60 * settings.hours - settings.reserve_minutes) / minutes))
    total = per_slot * len(settings.slots)
    slots = len(settings.slots)
    return Row("budget", True, f"about {total} rounds of the heaviest configuration at {config.steps} steps "
                               f"({minutes:.0f} min each) in {settings.hours:g} h on {slots} slot(s)")  # fmt: skip


def _box_text(settings: Settings) -> str:
    where = f"{settings.gpus} GPU(s), {len(settings.slots)} slot(s)" if settings.gpus else "the CPU"
    return f"model, train/val/ood_val splits and folders ok; rounds on {where}"


def _where(gpus: list[int]) -> str:
    return f"gpu {','.join(map(str, gpus))}" if gpus else "cpu"


def _table(rows: list[Row], seconds: float) -> str:
    width = max(len(row.what) for row in rows)
    lines = [f"{'check':{width}s}  result", f"{'-' * width}  ------"]
    lines += [f"{row.what:{width}s}  {'ok' if row.ok else 'FAILED'}: {row.detail}" for row in rows]
    lines.append(f"checked in {seconds:.0f} s")
    return "\n".join(lines)
