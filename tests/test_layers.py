"""Layering: what each package may import, checked statically (``ast``, nothing imported) and, for
the client side, at run time in a fresh interpreter.

* ``sdk/`` and ``agents/`` are what a trainer installs: they never pull in the server.
* ``domain/`` and ``models/`` know nothing of HTTP.
* ``models/`` is persistence only: it never reaches up into ``domain/`` or ``api/``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SERVER = {"api", "models", "domain", "sqlalchemy", "alembic", "fastapi", "uvicorn", "moto"}
HTTP = {"fastapi", "starlette", "uvicorn", "api"}

RULES = [
    ("sdk", SERVER),
    ("agents", SERVER),
    ("domain", HTTP),
    ("models", HTTP | {"domain"}),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def resolve(module: str | None, level: int, importer: str, is_package: bool) -> str:
    """The absolute name a (possibly relative) ``from ... import`` refers to."""
    if level == 0:
        return module or ""
    base = importer.split(".")
    # In a package's __init__ the package itself is level 1; in a module, its parent is.
    drop = level - 1 if is_package else level
    if drop:
        base = base[:-drop]
    return ".".join([*base, module] if module else base)


def imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``, wherever it sits (functions too),
    and of ``importlib.import_module("...")`` / ``__import__("...")`` with a literal name."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    importer = module_name(path)
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = resolve(node.module, node.level, importer, is_package)
            yield node.lineno, base
            if node.module is None:  # from . import x: x may be a module
                for alias in node.names:
                    yield node.lineno, f"{base}.{alias.name}"
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                yield node.lineno, node.args[0].value


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def violations(package: str, forbidden: set[str]) -> list[str]:
    found = []
    for path in sources(package):
        for line, name in imports(path):
            if name.split(".")[0] in forbidden:
                found.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    return found


@pytest.mark.parametrize(("package", "forbidden"), RULES, ids=[package for package, _ in RULES])
def test_package_imports_stay_in_their_layer(package: str, forbidden: set[str]) -> None:
    files = sources(package)
    assert ROOT / package / "__init__.py" in files, f"no sources found under {package}/"
    assert violations(package, forbidden) == []


def test_domain_and_models_are_walked_in_full() -> None:
    """The walk sees the real modules (and their imports), so an empty answer above means something."""
    assert {p.name for p in sources("domain")} >= {"__init__.py", "clusters.py", "errors.py"}
    assert {p.name for p in sources("models")} >= {"__init__.py", "db.py", "tables.py"}
    # domain/ does import the persistence layer and SQLAlchemy: the walk reports what is there.
    assert {"models", "sqlalchemy"} <= {
        name.split(".")[0] for p in sources("domain") for _, name in imports(p)
    }


def test_checker_catches_forbidden_imports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every import form the walk understands is reported, relative ones resolved."""
    package = tmp_path / "sdk"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from . import client\n")
    (package / "client.py").write_text(
        "import json\n"
        "import fastapi.responses\n"
        "from sqlalchemy import select\n"
        "def later():\n"
        "    import alembic\n"
        "    importlib.import_module('moto')\n"
    )
    (package / "sub" / "__init__.py").write_text(
        "from .. import client\nfrom .mod import x\nimport moto.core\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert violations("sdk", SERVER) == [
        "hyperpod_sim/sdk/client.py:2 imports fastapi.responses",
        "hyperpod_sim/sdk/client.py:3 imports sqlalchemy",
        "hyperpod_sim/sdk/client.py:5 imports alembic",
        "hyperpod_sim/sdk/client.py:6 imports moto",
        "hyperpod_sim/sdk/sub/__init__.py:3 imports moto.core",
    ]
    assert [name for _, name in imports(package / "sub" / "__init__.py")] == [
        "sdk",
        "hyperpod_sim.sdk.client",
        "hyperpod_sim.sdk.sub.mod",
        "moto.core",
    ]
    assert [name for _, name in imports(package / "__init__.py")] == ["sdk", "hyperpod_sim.sdk.client"]
    assert violations("models", {"domain"}) == []  # no such package: nothing found, and the
    assert sources("models") == []  # parametrized test above would then fail on the __init__.py check


def test_sdk_and_agents_import_without_the_server() -> None:
    script = (
        "import sdk, agents, sys; "
        "bad = {m for m in sys.modules "
        "if m.split('.')[0] in {'sqlalchemy','fastapi','alembic','uvicorn','moto','api','models','domain'}}; "
        "assert not bad, sorted(bad); "
        "print(sdk.__file__); print(agents.__file__)"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    # The packages imported are this project's, not something else on the path.
    assert result.stdout.split() == [str(ROOT / "sdk" / "__init__.py"), str(ROOT / "agents" / "__init__.py")]
