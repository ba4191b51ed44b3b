"""`hyperpod-sim demo` runs in CI: its own control plane, a 2-rank job, a node lost mid-run, the
node replaced, the job resumed from the newest complete checkpoint, and the report."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_demo_loses_a_node_and_resumes(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "hyperpod_sim", "demo", "--steps", "16", "--fail-at", "9"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=420,
    )
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    assert "NodeLoss injected on" in out
    report = out[out.index("=== demo report ===") :]
    lost = int(re.search(r"\((\d+) steps lost\)", report).group(1))  # type: ignore[union-attr]
    # Checkpoints every 2 steps: at most that interval and the save in flight are lost.
    assert 0 <= lost <= 4, report
    resumed = int(re.search(r"resumed from:\s+step (\d+)", report).group(1))  # type: ignore[union-attr]
    assert resumed >= 8
    # Rank 1's own node is gone: its shard came from the replica on another node.
    assert re.search(r"^\s+rank 1\s.*\b(replica|peer)$", report, re.MULTILINE), report
    # One step count, one restore time, the replacement timed from the injection.
    failed_at = re.search(r"after step (\d+)", report).group(1)  # type: ignore[union-attr]
    assert f"(rank 1's node) after step {failed_at}\n" in out
    assert "resumed from step" not in out
    assert out.count("restore took:") == 1
    assert re.search(r"replaced in:\s+\d+\.\d s from the injection", report), report
    assert "is replaced by" in report
    # The job restarted by itself (job run --auto-resume), on the replacement, after the node
    # was replaced: the parts of the outage, each timed from the injection.
    stopped = float(re.search(r"job stopped:\s+(\d+\.\d) s", report).group(1))  # type: ignore[union-attr]
    replaced = float(re.search(r"replaced in:\s+(\d+\.\d) s", report).group(1))  # type: ignore[union-attr]
    restarted = float(re.search(r"job restarted:\s+(\d+\.\d) s", report).group(1))  # type: ignore[union-attr]
    assert stopped <= restarted
    assert replaced <= restarted + 0.1  # the restart waited for the replacement (event times round)
    assert re.search(r"Job \S+ attempt 1 ended: node \S+ failed", report), report
    assert re.search(r"Job \S+ attempt 2 started on", report), report
    assert "done: steps" in out
