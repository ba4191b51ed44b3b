"""docs/architecture.md names every module of the package, one line each (section "Every module"),
and names none that does not exist: a newcomer finds each file's place there."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hyperpod_sim"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
LISTED = re.compile(r"^- `(?P<path>[^`]+)`: \S")


def docstring_only(path: Path) -> bool:
    """An ``__init__.py`` holding nothing but its docstring (the package's line says enough)."""
    body = ast.parse(path.read_text(encoding="utf-8")).body
    return all(isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) for node in body)


def modules() -> set[str]:
    found = set()
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith("migrations/versions/"):
            found.add("migrations/versions/")  # the revisions: one line
        elif path.name == "__init__.py" and docstring_only(path):
            continue
        else:
            found.add(relative)
    return found


def listed() -> list[str]:
    text = ARCHITECTURE.read_text(encoding="utf-8")
    section = text.split("\n## Every module\n", 1)
    assert len(section) == 2, "docs/architecture.md has no section '## Every module'"
    body = section[1].split("\n## ", 1)[0]
    return [match["path"] for line in body.splitlines() if (match := LISTED.match(line))]


def test_every_module_is_listed_once() -> None:
    names = listed()
    missing = sorted(modules() - set(names))
    assert not missing, f"docs/architecture.md, 'Every module', lacks a line for: {', '.join(missing)}"
    twice = sorted({name for name in names if names.count(name) > 1})
    assert not twice, f"listed more than once: {', '.join(twice)}"


def test_every_listed_module_exists() -> None:
    extra = sorted(set(listed()) - modules())
    assert not extra, f"docs/architecture.md, 'Every module', names what is not a module: {', '.join(extra)}"


# The domain works on typed values (models/values.py), not on AWS wire dicts: a read of a
# PascalCase key there is a read strict mypy cannot check. The API converts wire to value.
PASCAL_KEY = re.compile(r"^[A-Z][a-z0-9]+[A-Za-z0-9]*$")
PASCAL_READS_AT_MOST = 1


def pascal_key_reads(path: Path) -> list[str]:
    """``x["Key"]`` loads and ``x.get("Key")`` / ``.pop`` / ``.setdefault`` calls with a PascalCase key."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        key = None
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            if isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
                key = node.slice.value
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("get", "pop", "setdefault")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            key = node.args[0].value
        if key is not None and PASCAL_KEY.match(key):
            found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {key}")
    return found


def test_the_domain_reads_few_wire_keys() -> None:
    reads = [read for path in sorted((PACKAGE / "domain").rglob("*.py")) for read in pascal_key_reads(path)]
    assert len(reads) <= PASCAL_READS_AT_MOST, "\n".join(reads)


# The layout shows the parts (docs/architecture.md): the package's top level holds the entry
# points and the settings only, and no folder grows past what a reader takes in at a glance.
TOP_LEVEL_AT_MOST = 4
FOLDER_AT_MOST = 20


def test_the_layout_stays_grouped() -> None:
    top = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(top) <= TOP_LEVEL_AT_MOST, f"modules directly in hyperpod_sim/: {', '.join(top)}"
    for folder in sorted({path.parent for path in PACKAGE.rglob("*.py")}):
        if folder.name == "versions":
            continue  # the Alembic revisions: one file per schema change
        count = len(list(folder.glob("*.py")))
        assert count <= FOLDER_AT_MOST, f"{folder.relative_to(ROOT)} holds {count} modules"
