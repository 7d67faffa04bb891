"""The command-line processes (trainer, evaluator, the promotion's check) end with `exit_now`: everything they printed
and logged reaches its reader, their exit code is kept, and the interpreter's teardown is skipped."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_exit_now_keeps_the_output_and_the_code_and_skips_the_teardown(tmp_path):
    log = tmp_path / "run.log"
    script = "\n".join([
        "import atexit, logging, sys",
        "from common.process_exit import exit_now",
        f"logging.basicConfig(filename={str(log)!r}, level=logging.INFO)",
        "atexit.register(print, 'teardown')",
        "logging.info('logged')",
        "print('printed', end='')",
        "sys.stderr.write('warned')",
        "exit_now(3)",
    ])  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (3, "printed", "warned")
    assert log.read_text() == "INFO:root:logged\n"
