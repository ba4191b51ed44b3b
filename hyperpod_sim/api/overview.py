"""REST extension for consoles and dashboards: one answer per screen, and cheap polling.

``GET /overview`` summarizes every cluster; ``GET /clusters/{name}/overview`` is one cluster as a
console shows it: its summary, checkpoint policy, nodes in ring order (replica peers, memory held
vs budget, S3 lag), the checkpoint map with what a restore would read right now, the faults in
force and the newest events. Both carry an ``ETag``; a request with ``If-None-Match`` naming the
current one is answered ``304 Not Modified`` without a body. What the database knows is read on
every call (a few queries); what only the agents know (memory held, the checkpoint listing: a call
to every agent) is asked at most once per ``MAX_AGE_S`` per cluster whatever the number of pollers,
in the background, so any number of open consoles costs the agents what one does and a slow agent
delays no answer. The web console (hyperpod_sim/api/console_routes.py)
polls these every half second; docs/console.md has the numbers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

from fastapi import APIRouter, Request, Response
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, Field

from hyperpod_sim.api.deps import Services, ServicesDep
from hyperpod_sim.api.registry import dispatch
from hyperpod_sim.api.simulator_api import job_wire
from hyperpod_sim.domain.overview import OverviewConfig, OverviewService, restore_plan

log = logging.getLogger(__name__)
router = APIRouter(tags=["overview"])

MAX_AGE_S = 0.4
EVENTS_SHOWN = 100


class InstanceGroupCounts(BaseModel):
    InstanceGroupName: str
    InstanceType: str
    TargetCount: int
    CurrentCount: int


class OverviewClusterSummary(BaseModel):
    ClusterName: str
    ClusterArn: str
    ClusterStatus: str
    FailureMessage: str | None = None
    CreationTime: float = Field(description="Epoch seconds.")
    Orchestrator: str | None = Field(description="Eks, Slurm, or null.")
    NodeRecovery: str
    TieredStorageConfig: dict[str, Any] = Field(description='As stored: {"Mode": "Disable"} when off.')
    DesiredPolicyGeneration: int = Field(description="The cluster's policy generation.")
    AppliedPolicyGeneration: int = Field(
        description="The newest generation every node (but those shutting down) has applied."
    )
    NodeCounts: dict[str, int] = Field(description="Nodes by status (Pending, Running, Failure, ...).")
    InstanceGroups: list[InstanceGroupCounts]


class ClustersOverview(BaseModel):
    Clusters: list[OverviewClusterSummary]


class NodeView(BaseModel):
    InstanceId: str
    InstanceGroupName: str
    InstanceType: str
    Status: str
    StatusMessage: str | None = None
    RingPosition: int | None = Field(description="Place in the replica ring; null: not in it.")
    ReplicaPeers: list[str] = Field(description="The nodes that hold replicas of this node's shards.")
    Endpoint: str | None = Field(description="The agent's address.")
    AppliedPolicyGeneration: int
    MemoryBudgetBytes: int
    MemoryHeldBytes: int | None = Field(
        description="What the agent's tier holds; null: not asked or no answer."
    )
    S3LagSeconds: float | None = None
    S3PendingSteps: int | None = None
    LastError: str | None = None


class StepView(BaseModel):
    Step: int
    WorldSize: int | None = Field(
        default=None,
        description="The world size of the job that saved the step, when it is not the namespace's "
        "(NumRanks less the metadata rank): the SDK loads it resharded. Absent otherwise.",
    )
    Memory: dict[str, str] = Field(description="Rank -> the node holding its primary copy.")
    Replica: dict[str, list[str]] = Field(description="Rank -> the nodes holding a replica.")
    S3: bool = Field(description="Committed on S3.")
    S3WrittenBy: Literal["Trainer"] | None = Field(
        default=None,
        description="Trainer: the trainer wrote the step to S3 itself (the library's own S3 writes, no "
        "commit marker); absent for a step the agents committed, as in GET /clusters/{name}/checkpoints.",
    )
    Complete: bool


class RankSource(BaseModel):
    Tier: str = Field(description="Memory, Replica or S3.")
    InstanceId: str | None = None


class RestorePlan(BaseModel):
    Step: int = Field(description="The newest complete step.")
    Ranks: dict[str, RankSource]


class NamespaceView(BaseModel):
    Namespace: str
    NumRanks: int
    StepsRetained: int
    Steps: list[StepView] = Field(description="Newest first.")
    Restore: RestorePlan | None = Field(description="What a restore would read now; null: nothing complete.")


class ClusterOverview(OverviewClusterSummary):
    CheckpointPolicy: dict[str, Any] = Field(description="As GET /clusters/{name}/checkpoint-policy.")
    Nodes: list[NodeView]
    Checkpoints: list[NamespaceView]
    Unreachable: list[str] = Field(description="Running nodes whose agent did not answer.")
    Faults: list[dict[str, Any]] = Field(description="As GET /clusters/{name}/faults.")
    Jobs: list[dict[str, Any]] = Field(description="As GET /clusters/{name}/jobs: status, attempts, nodes.")
    Events: list[dict[str, Any]] = Field(description=f"The newest {EVENTS_SHOWN}, as ListClusterEvents.")


class _AgentViews:
    """What the agents answered for a cluster (memory held, the checkpoint listing), by cluster,
    reused for ``MAX_AGE_S``. Past that, the caller still gets it at once and one refresh starts in
    the background (one at a time per cluster): a slow or hung agent, or a slow S3 under an
    injected fault, never holds up the database's part of anyone's view. Only the first call for a
    cluster waits for its agents."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}
        self._views: dict[str, tuple[float, Any]] = {}

    def get(self, key: str, compute: Callable[[], Any]) -> Any:
        with self._lock:
            lock = self._locks.setdefault(key, threading.Lock())
        found = self._views.get(key)
        if found is not None:
            if time.monotonic() - found[0] >= MAX_AGE_S and lock.acquire(blocking=False):
                threading.Thread(
                    target=self._refresh, args=(key, compute, lock), name="overview-refresh", daemon=True
                ).start()
            return found[1]
        with lock:
            found = self._views.get(key)
            if found is None:
                found = self._views[key] = (time.monotonic(), compute())
            return found[1]

    def _refresh(self, key: str, compute: Callable[[], Any], lock: threading.Lock) -> None:
        try:
            self._views[key] = (time.monotonic(), compute())
        except Exception as exc:  # the next caller computes it again, and gets the error
            log.info("overview of %s not refreshed: %s", key, exc)
            self._views.pop(key, None)
        finally:
            lock.release()

    def forget(self, key: str) -> None:
        self._views.pop(key, None)


def _state(request: Request, services: Services) -> tuple[OverviewService, _AgentViews]:
    """The app's overview service and views, made on first use (the services they read are built
    in the app's lifespan)."""
    found: tuple[Services, OverviewService, _AgentViews] | None = getattr(request.app.state, "overview", None)
    if found is None or found[0] is not services:
        config = OverviewConfig(memory_scale=services.settings.simulation.memory_scale)
        found = (services, OverviewService(db=services.db, config=config), _AgentViews())
        request.app.state.overview = found
    return found[1], found[2]


def _answer(request: Request, view: Any) -> Response:
    """The view as JSON with its ETag, or 304 when ``If-None-Match`` names that ETag already."""
    body = json.dumps(view, separators=(",", ":"), default=str).encode()
    etag = '"' + hashlib.sha256(body).hexdigest()[:20] + '"'
    headers = {"ETag": etag, "Cache-Control": "no-cache"}
    if etag in (tag.strip() for tag in request.headers.get("if-none-match", "").split(",")):
        return Response(status_code=304, headers=headers)
    return Response(body, media_type="application/json", headers=headers)


_CONDITIONAL: dict[int | str, dict[str, Any]] = {
    304: {"description": "Not Modified: `If-None-Match` names the current ETag (no body)."},
    401: {"description": "Without credentials while auth is on (docs/security.md)."},
}


@router.get(
    "/overview",
    operation_id="GetOverview",
    summary="Every cluster, summarized (hyperpod-sim extension)",
    description="Status, orchestrator, tiered storage, policy generation applied vs desired, node "
    "counts by status and instance groups of every cluster, oldest first. Answers an ETag; send it "
    "back in `If-None-Match` to get 304 while nothing changed.",
    response_model=ClustersOverview,
    responses=_CONDITIONAL,
)
async def clusters_overview(request: Request, services: ServicesDep) -> Response:
    overview, _ = _state(request, services)
    clusters = await run_in_threadpool(overview.clusters)
    return _answer(request, {"Clusters": clusters})


def _cluster_view(services: Services, overview: OverviewService, agents: _AgentViews, name: str) -> Any:
    """The database's part, read on every call (a few queries), and the agents' part, shared."""
    view = overview.cluster(name=name)
    cluster = view["ClusterName"]

    def ask_agents() -> tuple[dict[str, int | None], Any]:
        return overview.memory_held(name=cluster), services.checkpoints.list_checkpoints(name=cluster)

    held, listing = agents.get(cluster, ask_agents)
    for node in view["Nodes"]:
        node["MemoryHeldBytes"] = held.get(node["InstanceId"])
    _, faults = services.faults.list_faults(name=cluster)
    _, jobs = services.jobs.list_jobs(name=cluster)
    events = dispatch(
        services,
        "ListClusterEvents",
        {"ClusterName": cluster, "SortOrder": "Descending", "MaxResults": EVENTS_SHOWN},
    )["Events"]
    return {
        **view,
        "Checkpoints": [{**ns.to_wire(), "Restore": restore_plan(ns)} for ns in listing.namespaces],
        "Unreachable": listing.unreachable,
        "Faults": [fault.wire() for fault in faults],
        "Jobs": [job_wire(job) for job in jobs],
        "Events": events,
    }


@router.get(
    "/clusters/{name}/overview",
    operation_id="GetClusterOverview",
    summary="One cluster as a console shows it (hyperpod-sim extension)",
    description="The cluster's summary (as in GET /overview), its checkpoint policy, its nodes in "
    "replica-ring order (replica peers, agent endpoint, applied generation, memory held vs budget, "
    "S3 lag, last error), the checkpoint map (GET /clusters/{name}/checkpoints, with the tier each "
    "rank of the newest complete step would be restored from), the faults in force and the newest "
    "events. Answers an ETag; `If-None-Match` with it gets 304 while nothing changed. The agents' "
    f"part (memory held, the checkpoint map) is asked at most every {MAX_AGE_S} s per cluster, "
    "whatever the number of callers.",
    response_model=ClusterOverview,
    responses={**_CONDITIONAL, 404: {"description": "ResourceNotFound"}},
)
async def cluster_overview(name: str, request: Request, services: ServicesDep) -> Response:
    overview, agents = _state(request, services)
    try:
        view = await run_in_threadpool(_cluster_view, services, overview, agents, name)
    except Exception:  # asked again next time; the app's handlers answer the error
        agents.forget(name)
        raise
    return _answer(request, view)
