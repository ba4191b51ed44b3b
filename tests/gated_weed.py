"""A SeaweedFS that starts only while the test lets it, so that an outage of the embedded S3 lasts
exactly as long as the test needs to look at it.

The embedded S3 runs it in place of ``weed`` (``HPSIM_S3__WEED_BINARY`` = a script that runs
``python tests/gated_weed.py <real weed> <weed's arguments>``). While the file ``hold-weed`` exists
in the data dir (the parent of weed's ``-dir``) it waits (up to a deadline, so that nothing outlives
a failed test; then it exits 1); then it becomes the real weed (exec, same pid).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

DEADLINE_S = 120.0


def main(argv: list[str]) -> int:
    binary, *args = argv
    s3_dir = next(Path(arg.removeprefix("-dir=")) for arg in args if arg.startswith("-dir="))
    hold = s3_dir.parent / "hold-weed"
    deadline = time.monotonic() + DEADLINE_S
    while hold.exists():
        if time.monotonic() > deadline:
            return 1
        time.sleep(0.05)
    os.execv(binary, [binary, *args])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
