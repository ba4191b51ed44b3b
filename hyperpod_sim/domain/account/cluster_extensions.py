"""Cluster extensions (Create/Describe/List/Update/DeleteClusterExtension(s),
ListClusterExtensionVersions): software HyperPod installs on every node of a Slurm cluster in
continuous provisioning mode, such as sagemaker-observability.

hyperpod-sim installs nothing: an extension is stored, validated and returned, and its status
follows the nodes (Creating or Updating until every live node is Running, then Active;
NodeSummary counts them). Versions come from hyperpod-sim's own small catalog (``CATALOG``),
not from HyperPod's; a configuration must be a JSON object, and its settings are not checked
against the extension's definition, which only HyperPod has (docs/cluster-operations.md).

Rules kept as HyperPod documents them: a Slurm cluster with NodeProvisioningMode Continuous, one
extension of a name per cluster (ResourceInUse), no update to an earlier version, an update's
ConfigurationValues merged into the current ones (a null removes a setting), a ClientToken
repeated within 8 hours with the same parameters answers the first request's extension (unless
it was deleted since) and with others fails (domain/client_tokens.py).
Deleting removes the extension at once (nothing is left on the nodes to remove).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from hyperpod_sim.domain import client_tokens
from hyperpod_sim.domain.account.resources import AccountResourceService, created_between
from hyperpod_sim.domain.errors import ConflictException, ResourceInUse, ResourceNotFound, ValidationException
from hyperpod_sim.domain.lifecycle import LIVE, NodeStatus
from hyperpod_sim.domain.pages import Page, paginate
from hyperpod_sim.models import Cluster, ClusterExtension, Node
from hyperpod_sim.models.values import WireValue

# Extension name -> versions offered, highest first (hyperpod-sim's numbering).
CATALOG: dict[str, tuple[str, ...]] = {
    "sagemaker-observability": ("1.1.0", "1.0.0"),
}
ACTIVE = "Active"
OPERATION = "CreateClusterExtension"


class _Made(WireValue):
    """What a CreateClusterExtension's ClientToken remembers of its answer: the extension it made."""

    extension_id: str


@dataclass(frozen=True)
class ExtensionState:
    row: ClusterExtension
    cluster_arn: str
    status: str
    total_nodes: int
    active_nodes: int


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def _check_offered(name: str, version: str) -> None:
    offered = CATALOG.get(name, ())
    if version not in offered:
        raise ValidationException(
            f"Version {version} of extension '{name}' is not offered; available versions: "
            f"{', '.join(offered)}."
        )


def _configuration(text: str | None) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ValidationException("ConfigurationValues must be a JSON object serialized as a string.")
    return value


class ExtensionService(AccountResourceService):
    def _cluster(self, session: Session, arn: str) -> Cluster:
        cluster = session.scalars(select(Cluster).where(Cluster.arn == arn)).one_or_none()
        if cluster is None:
            raise ResourceNotFound(f"Cluster '{arn}' does not exist.")
        return cluster

    def _extension(self, session: Session, cluster: Cluster, arn: str) -> ClusterExtension:
        row = session.scalars(
            select(ClusterExtension).where(
                ClusterExtension.arn == arn, ClusterExtension.cluster_id == cluster.id
            )
        ).one_or_none()
        if row is None:
            raise ResourceNotFound(f"Extension '{arn}' does not exist on cluster '{cluster.name}'.")
        return row

    def create(
        self,
        *,
        cluster_arn: str,
        name: str,
        version: str | None = None,
        configuration_values: str | None = None,
        tags: list[dict[str, str]] | None = None,
        client_token: str | None = None,
    ) -> ClusterExtension:
        offered = CATALOG.get(name)
        if offered is None:
            raise ValidationException(
                f"Extension '{name}' is not offered; available extensions: {', '.join(sorted(CATALOG))}."
            )
        if version is not None:
            _check_offered(name, version)
        configuration = _configuration(configuration_values)
        now = self.clock.now()
        with self.db.write() as session:
            cluster = self._cluster(session, cluster_arn)
            parameters = {
                "ExtensionName": name,
                "ExtensionVersion": version or offered[0],
                "ConfigurationValues": configuration,
            }
            earlier = client_tokens.earlier(
                session,
                cluster=cluster,
                operation=OPERATION,
                token=client_token,
                parameters=parameters,
                now=now,
                mismatch=ConflictException,
            )
            if earlier is not None:
                made = session.get(ClusterExtension, _Made.from_wire(earlier.result).extension_id)
                if made is not None:
                    return made
                client_tokens.forget(session, earlier)  # deleted since: the token makes a new one
            if not cluster.orchestrator or "Slurm" not in cluster.orchestrator:
                raise ValidationException(
                    f"Cluster '{cluster.name}' is not orchestrated by Slurm; extensions are available only "
                    "on Slurm-orchestrated clusters."
                )
            if not cluster.extra.continuous:
                raise ValidationException(
                    f"Cluster '{cluster.name}' does not use NodeProvisioningMode Continuous, which "
                    "extensions require."
                )
            taken = session.scalars(
                select(ClusterExtension).where(
                    ClusterExtension.cluster_id == cluster.id, ClusterExtension.name == name
                )
            ).one_or_none()
            if taken is not None:
                raise ResourceInUse(f"Extension '{name}' is already installed on cluster '{cluster.name}'.")
            extension_id = self.ids.cluster_id()
            row = ClusterExtension(
                id=extension_id,
                arn=self.arn(f"extension/{name}/{cluster.id}/{extension_id}"),
                cluster_id=cluster.id,
                name=name,
                version=version or offered[0],
                configuration=configuration,
                phase="Creating",
                creation_time=now,
                last_modified_time=now,
                tags=tags or [],
            )
            session.add(row)
            client_tokens.remember(
                session,
                cluster=cluster,
                operation=OPERATION,
                token=client_token,
                parameters=parameters,
                result=_Made(extension_id=extension_id).wire(),
                now=now,
            )
        return row

    def update(
        self,
        *,
        cluster_arn: str,
        arn: str,
        version: str | None = None,
        configuration_values: str | None = None,
    ) -> ClusterExtension:
        changes = _configuration(configuration_values)
        with self.db.write() as session:
            cluster = self._cluster(session, cluster_arn)
            row = self._extension(session, cluster, arn)
            if version is not None:
                _check_offered(row.name, version)
                if _version_key(version) < _version_key(row.version):
                    raise ValidationException(
                        f"Extension '{row.name}' runs version {row.version}; it cannot be updated to the "
                        f"earlier {version} (delete it and create it again with that version)."
                    )
                row.version = version
            if changes is not None:
                merged = {**(row.configuration or {}), **changes}
                row.configuration = {key: value for key, value in merged.items() if value is not None}
            row.phase = "Updating"
            row.last_modified_time = self.clock.now()
        return row

    def delete(self, *, cluster_arn: str, arn: str) -> str:
        with self.db.write() as session:
            cluster = self._cluster(session, cluster_arn)
            session.delete(self._extension(session, cluster, arn))
        return arn

    def describe(self, *, cluster_arn: str, arn: str) -> ExtensionState:
        with self.db.read() as session:
            cluster = self._cluster(session, cluster_arn)
            row = self._extension(session, cluster, arn)
            return self._state(session, cluster, row)

    def _state(self, session: Session, cluster: Cluster, row: ClusterExtension) -> ExtensionState:
        statuses = list(
            session.scalars(select(Node.status).where(Node.cluster_id == cluster.id, Node.status.in_(LIVE)))
        )
        running = sum(1 for status in statuses if status == NodeStatus.RUNNING)
        # Active once every node the groups want is up: a Continuous cluster adds its nodes after
        # CreateCluster answers, so "no live node yet" is not "all of them running".
        wanted = sum(group.target_count for group in cluster.instance_groups)
        status = ACTIVE if running == len(statuses) and running >= wanted else row.phase
        return ExtensionState(row, cluster.arn, status, len(statuses), running)

    def list(
        self,
        *,
        cluster_arn: str,
        creation_time_after: datetime | None = None,
        creation_time_before: datetime | None = None,
        max_results: int | None = None,
        next_token: str | None = None,
    ) -> Page[ExtensionState]:
        with self.db.read() as session:
            cluster = self._cluster(session, cluster_arn)
            query = select(ClusterExtension).where(ClusterExtension.cluster_id == cluster.id)
            query = query.where(
                *created_between(ClusterExtension.creation_time, creation_time_after, creation_time_before)
            )
            query = query.order_by(ClusterExtension.creation_time.asc(), ClusterExtension.name.asc())
            found = [self._state(session, cluster, row) for row in session.scalars(query)]
        return paginate(found, max_results=max_results, token=next_token, scope=f"extensions:{cluster.id}")


def versions(*, name: str, max_results: int | None = None, next_token: str | None = None) -> Page[str]:
    """The versions of ``name`` on offer, highest first; none for a name not offered."""
    return paginate(
        list(CATALOG.get(name, ())), max_results=max_results, token=next_token, scope=f"versions:{name}"
    )
