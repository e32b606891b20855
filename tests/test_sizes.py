"""Sizes that keep the code readable (issue 47): the engine's core under 400 lines, no class in
``foudre/`` over 500 lines, no function over 80 (decorators aside, docstrings included)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "foudre"
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 500
MAX_ENGINE_LINES = 400


def oversized(source: str, name: str) -> list[str]:
    """``name:line kind qualname (lines)`` for each function over ``MAX_FUNCTION_LINES`` and
    class over ``MAX_CLASS_LINES`` in ``source``."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                assert child.end_lineno is not None
                lines = child.end_lineno - child.lineno + 1
                is_class = isinstance(child, ast.ClassDef)
                limit = MAX_CLASS_LINES if is_class else MAX_FUNCTION_LINES
                if lines > limit:
                    kind = "class" if is_class else "function"
                    found.append(f"{name}:{child.lineno} {kind} {prefix}{child.name} ({lines})")
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source, name), "")
    return found


def test_no_function_or_class_is_too_long() -> None:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        found += oversized(path.read_text(), str(path.relative_to(ROOT.parent)))
    assert found == []


def test_the_engine_core_is_small() -> None:
    lines = len((ROOT / "engine" / "engine.py").read_text().splitlines())
    assert lines < MAX_ENGINE_LINES


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("x = 1\n" * 79, []),
        ("x = 1\n" * 80, ["f.py:1 function f (81)"]),
        ("class C:\n    def g(self):\n" + "        x = 1\n" * 80, ["f.py:2 function C.g (81)"]),
    ],
)
def test_an_oversized_function_is_found(body: str, expected: list[str]) -> None:
    if not body.startswith("class"):
        body = "def f():\n" + "".join("    " + line + "\n" for line in body.splitlines())
    assert oversized(body, "f.py") == expected


def test_an_oversized_class_is_found() -> None:
    body = "class C:\n" + "    x = 1\n" * 500
    assert oversized(body, "f.py") == ["f.py:1 class C (501)"]
