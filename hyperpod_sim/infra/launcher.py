"""serve's side of the agent launcher (hyperpod_sim/agents/launcher.py): started at the first
launch and again if it died, asked over its Unix socket to fork an agent, stopped after the agents
at serve's shutdown.

The socket is in ``<data dir>/launcher/``, a directory of serve's user only (0700); the launcher
answers that user only. Its own environment is the agents' (what the provisioner gives every
agent, launch secret aside) with room for each child's to be written over it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hyperpod_sim.agents.launcher.server import MAX_REQUEST, ROOM_VARIABLE, unix_address
from hyperpod_sim.infra.processes import spawn

ROOM = 4096  # bytes of argv and of environment a forked agent may show as its own
START_TIMEOUT_S = 60.0
ANSWER_TIMEOUT_S = 30.0


class LauncherError(OSError):
    """The launcher could not start an agent (an OSError: a failed start, tried again)."""


def launcher_command(socket_path: Path, *, merge_pages: bool = True) -> list[str]:
    """The launcher's command line: this interpreter, serve's pid as its parent, room to spare."""
    return [
        sys.executable,
        *("-m", "hyperpod_sim", "agent-launcher"),
        *("--socket", str(socket_path), "--parent", str(os.getpid())),
        *(() if merge_pages else ("--no-merge-pages",)),
        *("--room", "." * ROOM),
    ]


@dataclass
class AgentLauncher:
    """The launcher of one data dir's agents, started lazily."""

    directory: Path  # <data dir>/launcher
    env: Mapping[str, str]  # the launcher's own environment: the agents' base
    merge_pages: bool = True  # its memory and its agents' mergeable by KSM (agents/launcher/server.py)
    _process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def socket_path(self) -> Path:
        return self.directory / "launcher.sock"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None and self._process.poll() is None else None

    def _ensure(self) -> None:
        if self._process is not None and self._process.poll() is None:
            return
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.directory, 0o700)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()  # a dead launcher's: the new one's appearing means it is up
        env = {**self.env, ROOM_VARIABLE: "." * ROOM}
        self._process = spawn(
            launcher_command(self.socket_path, merge_pages=self.merge_pages),
            env=env,
            log_path=self.directory / "launcher.log",
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.socket_path.exists():
            if self._process.poll() is not None:
                raise LauncherError(
                    f"the agent launcher exited with {self._process.returncode} "
                    f"(see {self.directory / 'launcher.log'})"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise LauncherError(f"the agent launcher did not listen within {START_TIMEOUT_S:.0f} s")
            time.sleep(0.02)

    def launch(self, argv: Sequence[str], *, env: Mapping[str, str], log_path: Path) -> int:
        """Fork an agent running ``argv`` with ``env``, its output appended to ``log_path``: its
        pid. Raises LauncherError (an OSError) if the launcher refused or is not there."""
        self._ensure()
        request = json.dumps({"argv": list(argv), "env": dict(env), "log": str(log_path)}).encode()
        if len(request) >= MAX_REQUEST:
            raise LauncherError(f"an agent's request of {len(request)} bytes is too large for the launcher")
        answer = ask(self.socket_path, request + b"\n")
        pid = answer.get("pid")
        if not isinstance(pid, int):
            raise LauncherError(f"the agent launcher refused: {answer.get('error', answer)}")
        return pid

    def stop(self) -> None:
        """Stop the launcher (its agents live on: stop them first)."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def ask(socket_path: Path, request: bytes) -> dict[str, object]:
    """Send ``request`` to the launcher at ``socket_path``; its answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(ANSWER_TIMEOUT_S)
        try:
            with unix_address(socket_path) as address:
                sock.connect(address)
            sock.sendall(request)
            data = bytearray()
            while b"\n" not in data:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                data += chunk
        except OSError as exc:
            raise LauncherError(f"the agent launcher at {socket_path} does not answer: {exc}") from exc
    try:
        answer = json.loads(bytes(data))
    except ValueError:
        raise LauncherError(f"the agent launcher answered {bytes(data)[:200]!r}") from None
    if not isinstance(answer, dict):
        raise LauncherError(f"the agent launcher answered {answer!r}")
    return answer
