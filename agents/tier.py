"""The in-memory checkpoint tier of an agent.

It speaks the HTTP protocol of the in-memory checkpoint service that the public
``amzn-sagemaker-checkpointing`` library's ``InMemoryCheckpointClient`` uses (``/v1/cp/...``), so
that library's DCP writer and reader work against any agent of a cluster unmodified.

How the cluster-wide view works (docs/memory-tier.md):

- **Namespaces** are kept by the control plane (``/agent/v1/clusters/{c}/namespaces``); each agent
  caches them. A namespace created through one agent is known to all; clusters never share one.
- **Shards** are stored on the node whose agent received them (where the trainer runs), in
  shared memory (``agents/store.py``), and copied to the replica peers that the node's policy
  names (the next node in the cluster's ring). A read through any agent looks at its own copies
  first, then asks the other agents which of them holds a copy (``/v1/internal/...``, cluster
  token) and fetches one, verifying its checksum; a corrupt copy is never served.
- **latest** asks every agent for its index of the namespace and lists the steps for which every
  rank of the namespace (the metadata rank included) is held somewhere: a step that a crash left
  half-written is never listed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, quote, unquote

import httpx

from agents.access import checkpoint_credential, refusal
from agents.control_plane import ControlPlaneClient
from agents.httpserver import Request, Response, error_response, json_response
from agents.numbers import canonical_int, echo
from agents.s3tier import S3Tier
from agents.state import AgentState, Credential
from agents.store import (
    BudgetExceeded,
    CorruptShard,
    Reservation,
    ReservationCancelled,
    ShardInfo,
    ShardKey,
    ShardStore,
    UnusableShardFile,
    check_namespace,
)
from contracts.policy import NodePolicy
from contracts.shards import SHARD_META, TIER_HEADER, ShardMetaError, checksum_of, shard_meta
from contracts.shards import parse_shard_meta as parse_checksum_header

log = logging.getLogger(__name__)

# How long a replica keeps being retried (a replacement node takes seconds to register).
REPLICA_RETRY_S = 120.0
OCTETS = "application/octet-stream"
MAX_NODE_ID_CHARS = 128  # a replica's ``owner`` (a node id; stored in the shard's sidecar)


@dataclass
class TierCounters:
    replications_total: int = 0
    replication_failures_total: int = 0
    remote_reads_total: int = 0
    # Shards stored but not yet on every replica peer, and when the oldest of them was stored.
    replication_pending: dict[ShardKey, float] = field(default_factory=dict)

    def replication_lag_s(self, now: float) -> float:
        return max((now - since for since in self.replication_pending.values()), default=0.0)


@dataclass(frozen=True)
class _FastWrite:
    reservation: Reservation
    namespace: Namespace
    deadline: float  # time.monotonic()


@dataclass(frozen=True)
class Namespace:
    name: str
    num_ranks: int
    steps_retained: int

    def doc(self) -> dict[str, Any]:
        return {
            "namespace": self.name,
            "num_ranks": self.num_ranks,
            "steps_to_retain_per_rank": self.steps_retained,
        }


class TierError(Exception):
    def __init__(self, status: int, error: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.response = error_response(status, error, message, **extra)


def tier_of(info: ShardInfo) -> str:
    """The ``X-Hpsim-Tier`` of a copy held here: this node's own shard, or a replica of another's."""
    return "memory" if info.replica_of is None else "replica"


def parse_shard_meta(header: str | None) -> str:
    """The base64 xxh3_128 checksum of a ``Shard-Meta`` header; a TierError if it is not usable."""
    try:
        return parse_checksum_header(header)
    except ShardMetaError as exc:
        raise TierError(400, exc.error, str(exc)) from exc


def parse_key(name: str, rank: str, step: str) -> ShardKey:
    """The shard a path names: a namespace that fits in a directory name, and a rank and step in
    their one canonical spelling (agents/numbers.py). A TierError 400 otherwise."""
    checked_namespace(name)
    try:
        return ShardKey(name, canonical_int(rank, what="rank"), canonical_int(step, what="step"))
    except ValueError as exc:
        raise TierError(400, "InvalidShard", str(exc)) from exc


def checked_namespace(name: str) -> str:
    """``name`` if a namespace of that name can be stored (on disk: one directory name); a
    TierError 400 otherwise."""
    try:
        check_namespace(name)
    except ValueError as exc:
        raise TierError(400, "InvalidNamespace", str(exc)) from exc
    return name


def query_int(request: Request, parameter: str, *, default: int | None = None) -> int:
    """A query parameter's canonical integer value (its default when absent); TierError 400."""
    values = parse_qs(request.query, keep_blank_values=True).get(parameter)
    if not values:
        if default is None:
            raise TierError(400, "MissingParameter", f"the query parameter {parameter} is required")
        return default
    try:
        return canonical_int(values[0], what=parameter)
    except ValueError as exc:
        raise TierError(400, "InvalidParameter", str(exc)) from exc


class MemoryTier:
    """Routes ``/v1/cp/...`` (the library's protocol) and ``/v1/internal/...`` (agent to agent)."""

    def __init__(
        self,
        *,
        state: AgentState,
        store: ShardStore,
        control_plane: ControlPlaneClient,
        replication: str = "async",
        peer_timeout_s: float = 10.0,
        s3_endpoint_override: str | None = None,
        drain_timeout_s: float = 30.0,
        fast_timeout_s: float = 120.0,
    ) -> None:
        self.state = state
        self.store = store
        self.replication = replication
        self.counters = TierCounters()
        self._namespaces: dict[str, Namespace] = {}
        self._members: dict[str, str] = {}  # node id -> endpoint
        self._cp = control_plane  # the agent's own client: one connection pool to the control plane
        # Other agents: a hung one (stopped, partitioned) must not hold a read or `latest` for
        # long; the timeout is per network wait, so big shards still stream.
        self._peers = httpx.AsyncClient(
            timeout=peer_timeout_s, trust_env=False, limits=httpx.Limits(max_connections=64)
        )
        self._tasks: set[asyncio.Task[None]] = set()
        self.s3 = S3Tier(self, endpoint_override=s3_endpoint_override)
        self._fast: dict[str, _FastWrite] = {}  # token -> an open same-host write
        self._leases: dict[str, tuple[Callable[[], None], float]] = {}  # lease -> (unpin, deadline)
        self.fast_timeout_s = fast_timeout_s
        self.drain_timeout_s = drain_timeout_s
        state.listeners.append(self._on_policy)

    async def aclose(self) -> None:
        await self.s3.aclose()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._peers.aclose()

    # ------------------------------------------------------------------ routing

    async def handle(self, request: Request) -> Response | None:
        """The response for a tier route, or None if the path is not one of the tier's."""
        parts = [unquote(p) for p in request.path.strip("/").split("/")]
        credential: Credential | None
        if parts[:2] in (["v1", "cp"], ["v1", "fast"]):
            # /v1/cp/...: the library's protocol; /v1/fast/...: the same-host fast path of our SDK.
            handler = self._public_route(request.method, parts[2:] if parts[1] == "cp" else parts[1:])
            if handler is None:
                return None
            if not self.state.tiered_storage_enabled:
                return error_response(
                    503,
                    "TieredStorageDisabled",
                    "tiered storage is off on this cluster (TieredStorageConfig Mode is not Enable, or "
                    "this agent has no policy yet)",
                )
            # Writes and deletes need the checkpoint token when the cluster's AgentAccess is Token.
            credential = checkpoint_credential(self.state, request.method, parts[1])
        elif parts[:2] == ["v1", "internal"]:
            handler = self._internal_route(request.method, parts[2:])
            if handler is None:
                return None
            credential = Credential.CLUSTER  # the other agents of the cluster, always
        else:
            return None
        if credential is not None:
            refused = refusal(self.state, request, credential)
            if refused is not None:
                return refused
        try:
            return await handler(request)
        except TierError as exc:
            return exc.response

    def _public_route(self, method: str, parts: list[str]) -> Callable[[Request], Awaitable[Response]] | None:
        match method, parts:
            case "GET", ["namespaces", name]:
                return lambda r: self.get_namespace(name)
            case "POST", ["namespaces", name]:
                return lambda r: self.create_namespace(name, r)
            case "DELETE", ["namespaces", name]:
                return lambda r: self.delete_namespace(name)
            case "GET", ["checkpoints", name, "latest"]:
                return lambda r: self.latest(name, r)
            case "POST", ["checkpoints", name, rank, step]:
                return lambda r: self.put_shard(name, rank, step, r)
            case "GET", ["checkpoints", name, rank, step]:
                return lambda r: self.get_shard(name, rank, step)
            case "DELETE", ["checkpoints", name, rank, step]:
                return lambda r: self.delete_shard(name, rank, step)
            case "POST", ["cluster", "reset"]:
                return lambda r: self.reset()
            case "POST", ["fast", "reserve", name, rank, step]:
                return lambda r: self.fast_reserve(name, rank, step, r)
            case "POST", ["fast", "commit", token]:
                return lambda r: self.fast_commit(token, r)
            case "POST", ["fast", "abort", token]:
                return lambda r: self.fast_abort(token)
            case "GET", ["fast", "shards", name, rank, step]:
                return lambda r: self.fast_locate(name, rank, step)
            case "POST", ["fast", "release", lease]:
                return lambda r: self.fast_release(lease)
        return None

    def _internal_route(
        self, method: str, parts: list[str]
    ) -> Callable[[Request], Awaitable[Response]] | None:
        match method, parts:
            case "GET", ["index", name]:
                return lambda r: self.local_index(name)
            case "GET", ["s3-steps", name]:
                return lambda r: self.local_s3_steps(name)
            case "GET", ["shards", name, rank, step]:
                return lambda r: self.local_shard(name, rank, step)
            case "PUT", ["replicas", name, rank, step]:
                return lambda r: self.put_replica(name, rank, step, r)
            case "POST", ["persist", name, step]:
                return lambda r: self.persist(name, step, r)
            case "DELETE", ["shards", name, rank, step]:
                return lambda r: self.local_delete(name, rank, step)
            case "DELETE", ["namespaces", name]:
                return lambda r: self.local_delete_namespace(name)
            case "POST", ["reset"]:
                return lambda r: self.local_reset()
        return None

    # ------------------------------------------------------------------ control plane and peers

    def _token_header(self) -> dict[str, str]:
        token = self.state.cluster_token
        return {"Authorization": f"Bearer {token.get_secret_value()}"} if token else {}

    async def _cp_call(self, method: str, suffix: str, body: Any = None) -> httpx.Response:
        token = self.state.node_token  # this node's credential at the control plane
        try:
            return await self._cp.request(
                method, suffix, token=token.get_secret_value() if token else None, json_body=body
            )
        except httpx.HTTPError as exc:
            raise TierError(
                503, "ControlPlaneUnavailable", f"the control plane did not answer: {exc}"
            ) from exc

    async def namespace(self, name: str) -> Namespace:
        checked_namespace(name)
        cached = self._namespaces.get(name)
        if cached is not None:
            return cached
        response = await self._cp_call("GET", f"/namespaces/{quote(name, safe='')}")
        if response.status_code == 404:
            raise TierError(404, "NamespaceNotFound", f"namespace {name!r} does not exist")
        if response.status_code != 200:
            raise TierError(502, "ControlPlaneError", f"namespace lookup failed: {response.text[:200]}")
        doc = response.json()
        found = Namespace(name, int(doc["num_ranks"]), int(doc["steps_to_retain_per_rank"]))
        self._namespaces[name] = found
        return found

    async def members(self, *, refresh: bool = False) -> dict[str, str]:
        """Other agents of the cluster: node id -> endpoint. When the control plane cannot be
        reached (it is down, or this node is partitioned from it), the last list known: peers are
        still reachable, and reads, replication and S3 persistence go on."""
        if refresh or not self._members:
            try:
                response = await self._cp_call("GET", "/members")
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
        return dict(self._members)

    async def _fan_out(
        self, method: str, path: str, *, timeout: float | None = None
    ) -> list[tuple[str, httpx.Response]]:
        """The same internal call to every other agent; unreachable ones are left out."""
        members = await self.members(refresh=True)

        async def one(node_id: str, endpoint: str) -> tuple[str, httpx.Response] | None:
            try:
                kwargs: dict[str, Any] = {"headers": self._token_header()}
                if timeout is not None:
                    kwargs["timeout"] = timeout
                return node_id, await self._peers.request(method, f"{endpoint}{path}", **kwargs)
            except httpx.HTTPError as exc:
                log.info("agent %s did not answer %s %s: %s", node_id, method, path, exc)
                return None

        results = await asyncio.gather(*(one(n, e) for n, e in members.items()))
        return [r for r in results if r is not None]

    async def fan_out_post(
        self, path: str, body: Any, *, timeout: httpx.Timeout
    ) -> list[tuple[str, httpx.Response]]:
        """A JSON POST to every other agent (the S3 tier's persist requests)."""
        members = await self.members(refresh=True)

        async def one(node_id: str, endpoint: str) -> tuple[str, httpx.Response] | None:
            try:
                response = await self._peers.post(
                    f"{endpoint}{path}", json=body, headers=self._token_header(), timeout=timeout
                )
            except httpx.HTTPError as exc:
                log.info("agent %s did not answer POST %s: %s", node_id, path, exc)
                return None
            return node_id, response

        results = await asyncio.gather(*(one(n, e) for n, e in members.items()))
        return [r for r in results if r is not None]

    async def report_event(self, level: str, message: str) -> None:
        """A cluster event about this node (shown by ListClusterEvents)."""
        await self._cp_call(
            "POST", "/events", {"node_id": self.state.node_id, "level": level, "message": message}
        )

    # ------------------------------------------------------------------ namespaces

    async def get_namespace(self, name: str) -> Response:
        return json_response(200, (await self.namespace(name)).doc())

    async def create_namespace(self, name: str, request: Request) -> Response:
        checked_namespace(name)
        num_ranks = query_int(request, "num_ranks")
        steps = query_int(request, "steps_retained", default=3)
        response = await self._cp_call(
            "POST", f"/namespaces/{quote(name, safe='')}", {"num_ranks": num_ranks, "steps_retained": steps}
        )
        if response.status_code == 409:
            raise TierError(409, "NamespaceExists", f"namespace {name!r} already exists")
        if response.status_code != 201:
            raise TierError(
                response.status_code, "InvalidNamespace", response.json().get("message", "refused")
            )
        doc = response.json()
        self._namespaces[name] = Namespace(name, int(doc["num_ranks"]), int(doc["steps_to_retain_per_rank"]))
        return json_response(201, doc)

    async def delete_namespace(self, name: str) -> Response:
        checked_namespace(name)
        response = await self._cp_call("DELETE", f"/namespaces/{quote(name, safe='')}")
        if response.status_code == 404:
            raise TierError(404, "NamespaceNotFound", f"namespace {name!r} does not exist")
        await self.local_delete_namespace(name)
        await self._fan_out("DELETE", f"/v1/internal/namespaces/{quote(name, safe='')}")
        return json_response(200, {"deleted": name})

    async def reset(self) -> Response:
        await self._cp_call("POST", "/namespaces-reset")
        await self.local_reset()
        await self._fan_out("POST", "/v1/internal/reset")
        return json_response(200, {"reset": True})

    # ------------------------------------------------------------------ shards

    async def _key(self, name: str, rank: str, step: str) -> tuple[Namespace, ShardKey]:
        key = parse_key(name, rank, step)
        namespace = await self.namespace(name)
        if not 0 <= key.rank < namespace.num_ranks:
            raise TierError(
                400,
                "InvalidRank",
                f"rank {key.rank} is outside 0..{namespace.num_ranks - 1} of namespace {echo(name)}",
            )
        return namespace, key

    async def _receive(self, key: ShardKey, request: Request, *, replica_of: str | None) -> ShardInfo:
        """Stream a request body into shared memory; verify it; commit it. Nothing is stored on failure."""
        checksum = parse_shard_meta(request.headers.get(SHARD_META.lower()))
        size = request.content_length
        if size is None:
            raise TierError(411, "LengthRequired", "a shard upload needs a Content-Length")
        reservation = await self._reserve(key, size)
        try:
            await request.readinto(reservation.buffer())
            info = await asyncio.to_thread(reservation.commit, checksum=checksum, replica_of=replica_of)
        except CorruptShard as exc:
            reservation.abort()
            raise TierError(
                400, "ChecksumMismatch", "the body does not match the Shard-Meta checksum; nothing was stored"
            ) from exc
        except ReservationCancelled as exc:
            raise TierError(
                409, "Cancelled", "the namespace was deleted or reset while this shard was written"
            ) from exc
        except BaseException:
            reservation.abort()
            raise
        return info

    async def _protected_steps(self) -> set[tuple[str, int]]:
        """The newest complete step of every namespace held here: eviction never takes it."""
        protected = set()
        for name in {s.key.namespace for s in self.store.shards()}:
            with contextlib.suppress(TierError):
                steps = await self.complete_steps(name)
                if steps:
                    protected.add((name, steps[0]))
        return protected

    async def put_shard(self, name: str, rank: str, step: str, request: Request) -> Response:
        namespace, key = await self._key(name, rank, step)
        info = await self._receive(key, request, replica_of=None)
        await self._after_save(namespace, info)
        return json_response(200, {"namespace": name, "rank": key.rank, "step": key.step, "size": info.size})

    async def _after_save(self, namespace: Namespace, info: ShardInfo) -> None:
        """A trainer's shard is stored here: retention, S3 scheduling, replication."""
        key = info.key
        self.store.enforce_retention(
            key.namespace, namespace.steps_retained, protect=lambda: {(key.namespace, key.step)}
        )
        # The rank's next saves get files already allocated and faulted in: its rotation
        # (retention + 1 files) is made now, before the save is answered (the trainer waits on
        # it off its training thread), within the budget.
        await asyncio.to_thread(
            self.store.prepare_spares, key.namespace, key.rank, files=namespace.steps_retained + 1
        )
        self.s3.on_saved(namespace, key)
        peers = self._peer_ids()
        if peers:
            if self.replication == "sync":
                await self._replicate(info, peers)
            else:
                self.counters.replication_pending[key] = time.time()
                self._spawn(self._replicate(info, peers))

    # ------------------------------------------------------------------ same-host fast path

    async def _reserve(self, key: ShardKey, size: int) -> Reservation:
        """Room for a shard (HTTP upload, replica or same-host write), evicting older steps but
        never a namespace's newest complete one; 507 with the numbers when it does not fit. The
        reservation allocates the file's memory, so it runs in a worker thread."""
        protect: set[tuple[str, int]] = set()
        if self.store.in_use_bytes + size > self.store.budget_bytes:
            protect = await self._protected_steps()
        try:
            return await asyncio.to_thread(self.store.reserve, key, size, protect=lambda: protect)
        except BudgetExceeded as exc:
            raise TierError(
                507,
                "InsufficientStorage",
                str(exc),
                needed=exc.needed,
                budget=exc.budget,
                in_use=exc.in_use,
            ) from exc

    async def fast_reserve(self, name: str, rank: str, step: str, request: Request) -> Response:
        """Room for a shard in this agent's shared memory, as a file a trainer on this host maps
        and writes into; it becomes the shard at ``fast_commit``. A reservation not committed
        within ``fast_timeout_s`` is given back (its trainer died)."""
        namespace, key = await self._key(name, rank, step)
        size = query_int(request, "size")
        reservation = await self._reserve(key, size)
        token = uuid.uuid4().hex
        self._fast[token] = _FastWrite(reservation, namespace, time.monotonic() + self.fast_timeout_s)
        if len(self._fast) + len(self._leases) == 1:
            self._spawn(self._expire_fast_writes())
        return json_response(
            200,
            {"token": token, "path": str(reservation.path), "buffer_id": reservation.buffer_id, "size": size},
        )

    async def fast_commit(self, token: str, request: Request) -> Response:
        write = self._fast.pop(token, None)
        if write is None:
            raise TierError(404, "NoSuchReservation", "no open reservation with this token (expired?)")
        reservation = write.reservation
        try:
            size = query_int(request, "size", default=reservation.size)
        except TierError:
            reservation.abort()
            raise
        try:
            # The file is checked (a regular file under this agent's root, the one reserved, of
            # the reserved size) and read without a mapping: a trainer that truncated or replaced
            # it gets a 400 and its reservation back, never a SIGBUS in the agent.
            info = await asyncio.to_thread(reservation.commit_written, size=size)
        except UnusableShardFile as exc:
            raise TierError(400, "UnusableShardFile", str(exc)) from exc
        except ValueError as exc:
            raise TierError(400, "InvalidSize", str(exc)) from exc
        except ReservationCancelled as exc:
            raise TierError(409, "Cancelled", "the namespace was deleted or reset meanwhile") from exc
        await self._after_save(write.namespace, info)
        key = info.key
        return json_response(
            200,
            {
                "namespace": key.namespace,
                "rank": key.rank,
                "step": key.step,
                "size": info.size,
                "checksum": info.checksum,
                # The rank's next buffers, for the trainer to map ahead (off its training thread).
                "spares": [
                    {"path": str(spare.path), "buffer_id": spare.buffer_id, "size": spare.size}
                    for spare in self.store.spares(key.namespace)
                    if spare.rank == key.rank
                ],
            },
        )

    async def fast_abort(self, token: str) -> Response:
        write = self._fast.pop(token, None)
        if write is not None:
            write.reservation.abort()
        return json_response(200, {"aborted": write is not None})

    async def fast_locate(self, name: str, rank: str, step: str) -> Response:
        """Where this node's copy of a shard is, for a trainer on this host to map and verify
        itself; 404 if this node holds none (then it reads through ``GET /v1/cp/...``)."""
        _, key = await self._key(name, rank, step)
        found = self.store.local_path(key)
        if found is None:
            raise TierError(404, "ShardNotHere", "this node holds no copy; read it through /v1/cp")
        info, buffer_id = found
        # The file is not reused for a later save (truncated, rewritten) while the reader holds
        # this lease: until it releases it, or for fast_timeout_s.
        lease = uuid.uuid4().hex
        self._leases[lease] = (self.store.pin(key), time.monotonic() + self.fast_timeout_s)
        if len(self._fast) + len(self._leases) == 1:
            self._spawn(self._expire_fast_writes())
        return json_response(
            200,
            {
                "path": str(info.path),
                "size": info.size,
                "checksum": info.checksum,
                "buffer_id": buffer_id,
                "tier": tier_of(info),
                "lease": lease,
            },
        )

    async def fast_release(self, lease: str) -> Response:
        held = self._leases.pop(lease, None)
        if held is not None:
            held[0]()
        return json_response(200, {"released": held is not None})

    async def _expire_fast_writes(self) -> None:
        """Give back reservations never committed and leases never released (their trainer died)."""
        while self._fast or self._leases:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for lease, (unpin, deadline) in list(self._leases.items()):
                if deadline < now:
                    del self._leases[lease]
                    unpin()
            for token, write in list(self._fast.items()):
                if write.deadline < now:
                    del self._fast[token]
                    write.reservation.abort()
                    log.warning("a fast-path write of %s was never committed", write.reservation.key)

    async def put_replica(self, name: str, rank: str, step: str, request: Request) -> Response:
        owner = parse_qs(request.query).get("owner", [None])[0]
        if owner is not None and len(owner) > MAX_NODE_ID_CHARS:
            raise TierError(
                400, "InvalidOwner", f"owner is a node id of at most {MAX_NODE_ID_CHARS} characters"
            )
        key = parse_key(name, rank, step)
        info = await self._receive(key, request, replica_of=owner or "unknown")
        # Replicas are kept as the owner keeps its shards: the namespace's newest steps.
        try:
            namespace = await self.namespace(name)
        except TierError as exc:  # not known here yet and the control plane did not answer
            log.info("replica of %s kept without retention: %s", key, exc)
        else:
            self.store.enforce_retention(name, namespace.steps_retained, protect=lambda: {(name, key.step)})
        return json_response(200, {"size": info.size})

    def _peer_ids(self) -> list[str]:
        return self.state.policy.peer_ids if self.state.policy else []

    async def _replicate(self, info: ShardInfo, peers: list[str]) -> None:
        """Copy one of this node's shards to its replica peers (verified first: a corrupt copy is
        never replicated)."""
        key = info.key
        path = f"/v1/internal/replicas/{quote(key.namespace, safe='')}/{key.rank}/{key.step}"
        query = f"?owner={quote(self.state.node_id or '')}"
        unpin = self.store.pin(key)
        try:
            try:
                checked, view = await asyncio.to_thread(self.store.read_verified, key)
            except (CorruptShard, KeyError, FileNotFoundError) as exc:
                self.counters.replication_failures_total += 1
                log.warning("%s cannot be replicated: %s", key, exc)
                return
            headers = {
                **self._token_header(),
                SHARD_META: shard_meta(checked.checksum),
                "Content-Length": str(len(view)),
            }
            with view:
                for peer in peers:
                    await self._send_replica(key, peer, f"{path}{query}", view, headers)
        finally:
            unpin()
            self.counters.replication_pending.pop(key, None)

    async def _send_replica(
        self, key: ShardKey, peer: str, path: str, body: memoryview, headers: dict[str, str]
    ) -> bool:
        """Send one replica, retrying with backoff while ``peer`` stays a replica peer of this node
        (a replacement node has no endpoint until its agent registers) and for at most
        REPLICA_RETRY_S; the replication lag metric shows the wait."""
        deadline = time.monotonic() + REPLICA_RETRY_S
        delay = 0.2
        refresh = False
        while peer in self._peer_ids() and time.monotonic() < deadline:
            endpoint = (await self.members(refresh=refresh)).get(peer) or (
                await self.members(refresh=True)
            ).get(peer)
            refresh = True  # a try failed: the peer's agent may be back on another port
            if endpoint is not None:
                try:
                    response = await self._peers.put(
                        f"{endpoint}{path}", content=_slices(body), headers=headers
                    )
                    if response.status_code == 200:
                        self.counters.replications_total += 1
                        return True
                    log.warning("replica of %s refused by %s: %s", key, peer, response.text[:200])
                    if response.status_code == 507:
                        break  # the peer has no room; retrying will not make any
                except httpx.HTTPError as exc:
                    log.info("replica of %s to %s failed, retrying: %s", key, peer, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
        self.counters.replication_failures_total += 1
        log.warning("replica of %s to %s gave up", key, peer)
        return False

    def _spawn(self, coroutine: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def get_shard(self, name: str, rank: str, step: str) -> Response:
        _, key = await self._key(name, rank, step)
        local = await self._local_copy(key)
        if local is not None:
            return local
        remote = await self._remote_copy(key)
        if remote is not None:
            self.counters.remote_reads_total += 1
            return remote
        durable = await self.s3.read_shard(key)
        if durable is not None:
            data, checksum = durable
            return Response(
                status=200,
                body=data,
                content_type=OCTETS,
                headers=((SHARD_META, shard_meta(checksum)), (TIER_HEADER, "s3")),
            )
        raise TierError(404, "ShardNotFound", f"no good copy of rank {key.rank} step {key.step} of {name!r}")

    async def _local_copy(self, key: ShardKey) -> Response | None:
        """This node's copy, checksum-verified, sent from its shared-memory mapping.

        A mapped view, not sendfile: on loopback (a trainer restoring from its own node's agent)
        copying sends ran about 1.5x faster than sendfile from /dev/shm (bench/agent_http.py).
        """
        if self.store.get(key) is None:
            return None
        unpin = self.store.pin(key)
        try:
            info, view = await asyncio.to_thread(self.store.read_verified, key)
        except CorruptShard:
            unpin()
            log.error("local copy of %s is corrupt; it was dropped", key)
            return None
        except (KeyError, FileNotFoundError):
            unpin()
            return None

        def sent() -> None:
            view.release()
            unpin()

        return Response(
            status=200,
            content_type=OCTETS,
            body=view,
            headers=((SHARD_META, shard_meta(info.checksum)), (TIER_HEADER, tier_of(info))),
            on_sent=sent,
        )

    async def _remote_copy(self, key: ShardKey) -> Response | None:
        path = f"/v1/internal/shards/{quote(key.namespace, safe='')}/{key.rank}/{key.step}"
        for node_id, endpoint in (await self.members(refresh=True)).items():
            try:
                response = await self._peers.get(f"{endpoint}{path}", headers=self._token_header())
            except httpx.HTTPError:
                continue
            if response.status_code != 200:
                continue
            checksum = parse_shard_meta(response.headers.get(SHARD_META.lower()))
            if checksum_of(response.content) != checksum:
                log.error("copy of %s from %s failed its checksum; trying another", key, node_id)
                continue
            # The owner's own copy on another node is "peer"; a replica anywhere is "replica".
            tier = "replica" if response.headers.get(TIER_HEADER.lower()) == "replica" else "peer"
            return Response(
                status=200,
                body=response.content,
                content_type=OCTETS,
                headers=((SHARD_META, shard_meta(checksum)), (TIER_HEADER, tier)),
            )
        return None

    async def delete_shard(self, name: str, rank: str, step: str) -> Response:
        _, key = await self._key(name, rank, step)
        found = self.store.delete(key)
        for _, response in await self._fan_out(
            "DELETE", f"/v1/internal/shards/{quote(name, safe='')}/{key.rank}/{key.step}"
        ):
            found = found or response.status_code == 200
        if not found:
            raise TierError(
                404, "ShardNotFound", f"rank {key.rank} step {key.step} of {name!r} is not stored"
            )
        return json_response(200, {"deleted": {"rank": key.rank, "step": key.step}})

    # ------------------------------------------------------------------ latest

    async def complete_steps(self, name: str) -> list[int]:
        namespace = await self.namespace(name)
        held: dict[int, set[int]] = {}
        for step, ranks in self.store.steps(name).items():
            held.setdefault(step, set()).update(ranks)
        for _, response in await self._fan_out("GET", f"/v1/internal/index/{quote(name, safe='')}"):
            if response.status_code == 200:
                for step, ranks in response.json()["steps"].items():
                    held.setdefault(int(step), set()).update(ranks)
        everyone = set(range(namespace.num_ranks))
        return sorted((step for step, ranks in held.items() if everyone <= ranks), reverse=True)

    async def latest(self, name: str, request: Request) -> Response:
        checked_namespace(name)
        limit = query_int(request, "limit", default=5)
        memory, durable = await asyncio.gather(self.complete_steps(name), self.s3.committed_steps(name))
        steps = sorted(set(memory) | set(durable), reverse=True)
        return json_response(200, steps[: max(limit, 0)])

    async def persist(self, name: str, step: str, request: Request) -> Response:
        checked_namespace(name)
        try:
            number = canonical_int(step, what="step")
            body = json.loads(await request.read_body())
        except (ValueError, RecursionError) as exc:
            raise TierError(
                400, "InvalidPersist", f"a persist request needs a JSON body and a step: {str(exc)[:200]}"
            ) from exc
        return json_response(200, await self.s3.handle_persist(name, number, body))

    # ------------------------------------------------------------------ internal (agent to agent)

    async def local_index(self, name: str) -> Response:
        """step -> ranks held here: ``steps`` every copy, ``primary`` this node's own shards,
        ``replica`` the copies it holds of other nodes' shards (``steps`` is their union)."""
        held: dict[str, dict[int, set[int]]] = {"steps": {}, "primary": {}, "replica": {}}
        for info in self.store.shards(name):
            kind = "primary" if info.replica_of is None else "replica"
            for member in ("steps", kind):
                held[member].setdefault(info.key.step, set()).add(info.key.rank)
        index: dict[str, Any] = {"node_id": self.state.node_id}
        for member, steps in held.items():
            index[member] = {str(step): sorted(ranks) for step, ranks in sorted(steps.items())}
        return json_response(200, index)

    async def local_s3_steps(self, name: str) -> Response:
        """The steps of ``name`` committed on S3 (with a marker), newest first; [] without an S3 tier."""
        return json_response(200, {"steps": await self.s3.committed_steps(name)})

    async def local_shard(self, name: str, rank: str, step: str) -> Response:
        key = parse_key(name, rank, step)
        local = await self._local_copy(key)
        if local is None:
            raise TierError(404, "ShardNotFound", "no good copy here")
        return local

    async def local_delete(self, name: str, rank: str, step: str) -> Response:
        key = parse_key(name, rank, step)
        if not self.store.delete(key):
            raise TierError(404, "ShardNotFound", "not stored here")
        return json_response(200, {"deleted": True})

    async def local_delete_namespace(self, name: str) -> Response:
        self._namespaces.pop(name, None)
        removed = self.store.delete_namespace(name)
        return json_response(200, {"removed": removed})

    async def local_reset(self) -> Response:
        self._namespaces.clear()
        self.store.clear()
        return json_response(200, {"reset": True})

    # ------------------------------------------------------------------ policy changes

    def _on_policy(self, previous: NodePolicy | None, current: NodePolicy) -> None:
        """Budget changes evict down; new replica peers get this node's own shards; the S3 tier
        follows the policy's ``s3`` member. Switching tiered storage off (budget 0) first drains
        the newest complete steps to S3, then frees the memory."""
        was_on = previous is not None and previous.tiered_storage.enabled
        turned_off = was_on and not self.state.tiered_storage_enabled
        if turned_off and self.s3.target is not None and self.store.shard_count:
            self._spawn(self._drain_then_apply_budget())
        else:
            self.s3.set_target(current.s3)
            self.store.set_budget(current.memory_budget_bytes)
        old = set(previous.peer_ids if previous else [])
        new = current.peer_ids
        added = [peer for peer in new if peer not in old]
        if previous is None:
            # The first policy since this agent started: shards it found in shared memory may
            # have lost their replica in the crash that restarted it; check the peers' indexes.
            if new and any(info.replica_of is None for info in self.store.shards()):
                self._spawn(self._restore_replicas(new))
        elif added:
            self._members.clear()
            for info in self.store.shards():
                if info.replica_of is None:
                    self.counters.replication_pending.setdefault(info.key, time.time())
                    self._spawn(self._replicate(info, added))

    async def _drain_then_apply_budget(self) -> None:
        await self.s3.drain(timeout_s=self.drain_timeout_s, reason="tiered storage switched off")
        # The policy in force now (a newer one may have arrived during the drain).
        current = self.state.policy
        self.s3.set_target(current.s3 if current else None)
        self.store.set_budget(current.memory_budget_bytes if current else 0)

    async def _restore_replicas(self, peers: list[str]) -> None:
        """Send this node's own shards to the peers whose index lacks them."""
        own = [info for info in self.store.shards() if info.replica_of is None]
        for peer in peers:
            endpoint = (await self.members(refresh=True)).get(peer)
            if endpoint is None:
                continue  # not registered yet: its replicas come when the policy names it anew
            for name in sorted({info.key.namespace for info in own}):
                try:
                    response = await self._peers.get(
                        f"{endpoint}/v1/internal/index/{quote(name, safe='')}", headers=self._token_header()
                    )
                except httpx.HTTPError:
                    continue
                if response.status_code != 200:
                    continue
                held = {
                    (int(step), rank) for step, ranks in response.json()["steps"].items() for rank in ranks
                }
                for info in own:
                    if info.key.namespace == name and (info.key.step, info.key.rank) not in held:
                        self.counters.replication_pending.setdefault(info.key, time.time())
                        await self._replicate(info, [peer])


async def _slices(view: memoryview, size: int = 1 << 20) -> AsyncIterator[bytes]:
    """A shard's mapped bytes in 1 MiB pieces: a replica goes out without a copy of the whole
    shard in the agent's heap (bench/memory_tier.py: three 512 MiB copies before)."""
    for start in range(0, len(view), size):
        yield bytes(view[start : start + size])
