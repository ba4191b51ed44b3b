"""An agent's view of its cluster: the namespaces the control plane keeps, the other agents (members)
and the calls to them, through one connection pool each.

- ``namespace`` caches what the control plane says about a namespace (it never changes: a
  namespace is deleted and created anew, and a delete clears the cache of every agent).
- ``members`` lists the other agents; when the control plane cannot be reached, the last list known.
- ``fan_out`` makes the same internal call to every other agent (or to those named), with the
  cluster token; an agent that does not answer is left out.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection
from typing import Any
from urllib.parse import quote

from hyperpod_sim.agents.control_plane import ControlPlaneClient
from hyperpod_sim.agents.http.client import Answer, HttpClient, HttpError, Timeout
from hyperpod_sim.agents.state import AgentState
from hyperpod_sim.agents.tiermodel import Namespace, TierError, checked_namespace

log = logging.getLogger("hyperpod_sim.agents.tier")

PeerTimeout = float | Timeout

# How old the member list that the namespace index's homes are computed from may be: members come
# and go over seconds (heartbeats, node operations); asking the control plane on every `latest`
# would cost it one request per call. In a cluster whose heartbeats the control plane paces slower
# (past 64 agents), two heartbeat intervals: each list grows with the cluster and every agent asks
# for one (1,024 agents at 2 s: about 500 lists a second, each a read of every node's row). A new
# policy generation (a member added, replaced or gone bumps it) makes the list stale at once.
MEMBERS_MAX_AGE_S = 2.0


class ClusterView:
    def __init__(
        self, *, state: AgentState, control_plane: ControlPlaneClient, peer_timeout_s: float
    ) -> None:
        self.state = state
        self._cp = control_plane  # the agent's own client: one connection pool to the control plane
        # Other agents: a hung one (stopped, partitioned) must not hold a read or `latest` for
        # long; the timeout is per network wait, so big shards still stream.
        self.peers = HttpClient(timeout=peer_timeout_s, limit=64)
        self._namespaces: dict[str, Namespace] = {}
        self._members: dict[str, str] = {}  # node id -> endpoint
        self._members_at = 0.0  # time.monotonic() of the last member list
        # Every member's node id, this node's included, as of the last list: the same object for as
        # long as the set stays the same, so that whoever keeps it can tell a change by identity
        # (the namespace index's homes tag each image with the set it arrived under).
        self.member_ids: frozenset[str] = frozenset()
        self.fan_outs_total = 0  # calls made to every other agent

    async def aclose(self) -> None:
        await self.peers.aclose()

    # ------------------------------------------------------------------ the control plane

    async def control_plane(self, method: str, suffix: str, body: Any = None) -> Answer:
        """A call to the control plane's ``/agent/v1/clusters/{c}`` API with this node's token;
        TierError 503 when it does not answer."""
        token = self.state.node_token  # this node's credential at the control plane
        try:
            return await self._cp.request(
                method, suffix, token=token.get_secret_value() if token else None, json_body=body
            )
        except HttpError as exc:
            raise TierError(
                503, "ControlPlaneUnavailable", f"the control plane did not answer: {exc}"
            ) from exc

    async def report_event(self, level: str, message: str) -> None:
        """A cluster event about this node (shown by ListClusterEvents)."""
        await self.control_plane(
            "POST", "/events", {"node_id": self.state.node_id, "level": level, "message": message}
        )

    # ------------------------------------------------------------------ namespaces

    async def namespace(self, name: str) -> Namespace:
        checked_namespace(name)
        cached = self._namespaces.get(name)
        if cached is not None:
            return cached
        response = await self.control_plane("GET", f"/namespaces/{quote(name, safe='')}")
        if response.status_code == 404:
            raise TierError(404, "NamespaceNotFound", f"namespace {name!r} does not exist")
        if response.status_code != 200:
            raise TierError(502, "ControlPlaneError", f"namespace lookup failed: {response.text[:200]}")
        found = Namespace.from_doc(name, response.json())
        self._namespaces[name] = found
        return found

    def remember(self, namespace: Namespace) -> None:
        self._namespaces[namespace.name] = namespace

    def forget(self, name: str | None = None) -> None:
        """Drop a namespace (None: every namespace) from the cache."""
        if name is None:
            self._namespaces.clear()
        else:
            self._namespaces.pop(name, None)

    # ------------------------------------------------------------------ the other agents

    async def members(self, *, refresh: bool = False) -> dict[str, str]:
        """Other agents of the cluster: node id -> endpoint. When the control plane cannot be
        reached (it is down, or this node is partitioned from it), the last list known: peers are
        still reachable, and reads, replication and S3 persistence go on."""
        if refresh or not self._members:
            try:
                response = await self.control_plane("GET", "/members")
            except TierError:
                if not self._members:
                    raise
                log.info("the control plane did not answer; using the last known members")
                return dict(self._members)
            if response.status_code == 200:
                self._members = {
                    m["node_id"]: m["endpoint"]
                    for m in response.json()["members"]
                    if m["endpoint"] and m["node_id"] != self.state.node_id
                }
                self._members_at = time.monotonic()
                ids = frozenset([*self._members, *([self.state.node_id] if self.state.node_id else [])])
                if ids != self.member_ids:
                    self.member_ids = ids
        return dict(self._members)

    async def recent_members(self) -> dict[str, str]:
        """``members``, asked of the control plane again only when the list is older than
        ``members_max_age_s`` or a new policy made it stale (when the control plane does not
        answer, the last list known)."""
        stale = time.monotonic() - self._members_at > self.members_max_age_s
        return await self.members(refresh=stale)

    @property
    def members_max_age_s(self) -> float:
        return max(MEMBERS_MAX_AGE_S, 2 * self.state.heartbeat_interval_s)

    def members_stale(self) -> None:
        """The next ``recent_members`` asks the control plane (a new policy generation: the
        member set may have changed); the list is kept for when the control plane does not answer."""
        self._members_at = 0.0

    def forget_members(self) -> None:
        """The next ``members`` asks the control plane (new peers were named)."""
        self._members.clear()
        self._members_at = 0.0

    def token_header(self) -> dict[str, str]:
        token = self.state.cluster_token
        return {"Authorization": f"Bearer {token.get_secret_value()}"} if token else {}

    async def fan_out(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        timeout: PeerTimeout | None = None,
        only: Collection[str] | None = None,
    ) -> list[tuple[str, Answer]]:
        """The same internal call to every other agent (a JSON body if given), or with ``only`` to
        those of them named there; unreachable ones are left out."""
        if only is None:
            self.fan_outs_total += 1
            members = await self.members(refresh=True)
        else:
            known = await self.recent_members()
            members = {node_id: known[node_id] for node_id in only if node_id in known}
        options: dict[str, Any] = {"headers": self.token_header()}
        if json_body is not None:
            options["json"] = json_body
        if timeout is not None:
            options["timeout"] = timeout

        async def one(node_id: str, endpoint: str) -> tuple[str, Answer] | None:
            try:
                return node_id, await self.peers.request(method, f"{endpoint}{path}", **options)
            except HttpError as exc:
                log.info("agent %s did not answer %s %s: %s", node_id, method, path, exc)
                return None

        results = await asyncio.gather(*(one(n, e) for n, e in members.items()))
        return [r for r in results if r is not None]
