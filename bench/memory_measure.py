"""The measurements of ``memory_tier.py``: the library's saves and loads against each server,
interleaved, the memory of the agent that took them, and the async / sync replication saves."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import MIB, Server, memory_status
from bench.memory_servers import STEPS_RETAINED
from bench.runner import Sample, median, median_or_none, timed
from bench.tier_agent import AgentConnection

OURS = "hyperpod-sim"
REFERENCE = "reference"
RAW = "raw HTTP"
TARGET_RSS_FACTOR = 1.2
POLL_S = 0.005


# ---------------------------------------------------------------------- processes


def reset_peak_rss(pid: int) -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0, same user); whether it worked."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def du_bytes(path: Path) -> int:
    """Disk usage like ``du -s``: allocated blocks of every file under ``path``."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total


# ---------------------------------------------------------------------- cluster and agents


@dataclass
class Agent:
    node_id: str
    endpoint: str
    pid: int
    peer_id: str
    peer_endpoint: str
    peer_pid: int


# ---------------------------------------------------------------------- the library's client


def library_client(base_url: str, namespace: str) -> Any:
    from amzn_sagemaker_checkpointing.config.in_memory_client import InMemoryClientConfig
    from amzn_sagemaker_checkpointing.storage.clients.inmemory.inmemory_client import (
        InMemoryCheckpointClient,
    )

    client = InMemoryCheckpointClient(
        namespace=namespace,
        rank="0",
        world_size="1",
        config=InMemoryClientConfig(base_url=base_url, request_timeout=300),
        metadata_file_count=1,
        steps_retained=STEPS_RETAINED,
    )
    client.get_or_create_namespace()
    return client


def wait_replicated(metrics: AgentConnection, since: float, deadline_s: float = 300.0) -> float:
    """Poll ``hpsim_tier_replication_pending`` until 0; seconds from ``since`` (perf_counter) to the
    first answer that said 0."""
    done = metrics.wait_metric("hpsim_tier_replication_pending", lambda v: v == 0, POLL_S, deadline_s)
    return done - since


@dataclass
class Side:
    """One server as the library sees it, for one namespace."""

    name: str
    client: Any
    pids: list[int]
    metrics: AgentConnection | None = None  # ours: the saving agent's /metrics
    peer_metrics: AgentConnection | None = None
    complete_steps: bool = True  # save the metadata rank too, and check get_latest_checkpoints


@dataclass
class SaveResult:
    sample: Sample
    lag_s: float | None = None  # async: ack -> no replication pending
    peer_held_at_ack: bool | None = None


def save(side: Side, step: int, payload: bytes) -> SaveResult:
    peer_before = side.peer_metrics.value("hpsim_tier_bytes_held") if side.peer_metrics else 0.0
    _, sample = timed(lambda: side.client.put_checkpoint(step=step, data=payload, rank=0), side.pids)
    result = SaveResult(sample=sample)
    if side.peer_metrics is not None and side.metrics is not None:
        held = side.peer_metrics.value("hpsim_tier_bytes_held")
        result.peer_held_at_ack = held - peer_before >= len(payload)
        result.lag_s = wait_replicated(side.metrics, sample.ended)
    return result


def save_metadata(side: Side, step: int) -> None:
    """The metadata rank of the step (untimed), so that the step is complete for ``latest``."""
    side.client.put_checkpoint(step=step, data=f"metadata of step {step}".encode(), metadata_index=0)
    if side.metrics is not None:
        wait_replicated(side.metrics, time.perf_counter())


def load(side: Side, step: int, payload: bytes) -> Sample:
    loaded, sample = timed(lambda: side.client.get_checkpoint(step=step, rank=0), side.pids)
    if loaded is None or len(loaded) != len(payload) or loaded != payload:
        got = "nothing" if loaded is None else f"{len(loaded)} different bytes"
        raise RuntimeError(f"{side.name}: step {step} loaded {got}, expected the {len(payload)} saved")
    return sample


# ---------------------------------------------------------------------- results


@dataclass
class Row:
    size_mib: int
    server: str
    save_s: list[float]
    load_s: list[float]
    save_median_s: float
    load_median_s: float
    save_min_s: float
    load_min_s: float
    save_mib_s: float
    load_mib_s: float
    save_server_cpu_s: float | None
    load_server_cpu_s: float | None
    save_client_cpu_s: float
    load_client_cpu_s: float
    replication_lag_s: list[float] = field(default_factory=list)


def make_row(size: int, server: str, saves: list[SaveResult], loads: list[Sample]) -> Row:
    save_s = [s.sample.seconds for s in saves]
    load_s = [s.seconds for s in loads]
    return Row(
        size_mib=size // MIB,
        server=server,
        save_s=[round(s, 4) for s in save_s],
        load_s=[round(s, 4) for s in load_s],
        save_median_s=round(median(save_s), 4),
        load_median_s=round(median(load_s), 4),
        save_min_s=round(min(save_s), 4),
        load_min_s=round(min(load_s), 4),
        save_mib_s=round(size / MIB / median(save_s), 1),
        load_mib_s=round(size / MIB / median(load_s), 1),
        save_server_cpu_s=median_or_none([s.sample.server_cpu_s for s in saves]),
        load_server_cpu_s=median_or_none([s.server_cpu_s for s in loads]),
        save_client_cpu_s=round(median([s.sample.client_cpu_s for s in saves]), 3),
        load_client_cpu_s=round(median([s.client_cpu_s for s in loads]), 3),
        replication_lag_s=[round(s.lag_s, 4) for s in saves if s.lag_s is not None],
    )


@dataclass
class MemoryRow:
    size_mib: int
    steps_held: int
    bytes_held: int
    agent_baseline_rss: int
    agent_rss: int
    agent_rss_anon: int
    agent_rss_shmem: int
    agent_peak_rss: int | None  # VmHWM since this size's first save (None: could not reset it)
    rss_growth_over_held: float | None
    target_met: bool
    shm_du_saving_node: int
    shm_du_peer_node: int
    reference_rss: int
    reference_baseline_rss: int


@dataclass
class ReplicationRow:
    size_mib: int
    mode: str
    save_s: list[float]
    save_median_s: float
    save_mib_s: float
    lag_s: list[float]
    lag_median_s: float | None
    lag_max_s: float | None
    peer_held_at_ack: list[bool | None]


def mib(value: float) -> str:
    return f"{value / MIB:.1f}"


# ---------------------------------------------------------------------- phases


def shm_usage(shm_root: Path, agent: Agent) -> tuple[int, int]:
    """du of the saving node's and its peer's shared-memory directories (LocalProvisioner layout)."""
    return du_bytes(shm_root / agent.node_id), du_bytes(shm_root / agent.peer_id)


def measure_main(
    ours: Agent,
    shm_root: Path,
    reference: Server,
    raw: Server,
    payloads: dict[int, bytes],
    repeats: int,
    progress: Callable[[str], None],
) -> tuple[list[Row], list[MemoryRow]]:
    """Save and load every size through the library against every server, interleaved."""
    rows: list[Row] = []
    memory: list[MemoryRow] = []
    baseline = memory_status(ours.pid)
    reference_baseline = memory_status(reference.proc.pid)
    metrics, peer_metrics = AgentConnection(ours.endpoint, 30), AgentConnection(ours.peer_endpoint, 30)
    try:
        for size, payload in payloads.items():
            namespace = f"bench-{size // MIB}"
            ours_client = library_client(ours.endpoint, namespace)
            sides = [
                Side(OURS, ours_client, [ours.pid, ours.peer_pid], metrics, peer_metrics),
                Side(REFERENCE, library_client(reference.endpoint, namespace), [reference.proc.pid]),
                Side(RAW, library_client(raw.endpoint, namespace), [raw.proc.pid], complete_steps=False),
            ]
            peak_reset = reset_peak_rss(ours.pid)
            saves: dict[str, list[SaveResult]] = {s.name: [] for s in sides}
            loads: dict[str, list[Sample]] = {s.name: [] for s in sides}
            for step in range(1, repeats + 1):
                first = (step - 1) % len(sides)
                order = sides[first:] + sides[:first]  # each server goes first in turn
                for side in order:
                    saves[side.name].append(save(side, step, payload))
                    if side.complete_steps:
                        save_metadata(side, step)
                for side in order:
                    loads[side.name].append(load(side, step, payload))
                progress(
                    f"  {size // MIB} MiB step {step}: "
                    + ", ".join(
                        f"{s.name} save {saves[s.name][-1].sample.seconds:.3f} s "
                        f"load {loads[s.name][-1].seconds:.3f} s"
                        for s in sides
                    )
                )
            expected = list(range(repeats, max(0, repeats - STEPS_RETAINED), -1))
            for side in sides:
                got = side.client.get_latest_checkpoints() if side.complete_steps else expected
                if got != expected:
                    raise RuntimeError(f"{side.name}: latest steps {got}, expected {expected}")
                rows.append(make_row(size, side.name, saves[side.name], loads[side.name]))

            status = memory_status(ours.pid)
            held = int(metrics.value("hpsim_tier_bytes_held"))
            du_own, du_peer = shm_usage(shm_root, ours)
            growth = status["VmRSS"] - baseline["VmRSS"]
            memory.append(
                MemoryRow(
                    size_mib=size // MIB,
                    steps_held=min(repeats, STEPS_RETAINED),
                    bytes_held=held,
                    agent_baseline_rss=baseline["VmRSS"],
                    agent_rss=status["VmRSS"],
                    agent_rss_anon=status.get("RssAnon", 0),
                    agent_rss_shmem=status.get("RssShmem", 0),
                    agent_peak_rss=status.get("VmHWM") if peak_reset else None,
                    rss_growth_over_held=round(growth / held, 4) if held else None,
                    target_met=status["VmRSS"] <= TARGET_RSS_FACTOR * held + baseline["VmRSS"],
                    shm_du_saving_node=du_own,
                    shm_du_peer_node=du_peer,
                    reference_rss=memory_status(reference.proc.pid).get("VmRSS", 0),
                    reference_baseline_rss=reference_baseline.get("VmRSS", 0),
                )
            )
            for side in sides:  # untimed: free the memory before the next size
                side.client.delete_namespace()
                side.client.close()
    finally:
        metrics.close()
        peer_metrics.close()
    return rows, memory


def measure_replication(
    agents: dict[str, Agent], payloads: dict[int, bytes], repeats: int, progress: Callable[[str], None]
) -> list[ReplicationRow]:
    """Saves against the async and the sync cluster, interleaved; each step deleted once measured."""
    rows: list[ReplicationRow] = []
    opened: list[AgentConnection] = []
    try:
        for size, payload in payloads.items():
            namespace = f"replication-{size // MIB}"
            sides: list[Side] = []
            for mode, agent in agents.items():
                metrics, peer_metrics = (
                    AgentConnection(agent.endpoint, 30),
                    AgentConnection(agent.peer_endpoint, 30),
                )
                opened += [metrics, peer_metrics]
                client = library_client(agent.endpoint, namespace)
                sides.append(Side(mode, client, [agent.pid, agent.peer_pid], metrics, peer_metrics))
            results: dict[str, list[SaveResult]] = {s.name: [] for s in sides}
            for step in range(1, repeats + 1):
                for side in sides if step % 2 else sides[::-1]:
                    results[side.name].append(save(side, step, payload))
                    side.client.delete_checkpoint(step=step, rank=0)  # untimed: bounds memory
                progress(
                    f"  replication {size // MIB} MiB step {step}: "
                    + ", ".join(f"{s.name} save {results[s.name][-1].sample.seconds:.3f} s" for s in sides)
                )
            for side in sides:
                saves = results[side.name]
                seconds = [s.sample.seconds for s in saves]
                lags = [s.lag_s for s in saves if s.lag_s is not None]
                rows.append(
                    ReplicationRow(
                        size_mib=size // MIB,
                        mode=side.name,
                        save_s=[round(s, 4) for s in seconds],
                        save_median_s=round(median(seconds), 4),
                        save_mib_s=round(size / MIB / median(seconds), 1),
                        lag_s=[round(lag, 4) for lag in lags],
                        lag_median_s=round(median(lags), 4) if lags else None,
                        lag_max_s=round(max(lags), 4) if lags else None,
                        peer_held_at_ack=[s.peer_held_at_ack for s in saves],
                    )
                )
                side.client.delete_namespace()
                side.client.close()
    finally:
        for metrics in opened:
            metrics.close()
    return rows
