"""The README runs: its ``sh`` and ``python`` blocks, extracted in order and run as a new user would
type them, against a ``hyperpod-sim serve`` of the test's own (SQLite, local agents, the embedded
S3; the data dir is ``.hyperpod-sim`` under the directory the blocks run in, as after ``make
run``). The only changes made to a block are the addresses (the test's free ports for 8080 and
8333) and ``.venv/bin/`` (the interpreter's own bin directory); ``hyperpod-sim`` is on the PATH.
Between blocks the test waits until every cluster has settled (InService, or gone), as a reader
would before the next command. A block the test cannot run says why in the README, on the line
before it: ``<!-- readme-test: skip (reason) -->``. ``console`` blocks are transcripts, not run."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import ServerProcess, embedded_s3_port, kill_processes_under, shm_root_for, wait_for

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SKIP = re.compile(r"<!-- readme-test: skip \((?P<reason>[^)]+)\) -->")
RUN = ("sh", "python")


@dataclass(frozen=True)
class Block:
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    skip: str | None  # the reason, from the marker on the line before


def blocks(text: str) -> list[Block]:
    """The fenced blocks of a Markdown text, in order."""
    found: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        fence = re.fullmatch(r"```(\w*)\s*", lines[i])
        if fence is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = lines[i - 1] if i else ""
        marker = SKIP.fullmatch(before.strip())
        code = "\n".join(lines[i + 1 : end]) + "\n"
        found.append(Block(i + 1, fence.group(1), code, marker["reason"] if marker else None))
        i = end + 1
    return found


def test_the_blocks_are_found_and_every_skip_has_a_reason() -> None:
    found = [b for b in blocks(README.read_text(encoding="utf-8")) if b.language in RUN]
    assert len(found) >= 6
    assert found[0].skip is not None
    assert "make run" in found[0].code
    # A marker (a line of its own) that is not followed by a block would skip nothing: none stray.
    markers = sum(1 for line in README.read_text(encoding="utf-8").splitlines() if SKIP.fullmatch(line))
    assert markers == sum(1 for b in blocks(README.read_text(encoding="utf-8")) if b.skip)


def _settled(server: ServerProcess) -> bool:
    clusters = server.client().list_clusters()["ClusterSummaries"]
    return all(c["ClusterStatus"] in ("InService", "Failed") for c in clusters)


def test_the_readme_runs_in_order(tmp_path: Path) -> None:
    data_dir = tmp_path / ".hyperpod-sim"
    server = ServerProcess(f"sqlite:///{data_dir}/hyperpod-sim.db", data_dir)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "hyperpod-sim"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m hyperpod_sim "$@"\n')
    shim.chmod(0o755)
    venv_bin = Path(sys.executable).parent
    env = {
        **server.env,
        "PATH": f"{bin_dir}:{venv_bin}:{os.environ.get('PATH', '')}",
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "HPSIM_ENDPOINT_URL"):
        env.pop(key, None)
    ran: list[int] = []
    try:
        server.start()
        s3 = f"http://127.0.0.1:{embedded_s3_port(data_dir)}"
        for block in blocks(README.read_text(encoding="utf-8")):
            if block.language not in RUN or block.skip:
                continue
            code = (
                block.code.replace("http://127.0.0.1:8080", server.url)
                .replace("http://127.0.0.1:8333", s3)
                .replace(".venv/bin/", f"{venv_bin}/")
            )
            if block.language == "sh":
                code = f"export HPSIM_ENDPOINT_URL={server.url}\n{code}"
                argv = ["bash", "-e", "-o", "pipefail", "-c", code]
            else:
                argv = [sys.executable, "-c", code]
            wait_for(lambda: _settled(server), timeout=180, what="the clusters to settle")
            done = subprocess.run(
                argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False
            )
            assert done.returncode == 0, (
                f"README.md line {block.line} ({block.language}) failed with {done.returncode}:\n"
                f"{block.code}\n--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}\n"
                f"--- serve\n{server.log_tail()}"
            )
            ran.append(block.line)
    finally:
        server.stop()
        kill_processes_under(tmp_path)
        shutil.rmtree(shm_root_for(data_dir), ignore_errors=True)
    assert len(ran) >= 5, ran
