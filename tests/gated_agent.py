"""A node agent that starts only once the test lets it, as one on a node still booting would.

The local provisioner runs it in place of ``hyperpod-sim agent`` (``HPSIM_PROVISIONING__AGENT_COMMAND``
= ``[python, tests/gated_agent.py, agent]``, the agent's flags appended). It waits until the test
creates the file ``start`` in the agent's ``--data-dir`` (or a deadline passes, so that nothing
outlives a failed test), then becomes the real agent (exec, same pid). Until then its node stays
Pending and its cluster Creating, however fast or slow the machine is.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

DEADLINE_S = 120.0


def main(argv: list[str]) -> int:
    start = Path(argv[argv.index("--data-dir") + 1]) / "start"
    deadline = time.monotonic() + DEADLINE_S
    while not start.exists():
        if time.monotonic() > deadline:
            return 1
        time.sleep(0.05)
    os.execv(sys.executable, [sys.executable, "-m", "hyperpod_sim", *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
