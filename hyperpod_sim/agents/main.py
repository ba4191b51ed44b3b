"""Run a node agent: the admin API and the control plane loop on one event loop.

``run(settings)`` is what ``hyperpod-sim agent`` calls. It binds the listening socket itself (so the
endpoint it registers carries the real port when ``--port 0``), serves the API at once, registers,
heartbeats, and returns the process exit code: 0 on SIGTERM/SIGINT or when the control plane says the
node was deleted, 1 when the agent cannot listen or fails unexpectedly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
from pathlib import Path

from hyperpod_sim.agents.app import AgentApp
from hyperpod_sim.agents.config import AgentSettings
from hyperpod_sim.agents.control_plane import ControlPlaneClient
from hyperpod_sim.agents.http.server import HttpServer
from hyperpod_sim.agents.launcher.hotpages import keep_push_pages_unmerged, mergeable
from hyperpod_sim.agents.loop import AgentLoop, Identity, LoopOutcome
from hyperpod_sim.agents.retry import Backoff
from hyperpod_sim.agents.state import AgentState
from hyperpod_sim.agents.store import ShardStore
from hyperpod_sim.agents.tier import MemoryTier
from hyperpod_sim.contracts.partition import Partition
from hyperpod_sim.contracts.shm import UnsafeDirectory

log = logging.getLogger("agents")


def run(settings: AgentSettings) -> int:
    """Run the agent until it is told to stop; the process exit code."""
    logging.basicConfig(
        level=settings.log_level,
        format="%(asctime)s %(levelname)s agent %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        sock = bind(host=settings.host, port=settings.port)
    except OSError as exc:
        log.error("cannot listen on %s:%s: %s", settings.host, settings.port, exc)
        return 1
    try:
        return asyncio.run(serve(settings=settings, sock=sock))
    except UnsafeDirectory as exc:
        log.error(
            "refusing to start: %s. Remove it (its checkpoints cannot be trusted), or choose a "
            "directory of this user's only with --shm-dir / --data-dir (docs/security.md)",
            exc,
        )
        return 1
    except Exception:
        log.exception("the agent failed")
        return 1
    finally:
        sock.close()


def bind(*, host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on ``host:port`` (port 0: a free one, read back with getsockname)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def machine_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


async def serve(*, settings: AgentSettings, sock: socket.socket) -> int:
    """Serve on ``sock`` (bound, not yet listening) until stopped; the exit code."""
    # Its tokens come with the registration's answer; `settings.token` only registers.
    state = AgentState(cluster=settings.cluster, node_id=settings.node_id)
    port: int = sock.getsockname()[1]
    shm_dir = settings.shm_dir or Path("/dev/shm/hpsim") / (settings.node_id or f"{settings.cluster}-{port}")
    # Refuses a shared-memory directory another user could change (UnsafeDirectory); the key that
    # seals its sidecars stays in the agent's private data dir.
    store = ShardStore(shm_dir, key_dir=settings.data_dir)
    partition = Partition(settings.data_dir)
    client = ControlPlaneClient(
        base_url=settings.control_plane,
        cluster=settings.cluster,
        timeout_s=settings.request_timeout_s,
        partition=partition,
    )
    tier = MemoryTier(
        state=state,
        store=store,
        control_plane=client,
        replication=settings.replication,
        s3_endpoint_override=settings.s3_endpoint_url,
        drain_timeout_s=settings.drain_timeout_s,
        max_fast_leases=settings.max_fast_leases,
    )
    server = HttpServer(
        handler=AgentApp(state=state, tier=tier, partition=partition),
        sock=sock,
        body_deadline_base_s=settings.upload_deadline_base_s,
        body_min_rate_bytes_per_s=settings.upload_min_rate_bytes_per_s,
    )
    await server.start()
    endpoint = settings.endpoint(port)
    print(
        f"hyperpod-sim agent on {endpoint} (cluster {settings.cluster}, "
        f"node {settings.node_id or 'assigned at registration'}, pid {os.getpid()})",
        flush=True,
    )

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT)
    for signum in signals:
        loop.add_signal_handler(signum, stop.set)

    agent_loop = _agent_loop(settings=settings, state=state, client=client, endpoint=endpoint, tier=tier)
    loop_task = asyncio.create_task(agent_loop.run(), name="agent-loop")
    stop_task = asyncio.create_task(stop.wait(), name="agent-stop")
    tasks = [loop_task, stop_task]
    if mergeable():
        unmerging = _unmerge_push_pages(state, sock.getsockname())
        tasks.append(asyncio.create_task(unmerging, name="agent-hot-pages"))
    exit_code = 0
    try:
        await asyncio.wait({loop_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        exit_code = await _wind_down(loop_task, settings=settings, state=state, tier=tier, shm_dir=shm_dir)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.close()
        await tier.aclose()
        await client.aclose()
        for signum in signals:
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(signum)
    return exit_code


async def _unmerge_push_pages(state: AgentState, address: tuple[str, int]) -> None:
    """Once the first policy is in force: keep the pages a push writes out of same-page merging
    (agents/launcher/hotpages.py). A failure costs only that: the agent runs on as before."""
    applied = asyncio.Event()
    state.listeners.append(lambda previous, current: applied.set())
    await applied.wait()
    try:
        await keep_push_pages_unmerged(state, address)
    except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError) as exc:
        log.warning("could not find the pages a policy push writes (they stay mergeable): %s", exc)


def _agent_loop(
    *, settings: AgentSettings, state: AgentState, client: ControlPlaneClient, endpoint: str, tier: MemoryTier
) -> AgentLoop:
    """The loop that registers this agent, applies its policy and heartbeats."""
    memory_bytes = settings.memory_bytes if settings.memory_bytes is not None else machine_memory_bytes()
    return AgentLoop(
        state=state,
        client=client,
        identity=Identity(
            endpoint=endpoint,
            pid=os.getpid(),
            instance_type=settings.instance_type,
            memory_bytes=memory_bytes,
        ),
        token=settings.token,
        heartbeat_interval_s=settings.heartbeat_interval_s,
        adopt_control_plane_interval=not settings.heartbeat_interval_explicit,
        backoff=Backoff(initial_s=settings.register_backoff_initial_s, max_s=settings.register_backoff_max_s),
        permanent_retry_s=settings.permanent_retry_s,
        status_provider=tier.s3.status,
    )


async def _wind_down(
    loop_task: asyncio.Task[LoopOutcome],
    *,
    settings: AgentSettings,
    state: AgentState,
    tier: MemoryTier,
    shm_dir: Path,
) -> int:
    """After the control-plane loop ended or a signal came: drain to S3 (and free the node's
    memory if it was deleted); the exit code."""
    exit_code = 0
    if loop_task.done():
        if loop_task.cancelled() or loop_task.exception() is not None:
            log.error("the control plane loop ended unexpectedly", exc_info=loop_task.exception())
            exit_code = 1
        elif loop_task.result() is LoopOutcome.NODE_DELETED:
            log.warning("node %s was deleted: draining to S3, then freeing its shared memory", state.node_id)
            await tier.s3.drain(timeout_s=settings.drain_timeout_s, reason="node deleted")
            tier.store.clear()
            shutil.rmtree(shm_dir, ignore_errors=True)
    else:
        log.info("signal received: draining to S3, then stopping")
        await tier.s3.drain(timeout_s=settings.drain_timeout_s, reason="agent stopped (SIGTERM)")
    return exit_code
