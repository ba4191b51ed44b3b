"""Fakes for the service-level tests (tests/test_services_*.py): the domain services built
directly, on a real SQLite database made by the migrations, with a manual clock and a provisioner
that starts nothing and answers what the test says. No HTTP, no processes."""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import selectinload

from hyperpod_sim.domain.checkpoints.cluster_policy import S3Endpoint
from hyperpod_sim.domain.clock import Ids
from hyperpod_sim.domain.clusters.service import ClusterService, DomainConfig
from hyperpod_sim.domain.reconciler import Reconciler, ReconcilerConfig
from hyperpod_sim.models import Cluster, ClusterEvent, Database, Node
from tests.conftest import ManualClock


@dataclass
class FakeProvisioner:
    """A provisioner (domain.provisioning.Provisioner) that records what it is asked; the test
    sets which agents run, have exited or have stopped."""

    uses_agents: bool = False
    owns_agents: bool = False
    ready: bool = True  # simulated mode: every launch delay has passed
    launched: list[str] = field(default_factory=list)
    terminated: list[str] = field(default_factory=list)
    unlaunched: list[str] = field(default_factory=list)
    still_running: set[str] = field(default_factory=set)  # ShuttingDown nodes whose agent lingers
    exited: set[str] = field(default_factory=set)
    adoptable: set[str] = field(default_factory=set)
    adopt_calls: list[tuple[set[str], set[str]]] = field(default_factory=list)
    # What the next launches raise, in turn (an agent command that cannot be spawned).
    launch_errors: list[OSError] = field(default_factory=list)
    # Called by each launch, inside the reconciler's launch transaction (a database that goes away).
    on_launch: Callable[[], object] | None = None

    def launch(self, cluster: Cluster, node: Node) -> bool:
        self.launched.append(node.id)
        if self.on_launch is not None:
            self.on_launch()
        if self.launch_errors:
            raise self.launch_errors.pop(0)
        return self.owns_agents

    def unlaunch(self, node_id: str) -> None:
        self.unlaunched.append(node_id)

    def terminate(self, node: Node) -> None:
        self.terminated.append(node.id)

    def has_stopped(self, node: Node) -> bool:
        return node.id not in self.still_running

    def adopt_agents(self, *, live: Collection[str], unregistered: Collection[str] = ()) -> set[str] | None:
        self.adopt_calls.append((set(live), set(unregistered)))
        return self.adoptable & set(live) if self.owns_agents else None

    def stop_agents(self, *, hurry: threading.Event | None = None) -> list[str]:
        return []

    def is_ready(self, node: Node, now: datetime) -> bool:
        return self.ready

    def reap(self) -> None:
        return None

    def exited_agents(self, node_ids: Collection[str]) -> set[str] | None:
        return self.exited & set(node_ids) if self.owns_agents else None

    def kill_agent(self, node: Node, *, wipe_memory: bool) -> list[int]:
        return []

    def pause_agent(self, node: Node) -> list[int]:
        return []

    def resume_agent(self, node: Node) -> list[int]:
        return []

    def partition_agent(self, node: Node, *, fault_id: str, until: float) -> list[int]:
        return []

    def heal_agent(self, node: Node) -> bool:
        return False


class CountingIds(Ids):
    """Ids in the order they are made, so that a test can name them."""

    def __init__(self) -> None:
        self._count = 0

    def _next(self) -> int:
        self._count += 1
        return self._count

    def cluster_id(self) -> str:
        return f"c{self._next():011d}"

    def node_id(self) -> str:
        return f"i-{self._next():017x}"


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    database = Database(f"sqlite:///{tmp_path / 'services.db'}")
    database.migrate()
    yield database
    database.dispose()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def ids() -> CountingIds:
    return CountingIds()


def cluster_service(db: Database, clock: ManualClock, ids: Ids, **config: int) -> ClusterService:
    limits = {"max_instances_per_cluster": 16, "max_clusters": 3, **config}
    return ClusterService(
        db=db,
        clock=clock,
        ids=ids,
        config=DomainConfig(account_id="123456789012", region="us-east-1", **limits),
    )


def reconciler_config(**overrides: float | bool) -> ReconcilerConfig:
    config = ReconcilerConfig(
        interval_s=1.0,
        node_ready_delay_s=0.0,
        heartbeat_timeout_s=10.0,
        launch_timeout_s=30.0,
        memory_scale=1.0,
        s3_endpoint=S3Endpoint(url=None, region="us-east-1"),
        push_workers=2,
        push_timeout_s=1.0,
        push_backoff_s=1.0,
        push_backoff_max_s=8.0,
    )
    return replace(config, **overrides)


def make_reconciler(
    db: Database, clock: ManualClock, ids: Ids, provisioner: FakeProvisioner, **overrides: float | bool
) -> Reconciler:
    return Reconciler(
        db=db, clock=clock, ids=ids, provisioner=provisioner, config=reconciler_config(**overrides)
    )


def load(db: Database, name: str) -> Cluster:
    """The cluster with its groups and nodes, detached (for assertions)."""
    with db.read() as session:
        cluster = session.scalars(
            select(Cluster)
            .where(Cluster.name == name)
            .options(selectinload(Cluster.instance_groups), selectinload(Cluster.nodes))
        ).one()
        session.expunge_all()
        return cluster


def descriptions(db: Database, name: str) -> list[str]:
    """The cluster's event descriptions, oldest first."""
    with db.read() as session:
        cluster_id = session.scalars(select(Cluster.id).where(Cluster.name == name)).one()
        return list(
            session.scalars(
                select(ClusterEvent.description)
                .where(ClusterEvent.cluster_id == cluster_id)
                .order_by(ClusterEvent.event_time, ClusterEvent.id)
            )
        )
