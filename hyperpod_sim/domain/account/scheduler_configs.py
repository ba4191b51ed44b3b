"""Cluster scheduler configs: the cluster policy of HyperPod task governance
(Create/Describe/List/Update/DeleteClusterSchedulerConfig).

On HyperPod the policy configures the task-governance add-on (Kueue) of an EKS cluster: priority
classes, fair share, lending idle compute. hyperpod-sim runs no Kubernetes scheduler, so a policy
is stored, validated, versioned and returned, and does nothing to the nodes: its status is
``Created`` (``Updated`` after an update) at once, each component's status in StatusDetails
likewise (docs/cluster-operations.md).

Rules kept: one policy per cluster (a second is ConflictException), an EKS-orchestrated cluster
(task governance is EKS only), an update names the version it updates (``TargetVersion``: the
current one, or ConflictException) and makes the next; Describe returns any version.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select

from hyperpod_sim.domain.account.resources import AccountResourceService, created_between
from hyperpod_sim.domain.errors import ConflictException, ResourceNotFound, ValidationException
from hyperpod_sim.domain.pages import Page, paginate
from hyperpod_sim.models import Cluster, ClusterSchedulerConfig
from hyperpod_sim.models.groups import SchedulerVersion

CREATED = "Created"
UPDATED = "Updated"


@dataclass(frozen=True)
class SchedulerConfigVersion:
    """One version of a policy, with the row it belongs to (detached)."""

    row: ClusterSchedulerConfig
    cluster_arn: str
    version: int
    scheduler_config: dict[str, Any]
    description: str | None

    @property
    def status_details(self) -> dict[str, str]:
        """Each component the version sets, with the policy's status."""
        return {component: self.row.status for component in self.scheduler_config}


class SchedulerConfigService(AccountResourceService):
    def create(
        self,
        *,
        name: str,
        cluster_arn: str,
        scheduler_config: dict[str, Any],
        description: str | None = None,
        tags: list[dict[str, str]] | None = None,
    ) -> ClusterSchedulerConfig:
        now = self.clock.now()
        with self.db.write() as session:
            cluster = session.scalars(select(Cluster).where(Cluster.arn == cluster_arn)).one_or_none()
            if cluster is None:
                raise ValidationException(f"Cluster '{cluster_arn}' does not exist.")
            if not cluster.orchestrator or "Eks" not in cluster.orchestrator:
                raise ValidationException(
                    f"Cluster '{cluster.name}' is not orchestrated by EKS; task governance (cluster "
                    "scheduler configs) is available only on EKS-orchestrated clusters."
                )
            existing = session.scalars(
                select(ClusterSchedulerConfig).where(ClusterSchedulerConfig.cluster_id == cluster.id)
            ).one_or_none()
            if existing is not None:
                raise ConflictException(
                    f"Cluster '{cluster.name}' already has a cluster scheduler config ({existing.id}); "
                    "a cluster has at most one."
                )
            config_id = self.ids.cluster_id()
            row = ClusterSchedulerConfig(
                id=config_id,
                arn=self.arn(f"cluster-scheduler-config/{config_id}"),
                name=name,
                cluster_id=cluster.id,
                status=CREATED,
                version=1,
                creation_time=now,
                last_modified_time=now,
                tags=tags or [],
                versions=[
                    SchedulerVersion(
                        version=1,
                        scheduler_config=scheduler_config,
                        description=description,
                        time=now.timestamp(),
                    )
                ],
            )
            session.add(row)
        return row

    def update(
        self,
        *,
        config_id: str,
        target_version: int,
        scheduler_config: dict[str, Any] | None = None,
        description: str | None = None,
    ) -> ClusterSchedulerConfig:
        now = self.clock.now()
        with self.db.write() as session:
            row = session.get(ClusterSchedulerConfig, config_id, with_for_update=True)
            if row is None:
                raise ResourceNotFound(f"Cluster scheduler config '{config_id}' does not exist.")
            if target_version != row.version:
                raise ConflictException(
                    f"TargetVersion {target_version} is not the current version of cluster scheduler "
                    f"config '{config_id}' ({row.version}); describe it and update that version."
                )
            latest = row.versions[-1]
            row.version += 1
            row.versions = [
                *row.versions,
                SchedulerVersion(
                    version=row.version,
                    scheduler_config=scheduler_config
                    if scheduler_config is not None
                    else latest.scheduler_config,
                    description=description if description is not None else latest.description,
                    time=now.timestamp(),
                ),
            ]
            row.status = UPDATED
            row.last_modified_time = now
        return row

    def describe(self, *, config_id: str, version: int | None = None) -> SchedulerConfigVersion:
        with self.db.read() as session:
            row = session.get(ClusterSchedulerConfig, config_id)
            if row is None:
                raise ResourceNotFound(f"Cluster scheduler config '{config_id}' does not exist.")
            wanted = row.version if version is None else version
            found = next((v for v in row.versions if v.version == wanted), None)
            if found is None:
                raise ResourceNotFound(
                    f"Cluster scheduler config '{config_id}' has no version {wanted}; its versions are "
                    f"1 to {row.version}."
                )
            cluster = session.get(Cluster, row.cluster_id)
            assert cluster is not None  # the config goes with its cluster
            return SchedulerConfigVersion(
                row=row,
                cluster_arn=cluster.arn,
                version=wanted,
                scheduler_config=found.scheduler_config,
                description=found.description,
            )

    def delete(self, *, config_id: str) -> None:
        with self.db.write() as session:
            row = session.get(ClusterSchedulerConfig, config_id, with_for_update=True)
            if row is None:
                raise ResourceNotFound(f"Cluster scheduler config '{config_id}' does not exist.")
            session.delete(row)

    def list(
        self,
        *,
        created_after: datetime | None = None,
        created_before: datetime | None = None,
        name_contains: str | None = None,
        cluster_arn: str | None = None,
        status: str | None = None,
        sort_by: str | None = None,
        sort_order: str | None = None,
        max_results: int | None = None,
        next_token: str | None = None,
    ) -> Page[tuple[ClusterSchedulerConfig, str]]:
        """(policy, its cluster's ARN), by CreationTime (default), Name or Status; newest first
        unless Ascending."""
        query = select(ClusterSchedulerConfig, Cluster.arn).join(Cluster)
        query = query.where(
            *created_between(ClusterSchedulerConfig.creation_time, created_after, created_before)
        )
        if name_contains:
            query = query.where(ClusterSchedulerConfig.name.contains(name_contains, autoescape=True))
        if cluster_arn:
            query = query.where(Cluster.arn == cluster_arn)
        if status:
            query = query.where(ClusterSchedulerConfig.status == status)
        key = {
            "Name": ClusterSchedulerConfig.name,
            "Status": ClusterSchedulerConfig.status,
        }.get(sort_by or "", ClusterSchedulerConfig.creation_time)
        ascending = sort_order == "Ascending"
        query = query.order_by(
            key.asc() if ascending else key.desc(),
            ClusterSchedulerConfig.id.asc() if ascending else ClusterSchedulerConfig.id.desc(),
        )
        with self.db.read() as session:
            found = [(row, arn) for row, arn in session.execute(query)]
        scope = f"scheduler-configs:{name_contains}:{cluster_arn}:{status}:{sort_by}:{sort_order}"
        return paginate(found, max_results=max_results, token=next_token, scope=scope)
