"""``hyperpod-sim serve`` and what it leaves on disk (issue 12: the control plane without credentials
is loopback-only; the database holding the tokens is its owner's alone)."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from hyperpod_sim.models import Database
from tests.conftest import ControlPlane, free_port, shm_root_for

ROOT = Path(__file__).resolve().parent.parent.parent


def serve_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HPSIM_")}
    return {
        **env,
        "HPSIM_S3__EMBEDDED": "false",
        "HPSIM_PROVISIONING__MODE": "simulated",
        "HPSIM_SIMULATION__SHM_ROOT": str(shm_root_for(tmp_path)),
        **extra,
    }


def listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.10", "cp.example.com"])
def test_serve_refuses_a_non_loopback_address_without_credentials(tmp_path: Path, host: str) -> None:
    port = free_port()
    data_dir = tmp_path / "data"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "hyperpod_sim",
            "serve",
            "--host",
            host,
            "--port",
            str(port),
            "--data-dir",
            str(data_dir),
        ],
        cwd=ROOT,
        env=serve_env(tmp_path, HPSIM_S3__EMBEDDED="true"),  # it would start moto: it must not
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2
    assert result.stdout == ""  # no embedded S3, no banner: nothing started
    assert result.stderr.startswith(
        f"hyperpod-sim serve: refusing to listen on {host} without credentials: anyone who can reach it "
        "could drive every cluster. Configure them, e.g.\n"
        """  HPSIM_AUTH__CREDENTIALS='{"AKIDEXAMPLE": "a-long-random-secret"}'\n"""
    )
    assert "See docs/security.md." in result.stderr
    assert not data_dir.exists()
    assert not listening(port)


def serve_banner(tmp_path: Path, port: int, **env: str) -> str:
    """The first line ``serve`` prints on ``port`` with ``env`` added (it is stopped afterwards)."""
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hyperpod_sim",
            "serve",
            "--port",
            str(port),
            "--data-dir",
            str(tmp_path / "d"),
        ],
        cwd=ROOT,
        env=serve_env(tmp_path, **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        return process.stdout.readline()  # blocks until serve prints it (or exits)
    finally:
        process.terminate()
        process.wait(timeout=60)


def test_serve_with_credentials_says_auth_is_on(tmp_path: Path) -> None:
    port = free_port()
    banner = serve_banner(
        tmp_path,
        port,
        HPSIM_AUTH__CREDENTIALS=json.dumps({"AKIDONE": "s1", "AKIDTWO": "s2"}),
        HPSIM_AUTH__ADMIN_CREDENTIALS=json.dumps({"AKIDADMIN": "s3"}),
    )
    assert banner == (
        f"hyperpod-sim control plane on http://127.0.0.1:{port} (database: sqlite:///"
        f"{(tmp_path / 'd' / 'hyperpod-sim.db').resolve()}; auth on: 2 access key(s), 1 admin)\n"
    )


def test_the_banner_says_when_auth_is_off(tmp_path: Path) -> None:
    banner = serve_banner(tmp_path, free_port())
    assert banner.endswith("; auth off: loopback only, no credentials configured)\n"), banner


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_the_database_and_data_dir_are_the_owners_only(control_plane: ControlPlane, tmp_path: Path) -> None:
    database = Path(control_plane.database_url.removeprefix("sqlite:///"))
    for path in [database, *database.parent.glob(database.name + "-*")]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE(control_plane.services.settings.data_dir.stat().st_mode) == 0o700


def test_an_existing_world_readable_database_is_tightened(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    path.write_bytes(b"")
    path.chmod(0o644)
    database = Database(f"sqlite:///{path}")
    try:
        database.migrate()
    finally:
        database.dispose()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
