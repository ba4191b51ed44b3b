"""The S3 tier of an agent: complete steps persisted from memory to S3, off the request path.

How a step gets to S3 (docs/s3-tier.md):

- **When.** The agent that stores a step's metadata shard (the last rank of the namespace; DCP
  writes it once every rank's data is saved) checks the cluster's policy: the step is due when
  its number is a multiple of ``persist_every_steps`` or ``persist_every_seconds`` have passed since
  this agent last started a persist of the namespace. The save is answered first; the persist runs
  as a task. One persist per namespace at a time: while S3 is slow, newer due steps replace the
  queued one (the tier lags, visible in metrics and in the node's AgentStatus), and a failed
  persist is retried with backoff, on the newest complete step.
- **Who uploads.** The coordinating agent asks every agent of the cluster to upload the ranks it
  holds as primary (``POST /v1/internal/persist``), uploads its own, in parallel; ranks still
  missing come from replicas, then from objects a draining peer already put on S3.
- **Commit.** Only when every rank and the metadata are on S3 and verified (size and checksum read
  back) is the commit marker written; "on S3" means "has a marker". Then retention: whole steps
  beyond the newest ``retention`` are deleted, marker first, and objects of older steps that never
  got a marker (an upload that died) are deleted too.
- **Reads.** A shard that no agent holds is read from S3 and checked against its marker.
- **Drain.** On SIGTERM, node deletion and ``Mode: Disable`` the agent persists the newest complete
  step of its namespaces that S3 does not hold yet, within a deadline; what it cannot persist is
  logged, counted and sent to the control plane as a cluster event.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from hyperpod_sim.agents import catalog
from hyperpod_sim.agents.clock import SYSTEM_CLOCK, Clock
from hyperpod_sim.agents.cluster import ClusterView
from hyperpod_sim.agents.http.client import HttpError, Timeout
from hyperpod_sim.agents.retry import Backoff
from hyperpod_sim.agents.s3 import reads as s3reads
from hyperpod_sim.agents.s3.objects import S3Faults, S3Objects, S3Unavailable
from hyperpod_sim.agents.state import AgentState
from hyperpod_sim.agents.store import CorruptShard, ShardKey, ShardStore
from hyperpod_sim.agents.tiermodel import Namespace, TierError
from hyperpod_sim.contracts.agent_api import INTERNAL_PERSIST_ROUTE, agent_path
from hyperpod_sim.contracts.agent_bodies import (
    PersistAnswer,
    PersistRequest,
    S3TierStatus,
    UploadedShard,
    problem_of,
)
from hyperpod_sim.contracts.limits import namespace_name_problem
from hyperpod_sim.contracts.policy import NodePolicy, S3Policy
from hyperpod_sim.contracts.s3layout import (
    CommitMarker,
    S3Target,
    ShardObject,
    step_of_key,
    trainer_steps,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

PERSIST_RETRY_MAX_S = 30.0
# A peer's persist answer waits for its uploads: allow big shards on slow S3.
PEER_PERSIST_TIMEOUT = Timeout(connect=10.0, read=900.0)


class PersistFailed(Exception):
    """A step could not be committed on S3 (nothing was reported committed)."""


def is_temporary(exc: Exception) -> bool:
    """Whether a persist that failed with ``exc`` may succeed when tried again: S3 or a peer
    unavailable, a rank missing for now, the control plane down (5xx). A refusal (4xx), an
    answer off the contract or a bug of ours is permanent."""
    if isinstance(exc, TierError):
        return exc.status >= 500
    return isinstance(exc, PersistFailed | S3Unavailable | HttpError | OSError | TimeoutError)


@dataclass
class S3Counters:
    persisted_steps_total: int = 0
    uploaded_bytes_total: int = 0
    uploaded_shards_total: int = 0
    failures_total: int = 0  # persists that failed (each is retried or superseded)
    fallback_reads_total: int = 0  # shards served from S3
    retention_deleted_steps_total: int = 0
    abandoned_steps_deleted_total: int = 0  # uncommitted leftovers of died uploads, cleaned up
    drain_failures_total: int = 0
    last_error: str | None = None
    last_persisted: dict[str, int] = field(default_factory=dict)
    # (namespace, step) -> when it became due and is not on S3 yet.
    due: dict[tuple[str, int], float] = field(default_factory=dict)

    def lag_s(self, now: float) -> float:
        return max((now - since for since in self.due.values()), default=0.0)


@dataclass
class _NamespaceQueue:
    task: asyncio.Task[None] | None = None
    wanted: int | None = None  # the newest due step not yet persisted
    last_started: float = float("-inf")
    failures: int = 0  # failed persists since the last time nothing was pending


class S3Tier:
    def __init__(
        self,
        *,
        state: AgentState,
        store: ShardStore,
        cluster: ClusterView,
        clock: Clock = SYSTEM_CLOCK,
        endpoint_override: str | None = None,
        upload_workers: int = 4,
        holders: Callable[[str, int], Awaitable[list[str] | None]] | None = None,
    ) -> None:
        """``holders(namespace, step)``: the other nodes holding something of the step (the
        namespace index), None when it cannot tell; persist requests go to those only."""
        self._state = state
        self._holders = holders
        self.store = store
        self._cluster = cluster
        self._clock = clock
        self.counters = S3Counters()
        self.target: S3Target | None = None
        self._endpoint_override = endpoint_override
        self._objects: dict[tuple[str | None, str], S3Objects] = {}
        self._executor = ThreadPoolExecutor(
            max_workers=upload_workers + 4, thread_name_prefix="s3", initializer=_lower_priority
        )
        self._uploads: dict[tuple[str, ShardKey], asyncio.Future[ShardObject]] = {}
        # Shards this agent put on S3: (base uri, key) -> the object, reused while the checksum holds.
        self._uploaded: dict[tuple[str, ShardKey], ShardObject] = {}
        self._queues: dict[str, _NamespaceQueue] = {}
        self._closing = False
        # Injected S3 faults (the policy's faults.s3), applied by every S3 client of this tier.
        self.faults = S3Faults()
        state.listeners.append(self._on_policy)

    async def aclose(self) -> None:
        self._closing = True
        for queue in self._queues.values():
            if queue.task is not None:
                queue.task.cancel()
        await asyncio.gather(*(q.task for q in self._queues.values() if q.task), return_exceptions=True)
        self._executor.shutdown(wait=False, cancel_futures=True)
        for objects in self._objects.values():
            objects.close()

    # ------------------------------------------------------------------ configuration

    def set_target(self, s3: S3Policy | None) -> None:
        """Apply a policy's ``s3`` member (None: no S3 persistence)."""
        try:
            self.target = S3Target.from_policy(s3, endpoint_override=self._endpoint_override)
        except ValueError as exc:
            log.error("S3 persistence is off: %s", exc)
            self.target = None
        if self.target is None:
            self.counters.due.clear()

    def _on_policy(self, previous: NodePolicy | None, current: NodePolicy) -> None:
        self.faults.set(current.faults.s3)

    @property
    def upload_retries_total(self) -> int:
        return sum(objects.retries_total for objects in self._objects.values())

    async def _client(self, target: S3Target) -> S3Objects:
        """The S3 client of a target's endpoint, built once, in a worker thread: importing boto3
        and building a client takes a quarter of a second that the event loop (and the saves it
        answers) must not wait for."""
        key = (target.endpoint_url, target.region)
        objects = self._objects.get(key)
        if objects is None:
            built = await self._run(
                lambda: S3Objects(endpoint_url=target.endpoint_url, region=target.region, faults=self.faults)
            )
            objects = self._objects.setdefault(key, built)
            if objects is not built:
                built.close()
        return objects

    async def _run(self, call: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    def status(self) -> S3TierStatus | None:
        """What the heartbeat reports (the node's AgentStatus.S3Tier); None without a target."""
        if self.target is None:
            return None
        counters = self.counters
        return S3TierStatus(
            pending_steps=len(counters.due),
            lag_seconds=round(counters.lag_s(self._clock.wall()), 3),
            persisted_steps_total=counters.persisted_steps_total,
            failures_total=counters.failures_total,
            last_persisted=dict(counters.last_persisted),
            last_error=counters.last_error,
        )

    # ------------------------------------------------------------------ scheduling

    def on_saved(self, namespace: Namespace, key: ShardKey) -> None:
        """A trainer's shard was stored here: schedule a persist if it completes a due step."""
        target = self.target
        if target is None or self._closing or key.rank != namespace.num_ranks - 1:
            return
        queue = self._queues.setdefault(namespace.name, _NamespaceQueue())
        by_steps = target.every_steps is not None and key.step % target.every_steps == 0
        by_time = (
            target.every_seconds is not None
            and self._clock.monotonic() - queue.last_started >= target.every_seconds
        )
        if not (by_steps or by_time):
            return
        self.counters.due.setdefault((namespace.name, key.step), self._clock.wall())
        if queue.wanted is None or key.step > queue.wanted:
            queue.wanted = key.step
        if queue.task is None or queue.task.done():
            queue.task = asyncio.ensure_future(self._persist_loop(namespace.name, queue))

    async def _persist_loop(self, name: str, queue: _NamespaceQueue) -> None:
        """Persist the newest wanted step of a namespace until none is left. A temporary failure
        (S3 or a peer down) is retried with backoff; a permanent one (a refusal that retrying
        cannot change, or our bug) gives the step up: the next due step is tried afresh."""
        backoff = Backoff(initial_s=0.5, max_s=PERSIST_RETRY_MAX_S, jitter=False)
        while queue.wanted is not None and not self._closing:
            step = queue.wanted
            queue.last_started = self._clock.monotonic()
            try:
                await self.persist_step(name, step)
            except Exception as exc:
                temporary = is_temporary(exc)
                self._count_failure(name, step, exc, queue, temporary=temporary)
                if queue.wanted != step:
                    continue  # a newer step is wanted: try it at once
                if not temporary:
                    self._give_up(name, step, queue, why="retrying cannot make it succeed")
                    continue
                await self._clock.sleep(backoff.next_delay())
                if queue.wanted == step and await self._still_complete(name, step) is False:
                    self._give_up(name, step, queue, why="it is no longer complete in memory")
                continue
            backoff.reset()
            if queue.wanted == step:
                queue.wanted = None
            if queue.failures and not any(due[0] == name for due in self.counters.due):
                await self._report_caught_up(name, step, queue.failures)
                queue.failures = 0

    def _count_failure(
        self, name: str, step: int, exc: Exception, queue: _NamespaceQueue, *, temporary: bool
    ) -> None:
        self.counters.failures_total += 1
        queue.failures += 1
        self.counters.last_error = f"{type(exc).__name__}: {exc}"[:500]
        expected = isinstance(exc, PersistFailed | S3Unavailable)
        log.log(
            logging.WARNING if expected else logging.ERROR,
            "persist of step %d of %r failed (%s): %s",
            step,
            name,
            "temporary: retried" if temporary else "permanent",
            exc,
            exc_info=not expected,
        )

    def _give_up(self, name: str, step: int, queue: _NamespaceQueue, *, why: str) -> None:
        log.warning("step %d of %r is given up: %s", step, name, why)
        self._forget_due(name, up_to=step)
        queue.wanted = None

    async def _report_caught_up(self, name: str, step: int, failures: int) -> None:
        """A cluster event: the lag that failed persists built up is gone (nothing pending)."""
        target = self.target
        where = target.base_uri if target is not None else "S3"
        message = (
            f"S3 persistence caught up: step {step} of namespace {name!r} on S3 ({where}) after "
            f"{failures} failed attempt{'s' if failures != 1 else ''}; no step is pending."
        )
        log.warning("%s", message)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._cluster.report_event("Info", message), 5.0)

    async def _still_complete(self, name: str, step: int) -> bool | None:
        """Whether the step is still complete in memory; None if that cannot be told now (a
        persist is given up only on a definite no)."""
        try:
            return step in await catalog.cluster_complete_steps(self._cluster, self.store, name)
        except Exception:
            return None

    def _forget_due(self, name: str, *, up_to: int) -> None:
        for due in [d for d in self.counters.due if d[0] == name and d[1] <= up_to]:
            del self.counters.due[due]

    # ------------------------------------------------------------------ persisting a step

    async def persist_step(self, name: str, step: int) -> bool:
        """Put every shard of a step on S3 and then its commit marker. True if it was committed
        now, False if a marker was already there; PersistFailed if a shard could not be put."""
        target = self.target
        if target is None:
            raise PersistFailed("no S3 base URI is configured for this cluster")
        problem = namespace_name_problem(name)
        if problem is not None:
            # A namespace made before names were checked (issue 23: its persists failed forever
            # as temporary, PendingSteps stuck): no S3 key can carry it, so retrying is useless.
            raise TierError(400, "InvalidNamespace", f"its steps cannot be persisted to S3: {problem}")
        namespace = await self._cluster.namespace(name)
        objects = await self._client(target)
        marker_key = target.marker_key(name, step)
        # The save of the step: that of the metadata held here (the agent that received it
        # persists the step). Only that save's shards are put on S3, and the marker names it.
        held = self.store.get(ShardKey(name, namespace.num_ranks - 1, step))
        save = None if held is None else held.save
        existing = await self._run(lambda: objects.get(target.bucket, marker_key))
        if existing is not None:
            try:
                committed_save = CommitMarker.save_of(existing)
            except (ValueError, KeyError, TypeError):
                committed_save = None
            if save is None or committed_save == save:
                self._committed(name, step)
                return False
            # The step was saved again: the earlier save's marker goes first, so the step is
            # never on S3 with another save's objects under it.
            await self._run(lambda: objects.delete(target.bucket, [marker_key]))
            log.info("step %d of %r was saved again (save %s): persisting it anew", step, name, save)
        ranks = set(range(namespace.num_ranks))
        done: dict[int, ShardObject] = {}
        errors: list[str] = []

        def collect(results: list[ShardObject], problems: list[str]) -> None:
            for result in results:
                done.setdefault(result.rank, result)
            errors.extend(problems)

        # Round 1: every agent uploads the ranks it holds as primary, in parallel.
        own = [r for r in ranks if self._holds(ShardKey(name, r, step), primary=True, save=save)]
        local, remote = await asyncio.gather(
            self._upload_local(target, namespace, step, own),
            self._ask_peers(target, name, step, sorted(ranks - set(own)), replicas=False, save=save),
        )
        collect(*local)
        collect(*remote)
        # Round 2: what is still missing, from any copy (a lost primary's replica).
        missing = sorted(ranks - done.keys())
        if missing:
            replicas = [r for r in missing if self._holds(ShardKey(name, r, step), primary=False, save=save)]
            collect(*await self._upload_local(target, namespace, step, replicas))
            missing = sorted(ranks - done.keys())
            if missing:
                collect(*await self._ask_peers(target, name, step, missing, replicas=True, save=save))
        # Round 3: objects a peer put there before it went away (its drain), verified by HEAD;
        # not for a step of a named save (an object does not say which save it is of).
        for rank in sorted(ranks - done.keys()) if save is None else []:
            key = target.shard_key(name, rank, step, namespace.num_ranks)
            head = await self._run(functools.partial(objects.head, target.bucket, key))
            if head is not None and head[1] is not None:
                done[rank] = ShardObject(rank, key, head[0], head[1])
        missing = sorted(ranks - done.keys())
        if missing:
            detail = "; ".join(errors[:3]) or "no agent holds them"
            raise PersistFailed(f"step {step} of {name!r}: ranks {missing} could not be put on S3 ({detail})")
        marker = CommitMarker(
            namespace=name,
            step=step,
            num_ranks=namespace.num_ranks,
            committed_at=self._clock.wall(),
            committed_by=self._state.node_id,
            shards=tuple(done[rank] for rank in sorted(done)),
            save=save,
        )
        await self._run(lambda: objects.put_json(target.bucket, marker_key, marker.doc()))
        self.counters.persisted_steps_total += 1
        self._committed(name, step)
        log.info("step %d of %r is on S3 (%d shards)", step, name, len(done))
        try:
            world_size = namespace.num_ranks - 1 if namespace.num_ranks >= 2 else None
            await self._run(lambda: self._retain(objects, target, name, step, world_size))
        except S3Unavailable as exc:
            log.warning("S3 retention of %r did not finish: %s", name, exc)
        return True

    def _committed(self, name: str, step: int) -> None:
        last = self.counters.last_persisted.get(name)
        if last is None or step > last:
            self.counters.last_persisted[name] = step
        self._forget_due(name, up_to=step)

    def _holds(self, key: ShardKey, *, primary: bool, save: str | None = None) -> bool:
        """Whether this node holds a copy of ``key`` (its own, or a replica), of save ``save`` if named."""
        info = self.store.get(key)
        return (
            info is not None and (info.replica_of is None) == primary and (save is None or info.save == save)
        )

    async def _upload_local(
        self, target: S3Target, namespace: Namespace, step: int, ranks: list[int]
    ) -> tuple[list[ShardObject], list[str]]:
        async def one(rank: int) -> ShardObject | str:
            try:
                return await self.upload_shard(target, namespace, ShardKey(namespace.name, rank, step))
            except (S3Unavailable, CorruptShard, KeyError, FileNotFoundError) as exc:
                return f"rank {rank} on {self._state.node_id}: {exc}"

        results = await asyncio.gather(*(one(r) for r in ranks))
        return [r for r in results if isinstance(r, ShardObject)], [r for r in results if isinstance(r, str)]

    async def upload_shard(self, target: S3Target, namespace: Namespace, key: ShardKey) -> ShardObject:
        """Put one shard held here on S3 (once: a second call while it uploads waits for the first)."""
        info = self.store.get(key)
        if info is None:
            raise KeyError(key)
        done = self._uploaded.get((target.base_uri, key))
        if done is not None and done.checksum == info.checksum:
            return done
        running = self._uploads.get((target.base_uri, key))
        if running is not None:
            return await asyncio.shield(running)
        object_key = target.shard_key(key.namespace, key.rank, key.step, namespace.num_ranks)
        objects = await self._client(target)

        def upload() -> ShardObject:
            unpin = self.store.pin(key)  # its file is not reused for a later step meanwhile
            try:
                checked, body = self.store.open_verified(key)  # a corrupt copy is never uploaded
                with body:
                    objects.upload(
                        object_key, body, size=checked.size, checksum=checked.checksum, bucket=target.bucket
                    )
            finally:
                unpin()
            return ShardObject(key.rank, object_key, checked.size, checked.checksum)

        future: asyncio.Future[ShardObject] = asyncio.ensure_future(self._run(upload))
        self._uploads[(target.base_uri, key)] = future
        try:
            result = await asyncio.shield(future)
        finally:
            self._uploads.pop((target.base_uri, key), None)
        self._uploaded[(target.base_uri, key)] = result
        self.counters.uploaded_shards_total += 1
        self.counters.uploaded_bytes_total += result.size
        self._prune_uploaded()
        return result

    def _prune_uploaded(self) -> None:
        for entry in [e for e in self._uploaded if self.store.get(e[1]) is None]:
            del self._uploaded[entry]

    async def _ask_peers(
        self, target: S3Target, name: str, step: int, ranks: list[int], *, replicas: bool, save: str | None
    ) -> tuple[list[ShardObject], list[str]]:
        """Ask the other agents that hold something of the step (every other agent when the
        namespace index cannot tell) to upload the listed ranks they hold (primaries, or any
        copy), of save ``save`` if named."""
        if not ranks:
            return [], []
        holders = None if self._holders is None else await self._holders(name, step)
        path = agent_path(INTERNAL_PERSIST_ROUTE, namespace=name, step=step)
        body = PersistRequest(base_uri=target.base_uri, ranks=tuple(ranks), replicas=replicas, save=save)
        results: list[ShardObject] = []
        problems: list[str] = []
        for node_id, response in await self._cluster.fan_out(
            "POST", path, json_body=body.document(), timeout=PEER_PERSIST_TIMEOUT, only=holders
        ):
            if response.status_code != 200:
                problems.append(f"{node_id}: {response.status_code} {response.text[:200]}")
                continue
            try:
                answer = PersistAnswer.parse(response.content)
            except ValueError as exc:
                problems.append(f"{node_id}: answered off the contract: {problem_of(exc)}")
                continue
            results.extend(ShardObject(u.rank, u.key, u.size, u.checksum) for u in answer.uploaded)
            problems.extend(f"{node_id}: {p}" for p in answer.failed)
        return results, problems

    async def handle_persist(self, name: str, step: int, request: PersistRequest) -> PersistAnswer:
        """A peer's request: upload the listed ranks of a step that this agent holds."""
        target = self.target
        if target is None or target.base_uri != request.base_uri:
            return PersistAnswer(failed=(f"this agent's S3 target is {target and target.base_uri}",))
        namespace = await self._cluster.namespace(name)
        save = request.save
        ranks = [
            r
            for r in request.ranks
            if self._holds(ShardKey(name, r, step), primary=True, save=save)
            or (request.replicas and self._holds(ShardKey(name, r, step), primary=False, save=save))
        ]
        uploaded, failed = await self._upload_local(target, namespace, step, ranks)
        return PersistAnswer(
            uploaded=tuple(UploadedShard.model_validate(u.doc()) for u in uploaded), failed=tuple(failed)
        )

    # ------------------------------------------------------------------ retention and cleanup

    def _retain(
        self, objects: S3Objects, target: S3Target, name: str, newest: int, world_size: int | None
    ) -> None:
        """Keep the newest ``retention`` steps on S3 (markers go first; steps the trainer wrote
        count as on S3); delete what uploads that died before their marker left behind, below the
        newest committed step."""
        prefix = target.namespace_prefix(name)
        marker_prefix = target.marker_prefix(name)
        keys = list(objects.keys(target.bucket, prefix))
        markers = [k for k in keys if k.startswith(marker_prefix)]
        data = [k for k in keys if not k.startswith(marker_prefix)]
        trainer = trainer_steps(data, prefix, world_size)  # complete without a marker: not abandoned
        doomed, abandoned = catalog.retention_plan(
            [*(s for k in markers if (s := step_of_key(k)) is not None), *trainer],
            (s for k in data if (s := step_of_key(k)) is not None),
            target.retention,
        )
        for step in sorted(doomed):
            objects.delete(target.bucket, [target.marker_key(name, step)])  # not "on S3" from here on
            objects.delete(target.bucket, [k for k in data if step_of_key(k) == step])
            self.counters.retention_deleted_steps_total += 1
        if abandoned:
            objects.delete(target.bucket, [k for k in keys if step_of_key(k) in abandoned])
            self.counters.abandoned_steps_deleted_total += len(abandoned)
        stale_uploads = abandoned | doomed
        if stale_uploads:
            objects.abort_uploads(target.bucket, prefix, steps=stale_uploads)

    # ------------------------------------------------------------------ reads

    async def committed_steps(self, name: str) -> list[int]:
        """Steps on S3, newest first: with a commit marker, or written whole by the trainer through
        the library, in either layout (``s3layout.trainer_steps``); [] without a target or when S3 fails."""
        return sorted(await self.s3_steps(name), reverse=True)

    async def s3_steps(self, name: str) -> dict[int, str]:
        """Every step of ``name`` on S3 -> who wrote it (``WRITTEN_BY_AGENTS``: it has a marker,
        ``WRITTEN_BY_TRAINER``: the library wrote it complete, without one); {} when S3 fails."""
        try:
            return await self.listed_steps(name)
        except S3Unavailable as exc:
            log.warning("cannot list S3 steps of %r: %s", name, exc)
            return {}

    async def listed_steps(self, name: str) -> dict[int, str]:
        """:meth:`s3_steps`, but S3Unavailable when S3 cannot be listed: for a caller that must
        tell "not on S3" from "S3 unreachable" (the control plane's checkpoint listing)."""
        target = self.target
        if target is None:
            return {}
        objects = await self._client(target)
        world_size = await self._world_size(name)
        keys = await self._run(lambda: list(objects.keys(target.bucket, target.namespace_prefix(name))))
        return s3reads.written_steps(target, name, keys, world_size)

    async def step_world_size(self, name: str, step: int) -> int | None:
        """The world size of the job that saved a step on S3: its marker's (``CommitMarker.
        world_size_of``), the namespace's for a step the library wrote itself; None when that
        cannot be told (no target, S3 unreachable, a marker that is not one)."""
        target = self.target
        if target is None:
            return None
        try:
            objects = await self._client(target)
            raw = await self._run(lambda: objects.get(target.bucket, target.marker_key(name, step)))
        except S3Unavailable as exc:
            log.warning("cannot read the marker of step %d of %r: %s", step, name, exc)
            return None
        if raw is None:  # the library's own write: its job's world size (1 in a one-rank namespace)
            size = await self._world_size(name)
            return 1 if size is None else size
        try:
            return CommitMarker.world_size_of(raw)
        except (ValueError, KeyError, TypeError):
            return None

    async def _world_size(self, name: str) -> int | None:
        """The trainer's world size of a namespace the control plane knows (its ranks less the
        metadata rank), or None."""
        try:
            namespace = await self._cluster.namespace(name)
        except Exception:
            return None
        return namespace.num_ranks - 1 if namespace.num_ranks >= 2 else None

    async def read_shard(self, key: ShardKey, *, checksum: str | None = None) -> tuple[bytes, str] | None:
        """A shard's bytes and checksum from S3, verified against its step's marker; None if S3
        has no committed good copy (with ``checksum``: none whose checksum that is)."""
        target = self.target
        if target is None:
            return None
        objects = await self._client(target)

        world_size = await self._world_size(key.namespace)

        def read() -> tuple[bytes, str] | None:
            raw = objects.get(target.bucket, target.marker_key(key.namespace, key.step))
            if raw is None:
                written = s3reads.read_trainer_written(objects, target, key, world_size)
                return None if written is None or checksum not in (None, written[1]) else written
            shard = CommitMarker.shard_of(raw, key.rank)
            if shard is None or (checksum is not None and shard.checksum != checksum):
                return None
            data = objects.get_verified(target.bucket, shard)
            return None if data is None else (data, shard.checksum)

        try:
            found = await self._run(read)
        except (S3Unavailable, ValueError, KeyError, TypeError) as exc:
            log.warning("S3 read of %s failed: %s", key, exc)
            return None
        if found is not None:
            self.counters.fallback_reads_total += 1
        return found

    # ------------------------------------------------------------------ drain

    async def drain(self, *, timeout_s: float, reason: str) -> list[str]:
        """Persist the newest complete step of each namespace this node holds primaries of, if S3
        does not hold it yet, within ``timeout_s``. Returns (and reports) what could not be."""
        target = self.target
        if target is None:
            return []
        names = sorted({s.key.namespace for s in self.store.shards() if s.replica_of is None})
        deadline = self._clock.monotonic() + timeout_s
        problems: list[str] = []
        for name in names:
            step: int | None = None
            try:
                complete = await asyncio.wait_for(
                    catalog.cluster_complete_steps(self._cluster, self.store, name), self._left(deadline)
                )
                if not complete:
                    continue
                step = complete[0]
                committed = await asyncio.wait_for(self.committed_steps(name), self._left(deadline))
                if committed and committed[0] >= step:
                    continue
                await asyncio.wait_for(self.persist_step(name, step), self._left(deadline))
                log.warning("drain (%s): step %d of %r persisted to S3", reason, step, name)
            except Exception as exc:
                what = "the newest complete step" if step is None else f"step {step}"
                problem = (
                    f"node {self._state.node_id} could not persist {what} of namespace {name!r} to "
                    f"{target.base_uri} before stopping ({reason}): {type(exc).__name__}: {exc}"
                )
                problems.append(problem)
        for problem in problems:
            self.counters.drain_failures_total += 1
            self.counters.last_error = problem[:500]
            log.error("%s", problem)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._cluster.report_event("Error", problem[:2048]), 5.0)
        return problems

    def _left(self, deadline: float) -> float:
        return max(deadline - self._clock.monotonic(), 0.001)


# How much lower than the agent's event loop (nice 0) S3 work runs. Linux gives each thread its own
# nice value and a thread inherits its creator's, so s3transfer's part threads, started from these
# workers, run niced too: a save the event loop receives gets the CPU first while uploads run.
UPLOAD_NICE = 10


def _lower_priority() -> None:
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), UPLOAD_NICE)
