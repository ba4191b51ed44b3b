"""One batch of nodes named by the caller (BatchDeleteClusterNodes, BatchReboot/
BatchReplaceClusterNodes, MoveClusterNodes): each key once, in the order given, looked up by id or
logical id, refused with an error code and message or acted on, and the answer in one type.

The operation says why a node is refused (``refuse``) and what happens to one that is not
(``act``); this module does the rest alike for all of them. A node named twice, by id and by
logical id, is looked at twice: the second time it is refused if the first act made it so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hyperpod_sim.models import Node

NODE_IDS = "NodeIds"
NODE_LOGICAL_IDS = "NodeLogicalIds"
_ATTRIBUTE = {NODE_IDS: "id", NODE_LOGICAL_IDS: "logical_id"}

# Why a node (None: no node has the key) cannot be acted on: (the model's error code, message).
Refuse = Callable[[Node | None, str], tuple[str, str] | None]
Act = Callable[[Node], None]


@dataclass
class NodeBatch:
    """What a batch did to the nodes named one way (``by``: ``NodeIds``, ``NodeLogicalIds``, or
    ``InstanceCount`` for a move that picked its nodes): the keys acted on, and (key, error code,
    message) of those refused. ``dataclasses.asdict`` of it is what a ClientToken remembers."""

    by: str
    successful: list[str] = field(default_factory=list)
    failed: list[tuple[str, str, str]] = field(default_factory=list)

    @property
    def logical(self) -> bool:
        return self.by == NODE_LOGICAL_IDS

    @classmethod
    def from_stored(cls, stored: dict[str, Any]) -> NodeBatch:
        return cls(
            by=stored["by"],
            successful=list(stored["successful"]),
            failed=[(key, code, message) for key, code, message in stored["failed"]],
        )


def run(nodes: Iterable[Node], keys: Sequence[str] | None, *, by: str, refuse: Refuse, act: Act) -> NodeBatch:
    """Each of ``keys`` once, in order: the node of ``nodes`` it names (``by`` ids or logical ids),
    refused when ``refuse`` says why, else acted on."""
    index = {getattr(node, _ATTRIBUTE[by]): node for node in nodes}
    result = NodeBatch(by=by)
    for key in dict.fromkeys(keys or []):
        node = index.get(key)
        refusal = refuse(node, key)
        if refusal is not None:
            result.failed.append((key, *refusal))
            continue
        assert node is not None  # refuse answers why for a key that names no node
        act(node)
        result.successful.append(key)
    return result


def run_both(
    nodes: Iterable[Node],
    node_ids: Sequence[str] | None,
    node_logical_ids: Sequence[str] | None,
    *,
    refuse: Refuse,
    act: Act,
) -> tuple[NodeBatch, NodeBatch]:
    """The nodes named by id, then those named by logical id (the two halves of a batch's answer)."""
    nodes = list(nodes)
    by_id = run(nodes, node_ids, by=NODE_IDS, refuse=refuse, act=act)
    return by_id, run(nodes, node_logical_ids, by=NODE_LOGICAL_IDS, refuse=refuse, act=act)


def acted_on(nodes: Iterable[Node], *batches: NodeBatch) -> list[Node]:
    """The nodes some batch acted on, in the order of ``nodes``."""
    keys = {(batch.by, key) for batch in batches for key in batch.successful}
    return [
        node for node in nodes if (NODE_IDS, node.id) in keys or (NODE_LOGICAL_IDS, node.logical_id) in keys
    ]
