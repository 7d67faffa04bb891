"""What a merge's build costs: seconds and peak host memory of `python -m search.merge` on models of the real
Qwen2-VL-2B size (random weights, bfloat16, 4.4 GB each), against the size of one model.

    python bench/soup_cost.py --work /tmp/soup-cost --ingredients 4 --out bench/results/DATE-cpu-soup-cost.json

Builds a base and `--ingredients` models once under --work (cached), then times two builds, each in a fresh process
as the search runs it: the uniform soup of the ingredients (eta 1: the base is not read) and the same soup moved from
the base (eta 1.25: one model more to read). Host memory, of the build process: its own memory (RssAnon, sampled
every 0.1 s: the tensors it averages and the shard it writes) apart from the pages of the memory-mapped weight files
it has read (RssFile: the page cache, clean and given back under memory pressure), and the maximum resident set
getrusage reports (both together).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def models(work: Path, ingredients: int) -> tuple[Path, list[Path]]:
    """The base and the ingredients: the 2b architecture with seeded random weights (synthetic.models)."""
    from synthetic.models import build_model

    folders = [work / f"model-{seed}" for seed in range(ingredients + 1)]
    for seed, folder in enumerate(folders):
        if not (folder / "config.json").is_file():
            print(f"building {folder}", flush=True)
            build_model(folder, size="2b", seed=seed)
    return folders[0], folders[1:]


def timed_build(base: Path, ingredients: list[Path], eta: float, run_dir: Path) -> dict:
    """One build in a fresh process: its wall seconds, the seconds it reports, and its peak resident set."""
    import shutil

    from search.merge import MergeSpec

    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    spec_path = run_dir / "merge.json"
    MergeSpec(tuple(str(p) for p in ingredients), str(base), eta).to_json(spec_path)
    subprocess.run(["sync"], check=False)
    began = time.perf_counter()
    # A fresh child per build, alone in this process's children, so RUSAGE_CHILDREN's maximum is its own.
    pid = os.fork()
    if pid == 0:
        os.execv(sys.executable, [sys.executable, "-m", "search.merge", "--spec", str(spec_path)])
    peaks = {"RssAnon": 0, "RssFile": 0}
    while True:
        ended, status, usage = os.wait4(pid, os.WNOHANG)
        if ended:
            break
        for key, kb in _rss(pid).items():
            peaks[key] = max(peaks[key], kb)
        time.sleep(0.1)
    seconds = time.perf_counter() - began
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"the build failed: {os.waitstatus_to_exitcode(status)}")
    reported = json.loads((run_dir / "status.json").read_text())["timings"]["build"]
    return {"eta": eta, "models_read": len(ingredients) + (eta != 1.0), "wall_s": round(seconds, 1),
            "build_s": round(reported, 1), "peak_rss_gb": round(usage.ru_maxrss * 1024 / 1e9, 2),
            "peak_anon_gb": round(peaks["RssAnon"] * 1024 / 1e9, 2),
            "peak_file_gb": round(peaks["RssFile"] * 1024 / 1e9, 2)}  # fmt: skip


def _rss(pid: int) -> dict[str, int]:
    """RssAnon and RssFile of a live process, in kB (empty once it is gone)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    fields = (line.split() for line in lines if line.startswith(("RssAnon:", "RssFile:")))
    return {name.rstrip(":"): int(kb) for name, kb, *_ in fields}


def folder_gb(folder: Path) -> float:
    return round(sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1e9, 2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="where the models are built (5 x 4.4 GB for 4)")
    parser.add_argument("--ingredients", type=int, default=4)
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = parser.parse_args(argv)
    os.chdir(ROOT)  # `python -m search.merge` from the project
    base, ingredients = models(args.work, args.ingredients)
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
                   f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB",
        "model_gb": folder_gb(base),
        "builds": [timed_build(base, ingredients, eta, args.work / f"soup-eta{eta:g}") for eta in (1.0, 1.25)],
    }  # fmt: skip
    for b in result["builds"]:
        print(f"eta {b['eta']:g}: {b['models_read']} models read, {b['wall_s']} s ({b['build_s']} s building), "
              f"its own memory at most {b['peak_anon_gb']} GB, mapped weight files {b['peak_file_gb']} GB, peak "
              f"resident {b['peak_rss_gb']} GB; one model {result['model_gb']} GB")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
