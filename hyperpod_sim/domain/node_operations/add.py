"""BatchAddClusterNodes: more nodes in instance groups of a cluster with ``NodeProvisioningMode:
Continuous``, each answered with its ``NodeLogicalId`` at once (the model: "a safer alternative to
UpdateCluster for scaling operations").

The nodes are made in the request's transaction (Pending, with their logical ids, the group's
target count raised by as many); the reconciler starts their agents (``node_operations.LAUNCH``).
The cluster stays InService: in continuous provisioning nodes come and go without a cluster update.
A request that adds nodes records a ``Scaling`` operation over the groups it grew (their counts
before and the targets after), Done once none of its nodes is Pending (domain/operation_records.py).
Per group, what cannot be added is answered in ``Failed`` with the model's error codes.

``ClientToken`` (domain/client_tokens.py): a retry with the same token and NodesToAdd within 8
hours adds nothing and answers the first request's ``Successful`` and ``Failed``, each added
node with its status now (``NotFound`` once it is gone); the same token with other NodesToAdd is
a ValidationException (the model lists no error of its own for it: ResourceNotFound and
ResourceLimitExceeded only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hyperpod_sim.domain import client_tokens, events
from hyperpod_sim.domain import operation_records as operations
from hyperpod_sim.domain.cluster_reads import locked_cluster
from hyperpod_sim.domain.clusters import rules as cluster_rules
from hyperpod_sim.domain.errors import ValidationException
from hyperpod_sim.domain.lifecycle import MUTABLE, GroupStatus, NodeStatus, bump_generation
from hyperpod_sim.domain.node_operations.reboot_replace import LAUNCH
from hyperpod_sim.domain.nodes.node_set import NO_ADDRESSES, NodeAddresses, new_node
from hyperpod_sim.domain.service import DomainService
from hyperpod_sim.models import Cluster, InstanceGroup
from hyperpod_sim.models.node_sets import (
    AddClusterNodeSpecification,
    Additions,
    BatchAddClusterNodesError,
    NodeAdditionResult,
)

MAX_NODES_PER_REQUEST = 50
OPERATION = "BatchAddClusterNodes"


@dataclass(kw_only=True, eq=False)
class AddNodesService(DomainService):
    """Keyword-only arguments; raise AwsError subclasses; no HTTP."""

    region: str
    max_instances: int
    addresses: NodeAddresses = NO_ADDRESSES

    def batch_add(
        self, *, name: str, nodes_to_add: list[AddClusterNodeSpecification], client_token: str | None = None
    ) -> Additions:
        total = sum(spec.increment_target_count_by for spec in nodes_to_add)
        if total > MAX_NODES_PER_REQUEST:
            raise ValidationException(
                f"NodesToAdd adds {total} nodes; at most {MAX_NODES_PER_REQUEST} can be added in one request."
            )
        successful: list[NodeAdditionResult] = []
        failed: list[BatchAddClusterNodesError] = []
        with self.db.write() as session:
            cluster = locked_cluster(session, name)
            now = self.clock.now()
            parameters = {"NodesToAdd": [spec.wire() for spec in nodes_to_add]}
            earlier = client_tokens.earlier(
                session,
                cluster=cluster,
                operation=OPERATION,
                token=client_token,
                parameters=parameters,
                now=now,
                mismatch=ValidationException,
            )
            if earlier is not None:
                return self._replayed(cluster, earlier.result)
            if not cluster.extra.continuous:
                raise ValidationException(
                    f"BatchAddClusterNodes is supported only for clusters whose NodeProvisioningMode is "
                    f"Continuous; cluster '{cluster.name}' is not: use UpdateCluster."
                )
            live = sum(1 for n in cluster.nodes if n.status != NodeStatus.SHUTTING_DOWN)
            cluster_rules.check_instance_limit(live + total, self.max_instances)
            groups = {g.name: g for g in cluster.instance_groups}
            current = operations.live_counts(session, cluster)
            original = {g.name: g.target_count for g in cluster.instance_groups}
            grown: dict[str, InstanceGroup] = {}
            added: list[str] = []
            for spec in nodes_to_add:
                group = groups.get(spec.instance_group_name)
                refusal = self._refusal(cluster, group, spec)
                if refusal is not None:
                    failed.append(refusal)
                    continue
                assert group is not None
                for _ in range(spec.increment_target_count_by):
                    node = new_node(
                        session, cluster, group, now, ids=self.ids, ready_delay_s=0, addresses=self.addresses
                    )
                    node.pending_action = LAUNCH
                    added.append(node.id)
                    successful.append(
                        NodeAdditionResult(
                            node_logical_id=node.logical_id,
                            instance_group_name=group.name,
                            status=node.status,
                            availability_zones=[f"{self.region}a"],
                            instance_types=[node.instance_type],
                        )
                    )
                grown[group.name] = group
                group.target_count += spec.increment_target_count_by
                group.spec = group.spec.model_copy(update={"instance_count": group.target_count})
                events.record(
                    session,
                    ids=self.ids,
                    now=now,
                    cluster=cluster,
                    group_name=group.name,
                    description=f"{spec.increment_target_count_by} nodes added to group {group.name} "
                    f"(BatchAddClusterNodes); its target count is {group.target_count}.",
                )
            result = Additions(successful=successful, failed=failed)
            if successful:
                bump_generation(cluster)  # the replica ring grew
                operations.record_scaling(
                    session,
                    ids=self.ids,
                    now=now,
                    cluster=cluster,
                    requested_by=OPERATION,
                    current=current,
                    original=original,
                    groups=list(grown.values()),
                    node_ids=added,
                )
            client_tokens.remember(
                session,
                cluster=cluster,
                operation=OPERATION,
                token=client_token,
                parameters=parameters,
                result=result.wire(),
                now=now,
            )
        self.on_change()
        return result

    @staticmethod
    def _replayed(cluster: Cluster, remembered: dict[str, Any]) -> Additions:
        """The first request's answer, each node it added with its status now."""
        answered: Additions = Additions.from_wire(remembered)
        status: dict[str, str] = {node.logical_id: node.status for node in cluster.nodes}
        return answered.model_copy(
            update={
                "successful": [
                    entry.model_copy(update={"status": status.get(entry.node_logical_id, "NotFound")})
                    for entry in answered.successful
                ]
            }
        )

    def _refusal(
        self, cluster: Cluster, group: InstanceGroup | None, spec: AddClusterNodeSpecification
    ) -> BatchAddClusterNodesError | None:
        name = spec.instance_group_name

        def failed(code: str, message: str) -> BatchAddClusterNodesError:
            # What the refused entry asked for, as the model's error shape echoes it (an empty
            # list is not echoed).
            return BatchAddClusterNodesError(
                instance_group_name=name,
                error_code=code,
                failed_count=spec.increment_target_count_by,
                message=message,
                instance_types=spec.instance_types or None,
                availability_zones=spec.availability_zones or None,
            )

        if group is None:
            return failed(
                "InstanceGroupNotFound",
                f"Instance group '{name}' does not exist in cluster '{cluster.name}'.",
            )
        if cluster.status not in MUTABLE or group.status not in (
            GroupStatus.IN_SERVICE,
            GroupStatus.UPDATING,
        ):
            return failed(
                "InvalidInstanceGroupStatus",
                f"Instance group '{name}' is {group.status} in a cluster that is {cluster.status}; nodes "
                "can be added only while the cluster is InService.",
            )
        types = spec.instance_types
        allowed = group.spec.instance_types
        if types and not set(types) & set(allowed):
            return failed(
                "IncompatibleInstanceTypes",
                f"Instance group '{name}' runs {', '.join(allowed)}, not {', '.join(types)}.",
            )
        zones = spec.availability_zones
        if zones and f"{self.region}a" not in zones:
            return failed(
                "IncompatibleAvailabilityZones",
                f"Instance group '{name}' places its nodes in {self.region}a (hyperpod-sim has one "
                f"availability zone), not in {', '.join(zones)}.",
            )
        return None
