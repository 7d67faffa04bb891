"""Rounds as processes on this machine: the trainer, then the evaluator on the same GPUs, in the round's folder
(trainer.run_folder). Each process runs in its own session (process group) with CUDA_VISIBLE_DEVICES set to the
round's GPUs, so rounds side by side never share a GPU and a kill reaches every child (accelerate's workers,
dataloader workers). Nothing blocks except `kill`, which waits at most `kill_grace_s` for the trainer to exit on
SIGTERM.

A round's evaluator starts with its trainer (`python -m evaluator --wait-for-input`): it imports and reads the
splits on the CPU while the round trains, touching no GPU, and loads the model once the trainer has saved it and a
line on its standard input says so. A round that ends without an evaluation kills it.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from search.backends.base import RoundOutcome
from search.backends.fit import FitCheck, card_bytes_of
from search.folders import inside
from search.merge import SPEC_FILE, MergeSpec
from search.settings import Settings
from trainer.config import TrialConfig
from trainer.run_folder import (
    EVAL_LOG,
    MERGED_DIR,
    PROCESSES_FILE,
    PROGRESS_FILE,
    STATUS_FILE,
    STOP_FILE,
    TRAIN_LOG,
    TRIAL_FILE,
    FailureKind,
    Phase,
    ProgressReader,
    RoundState,
    Status,
    eval_report,
    read_report,
    read_status,
)

PROJECT_ROOT = Path(__file__).resolve().parents[2]
_PR_SET_PDEATHSIG = 1
try:
    _LIBC = ctypes.CDLL(None, use_errno=True)  # loaded before any fork: the child only calls into it
except OSError:  # not Linux/glibc: no parent-death signal, the orphan sweep alone cleans up
    _LIBC = None


class LocalBackend:
    def __init__(self, settings: Settings):
        self.settings = settings
        # Overridable commands (tests substitute stub programs). None: `python -m trainer` for one process,
        # `accelerate launch --num_processes N -m trainer` for several GPUs. Both get `--config RUN_DIR/trial.json`.
        self.trainer_command: list[str] | None = None
        self.evaluator_command: list[str] = [sys.executable, "-m", "evaluator"]
        self.kill_grace_s = 30.0
        self.threads_per_round = threads_per_round(settings)
        self._rounds: list[LocalRound] = []  # those started, until `wait` sees them done
        self.fit = FitCheck(lambda: model_config(settings.model_path), card_bytes_of(settings.gpu_memory_gb))

    def start(self, config: TrialConfig, gpus: list[int]) -> "LocalRound":
        run_dir = _fresh_run_dir(config.output_dir)
        config.to_json(run_dir / TRIAL_FILE)
        return self._started(LocalRound(self, run_dir, gpus))

    def score(self, model_dir: str, run_dir: str, gpus: list[int]) -> "LocalRound":
        return self._started(LocalRound(self, _fresh_run_dir(run_dir), gpus, model_dir=Path(model_dir)))

    def merge(self, spec: MergeSpec, run_dir: str, gpus: list[int]) -> "LocalRound":
        folder = _fresh_run_dir(run_dir)
        spec.to_json(folder / SPEC_FILE)
        build = [sys.executable, "-m", "search.merge", "--spec", str(folder / SPEC_FILE)]
        return self._started(LocalRound(self, folder, gpus, build_command=build))

    def has_weights(self, merged_dir: str) -> bool:
        return Path(merged_dir, "config.json").is_file()

    def wait(self, seconds: float) -> None:
        self._rounds = [r for r in self._rounds if r.phase() != Phase.DONE]
        wait_for_any_end([r.pid for r in self._rounds], seconds)

    def _started(self, round_: "LocalRound") -> "LocalRound":
        self._rounds.append(round_)
        return round_

    def reap_orphan(self, run_dir: str | os.PathLike) -> list[int]:
        """Kill what is left of a round whose scheduler died (SIGKILL, power loss of the scheduler alone): every
        process group its `processes.jsonl` lists that was started on this host and is still the same group
        (a group whose leader now is a different process, by its start time, is someone else's). Returns the
        process group ids signalled. A `run_dir` outside this study's rounds folder is refused (OSError): it comes
        from the storage, and its processes.jsonl could name any process."""
        if not inside(run_dir, self.settings.rounds_dir):
            raise OSError(f"{run_dir} is not inside {self.settings.rounds_dir}; its processes are left alone")
        return reap_processes(Path(run_dir))

    def train_command(self, gpus: list[int], config_path: Path) -> list[str]:
        if self.trainer_command is not None:
            base = list(self.trainer_command)
        elif len(gpus) > 1:
            base = [
                sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
                "--num_processes", str(len(gpus)), "--num_machines", "1",
                # Rounds side by side each run their own rendezvous: a fixed port would collide.
                "--main_process_port", str(_free_port()),
                "-m", "trainer",
            ]  # fmt: skip
        else:
            base = [sys.executable, "-m", "trainer"]
        return [*base, "--config", str(config_path)]

    def eval_command(self, merged: Path, run_dir: Path, *, wait_for_input: bool = False) -> tuple[list[str], list[str]]:
        """The evaluation after training, one process from one load of the model: all of OOD (or `ood_rows` of it),
        then the val health check (`val_rows` of val, none when 0); and the names of the reports it writes
        (`run_folder.eval_report`). Subsets are seeded with the study's seed, so every round is scored on the same
        rows. `wait_for_input`: the process waits for a line on its standard input before it reads `merged`."""
        s = self.settings
        names, splits, limits = ["ood"], [s.ood_val_path], [str(s.ood_rows or "all")]
        if s.val_rows:
            names, splits, limits = [*names, "val"], [*splits, s.val_path], [*limits, str(s.val_rows)]
        command = [*self.evaluator_command, str(merged), *splits, "--limit", *limits, "--seed", str(s.seed),
                   "--out", *(str(run_dir / eval_report(name)) for name in names)]  # fmt: skip
        if s.eval_batch_size:
            command += ["--batch-size", str(s.eval_batch_size)]
        if not s.eval_static_cache:
            command.append("--dynamic-cache")
        if s.gpu_memory_gb is not None:
            command += ["--gpu-memory-gb", str(s.gpu_memory_gb)]
        if wait_for_input:
            command.append("--wait-for-input")
        return command, names


def model_config(model_path: str):
    """The base model's config (for the fit check: the architecture, no weights)."""
    from transformers import AutoConfig  # late: only the first fit check needs it

    return AutoConfig.from_pretrained(model_path)


class LocalRound:
    """One round's processes. `done()` advances it: training -> evaluation -> done. Given `model_dir`, it only
    scores that model: evaluation -> done. Given `build_command`, that command writes the model and the status in
    the trainer's place (a merge, search.merge.soup)."""

    def __init__(
        self,
        backend: LocalBackend,
        run_dir: Path,
        gpus: list[int],
        *,
        model_dir: Path | None = None,
        build_command: list[str] | None = None,
    ):
        self._backend = backend
        self.run_dir = run_dir
        self._env = dict(os.environ)
        self._env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)  # "" hides every GPU from a CPU round
        self._env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")]))
        if backend.threads_per_round is not None:
            self._env["OMP_NUM_THREADS"] = str(backend.threads_per_round)
        self._phase = Phase.TRAINING
        self._evaluate = True
        self._progress = ProgressReader(run_dir)
        self._state: RoundState | None = None
        self._reason: str | None = None
        self._failure: FailureKind | None = None
        self._status: Status | None = None
        self._reports: dict[str, dict] = {}
        self._eval_names: list[str] = []  # the reports the evaluation writes
        self._evaluator_waiting: subprocess.Popen | None = None  # started with the trainer, until it is told to go
        self._eval_seconds: float | None = None  # once the evaluation is over
        self._eval_cut: float | None = None  # the evaluation's seconds when a kill cut it short
        self._train_seconds: float | None = None
        self._model_dir = model_dir or run_dir / MERGED_DIR
        if model_dir is not None:
            self._state = RoundState.COMPLETED
            self._start_evaluation()
        else:
            command = build_command or backend.train_command(gpus, run_dir / TRIAL_FILE)
            self._proc, self._started = self._spawn(command, run_dir / TRAIN_LOG)
            self._start_evaluator_ahead()

    # ------------------------------------------------------------------ RoundHandle
    def progress(self) -> list[dict]:
        return self._progress.new_lines()

    def phase(self) -> Phase:
        return self._phase

    @property
    def pid(self) -> int:
        """The process the round is running now (its trainer or an evaluator; the last one once done)."""
        return self._proc.pid

    def done(self) -> bool:
        if self._phase == Phase.DONE:
            return True
        if self._proc.poll() is None:
            return False
        seconds = time.monotonic() - self._started
        _kill_group(self._proc.pid, signal.SIGKILL)  # stragglers the leader left behind would hold GPU memory
        if self._phase == Phase.TRAINING:
            self._train_seconds = seconds
            self._after_training(self._proc.returncode)
        else:
            self._after_evaluation(self._proc.returncode, seconds)
        return self._phase == Phase.DONE

    def request_stop(self, *, evaluate: bool = True) -> None:
        self._evaluate = self._evaluate and evaluate
        if self._phase == Phase.TRAINING:
            (self.run_dir / STOP_FILE).touch()

    def kill(self) -> None:
        if self._phase == Phase.DONE:
            return
        if self._proc.poll() is None:
            _kill_group(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(self._backend.kill_grace_s)
            except subprocess.TimeoutExpired:
                pass
        _kill_group(self._proc.pid, signal.SIGKILL)
        self._proc.wait()
        if self._phase == Phase.EVALUATING:  # what it took so far: the DurationModel learns it is at least that slow
            self._eval_cut = time.monotonic() - self._started
        self._fail(f"killed while {self._phase}")

    def outcome(self) -> RoundOutcome:
        if self._phase != Phase.DONE:
            raise RuntimeError(f"{self.run_dir}: outcome() before done()")
        ood, val = self._reports.get("ood", {}), self._reports.get("val", {})
        return RoundOutcome(
            state=self._state,
            reason=self._reason,
            ood_accuracy=ood.get("accuracy_pct"),
            val_accuracy=val.get("accuracy_pct"),
            format_rate=ood.get("format_rate"),
            mean_completion_tokens=ood.get("mean_completion_tokens"),
            steps_done=self._status.steps_done if self._status else 0,
            timings=self._timings(),
            merged_dir=str(self._model_dir) if self._state.saved else None,
            ood_rows=ood.get("per_row"),
            failure=self._failure,
        )

    # ------------------------------------------------------------------ the round's course
    def _spawn(self, command: list[str], log: Path, stdin: int = subprocess.DEVNULL) -> tuple[subprocess.Popen, float]:
        with log.open("ab") as out:
            proc = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, stdin=stdin,
                env=self._env, start_new_session=True, preexec_fn=_die_with_parent(os.getpid()),
            )  # fmt: skip
        _record_process(self.run_dir, proc.pid)
        return proc, time.monotonic()

    def _after_training(self, returncode: int) -> None:
        status = self._status = read_status(self.run_dir)
        if returncode != 0 or status is None or not status.state.saved:
            failed = status is not None and status.state == RoundState.FAILED
            reason = status.reason if failed else None
            log = _last_line(self.run_dir / TRAIN_LOG)
            if reason is None and returncode < 0:  # no status: killed by a signal (SIGKILL: often the OOM killer)
                name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else -returncode
                reason = f"the trainer was killed by {name}" + (" (the kernel's out-of-memory killer sends it)"
                                                                 if returncode == -signal.SIGKILL else "")
                reason += f": {log}"
            self._fail(reason or f"the trainer exited with code {returncode}: {log}",
                       status.kind if failed else FailureKind.ERROR)  # fmt: skip
        elif not (self._model_dir / "config.json").is_file():
            self._fail(f"the trainer reported {status.state} but wrote no model to {self._model_dir}")
        elif not self._evaluate:
            self._finish(status.state, status.reason)
        else:
            self._state, self._reason = status.state, status.reason
            self._start_evaluation()

    def _start_evaluator_ahead(self) -> None:
        command, self._eval_names = self._backend.eval_command(self._model_dir, self.run_dir, wait_for_input=True)
        try:
            self._evaluator_waiting, _ = self._spawn(command, self.run_dir / EVAL_LOG, stdin=subprocess.PIPE)
        except OSError:  # started again once the model is saved, where its failure fails the round
            self._evaluator_waiting = None

    def _start_evaluation(self) -> None:
        self._phase = Phase.EVALUATING
        waiting, self._evaluator_waiting = self._evaluator_waiting, None
        if waiting is not None:
            try:
                waiting.stdin.write(b"go\n")
                waiting.stdin.close()
            except OSError:  # it has ended already (a broken pipe): its exit code and log say why at the next poll
                pass
            self._proc, self._started = waiting, time.monotonic()
            return
        command, self._eval_names = self._backend.eval_command(self._model_dir, self.run_dir)
        try:
            self._proc, self._started = self._spawn(command, self.run_dir / EVAL_LOG)
        except OSError as error:  # e.g. the evaluator's interpreter is missing: this round fails, the search goes on
            self._fail(f"could not start the evaluation: {error}")

    def _drop_waiting_evaluator(self) -> None:
        """Kill and reap the evaluator started with the trainer, when the round ends without telling it to go."""
        waiting, self._evaluator_waiting = self._evaluator_waiting, None
        if waiting is None:
            return
        _kill_group(waiting.pid, signal.SIGKILL)
        waiting.wait()
        try:
            waiting.stdin.close()
        except OSError:
            pass

    def _after_evaluation(self, returncode: int, seconds: float) -> None:
        reports = {name: read_report(self.run_dir, name) for name in self._eval_names}
        missing = [name for name, report in reports.items() if report is None]
        if returncode != 0 or missing:
            what = f"failed with exit code {returncode}" if returncode else f"wrote no {' or '.join(missing)} report"
            self._fail(f"the evaluation {what} ({_last_line(self.run_dir / EVAL_LOG)})")
            return
        self._reports = reports
        self._eval_seconds = seconds
        self._finish(self._state, self._reason)

    def _finish(self, state: RoundState, reason: str | None) -> None:
        self._drop_waiting_evaluator()
        self._state, self._reason, self._phase = state, reason, Phase.DONE

    def _fail(self, reason: str, kind: FailureKind = FailureKind.ERROR) -> None:
        self._failure = kind
        self._finish(RoundState.FAILED, reason)

    def _timings(self) -> dict[str, float]:
        trainer = self._status.timings if self._status else {}
        timings = {key: trainer[key] for key in ("train", "save", "build") if key in trainer}
        if self._train_seconds is not None and "train" in timings and "save" in timings:
            # The trainer's own "setup" starts after its imports; the process wall-clock covers all of it.
            timings["setup"] = max(0.0, self._train_seconds - timings["train"] - timings["save"])
        if self._eval_seconds is not None:
            timings["eval"] = self._eval_seconds
        if self._eval_cut is not None:
            timings["eval_at_least"] = self._eval_cut
        return timings


def wait_for_any_end(pids: list[int], seconds: float) -> None:
    """Sleep `seconds`, or less: until one of `pids` (this process's children) has ended. Each is watched through
    a Linux process file descriptor (pidfd), readable once the process has ended, reaped or not; without pidfds
    (not Linux 5.3+), a plain sleep."""
    descriptors: list[int] = []
    try:
        for pid in pids:
            descriptors.append(os.pidfd_open(pid))
    except ProcessLookupError:  # one has ended and was reaped already: no waiting
        seconds = 0.0
    except (AttributeError, OSError):
        for descriptor in descriptors:
            os.close(descriptor)
        descriptors = []
    try:
        if seconds <= 0:
            return
        if descriptors:
            select.select(descriptors, [], [], seconds)
        else:
            time.sleep(seconds)
    finally:
        for descriptor in descriptors:
            os.close(descriptor)


def threads_per_round(settings: Settings) -> int | None:
    """CPU threads for each round's processes when several rounds run at once: the cores shared out, since torch
    gives every process as many threads as there are cores and side-by-side rounds then fight over them (their
    GPUs wait on the CPU). None (torch's default) for one round at a time, or when OMP_NUM_THREADS is set."""
    rounds = len(settings.slots)
    if rounds <= 1 or "OMP_NUM_THREADS" in os.environ:
        return None
    return max(1, (os.cpu_count() or 1) // rounds)


def _fresh_run_dir(path: str | os.PathLike) -> Path:
    run_dir = Path(path)
    run_dir.mkdir(parents=True, exist_ok=True)
    # A folder left by an earlier study under the same runs_dir must not pass its files off as this round's.
    for stale in (STOP_FILE, PROGRESS_FILE, STATUS_FILE, eval_report("ood"), eval_report("val"), PROCESSES_FILE):
        (run_dir / stale).unlink(missing_ok=True)
    return run_dir


def _die_with_parent(parent: int):
    """A preexec function: the round's group leader gets SIGTERM when the scheduler dies (a trainer then stops after
    its step and saves; accelerate's launcher passes it on to its workers; an evaluator exits). A process deaf to
    SIGTERM, or a straggler its leader left, is killed by the next scheduler's orphan sweep (`reap_processes`)."""
    if _LIBC is None:
        return None

    def preexec() -> None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the scheduler died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def _stat_fields(pid: int | str) -> list[str] | None:
    """/proc/PID/stat's fields from field 3 on (state, ppid, pgrp, ...): those after the command's closing
    parenthesis, as the command itself may hold spaces and parentheses. None when the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot, /proc/PID/stat field 22), None when there is none."""
    fields = _stat_fields(pid)
    try:
        return int(fields[19]) if fields else None
    except (IndexError, ValueError):
        return None


def _record_process(run_dir: Path, pid: int) -> None:
    line = {"pgid": pid, "start": _start_time(pid), "host": socket.gethostname()}
    with (run_dir / PROCESSES_FILE).open("a") as f:
        f.write(json.dumps(line) + "\n")


def reap_processes(run_dir: Path) -> list[int]:
    """SIGKILL every process group `run_dir/processes.jsonl` lists from this host that still has a running member,
    unless its id was reused: a group id stays taken while any member lives, so a listed id is still the round's own
    group when its leader is gone or is the process that was recorded (same start time)."""
    try:
        lines = (run_dir / PROCESSES_FILE).read_text().splitlines()
    except OSError:
        return []
    running = _running_groups()
    killed = []
    for raw in lines:
        try:
            entry = json.loads(raw)
            pgid, start, host = int(entry["pgid"]), entry.get("start"), entry.get("host")
        except (ValueError, KeyError, TypeError):
            continue  # a torn line: its process was the last one spawned, and the scheduler died with it
        if host != socket.gethostname() or pgid <= 1 or pgid == os.getpgrp():  # never the scheduler's own group
            continue
        if running is not None and pgid not in running:
            continue  # nothing left to kill: gone, or zombies that a container's first process never reaps
        now = _start_time(pgid)
        if now is not None and start is not None and now != start:
            continue  # the id belongs to another process now
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue
        killed.append(pgid)
    return killed


def _running_groups() -> set[int] | None:
    """The process group ids with at least one member that is not a zombie; None where /proc cannot be read."""
    try:
        entries = [entry for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:
        return None
    groups = set()
    for entry in entries:
        fields = _stat_fields(entry)  # None: it ended while the folder was read
        if fields and fields[0] not in ("Z", "X"):
            groups.add(int(fields[2]))
    return groups


def _kill_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the whole group is gone already


def _last_line(path: Path) -> str:
    """The log's last non-empty line: usually the exception that ended the process."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            lines = [line.strip() for line in f.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError:
        return f"no {path.name}"
    return lines[-1] if lines else f"{path.name} is empty"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
