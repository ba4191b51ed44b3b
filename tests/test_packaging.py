"""What installing the package puts on a trainer's machine: one import name of ours, and the files
the server needs at run time (migrations, the console) inside it; the SDK extra without the
server; a one-line message, naming the extra, from a command or module whose extra is missing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SERVER_MODULES = ("fastapi", "sqlalchemy", "uvicorn", "alembic", "moto", "torch")
OURS_SERVER_SIDE = ("hyperpod_sim.api", "hyperpod_sim.domain", "hyperpod_sim.models", "hyperpod_sim.agents")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # From a copy of the checkout: an in-tree build/ would leave stale files in the wheel.
    source = tmp_path_factory.mktemp("source") / "hyperpod-sim"
    skipped = (".git", ".venv", "build", "*.egg-info", "__pycache__", ".*_cache", ".hyperpod-sim", "results")
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*skipped))
    # setuptools' own build (PEP 517), so that its warnings reach this test.
    build = "import sys; from setuptools import build_meta; build_meta.build_wheel(sys.argv[1])"
    done = subprocess.run(
        [sys.executable, "-c", build, str(out)], cwd=source, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # The license is an SPDX expression: setuptools has nothing to deprecate.
    assert "deprecat" not in (done.stdout + done.stderr).lower(), done.stderr
    (built,) = out.glob("hyperpod_sim-*.whl")
    return built


def test_wheel_holds_only_our_package(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top == {"hyperpod_sim"}
    # A trainer's own `models/` or `api/` package cannot collide with ours.
    assert not any(name.startswith(("models/", "api/", "sdk/", "agents/", "domain/")) for name in names)
    # The server's run-time files travel inside the package.
    assert any(name.startswith("hyperpod_sim/migrations/versions/0001_") for name in names)
    assert "hyperpod_sim/migrations/script.py.mako" in names
    metadata = zipfile.ZipFile(wheel).read(f"{wheel.name.split('-')[0]}-0.1.0.dist-info/METADATA").decode()
    for extra in ("sdk", "trainer", "server", "dev"):
        assert f"Provides-Extra: {extra}\n" in metadata
    assert "License-Expression: Apache-2.0" in metadata


def install(wheel: Path, tmp_path: Path, extra: str) -> tuple[Path, dict[str, str]]:
    """``pip install 'hyperpod-sim[EXTRA]'`` into a fresh venv: ours from the wheel, dependencies
    from the configured index. Returns the venv and the environment to run it with."""
    venv = tmp_path / "venv"
    tmp_path.mkdir(parents=True, exist_ok=True)
    # Nothing of the checkout on the path: the venv sees the installed wheel only.
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--find-links", str(wheel.parent),
         f"hyperpod-sim[{extra}]"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "does not provide the extra" not in done.stdout + done.stderr
    return venv, env


def test_the_sdk_extra_installs_no_server(wheel: Path, tmp_path: Path) -> None:
    venv, env = install(wheel, tmp_path, "sdk")
    python = str(venv / "bin" / "python")

    probe = (
        "import sys, hyperpod_sim.sdk.client, hyperpod_sim.sdk.agent, hyperpod_sim.cli.clusters\n"
        f"print(sorted(m for m in sys.modules if m.partition('.')[0] in {SERVER_MODULES!r} "
        f"or m.startswith({OURS_SERVER_SIDE!r})))\n"
    )
    imported = subprocess.run(
        [python, "-c", probe], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env
    )
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.strip() == "[]"

    # A command whose extra is missing says which to install, in one line.
    serve = subprocess.run(
        [str(venv / "bin" / "hyperpod-sim"), "serve", "--data-dir", str(tmp_path / "data")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert serve.returncode == 1
    assert serve.stderr.strip().splitlines() == [
        "hyperpod-sim serve: needs the 'server' extra (no module 'uvicorn'): "
        "pip install 'hyperpod-sim[server]'"
    ], serve.stderr
    checkpoint = subprocess.run(
        [python, "-c", "import hyperpod_sim.sdk.checkpoint"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env=env,
    )
    assert checkpoint.returncode == 1
    assert checkpoint.stderr.strip().splitlines()[-1] == (
        "ModuleNotFoundError: hyperpod_sim.sdk.checkpoint needs torch: pip install 'hyperpod-sim[trainer]'"
    )


@pytest.mark.skipif(
    not os.environ.get("HPSIM_TEST_ALL_EXTRAS"),
    reason="two more installs (about 1.4 GB, one to two minutes): set HPSIM_TEST_ALL_EXTRAS=1",
)
def test_the_server_and_trainer_extras_bring_what_they_promise(wheel: Path, tmp_path: Path) -> None:
    """One venv, the two extras in turn: the server without torch, then the trainer's DCP writer."""
    venv, env = install(wheel, tmp_path / "server", "server")
    python = str(venv / "bin" / "python")
    probe = (
        "import importlib.util, hyperpod_sim.api.app, hyperpod_sim.serve.process, hyperpod_sim.agents.main\n"
        "print(importlib.util.find_spec('torch'))\n"
    )
    done = subprocess.run(
        [python, "-c", probe], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "None"  # the server does not pull in torch

    venv, env = install(wheel, tmp_path / "trainer", "trainer")
    probe = (
        "import importlib.util, hyperpod_sim.sdk.checkpoint\n"
        "print(importlib.util.find_spec('fastapi'), importlib.util.find_spec('sqlalchemy'))\n"
    )
    python = str(venv / "bin" / "python")
    done = subprocess.run(
        [python, "-c", probe], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "None None"  # nor the trainer the server
