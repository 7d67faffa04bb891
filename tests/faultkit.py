"""Tools of the fault, bad-input and worker tests (not a test module).

Run as a program it is one of three things, with the command-line contracts of the real ones:

    python tests/faultkit.py trainer --config RUN_DIR/trial.json        # a stub GRPO round
    python tests/faultkit.py evaluator MODEL DATA... --out REPORT...    # a stub evaluation (--wait-for-input too)
    python tests/faultkit.py search [run_search.py arguments]           # the real run_search.main, its LocalBackend
                                                                        # running the two stubs above

The `search` role is the real program (settings, box check, study, Scheduler, LocalBackend spawning process groups,
promotion with its lock and PROMOTED.json, leaderboard) with only the GRPO round and the evaluation replaced, so a
test can run whole searches, kill them and run several workers on one study in seconds on a CPU.

The environment drives the stubs:
- FAULT_PLAN: comma-separated modes, the round of trial N takes the N-th (default and past the end: "ok"):
  ok | raise | oom | nan | oomkill (the kernel's OOM killer: SIGKILL) | hang (no progress, deaf to SIGTERM, with a
  child in its process group);
- STUB_LEDGER: a file each stub trainer appends {"run_dir", "pid", "ppid"} to when it starts;
- STUB_STEP_S: seconds per stub step (default 0.05);
- PROMOTION_LOG: a file the search appends {"trial", "accuracy", "pid"} to at each swap into the submission, inside
  the promotion lock;
- STUB_ENOSPC_COPY=N: the N-th promotion's copy raises OSError(ENOSPC) halfway;
- STUB_CHECK=real: keep the real load check of a promotion (default: none, the stub models do not load);
- STUB_POLL_S: the Scheduler's poll period (default 0.1 s).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve()


# ---------------------------------------------------------------------------------------------------------- stubs
def stub_accuracy(tag: str, data: str) -> float:
    """A stable, spread-out accuracy per model (its round folder's name) and split; the base model (round 0) scores
    below every trained one, as an untrained model does."""
    if tag == "base":
        return 4.0
    return 5.0 + (zlib.crc32(f"{tag}|{Path(data).name}".encode()) % 9000) / 100.0


def _trainer(argv: list[str]) -> int:
    config = json.loads(Path(argv[argv.index("--config") + 1]).read_text())
    out = Path(config["output_dir"])
    number = int(out.name.rsplit("-", 1)[1]) if out.name.startswith("round-") else 0
    plan = [m for m in os.environ.get("FAULT_PLAN", "").split(",") if m]
    mode = plan[number] if number < len(plan) else "ok"
    if os.environ.get("STUB_LEDGER"):
        with open(os.environ["STUB_LEDGER"], "a") as f:
            f.write(json.dumps({"run_dir": str(out), "pid": os.getpid(), "ppid": os.getppid(), "mode": mode}) + "\n")
    step_s = float(os.environ.get("STUB_STEP_S", "0.05"))
    progress = (out / "progress.jsonl").open("a")

    def line(step: int, reward: float | None = 0.5) -> None:
        progress.write(json.dumps({"step": step, "reward": reward, "rewards": {}}) + "\n")
        progress.flush()

    def status(state: str, reason: str | None, steps: int, kind: str | None = None) -> None:
        timings = {"setup": 0.01, "train": round(steps * step_s, 3), "save": 0.01}
        data = {"state": state, "kind": kind, "reason": reason, "steps_done": steps, "timings": timings}
        tmp = out / ".status.json.tmp"
        tmp.write_text(json.dumps(data))
        os.replace(tmp, out / "status.json")

    if mode == "raise":
        print("Traceback (most recent call last):\nRuntimeError: boom in the reward function", file=sys.stderr)
        status("failed", "RuntimeError: boom in the reward function", 0, "error")
        return 1
    if mode == "oom":  # what trainer.failure.describe_exception writes for torch.OutOfMemoryError
        line(1)
        status("failed", "out of memory: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", 1,
               "out_of_memory")
        return 1
    if mode == "nan":  # what the trainer's NaN guard writes
        line(1)
        line(2, reward=None)
        status("failed", "NaN or inf reward (None) at step 2", 2, "nan")
        return 1
    if mode == "oomkill":
        line(1)
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "hang":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        line(1)
        (out / "child.pid").write_text(str(child.pid))
        time.sleep(3600)
        return 0
    steps = int(config.get("steps", 3))
    for step in range(1, steps + 1):
        time.sleep(step_s)
        line(step)
        if (out / "STOP").exists():
            break
    merged = out / "merged"
    merged.mkdir(exist_ok=True)
    (merged / "config.json").write_text(json.dumps({"model_type": "qwen2_vl", "tag": out.name}))
    (merged / "model.safetensors").write_text(out.name * 100)
    status("completed" if step == steps else "stopped", None, step)
    return 0


def _evaluator(argv: list[str]) -> int:
    if "--wait-for-input" in argv and not sys.stdin.readline():  # started with the trainer: wait for its model
        return 3
    model, splits, outs = argv[0], _values(argv, 0), _values(argv, argv.index("--out"))
    tag = json.loads(Path(model, "config.json").read_text()).get("tag", "?")
    for data, out in zip(splits, outs):
        accuracy = stub_accuracy(tag, data)
        report = {"accuracy_pct": accuracy, "n": 10, "correct": 1, "format_rate": 95.0, "mean_completion_tokens": 12.0}
        Path(out).write_text(json.dumps(report))
    return 0


def _values(argv: list[str], at: int) -> list[str]:
    """The arguments after argv[at] up to the next option: an option's values, or (at 0) the positionals."""
    end = next((i for i in range(at + 1, len(argv)) if argv[i].startswith("--")), len(argv))
    return argv[at + 1 : end]


# ---------------------------------------------------------------------------------------------------------- search
def _search(argv: list[str]) -> int:
    sys.path.insert(0, str(ROOT))
    import run_search
    from search import scheduler
    from search.backends import local as local_backend
    from search.promotion import submission as promotion
    from search.promotion import verification

    scheduler.POLL_S = float(os.environ.get("STUB_POLL_S", "0.1"))
    original_init = local_backend.LocalBackend.__init__

    def init(self, settings):
        original_init(self, settings)
        self.trainer_command = [sys.executable, str(THIS), "trainer"]
        self.evaluator_command = [sys.executable, str(THIS), "evaluator"]
        self.kill_grace_s = 1.0

    local_backend.LocalBackend.__init__ = init
    if os.environ.get("STUB_CHECK") != "real":
        # Looked up at call time; a check whose parts took no time, as the real one reports them.
        promotion.check_submission = lambda path, **kwargs: {"seconds": dict.fromkeys(verification.CHECK_PARTS, 0.0)}
        verification.keep_a_checker_ready = lambda on=True: None  # no checker interpreter to start
    if os.environ.get("STUB_ENOSPC_COPY"):  # the N-th promotion's copy fills the disk halfway
        import errno
        import shutil

        fail_at, copies = int(os.environ["STUB_ENOSPC_COPY"]), []
        real_promote = promotion.promote

        def promote(*args, copy_tree=shutil.copytree, **kwargs):  # whichever copy the scheduler chose, failing once
            def failing_once(source: str, target: str):
                copies.append(source)
                if len(copies) == fail_at:
                    os.makedirs(target)
                    shutil.copy(Path(source) / "config.json", target)
                    raise OSError(errno.ENOSPC, "No space left on device")
                return copy_tree(source, target)

            return real_promote(*args, copy_tree=failing_once, **kwargs)

        promotion.promote = promote  # looked up at call time
    log = os.environ.get("PROMOTION_LOG")
    if log:
        original_swap, original_replace = promotion._swap_in, promotion._replace_contents

        def record(staging: Path) -> None:
            marker = json.loads((Path(staging) / promotion.MARKER).read_text())
            entry = {"trial": marker["trial"], "accuracy": marker["accuracy"], "pid": os.getpid(), "t": time.time()}
            with open(log, "a") as f:
                f.write(json.dumps(entry) + "\n")

        def swap(staging, submission):
            record(staging)
            return original_swap(staging, submission)

        def replace(submission, staging):
            record(staging)
            return original_replace(submission, staging)

        promotion._swap_in, promotion._replace_contents = swap, replace
    return run_search.main(argv)


# ---------------------------------------------------------------------------------------------------------- helpers
def search_command(*args: str) -> list[str]:
    return [sys.executable, str(THIS), "search", *args]


def write_budget(folder: Path, **changes) -> Path:
    """The demo budget (tiny-model sized) with `changes`, written as folder/budget.yaml."""
    import yaml

    data = yaml.safe_load((ROOT / "demo_budget.yaml").read_text())
    data.update(changes)
    path = folder / "budget.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def fake_model(folder: Path) -> Path:
    """A folder that passes the box check as a Qwen2-VL model: its config (tag "base", as the stub trainer tags its
    merged models) and a one-number weights file (the stubs load nothing)."""
    import numpy
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2_vl", "tag": "base"}))
    save_file({"weight": numpy.zeros(1, dtype=numpy.float32)}, str(folder / "model.safetensors"))
    return folder


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for its reaper."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def group_members(pgid: int) -> list[int]:
    """Live processes of process group `pgid`."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05):
    until = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > until:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def read_jsonl(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        return []


if __name__ == "__main__":
    role, rest = sys.argv[1], sys.argv[2:]
    sys.exit({"trainer": _trainer, "evaluator": _evaluator, "search": _search}[role](rest))
