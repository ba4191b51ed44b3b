"""No test module imports another: what test modules share lives where shared test code belongs
(fixtures in tests/conftest.py and its plugins under tests/plugins/, plain helpers in the modules
of tests/ not named ``test_*``), so that a module's tests can move or go without breaking
another's, and a fixture reaches a module by pytest's lookup, not by an import."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def imported_modules(source: str, package: str) -> Iterator[tuple[int, str]]:
    """Every module an import statement of ``source`` (a file of ``package``) may name, absolute,
    with its line. ``from p import x`` names ``p`` and ``p.x`` (x may be a module); a ``test_*``
    name imported from a module is taken for a module too: a test function imported into another
    module would run twice."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            yield node.lineno, module
            for alias in node.names:
                yield node.lineno, f"{module}.{alias.name}"


def is_test_module(module: str) -> bool:
    parts = module.split(".")
    return parts[0] == "tests" and parts[-1].startswith("test_")


def test_no_test_module_imports_another() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for path in sorted(TESTS.rglob("*.py"))
        for line, module in imported_modules(
            path.read_text(encoding="utf-8"), ".".join(path.parent.relative_to(ROOT).parts)
        )
        if is_test_module(module)
    ]
    assert not found, (
        "test modules imported (move what they share to a helper module of tests/, or a fixture to "
        "tests/plugins/):\n" + "\n".join(found)
    )


def test_the_walk_sees_every_form_of_import() -> None:
    source = (
        "import tests.test_a\n"
        "from tests.test_b import f\n"
        "from tests import test_c\n"
        "from .test_d import g\n"
        "from .. import test_e\n"
        "def later():\n"
        "    from ..test_f import h\n"
        "from tests.helpers import wait_for\n"
        "from . import fake_agent\n"
    )
    found = {module for _, module in imported_modules(source, "tests.security") if is_test_module(module)}
    assert found == {
        "tests.test_a",
        "tests.test_b",
        "tests.test_c",
        "tests.security.test_d",
        "tests.test_e",
        "tests.test_f",
    }
