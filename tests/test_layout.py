"""The house's layout as the code imports it: the arrows between the parts flow one way (run_search.py -> search ->
trainer / evaluator; trainer -> evaluator; every part -> common), and code outside a room of search/ enters it only
through what its `__init__` offers. Read from the source with ast: no module is imported. CPU, under a second."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("run_search", "search", "trainer", "evaluator", "common", "synthetic")
# What each part may import of the others; anything else is an arrow the wrong way.
ALLOWED = {
    "run_search": {"search", "common"},
    "search": {"trainer", "evaluator", "common", "synthetic"},  # synthetic: the demo's box, built by --demo
    "trainer": {"evaluator", "common"},
    "evaluator": {"common"},
    "common": set(),
    "synthetic": {"evaluator", "common"},  # the demo model is taught with the evaluator's prompt
}


def _sources(part: str) -> list[Path]:
    return [ROOT / "run_search.py"] if part == "run_search" else sorted((ROOT / part).rglob("*.py"))


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every absolute import in `path`, those inside functions too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
    return found


def _rooms() -> list[str]:
    return sorted(path.parent.name for path in (ROOT / "search").glob("*/__init__.py"))


def _is_module(room: str, name: str) -> bool:
    folder = ROOT / "search" / room
    return (folder / f"{name}.py").is_file() or (folder / name / "__init__.py").is_file()


def test_the_parts_import_one_way():
    wrong = []
    for part in PARTS:
        for path in _sources(part):
            for line, module, _ in _imports(path):
                top = module.split(".")[0]
                if top in PARTS and top != part and top not in ALLOWED[part]:
                    wrong.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not wrong, "\n".join(wrong)


def test_outside_a_room_of_search_only_its_init_is_imported():
    """bench/ and the parts (tests may reach inside a module they test)."""
    rooms = _rooms()
    assert {"backends", "merge", "promotion", "report"} <= set(rooms)
    sources = [path for part in PARTS for path in _sources(part)] + sorted((ROOT / "bench").rglob("*.py"))
    wrong = []
    for path in sources:
        for line, module, names in _imports(path):
            parts = module.split(".")
            if parts[0] != "search" or len(parts) < 2 or parts[1] not in rooms:
                continue
            if path.is_relative_to(ROOT / "search" / parts[1]):
                continue
            reached = [parts[2]] if len(parts) > 2 else names  # `search.room.module` or `from search.room import x`
            wrong += [f"{path.relative_to(ROOT)}:{line} imports search.{parts[1]}.{name}" for name in reached
                      if _is_module(parts[1], name)]  # fmt: skip
    assert not wrong, "\n".join(wrong)


def test_the_checks_see_a_wrong_arrow_and_a_private_module(tmp_path):
    """The walker finds imports inside functions and both import forms (else the checks above would pass on
    anything)."""
    source = tmp_path / "probe.py"
    source.write_text("def f():\n    from search.promotion import verification\n    import trainer.rewards\n")
    found = _imports(source)
    assert (2, "search.promotion", ["verification"]) in found and (3, "trainer.rewards", []) in found
    assert _is_module("promotion", "verification") and not _is_module("promotion", "promote")
