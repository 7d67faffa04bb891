"""search.log: every line printed during a recording goes to the log file with its time, once the file is named;
lines held before are kept, or dropped with the recording if no file is ever named; passwords are redacted."""

from __future__ import annotations

import re

from search import log


def _hide(text: str) -> str:
    return text.replace("hunter2", "***")


def test_lines_are_held_until_the_file_is_named_and_dropped_without_one(tmp_path, capsys):
    with log.recording(_hide):
        log.say("checking hunter2")
    assert not list(tmp_path.iterdir())
    with log.recording(_hide) as recording:
        log.say("before the file")
        recording.open(tmp_path / "logs" / "search.log")
        log.say("two\nlines")
        log.warn("warning: hunter2 went wrong")
    log.say("after the recording")
    assert recording.path == tmp_path / "logs" / "search.log"
    stamped = recording.path.read_text().splitlines()
    assert all(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d ", line) for line in stamped), stamped
    assert [line[20:] for line in stamped] == ["before the file", "two", "lines", "warning: *** went wrong"]
    out, err = capsys.readouterr()
    assert out.splitlines() == ["checking ***", "before the file", "two", "lines", "after the recording"]
    assert err.splitlines() == ["warning: *** went wrong"]


def test_without_a_recording_lines_are_only_printed(capsys):
    log.say("hunter2")
    log.warn("warning: hunter2")
    assert capsys.readouterr() == ("hunter2\n", "warning: hunter2\n")
