"""Replication: a copy of each of this node's own shards on the replica peers its policy names.

A save is copied after it is answered (``async``, the default) or before (``sync``). A copy that a
peer cannot take yet (its agent not registered, a network fault) is retried with backoff while the
peer stays named, for at most :data:`REPLICA_RETRY_S`; the replication lag metric shows the wait.
The copy sent is the verified one: a corrupt shard is never replicated.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from urllib.parse import urlencode

from hyperpod_sim.agents import catalog
from hyperpod_sim.agents.clock import Clock
from hyperpod_sim.agents.cluster import ClusterView
from hyperpod_sim.agents.http.client import HttpError
from hyperpod_sim.agents.retry import Backoff
from hyperpod_sim.agents.store import CorruptShard, ShardInfo, ShardKey, ShardStore
from hyperpod_sim.agents.tiermodel import TierCounters
from hyperpod_sim.contracts.agent_api import (
    INTERNAL_INDEX_ROUTE,
    INTERNAL_REPLICA_ROUTE,
    OWNER_PARAMETER,
    agent_path,
)
from hyperpod_sim.contracts.shards import SHARD_META, shard_meta

log = logging.getLogger("hyperpod_sim.agents.tier")

# How long a replica keeps being retried (a replacement node takes seconds to register).
REPLICA_RETRY_S = 120.0
Spawn = Callable[[Awaitable[None]], None]


class Replicator:
    def __init__(
        self,
        *,
        cluster: ClusterView,
        store: ShardStore,
        counters: TierCounters,
        clock: Clock,
        spawn: Spawn,
        mode: str = "async",
    ) -> None:
        self._cluster = cluster
        self._store = store
        self._counters = counters
        self._clock = clock
        self._spawn = spawn
        self.mode = mode

    def peer_ids(self) -> list[str]:
        policy = self._cluster.state.policy
        return policy.peer_ids if policy else []

    async def after_save(self, info: ShardInfo) -> None:
        """A trainer's shard was stored here: copy it to the peers (now, or in a task)."""
        peers = self.peer_ids()
        if not peers:
            return
        if self.mode == "sync":
            await self.replicate(info, peers)
        else:
            self._counters.replication_pending[info.key] = self._clock.wall()
            self._spawn(self.replicate(info, peers))

    def to_new_peers(self, added: list[str]) -> None:
        """Peers newly named by the policy get every shard of this node's own."""
        self._cluster.forget_members()
        for info in self._store.shards():
            if info.replica_of is None:
                self._counters.replication_pending.setdefault(info.key, self._clock.wall())
                self._spawn(self.replicate(info, added))

    async def replicate(self, info: ShardInfo, peers: list[str]) -> None:
        """Copy one of this node's shards to its replica peers (verified first: a corrupt copy is
        never replicated)."""
        key = info.key
        path = agent_path(INTERNAL_REPLICA_ROUTE, namespace=key.namespace, rank=key.rank, step=key.step)
        query = f"?{urlencode({OWNER_PARAMETER: self._cluster.state.node_id or ''})}"
        unpin = self._store.pin(key)
        try:
            try:
                checked, view = await asyncio.to_thread(self._store.read_verified, key)
            except (CorruptShard, KeyError, FileNotFoundError) as exc:
                self._counters.replication_failures_total += 1
                log.warning("%s cannot be replicated: %s", key, exc)
                return
            headers = {
                **self._cluster.token_header(),
                SHARD_META: shard_meta(checked.checksum, checked.save),
                "Content-Length": str(len(view)),
            }
            with view:
                for peer in peers:
                    await self._send(key, peer, f"{path}{query}", view, headers)
        finally:
            unpin()
            self._counters.replication_pending.pop(key, None)

    async def _send(
        self, key: ShardKey, peer: str, path: str, body: memoryview, headers: dict[str, str]
    ) -> bool:
        """Send one replica, retrying with backoff while ``peer`` stays a replica peer of this node
        (a replacement node has no endpoint until its agent registers) and for at most
        REPLICA_RETRY_S."""
        deadline = self._clock.monotonic() + REPLICA_RETRY_S
        backoff = Backoff(initial_s=0.2, max_s=5.0, jitter=False)
        refresh = False
        while peer in self.peer_ids() and self._clock.monotonic() < deadline:
            members = self._cluster.members
            endpoint = (await members(refresh=refresh)).get(peer) or (await members(refresh=True)).get(peer)
            refresh = True  # a try failed: the peer's agent may be back on another port
            if endpoint is not None:
                try:
                    response = await self._cluster.peers.put(
                        f"{endpoint}{path}", content=_slices(body), headers=headers
                    )
                    if response.status_code == 200:
                        self._counters.replications_total += 1
                        return True
                    log.warning("replica of %s refused by %s: %s", key, peer, response.text[:200])
                    if response.status_code == 507:
                        break  # the peer has no room; retrying will not make any
                except HttpError as exc:
                    log.info("replica of %s to %s failed, retrying: %s", key, peer, exc)
            await self._clock.sleep(backoff.next_delay())
        self._counters.replication_failures_total += 1
        log.warning("replica of %s to %s gave up", key, peer)
        return False

    async def restore(self, peers: list[str]) -> None:
        """Send this node's own shards to the peers whose index lacks them (after a restart: the
        shards found in shared memory may have lost their replica in the crash)."""
        own = [info for info in self._store.shards() if info.replica_of is None]
        for peer in peers:
            endpoint = (await self._cluster.members(refresh=True)).get(peer)
            if endpoint is None:
                continue  # not registered yet: its replicas come when the policy names it anew
            for name in sorted({info.key.namespace for info in own}):
                try:
                    response = await self._cluster.peers.get(
                        f"{endpoint}{agent_path(INTERNAL_INDEX_ROUTE, namespace=name)}",
                        headers=self._cluster.token_header(),
                    )
                except HttpError:
                    continue
                index = catalog.peer_index(response)
                if index is None:
                    continue
                held = {(step, rank) for step, ranks in index.steps.items() for rank in ranks}
                for info in own:
                    if info.key.namespace == name and (info.key.step, info.key.rank) not in held:
                        self._counters.replication_pending.setdefault(info.key, self._clock.wall())
                        await self.replicate(info, [peer])


async def _slices(view: memoryview, size: int = 1 << 20) -> AsyncIterator[bytes]:
    """A shard's mapped bytes in 1 MiB pieces: a replica goes out without a copy of the whole
    shard in the agent's heap (bench/memory_tier.py: three 512 MiB copies before)."""
    for start in range(0, len(view), size):
        yield bytes(view[start : start + size])
