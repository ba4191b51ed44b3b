"""The measurements of ``s3_tier.py``: persistence throughput (the agent against boto3 and against
its own upload code in this process) and the save latency while persisting."""

from __future__ import annotations

import contextlib
import io
import json
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from bench.common import MIB, progress
from bench.runner import Cpu, NodeAgent, median_or_none
from bench.s3_servers import BUCKET, S3Load, shm_file
from bench.tier_agent import AgentConnection, Shard

OURS = "hyperpod-sim"
BASELINE = "boto3"
AGENT_CODE = "S3Objects"
OFF, CONTROL, ON = "off", "off + S3 load", "every step"
POLL_S = 0.01
METADATA = b"m" * 4096
WARMUP_STEPS = 2
LATENCY_STEPS_RETAINED = 3


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
    agent: AgentConnection, pids: tuple[int, ...], s3: Any, namespace: str, step: int, shards: list[Shard]
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
    ended = agent.wait_metric("hpsim_s3_persisted_steps_total", lambda v: v > committed, POLL_S)
    (s3_cpu, agent_cpu), other = cpu.spent()

    marker_key = f"ours/{namespace}/_committed/step_{step}.json"
    marker = json.loads(s3.get_object(Bucket=BUCKET, Key=marker_key)["Body"].read())
    sizes = {d["rank"]: d["size"] for d in marker["shards"]}
    expected = {rank: len(s.body) for rank, s in enumerate([*shards, metadata])}
    if sizes != expected:
        raise RuntimeError(f"{marker_key} lists shard sizes {sizes}, expected {expected}")
    if step > 1:  # S3Retention 1: the previous step goes once this one is committed
        deleted = before["hpsim_s3_retention_deleted_steps_total"]
        agent.wait_metric("hpsim_s3_retention_deleted_steps_total", lambda v: v > deleted, POLL_S)
    return Upload(ended - start, s3_cpu, agent_cpu, other)


def delete_prefix(s3: Any, prefix: str) -> None:
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
        if keys:
            s3.delete_objects(Bucket=BUCKET, Delete={"Objects": keys, "Quiet": True})


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
        s3_cpu_s=median_or_none([u.s3_cpu_s for u in uploads], 3),
        uploader_cpu_s=median_or_none([u.uploader_cpu_s for u in uploads], 3),
        other_cpus=median_or_none([u.other_cpus for u in uploads], 3),
    )


def measure_throughput(
    agent: NodeAgent,
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
    client = AgentConnection(agent.endpoint)

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


def measure_latency(
    agent: NodeAgent, pids: tuple[int, ...], persistence: str, body: bytes, saves: int, load: S3Load | None
) -> LatencyRow:
    """``saves`` timed steps (data rank timed, metadata rank not) after WARMUP_STEPS untimed ones.
    ``pids``: the S3 server, the agent, then the run's other processes."""
    client = AgentConnection(agent.endpoint)
    namespace = f"lat-{persistence.replace(' ', '-').replace('+', 'and')}"
    try:
        data, metadata = Shard.of(body), Shard.of(METADATA)
        client.create_namespace(namespace, 2, steps_retained=LATENCY_STEPS_RETAINED)
        warmup = []
        for step in range(WARMUP_STEPS):
            warmup.append(client.save(namespace, 0, step, data))
            client.save(namespace, 1, step, metadata)
        client.wait_metric("hpsim_s3_pending_steps", lambda v: v == 0, POLL_S)  # the tier is idle
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
        drained = client.wait_metric("hpsim_s3_pending_steps", lambda v: v == 0, POLL_S)
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
