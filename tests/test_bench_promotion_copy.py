"""bench/promotion_copy.py on a small folder: a promotion's parts timed both ways, and nothing left behind."""

from __future__ import annotations

from bench import promotion_copy


def test_a_copied_and_a_linked_promotion_are_timed_and_the_work_folder_removed(tmp_path):
    work = tmp_path / "work"
    figures = promotion_copy.measure(work, gb=0.01)
    assert 0 < figures["gb"] <= 0.02
    for way, shared in (("copied", False), ("linked", True)):
        assert set(figures[way]) == {"copy", "flush", "check", "shares_files"}
        assert figures[way]["shares_files"] is shared
    assert not work.exists()
