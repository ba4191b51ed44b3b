"""The namespace index: which node holds which (namespace, rank, step), kept by two agents per
namespace (its homes) so that ``latest``, reads that miss locally and deletes ask one of them
instead of every agent of the cluster (docs/memory-tier.md, "The namespace index").

- **Homes**: the two members of highest rendezvous weight for the namespace
  (:func:`agents.catalog.homes`) over the member list this agent knows, itself included.
- **Reports**: whenever a shard of a namespace comes or goes here (the store's watch), this agent
  sends the homes its whole index of the namespace (a ``ShardIndex`` with an increasing ``seq``),
  at most one report in flight per namespace, the latest image winning; a report that fails is
  retried with backoff for a while (a home that restarts asks everyone anyway).
- **Views**: a home keeps each member's latest image (:class:`agents.catalog.HomeView`), tagged
  with the member set it arrived under. A view not yet made whole for the current member set asks
  the members whose image it lacks, or holds from under another set, for their index, once;
  after that, answers cost no request.
- **Questions**: the complete steps, and who holds a (rank, step). ``ask`` tries the first home,
  then the second; None when neither answers, and the caller falls back to asking everyone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from hyperpod_sim.agents import catalog
from hyperpod_sim.agents.cluster import ClusterView
from hyperpod_sim.agents.http.client import HttpError
from hyperpod_sim.agents.retry import Backoff
from hyperpod_sim.agents.store import ShardStore
from hyperpod_sim.agents.tiermodel import TierError
from hyperpod_sim.contracts.agent_api import (
    INTERNAL_CATALOG_ROUTE,
    INTERNAL_HOLDERS_ROUTE,
    INTERNAL_INDEX_ROUTE,
    agent_path,
)
from hyperpod_sim.contracts.agent_bodies import (
    AgentBody,
    CatalogImages,
    CatalogReported,
    CatalogSteps,
    ShardIndex,
    StepHolders,
    problem_of,
)

log = logging.getLogger("hyperpod_sim.agents.tier")

B = TypeVar("B", bound=AgentBody)

# A report that a home did not take is sent again after these waits, then left to the home's own
# rebuild (a home that was down asks every agent for its index when it is asked next).
REPORT_RETRY_INITIAL_S = 0.2
REPORT_RETRY_MAX_S = 10.0
REPORT_ATTEMPTS = 20
# A save waits this long at most for its report to reach the homes before it is answered.
SETTLE_TIMEOUT_S = 5.0
# The waits before each try of a started agent's reading of the cluster's namespaces.
ANNOUNCE_WAITS_S = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0)


class CatalogCounters:
    def __init__(self) -> None:
        self.reports_sent_total = 0  # images sent to a home (this node's own home included)
        self.report_failures_total = 0
        self.reports_received_total = 0  # images received as a home
        self.answers_total = 0  # questions answered as a home
        self.rebuilds_total = 0  # views made whole by asking agents for their index
        self.index_answers_total = 0  # GET /v1/internal/index answered (someone's fan-out)
        self.fallbacks_total = 0  # questions no home answered: the caller asked everyone


class NamespaceIndex:
    """This agent's side of the namespace index: its reports to the homes, the views it keeps as
    a home, and the questions it asks them."""

    def __init__(
        self, *, cluster: ClusterView, store: ShardStore, spawn: Callable[[Awaitable[None]], None]
    ) -> None:
        self.cluster = cluster
        self.store = store
        self._spawn = spawn
        self.counters = CatalogCounters()
        self._last_seq = 0
        self._started = False
        # Reports: namespace -> changes seen, changes whose report was attempted / landed.
        self._version: dict[str, int] = {}
        self._tried: dict[str, int] = {}
        self._reporting: set[str] = set()
        # Set by a change while the report task waits to retry: it tries again at once (a save
        # waits on its report's attempt, never on a backoff meant for the previous one).
        self._wake: dict[str, asyncio.Event] = {}
        self._settled = asyncio.Condition()
        # Views kept as a home.
        self._views: dict[str, catalog.HomeView] = {}
        self._building: dict[str, asyncio.Lock] = {}

    @property
    def node_id(self) -> str:
        return self.cluster.state.node_id or ""

    def start(self) -> None:
        """Watch the store (from now on every change is reported) and report what it holds now
        (shards adopted at a restart). Once: later calls do nothing."""
        if self._started:
            return
        self._started = True
        loop = asyncio.get_running_loop()

        def changed(namespace: str) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closing: nobody left to tell
                loop.call_soon_threadsafe(self.touch, namespace)

        self.store.watch(changed)
        held = {info.key.namespace for info in self.store.shards()}
        for namespace in held:
            self.touch(namespace)
        self._spawn(self._announce(held))

    async def _announce(self, held: set[str]) -> None:
        """Report this node's image of every other namespace of the cluster too: empty. An agent
        started with empty memory (a reboot, a lost node's agent started again) holds nothing of
        what its predecessor held, and without a report of its own the homes would keep the
        predecessor's image, and list copies that are gone."""
        for wait_s in ANNOUNCE_WAITS_S:
            await asyncio.sleep(wait_s)
            try:
                response = await self.cluster.control_plane("GET", "/namespaces")
                names = [str(doc["namespace"]) for doc in response.json()["namespaces"]]
            except (TierError, ValueError, KeyError, TypeError) as exc:
                log.info("the cluster's namespaces could not be read for the index: %s", exc)
                continue
            for name in names:
                if name not in held:
                    self.touch(name)
            return
        log.warning("the homes were not told what this node holds: the namespaces could not be read")

    # ------------------------------------------------------------------ images and reports

    def image(self, namespace: str) -> ShardIndex:
        """This node's index of ``namespace`` now, numbered above every earlier one (wall-clock
        nanoseconds, so a restarted agent's images still come after its predecessor's)."""
        self._last_seq = max(self._last_seq + 1, time.time_ns())
        index = catalog.local_index(self.store.shards(namespace), self.cluster.state.node_id)
        return index.model_copy(update={"seq": self._last_seq})

    def touch(self, namespace: str) -> None:
        """What this node holds of ``namespace`` changed: report it to the homes (coalesced)."""
        self._version[namespace] = self._version.get(namespace, 0) + 1
        wake = self._wake.get(namespace)
        if wake is not None:
            wake.set()
        if namespace not in self._reporting and self.cluster.state.node_id:
            self._reporting.add(namespace)
            self._spawn(self._report(namespace))

    async def settle(self, namespace: str, *, timeout_s: float = SETTLE_TIMEOUT_S) -> None:
        """Wait until a report of what this node holds of ``namespace`` now has been tried with
        every home (landed, or failed once: then it is retried in the background), so that a save
        or a delete answered is seen by the next ``latest`` through any agent."""
        target = self._version.get(namespace, 0)
        if self._tried.get(namespace, 0) >= target:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s), self._settled:
                await self._settled.wait_for(lambda: self._tried.get(namespace, 0) >= target)

    async def _report(self, namespace: str) -> None:
        backoff = Backoff(initial_s=REPORT_RETRY_INITIAL_S, max_s=REPORT_RETRY_MAX_S)
        failures = 0
        try:
            while True:
                version = self._version[namespace]
                landed = await self._send(namespace)
                async with self._settled:
                    self._tried[namespace] = max(self._tried.get(namespace, 0), version)
                    self._settled.notify_all()
                if landed:
                    failures = 0
                    backoff.reset()
                    if self._version[namespace] == version:
                        return
                    continue
                failures += 1
                if failures >= REPORT_ATTEMPTS and self._version[namespace] == version:
                    log.warning("the homes of %r did not take this node's index; they rebuild it", namespace)
                    return
                if self._version[namespace] != version:
                    continue  # changed meanwhile: a save waits on this attempt
                wake = self._wake.setdefault(namespace, asyncio.Event())
                wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), backoff.next_delay())
        except TierError as exc:  # no member list (the control plane never answered)
            log.info("this node's index of %r was not reported: %s", namespace, exc)
            async with self._settled:  # nobody waits for a report that cannot be sent
                self._tried[namespace] = self._version[namespace]
                self._settled.notify_all()
        finally:
            self._reporting.discard(namespace)
            self._wake.pop(namespace, None)

    async def _send(self, namespace: str) -> bool:
        """This node's image of ``namespace`` to each of its homes; whether every one took it."""
        members = await self.cluster.recent_members()
        image = self.image(namespace)
        body = image.model_dump_json().encode()
        path = agent_path(INTERNAL_CATALOG_ROUTE, namespace=namespace)

        async def one(home: str) -> bool:
            self.counters.reports_sent_total += 1
            if home == self.node_id:
                self.receive(namespace, image)
                return True
            try:
                response = await self.cluster.peers.put(
                    f"{members[home]}{path}",
                    content=body,
                    headers={**self.cluster.token_header(), "Content-Type": "application/json"},
                )
            except HttpError as exc:
                log.info("home %s of %r did not take this node's index: %s", home, namespace, exc)
                self.counters.report_failures_total += 1
                return False
            if response.status_code != 200:
                self.counters.report_failures_total += 1
                return False
            return True

        results = await asyncio.gather(*(one(h) for h in catalog.homes(namespace, self.cluster.member_ids)))
        return all(results)

    # ------------------------------------------------------------------ as a home

    def receive(self, namespace: str, image: ShardIndex) -> CatalogReported:
        """A member's report: its whole index of ``namespace``."""
        if image.node_id is None:
            raise TierError(400, "InvalidReport", "a report names the node whose index it is")
        self.counters.reports_received_total += 1
        view = self._views.setdefault(namespace, catalog.HomeView())
        return CatalogReported(kept=view.offer(image, self.cluster.member_ids))

    def forget(self, namespace: str | None = None) -> None:
        """The namespace (None: every one) was deleted: its views go."""
        if namespace is None:
            self._views.clear()
        else:
            self._views.pop(namespace, None)

    async def _view(self, namespace: str) -> catalog.HomeView:
        """The view of a namespace this agent is a home of, made whole first if it is not for the
        current member set: TierError 421 ``NotHome`` when it is not a home of it."""
        await self.cluster.recent_members()
        everyone = self.cluster.member_ids
        if self.node_id not in catalog.homes(namespace, everyone):
            raise TierError(421, "NotHome", f"this agent is not a home of namespace {namespace!r}")
        view = self._views.setdefault(namespace, catalog.HomeView())
        if view.warm_for is not everyone:
            async with self._building.setdefault(namespace, asyncio.Lock()):
                if view.warm_for is not everyone:
                    await self._rebuild(namespace, view, everyone)
        self.counters.answers_total += 1
        return view

    async def _rebuild(self, namespace: str, view: catalog.HomeView, everyone: frozenset[str]) -> None:
        """Make the view whole for ``everyone``: the images that arrived under this member set are
        kept as they are (each report is a node's whole index, and every change is reported to
        the homes of the set the node knows); the members whose image is missing, or arrived under
        another set (a report sent meanwhile may have gone to other homes), are asked for their
        index. After a save by every node of a cluster, a new namespace's first question asks
        nobody."""
        view.offer(self.image(namespace), everyone)
        unknown = [n for n in view.unknown(everyone) if n != self.node_id]
        if unknown:
            self.counters.rebuilds_total += 1
            path = agent_path(INTERNAL_INDEX_ROUTE, namespace=namespace)
            for node_id, response in await self.cluster.fan_out("GET", path, only=unknown):
                index = catalog.peer_index(response)
                if index is not None and index.node_id == node_id:
                    view.offer(index, everyone)
        view.retain(everyone)
        view.warm_for = everyone

    async def steps_here(self, namespace: str, num_ranks: int) -> CatalogSteps:
        sizes = (await self._view(namespace)).steps(num_ranks)
        return CatalogSteps(steps=tuple(sizes), world_sizes=sizes)

    async def images_here(self, namespace: str) -> CatalogImages:
        view = await self._view(namespace)
        return CatalogImages(images=tuple(view.images[n] for n in sorted(view.images)))

    async def holders_here(self, namespace: str, step: int, rank: int | None) -> StepHolders:
        primary, replica = (await self._view(namespace)).holders(step, rank)
        return StepHolders(primary=primary, replica=replica)

    # ------------------------------------------------------------------ asking the homes

    async def _ask(
        self,
        namespace: str,
        path: str,
        params: dict[str, str],
        parse: type[B],
        here: Callable[[], Awaitable[B]],
    ) -> B | None:
        """A question to the first home of ``namespace`` that answers it; None if none does."""
        await self.settle(namespace)  # this node's own latest changes first
        members = await self.cluster.recent_members()
        for home in catalog.homes(namespace, self.cluster.member_ids):
            if home == self.node_id:
                try:
                    return await here()
                except TierError as exc:
                    log.info("this agent could not answer as a home of %r: %s", namespace, exc.message)
                    continue
            try:
                response = await self.cluster.peers.get(
                    f"{members[home]}{path}", params=params, headers=self.cluster.token_header()
                )
            except HttpError as exc:
                log.info("home %s of %r did not answer: %s", home, namespace, exc)
                continue
            if response.status_code != 200:
                continue
            try:
                return parse.parse(response.content)
            except ValueError as exc:
                log.warning("home %s answered off the contract: %s", home, problem_of(exc))
        self.counters.fallbacks_total += 1
        return None

    async def steps(self, namespace: str, num_ranks: int) -> dict[int, int] | None:
        """The complete steps of ``namespace`` with their world sizes, newest first, from a home;
        None when no home answered."""
        answer = await self._ask(
            namespace,
            agent_path(INTERNAL_CATALOG_ROUTE, namespace=namespace),
            {"num_ranks": str(num_ranks)},
            CatalogSteps,
            lambda: self.steps_here(namespace, num_ranks),
        )
        return None if answer is None else dict(answer.world_sizes)

    async def holders(self, namespace: str, step: int, rank: int | None = None) -> list[str] | None:
        """The other nodes that hold ``rank`` of ``step`` (None: any rank of it), own copies first,
        then replicas; None when no home answered."""
        params = {} if rank is None else {"rank": str(rank)}
        answer = await self._ask(
            namespace,
            agent_path(INTERNAL_HOLDERS_ROUTE, namespace=namespace, step=step),
            params,
            StepHolders,
            lambda: self.holders_here(namespace, step, rank),
        )
        if answer is None:
            return None
        return [n for n in dict.fromkeys((*answer.primary, *answer.replica)) if n != self.node_id]
