"""The run folder's readers and writers: what one side writes the other reads back, and what a crash or an older
trainer leaves is read without raising."""

from __future__ import annotations

import json

from trainer.run_folder import (
    FailureKind,
    ProgressReader,
    RoundState,
    Status,
    earliest_rank_failure,
    read_progress,
    read_status,
    write_rank_failure,
    write_status,
)


def test_a_status_round_trips_with_its_kind(tmp_path):
    write_status(tmp_path, Status(RoundState.FAILED, "CUDA out of memory", 3, {"setup": 1.5, "train": 2.0},
                                  FailureKind.OUT_OF_MEMORY))  # fmt: skip
    raw = json.loads((tmp_path / "status.json").read_text())
    assert raw["state"] == "failed" and raw["kind"] == "out_of_memory"
    assert raw["timings"] == {"setup": 1.5, "train": 2.0}  # only the parts that ran: no save, no build
    written = {"setup": 1.5, "train": 2.0}
    expected = Status(RoundState.FAILED, "CUDA out of memory", 3, written, FailureKind.OUT_OF_MEMORY)
    assert read_status(tmp_path) == expected


def test_a_merge_status_keeps_its_build_time_and_drops_unknown_parts(tmp_path):
    write_status(tmp_path, Status(RoundState.COMPLETED, None, 0, {"build": 12.25, "warmup": 3.0}))
    assert read_status(tmp_path).timings == {"build": 12.25}


def test_a_status_without_a_kind_is_still_read(tmp_path):
    (tmp_path / "status.json").write_text(json.dumps({"state": "failed", "reason": "NaN or inf loss", "steps_done": 2,
                                                      "timings": {"setup": 1, "train": 2, "save": 0}}))  # fmt: skip
    status = read_status(tmp_path)
    assert status.state == RoundState.FAILED and status.kind == FailureKind.ERROR and status.steps_done == 2
    (tmp_path / "status.json").write_text(json.dumps({"state": "stopped", "reason": "STOP file", "steps_done": 1}))
    assert read_status(tmp_path) == Status(RoundState.STOPPED, "STOP file", 1, {}, None)


def test_what_is_not_a_status_reads_as_none(tmp_path):
    assert read_status(tmp_path) is None
    for text in ("", "{\"state\": \"compl", "[1, 2]", json.dumps({"state": "exploded"})):
        (tmp_path / "status.json").write_text(text)
        assert read_status(tmp_path) is None, text


def test_progress_is_read_as_it_grows_and_a_torn_line_waits(tmp_path):
    reader = ProgressReader(tmp_path)
    assert reader.new_lines() == []  # no file yet
    path = tmp_path / "progress.jsonl"
    path.write_text(json.dumps({"step": 1, "reward": 0.5}) + "\n" + '{"step": 2, "rew')
    assert [line["step"] for line in reader.new_lines()] == [1]
    with path.open("a") as f:
        f.write('ard": 0.6}\n' + "not json\n" + json.dumps({"no": "step"}) + "\n" + json.dumps({"step": 3}) + "\n")
    assert [line["step"] for line in reader.new_lines()] == [2, 3]
    assert reader.new_lines() == []
    assert [line["step"] for line in read_progress(tmp_path)] == [1, 2, 3]


def test_the_earliest_rank_failure_is_the_cause(tmp_path):
    assert earliest_rank_failure(tmp_path) is None
    write_rank_failure(tmp_path, 1, FailureKind.ERROR, "the collective broke")
    earlier = {"rank": 0, "time": 1.0, "kind": "out_of_memory", "reason": "CUDA out of memory"}
    (tmp_path / "failure.rank0.json").write_text(json.dumps(earlier))
    (tmp_path / "failure.rank2.json").write_text("{")  # torn: skipped
    first = earliest_rank_failure(tmp_path)
    assert (first.rank, first.kind, first.reason) == (0, FailureKind.OUT_OF_MEMORY, "CUDA out of memory")
    (tmp_path / "failure.rank0.json").write_text(json.dumps({"rank": 0, "time": 1.0, "reason": "no kind: older"}))
    assert earliest_rank_failure(tmp_path).kind == FailureKind.ERROR
