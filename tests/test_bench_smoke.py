"""The benchmark scripts still run: ``bench/run_all.py`` on each of its seven with small sizes,
``bench/agent_http.py`` (the agents' HTTP server against the loopback ceiling, docs/decisions/0001)
with a 4 MiB body, and ``bench/agent_client.py`` (the agents' client against httpx, 0005) small.

Nothing here judges a ratio (timings belong to the scripts, on a quiet machine); what is checked is
that every script starts its servers, measures each of its targets and writes the common
``target_ratios`` JSON that the README's table is made from. A script broken by a change elsewhere
(an API it calls, an option it passes) fails here instead of on the next benchmark run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SMALL = {
    "control_plane": "--duration 0.3 --warmup 5 --clients 1,8",
    "policy_rollout": "--sizes 1,64 --repeats 1",  # its target compares 64 nodes with 1
    "memory_tier": "--sizes 8 --repeats 1 --no-replication",
    "s3_tier": "--sizes 8 --repeats 1 --saves 2 --save-size 4",
    "checkpoint_path": "--sizes 16 --repeats 2",
    "reshard": "--size 16 --repeats 1",
    "scale": "--sizes 2,4 --settle-s 1 --steady-s 1 --idle-s 1 --latest-calls 3 --rollouts 1",
}


def test_the_smoke_runs_every_benchmark_of_run_all(tmp_path: Path) -> None:
    command = [sys.executable, str(ROOT / "bench" / "run_all.py"), "--results", str(tmp_path), "--dry-run"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    commands = [line.split() for line in result.stdout.splitlines() if line.startswith(sys.executable)]
    scripts = {Path(command[1]).stem for command in commands}
    assert scripts == set(SMALL)


# One test a benchmark (run_all.py --only): the xdist workers run them side by side, where one test
# of all of them was the suite's longest (about 150 s) and often its last.
@pytest.mark.parametrize("name", list(SMALL))
def test_each_benchmark_runs_and_measures_its_targets(tmp_path: Path, name: str) -> None:
    command = [
        *(sys.executable, str(ROOT / "bench" / "run_all.py"), "--results", str(tmp_path)),
        *("--only", name, "--args", f"{name}={SMALL[name]}"),
    ]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    rows = json.loads((tmp_path / "table.json").read_text())["rows"]
    assert {row["benchmark"] for row in rows} == {name}, rows
    unmeasured = [row for row in rows if not isinstance(row.get("value"), int | float)]
    assert not unmeasured, unmeasured
    report = json.loads((tmp_path / f"{name}.json").read_text())
    assert report["target_ratios"], name


def test_the_agent_http_benchmark_runs_and_measures_every_cell(tmp_path: Path) -> None:
    # Not one of run_all's: it has no target, only the numbers behind docs/decisions/0001. Its
    # untimed first run of each cell checks the bytes (a SHA-256 on the server, a comparison here).
    out = tmp_path / "agent_http.json"
    command = [sys.executable, str(ROOT / "bench" / "agent_http.py"), "--mib", "4", "--runs", "1"]
    result = subprocess.run(
        [*command, "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report = json.loads(out.read_text())
    assert len(report["cells"]) == 7, report
    assert all(cell["mib_per_s"] > 0 and len(cell["times_s"]) == 1 for cell in report["cells"]), report
    assert len(report["ratios"]) == 4, report
    assert all(ratio > 0 for ratio in report["ratios"].values()), report


def test_the_agent_client_benchmark_runs_and_measures_both_ratios(tmp_path: Path) -> None:
    # Not one of run_all's: the numbers behind docs/decisions/0005, each library against the agents'
    # own server; its calls check every answer's length.
    out = tmp_path / "agent_client.json"
    command = [sys.executable, str(ROOT / "bench" / "agent_client.py"), "--calls", "300", "--peers", "128"]
    result = subprocess.run(
        [*command, "--runs", "1", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report = json.loads(out.read_text())
    # (Either library's CPU may be less than os.times can tell at these sizes: a ratio of 0, or none.)
    assert len(report["target_ratios"]) == 2, report
    assert {len(cells["fan_cpu"]) for cells in report["results"].values()} == {1}, report
