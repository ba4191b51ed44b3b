"""Layering: what each package may import.

The rules are import-linter contracts in pyproject.toml (``[tool.importlinter]``), checked
statically by ``lint-imports`` (``make lint``); the test here runs it, so ``pytest`` alone catches a
violation too. The run-time half checks what the static one cannot: importing the SDK and the
agents in a fresh interpreter loads no server module (a plugin, a ``.pth`` hook, an import by
name).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SERVER = ("sqlalchemy", "fastapi", "starlette", "alembic", "uvicorn", "moto")
OURS = ("hyperpod_sim.api", "hyperpod_sim.models", "hyperpod_sim.domain", "hyperpod_sim.infra")


def lint_imports() -> str | None:
    """The ``lint-imports`` of this interpreter's environment, else the one on the PATH."""
    beside = Path(sys.executable).with_name("lint-imports")
    return str(beside) if beside.exists() else shutil.which("lint-imports")


def test_import_linter_contracts_are_kept() -> None:
    command = lint_imports()
    if command is None:
        pytest.fail("lint-imports is not installed: pip install -e '.[dev]'")
    result = subprocess.run(
        [command, "--no-cache", "--no-logo"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout, result.stdout[-4000:]


def test_sdk_and_agents_import_without_the_server() -> None:
    script = (
        "import hyperpod_sim.sdk.checkpoint, hyperpod_sim.sdk.client, hyperpod_sim.agents.main, sys; "
        f"bad = {{m for m in sys.modules if m.split('.')[0] in {set(SERVER)!r} "
        f"or '.'.join(m.split('.')[:2]) in {set(OURS)!r}}}; "
        "assert not bad, sorted(bad); "
        "import hyperpod_sim; print(hyperpod_sim.__file__)"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    # The package imported is this checkout's, not something else on the path.
    assert result.stdout.split() == [str(ROOT / "hyperpod_sim" / "__init__.py")]
