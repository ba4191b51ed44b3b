"""The in-memory checkpoint tier of an agent: what it does with namespaces and shards.

It serves the HTTP protocol of the in-memory checkpoint service that the public
``amzn-sagemaker-checkpointing`` library's ``InMemoryCheckpointClient`` uses (``/v1/cp/...``), so
that library's DCP writer and reader work against any agent of a cluster unmodified; the routes,
requests and responses are :mod:`agents.tierroutes`'. Its methods return results (documents, a
:class:`ShardCopy`) or raise :class:`TierError`.

How the cluster-wide view works (docs/memory-tier.md):

- **Namespaces** are kept by the control plane (``/agent/v1/clusters/{c}/namespaces``); each agent
  caches them (:mod:`agents.cluster`). A namespace created through one agent is known to all;
  clusters never share one.
- **Shards** are stored on the node whose agent received them (where the trainer runs), in
  shared memory (:mod:`agents.store`), and copied to the replica peers that the node's policy
  names (:mod:`agents.replication`). A read through any agent looks at its own copies first, then
  asks the other agents which of them holds a copy (``/v1/internal/...``, cluster token) and
  fetches one, verifying its checksum; a corrupt copy is never served.
- **latest** lists the steps for which every rank of the namespace (the metadata rank included) is
  held somewhere (:mod:`agents.catalog`), or committed on S3 (:mod:`agents.s3tier`).
- **The namespace index** (:mod:`agents.homes`): two agents per namespace keep which node holds
  which (rank, step); ``latest``, reads that miss here, deletes and drops of other saves ask one of
  them instead of every agent, and fall back to asking every agent when neither answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
from collections.abc import Awaitable, Callable
from urllib.parse import quote, urlencode

from hyperpod_sim.agents import catalog
from hyperpod_sim.agents.clock import SYSTEM_CLOCK, Clock
from hyperpod_sim.agents.cluster import ClusterView
from hyperpod_sim.agents.control_plane import ControlPlaneClient
from hyperpod_sim.agents.fastpath import FastPath
from hyperpod_sim.agents.homes import NamespaceIndex
from hyperpod_sim.agents.http.client import Answer, HttpError
from hyperpod_sim.agents.numbers import echo
from hyperpod_sim.agents.replication import Replicator
from hyperpod_sim.agents.s3.objects import S3Unavailable
from hyperpod_sim.agents.s3.tier import S3Tier
from hyperpod_sim.agents.state import AgentState
from hyperpod_sim.agents.store import (
    BudgetExceeded,
    CorruptShard,
    Reservation,
    ReservationCancelled,
    ShardInfo,
    ShardKey,
    ShardStore,
    UnusableShardFile,
)
from hyperpod_sim.agents.tiermodel import (
    MAX_NODE_ID_CHARS,
    Namespace,
    ShardCopy,
    TierCounters,
    TierError,
    Upload,
    checked_namespace,
    checked_new_namespace,
    parse_key,
    parse_shard_meta,
    parse_shard_save,
    tier_of,
)
from hyperpod_sim.contracts.agent_api import (
    CHECKSUM_PARAMETER,
    INTERNAL_NAMESPACE_ROUTE,
    INTERNAL_RESET_ROUTE,
    INTERNAL_SAVES_ROUTE,
    INTERNAL_SHARD_ROUTE,
    SAVE_PARAMETER,
    agent_path,
)
from hyperpod_sim.contracts.agent_bodies import (
    CatalogImages,
    CatalogReported,
    CatalogSteps,
    FastAborted,
    FastCommitted,
    FastLocation,
    FastReleased,
    FastReservation,
    LatestSteps,
    LocalDeleted,
    LocalNamespaceDeleted,
    NamespaceAnswer,
    NamespaceDeleted,
    PersistAnswer,
    PersistRequest,
    RankStep,
    ReplicaStored,
    ResetDone,
    S3Steps,
    SavesDropped,
    ShardDeleted,
    ShardIndex,
    ShardStored,
    SpareBuffer,
    StepHolders,
    problem_of,
)
from hyperpod_sim.contracts.limits import DEFAULT_MAX_FAST_LEASES, num_ranks_problem
from hyperpod_sim.contracts.policy import NodePolicy
from hyperpod_sim.contracts.s3layout import WRITTEN_BY_TRAINER
from hyperpod_sim.contracts.shards import SHARD_META, TIER_HEADER, checksum_of

log = logging.getLogger(__name__)


def _control_plane_refusal(response: Answer, *, default: str) -> TierError:
    """The control plane's refusal of a call, as this agent answers it: its status, code and
    message (``default`` the code when its body names none)."""
    try:
        doc = response.json()
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        doc = {}
    error, message = doc.get("error"), doc.get("message")
    return TierError(
        response.status_code,
        error if isinstance(error, str) and error else default,
        message if isinstance(message, str) else f"the control plane refused it: {response.text[:200]}",
    )


# The errors of a file system that has no room left (shared memory's tmpfs full, a quota).
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)


def _out_of_room(exc: OSError, *, needed: int) -> TierError:
    """The 507 for a write that found the shared memory full below the agent's budget (the tmpfs
    is shared with other processes, or smaller than the budget): the write is undone already."""
    return TierError(
        507,
        "InsufficientStorage",
        f"the shared memory holding this agent's shards has no room for {needed} more bytes "
        f"({exc.strerror or exc}); nothing was stored",
        needed=needed,
    )


# Waits before asking the agents that did not answer a drop of other saves again (about a minute).
DROP_RETRY_WAITS_S = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0)


class MemoryTier:
    """The namespaces and shards of ``/v1/cp/...`` (the library's protocol), ``/v1/fast/...`` (the
    same-host fast path) and ``/v1/internal/...`` (agent to agent), and the policy's effects."""

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
        max_fast_leases: int = DEFAULT_MAX_FAST_LEASES,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.state = state
        self.store = store
        self.clock = clock
        self.counters = TierCounters()
        self.cluster = ClusterView(state=state, control_plane=control_plane, peer_timeout_s=peer_timeout_s)
        self._tasks: set[asyncio.Task[None]] = set()
        self.index = NamespaceIndex(cluster=self.cluster, store=store, spawn=self._spawn)
        self.replicas = Replicator(
            cluster=self.cluster,
            store=store,
            counters=self.counters,
            clock=clock,
            spawn=self._spawn,
            mode=replication,
        )
        self.fast = FastPath(
            clock=clock, timeout_s=fast_timeout_s, spawn=self._spawn, max_entries=max_fast_leases
        )
        self.s3 = S3Tier(
            state=state,
            store=store,
            cluster=self.cluster,
            clock=clock,
            endpoint_override=s3_endpoint_override,
            holders=self.index.holders,
        )
        self.drain_timeout_s = drain_timeout_s
        state.listeners.append(self._on_policy)

    async def aclose(self) -> None:
        await self.s3.aclose()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.cluster.aclose()

    def _spawn(self, coroutine: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ namespaces

    async def get_namespace(self, name: str) -> NamespaceAnswer:
        return (await self.cluster.namespace(name)).answer()

    async def create_namespace(self, name: str, *, num_ranks: int, steps_retained: int) -> NamespaceAnswer:
        """Create a namespace at the control plane, which keeps them (and counts them against its
        limits). What no setting allows is refused here already: a name S3 keys cannot carry, more
        ranks than the protocol's ceiling. A refusal of the control plane is answered as it came
        (``ResourceLimitExceeded``, ``ValidationException``...)."""
        checked_new_namespace(name)
        problem = num_ranks_problem(num_ranks)
        if problem is not None:
            raise TierError(400, "ValidationException", problem)
        response = await self.cluster.control_plane(
            "POST",
            f"/namespaces/{quote(name, safe='')}",
            {"num_ranks": num_ranks, "steps_retained": steps_retained},
        )
        if response.status_code == 409:
            raise TierError(409, "NamespaceExists", f"namespace {echo(name)} already exists")
        if response.status_code != 201:
            raise _control_plane_refusal(response, default="InvalidNamespace")
        created = Namespace.from_doc(name, response.json())
        self.cluster.remember(created)
        return created.answer()

    async def delete_namespace(self, name: str) -> NamespaceDeleted:
        checked_namespace(name)
        response = await self.cluster.control_plane("DELETE", f"/namespaces/{quote(name, safe='')}")
        if response.status_code == 404:
            raise TierError(404, "NamespaceNotFound", f"namespace {name!r} does not exist")
        self.local_delete_namespace(name)
        # Every agent's namespace cache is cleared too: a rare admin call, it asks every agent.
        await self.cluster.fan_out("DELETE", agent_path(INTERNAL_NAMESPACE_ROUTE, namespace=name))
        return NamespaceDeleted(deleted=name)

    async def reset(self) -> ResetDone:
        await self.cluster.control_plane("POST", "/namespaces-reset")
        self.local_reset()
        await self.cluster.fan_out("POST", agent_path(INTERNAL_RESET_ROUTE))
        return ResetDone()

    # ------------------------------------------------------------------ saving shards

    async def _key(self, name: str, rank: str, step: str) -> tuple[Namespace, ShardKey]:
        key = parse_key(name, rank, step)
        namespace = await self.cluster.namespace(name)
        if not 0 <= key.rank < namespace.num_ranks:
            raise TierError(
                400,
                "InvalidRank",
                f"rank {key.rank} is outside 0..{namespace.num_ranks - 1} of namespace {echo(name)}",
            )
        return namespace, key

    async def _receive(self, key: ShardKey, upload: Upload, *, replica_of: str | None) -> ShardInfo:
        """Receive an upload into shared memory; verify it; commit it. Nothing is stored on failure."""
        checksum, save = upload.checksum(), upload.save()
        reservation = await self._reserve(key, upload.size())
        try:
            await upload.fill(reservation.buffer())
            info = await asyncio.to_thread(
                functools.partial(reservation.commit, checksum=checksum, replica_of=replica_of, save=save)
            )
        except CorruptShard as exc:
            reservation.abort()
            raise TierError(
                400, "ChecksumMismatch", "the body does not match the Shard-Meta checksum; nothing was stored"
            ) from exc
        except ReservationCancelled as exc:
            raise TierError(
                409, "Cancelled", "the namespace was deleted or reset while this shard was written"
            ) from exc
        except OSError as exc:
            reservation.abort()
            if exc.errno in _NO_ROOM:  # its sidecar found the tmpfs full
                raise _out_of_room(exc, needed=reservation.size) from exc
            raise
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

    async def _reserve(self, key: ShardKey, size: int, *, ahead: bool = False) -> Reservation:
        """Room for a shard (HTTP upload, replica or same-host write), evicting older steps but
        never a namespace's newest complete one; 507 with the numbers when it does not fit. The
        reservation allocates the file's memory, so it runs in a worker thread."""
        protect: set[tuple[str, int]] = set()
        if self.store.in_use_bytes + size > self.store.budget_bytes:
            protect = await self._protected_steps()
        try:
            return await asyncio.to_thread(
                self.store.reserve, key, size, protect=lambda: protect, ahead=ahead
            )
        except BudgetExceeded as exc:
            raise TierError(
                507,
                "InsufficientStorage",
                str(exc),
                needed=exc.needed,
                budget=exc.budget,
                in_use=exc.in_use,
            ) from exc
        except OSError as exc:  # the reservation is given back already (ShardStore.reserve)
            if exc.errno in _NO_ROOM:
                raise _out_of_room(exc, needed=size) from exc
            raise

    async def put_shard(self, name: str, rank: str, step: str, upload: Upload) -> ShardStored:
        namespace, key = await self._key(name, rank, step)
        info = await self._receive(key, upload, replica_of=None)
        await self._after_save(namespace, info)
        return ShardStored(namespace=name, rank=key.rank, step=key.step, size=info.size)

    async def _after_save(self, namespace: Namespace, info: ShardInfo) -> None:
        """A trainer's shard is stored here: retention, S3 scheduling, replication."""
        key = info.key
        self.store.enforce_retention(
            key.namespace, namespace.steps_retained, protect=lambda: {(key.namespace, key.step)}
        )
        # The rank's next saves get files already allocated and faulted in: its rotation
        # (retention + 1 files) is made now, before the save is answered (the trainer waits on
        # it off its training thread), within the budget.
        try:
            await asyncio.to_thread(
                self.store.prepare_spares, key.namespace, key.rank, files=namespace.steps_retained + 1
            )
        except OSError as exc:  # the shard is stored: with a full tmpfs the rank only lacks spares
            if exc.errno not in _NO_ROOM:
                raise
            log.info("no spares for %s: the shared memory is full (%s)", key, exc.strerror)
        if info.save is not None and key.rank == namespace.num_ranks - 1:
            await self._replace_other_saves(key.namespace, key.step, info.save)
        self.s3.on_saved(namespace, key)
        await self.replicas.after_save(info)
        # The homes know of this shard before the save is answered: the next `latest` through any
        # agent sees it (a home that does not answer gets it later, or rebuilds).
        await self.index.settle(key.namespace)

    async def _replace_other_saves(self, name: str, step: int, save: str) -> None:
        """The step's metadata of save ``save`` is committed here: every other save's shards of
        the step go, on this node and on every other agent holding some, so a step saved again replaces the
        earlier save whole. An agent that does not answer keeps its copies; readers use only the
        shards the committed metadata names (by checksum) in any case."""
        dropped = self.store.drop_other_saves(name, step, save)
        missing = await self._drop_on_peers(name, step, save)
        if dropped or missing:
            log.info(
                "step %d of %r is save %s: %d shards of other saves dropped here; agents not answering: %s",
                step, name, save, len(dropped), missing,
            )  # fmt: skip
        if missing:  # tried again in the background: a busy or restarting agent answers later
            self._spawn(self._drop_on_peers_later(name, step, save))

    async def _drop_on_peers(self, name: str, step: int, save: str) -> list[str]:
        """Ask the other agents that hold something of the step (the namespace index says which;
        every other agent when no home answers) to drop its other saves; the nodes that did not."""
        path = agent_path(INTERNAL_SAVES_ROUTE, namespace=name, step=step)
        holders = await self.index.holders(name, step)
        answers = await self.cluster.fan_out(
            "POST", f"{path}?{urlencode({SAVE_PARAMETER: save})}", only=holders
        )
        done = {node for node, response in answers if response.status_code == 200}
        asked = set(await self.cluster.members()) if holders is None else set(holders)
        return sorted(asked - done)

    async def _drop_on_peers_later(self, name: str, step: int, save: str) -> None:
        for wait_s in DROP_RETRY_WAITS_S:
            await asyncio.sleep(wait_s)
            try:
                if not await self._drop_on_peers(name, step, save):
                    return
            except TierError as exc:  # the control plane did not answer for the members
                log.info("dropping other saves of step %d of %r: %s", step, name, exc)
        log.warning("other saves of step %d of %r may remain on agents that never answered", step, name)

    async def put_replica(
        self, name: str, rank: str, step: str, upload: Upload, *, owner: str | None
    ) -> ReplicaStored:
        if owner is not None and len(owner) > MAX_NODE_ID_CHARS:
            raise TierError(
                400, "InvalidOwner", f"owner is a node id of at most {MAX_NODE_ID_CHARS} characters"
            )
        key = parse_key(name, rank, step)
        info = await self._receive(key, upload, replica_of=owner or "unknown")
        # Replicas are kept as the owner keeps its shards: the namespace's newest steps.
        try:
            namespace = await self.cluster.namespace(name)
        except TierError as exc:  # not known here yet and the control plane did not answer
            log.info("replica of %s kept without retention: %s", key, exc)
        else:
            self.store.enforce_retention(name, namespace.steps_retained, protect=lambda: {(name, key.step)})
        await self.index.settle(name)  # a replica answered is known to the homes (a sync save's too)
        return ReplicaStored(size=info.size)

    # ------------------------------------------------------------------ same-host fast path

    async def fast_reserve(
        self, name: str, rank: str, step: str, *, size: Callable[[], int], ahead: Callable[[], bool]
    ) -> FastReservation:
        """Room for a shard in this agent's shared memory, as a file a trainer on this host maps
        and writes into; it becomes the shard at ``fast_commit``. A reservation not committed
        within the fast path's timeout (``expires_in_s``) is given back (its trainer died).
        ``ahead``: the rank's next write, reserved before its step is known (``step`` is a
        placeholder; the commit names the step): given back, it stays the rank's spare."""
        namespace, key = await self._key(name, rank, step)
        wanted, early = size(), ahead()
        self.fast.check_room(leases=False)
        reservation = await self._reserve(key, wanted, ahead=early)
        token = self.fast.open_write(reservation, namespace)
        return FastReservation(
            token=token,
            path=str(reservation.path),
            buffer_id=reservation.buffer_id,
            size=wanted,
            expires_in_s=self.fast.timeout_s,
        )

    async def fast_commit(
        self,
        token: str,
        *,
        size: Callable[[int], int],
        step: Callable[[], int | None],
        save: Callable[[], str | None] = lambda: None,
    ) -> FastCommitted:
        """Commit an open write; ``size`` gives the bytes written from the reserved size (its
        default), ``step`` the step a write reserved ahead is (None: the step reserved), ``save``
        the save of its step the shard belongs to; each one raises TierError (the reservation is
        then given back)."""
        write = self.fast.take_write(token)
        if write is None:
            raise TierError(404, "NoSuchReservation", "no open reservation with this token (expired?)")
        reservation = write.reservation
        try:
            written = size(reservation.size)
            named = step()
            saved_as = save()
            if named is not None:
                if not reservation.ahead:
                    raise TierError(
                        400, "InvalidParameter", "step is named only at the commit of a write reserved ahead"
                    )
                rebind_to = parse_key(reservation.key.namespace, str(reservation.key.rank), str(named)).step
                reservation.rebind(rebind_to)
        except TierError:
            reservation.abort()
            raise
        except ReservationCancelled as exc:
            reservation.abort()
            raise TierError(409, "Cancelled", "the namespace was deleted or reset meanwhile") from exc
        try:
            # The file is checked (a regular file under this agent's root, the one reserved, of
            # the reserved size) and read without a mapping: a trainer that truncated or replaced
            # it gets a 400 and its reservation back, never a SIGBUS in the agent.
            info = await asyncio.to_thread(
                functools.partial(reservation.commit_written, size=written, save=saved_as)
            )
        except UnusableShardFile as exc:
            raise TierError(400, "UnusableShardFile", str(exc)) from exc
        except ValueError as exc:
            raise TierError(400, "InvalidSize", str(exc)) from exc
        except ReservationCancelled as exc:
            raise TierError(409, "Cancelled", "the namespace was deleted or reset meanwhile") from exc
        except OSError as exc:  # the reservation is given back already (Reservation.commit_written)
            if exc.errno in _NO_ROOM:
                raise _out_of_room(exc, needed=written) from exc
            raise
        await self._after_save(write.namespace, info)
        key = info.key
        return FastCommitted(
            namespace=key.namespace,
            rank=key.rank,
            step=key.step,
            size=info.size,
            checksum=info.checksum,
            # The rank's next buffers, for the trainer to map ahead (off its training thread).
            spares=tuple(
                SpareBuffer(path=str(spare.path), buffer_id=spare.buffer_id, size=spare.size)
                for spare in self.store.spares(key.namespace)
                if spare.rank == key.rank
            ),
        )

    def fast_abort(self, token: str) -> FastAborted:
        write = self.fast.take_write(token)
        if write is not None:
            write.give_back()
        return FastAborted(aborted=write is not None)

    async def fast_locate(self, name: str, rank: str, step: str) -> FastLocation:
        """Where this node's copy of a shard is, for a trainer on this host to map and verify
        itself; 404 if this node holds none (then it reads through ``GET /v1/cp/...``)."""
        _, key = await self._key(name, rank, step)
        found = self.store.local_path(key)
        if found is None:
            raise TierError(404, "ShardNotHere", "this node holds no copy; read it through /v1/cp")
        info, buffer_id = found
        self.fast.check_room(leases=True)
        # The file is not reused for a later save (truncated, rewritten) while the reader holds
        # this lease: until it releases it, or for the fast path's timeout.
        lease = self.fast.lease(self.store.pin(key))
        return FastLocation(
            path=str(info.path),
            size=info.size,
            checksum=info.checksum,
            buffer_id=buffer_id,
            tier=tier_of(info),
            lease=lease,
        )

    def fast_release(self, lease: str) -> FastReleased:
        return FastReleased(released=self.fast.release(lease))

    # ------------------------------------------------------------------ reading and deleting shards

    async def get_shard(self, name: str, rank: str, step: str, *, checksum: str | None = None) -> ShardCopy:
        """A good copy of a shard: this node's, another agent's, then S3's. ``checksum``: only a
        copy with that checksum (the one the step's committed metadata names); a copy of another
        save of the step is passed over."""
        _, key = await self._key(name, rank, step)
        local = await self._local_copy(key, checksum=checksum)
        if local is not None:
            return local
        remote = await self._remote_copy(key, checksum=checksum)
        if remote is not None:
            self.counters.remote_reads_total += 1
            return remote
        durable = await self.s3.read_shard(key, checksum=checksum)
        if durable is not None:
            data, found = durable
            return ShardCopy(body=data, checksum=found, tier="s3")
        wanted = "" if checksum is None else f" with checksum {checksum}"
        raise TierError(
            404, "ShardNotFound", f"no good copy of rank {key.rank} step {key.step} of {name!r}{wanted}"
        )

    async def _local_copy(self, key: ShardKey, *, checksum: str | None = None) -> ShardCopy | None:
        """This node's copy, checksum-verified, sent from its shared-memory mapping; with
        ``checksum``, only if it is the copy with that checksum.

        A mapped view, not sendfile: on loopback (a trainer restoring from its own node's agent)
        copying sends ran about 1.5x faster than sendfile from /dev/shm (bench/agent_http.py).
        """
        held = self.store.get(key)
        if held is None or (checksum is not None and held.checksum != checksum):
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

        if checksum is not None and info.checksum != checksum:  # replaced meanwhile by another save's
            sent()
            return None
        return ShardCopy(body=view, checksum=info.checksum, tier=tier_of(info), on_sent=sent, save=info.save)

    async def _remote_copy(self, key: ShardKey, *, checksum: str | None = None) -> ShardCopy | None:
        """A good copy from another agent: from the nodes that the namespace index says hold it
        (own copies first, then replicas: a dead holder fails fast and the next is tried), or,
        when no home answers, from every other agent in turn."""
        path = agent_path(INTERNAL_SHARD_ROUTE, namespace=key.namespace, rank=key.rank, step=key.step)
        params = {} if checksum is None else {CHECKSUM_PARAMETER: checksum}
        holders = await self.index.holders(key.namespace, key.step, key.rank)
        if holders is None:
            candidates = await self.cluster.members(refresh=True)
        else:
            known = await self.cluster.recent_members()
            candidates = {node_id: known[node_id] for node_id in holders if node_id in known}
        for node_id, endpoint in candidates.items():
            try:
                response = await self.cluster.peers.get(
                    f"{endpoint}{path}", headers=self.cluster.token_header(), params=params
                )
            except HttpError:
                continue
            if response.status_code != 200:
                continue
            header = response.headers.get(SHARD_META.lower())
            found = parse_shard_meta(header)
            if checksum_of(response.content) != found or (checksum is not None and found != checksum):
                log.error("copy of %s from %s failed its checksum; trying another", key, node_id)
                continue
            # The owner's own copy on another node is "peer"; a replica anywhere is "replica".
            tier = "replica" if response.headers.get(TIER_HEADER.lower()) == "replica" else "peer"
            return ShardCopy(body=response.content, checksum=found, tier=tier, save=parse_shard_save(header))
        return None

    async def delete_shard(self, name: str, rank: str, step: str) -> ShardDeleted:
        _, key = await self._key(name, rank, step)
        holders = await self.index.holders(name, key.step, key.rank)
        found = self.store.delete(key)
        path = agent_path(INTERNAL_SHARD_ROUTE, namespace=name, rank=key.rank, step=key.step)
        for _, response in await self.cluster.fan_out("DELETE", path, only=holders):
            found = found or response.status_code == 200
        await self.index.settle(name)
        if not found:
            raise TierError(
                404, "ShardNotFound", f"rank {key.rank} step {key.step} of {name!r} is not stored"
            )
        return ShardDeleted(deleted=RankStep(rank=key.rank, step=key.step))

    # ------------------------------------------------------------------ latest

    async def complete_steps(self, name: str) -> list[int]:
        """The complete steps of ``name`` in memory across the cluster, newest first."""
        return list(await self._memory_steps(name))

    async def latest(self, name: str, *, limit: int) -> list[int]:
        """What the library asks: the newest steps saved at the namespace's own world size (its
        ranks less the metadata rank), the only ones a job of its fixed world size can read; a
        step saved by a job of another world size (the SDK's resharding) is never in it."""
        namespace = await self.cluster.namespace(checked_namespace(name))
        own = max(namespace.num_ranks - 1, 1)
        sized = await self.latest_sizes(name, limit=limit, wanted=own)
        return [step for step in sized.steps if sized.world_sizes[step] == own]

    async def latest_sizes(self, name: str, *, limit: int, wanted: int | None = None) -> LatestSteps:
        """The newest ``limit`` complete steps (in memory or on S3) of every world size, each with
        the world size of the job that saved it (``wanted``: of that world size only)."""
        checked_namespace(name)
        memory, durable = await asyncio.gather(self._memory_steps(name), self.s3.committed_steps(name))
        sizes: dict[int, int] = {}
        for step in sorted(set(memory) | set(durable), reverse=True):
            if len(sizes) >= max(limit, 0):
                break
            size = memory[step] if step in memory else await self.s3.step_world_size(name, step)
            if size is not None and wanted in (None, size):
                sizes[step] = size
        return LatestSteps(steps=tuple(sizes), world_sizes=sizes)

    async def _memory_steps(self, name: str) -> dict[int, int]:
        """The complete steps in memory with their world sizes, newest first: from a home of the
        namespace index, else from every agent's index (the fan-out)."""
        namespace = await self.cluster.namespace(name)
        found = await self.index.steps(name, namespace.num_ranks)
        if found is not None:
            return found
        return await catalog.cluster_steps(self.cluster, self.store, name)

    async def persist(self, name: str, step: int, request: PersistRequest) -> PersistAnswer:
        """A peer's request to upload the ranks of a step that this agent holds."""
        return await self.s3.handle_persist(name, step, request)

    # ------------------------------------------------------------------ internal (agent to agent)

    def local_index(self, name: str) -> ShardIndex:
        self.index.counters.index_answers_total += 1
        return self.index.image(name)

    def catalog_report(self, name: str, body: bytes) -> CatalogReported:
        """A member's report of what it holds of ``name``, to this agent as a home of it."""
        checked_namespace(name)
        try:
            image = ShardIndex.parse(body)
        except ValueError as exc:
            raise TierError(400, "InvalidReport", f"a report is a ShardIndex: {problem_of(exc)}") from exc
        return self.index.receive(name, image)

    async def catalog_steps(self, name: str, num_ranks: int) -> CatalogSteps:
        checked_namespace(name)
        return await self.index.steps_here(name, num_ranks)

    async def catalog_images(self, name: str) -> CatalogImages:
        checked_namespace(name)
        return await self.index.images_here(name)

    async def catalog_holders(self, name: str, step: str, rank: str | None) -> StepHolders:
        key = parse_key(name, rank or "0", step)
        return await self.index.holders_here(name, key.step, None if rank is None else key.rank)

    async def local_s3_steps(self, name: str) -> S3Steps:
        """The steps of ``name`` on S3 (with a marker, or written whole by the trainer through the
        library: those also in ``trainer``), newest first; [] without an S3 tier; 503
        ``S3Unavailable`` when S3 cannot be listed (not an empty list: nothing says the steps
        are not there)."""
        try:
            written = await self.s3.listed_steps(name)
        except S3Unavailable as exc:
            raise TierError(503, "S3Unavailable", f"S3 cannot be listed: {exc}") from exc
        steps = sorted(written, reverse=True)
        sizes = {step: await self.s3.step_world_size(name, step) for step in steps}
        return S3Steps(
            steps=tuple(steps),
            trainer=tuple(s for s in steps if written[s] == WRITTEN_BY_TRAINER),
            world_sizes={step: size for step, size in sizes.items() if size is not None},
        )

    async def local_shard(self, name: str, rank: str, step: str, *, checksum: str | None = None) -> ShardCopy:
        key = parse_key(name, rank, step)
        local = await self._local_copy(key, checksum=checksum)
        if local is None:
            raise TierError(404, "ShardNotFound", "no good copy here")
        return local

    async def local_delete(self, name: str, rank: str, step: str) -> LocalDeleted:
        key = parse_key(name, rank, step)
        if not self.store.delete(key):
            raise TierError(404, "ShardNotFound", "not stored here")
        await self.index.settle(name)  # the homes know before the delete is answered
        return LocalDeleted()

    async def local_drop_other_saves(self, name: str, step: str, save: str) -> SavesDropped:
        """A peer committed the step's metadata of save ``save``: the shards of the step held
        here that belong to another save are removed."""
        key = parse_key(name, "0", step)
        dropped = self.store.drop_other_saves(name, key.step, save)
        if dropped:
            await self.index.settle(name)
        return SavesDropped(dropped=tuple(RankStep(rank=k.rank, step=k.step) for k in dropped))

    def local_delete_namespace(self, name: str) -> LocalNamespaceDeleted:
        self.cluster.forget(name)
        self.index.forget(name)
        removed = self.store.delete_namespace(name)
        return LocalNamespaceDeleted(removed=removed)

    def local_reset(self) -> ResetDone:
        self.cluster.forget()
        self.index.forget()
        self.store.clear()
        return ResetDone()

    # ------------------------------------------------------------------ policy changes

    def _on_policy(self, previous: NodePolicy | None, current: NodePolicy) -> None:
        """Budget changes evict down; new replica peers get this node's own shards; the S3 tier
        follows the policy's ``s3`` member. Switching tiered storage off (budget 0) first drains
        the newest complete steps to S3, then frees the memory."""
        self.cluster.members_stale()  # a member added, replaced or gone comes with a new generation
        was_on = previous is not None and previous.tiered_storage.enabled
        turned_off = was_on and not self.state.tiered_storage_enabled
        if turned_off and self.s3.target is not None and self.store.shard_count:
            self._spawn(self._drain_then_apply_budget())
        else:
            self._apply_targets(current)
        old = set(previous.peer_ids if previous else [])
        new = current.peer_ids
        added = [peer for peer in new if peer not in old]
        if previous is None:
            # Its node id is known now: what it holds (adopted at a restart) goes to the homes,
            # and every later change too.
            self.index.start()
            # The first policy since this agent started: shards it found in shared memory may
            # have lost their replica in the crash that restarted it; check the peers' indexes.
            if new and any(info.replica_of is None for info in self.store.shards()):
                self._spawn(self.replicas.restore(new))
        elif added:
            self.replicas.to_new_peers(added)

    def _apply_targets(self, policy: NodePolicy | None) -> None:
        self.s3.set_target(policy.s3 if policy else None)
        self.store.set_budget(policy.memory_budget_bytes if policy else 0)

    async def _drain_then_apply_budget(self) -> None:
        await self.s3.drain(timeout_s=self.drain_timeout_s, reason="tiered storage switched off")
        # The policy in force now (a newer one may have arrived during the drain).
        self._apply_targets(self.state.policy)
