"""Typed values of the operations that change a cluster's set of nodes: BatchAddClusterNodes (what
a request adds to each group, and what it answers) and MoveClusterNodes (the request, and the
record a moving node keeps until it arrives, ``Node.move``).

The names are botocore's shape names where the value is one of the model's shapes. A
BatchAddClusterNodes answer, a MoveClusterNodes request and ``Node.move`` are stored in these
values' wire shape (a ClientToken's row, domain/client_tokens.py; the Move operation's details;
the nodes table), so rows kept before the values existed read back unchanged.
"""

from __future__ import annotations

from hyperpod_sim.models.values import WireValue


class AddClusterNodeSpecification(WireValue):
    """One entry of BatchAddClusterNodes' ``NodesToAdd``: how many nodes one group gains, and the
    instance types and zones they may have (none: the group's)."""

    instance_group_name: str
    increment_target_count_by: int
    availability_zones: list[str] | None = None
    instance_types: list[str] | None = None


class NodeAdditionResult(WireValue):
    """A node BatchAddClusterNodes added (``Successful``), with its status when it was answered."""

    node_logical_id: str
    instance_group_name: str
    status: str
    availability_zones: list[str]
    instance_types: list[str]


class BatchAddClusterNodesError(WireValue):
    """A ``NodesToAdd`` entry that added nothing (``Failed``); the types and zones it asked for are
    echoed when it named some (the model's error shape carries them)."""

    instance_group_name: str
    error_code: str
    failed_count: int
    message: str
    instance_types: list[str] | None = None
    availability_zones: list[str] | None = None


class Additions(WireValue):
    """BatchAddClusterNodes' answer, as it is returned and as its ClientToken keeps it."""

    successful: list[NodeAdditionResult] = []
    failed: list[BatchAddClusterNodesError] = []


class MoveRequest(WireValue):
    """A MoveClusterNodes request less its ClientToken: the parameters a retry with the same token
    must repeat, and those the source cluster's Move operation keeps. Exactly one of
    ``node_ids``, ``node_logical_ids`` and ``instance_count`` names the nodes (the domain says so
    when a request breaks that)."""

    source_cluster_arn: str
    source_instance_group_name: str
    target_cluster_arn: str
    target_instance_group_name: str
    node_ids: list[str] | None = None
    node_logical_ids: list[str] | None = None
    instance_count: int | None = None


class NodeMove(WireValue):
    """Where a moving node goes and whence (``Node.move``), kept until it runs in its target group:
    the reconciler hands it off (domain/node_operations/move.py ``hand_off``) by these ids and names."""

    source_cluster_id: str
    source_group: str
    target_cluster_id: str
    target_group: str
