"""A node agent that takes its time to stop, as one draining its checkpoints to S3 does.

The local provisioner runs it in place of ``hyperpod-sim agent`` (``HPSIM_PROVISIONING__AGENT_COMMAND``
= ``[python, tests/lingering_agent.py, agent]``, the agent's flags appended). It runs the real agent
as a child process and passes SIGTERM on to it, but itself exits only once the test creates the file
``release`` in the agent's ``--data-dir`` (or after a deadline, so that nothing outlives a failed
test): until then the provisioner sees the node's agent still running, as it would see one
still uploading. The child's own exit (a heartbeat answered 404) does not end the wait either.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

DEADLINE_S = 120.0


def main(argv: list[str]) -> int:
    data_dir = Path(argv[argv.index("--data-dir") + 1])
    child = subprocess.Popen([sys.executable, "-m", "hyperpod_sim", *argv])

    def forward(signum: int, frame: FrameType | None) -> None:
        child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    deadline = time.monotonic() + DEADLINE_S
    release = data_dir / "release"
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    child.terminate()
    child.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
