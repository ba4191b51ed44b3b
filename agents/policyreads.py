"""The memory and S3 tiers' reads of the node policy, in one place (until the policy is a typed model
that they read by attribute)."""

from __future__ import annotations

from typing import Any

Policy = dict[str, Any]


def peer_ids(policy: Policy | None) -> list[str]:
    """The node ids of this node's replica peers, in the policy's order."""
    return [p["node_id"] for p in ((policy or {}).get("replication") or {}).get("peers", [])]


def tiered_storage_on(policy: Policy | None) -> bool:
    return bool(((policy or {}).get("tiered_storage") or {}).get("enabled"))


def memory_budget_bytes(policy: Policy | None) -> int:
    return int((policy or {}).get("memory_budget_bytes") or 0)


def s3_member(policy: Policy | None) -> Any:
    """The policy's ``s3`` member (None: no S3 persistence)."""
    return (policy or {}).get("s3")


def s3_faults(policy: Policy | None) -> Any:
    """The S3 faults injected on this node (the policy's ``faults.s3``)."""
    return ((policy or {}).get("faults") or {}).get("s3")
