"""BatchAddClusterNodes: more nodes in instance groups of a cluster with ``NodeProvisioningMode:
Continuous``, each answered with its ``NodeLogicalId`` at once (the model: "a safer alternative to
UpdateCluster for scaling operations").

The nodes are made in the request's transaction (Pending, with their logical ids, the group's
target count raised by as many); the reconciler starts their agents (``node_operations.LAUNCH``).
The cluster stays InService: in continuous provisioning nodes come and go without a cluster update.
A request that adds nodes records a ``Scaling`` operation over the groups it grew (their counts
before and the targets after), Done once none of its nodes is Pending (domain/operations.py).
Per group, what cannot be added is answered in ``Failed`` with the model's error codes.

``ClientToken`` (domain/client_tokens.py): a retry with the same token and NodesToAdd within 8
hours adds nothing and answers the first request's ``Successful`` and ``Failed``, each added
node with its status now (``NotFound`` once it is gone); the same token with other NodesToAdd is
a ValidationException (the model lists no error of its own for it: ResourceNotFound and
ResourceLimitExceeded only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hyperpod_sim.domain import client_tokens, cluster_rules, events, operations
from hyperpod_sim.domain.clock import Clock, Ids
from hyperpod_sim.domain.cluster_reads import locked_cluster
from hyperpod_sim.domain.errors import ValidationException
from hyperpod_sim.domain.lifecycle import MUTABLE, GroupStatus, NodeStatus, bump_generation
from hyperpod_sim.domain.node_operations import LAUNCH
from hyperpod_sim.domain.nodes import new_node
from hyperpod_sim.models import Cluster, Database, InstanceGroup

MAX_NODES_PER_REQUEST = 50
OPERATION = "BatchAddClusterNodes"


@dataclass
class Additions:
    successful: list[dict[str, Any]] = field(default_factory=list)
    failed: list[dict[str, Any]] = field(default_factory=list)


class AddNodesService:
    """Keyword-only arguments; raise AwsError subclasses; no HTTP."""

    def __init__(
        self,
        *,
        db: Database,
        clock: Clock,
        ids: Ids,
        region: str,
        max_instances: int,
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.db = db
        self.clock = clock
        self.ids = ids
        self.region = region
        self.max_instances = max_instances
        self.on_change = on_change

    def batch_add(
        self, *, name: str, nodes_to_add: list[dict[str, Any]], client_token: str | None = None
    ) -> Additions:
        total = sum(spec["IncrementTargetCountBy"] for spec in nodes_to_add)
        if total > MAX_NODES_PER_REQUEST:
            raise ValidationException(
                f"NodesToAdd adds {total} nodes; at most {MAX_NODES_PER_REQUEST} can be added in one request."
            )
        result = Additions()
        with self.db.write() as session:
            cluster = locked_cluster(session, name)
            now = self.clock.now()
            parameters = {"NodesToAdd": nodes_to_add}
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
            if cluster.extra.get("NodeProvisioningMode") != "Continuous":
                raise ValidationException(
                    f"BatchAddClusterNodes is supported only for clusters whose NodeProvisioningMode is "
                    f"Continuous; cluster '{cluster.name}' is not: use UpdateCluster."
                )
            live = sum(1 for n in cluster.nodes if n.status != NodeStatus.SHUTTING_DOWN)
            cluster_rules.check_instance_limit(live + total, self.max_instances)
            groups = {g.name: g for g in cluster.instance_groups}
            current = operations.live_counts(cluster)
            original = {g.name: g.target_count for g in cluster.instance_groups}
            grown: dict[str, InstanceGroup] = {}
            added: list[str] = []
            for spec in nodes_to_add:
                group = groups.get(spec["InstanceGroupName"])
                refusal = self._refusal(cluster, group, spec)
                if refusal is not None:
                    result.failed.append(refusal)
                    continue
                assert group is not None
                for _ in range(spec["IncrementTargetCountBy"]):
                    node = new_node(session, cluster, group, now, ids=self.ids, ready_delay_s=0)
                    node.pending_action = LAUNCH
                    added.append(node.id)
                    result.successful.append(
                        {
                            "NodeLogicalId": node.logical_id,
                            "InstanceGroupName": group.name,
                            "Status": node.status,
                            "AvailabilityZones": [f"{self.region}a"],
                            "InstanceTypes": [node.instance_type],
                        }
                    )
                grown[group.name] = group
                group.target_count += spec["IncrementTargetCountBy"]
                group.spec = {**group.spec, "InstanceCount": group.target_count}
                events.record(
                    session,
                    ids=self.ids,
                    now=now,
                    cluster=cluster,
                    group_name=group.name,
                    description=f"{spec['IncrementTargetCountBy']} nodes added to group {group.name} "
                    f"(BatchAddClusterNodes); its target count is {group.target_count}.",
                )
            if result.successful:
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
                result={"Successful": result.successful, "Failed": result.failed},
                now=now,
            )
        self.on_change()
        return result

    @staticmethod
    def _replayed(cluster: Cluster, answered: dict[str, Any]) -> Additions:
        """The first request's answer, each node it added with its status now."""
        status: dict[str, str] = {node.logical_id: node.status for node in cluster.nodes}

        def now_of(entry: dict[str, Any]) -> dict[str, Any]:
            return {**entry, "Status": status.get(entry["NodeLogicalId"], "NotFound")}

        return Additions(
            successful=[now_of(entry) for entry in answered["Successful"]], failed=list(answered["Failed"])
        )

    def _refusal(
        self, cluster: Cluster, group: InstanceGroup | None, spec: dict[str, Any]
    ) -> dict[str, Any] | None:
        name = spec["InstanceGroupName"]
        count = spec["IncrementTargetCountBy"]

        def failed(code: str, message: str) -> dict[str, Any]:
            entry = {"InstanceGroupName": name, "ErrorCode": code, "FailedCount": count, "Message": message}
            # What the refused entry asked for, as the model's error shape echoes it.
            entry.update({key: spec[key] for key in ("InstanceTypes", "AvailabilityZones") if spec.get(key)})
            return entry

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
        types = spec.get("InstanceTypes")
        allowed = (group.spec.get("InstanceRequirements") or {}).get("InstanceTypes") or [group.instance_type]
        if types and not set(types) & set(allowed):
            return failed(
                "IncompatibleInstanceTypes",
                f"Instance group '{name}' runs {', '.join(allowed)}, not {', '.join(types)}.",
            )
        zones = spec.get("AvailabilityZones")
        if zones and f"{self.region}a" not in zones:
            return failed(
                "IncompatibleAvailabilityZones",
                f"Instance group '{name}' places its nodes in {self.region}a (hyperpod-sim has one "
                f"availability zone), not in {', '.join(zones)}.",
            )
        return None
